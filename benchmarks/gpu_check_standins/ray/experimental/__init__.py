"""`ray.experimental`: what verl imports of it."""
