"""`ray.util`: what verl imports of it."""
