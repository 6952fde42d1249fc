"""SPES across real node processes (gloo): what a sync leaves on every node, what it moves, and that
with H = 1 each mode is the single-process math it claims to be."""

from __future__ import annotations

import time

import pytest
import torch

from odc_plugin.launch import RankFailed, run_ranks
from odc_plugin.spes import SPESConfig, assign_experts, merge_alpha, merge_experts, moe_layers, split_experts
from odc_plugin.spes.models import build_olmoe, lm_loss
from odc_plugin.spes.sync import allreduce_bytes

from . import workers

# a sync every 2 steps and a merge every 2nd sync, its weight halving over 8 steps, to the 2 nearest experts
MERGING = dict(sync_every=2, merge_interval=4, merge_alpha_start=0.5, merge_decay_steps=8, merge_topk=2)


def expert_of(name: str) -> int | None:
    return int(name.rsplit(".", 1)[1]) if ".mlp.experts." in name else None


def reference_model():
    return split_experts(build_olmoe("test", seed=0))


def shared_and_expert_bytes() -> tuple[int, int]:
    sizes = {"shared": 0, "experts": 0}
    for name, p in reference_model().named_parameters():
        sizes["experts" if expert_of(name) is not None else "shared"] += p.numel() * 4
    return sizes["shared"], sizes["experts"]


class ReferenceOuter:
    """The outer step in one process on whole tensors: SGD over the weights of the last sync, the first
    being every node's initial weights."""

    def __init__(self, config: SPESConfig):
        self.anchor = {n: p.detach().clone() for n, p in reference_model().named_parameters()}
        self.optimizer = torch.optim.SGD(
            list(self.anchor.values()), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=True
        )

    def step(self, synced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, anchor in self.anchor.items():
            anchor.grad = anchor - synced[name]
        self.optimizer.step()
        return {n: a.clone() for n, a in self.anchor.items()}

    def reset_anchor(self, params: dict[str, torch.Tensor]) -> None:
        for name, anchor in self.anchor.items():
            anchor.copy_(params[name])


def expected_after_sync(befores: list[dict], config: SPESConfig, step: int, outer: ReferenceOuter | None) -> dict:
    """Shared parameters (in fedavg: all): the mean of the nodes' copies; experts in spes: their owner's
    copy; then the outer step and the merge, done in one process on whole tensors."""
    nodes = len(befores)
    num_experts = moe_layers(reference_model())[0].num_experts
    expected = {}
    for name in befores[0]:
        e = expert_of(name)
        if e is None or config.mode == "fedavg":
            expected[name] = torch.stack([b[name] for b in befores]).mean(0)
        else:
            owner = next(q for q in range(nodes) if e in assign_experts(num_experts, nodes, q))
            expected[name] = befores[owner][name]
    if outer:
        expected = outer.step(expected)
    alpha = merge_alpha(step, config)
    if alpha > 0:
        model = reference_model()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(expected[name])
        merge_experts(moe_layers(model), alpha, config.merge_topk)
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    if outer:
        outer.reset_anchor(expected)
    return expected


def check_syncs(results, config: SPESConfig, nodes: int, ranks_per_node: int):
    """Every node holds the same model right after each sync, the one the reference computes."""
    heads = [r for r in results if "before" in r["syncs"][0]]  # local rank 0 of each node, in node order
    assert [h["node"] for h in heads] == list(range(nodes))
    shared_bytes, expert_bytes = shared_and_expert_bytes()
    if config.mode == "fedavg":
        per_sync = allreduce_bytes(shared_bytes + expert_bytes, nodes)
    else:
        per_sync = allreduce_bytes(shared_bytes, nodes) + (nodes - 1) * expert_bytes // nodes
    outer = ReferenceOuter(config) if config.outer else None
    for i, sync in enumerate(heads[0]["syncs"]):
        step = sync["record"].step
        expected = expected_after_sync([h["syncs"][i]["before"] for h in heads], config, step, outer)
        for h in heads:
            after = h["syncs"][i]["after"]
            for name, want in expected.items():
                assert torch.equal(after[name], heads[0]["syncs"][i]["after"][name]), (step, h["node"], name)
                if not outer and (expert_of(name) is not None or nodes == 2):  # a mean of two is exact
                    assert torch.equal(after[name], want), (step, name)
                else:  # the ring sums in its own order; the outer step runs on flat buffers
                    torch.testing.assert_close(after[name], want, rtol=1e-5, atol=1e-6)
        for node in range(nodes):
            ranks = results[node * ranks_per_node : (node + 1) * ranks_per_node]
            assert sum(r["syncs"][i]["record"].sent for r in ranks) == per_sync
            assert sum(r["syncs"][i]["record"].received for r in ranks) == per_sync


def check_frozen(results, nodes: int, ranks_per_node: int):
    shared_bytes, expert_bytes = shared_and_expert_bytes()
    for node in range(nodes):
        ranks = results[node * ranks_per_node : (node + 1) * ranks_per_node]
        assert all(r["frozen_grads"] == 0 and r["frozen_opt_state"] == 0 for r in ranks)
        # what the node trains: the shared parameters and its own experts, nothing else
        assert sum(r["trainable"] for r in ranks) * 4 == shared_bytes + expert_bytes // nodes
        for r in ranks:
            state = r["state"]
            assert state.counted == r["trainable"] * 4 * 4  # param, grad, two Adam moments
            # plus one 4-byte step counter per trained tensor and nothing for frozen ones
            assert state.measured == state.counted + 4 * r["opt_state_params"]


def test_four_nodes_sync_invariants_bytes_and_frozen_experts():
    config = SPESConfig(**MERGING, outer_optimizer="none", sync_timeout_s=60)
    results = run_ranks(workers.train_and_sync, 4, 1, "none", config, 4)
    assert [r["syncs"][i]["record"].merge_alpha for r in results[:1] for i in range(2)] == [0.0, 0.25]
    check_syncs(results, config, nodes=4, ranks_per_node=1)
    check_frozen(results, nodes=4, ranks_per_node=1)


def test_the_outer_step_is_applied_alike_on_every_node():
    """Nesterov over the pseudo-gradient in spes (with a merge) and fedavg: after every sync each node
    holds the same weights, those of the one-process reference, which differ from the plain average."""
    configs = [SPESConfig(**MERGING, mode=mode, outer_optimizer="nesterov") for mode in ("spes", "fedavg")]
    per_rank = run_ranks(workers.train_and_sync_configs, 4, configs, 6)
    for i, config in enumerate(configs):
        results = [r[i] for r in per_rank]
        check_syncs(results, config, nodes=4, ranks_per_node=1)
        last = results[0]["syncs"][-1]
        plain = expected_after_sync([r["syncs"][-1]["before"] for r in results], config, 6, None)
        assert any(not torch.allclose(last["after"][n], plain[n]) for n in plain)
        # outer state for what the node trains only: its weights at the last sync and their momentum
        assert all(r["state"].outer == 2 * 4 * r["trainable"] for r in results)


def test_two_nodes_of_two_ranks_with_odc_or_fsdp2_inside_train_and_keep_the_invariants():
    config = SPESConfig(**MERGING, outer_optimizer="nesterov", sync_timeout_s=60)
    per_rank = run_ranks(workers.train_and_sync_each, 4, 2, ("odc", "fsdp2"), config, 6)
    for inner in ("odc", "fsdp2"):
        results = [r[inner] for r in per_rank]
        check_syncs(results, config, nodes=2, ranks_per_node=2)
        check_frozen(results, nodes=2, ranks_per_node=2)
        for r in results:
            assert sum(r["losses"][-2:]) < sum(r["losses"][:2]) - 0.2, (inner, r["losses"])


def reference_sgd(mode: str, nodes: int, steps: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """One process: each node's gradient from its own batch, combined as the mode says (the mean; in
    spes an expert's gradient is its owner's alone), then one SGD-with-momentum step."""
    model = reference_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    num_experts = moe_layers(model)[0].num_experts
    snapshots = []
    for step in range(1, steps + 1):
        per_node = []
        for node in range(nodes):
            model.zero_grad(set_to_none=False)
            lm_loss(model, workers.tokens(step, node)).backward()
            per_node.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name, p in model.named_parameters():
            e = expert_of(name)
            if mode == "spes" and e is not None:
                p.grad = per_node[e // (num_experts // nodes)][name]
            else:
                p.grad = torch.stack([g[name] for g in per_node]).mean(0)
        opt.step()
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snapshots


def test_with_h1_each_mode_is_its_single_process_math():
    nodes, steps, lr = 2, 3, 0.05
    results = run_ranks(workers.sgd_every_mode, nodes, steps, lr)
    for mode in ("centralized", "fedavg", "spes"):
        for step, want in enumerate(reference_sgd(mode, nodes, steps, lr)):
            for node in range(nodes):
                got = results[node][mode][step]
                for name in want:
                    torch.testing.assert_close(
                        got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{mode}, step {step + 1}, node {node}: {name}"
                    )


def test_a_node_dying_mid_sync_ends_every_node_with_a_clear_error():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(workers.die_mid_sync, 3, 2, 20.0, failure_grace_s=40)
    message = str(info.value)
    assert time.monotonic() - start < 90
    assert message.startswith("rank 2 failed: exited with code 17"), message
    for node in (0, 1):
        assert (
            f"SPESSyncError: node {node} (local rank 0): spes sync at step 1 failed in the expert exchange" in message
        ), message
