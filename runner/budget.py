"""The budget as a hard ceiling: billed total <= max_cost and <= max_hours, reruns included.

Before every step rank 0 asks: would the next step, a checkpoint after it and shutting down
(ranks exit, launcher exits, the runner's last billing write) still fit? Each of those costs
is measured (slowest seen, over all attempts of the run, from billing.json), plus a margin
from the measured spread of step times. What has not been measured yet is modelled from
priors below, and said so. The runner asks the same question before launching, adding the
measured start-up of earlier attempts, so a rerun of a spent run launches nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gptplan import money
from gptplan.errors import BudgetError
from gptplan.plan import Plan
from runner.billing import Billing, Heartbeat

if TYPE_CHECKING:
    from runner.metrics import StepRecord

# Priors for costs not measured yet in this run (modelled, conservative for the CPU machine):
SHUTDOWN_PRIOR_S = {False: 1.0, True: 6.0}  # in-process vs launched ranks
CHECKPOINT_BYTES_PER_S = 50e6  # slow disk
CHECKPOINT_FIXED_S = 1.0
MARGIN_FRACTION = 0.10  # on top of the measured spread
# Start-up (runner start to the first step) of a run that has not measured one, a stated bound
# (the CPU test machine measured 5-12 s in-process and 15-30 s for two launched ranks).
STARTUP_BOUND_S = {False: 15.0, True: 45.0}  # in-process vs launched ranks


@dataclass(frozen=True)
class StopCosts:
    """Seconds a run still needs to end cleanly after deciding to take one more step."""

    step_s: float
    checkpoint_s: float
    shutdown_s: float
    margin_s: float
    measured: bool  # all parts measured (False: some modelled from priors)

    @property
    def total_s(self) -> float:
        return self.step_s + self.checkpoint_s + self.shutdown_s + self.margin_s


def checkpoint_prior_bytes(plan: Plan) -> int:
    """Modelled checkpoint size (gptplan.money.checkpoint_bytes; tied weights once)."""
    from gptplan.modelfacts import parameter_count

    t = plan.training
    return int(
        money.checkpoint_bytes(
            parameter_count(plan.model),
            master_weights=money.keeps_master_weights(t.precision, t.fp16_opt_level),
        )
    )


def checkpoint_prior_s(plan: Plan) -> float:
    return CHECKPOINT_FIXED_S + checkpoint_prior_bytes(plan) / CHECKPOINT_BYTES_PER_S


def modelled_step_s(plan: Plan) -> tuple[float, str]:
    """Step time for a run that has not measured one: the plan's estimate, else the time at
    the hardware's peak FLOPS (a lower bound). (seconds, how it was obtained)."""
    if plan.estimate.step_time_s > 0:
        return plan.estimate.step_time_s, f"{plan.estimate.source} estimate"
    if plan.hardware.peak_tflops > 0:
        from gptplan.modelfacts import training_flops_per_token

        flops = training_flops_per_token(plan.model, plan.training.seq_len) * plan.tokens_per_step
        seconds = flops / (plan.hardware.peak_tflops * 1e12 * plan.parallel.world_size)
        return seconds, "modelled at the hardware's peak FLOPS, a lower bound"
    return 0.0, "unknown"


def measured_max(attempts: list[dict], key: str) -> float | None:
    values = [a[key] for a in attempts if isinstance(a.get(key), (int, float))]
    return max(values) if values else None


def stop_costs(
    plan: Plan, attempts: list[dict], *, step_times: list[float], checkpoint_times: list[float]
) -> StopCosts:
    """Costs of one more step and a clean stop, from this attempt's measurements and the
    earlier attempts' (`attempts` from billing.json)."""
    launched = plan.parallel.world_size > 1
    steps = list(step_times[-20:])
    prev_step = measured_max(attempts, "step_s")
    if prev_step is not None:
        steps.append(prev_step)
    step_s = max(steps) if steps else modelled_step_s(plan)[0]
    ckpts = list(checkpoint_times)
    prev_ckpt = measured_max(attempts, "checkpoint_s")
    if prev_ckpt is not None:
        ckpts.append(prev_ckpt)
    checkpoint_s = max(ckpts) if ckpts else checkpoint_prior_s(plan)
    shutdown = measured_max(attempts, "shutdown_s")
    shutdown_s = shutdown if shutdown is not None else SHUTDOWN_PRIOR_S[launched]
    spread = (max(steps) - min(steps)) if len(steps) > 1 else step_s
    margin_s = spread + MARGIN_FRACTION * (step_s + checkpoint_s + shutdown_s)
    return StopCosts(
        step_s=step_s,
        checkpoint_s=checkpoint_s,
        shutdown_s=shutdown_s,
        margin_s=margin_s,
        measured=bool(steps) and bool(ckpts) and shutdown is not None,
    )


def cost_of_seconds(plan: Plan, seconds: float) -> float:
    return money.cost(
        price_per_node_hour=plan.hardware.price_per_node_hour,
        nodes=plan.parallel.nnodes,
        seconds=seconds,
    )


def over_limits(plan: Plan, *, billed_s: float, needed_s: float) -> list[str]:
    """Which limits (budget.max_cost, budget.max_hours) `needed_s` more seconds would cross."""
    b = plan.budget
    crossed = []
    if b.max_cost > 0 and cost_of_seconds(plan, billed_s + needed_s) > b.max_cost:
        crossed.append("budget.max_cost")
    if b.max_hours > 0 and (billed_s + needed_s) / 3600.0 > b.max_hours:
        crossed.append("budget.max_hours")
    return crossed


def startup_s(
    plan: Plan, attempts: list[dict], *, machine_startup_s: float | None = None
) -> tuple[float, str]:
    """Start-up still ahead of an attempt: the slowest measured in earlier attempts (runner
    start to first step) or, when slower, on this machine for plans of this shape
    (runner.ceiling), else the stated bound. (seconds, how it was obtained)."""
    measured = measured_max(attempts, "startup_s")
    if machine_startup_s is not None and (measured is None or machine_startup_s > measured):
        bound = STARTUP_BOUND_S[plan.parallel.world_size > 1]
        if measured is not None or machine_startup_s > bound:
            return machine_startup_s, "measured on this machine"
    if measured is not None:
        return measured, "measured"
    return STARTUP_BOUND_S[plan.parallel.world_size > 1], "stated bound"


def first_step_need_s(
    plan: Plan, attempts: list[dict], *, machine_startup_s: float | None = None
) -> tuple[float, str]:
    """Seconds an attempt needs to take one step and stop cleanly: start-up, the step, its
    checkpoint and shutdown (measured where earlier attempts measured them)."""
    start, how = startup_s(plan, attempts, machine_startup_s=machine_startup_s)
    costs = stop_costs(plan, attempts, step_times=[], checkpoint_times=[])
    step_how = "measured" if costs.measured else modelled_step_s(plan)[1]
    return (
        start + costs.total_s,
        f"start-up {start:.1f} s ({how}), step and stop {costs.total_s:.1f} s ({step_how})",
    )


DEADLINE_TEARDOWN_S = 1.0  # killing the group and the last billing write


def deadline(plan: Plan, *, billed_s: float, attempt_start: float) -> float | None:
    """time.time() at which this attempt must be over for the billed total to stay within
    budget.max_cost and budget.max_hours (None: no limit)."""
    b = plan.budget
    limits = []
    if b.max_hours > 0:
        limits.append(b.max_hours * 3600.0)
    if b.max_cost > 0:
        limits.append(
            money.seconds_for(
                price_per_node_hour=plan.hardware.price_per_node_hour,
                nodes=plan.parallel.nnodes,
                money=b.max_cost,
            )
        )
    limits = [x for x in limits if x != float("inf")]
    if not limits:
        return None
    return attempt_start + min(limits) - billed_s - DEADLINE_TEARDOWN_S


def check_budget(
    plan: Plan, billing: Billing, *, started_at: float, step: int, plan_file: Path
) -> str | None:
    """Before anything is launched, for every plan shape: None if start-up, one step, its
    checkpoint and shutdown fit what the budget has left (measured where earlier attempts
    measured, else the stated bounds above); else the line saying the budget is spent. A run
    that never billed anything and cannot buy one step is bad input (BudgetError, exit 2).
    `started_at`: this runner process's start (its time so far is billed too); `step`: the
    step the run would resume from."""
    from runner import ceiling

    billed = billing.total_seconds() + (time.time() - started_at)
    need, how = first_step_need_s(
        plan, billing.attempts, machine_startup_s=ceiling.machine_startup_s(plan)
    )
    crossed = over_limits(plan, billed_s=billed, needed_s=need)
    if not crossed:
        return None
    b, cur = plan.budget, plan.hardware.currency
    if not billing.attempts:
        key = crossed[0]
        limit = f"{b.max_cost} {b.currency}" if key == "budget.max_cost" else f"{b.max_hours} h"
        raise BudgetError(
            f"{limit} cannot buy one step with start-up and shutdown "
            f"({cost_of_seconds(plan, need):.6g} {cur} for "
            f"{need:.3g} s: {how}); raise {key}",
            file=str(plan_file),
            key=key,
        )
    limits = []
    if "budget.max_cost" in crossed:
        limits.append(
            f"billed {cost_of_seconds(plan, billed):.4f} {cur} of "
            f"budget.max_cost {b.max_cost} {b.currency}"
        )
    if "budget.max_hours" in crossed:
        limits.append(f"billed {billed / 3600:.4f} h of budget.max_hours {b.max_hours} h")
    return (
        f"budget spent: {' and '.join(limits)} (measured); another step with start-up, "
        f"checkpoint and shutdown needs ~{need:.1f} s more ({how}); trained {step} of "
        f"{plan.training.max_steps} steps (checkpoint at step {step}); raise the limit "
        "to continue"
    )


@dataclass(frozen=True)
class Attempt:
    """An attempt opened in the bill (runner.billing): when it started, and when it must be
    over for the billed total to stay within the budget (None: no limit, or a node > 0)."""

    start: float
    deadline: float | None
    journal: Billing | None = None  # the journal this node's attempt is written in


@contextlib.contextmanager
def billed_attempt(
    plan: Plan, billing: Billing, *, node_rank: int, started_at: float
) -> Iterator[Attempt]:
    """Node 0 opens the attempt (from this process's start, `started_at`) before preparing or
    launching anything, and a heartbeat keeps it current until the attempt is closed at exit."""
    if node_rank > 0:  # its own time, in its own journal (runner.billing.journal_paths)
        own = Billing(plan.run_dir, repair=True, node_rank=node_rank)
        attempt = Attempt(start=time.time(), deadline=None, journal=own)
        own.open_attempt(started_at)
        heartbeat = Heartbeat(own).start()
        try:
            yield attempt
        finally:
            heartbeat.stop()
        return
    start = billing.open_attempt(started_at)
    attempt = Attempt(
        start=start,
        deadline=deadline(plan, billed_s=billing.previous_seconds(), attempt_start=start),
        journal=billing,
    )
    heartbeat = Heartbeat(billing).start()
    try:
        yield attempt
    finally:
        heartbeat.stop()


def projection_alert(plan: Plan, records: Sequence[StepRecord]) -> str | None:
    """The warning line when the run's projected total (cost at max_steps at the measured pace,
    runner.metrics) passes the plan's p90 cost, else None. Plans without a recorded p90 cost
    (by hand, or older) get none."""
    p90 = plan.budget.planned_cost_p90
    if p90 <= 0 or not records:
        return None
    projected = records[-1].projected_cost
    if projected <= p90:
        return None
    b, cur = plan.budget, plan.budget.currency
    ceiling = f"; the run stops at budget.max_cost {b.max_cost:g} {cur}" if b.max_cost else ""
    return (
        f"WARNING: projected total {projected:,.4g} {cur} (measured pace) passes the plan's "
        f"p90 cost {p90:,.4g} {cur} (planned {b.planned_cost:,.4g} {cur}, modelled){ceiling}"
    )
