"""The loss table of docs/verl.md: the loss probe's verdict (odc_plugin/verl/loss_probe.py) on every policy loss of
verl's registry under every `loss_agg_mode`, on the critic's value loss and on every on-policy distillation loss,
as odc packs a role under LB-Mini: with dynamic batch sizes, and with micro-batches of one sample.

    python -m tests.verl.loss_table   # compute it and rewrite it in docs/verl.md

tests/verl/test_loss_probe.py checks that docs/verl.md holds the table this computes.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

from odc_plugin.verl.loss_probe import LOSS_AGG_MODES, ProbeShape, Verdict, probe_actor_loss, probe_critic_loss

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
BEGIN = "<!-- the loss table, written by python -m tests.verl.loss_table -->"
END = "<!-- end of the loss table -->"
# A run's shape like odc-grpo-cpu's (2 ranks, prompts and responses of up to 96 and 64 tokens, dynamic batch sizes),
# with mini-batches of 16 samples to keep the table's 170 probes quick; tests/verl/test_loss_probe.py probes other
# shapes too.
SHAPE = ProbeShape(dp_size=2, samples=16, max_prompt_length=96, max_response_length=64, max_token_len=160)
# micro-batches of one sample, with GRPO's advantages (one per response) and with GAE's (one per token)
ONE_PER_RESPONSE = dataclasses.replace(SHAPE, micro_batch_size=1, max_token_len=None, per_token_advantages=False)
ONE_PER_TOKEN = dataclasses.replace(ONE_PER_RESPONSE, per_token_advantages=True)
FACTOR = 64  # a loss_scale_factor: data.max_response_length
# Columns: (loss_agg_mode, loss_scale_factor, shape, heading).
COLUMNS = [
    *((agg, None, SHAPE, f"`{agg}`") for agg in LOSS_AGG_MODES),
    ("seq-mean-token-sum-norm", FACTOR, SHAPE, "`seq-mean-token-sum-norm` with `loss_scale_factor`"),
    ("token-mean", None, ONE_PER_RESPONSE, "micro-batches of 1, advantages per response (GRPO)"),
    ("token-mean", None, ONE_PER_TOKEN, "micro-batches of 1, advantages per token (GAE)"),
]


def actor_config(loss_mode: str, loss_agg_mode: str = "token-mean", loss_scale_factor=None, **kw):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=4,
        use_dynamic_bsz=True,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        # dro refuses to run without its penalty
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.1),
        **kw,
    )


def distillation_config(loss_mode: str):
    """verl's default distillation settings (distillation.yaml: the task's policy loss beside the distillation
    loss, which is backpropagated directly) with this loss; k1 only as a reward, which is what verl allows."""
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    return DistillationConfig(
        distillation_loss=DistillationLossConfig(
            loss_mode=loss_mode, use_policy_gradient=loss_mode == "k1", loss_max_clamp=None, log_prob_min_clamp=None
        )
    )


def rows() -> list[tuple[str, str, str]]:
    """(kind, loss mode, heading) of every row: verl's registered policy losses, the critic, its distillation
    losses."""
    from verl.trainer.distillation.losses import DISTILLATION_LOSS_REGISTRY
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return [
        *(("policy", mode, f"`{mode}`") for mode in POLICY_LOSS_REGISTRY),
        ("critic", "", "the critic's value loss"),
        *(("distillation", mode, f"distillation `{mode}`") for mode in DISTILLATION_LOSS_REGISTRY),
    ]


@functools.cache
def verdict(kind: str, mode: str, agg: str, factor: int | None, shape: ProbeShape) -> Verdict:
    """The probe's verdict on one cell (cached: the tests probe the same cells)."""
    if kind == "critic":
        from verl.workers.config import FSDPCriticConfig

        config = FSDPCriticConfig(
            strategy="fsdp2", ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg, loss_scale_factor=factor
        )
        return probe_critic_loss(config, shape)
    if kind == "distillation":
        return probe_actor_loss(actor_config("vanilla", agg, factor), shape, distillation=distillation_config(mode))
    return probe_actor_loss(actor_config(mode, agg, factor), shape)


def table() -> str:
    """The table, in markdown: a cell says `same` (the probe finds the update the same as fsdp2's) or `refused`."""
    lines = [
        f"| loss | {' | '.join(heading for *_, heading in COLUMNS)} |",
        f"| --- |{' --- |' * len(COLUMNS)}",
    ]
    for kind, mode, heading in rows():
        cells = []
        for agg, factor, shape, _ in COLUMNS:
            found = verdict(kind, mode, agg, factor, shape)
            cells.append("same" if found.invariant else "refused")
        lines.append(f"| {heading} | {' | '.join(cells)} |")
    return "\n".join(lines)


def documented() -> str:
    """The table docs/verl.md holds, between its markers."""
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main() -> int:
    computed = table()  # minutes: the doc is read after, so that edits made meanwhile stay
    text, old = DOC.read_text(), documented()
    DOC.write_text(f"{text[: text.index(BEGIN) + len(BEGIN)]}\n{computed}\n{text[text.index(END) :]}")
    print(computed)
    print(f"{DOC}: the loss table {'unchanged' if computed == old else 'rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
