"""`ray.util.placement_group`: imported by `verl.single_controller.ray.base`."""

from ray import absent


class PlacementGroup:
    pass


placement_group = absent("util.placement_group.placement_group")
