"""Money and checkpoint size: each fact in one function (runner budget, metrics, report and the
planner use these, never their own copy).

cost = price per node-hour x nodes x billed hours: what the cloud bill says (SkyPilot's
optimizer prices a candidate the same way).
"""

from __future__ import annotations

from gptplan import precision as precisions
from gptplan.columns import Numbers

SECONDS_PER_HOUR = 3600.0

# Checkpoint bytes per parameter: fp32 weights (4) + AdamW's two fp32 moments (8). Under O2
# (fp16/bf16 weights) the optimizer also keeps fp32 master weights: 2 + 4 + 8 = 14.
CHECKPOINT_BYTES_PER_PARAM = 12
CHECKPOINT_BYTES_PER_PARAM_MASTER_WEIGHTS = 14


def cost(*, price_per_node_hour: float, nodes: int, seconds: float) -> float:
    """Cost (in the price's currency) of `nodes` nodes held for `seconds` of wall-clock time."""
    return price_per_node_hour * nodes * seconds / SECONDS_PER_HOUR


def cost_of_hours(*, price_per_node_hour: Numbers, nodes: Numbers, hours: Numbers) -> Numbers:
    """`cost` in hours, for columns: price per node-hour x nodes x hours, in that order
    (numbers or numpy arrays alike; the planner's search prices every candidate with it)."""
    return price_per_node_hour * nodes * hours


def price_of(*, cost: Numbers, nodes: Numbers, hours: Numbers) -> Numbers:
    """The price per node-hour at which `nodes` nodes held for `hours` hours cost `cost`
    (the inverse of `cost_of_hours`; numbers or numpy arrays alike)."""
    return cost / (nodes * hours)


def seconds_for(*, price_per_node_hour: float, nodes: int, money: float) -> float:
    """Wall-clock seconds `money` buys on `nodes` nodes (inf when the price is 0)."""
    per_second = cost(price_per_node_hour=price_per_node_hour, nodes=nodes, seconds=1.0)
    return money / per_second if per_second > 0 else float("inf")


def checkpoint_bytes(params: Numbers, *, master_weights: Numbers = False) -> Numbers:
    """Modelled size of one checkpoint (weights + optimizer state) of `params` parameters;
    `params` and `master_weights` may be numbers or numpy arrays alike."""
    extra = CHECKPOINT_BYTES_PER_PARAM_MASTER_WEIGHTS - CHECKPOINT_BYTES_PER_PARAM
    return params * (CHECKPOINT_BYTES_PER_PARAM + extra * master_weights)


def keeps_master_weights(precision: str, fp16_opt_level: str) -> bool:
    """O2 with a 16-bit precision keeps fp32 master weights next to the 16-bit ones."""
    return precisions.row(precision).master_weights and fp16_opt_level == "O2"


# The runner's ceiling for a planned run: the plan's own p90 cost times this factor, never more
# than the spec's budget. 1.5 = 1 / (1 - 0.34): room for the cost model's worst held-out error
# on published runs (34%, bench/README.md benchmark 5) beyond its own 80% interval.
CEILING_FACTOR_OVER_P90 = 1.5


def planned_ceiling(
    budget_total: float, cost_p90: float, factor: float = CEILING_FACTOR_OVER_P90
) -> float:
    """budget.max_cost of a planned run: min(budget_total, cost_p90 x factor); the budget alone
    when the plan has no p90 cost (0), and cost_p90 x factor when there is no budget (0)."""
    if cost_p90 <= 0:
        return budget_total
    ceiling = cost_p90 * factor
    return min(budget_total, ceiling) if budget_total > 0 else ceiling
