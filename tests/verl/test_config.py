"""The `odc` backend from verl's command line: entry point, hydra configs and config validation.

Everything here runs verl's real hydra config (`verl/trainer/config/ppo_trainer.yaml`) through hydra's
compose API, then the checks `python -m verl.trainer.main_ppo` runs before it starts Ray
(`auto_set_device` + `validate_config`), then the conversions to dataclasses the workers do.

The ODC configs are found through `hydra.searchpath`: `pkg://odc_plugin.configs` once the package
ships them, else the repository's `configs/` directory (see `test_configs_ship_in_the_package`).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPEngineConfig
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from odc_plugin.verl import ppo_config
from odc_plugin.verl.config import ODCEngineConfig
from odc_plugin.verl.engine import ODCEngineWithLMHead, ODCEngineWithValueHead

REPO = Path(__file__).resolve().parents[2]
PACKAGED = importlib.util.find_spec("odc_plugin.configs") is not None
SEARCHPATH = "pkg://odc_plugin.configs" if PACKAGED else (REPO / "configs").as_uri()
ODC = [f"hydra.searchpath=[{SEARCHPATH}]", "model_engine=odc"]
ODC_KEYS = [f.name for f in fields(ODCEngineConfig) if f.name.startswith("odc_")]
EXAMPLES = sorted((REPO / "examples").glob("grpo_*.sh"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small PPO run with a reference model and a critic, valid for verl's checks.

    The critic's model config is built from its path (HF config only, no weights, no tokenizer).
    """
    from transformers import Qwen2Config

    model_dir = tmp_path_factory.mktemp("model")
    Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(model_dir)
    return [
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8",
        "actor_rollout_ref.model.path=" + str(model_dir),
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "critic.enable=True",
        "critic.ppo_mini_batch_size=4",
        "critic.use_dynamic_bsz=True",
        "critic.model.path=" + str(model_dir),
        "+critic.model.load_tokenizer=False",
    ]


compose_ppo, validate = ppo_config.compose, ppo_config.check


def role_configs(cfg):
    """The actor, reference and critic role configs as the workers build them (`init_model`, `_setup`)."""
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref_cfg = OmegaConf.create(OmegaConf.to_container(cfg.actor_rollout_ref, resolve=True)).ref
    with open_dict(ref_cfg):
        ref_cfg.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref_cfg.ppo_micro_batch_size = ref_cfg.pop("log_prob_micro_batch_size", None)
        ref_cfg.ppo_micro_batch_size_per_gpu = ref_cfg.pop("log_prob_micro_batch_size_per_gpu", None)
        ref_cfg.use_dynamic_bsz = ref_cfg.pop("log_prob_use_dynamic_bsz", False)
        ref_cfg.ppo_max_token_len_per_gpu = ref_cfg.pop("log_prob_max_token_len_per_gpu", None)
    ref = omega_conf_to_dataclass(ref_cfg)
    critic = omega_conf_to_dataclass(cfg.critic)
    return {"actor": actor, "ref": ref, "critic": critic}


def odc_error(exc: BaseException) -> BaseException:
    """The error ODC raised: hydra's `instantiate` wraps it (`InstantiationException`, message
    "Error in call to target '...':\\n<repr of the error>\\nfull_key: <config path>"), chained as the cause."""
    while type(exc).__name__ == "InstantiationException" and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


# ---------------------------------------------------------------------------------------------
# entry point


def test_import_verl_alone_registers_odc(tmp_path):
    """verl loads our `verl.plugins` entry point by itself; nothing else is imported first."""
    code = (
        "import sys, verl\n"
        "from verl.workers.engine import EngineRegistry\n"
        "for model_type in ('language_model', 'value_model'):\n"
        "    cls = EngineRegistry.get_engine_cls(model_type, 'odc')\n"
        "    print(model_type, cls.__module__ + '.' + cls.__qualname__)\n"
        "print('plugin', 'odc_plugin.verl.plugin' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (
        "`import verl` did not register backend odc: is the `verl.plugins` entry point installed "
        f"(pip install -e .)?\n{proc.stderr[-3000:]}"
    )
    lines = proc.stdout.splitlines()
    assert "language_model odc_plugin.verl.engine.ODCEngineWithLMHead" in lines
    assert "value_model odc_plugin.verl.engine.ODCEngineWithValueHead" in lines
    assert "plugin True" in lines


# ---------------------------------------------------------------------------------------------
# strategy=odc alone: verl's own FSDP configs, ODC defaults


def test_strategy_odc_alone_passes_validation(base):
    cfg = compose_ppo(base + ["actor_rollout_ref.actor.strategy=odc", "critic.strategy=odc"])
    validate(cfg)
    roles = role_configs(cfg)
    for name, role in roles.items():
        assert role.strategy == "odc", name
        assert type(role.engine) is FSDPEngineConfig, name
        assert role.engine.strategy == "odc", name
    assert roles["ref"].engine.forward_only
    assert EngineRegistry.get_engine_cls("language_model", roles["actor"].engine.strategy) is ODCEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", roles["critic"].engine.strategy) is ODCEngineWithValueHead


# ---------------------------------------------------------------------------------------------
# model_engine=odc: ODC engine configs with options


def test_model_engine_odc_sets_options_per_role(base):
    cfg = compose_ppo(
        base
        + ODC
        + [
            "actor_rollout_ref.actor.fsdp_config.odc_transport=shm",
            "actor_rollout_ref.actor.fsdp_config.odc_cost_model=fit",
            "actor_rollout_ref.actor.fsdp_config.odc_cost_fit_a=0.5",
            "actor_rollout_ref.ref.fsdp_config.odc_barrier_timeout_s=30",
            "critic.fsdp.odc_balancer=lb_micro",
        ]
    )
    validate(cfg)
    roles = role_configs(cfg)
    for name, role in roles.items():
        assert role.strategy == "odc", name
        assert type(role.engine) is ODCEngineConfig, name
        assert role.engine.strategy == "odc", name
    actor, ref, critic = roles["actor"].engine, roles["ref"].engine, roles["critic"].engine
    assert (actor.odc_transport, actor.odc_cost_model, actor.odc_cost_fit_a) == ("shm", "fit", 0.5)
    assert ref.odc_barrier_timeout_s == 30.0 and ref.forward_only and ref.odc_transport == "auto"
    assert critic.odc_balancer == "lb_micro" and critic.odc_transport == "auto"
    assert EngineRegistry.get_engine_cls("language_model", actor.strategy) is ODCEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", critic.strategy) is ODCEngineWithValueHead


def test_one_role_on_odc(base):
    cfg = compose_ppo(
        base
        + [
            f"hydra.searchpath=[{SEARCHPATH}]",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "critic=odc_critic",
            "critic.fsdp.odc_transport=shm",
        ]
    )
    validate(cfg)
    roles = role_configs(cfg)
    assert type(roles["critic"].engine) is ODCEngineConfig
    assert (roles["critic"].engine.strategy, roles["critic"].engine.odc_transport) == ("odc", "shm")
    for name in ("actor", "ref"):
        assert type(roles[name].engine) is FSDPEngineConfig and roles[name].engine.strategy == "fsdp2", name


def test_yaml_defaults_are_the_dataclass_defaults(base):
    engine = role_configs(compose_ppo(base + ODC))["actor"].engine
    for key in ODC_KEYS:
        default = next(f.default for f in fields(ODCEngineConfig) if f.name == key)
        assert default is not MISSING
        assert getattr(engine, key) == default, key


def test_model_engine_odc_is_verl_dp_plus_odc_options(base):
    """The odc role configs add the ODC options to verl's dp role configs and change nothing else."""
    dp = compose_ppo(base + ["actor_rollout_ref.actor.strategy=odc", "critic.strategy=odc"])
    odc = compose_ppo(base + ODC)
    for role, engine_key in (
        ("actor_rollout_ref.actor", "fsdp_config"),
        ("actor_rollout_ref.ref", "fsdp_config"),
        ("critic", "fsdp"),
    ):
        want = OmegaConf.to_container(OmegaConf.select(dp, role))
        got = OmegaConf.to_container(OmegaConf.select(odc, role))
        engine = got[engine_key]
        assert engine.pop("_target_") == "odc_plugin.verl.config.ODCEngineConfig"
        assert engine.pop("strategy") == "odc"
        assert sorted(k for k in engine if k.startswith("odc_")) == sorted(ODC_KEYS)
        for key in ODC_KEYS:
            engine.pop(key)
        want[engine_key].pop("_target_")
        want[engine_key].pop("strategy")
        assert got == want, role


def test_engine_odc_option_in_a_role_config_of_your_own(base, tmp_path):
    """engine/odc.yaml is an option of verl's `engine` group, for role configs that pick their engine."""
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "my_actor.yaml").write_text(
        "defaults:\n"
        "  - ../optim@optim: fsdp\n"
        "  - ../engine@fsdp_config: odc\n"
        "  - actor\n"
        "  - _self_\n"
        "_target_: verl.workers.config.FSDPActorConfig\n"
        "strategy: odc\n"
    )
    cfg = compose_ppo(
        base
        + [
            f"hydra.searchpath=[{SEARCHPATH},{tmp_path.as_uri()}]",
            "actor@actor_rollout_ref.actor=my_actor",
            "actor_rollout_ref.actor.fsdp_config.odc_transport=shm",
        ]
    )
    validate(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor.engine) is ODCEngineConfig
    assert (actor.engine.strategy, actor.engine.odc_transport) == ("odc", "shm")
    # everything else is verl's engine/fsdp.yaml
    stock = OmegaConf.to_container(compose_ppo(base).actor_rollout_ref.actor.fsdp_config, resolve=True)
    mine = OmegaConf.to_container(cfg.actor_rollout_ref.actor.fsdp_config, resolve=True)
    assert {k: v for k, v in mine.items() if k in stock and k not in ("_target_", "strategy")} == {
        k: v for k, v in stock.items() if k not in ("_target_", "strategy")
    }


# ---------------------------------------------------------------------------------------------
# wrong ODC options fail with one line naming the key


@pytest.mark.parametrize(
    "override, key",
    [
        ("actor_rollout_ref.actor.fsdp_config.odc_transport=tcp", "odc_transport"),
        ("actor_rollout_ref.actor.fsdp_config.odc_balancer=x", "odc_balancer"),
        ("actor_rollout_ref.actor.fsdp_config.odc_barrier_timeout_s=0", "odc_barrier_timeout_s"),
        ("+actor_rollout_ref.actor.fsdp_config.odc_foo=1", "odc_foo"),
        ("critic.fsdp.odc_cost_model=bytes", "odc_cost_model"),
        # the lockstep baseline runs verl's equal split; LB-Mini's uneven counts cannot move in lockstep
        ("actor_rollout_ref.actor.fsdp_config.odc_lockstep=True", "odc_lockstep"),
        ("actor_rollout_ref.actor.fsdp_config.odc_split=on", "odc_split"),
        ("actor_rollout_ref.actor.fsdp_config.odc_split_bandwidth=0", "odc_split_bandwidth"),
        ("critic.fsdp.odc_split_latency_s=-2e-05", "odc_split_latency_s"),
        ("actor_rollout_ref.actor.fsdp_config.odc_split_latency_s=fast", "odc_split_latency_s"),
        # bytes/s: a figure in GB/s is refused, not planned with at a billionth of the link
        ("actor_rollout_ref.actor.fsdp_config.odc_split_bandwidth=360", "odc_split_bandwidth"),
    ],
)
def test_wrong_option_fails_validation_naming_the_key(base, override, key):
    cfg = compose_ppo(base + ODC + [override])
    with pytest.raises(Exception) as info:
        validate(cfg)
    # hydra's wrapper names the config path on its last line and repeats ODC's error on the second
    wrapper = str(info.value)
    assert key in wrapper
    assert wrapper.splitlines()[-1] == "full_key: " + override.lstrip("+").split("=")[0].rsplit(".", 1)[0]
    error = odc_error(info.value)
    assert isinstance(error, (ValueError, TypeError))
    message = str(error)
    assert len(message.splitlines()) == 1 and key in message, message


def test_measured_all_to_all_settings_as_odc_check_prints_them_reach_the_engine_config(base):
    """odc-check prints `odc_split_bandwidth=8.292e+08 odc_split_latency_s=1.042e-03`: as overrides they
    compose, pass verl's checks and reach every role's engine config as numbers; unset, they are None
    (the planner's modelled figures)."""
    cfg = compose_ppo(
        base
        + ODC
        + [
            "actor_rollout_ref.actor.fsdp_config.odc_split_bandwidth=8.292e+08",
            "actor_rollout_ref.actor.fsdp_config.odc_split_latency_s=1.042e-03",
            "critic.fsdp.odc_split_bandwidth=360000000000",
        ]
    )
    validate(cfg)
    roles = role_configs(cfg)
    actor, critic, ref = (roles[name].engine for name in ("actor", "critic", "ref"))
    assert (actor.odc_split_bandwidth, actor.odc_split_latency_s) == (8.292e08, 1.042e-03)
    assert (critic.odc_split_bandwidth, critic.odc_split_latency_s) == (360e9, None)
    assert (ref.odc_split_bandwidth, ref.odc_split_latency_s) == (None, None)


def test_verls_ulysses_group_and_the_split_are_refused_together_in_one_line():
    """verl's Ulysses fixes one group for every micro-batch; odc_split picks one per micro-batch (SFT's
    engine config holds both; main_ppo refuses odc_split itself: test_trainer_choice.py)."""
    with pytest.raises(ValueError) as info:
        ODCEngineConfig(odc_split="auto", ulysses_sequence_parallel_size=2)
    assert str(info.value) == (
        "odc_split=auto plans each micro-batch's sequence-parallel group itself: it needs odc_balancer=lb_mini and "
        "ulysses_sequence_parallel_size=1, got 'lb_mini' and 2"
    )


def test_wrong_ref_option_fails_when_the_ref_model_is_built(base):
    """verl's validation does not look at the reference model; the worker's conversion does."""
    cfg = compose_ppo(base + ODC + ["actor_rollout_ref.ref.fsdp_config.odc_transport=tcp"])
    validate(cfg)
    with pytest.raises(Exception) as info:
        role_configs(cfg)
    message = str(odc_error(info.value))
    assert len(message.splitlines()) == 1 and "odc_transport" in message and "'tcp'" in message


def test_unknown_option_without_plus_fails_at_compose_naming_the_key(base):
    with pytest.raises(Exception) as info:
        compose_ppo(base + ODC + ["actor_rollout_ref.actor.fsdp_config.odc_foo=1"])
    assert "actor_rollout_ref.actor.fsdp_config.odc_foo" in str(info.value).splitlines()[0]


# ---------------------------------------------------------------------------------------------
# fsdp2 back: stock verl


def test_fsdp2_is_stock_verl(base):
    # the ODC search path may stay: without model_engine=odc nothing of ours is used
    cfg = compose_ppo(
        base + [f"hydra.searchpath=[{SEARCHPATH}]", "actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2"]
    )
    validate(cfg)
    for name, role in role_configs(cfg).items():
        assert type(role.engine) is FSDPEngineConfig, name
        assert role.engine.strategy == "fsdp2", name
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is FSDPEngineWithValueHead


# ---------------------------------------------------------------------------------------------
# packaging and examples


def test_configs_ship_in_the_package():
    """`hydra.searchpath=[pkg://odc_plugin.configs]` needs `configs/` installed as `odc_plugin.configs`."""
    assert PACKAGED, (
        "odc_plugin.configs is not importable: map configs/ to odc_plugin.configs in "
        "pyproject.toml ([tool.setuptools] package-dir / packages / package-data) and reinstall"
    )
    from importlib.resources import files

    root = files("odc_plugin.configs")
    for name in (
        "engine/odc.yaml",
        "model_engine/odc.yaml",
        "actor/odc_actor.yaml",
        "ref/odc_ref.yaml",
        "critic/odc_critic.yaml",
        "odc_options/engine.yaml",
    ):
        assert root.joinpath(name).is_file(), name


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("strategy", ["fsdp2", "odc"])
def test_example_command_passes_validation(script, strategy, tmp_path):
    """Each example's main_ppo command line (DRY_RUN=1 prints it, then the planner's prediction under a
    `# odc-plan` line) composes and passes verl's checks."""
    env = dict(os.environ, DRY_RUN="1", STRATEGY=strategy, ODC_CONFIGS=SEARCHPATH, OUT_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.splitlines()
    start = args.index("verl.trainer.main_ppo") + 1
    overrides = list(itertools.takewhile(lambda arg: not arg.startswith("# odc-plan"), args[start:]))
    cfg = compose_ppo(overrides)
    validate(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.engine.strategy == strategy
    assert type(actor.engine) is (ODCEngineConfig if strategy == "odc" else FSDPEngineConfig)
    assert "file" in cfg.trainer.logger
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.rollout.name == "vllm"


@pytest.mark.parametrize("config_class", ["odc_plugin.verl.config.ODCEngineConfig", "odc_plugin.fsdp.odc.ODCConfig"])
def test_odc_configs_are_keyword_only_with_a_docstring_per_field(config_class):
    """torchtitan's style: choices as Literal types (checked from the annotation, the error naming the key),
    keyword-only fields, each documented where it is declared."""
    import ast
    import importlib
    import inspect
    import textwrap
    import typing

    module, name = config_class.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    own = list(cls.__annotations__)
    assert all(f.kw_only for f in fields(cls) if f.name in own)
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            after = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(after, ast.Expr) and isinstance(after.value.value, str), f"{node.target.id}: no docstring"
    literals = [n for n, hint in cls.__annotations__.items() if typing.get_origin(hint) is typing.Literal]
    if cls is ODCEngineConfig:
        assert literals == [
            "strategy",
            "odc_transport",
            "odc_accumulate",
            "odc_balancer",
            "odc_cost_model",
            "odc_split",
        ]
