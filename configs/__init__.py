"""Hydra configs of the ODC plugin, for `hydra.searchpath=[pkg://odc_plugin.configs]`.

Options added next to verl's own groups (`verl/trainer/config`):

- `model_engine=odc`: actor, reference model and critic on strategy odc with ODC engine configs, like
  verl's `model_engine=megatron`; options per role, e.g. `actor_rollout_ref.actor.fsdp_config.odc_transport=shm`,
  `actor_rollout_ref.ref.fsdp_config.odc_transport=shm`, `critic.fsdp.odc_transport=shm`;
- one role only: `actor@actor_rollout_ref.actor=odc_actor` (with `ref@actor_rollout_ref.ref=odc_ref`),
  `critic=odc_critic`;
- `engine/odc.yaml`: verl's FSDP engine config plus the ODC keys, for role configs of your own
  (`../engine@fsdp_config: odc`);
- `odc_options/engine.yaml`: the ODC keys and their defaults, written once, laid over the above.
"""
