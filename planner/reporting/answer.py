"""The answer of `planner optimize` and `planner estimate`: the console lines (tables, the
chosen plan, timings), the same result as JSON (raw numbers under unit-bearing snake_case
keys), and one console line per probe as the autotuning finishes it."""

from __future__ import annotations

from pathlib import Path


def probe_logger(log):
    """One line per probe as it finishes (the pipeline calls it)."""
    count = [0]

    def progress(result, tbl, row, cached=False):
        count[0] += 1
        r = tbl.row(row)
        what = (
            f"{r['offer_choice'].offer.instance}, {r['precision']}, seq {r['seq']}, micro "
            f"{r['micro']} x acc {r['acc']}, recompute {r['recompute']}"
        )
        if result.ok:
            err = (tbl["step_time_s"][row] - result.step_time_s) / result.step_time_s
            log(
                f"probe {count[0]}{' (cached)' if cached else ''}: {what}: "
                f"{result.step_time_s * 1000:.0f} ms/step measured (median of "
                f"{result.measured_steps}), {tbl['step_time_s'][row] * 1000:.0f} modelled "
                f"({err:+.0%}), {result.peak_memory_gb:.2f} GB peak RSS"
                + (
                    f"; taken under load (load average {result.loadavg_1m:.1f}): counted as noisier"
                    if result.under_load
                    else ""
                )
            )
        else:
            log(f"probe {count[0]}: {what}: {result.status.upper()} ({result.detail[:120]})")

    return progress


def optimize_console(result, spec, args, answer, out: Path) -> list[str]:
    """The console answer of `planner optimize`, as lines (printed after the plan is written)."""
    from planner.reporting.costreport import fit_lines, render_decisions, render_offers
    from planner.reporting.report import (
        render_calibration,
        render_candidates,
        render_choice,
        render_model,
        render_probed,
    )

    lines = []
    if result.tuning is not None and result.tuning.calibration is not None:
        lines.append(fit_lines(render_calibration(result.tuning)))
    for note in result.notes:
        lines.append(fit_lines(note))
    top = spec.search.top
    lines += [render_offers(result.decision, spec, wide=args.wide), ""]
    if args.wide:
        lines.append(render_candidates(result, top))
    elif result.tuning is not None:
        lines.append(render_probed(result, top))
    else:
        lines.append(render_decisions(result, top))
    lines += ["", fit_lines(render_model(result))]
    if answer is not None:
        lines.append(fit_lines("\n".join(answer.lines())))
    lines.append(fit_lines(render_choice(result)))
    timings = result.timings
    lines.append(
        fit_lines(
            f"planned in {timings['search_s']:.2f} s ({timings['candidates']:,} candidates; "
            f"corpus statistics {timings['corpus_statistics_s']:.1f} s"
            + (
                f"; probes and calibration {timings['tuning_s']:.0f} s"
                if "tuning_s" in timings
                else ""
            )
            + ")"
        )
    )
    if result.plan is not None:
        lines.append(
            fit_lines(
                f"wrote {out}\n  next: runner execute {out} --dry-run on the planned "
                "machines, or --local --max-steps 2 to rehearse it here"
            )
        )
    return lines


def optimize_json(result, out) -> dict:
    """The result as data: raw numbers under snake_case keys that carry their units."""
    from dataclasses import asdict

    from planner.reporting.costreport import cost_json
    from planner.reporting.report import (
        candidate_record,
        candidate_records,
        model_facts,
        result_rows,
    )

    spec, decision, table = result.spec, result.decision, result.table
    cur = spec.constraints.currency

    def record(i, variants=()):
        return candidate_record(
            table,
            i,
            cur,
            chosen=result.chosen,
            measured=result.measured(i),
            calibrated_cost=result.calibrated_cost(i),
            variants=variants,
        )

    shown, folded = result_rows(result, spec.search.top) if len(table) else ([], 0)
    tuning = _tuning_json(result)
    plan_estimate = asdict(result.plan.estimate) if result.plan is not None else None
    return {
        "spec": spec.path,
        "currency": cur,
        "target_tokens": float(result.target),
        **model_facts(result),
        "numbers": "modelled (analytic cost model) unless under measured_* or calibrated_* keys",
        "corpus": asdict(result.stats),
        **result.data,
        "chosen": record(result.chosen) if result.chosen is not None else None,
        "chosen_source": result.chosen_source if result.chosen is not None else None,
        "plan_estimate": plan_estimate,
        "problems": decision.problems,
        "binding": decision.binding,
        "candidates": [record(i, others) for i, others in shown],
        "candidates_folded_as_identical_under_the_model": folded,
        "pareto": candidate_records(table, decision.pareto, cur, result.chosen),
        "tuning": tuning,
        "notes": result.notes,
        "model_changes": list(spec.model_changes),
        "budget_conversion": spec.budget_conversion or None,
        **cost_json(result),
        "timings": result.timings,
        "plan": str(out) if out else None,
    }


def _tuning_json(result) -> dict | None:
    """The autotuning of a result as data (None without probes)."""
    if result.tuning is None:
        return None
    o, cal = result.tuning.outcome, result.tuning.calibration
    return {
        "profile": result.tuning.profile,
        "study": o.study_name,
        "storage": o.storage,
        "configurations_measured": len(o.probed),
        "probes_run": o.probes_run,
        "reused_from_cache": o.reused,
        "probe_wall_s": o.probe_wall_s,
        "repairs": o.notes,
        "race": o.race.to_dict() if o.race else None,
        "calibration": None
        if cal is None
        else {
            "points": cal.points,
            "fit_error_median": cal.fit_error,
            "fit_error_worst": cal.worst_error,
            "written_to": str(result.tuning.calibration_path)
            if result.tuning.calibration_path
            else None,
        },
    }
