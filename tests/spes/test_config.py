"""Bad SPES settings fail at once with one line naming the key."""

from __future__ import annotations

import pytest

from odc_plugin.spes import SPESConfig, assign_experts


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"sync_every": 0}, "sync_every must be an integer >= 1, got 0"),
        ({"sync_every": 2.5}, "sync_every must be an integer >= 1, got 2.5"),
        ({"merge_alpha_start": 1.5}, "merge_alpha_start must be in [0, 1], got 1.5"),
        ({"merge_alpha_start": -0.1}, "merge_alpha_start must be in [0, 1], got -0.1"),
        ({"mode": "diloco"}, "mode must be one of spes, fedavg, centralized, got 'diloco'"),
        ({"merge_interval": 0}, "merge_interval must be an integer >= 1, got 0"),
        ({"merge_decay_steps": -5}, "merge_decay_steps must be an integer >= 1, got -5"),
        ({"merge_topk": 0}, "merge_topk must be an integer >= 1, got 0"),
        ({"sync_timeout_s": 0}, "sync_timeout_s must be > 0, got 0"),
        ({"outer_optimizer": "adam"}, "outer_optimizer must be one of nesterov, none, got 'adam'"),
        ({"outer_lr": 0.0}, "outer_lr must be > 0, got 0.0"),
        ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1), got 1.0"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_key(kwargs, message):
    with pytest.raises(ValueError) as info:
        SPESConfig(**kwargs)
    assert str(info.value) == message


def test_experts_that_do_not_divide_over_the_nodes_are_refused():
    with pytest.raises(ValueError) as info:
        assign_experts(6, 4, 0)
    assert str(info.value) == (
        "num_experts (6) must be divisible by the number of nodes (4): SPES gives every node the same number of experts"
    )
    with pytest.raises(ValueError, match=r"node must be in \[0, 4\), got 4"):
        assign_experts(8, 4, 4)


@pytest.mark.parametrize("experts,nodes", [(8, 4), (8, 2), (6, 3), (4, 1)])
def test_assignment_is_contiguous_disjoint_and_covers_every_expert(experts, nodes):
    owned = [assign_experts(experts, nodes, p) for p in range(nodes)]
    assert [e for r in owned for e in r] == list(range(experts))
    assert all(len(r) == experts // nodes and r.step == 1 for r in owned)
