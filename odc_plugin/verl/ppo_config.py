"""verl's PPO trainer configuration as `python -m verl.trainer.main_ppo` builds and checks it, without
starting anything: hydra composition of `verl/trainer/config/ppo_trainer.yaml` with command-line
overrides (`hydra.searchpath=...` included), then the checks `main_ppo.main` runs before Ray starts."""

from __future__ import annotations

import os


def compose(overrides: list[str]):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


def check(config) -> None:
    """What `verl.trainer.main_ppo.main` runs on the composed config before Ray starts."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
