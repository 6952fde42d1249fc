"""`ray.util.scheduling_strategies`: imported by `verl.single_controller.ray.base`."""


class NodeAffinitySchedulingStrategy:
    pass


class PlacementGroupSchedulingStrategy:
    pass
