"""`ray.actor`: a name in verl's annotations."""


class ActorHandle:
    pass
