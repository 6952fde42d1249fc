"""`ray.experimental.state.api`: imported by `verl.single_controller.ray.base`."""

from ray import absent

get_actor = absent("experimental.state.api.get_actor")
