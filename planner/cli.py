"""`planner`: capacity planning before any cloud spend.

  planner optimize [--budget 12000] [--spec FILE] ...   search, print tables, write the plan
  planner estimate (--plan PLAN | [--spec FILE] --set section.key=value ...)
  planner explain PLAN                                  why this plan; the article's claims
  planner profiles                                      hardware profiles and offers
  planner prices import FILE.csv --as-of DATE           SkyPilot-style catalog -> price rows
  planner prices history INSTANCE                       every price row of an instance
  planner launch-file PLAN                              SkyPilot task YAML for the plan
  planner paddlenlp-args PLAN                           PaddleNLP run_pretrain.py args JSON

Bad input: one line on stderr, exit status 2. No plan possible: the reason, exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import tomli

from gptplan import quiet_third_party_warnings, userdata
from gptplan.cliargs import OneLineParser
from gptplan.errors import UserError
from planner import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="planner", description="Plan GPT pretraining cost.")
    parser.add_argument("--version", action="version", version=f"planner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    opt = sub.add_parser("optimize", help="search the space, write the cheapest plan")
    _spec_args(opt)
    opt.add_argument("--out", type=Path, default=None, help="plan path (plans/<name>.toml)")
    opt.add_argument("--top", type=int, default=None, help="rows in the candidate table")
    opt.add_argument("--json", action="store_true", help="machine-readable output")
    opt.add_argument("--plot", type=Path, default=None, help="save the Pareto front (PNG)")
    opt.add_argument(
        "--wide",
        action="store_true",
        help="every column of every candidate (wider than 120 columns)",
    )
    opt.add_argument(
        "--maximize",
        choices=["tokens", "params"],
        default=None,
        help="plan the most tokens (or the largest model of the family at "
        "--tokens-per-param) that the budget buys within the deadline, with the "
        "probability of staying within budget",
    )
    opt.add_argument(
        "--tokens-per-param",
        type=float,
        default=None,
        metavar="RATIO",
        help="tokens per parameter for --maximize params (default 20, Hoffmann et al. 2022)",
    )
    _tune_args(opt)

    est = sub.add_parser("estimate", help="evaluate one fully given configuration")
    _spec_args(est)
    est.add_argument("--plan", type=Path, default=None, help="estimate an existing plan")
    est.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="spec override (TOML value), e.g. --set search.micro_batch_sizes=[8]",
    )
    est.add_argument("--json", action="store_true")
    est.add_argument(
        "--memory",
        action="store_true",
        help="the modelled memory per device term by term, and the change that frees the most",
    )

    exp = sub.add_parser("explain", help="why this plan, and which reference claims hold")
    exp.add_argument("plan", type=Path)
    exp.add_argument(
        "--spec",
        default=None,
        help="spec the plan came from (default: the one recorded in the plan)",
    )
    exp.add_argument("--json", action="store_true")
    exp.add_argument(
        "--claims",
        action="store_true",
        default=None,
        help="check the bank-FAQ article's claims (default: only for plans from the bank-FAQ spec)",
    )

    prof = sub.add_parser("profiles", help="list hardware profiles and offers")
    prof.add_argument(
        "--wide", action="store_true", help="every column (specs, sources; wider than 120)"
    )

    cal = sub.add_parser("calibrate", help="probe this machine, fit and save its efficiency")
    _spec_args(cal)
    _tune_args(cal, default_probes=6)

    hist = sub.add_parser("history", help="the autotuning study's trials")
    _spec_args(hist)
    hist.add_argument("--storage", default="", help="study storage (default: the run's SQLite)")
    hist.add_argument("--plot", type=Path, default=None, help="save optimisation history PNG")

    lf = sub.add_parser(
        "launch-file", help="write a SkyPilot task YAML for a plan (sky jobs launch)"
    )
    lf.add_argument("plan", type=Path, help="plan TOML (inside this project: it is synced)")
    lf.add_argument("--out", type=Path, default=None, help="YAML file (default: PLAN.sky.yaml)")
    lf.add_argument(
        "--bucket", default="", help="checkpoint bucket name (default: gptplan-<plan name>-<hash>)"
    )
    lf.add_argument(
        "--region",
        default=None,
        help="cloud region (default: the region the price was seen in, if recorded)",
    )
    lf.add_argument(
        "--corpus-bucket",
        default="",
        metavar="URI",
        help="bucket holding the full corpus, mounted at /corpus on the nodes and "
        "used as job.corpus: s3://BUCKET[/PREFIX][/GLOB] (also gs://, r2://, "
        "https://ACCOUNT.blob.core.windows.net/CONTAINER/...); default: the "
        "plan's job.corpus as synced with the project",
    )
    lf.add_argument(
        "--store",
        default="",
        choices=("s3", "gcs", "azure", "r2", "ibm", "oci", "nebius"),
        help="bucket store for the run directory (default: the cloud's own; S3 for a cloud "
        "without one, e.g. Lambda)",
    )
    pa = sub.add_parser(
        "paddlenlp-args",
        help="write the plan as PaddleNLP 2.8.1 llm/run_pretrain.py arguments (JSON + config)",
    )
    pa.add_argument("plan", type=Path, help="plan TOML")
    pa.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for run_pretrain.json and model/config.json (default: PLAN.paddlenlp/)",
    )
    pa.add_argument(
        "--input-dir",
        default="data",
        help="PaddleNLP's preprocessed corpus (llm/tools/preprocess *.bin/*.idx), relative to "
        "the folder run_pretrain.py runs in (default: data)",
    )
    pa.add_argument(
        "--tokenizer",
        default="",
        help="PaddleNLP tokenizer name or folder (default: job.tokenizer when it names one, "
        "else the model folder, where a run's exported tokenizer goes)",
    )

    prices = sub.add_parser("prices", help="price lists")
    prices_sub = prices.add_subparsers(dest="prices_command", required=True)
    imp = prices_sub.add_parser("import", help="import a SkyPilot-style catalog CSV")
    imp.add_argument("csv", type=Path)
    imp.add_argument("--name", default=None, help="price list name (default: CSV file stem)")
    imp.add_argument("--provider", default=None, help="provider (default: from file name)")
    imp.add_argument(
        "--as-of",
        default=None,
        help="the catalog's own date, YYYY-MM-DD: the commit date of the vms.csv (required: "
        "SkyPilot's CSVs carry none; a file in a git clone is never dated later than its commit)",
    )
    his = prices_sub.add_parser("history", help="every price row of an instance, newest first")
    his.add_argument("instance", help="instance type, e.g. p4de.24xlarge or aws/p4de.24xlarge")
    return parser


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spec",
        default=None,
        help="job spec TOML (default: ./planner.toml, "
        "[tool.planner] in ./pyproject.toml, or the "
        "embedded bank-FAQ example)",
    )
    p.add_argument("--budget", type=float, default=None, help="constraints.budget")
    p.add_argument("--deadline-hours", type=float, default=None, help="constraints.deadline_hours")
    p.add_argument("--currency", default=None, help="constraints.currency")
    p.add_argument("--hardware", default=None, help="comma-separated profile names allowed")
    p.add_argument(
        "--spot", dest="spot", action="store_true", default=None, help="allow spot capacity"
    )
    p.add_argument("--no-spot", dest="spot", action="store_false", help="on-demand only")
    p.add_argument("--target-tokens", type=float, default=None, help="job.target_tokens")
    p.add_argument(
        "--allow-outlier-prices",
        action="store_true",
        default=None,
        help="let an outlier spot price (below half the same GPU's other spot "
        "offers) make the headline",
    )
    p.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="CODE=RATE",
        help="exchange rate as in [rates]: units of the spec's quote currency (rates.quote, "
        "else its constraints.currency) per unit of CODE, e.g. --rate EUR=7.9 when the spec "
        "quotes CNY",
    )
    p.add_argument(
        "--rate-date", default=None, metavar="DATE", help="date of the --rate values (rates.as_of)"
    )
    p.add_argument(
        "--any-region",
        action="store_true",
        default=None,
        help="take on-demand and spot prices from whichever region is cheapest for each "
        "(default: both from one region)",
    )
    p.add_argument(
        "--spot-fallback-hours",
        type=float,
        default=None,
        metavar="HOURS",
        help="price spot with on-demand fallback after HOURS of waiting (spot.fallback_wait_hours)",
    )


def _tune_args(p: argparse.ArgumentParser, default_probes: int = 0) -> None:
    p.add_argument(
        "--probes",
        type=int,
        default=default_probes,
        help="real probe runs on this machine (0 = model only)",
    )
    p.add_argument("--probe-time", type=float, default=900.0, help="total probe wall time, seconds")
    p.add_argument("--trials", type=int, default=200, help="Optuna trials in all")
    p.add_argument(
        "--storage",
        default="",
        help="Optuna storage: RDB URL or journal file (default: SQLite in runs/autotune/<name>/)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampler seed")
    p.add_argument(
        "--multi-objective",
        action="store_true",
        help="NSGA-II on (cost, hours) instead of TPE on cost",
    )
    p.add_argument(
        "--local-profile",
        default="",
        help="profile of this machine's devices (default: cpu without a GPU)",
    )
    p.add_argument("--probe-timeout", type=float, default=180.0, help="seconds per probe")


# Which command-line flag sets which spec key (errors in those values name the flag).
FLAGS = {
    "constraints.budget": "--budget",
    "constraints.deadline_hours": "--deadline-hours",
    "constraints.currency": "--currency",
    "constraints.profiles": "--hardware",
    "constraints.spot": "--spot/--no-spot",
    "job.target_tokens": "--target-tokens",
    "spot.fallback_wait_hours": "--spot-fallback-hours",
    "constraints.allow_outlier_prices": "--allow-outlier-prices",
    "constraints.any_region": "--any-region",
    "search.top": "--top",
    "rates.as_of": "--rate-date",
}


def check_writable_file(path: Path, *, key: str) -> None:
    """Before any work: the output path must be a file path whose folders are folders."""
    path = Path(path)
    if path.is_dir():
        raise UserError(
            f"{str(path)!r} is a folder; give a file path such as {path / 'plan.toml'}", key=key
        )
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{str(path)!r}: {parent} is a file, not a folder", key=key)


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
        if not out["constraints.profiles"]:
            raise UserError(
                f"{args.hardware!r} names no profile; give comma-separated names "
                "(see 'planner profiles')",
                key="--hardware",
            )
    if args.spot is not None:
        out["constraints.spot"] = args.spot
    if args.target_tokens is not None:
        out["job.target_tokens"] = args.target_tokens
    if getattr(args, "allow_outlier_prices", None):
        out["constraints.allow_outlier_prices"] = True
    if getattr(args, "any_region", None):
        out["constraints.any_region"] = True
    rate_keys = {}
    for item in getattr(args, "rate", []) or []:
        code, sep, raw = item.partition("=")
        try:
            value = float(raw) if sep else None
        except ValueError:
            value = None
        if value is None:
            raise UserError(f"{item!r}: use CODE=RATE, e.g. --rate EUR=7.9", key="--rate")
        out[f"rates.{code.strip()}"] = value  # checked as [rates] are (ISO code, number > 0)
        rate_keys[f"rates.{code.strip()}"] = "--rate"
    if getattr(args, "rate_date", None) is not None:
        from planner.pricebook import price_date

        if price_date(args.rate_date) is None:
            raise UserError(
                f"{args.rate_date!r} is not a date; use YYYY-MM-DD, YYYY-MM or YYYY",
                key="--rate-date",
            )
        out["rates.as_of"] = args.rate_date
    if rate_keys:
        given = ", ".join(f"{k.split('.', 1)[1]}={v:g}" for k, v in out.items() if k in rate_keys)
        out["rates.source"] = f"command line --rate {given} (other rates: the spec's [rates])"
    if getattr(args, "spot_fallback_hours", None) is not None:
        out["spot.fallback_wait_hours"] = args.spot_fallback_hours
    if getattr(args, "top", None) is not None:  # checked by the spec's range (search.top)
        out["search.top"] = args.top
    set_keys: dict[str, str] = {}
    for item in getattr(args, "set", []) or []:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise UserError(f"{item!r}: use SECTION.KEY=VALUE", key="--set")
        try:  # TOML syntax for the value; never eval
            value = tomli.loads(f"v = {raw}")["v"]
        except tomli.TOMLDecodeError:
            value = raw
        out[key] = value
        set_keys[key] = f"--set {key}"  # named as given, even where a flag sets that key too
    args.overridden = {
        k: set_keys.get(k) or rate_keys.get(k) or FLAGS.get(k, f"--set {k}") for k in out
    }
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input is one line and exit 2, a SIGTERM/SIGINT one line and exit
    143/130 (its probes ended, its running trials marked failed: planner.stopping)."""
    from planner.stopping import Stopped, stop_on_signals

    parser = build_parser()
    userdata.add_flag(parser)  # --data-dir before or after any command
    args = parser.parse_args(argv)
    quiet_third_party_warnings()
    probing = args.command == "history" or getattr(args, "probes", 0) > 0
    try:
        userdata.apply_flag(args)
        with stop_on_signals(import_paddle=probing):
            return _dispatch(args)
    except Stopped as stop:
        print(stop.summary(), file=sys.stderr)
        return stop.exit_status
    except UserError as exc:
        flag = getattr(args, "overridden", {}).get(exc.key)
        if flag:  # the bad value came from the command line, not the spec file
            exc.file, exc.key = None, flag
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status


def _dispatch(args) -> int:
    commands = {
        "optimize": cmd_optimize,
        "estimate": cmd_estimate,
        "explain": cmd_explain,
        "profiles": cmd_profiles,
        "calibrate": cmd_calibrate,
        "history": cmd_history,
        "prices": cmd_prices,
        "launch-file": cmd_launch_file,
        "paddlenlp-args": cmd_paddlenlp_args,
    }
    return commands[args.command](args)


# ---- optimize ----------------------------------------------------------------------------------


TUNE_FLAGS = {
    "probes": "--probes",
    "probe_time_s": "--probe-time",
    "trials": "--trials",
    "seed": "--seed",
    "storage": "--storage",
    "multi_objective": "--multi-objective",
    "timeout_s": "--probe-timeout",
}


def tune_settings(args):
    """The autotuning flags, range-checked by TuneSettings' schema (errors name the flag)."""
    from planner.autotune import tune_settings_from

    table = {
        "probes": args.probes,
        "probe_time_s": args.probe_time,
        "trials": args.trials,
        "seed": args.seed,
        "storage": args.storage,
        "multi_objective": args.multi_objective,
        "timeout_s": args.probe_timeout,
    }
    try:
        return tune_settings_from(table)
    except UserError as exc:
        exc.file, exc.key = None, TUNE_FLAGS[exc.key.split(".", 1)[1]]
        raise


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


def write_spec_plan(plan, out: Path, spec) -> None:
    """Write the chosen plan; a rule of the plan schema that the spec's values break is the
    spec's error (its file and key), not the output file's."""
    from gptplan.errors import PlanError
    from gptplan.plan import write_plan
    from planner.spec import SpecError

    try:
        write_plan(
            plan,
            out,
            header=f"# Written by planner {__version__} from {spec.path}. Numbers in "
            "[estimate] are modelled unless listed in estimate.measured.\n",
        )
    except PlanError as err:
        raise SpecError(
            f"{err.detail} (in the plan this spec gives)", file=spec.path, key=err.key
        ) from None


def cmd_optimize(args) -> int:
    from planner.costreport import fit_lines
    from planner.pipeline import optimize
    from planner.report import plot_pareto, render_stats
    from planner.spec import load_spec

    spec = load_spec(args.spec, overrides=spec_overrides(args))
    settings = tune_settings(args)  # bad flags refused before any work
    check_writable_file(args.out or Path("plans") / f"{spec.job.name}.toml", key="--out")
    if args.plot:
        check_writable_file(args.plot, key="--plot")
    quiet = args.json

    def log(*parts, **_kwargs) -> None:  # every console line at most costreport.WIDTH columns
        if not quiet:
            print(fit_lines(" ".join(str(p) for p in parts)))

    def on_stats(stats, target):  # statistics before the search
        from planner.dataprep import stats_lines

        log("\n".join([render_stats(stats, target), *stats_lines(stats, target)]) + "\n")

    if spec.budget_conversion:
        log(spec.budget_conversion)
    answer = None
    if args.tokens_per_param is not None and (
        args.maximize != "params" or not args.tokens_per_param > 0
    ):
        raise UserError(
            f"--tokens-per-param {args.tokens_per_param:g}: allowed only with --maximize "
            "params, and > 0",
            key="--tokens-per-param",
        )
    if args.maximize:
        from planner.maximize import TOKENS_PER_PARAM, maximize
        from planner.pipeline import measure_corpus

        planned, answer = maximize(
            spec,
            measure_corpus(spec),
            what=args.maximize,
            tokens_per_param=args.tokens_per_param or TOKENS_PER_PARAM,
        )
        if planned is None:
            if quiet:
                print(json.dumps({"maximize": None, "problems": [answer]}, indent=1))
            else:
                print(f"NO PLAN: {answer}")
            return 1
        spec = planned

    result = optimize(
        spec,
        settings=settings if settings.probes else None,
        local_profile=local_profile_name(args) if args.probes else "",
        log=log,
        on_stats=on_stats,
        on_probe=probe_logger(log),
    )
    # everything is rendered before anything is written: a command that fails (a report that
    # cannot be drawn, a plan the schema refuses) leaves no plan, plot or half a console answer
    cur = spec.constraints.currency
    out = args.out or Path("plans") / f"{spec.job.name}.toml"
    if quiet:
        data = optimize_json(result, out if result.plan else None)
        if answer is not None:
            data["maximize"] = answer.to_json()
        text = json.dumps(data, indent=1)
    else:
        text = "\n".join(optimize_console(result, spec, args, answer, out))
    if result.plan is not None:
        write_spec_plan(result.plan, out, spec)
    if args.plot:
        plot_pareto(result.decision, str(args.plot), cur, spec=spec, chosen=result.chosen)
    print(text)
    if args.plot and not quiet:
        print(f"wrote {args.plot}")
    return 0 if result.plan is not None else 1


def optimize_console(result, spec, args, answer, out: Path) -> list[str]:
    """The console answer of `planner optimize`, as lines (printed after the plan is written)."""
    from planner.costreport import fit_lines, render_decisions, render_offers
    from planner.report import (
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

    from planner.costreport import cost_json
    from planner.report import (
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
    tuning = None
    if result.tuning is not None:
        o, cal = result.tuning.outcome, result.tuning.calibration
        tuning = {
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


# ---- autotuning -------------------------------------------------------------------------------


def local_profile_name(args) -> str:
    import paddle

    if args.local_profile:
        return args.local_profile
    return "" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() else "cpu"


def cmd_calibrate(args) -> int:
    from planner.costreport import fit_lines
    from planner.pipeline import plan_space, tune_locally
    from planner.report import render_calibration
    from planner.spec import load_spec

    spec = load_spec(args.spec, overrides=spec_overrides(args))
    settings = tune_settings(args)
    stats, target, decision, _ = plan_space(spec)
    if decision.chosen is None and not decision.table["fits"].any():
        raise UserError("no candidate fits on this machine to probe", file=spec.path)
    tuning = tune_locally(
        spec,
        decision,
        target,
        settings,
        local_profile=local_profile_name(args),
        work_dir=Path("runs") / "autotune" / spec.job.name,
        log=print,
        on_probe=probe_logger(print),
    )
    if tuning is not None and tuning.calibration is not None:
        print(fit_lines(render_calibration(tuning)))
    return 0


def cmd_history(args) -> int:
    from tabulate import tabulate

    from planner.autotune import history_rows, study_name
    from planner.probes import hardware_fingerprint
    from planner.spec import load_spec
    from planner.study import sqlite_damage

    spec = load_spec(args.spec, overrides=spec_overrides(args))
    if args.plot:
        check_writable_file(args.plot, key="--plot")
    name = study_name(spec, hardware_fingerprint())
    storage = args.storage or f"sqlite:///{Path('runs') / 'autotune' / spec.job.name / 'study.db'}"
    problem = (
        sqlite_damage(Path(storage[len("sqlite:///") :]))
        if storage.startswith("sqlite:///")
        else None
    )
    if problem:
        raise UserError(
            f"the study is damaged ({problem}); 'planner optimize --probes N' moves "
            "it aside and rebuilds it from the probe cache",
            file=storage[len("sqlite:///") :],
        )
    try:
        rows = history_rows(storage, name)
    except KeyError:
        raise UserError(
            f"no study {name!r} in {storage}; run 'planner optimize --probes N' first",
            key="--storage",
        ) from None
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
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


# ---- estimate ----------------------------------------------------------------------------------


def plan_as_overrides(plan) -> dict:
    """Pin every searched dimension, and the model, to the plan's value."""
    import dataclasses

    from gptplan import families
    from gptplan.layout import Layout
    from gptplan.modelfacts import kv_heads
    from planner.spec import ModelSpec

    t, hw = plan.training, plan.hardware
    m = plan.model
    # every field the spec's [model] table sets besides the size's name, as the plan has it
    model = {
        f"model.{f.name}": getattr(m, f.name)
        for f in dataclasses.fields(ModelSpec)
        if f.name != "size"
    }
    # the size's name (for display) only where it cannot bring back KV heads the plan dropped
    named = families.all_sizes().get(m.name)
    keep_name = named is not None and kv_heads(m) == (
        named.num_key_value_heads or named.num_attention_heads
    )
    return {
        "model.size": m.name if keep_name else "",
        **model,
        # the plan's layout as spec pins (gptplan.layout: the one translation)
        **Layout.from_plan(plan).spec_pins(),
        "constraints.profiles": [hw.profile],
        "constraints.offers": [hw.offer],
        "constraints.global_batch_tokens_min": plan.tokens_per_step,
        "constraints.global_batch_tokens_max": plan.tokens_per_step,
        "constraints.spot": hw.spot,
        "constraints.on_demand": not hw.spot,
        "constraints.budget": 0.0,
        "constraints.deadline_hours": 0.0,
        "job.target_tokens": float(plan.job.target_tokens or plan.tokens_per_step * t.max_steps),
        "job.corpus": list(plan.job.corpus),
    }


def cmd_estimate(args) -> int:
    from gptplan.plan import load_plan
    from planner.costreport import fit_lines
    from planner.pipeline import optimize
    from planner.report import render_candidates, render_choice, render_model
    from planner.spec import load_spec

    overrides = {}
    spec_path = args.spec
    if args.plan:
        plan = load_plan(args.plan)
        overrides = plan_as_overrides(plan)
        spec_path = spec_path or (
            plan.provenance.spec if Path(plan.provenance.spec).exists() else None
        )
    overrides |= spec_overrides(args)
    spec = load_spec(spec_path, overrides=overrides)
    # the plan's model exactly: its vocabulary is not derived again from a tokenizer
    spec.model_pinned = bool(args.plan)
    result = optimize(spec)
    if spec.budget_conversion and not args.json:
        print(spec.budget_conversion)
    n = result.timings.get("candidates", len(result.table))
    what = (
        f"evaluated {n:,} configuration(s): "
        + ("the plan's own" if args.plan else "the spec's search space")
        + (" with the --set values pinned" if args.set else "")
        + " (no probes; the cost model only)"
    )
    if args.json:
        print(json.dumps(optimize_json(result, None) | {"evaluated": what}, indent=1))
    else:
        print(what)
        for line in spec.model_changes:  # every change to the asked model, one line each
            print(fit_lines(line))
        print(render_candidates(result, 5))
        print(render_model(result))
        print(render_choice(result))
        if args.memory:
            from planner.report import render_memory

            print(render_memory(result))
    return 0 if result.chosen is not None else 1


# ---- explain -----------------------------------------------------------------------------------


def cmd_explain(args) -> int:
    from planner.explain import explain_plan, render_explanation

    result = explain_plan(args.plan, spec_path=args.spec, claims=args.claims)
    print(json.dumps(result, indent=1) if args.json else render_explanation(result))
    return 0


# ---- profiles and prices -----------------------------------------------------------------------


def cmd_profiles(args) -> int:
    """One row per offer (an instance priced in several regions: its cheapest on-demand
    region), price per GPU-hour first as `sky show-gpus` shows it; --wide adds the specs,
    prices per node-hour, regions and sources."""
    from tabulate import tabulate

    from planner.costreport import money
    from planner.hardware import load_profiles
    from planner.pricebook import price_age_days
    from planner.search import region_choices

    wide = getattr(args, "wide", False)
    rows: list[dict[str, object]] = []
    for prof in load_profiles().values():
        name = prof.name + ("" if prof.verified else " *")
        peaks = "/".join(
            f"{prof.peak_tflops.get(p, 0):g}" for p in ("fp32", "tf32", "fp16", "bf16")
        )
        groups: dict[str, list] = {}
        for offer in prof.offers:
            groups.setdefault(offer.key, []).append(offer)
        if not groups:
            rows.append({"profile": name, "GB": f"{prof.memory_gb:g}", "offer": "(no price)"})
        for offers in groups.values():
            choices = region_choices(offers)
            offer, _, where = choices[0]  # on-demand from its cheapest region ...
            spot_offer = next(o for o, only, _ in choices if only in ("", "spot"))  # ... spot too
            where = "; ".join(w for _, _, w in choices if w)
            gpus = offer.gpus_per_node
            age = price_age_days(offer.as_of)
            if offer.kind == "on_prem":
                od = offer.node_price_per_hour(spot=False, tdp_w=prof.tdp_w) / gpus
                spot = ""
            else:
                od = offer.on_demand_per_hour / gpus
                spot = money(spot_offer.spot_per_hour / gpus) if spot_offer.spot_per_hour else "-"
                if spot_offer.price_flag:
                    spot += " (placeholder)"
            row = {
                "profile": name,
                "GB": f"{prof.memory_gb:g}",
                "bf16 TF": f"{prof.peak_tflops['bf16']:g}" if "bf16" in prof.peak_tflops else "-",
                "offer": offer.key,
                "GPUs": gpus,
                "Gbit/s": f"{offer.inter_node_gbits_per_s:g}"
                if offer.inter_node_gbits_per_s
                else "1 node",
                "/GPU-h": (money(od) if od > 0 else "spot only")
                + (" (power)" if offer.kind == "on_prem" else ""),
                "spot/GPU-h": spot,
                "cur": offer.currency,
                "age": f"{age} d" if age is not None else "undated",
            }
            if wide:
                row |= {
                    "device": prof.device,
                    "TFLOPS fp32/tf32/fp16/bf16": peaks,
                    "TDP W": f"{prof.tdp_w:g}",
                    "eff. max": f"{prof.efficiency.max:g}",
                    "per node-hour": f"{offer.on_demand_per_hour:g} / {offer.spot_per_hour:g} spot"
                    if offer.kind != "on_prem"
                    else "",
                    "as of": offer.as_of or "undated",
                    "region": where or offer.region or "",
                    "regions priced": len(offers),
                    "network": offer.network_source,
                    "price source": offer.source,
                }
            rows.append(row)
    import tabulate as tabulate_module

    padding, tabulate_module.MIN_PADDING = tabulate_module.MIN_PADDING, 0  # headers not padded
    try:
        table = tabulate(
            rows,
            headers="keys",
            tablefmt="grid" if wide else "simple",
            maxcolwidths=40 if wide else 32,
            disable_numparse=True,
        )
    finally:
        tabulate_module.MIN_PADDING = padding
    print(table)
    print(
        textwrap.fill(
            "Prices per GPU-hour (on-demand, spot) of each offer's cheapest region; Gbit/s = "
            "inter-node bandwidth (1 node = not stated: planned single-node); * = unverified "
            "profile (a lead, not a fact). --wide: specs, regions and sources; 'planner "
            "prices history INSTANCE': every price row.",
            width=120,
        )
    )
    return 0


def cmd_launch_file(args) -> int:
    from gptplan.plan import load_plan
    from planner.skypilot import write_launch_file

    plan = load_plan(args.plan)
    import yaml

    from planner.skypilot import corpus_note, disk_plan, interconnect_note, store_note

    out = write_launch_file(
        plan,
        plan_path=args.plan,
        out=args.out,
        bucket=args.bucket,
        region=args.region,
        corpus_bucket=args.corpus_bucket,
        store=args.store,
    )
    task = yaml.safe_load(out.read_text())
    notes = (
        f"SkyPilot task written to {out}; launch it from this directory as a managed job "
        "(relaunched after preemption, resuming from the bucket's checkpoints):",
        store_note(task, plan),
        interconnect_note(task, plan),
        corpus_note(task, plan),
        disk_plan(plan)[1],
    )
    for i, note in enumerate(notes):  # at most 120 columns, as every planner output
        print(textwrap.fill(note, 120, subsequent_indent="  ", break_long_words=False))
        if i == 0:
            print(f"  sky jobs launch -n {plan.name} {out}")
    return 0


def cmd_paddlenlp_args(args) -> int:
    """The plan as run_pretrain.py arguments (gptplan.paddlenlp_args): run_pretrain.json and
    model/config.json in one folder, written atomically; paths in the JSON are relative to it."""
    from gptplan.paddlenlp_args import model_config, pretrain_args
    from gptplan.plan import load_plan
    from gptplan.tomlconf import write_text_atomic

    plan = load_plan(args.plan)
    out = args.out or args.plan.with_name(args.plan.stem + ".paddlenlp")
    tokenizer = args.tokenizer
    if not tokenizer and plan.job.tokenizer != "sentencepiece":
        tokenizer = plan.job.tokenizer  # a PaddleNLP name or a folder the plan names
    arguments = pretrain_args(
        plan, model_dir="model", tokenizer=tokenizer, input_dir=args.input_dir
    )
    (out / "model").mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        out / "model" / "config.json", json.dumps(model_config(plan), indent=1) + "\n"
    )
    write_text_atomic(out / "run_pretrain.json", json.dumps(arguments, indent=1) + "\n")
    p = plan.parallel
    devices = ",".join(str(i) for i in range(p.nproc_per_node))
    notes = (
        f"PaddleNLP 2.8.1 pretraining arguments written to {out / 'run_pretrain.json'} (the "
        f"model's config in {out / 'model' / 'config.json'}); run from {out} on each of the "
        f"{p.nnodes} node(s), with PaddleNLP's llm/ folder at hand:",
        f"input_dir {args.input_dir!r}: PaddleNLP's preprocessed corpus (llm/tools/preprocess), "
        "not this project's cache format. "
        + (
            f"Tokenizer: {tokenizer!r}."
            if tokenizer
            else "Tokenizer: the plan trains its own sentencepiece model; copy a run's "
            "exported tokenizer (runner export) into model/."
        ),
        "The data-parallel degree is PaddleNLP's to derive (world size / tensor / pipeline / "
        "sharding), as the plan's is; the runner's own checkpoints are not PaddleNLP's.",
    )
    for i, note in enumerate(notes):
        print(textwrap.fill(note, 120, subsequent_indent="  ", break_long_words=False))
        if i == 0:
            master = " --master <NODE0_IP>:8090" if p.nnodes > 1 else ""
            print(
                f"  python -m paddle.distributed.launch --nnodes {p.nnodes}{master} --devices "
                f"{devices} llm/run_pretrain.py run_pretrain.json"
            )
    return 0


def cmd_prices(args) -> int:
    from tabulate import tabulate

    from planner.prices import import_catalog, price_history

    if args.prices_command == "history":
        rows = price_history(args.instance)
        if not rows:
            raise UserError(
                f"{args.instance!r}: no price row names this instance (see 'planner profiles')",
                key="instance",
            )
        print(tabulate(rows, headers="keys", tablefmt="simple", maxcolwidths=[None] * 7 + [50]))
        return 0
    changes: list[str] = []
    path, count, skipped, warnings = import_catalog(
        args.csv, name=args.name, provider=args.provider, as_of=args.as_of, changes=changes
    )
    print(f"imported {count} price rows (one per instance and region) into {path}")
    for line in skipped:
        print(f"  skipped {line}")
    for line in changes:
        print(line)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
