"""A budget guard sized to the plan: the planner writes max_cost = min(budget, planned p90 x
1.5) and keeps the spec's budget as budget_total; a run whose projected total passes the
planned p90 is warned; a run 10x slower than planned stops at that ceiling, not at the
spec's 12,000 CNY; `--set budget.max_cost=` still overrides; plans without the new keys load."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import run_cli

from gptplan import money
from gptplan.plan import load_plan
from runner import budget as guard

REPO = Path(__file__).resolve().parents[1]


def test_planned_ceiling_policy():
    assert money.CEILING_FACTOR_OVER_P90 == 1.5
    assert money.planned_ceiling(12000, 300) == 450  # the plan's p90 x 1.5
    assert money.planned_ceiling(400, 300) == 400  # never above the budget
    assert money.planned_ceiling(0, 300) == 450  # no budget: the plan's own ceiling
    assert money.planned_ceiling(12000, 0) == 12000  # no p90 (e.g. price 0): the budget


def test_a_bank_faq_run_10x_slower_than_planned_stops_at_the_plans_ceiling(bank_optimized):
    work, proc = bank_optimized
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = load_plan(work / "plans" / "bank_faq.toml")
    b = plan.budget
    assert b.budget_total == 12000 and b.ceiling_factor == 1.5
    assert b.planned_cost == pytest.approx(plan.estimate.cost)
    assert b.planned_cost_p90 == pytest.approx(plan.estimate.cost_p90)
    assert b.max_cost == pytest.approx(min(12000, 1.5 * plan.estimate.cost_p90), rel=1e-5)
    assert b.max_cost < 12000
    # 10x slower than planned: the first logged step projects 10x the planned cost
    slow = SimpleNamespace(projected_cost=10 * b.planned_cost)
    line = guard.projection_alert(plan, [slow])
    assert line and "p90" in line and f"{b.max_cost:g}" in line
    assert guard.projection_alert(plan, [SimpleNamespace(projected_cost=b.planned_cost)]) is None
    # the guard stops once the bill passes max_cost: far below the spec's 12,000 CNY
    at_ceiling = money.seconds_for(
        price_per_node_hour=plan.hardware.price_per_node_hour,
        nodes=plan.parallel.nnodes,
        money=b.max_cost,
    )
    assert guard.over_limits(plan, billed_s=at_ceiling, needed_s=60) == ["budget.max_cost"]
    assert guard.over_limits(plan, billed_s=at_ceiling * 0.9, needed_s=60) == []
    assert guard.cost_of_seconds(plan, at_ceiling + 60) < 0.1 * 12000


def test_set_budget_max_cost_still_overrides_and_old_plans_load(tmp_path):
    from runner.overrides import load_plan_with

    # the shipped plan as written before the new [budget] keys
    text = (REPO / "plans" / "bank_faq.toml").read_text()
    new_keys = ("budget_total", "planned_cost", "planned_cost_p90", "ceiling_factor")
    old = tmp_path / "old_bank_faq.toml"
    old.write_text(
        "\n".join(
            line
            for line in text.splitlines()
            if not line.startswith(tuple(f"{k} =" for k in new_keys))
        )
        + "\n"
    )
    plan, _ = load_plan_with(old, ["budget.max_cost=20000"])
    assert plan.budget.max_cost == 20000
    assert plan.budget.budget_total == 0 and plan.budget.planned_cost_p90 == 0
    assert guard.projection_alert(plan, [SimpleNamespace(projected_cost=1e9)]) is None


# ---- the ceiling through any number of reruns (issue 39) ---------------------------------------


def spent_run(write_plan, tmp_path, *, billed_s: float) -> tuple[Path, Path]:
    """A plan at 36 USD/h (0.01 USD/s) whose run directory billed `billed_s` of a 25 s
    ceiling: reruns find it spent before preparing or launching anything."""
    from runner.billing import Billing

    plan = write_plan(
        {"hardware": {"price_per_node_hour": 36.0}, "budget": {"max_cost": 0.25}},
    )
    run = tmp_path / "run"
    run.mkdir()
    billing = Billing(run, repair=True)
    billing.open_attempt(1000.0, now=1000.0)
    billing.close(1000.0 + billed_s)
    return plan, run


def test_ten_reruns_of_a_spent_run_stay_within_max_cost(write_plan, tmp_path):
    from runner.billing import Billing

    plan, run = spent_run(write_plan, tmp_path, billed_s=24.5)
    for _ in range(10):
        proc = run_cli("runner", "execute", str(plan), cwd=tmp_path)
        assert proc.returncode == 0 and "budget spent:" in proc.stdout, proc.stderr[-2000:]
    billing = Billing(run)
    assert len(billing.attempts) == 11  # every rerun kept, with its seconds ...
    assert billing.total_seconds() * 36.0 / 3600 <= 0.25  # ... but none billed past the ceiling
    assert billing.total_seconds() == pytest.approx(24.5)
    checks, seconds = billing.unbilled()
    assert checks == 10 and seconds > 0
