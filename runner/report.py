"""Planned vs actual: a pure function from (plan, result, billing) to rows, then rendering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from tabulate import tabulate

from gptplan import money
from gptplan.plan import Plan


@dataclass(frozen=True)
class Row:
    metric: str
    unit: str
    planned: float | None
    actual: float | None

    @property
    def ratio(self) -> float | None:
        if self.planned and self.actual is not None:
            return self.actual / self.planned
        return None


class ReportRow(TypedDict):
    """One line of the planned-vs-actual table (report.json's "rows")."""

    metric: str
    unit: str
    planned: float | None  # the plan's estimate (estimate.source says how it was obtained)
    actual: float | None  # measured by this run
    actual_over_planned: float | None


class StepTimeNoise(TypedDict):
    """The actual step time against the probes' measured noise around the planned one."""

    planned_step_time_interval_s: list[float]
    planned_step_time_spread: float
    actual_step_time_s: float
    actual_within_planned_interval: bool
    actual_within_planned_spread: bool


class RunReport(TypedDict):
    """The end-of-run report: report.json, and what `render` prints."""

    plan: str
    step_time_noise: StepTimeNoise | None
    planned_source: str
    planned_measured_fields: list[str]
    actual_source: str
    currency: str
    finished: bool
    stop_reason: str
    completed_steps: int
    max_steps: int
    useful_token_fraction: float
    padded_tokens: int
    memory_per_rank: dict[str, Any] | None
    rows: list[ReportRow]


def planned_vs_actual(plan: Plan, result: dict, billed_seconds: float) -> RunReport:
    """Everything the end-of-run report says, as data (written to report.json)."""
    m = result["measured"]
    cur = plan.hardware.currency
    est = plan.estimate
    cost = money.cost(
        price_per_node_hour=plan.hardware.price_per_node_hour,
        nodes=plan.parallel.nnodes,
        seconds=billed_seconds,
    )
    tokens = m["tokens_trained"]
    rows = [
        Row("tokens/s (whole job)", "tokens/s", est.tokens_per_second, m["tokens_per_second"]),
        Row("step time (median)", "s", est.step_time_s, m["step_time_s"]),
        Row(
            f"peak memory per device ({m['peak_memory_method']})",
            "GB",
            est.peak_memory_gb,
            m["peak_memory_gb"],
        ),
        Row(
            "MFU" if plan.hardware.peak_tflops > 0 else "MFU (hardware peak unknown)",
            "%",
            est.mfu * 100 if est.mfu else None,
            m["mfu"] * 100 if plan.hardware.peak_tflops > 0 else None,
        ),
        Row(
            "cost per million tokens",
            cur,
            est.cost_per_million_tokens,
            cost / tokens * 1e6 if tokens else None,
        ),
        Row("total cost (billed wall-clock)", cur, est.cost, cost),
        Row("hours (billed wall-clock)", "h", est.hours, billed_seconds / 3600),
        Row(
            "tokens trained",
            "tokens",
            float(plan.training.max_steps * plan.tokens_per_step),
            float(tokens),
        ),
    ]
    per_rank = memory_per_rank(plan, m)
    spread: StepTimeNoise | None = None
    if est.step_time_interval_s:  # the probes' measured noise around the planned step time
        low, high = est.step_time_interval_s
        actual = m["step_time_s"]
        spread = {
            "planned_step_time_interval_s": [low, high],
            "planned_step_time_spread": est.step_time_spread,
            "actual_step_time_s": actual,
            "actual_within_planned_interval": low <= actual <= high,
            "actual_within_planned_spread": abs(actual - est.step_time_s)
            <= est.step_time_spread * est.step_time_s,
        }
    return {
        "plan": plan.name,
        "step_time_noise": spread,
        "planned_source": est.source,
        "planned_measured_fields": est.measured,
        "actual_source": "measured",
        "currency": cur,
        "finished": result["finished"],
        "stop_reason": result["stop_reason"],
        "completed_steps": result["completed_steps"],
        "max_steps": result["max_steps"],
        "useful_token_fraction": m["useful_token_fraction"],
        "padded_tokens": m["padded_tokens"],
        "memory_per_rank": per_rank,
        "rows": [
            {
                "metric": r.metric,
                "unit": r.unit,
                "planned": r.planned,
                "actual": r.actual,
                "actual_over_planned": r.ratio,
            }
            for r in rows
        ],
    }


def memory_per_rank(plan: Plan, measured: dict) -> dict[str, Any] | None:
    """Each rank's measured allocator figures (Paddle's allocator: on GPU and on the rehearsal
    device; allocated and reserved, the whole attempt's peak and, where recorded, after the
    model build, the first optimizer step's peak, after it, and the later steps' peak) next
    to the plan's modelled peak per device and the memory model's figure for each phase, with
    the busiest rank's ratios. Plain CPU: {'allocator_unavailable': why}; None where the run
    recorded neither."""
    ranks = measured.get("peak_memory_per_rank")
    if not ranks:
        why = measured.get("allocator_unavailable")
        return {"allocator_unavailable": why} if why else None
    modelled = plan.estimate.peak_memory_gb
    top = max(ranks, key=lambda r: r["reserved_gb"])
    out = {
        "modelled_gb_per_device": modelled,
        "modelled_source": plan.estimate.source,
        "ranks": ranks,
        "busiest_rank": top["rank"],
        "max_reserved_gb": top["reserved_gb"],
        "max_allocated_gb": max(r["allocated_gb"] for r in ranks),
        "max_reserved_over_modelled": top["reserved_gb"] / modelled if modelled else None,
        "method": (
            measured.get("allocator_method")
            or "paddle.device.cuda.max_memory_allocated / max_memory_reserved"
        )
        + " per rank (measured)",
    }
    if any("after_model_build_allocated_gb" in r for r in ranks):
        from runner.rehearsal import modelled_allocator_gb

        phases = modelled_allocator_gb(plan)
        out["modelled_allocator_gb"] = phases  # gptplan.memory's terms (modelled)
        out["measured_over_modelled"] = {
            key: max(r.get(f"{key}_allocated_gb") or 0.0 for r in ranks) / phases[f"{key}_gb"]
            for key in ("after_model_build", "after_first_step", "step_peak")
            if phases[f"{key}_gb"] > 0 and any(f"{key}_allocated_gb" in r for r in ranks)
        }
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def render(report: RunReport) -> str:

    source = report["planned_source"]
    planned_head = f"planned ({source})" if source != "none" else "planned (none given)"
    table = [
        [
            r["metric"],
            r["unit"],
            _fmt(r["planned"] or None),
            _fmt(r["actual"]),
            _fmt(r["actual_over_planned"]),
        ]
        for r in report["rows"]
    ]
    head = ["metric", "unit", planned_head, "actual (measured)", "actual/planned"]
    status = "finished" if report["finished"] else f"stopped: {report['stop_reason']}"
    lines = [
        f"plan {report['plan']}: {status} after {report['completed_steps']}/"
        f"{report['max_steps']} steps; useful (non-padding) tokens "
        f"{report['useful_token_fraction']:.1%}",
        tabulate(table, headers=head, tablefmt="github", disable_numparse=True),
    ]
    mem = report.get("memory_per_rank")
    if mem and "allocator_unavailable" in mem:
        lines.append(f"allocator peaks per rank: not measured ({mem['allocator_unavailable']})")
    elif mem:
        ratio = mem["max_reserved_over_modelled"]
        lines.append(
            f"peak memory per rank (measured, allocator reserved / allocated): busiest rank "
            f"{mem['busiest_rank']} {_fmt(mem['max_reserved_gb'])} / "
            f"{_fmt(mem['max_allocated_gb'])} GB over {len(mem['ranks'])} ranks; modelled "
            f"{_fmt(mem['modelled_gb_per_device'])} GB per device"
            + (f" (reserved / modelled {ratio:.3f})" if ratio else "")
        )
        for key, value in (mem.get("measured_over_modelled") or {}).items():
            lines.append(
                f"  {key.replace('_', ' ')}: allocated {_fmt(value)} x the modelled "
                f"{_fmt(mem['modelled_allocator_gb'][key + '_gb'])} GB (busiest rank, measured "
                "/ modelled)"
            )
    noise = report.get("step_time_noise")
    if noise:
        low, high = noise["planned_step_time_interval_s"]
        inside = "inside" if noise["actual_within_planned_interval"] else "outside"
        lines.append(
            f"planned step time from probes (measured): 95% interval of the mean "
            f"{_fmt(low)}-{_fmt(high)} s, single steps spread "
            f"{noise['planned_step_time_spread']:.0%} (10-90%); the actual median "
            f"{_fmt(noise['actual_step_time_s'])} s is {inside} the interval and "
            + ("within" if noise["actual_within_planned_spread"] else "beyond")
            + " the probes' spread"
        )
    return "\n".join(lines)
