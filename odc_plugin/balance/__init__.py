"""LB-Mini: balancing a mini-batch's total work per rank once ODC frees ranks from lockstep.

lb_mini and lb_micro (verl's own behaviour, the baseline) both return, per data-parallel rank, a list
of micro-batches of sample indices; odc_plugin.balance.step_time's model predicts what each is worth
(`odc-plan`, odc_plugin.balance.planner, prints it; plan_report formats it).
"""

from odc_plugin.balance.common import RankPlan, balance_efficiency
from odc_plugin.balance.costs import (
    PRESETS,
    QWEN2_5_PRESETS,
    CostModel,
    FitCost,
    FlopsCost,
    TokenCost,
    VerlFlopsCost,
    get_cost_model,
)
from odc_plugin.balance.lb_micro import lb_micro, verl_rank_partition
from odc_plugin.balance.lb_mini import lb_mini
from odc_plugin.balance.lengths import LengthSample, load_lengths, rl_math_like, sft_long_context_like

__all__ = [
    "PRESETS",
    "QWEN2_5_PRESETS",
    "CostModel",
    "FitCost",
    "FlopsCost",
    "LengthSample",
    "RankPlan",
    "TokenCost",
    "VerlFlopsCost",
    "balance_efficiency",
    "get_cost_model",
    "lb_micro",
    "lb_mini",
    "load_lengths",
    "rl_math_like",
    "sft_long_context_like",
    "verl_rank_partition",
]
