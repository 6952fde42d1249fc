"""`ray.experimental.state`: what verl imports of it."""
