"""`planner`: capacity planning before any cloud spend.

  planner optimize [--budget 12000] [--spec FILE] ...   search, print tables, write the plan
  planner estimate (--plan PLAN | [--spec FILE] --set section.key=value ...)
  planner explain PLAN                                  why this plan; the article's claims
  planner profiles                                      hardware profiles and offers
  planner prices import FILE.csv                        SkyPilot-style catalog -> offers
  planner launch-file PLAN                              SkyPilot task YAML for the plan

Bad input: one line on stderr, exit status 2. No plan possible: the reason, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import tomli

from planner import __version__
from runner import quiet_third_party_warnings
from runner.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="planner", description="Plan GPT pretraining cost.")
    parser.add_argument("--version", action="version", version=f"planner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    opt = sub.add_parser("optimize", help="search the space, write the cheapest plan")
    _spec_args(opt)
    opt.add_argument("--out", type=Path, default=None, help="plan path (plans/<name>.toml)")
    opt.add_argument("--top", type=int, default=None, help="rows in the candidate table")
    opt.add_argument("--json", action="store_true", help="machine-readable output")
    opt.add_argument("--plot", type=Path, default=None, help="save the Pareto front (PNG)")
    _tune_args(opt)

    est = sub.add_parser("estimate", help="evaluate one fully given configuration")
    _spec_args(est)
    est.add_argument("--plan", type=Path, default=None, help="estimate an existing plan")
    est.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="spec override (TOML value), e.g. --set search.micro_batch_sizes=[8]")
    est.add_argument("--json", action="store_true")

    exp = sub.add_parser("explain", help="why this plan, and which reference claims hold")
    exp.add_argument("plan", type=Path)
    exp.add_argument("--spec", default=None, help="spec the plan came from (default: the one "
                                                   "recorded in the plan)")
    exp.add_argument("--json", action="store_true")

    sub.add_parser("profiles", help="list hardware profiles and offers")

    cal = sub.add_parser("calibrate", help="probe this machine, fit and save its efficiency")
    _spec_args(cal)
    _tune_args(cal, default_probes=6)

    hist = sub.add_parser("history", help="the autotuning study's trials")
    _spec_args(hist)
    hist.add_argument("--storage", default="", help="study storage (default: the run's SQLite)")
    hist.add_argument("--plot", type=Path, default=None, help="save optimisation history PNG")

    lf = sub.add_parser("launch-file", help="write a SkyPilot task YAML for a plan "
                                            "(sky jobs launch)")
    lf.add_argument("plan", type=Path, help="plan TOML (inside this project: it is synced)")
    lf.add_argument("--out", type=Path, default=None, help="YAML file (default: PLAN.sky.yaml)")
    lf.add_argument("--bucket", default="", help="checkpoint bucket name (default: "
                                                 "gptplan-<plan name>-<hash>)")
    lf.add_argument("--region", default=None, help="cloud region (default: the region the "
                                                   "price was seen in, if recorded)")
    prices = sub.add_parser("prices", help="price lists")
    prices_sub = prices.add_subparsers(dest="prices_command", required=True)
    imp = prices_sub.add_parser("import", help="import a SkyPilot-style catalog CSV")
    imp.add_argument("csv", type=Path)
    imp.add_argument("--name", default=None, help="price list name (default: CSV file stem)")
    imp.add_argument("--provider", default=None, help="provider (default: from file name)")
    imp.add_argument("--as-of", default=None, help="date of the prices (default: today)")
    return parser


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None, help="job spec TOML (default: ./planner.toml, "
                                                "[tool.planner] in ./pyproject.toml, or the "
                                                "embedded bank-FAQ example)")
    p.add_argument("--budget", type=float, default=None, help="constraints.budget")
    p.add_argument("--deadline-hours", type=float, default=None,
                   help="constraints.deadline_hours")
    p.add_argument("--currency", default=None, help="constraints.currency")
    p.add_argument("--hardware", default=None, help="comma-separated profile names allowed")
    p.add_argument("--spot", dest="spot", action="store_true", default=None,
                   help="allow spot capacity")
    p.add_argument("--no-spot", dest="spot", action="store_false", help="on-demand only")
    p.add_argument("--target-tokens", type=float, default=None, help="job.target_tokens")


def _tune_args(p: argparse.ArgumentParser, default_probes: int = 0) -> None:
    p.add_argument("--probes", type=int, default=default_probes,
                   help="real probe runs on this machine (0 = model only)")
    p.add_argument("--probe-time", type=float, default=900.0,
                   help="total probe wall time, seconds")
    p.add_argument("--trials", type=int, default=200, help="Optuna trials in all")
    p.add_argument("--storage", default="", help="Optuna storage: RDB URL or journal file "
                                                  "(default: SQLite in runs/autotune/<name>/)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed")
    p.add_argument("--multi-objective", action="store_true",
                   help="NSGA-II on (cost, hours) instead of TPE on cost")
    p.add_argument("--local-profile", default="",
                   help="profile of this machine's devices (default: cpu without a GPU)")
    p.add_argument("--probe-timeout", type=float, default=180.0, help="seconds per probe")


def spec_overrides(args) -> dict:
    out = {}
    if args.budget is not None:
        out["constraints.budget"] = args.budget
    if args.deadline_hours is not None:
        out["constraints.deadline_hours"] = args.deadline_hours
    if args.currency is not None:
        out["constraints.currency"] = args.currency
    if args.hardware is not None:
        out["constraints.profiles"] = [h.strip() for h in args.hardware.split(",") if h.strip()]
    if args.spot is not None:
        out["constraints.spot"] = args.spot
    if args.target_tokens is not None:
        out["job.target_tokens"] = args.target_tokens
    for item in getattr(args, "set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise UserError(f"{item!r}: use SECTION.KEY=VALUE", key="--set")
        try:  # TOML syntax for the value; never eval
            value = tomli.loads(f"v = {raw}")["v"]
        except tomli.TOMLDecodeError:
            value = raw
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party_warnings()
    try:
        if args.command == "optimize":
            return cmd_optimize(args)
        if args.command == "estimate":
            return cmd_estimate(args)
        if args.command == "explain":
            return cmd_explain(args)
        if args.command == "profiles":
            return cmd_profiles()
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "history":
            return cmd_history(args)
        if args.command == "prices":
            return cmd_prices_import(args)
        if args.command == "launch-file":
            return cmd_launch_file(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status
    return 2


# ---- optimize ----------------------------------------------------------------------------------

def plan_space(spec, *, log=print):
    """Spec -> (stats, target, decision, timings): the shared core of optimize/estimate."""
    from planner.corpus_stats import corpus_statistics
    from planner.hardware import load_profiles
    from planner.search import allowed_offers, decide, evaluate_space, target_tokens

    timings = {}
    t0 = time.perf_counter()
    profiles = load_profiles()
    offers = allowed_offers(spec, profiles)
    if not offers:
        raise UserError("no hardware offer matches constraints.profiles/offers; see "
                        "'planner profiles'", file=spec.path, key="constraints.profiles")
    model = spec.model_section()
    stats = corpus_statistics(corpus=spec.job.corpus, tokenizer=spec.job.tokenizer,
                              vocab_size=model.vocab_size, cache_dir=spec.job.cache_dir,
                              sample_documents=spec.job.sample_documents,
                              declared_bytes=spec.job.corpus_bytes,
                              seq_lens=spec.constraints.seq_lens, log=log)
    timings["corpus_statistics_s"] = time.perf_counter() - t0
    target = target_tokens(spec, stats)
    t1 = time.perf_counter()
    table = evaluate_space(spec, offers, target)
    decision = decide(spec, table, target)
    timings["search_s"] = time.perf_counter() - t1
    timings["candidates"] = len(table)
    return stats, target, decision, timings


def cmd_optimize(args) -> int:
    from planner.planwriter import candidate_plan, decision_notes
    from planner.report import (describe, plot_pareto, render_candidates, render_choice,
                                render_per_offer, render_stats)
    from planner.spec import load_spec
    from runner.plan import write_plan

    spec = load_spec(args.spec, overrides=spec_overrides(args))
    quiet = args.json
    stats, target, decision, timings = plan_space(
        spec, log=(lambda *a: None) if quiet else print)
    cur = spec.constraints.currency
    c = spec.constraints
    if args.plot:
        plot_pareto(decision, str(args.plot), cur)
    out = args.out or Path("plans") / f"{spec.job.name}.toml"
    plan = None
    tuned = None
    if args.probes and decision.chosen is not None:
        tuned = run_autotune(spec, decision, target, args, log=(lambda *a: None) if quiet
                             else print)
    if tuned is not None and tuned[0] is not None:
        plan = tuned[0]
    elif decision.chosen is not None:
        row = decision.table.row(decision.chosen)
        notes = decision_notes(decision, lambda i: describe(decision.table, i, cur))
        plan = candidate_plan(spec, row, target=target, notes=notes)
    if plan is not None:
        write_plan(plan, out, header=f"# Written by planner {__version__} from {spec.path}. "
                                     "Numbers in [estimate] are modelled unless listed in "
                                     "estimate.measured.\n")
    if quiet:
        print(json.dumps(optimize_json(spec, stats, target, decision, timings, out if plan
                                       else None), indent=1))
    else:
        print(render_stats(stats, target))
        print()
        print(render_candidates(decision, cur, args.top or spec.search.top))
        print()
        print(render_per_offer(decision, c.budget, c.deadline_hours, cur))
        print()
        print(render_choice(decision, cur))
        print(f"planned in {timings['search_s']:.2f} s ({timings['candidates']:,} candidates; "
              f"corpus statistics {timings['corpus_statistics_s']:.1f} s)")
        if plan is not None:
            print(f"wrote {out}  (next: runner execute {out} --dry-run)")
        if args.plot:
            print(f"wrote {args.plot}")
    return 0 if plan is not None else 1


def optimize_json(spec, stats, target, decision, timings, out) -> dict:
    from dataclasses import asdict

    from planner.report import candidate_records, per_offer_records
    from planner.search import ranked

    cur = spec.constraints.currency
    table = decision.table
    top = ranked(table, decision.feasible)[: spec.search.top] if len(table) else []
    return {
        "spec": spec.path, "currency": cur, "target_tokens": target,
        "numbers": "modelled (analytic cost model) unless marked measured",
        "corpus": asdict(stats) | {"tokens_per_character_source": "measured",
                                   "total_tokens_source": "extrapolated" if stats.extrapolated
                                   else "measured"},
        "chosen": candidate_records(table, [decision.chosen], cur, decision.chosen)[0]
        if decision.chosen is not None else None,
        "problems": decision.problems, "binding": decision.binding,
        "top": candidate_records(table, top, cur, decision.chosen),
        "per_offer": per_offer_records(decision, spec.constraints.budget,
                                       spec.constraints.deadline_hours, cur),
        "pareto": candidate_records(table, decision.pareto, cur, decision.chosen),
        "timings": timings, "plan": str(out) if out else None,
    }


# ---- autotuning -------------------------------------------------------------------------------

def local_profile_name(args) -> str:
    import paddle

    if args.local_profile:
        return args.local_profile
    return "" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() else "cpu"


def run_autotune(spec, decision, target, args, *, log=print):
    """Probe locally runnable candidates, calibrate, and return (plan or None, outcome)."""

    import numpy as np
    from tabulate import tabulate

    from planner import calibration
    from planner.autotune import TuneSettings, measured_cost, tune
    from planner.planwriter import candidate_plan, decision_notes
    from planner.report import describe, layout

    table = decision.table
    local = local_profile_name(args)
    offers_local = [i for i, c in enumerate(table.offers) if c.profile.name == local]
    if not local or not offers_local:
        used = {c.profile.name: c.profile.efficiency_for("fp16").source for c in table.offers}
        which = local or "unknown GPU; pass --local-profile"
        log(f"no planned offer runs on this machine's devices ({which}): planning from the "
            "model only; efficiency calibrations used: "
            + "; ".join(f"{k}: {v}" for k, v in used.items()))
        return None
    local_rows = np.flatnonzero(np.isin(table["offer"], offers_local) & table["fits"])
    settings = TuneSettings(probes=args.probes, probe_time_s=args.probe_time,
                            trials=args.trials, seed=args.seed, storage=args.storage,
                            multi_objective=args.multi_objective,
                            timeout_s=args.probe_timeout)
    work = Path("runs") / "autotune" / spec.job.name
    count = [0]

    def progress(result, tbl, row, cached=False):
        count[0] += 1
        r = tbl.row(row)
        what = (f"{r['offer_choice'].offer.instance}, {r['precision']}, seq {r['seq']}, micro "
                f"{r['micro']} x acc {r['acc']}, recompute {r['recompute']}")
        if result.ok:
            err = (tbl["step_time_s"][row] - result.step_time_s) / result.step_time_s
            log(f"probe {count[0]}{' (cached)' if cached else ''}: {what}: "
                f"{result.step_time_s * 1000:.0f} ms/step measured, "
                f"{tbl['step_time_s'][row] * 1000:.0f} modelled ({err:+.0%}), "
                f"{result.peak_memory_gb:.2f} GB peak RSS")
        else:
            log(f"probe {count[0]}: {what}: {result.status.upper()} ({result.detail[:120]})")

    log(f"autotuning on {local}: {len(local_rows):,} runnable candidates, at most "
        f"{settings.probes} probes / {settings.probe_time_s:g} s")
    outcome = tune(spec, table, local_rows, target=target, work_dir=work, settings=settings,
                   progress=progress)
    log(f"study {outcome.study_name} in {outcome.storage}: {len(outcome.probed)} "
        f"configuration(s) measured, {outcome.probes_run} probe(s) run now, {outcome.reused} "
        f"reused from the probe cache, probe time {outcome.probe_wall_s:.0f} s")
    rows = []
    for i, r in sorted(outcome.probed.items(), key=lambda kv: measured_cost(table, *kv)[0]):
        row = table.row(i)
        cost, hours = measured_cost(table, i, r)
        rows.append([("*" if i == outcome.best_row else ""), row["offer_choice"].offer.instance,
                     row["precision"], row["seq"], f"{row['micro']}x{row['acc']}", layout(row),
                     row["recompute"], f"{row['step_time_s'] * 1000:.0f}",
                     f"{r.step_time_s * 1000:.0f}", f"{row['memory_gb']:.2f}",
                     f"{r.peak_memory_gb:.2f}", f"{row['cost']:.4g}", f"{cost:.4g}"])
    cur = spec.constraints.currency
    if rows:
        log(tabulate(rows, headers=["", "offer", "prec", "seq", "micro x acc", "layout",
                                    "recompute", "step ms modelled", "step ms measured",
                                    "mem GB modelled", "mem GB measured (RSS)",
                                    f"cost {cur} modelled", f"cost {cur} measured"],
                     tablefmt="github"))
    profile = table.offers[offers_local[0]].profile
    fitted = calibration.fit(table, outcome.probed, profile,
                             fingerprint=outcome.study_name.rsplit("-", 1)[-1])
    if fitted is not None:
        path = calibration.write(fitted)
        log(f"calibrated {profile.name}: "
            + ", ".join(f"{p} max {e.max:.3f} half_tokens {e.half_tokens:,.0f} rolloff_tokens "
                        f"{e.rolloff_tokens:,.0f}"
                        for p, e in fitted.by_precision.items())
            + f"; step-time fit error median {fitted.fit_error:.1%}, worst "
            f"{fitted.worst_error:.1%} on {fitted.points} probes; written to "
            f"{os.path.relpath(path)}")
    if outcome.best_row is None:
        log("no probed configuration met the constraints: keeping the model's choice")
        return None
    best = outcome.best_row
    result = outcome.probed[best]
    cost, hours = measured_cost(table, best, result)
    row = table.row(best)
    row = row | {"step_time_s": result.step_time_s, "tokens_per_s": result.tokens_per_second *
                 row["nodes"], "memory_gb": result.peak_memory_gb, "cost": cost,
                 "hours": hours, "cost_per_million_tokens": cost / target * 1e6,
                 "mfu": row["mfu"] * row["step_time_s"] / result.step_time_s}
    notes = decision_notes(decision, lambda i: describe(table, i, cur))
    notes.append(f"autotuned: study {outcome.study_name}, {len(outcome.probed)} probes, "
                 f"{outcome.probe_wall_s:.0f} s of probes; model's choice was "
                 f"{describe(table, decision.chosen, cur)}")
    if fitted is not None:
        notes.append(f"calibration: {profile.name} fit error {fitted.fit_error:.1%}")
    plan = candidate_plan(spec, row, target=target, notes=notes,
                          measured=["tokens_per_second", "step_time_s", "peak_memory_gb",
                                    "mfu", "hours", "cost", "cost_per_million_tokens"],
                          probes=len(outcome.probed))
    log(f"chosen after probes: {describe(table, best, cur).rsplit(':', 1)[0]}: "
        f"{cost:.4g} {cur}, {hours:.3g} h (measured step time)")
    return plan, outcome


def cmd_calibrate(args) -> int:
    from planner.spec import load_spec

    spec = load_spec(args.spec, overrides=spec_overrides(args))
    stats, target, decision, _ = plan_space(spec)
    if decision.chosen is None and not decision.table["fits"].any():
        raise UserError("no candidate fits on this machine to probe", file=spec.path)
    if decision.chosen is None:  # calibrating needs runnable configurations, not a budget
        import numpy as np

        decision.chosen = int(np.flatnonzero(decision.table["fits"])[0])
    run_autotune(spec, decision, target, args)
    return 0


def cmd_history(args) -> int:
    from tabulate import tabulate

    from planner.autotune import history_rows, study_name
    from planner.probes import hardware_fingerprint
    from planner.spec import load_spec

    spec = load_spec(args.spec, overrides=spec_overrides(args))
    name = study_name(spec, hardware_fingerprint())
    storage = args.storage or f"sqlite:///{Path('runs') / 'autotune' / spec.job.name / 'study.db'}"
    try:
        rows = history_rows(storage, name)
    except KeyError:
        raise UserError(f"no study {name!r} in {storage}; run 'planner optimize --probes N' "
                        "first", key="--storage") from None
    print(tabulate(rows, headers="keys", tablefmt="github"))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        values = [r["measured cost"] for r in rows]
        best, xs, ys = float("inf"), [], []
        for r, v in zip(rows, values):
            if v is not None:
                best = min(best, v)
                xs.append(r["trial"])
                ys.append(best)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.step(xs, ys, where="post")
        ax.set_xlabel("trial")
        ax.set_ylabel(f"best measured cost, {spec.constraints.currency}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


# ---- estimate ----------------------------------------------------------------------------------

def plan_as_overrides(plan) -> dict:
    """Pin every searched dimension to the plan's value."""
    p, t, hw = plan.parallel, plan.training, plan.hardware
    provider, _, instance = hw.offer.partition("/")
    return {
        "constraints.seq_lens": [t.seq_len], "constraints.precisions": [t.precision],
        "constraints.profiles": [hw.profile], "constraints.offers": [hw.offer],
        "constraints.global_batch_tokens_min": plan.tokens_per_step,
        "constraints.global_batch_tokens_max": plan.tokens_per_step,
        "constraints.max_nodes": p.nnodes, "constraints.spot": hw.spot,
        "constraints.on_demand": not hw.spot, "constraints.budget": 0.0,
        "constraints.deadline_hours": 0.0,
        "search.micro_batch_sizes": [t.per_device_train_batch_size],
        "search.accumulation_steps": [t.gradient_accumulation_steps],
        "search.tensor_parallel": [p.tensor_parallel_degree],
        "search.pipeline_parallel": [p.pipeline_parallel_degree],
        "search.virtual_pp": [p.virtual_pp_degree],
        "search.sharding": [p.sharding], "search.recompute": [p.recompute],
        "search.sharding_degrees": [p.sharding_parallel_degree] if p.sharding else [],
        "search.flash_attention": t.use_flash_attention,
        "search.sequence_parallel": [p.sequence_parallel], "search.node_counts": [p.nnodes],
        "job.target_tokens": float(plan.job.target_tokens or plan.tokens_per_step *
                                   t.max_steps),
    }


def cmd_estimate(args) -> int:
    from planner.report import render_candidates, render_choice
    from planner.spec import load_spec
    from runner.plan import load_plan

    overrides = {}
    spec_path = args.spec
    if args.plan:
        plan = load_plan(args.plan)
        overrides = plan_as_overrides(plan)
        spec_path = spec_path or (plan.provenance.spec if Path(plan.provenance.spec).exists()
                                  else None)
    overrides |= spec_overrides(args)
    spec = load_spec(spec_path, overrides=overrides)
    stats, target, decision, timings = plan_space(spec, log=lambda *a: None)
    cur = spec.constraints.currency
    if args.json:
        print(json.dumps(optimize_json(spec, stats, target, decision, timings, None), indent=1))
    else:
        print(render_candidates(decision, cur, 5))
        print(render_choice(decision, cur))
    return 0 if decision.chosen is not None else 1


# ---- explain -----------------------------------------------------------------------------------

def cmd_explain(args) -> int:
    from planner.explain import explain_plan, render_explanation

    result = explain_plan(args.plan, spec_path=args.spec)
    print(json.dumps(result, indent=1) if args.json else render_explanation(result))
    return 0


# ---- profiles and prices -----------------------------------------------------------------------

def cmd_profiles() -> int:
    from tabulate import tabulate

    from planner.hardware import load_profiles

    rows = []
    for prof in load_profiles().values():
        peaks = "/".join(f"{prof.peak_tflops.get(p, 0):g}" for p in ("fp32", "tf32", "fp16",
                                                                      "bf16"))
        base = {"profile": prof.name + ("" if prof.verified else " (unverified)"),
                "device": prof.device, "mem GB": prof.memory_gb,
                "TFLOPS fp32/tf32/fp16/bf16": peaks, "TDP W": prof.tdp_w,
                "efficiency": f"{prof.efficiency.max:g} ({prof.efficiency.source[:24]})"}
        if not prof.offers:
            rows.append(base | {"offer": "(none: price unknown)", "per node-hour": ""})
        for offer in prof.offers:
            if offer.kind == "on_prem":
                price = (f"{offer.node_price_per_hour(spot=False, tdp_w=prof.tdp_w):.3g} "
                         f"{offer.currency} (electricity)")
            else:
                price = f"{offer.on_demand_per_hour:g} / {offer.spot_per_hour:g} spot " \
                        f"{offer.currency}"
            rows.append(base | {"offer": f"{offer.key} ({offer.gpus_per_node}x, "
                                         f"{offer.as_of})", "per node-hour": price})
    print(tabulate(rows, headers="keys", tablefmt="github"))
    print("Specs from datasheets; prices from the sources named in each profile (as_of dates "
          "shown). Unverified profiles are leads, not facts.")
    return 0


def cmd_launch_file(args) -> int:
    from planner.skypilot import write_launch_file
    from runner.plan import load_plan

    plan = load_plan(args.plan)
    out = write_launch_file(plan, plan_path=args.plan, out=args.out, bucket=args.bucket,
                            region=args.region)
    print(f"SkyPilot task written to {out}; launch it from this directory as a managed job "
          f"(relaunched after preemption, resuming from the bucket's checkpoints):\n"
          f"  sky jobs launch -n {plan.name} {out}")
    return 0


def cmd_prices_import(args) -> int:
    from planner.prices import import_catalog

    path, count, skipped = import_catalog(args.csv, name=args.name, provider=args.provider,
                                          as_of=args.as_of)
    print(f"imported {count} offers into {path}" + (f"; skipped {len(skipped)} rows: "
                                                     f"{'; '.join(skipped[:5])}" if skipped
                                                     else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
