"""The risks a plan's headline states: the odds of meeting the budget and the deadline, whether
a spot plan is a capacity bet, and whether its on-demand fallback fits the budget.

- P(within budget) and P(meeting the deadline) come from the same 80% intervals the plan
  prints (cost and hours p10/p90 around the modelled value, `probability_within`).
- A spot plan that holds more spot GPU-hours than CAPACITY_BET_GPU_HOURS is a capacity bet:
  the interruption rates we use (hardware_profiles/spot/interruptions.toml) are per instance,
  and no source we have measures holding many 8-GPU spot nodes at once for weeks; providers
  reclaim spot capacity fleet-wide when demand rises (AWS: "Spot Instances can be interrupted
  when EC2 needs the capacity back"). The threshold, 32 GPUs (four 8-GPU nodes) for one week,
  is our statement of where a spot fleet stops being an ordinary risk, not a measured limit.
  The bet is stated with the cost of the same plan on-demand (the fallback).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z90 = 1.2815515655446004  # standard normal 90th percentile
CAPACITY_BET_GPUS = 32  # four 8-GPU nodes ...
CAPACITY_BET_HOURS = 168.0  # ... held for one week
CAPACITY_BET_GPU_HOURS = CAPACITY_BET_GPUS * CAPACITY_BET_HOURS


def probability_within(value: float, p10: float, p90: float, limit: float) -> float:
    """P(x <= limit) for an x whose median is `value` and whose 10th/90th percentiles are
    p10/p90: a log-normal on each side of the median (two-piece), so an asymmetric interval
    keeps its asymmetry. 1.0 without a limit (0)."""
    if not limit:
        return 1.0
    if not (value > 0 and math.isfinite(value)):
        return 1.0 if value <= 0 else 0.0
    z = math.log(limit / value)
    side = (p90 if z >= 0 else p10) or value
    if not (side > 0 and math.isfinite(side)):
        return 1.0 if limit >= value else 0.0
    sigma = abs(math.log(side / value)) / Z90
    if sigma <= 0:
        return 1.0 if limit >= value else 0.0
    return 0.5 * (1.0 + math.erf(z / sigma / math.sqrt(2.0)))


@dataclass(frozen=True)
class Risk:
    probability_within_budget: float
    probability_meeting_deadline: float
    spot_gpu_hours: float  # 0 for on-demand and owned plans
    capacity_bet: bool
    fallback_cost: float  # the same plan on-demand (nan: no on-demand price)
    fallback_over_budget: bool

    def headline(self, *, budget: float, deadline_hours: float, currency: str) -> str:
        """One line: both probabilities side by side."""
        b = (
            f"P(within the {budget:,.0f} {currency} budget) = {self.probability_within_budget:.0%}"
            if budget
            else "no budget set"
        )
        d = (
            f"P(meeting the {deadline_hours:,.0f} h deadline) = "
            f"{self.probability_meeting_deadline:.0%}"
            if deadline_hours
            else "no deadline set"
        )
        return f"{b}, {d} (modelled, from the plan's 80% cost and hours intervals)"

    def bet_line(self, *, budget: float, currency: str) -> str:
        """'' unless the plan is a capacity bet or its fallback is over the budget."""
        parts = []
        fallback = (
            f"on-demand fallback {self.fallback_cost:,.0f} {currency}"
            if math.isfinite(self.fallback_cost)
            else "no on-demand fallback priced"
        )
        if self.capacity_bet:
            parts.append(
                f"CAPACITY BET: {self.spot_gpu_hours:,.0f} spot GPU-hours, above the "
                f"{CAPACITY_BET_GPU_HOURS:,.0f} we treat as an ordinary spot risk "
                f"({CAPACITY_BET_GPUS} GPUs for {CAPACITY_BET_HOURS:g} h; planner/screen/risk.py); "
                + fallback
            )
        if self.fallback_over_budget:
            parts.append(
                f"FALLBACK OVER BUDGET: the same plan on-demand costs "
                f"{self.fallback_cost:,.0f} {currency}, above the {budget:,.0f} {currency} budget"
            )
        return "; ".join(parts)


def plan_risk(
    *,
    cost: float,
    cost_p10: float,
    cost_p90: float,
    hours: float,
    hours_p10: float,
    hours_p90: float,
    budget: float,
    deadline_hours: float,
    spot: bool,
    gpus: int,
    fallback_cost: float,
) -> Risk:
    spot_gpu_hours = gpus * hours if spot else 0.0
    fallback = float(fallback_cost) if spot else float("nan")
    return Risk(
        probability_within_budget=probability_within(cost, cost_p10, cost_p90, budget),
        probability_meeting_deadline=probability_within(
            hours, hours_p10, hours_p90, deadline_hours
        ),
        spot_gpu_hours=spot_gpu_hours,
        capacity_bet=spot_gpu_hours > CAPACITY_BET_GPU_HOURS,
        fallback_cost=fallback,
        fallback_over_budget=bool(
            spot and budget and math.isfinite(fallback) and fallback > budget
        ),
    )


def row_risk(spec, table, i: int) -> Risk:
    """The risk of row i of a candidate table under the spec's budget and deadline."""
    r = table.row(int(i))
    c = spec.constraints
    return plan_risk(
        cost=float(r["cost"]),
        cost_p10=float(r["cost_p10"]),
        cost_p90=float(r["cost_p90"]),
        hours=float(r["hours"]),
        hours_p10=float(r["hours_p10"]),
        hours_p90=float(r["hours_p90"]),
        budget=c.budget,
        deadline_hours=c.deadline_hours,
        spot=bool(r["spot"]),
        gpus=int(r["world"]),
        fallback_cost=float(r["cost_on_demand"]),
    )
