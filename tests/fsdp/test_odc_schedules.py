"""What ODC lets ranks do inside a mini-batch, against single-process math and against stock FSDP2.

Ranks may run any number of micro-batches, zero included, and each micro-batch may touch any subset of
the model's modules (an expert no token is routed to, a tower only some samples use). The update then
equals single-process math over the union of the ranks' data, and a parameter has `.grad` None exactly
where no rank produced a gradient for it. Forward-only mini-batches and plain evaluation forwards run in
between without disturbing either. Stock FSDP2 cannot run such a schedule: its per-module collectives
need every rank to call the same modules the same number of times.
"""

from __future__ import annotations

import pytest
import torch

from odc_plugin.launch import RankFailed, run_ranks

from . import workers


def sample(seed, experts, image=False):
    return workers.routed_sample(seed, experts, image)


EVAL_BATCH = [sample(900, (0, 1, 2), image=True), sample(901, (0,))]  # the same on every rank


def uneven_steps(world_size: int, n_steps: int = 3) -> list[dict]:
    """Rank 0 trains on three micro-batches through experts 0-2; rank 1 on one, with images, so only it
    uses the tower (until the last step, where no rank does); rank 2 has no data. Expert 2 gets tokens
    on rank 0 only, expert 3 on no rank. The forward-only passes are uneven too."""
    steps = []
    for k in range(n_steps):
        s, image = 100 * k, k < n_steps - 1
        train = [
            [[sample(s + 1, (0, 1)), sample(s + 2, (0, 2))], [sample(s + 3, (2,))], [sample(s + 4, (0, 1, 2))]],
            [[sample(s + 5, (0, 1), image), sample(s + 6, (1,), image)]],
            [],
        ]
        score = [[[sample(s + 7, (0,))]], [[sample(s + 8, (1, 2), image)], [sample(s + 9, (0,))]], []]
        steps.append({"train": train[:world_size], "score": score[:world_size]})
    return steps


def even_steps(n_steps: int = 3) -> list[dict]:
    """Two ranks, one micro-batch each, both through the same modules (experts 0 and 2, the tower until
    the last step): a schedule stock FSDP2 can run. Experts 1 and 3 get no token on any rank."""
    steps = []
    for k in range(n_steps):
        s, image = 100 * k, k < n_steps - 1
        steps.append(
            {
                "train": [[[sample(s + 1, (0, 2), image)]], [[sample(s + 2, (0, 2), image)]]],
                "score": [[[sample(s + 3, (0, 2))]], [[sample(s + 4, (0, 2))]]],
            }
        )
    return steps


def reference(steps) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """workers.train_routed in one process over the union of the ranks' data."""
    model = workers.build_routed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    records = []
    for step in steps:
        with torch.no_grad():
            scores = [[model(mb).item() for mb in share] for share in step["score"]]
            evaluation = model(EVAL_BATCH).item()
        opt.zero_grad(set_to_none=True)
        train = [mb for share in step["train"] for mb in share]
        (sum(model(mb) for mb in train) / workers.routed_targets(train)).backward()
        no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        opt.step()
        records.append({"scores": scores, "eval": evaluation, "no_grad": no_grad})
    return {n: p.detach() for n, p in model.named_parameters()}, records


def assert_close_params(got, expected):
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "no-reshard"])
@pytest.mark.parametrize("world_size", [2, 3], ids=["2ranks", "3ranks"])
def test_uneven_counts_and_module_subsets_equal_single_process_math(world_size, reshard_after_forward):
    steps = uneven_steps(world_size)
    per_rank = run_ranks(workers.train_routed, world_size, steps, EVAL_BATCH, True, reshard_after_forward)
    expected_params, expected = reference(steps)
    initial = dict(workers.build_routed().named_parameters())
    for k, want in enumerate(expected):
        # the schedule does what it claims: expert 3 unused everywhere, the tower only in the last step,
        # expert 2 used by rank 0 alone
        assert [n for n in want["no_grad"] if not n.startswith("experts.3.")] == (
            [] if k < len(steps) - 1 else ["tower.0.bias", "tower.0.weight", "tower.2.bias", "tower.2.weight"]
        )
        for rank, (_, records) in enumerate(per_rank):
            got = records[k]
            assert got["no_grad"] == want["no_grad"], (rank, k)
            torch.testing.assert_close(got["scores"], want["scores"][rank], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["eval"], want["eval"], rtol=1e-5, atol=1e-6)
    for params, _ in per_rank:
        assert_close_params(params, expected_params)
        # AdamW never touched the parameters no rank had a gradient for: weight decay would have moved them
        assert torch.equal(params["experts.3.0.weight"], initial["experts.3.0.weight"].detach())


def test_stock_fsdp2_cannot_run_the_uneven_schedule():
    # Short timeouts: a rank waiting for a collective its peer never issues fails in seconds, and the
    # launcher kills whatever still hangs (torch 2.11's FSDP2 can hang past the process-group timeout).
    with pytest.raises(RankFailed):
        run_ranks(
            workers.train_routed, 2, uneven_steps(2), EVAL_BATCH, False, timeout_s=30, pg_timeout_s=5, failure_grace_s=5
        )


def test_bf16_params_with_unused_experts_match_stock_fsdp2():
    """bf16 parameters, fp32 reduce, fully_shard's default resharding (the root stays unsharded after a
    forward): ODC against stock FSDP2 on a schedule stock can run."""
    steps = even_steps()
    odc = run_ranks(workers.train_routed, 2, steps, EVAL_BATCH, True, None, True)
    fsdp = run_ranks(workers.train_routed, 2, steps, EVAL_BATCH, False, None, True)
    for (odc_params, odc_records), (fsdp_params, fsdp_records) in zip(odc, fsdp):
        for got, want in zip(odc_records, fsdp_records):
            assert any(n.startswith("experts.1.") for n in want["no_grad"])
            assert got == want
        assert_close_params(odc_params, fsdp_params)
