"""A rank that waits for a late peer sleeps: with 32 ranks on 2 cores a polling waiter would steal the
time its peers need to get there."""

from odc_plugin.launch import run_ranks

from . import workers


def test_a_rank_blocked_2s_in_odc_waits_uses_under_a_tenth_of_it_in_cpu():
    spent = run_ranks(workers.cpu_while_waiting, 2, 2.0)[0]
    for wait in ("published", "barrier"):
        cpu, wall = spent[wait]
        assert wall > 1.8, (wait, wall)  # it did wait for the late rank
        assert cpu < 0.2, f"{wait}: {cpu:.3f} s of CPU in {wall:.2f} s of waiting"
