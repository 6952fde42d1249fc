"""verl's worker classes as odc runs use them: subclasses with the members `patches/` adds for odc
(odc_patches.odc_subclass), put in place by the odc trainer (trainer.py); a run without odc never
imports this module.

- `ODCTrainingWorker`: the critic's worker group, and the actor's and reference model's inner worker;
  its `train_mini_batch` runs an LB-Mini plan's steps, its `train_mini_batch` and `infer_batch` are
  dispatched by the plan, and the per-rank readings in its metrics agree over ranks.
- `ODCActorRolloutRefWorker`: `update_actor`, `compute_log_prob` and `compute_ref_log_prob` dispatched
  by the plan, with `ODCTrainingWorker` inside.
- `ODCDetachActorWorker`: the same for separate_async's actor worker, which also saves and restores the odc
  actor's weights as fsdp2's (`patches/detach_actor.py`).

Defined at module level, so that Ray sends them to the workers by name.
"""

from __future__ import annotations

from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from odc_patches import odc_subclass

ODCTrainingWorker = odc_subclass("training_worker", TrainingWorker, "ODCTrainingWorker", __name__)
ODCActorRolloutRefWorker, ODCDetachActorWorker = (
    odc_subclass(
        "actor_worker",
        base,
        f"ODC{base.__name__}",
        __name__,
        actor_worker_cls=ODCTrainingWorker,
        ref_worker_cls=ODCTrainingWorker,
    )
    for base in (ActorRolloutRefWorker, DetachActorWorker)
)
# verl's actor-side worker classes, and the odc subclass of each
ACTOR_WORKERS = {ActorRolloutRefWorker: ODCActorRolloutRefWorker, DetachActorWorker: ODCDetachActorWorker}
