"""`planner optimize`: search the space, print the tables, write the cheapest plan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gptplan.errors import UserError
from planner.commands.flags import spec_args, tune_args
from planner.commands.overrides import (
    check_writable_file,
    local_profile_name,
    spec_overrides,
    tune_settings,
)

NAME = "optimize"


def add_parser(sub: argparse._SubParsersAction) -> None:
    opt = sub.add_parser(NAME, help="search the space, write the cheapest plan")
    spec_args(opt)
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
    tune_args(opt)


def run(args: argparse.Namespace) -> int:
    from planner.pipeline import optimize
    from planner.reporting.answer import optimize_console, optimize_json, probe_logger
    from planner.reporting.plots import plot_pareto
    from planner.spec import load_spec
    from planner.writing.planwriter import write_spec_plan

    spec = load_spec(args.spec, overrides=spec_overrides(args))
    settings = tune_settings(args)  # bad flags refused before any work
    check_writable_file(args.out or Path("plans") / f"{spec.job.name}.toml", key="--out")
    if args.plot:
        check_writable_file(args.plot, key="--plot")
    log, on_stats = _console(quiet=args.json)
    if spec.budget_conversion:
        log(spec.budget_conversion)
    _check_tokens_per_param(args)
    answer = None
    if args.maximize:
        planned, answer = _maximized(spec, args)
        if planned is None:
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
    out = args.out or Path("plans") / f"{spec.job.name}.toml"
    if args.json:
        data = optimize_json(result, out if result.plan else None)
        if answer is not None:
            data["maximize"] = answer.to_json()
        text = json.dumps(data, indent=1)
    else:
        text = "\n".join(optimize_console(result, spec, args, answer, out))
    if result.plan is not None:
        write_spec_plan(result.plan, out, spec)
    if args.plot:
        cur = spec.constraints.currency
        plot_pareto(result.decision, str(args.plot), cur, spec=spec, chosen=result.chosen)
    print(text)
    if args.plot and not args.json:
        print(f"wrote {args.plot}")
    return 0 if result.plan is not None else 1


def _console(*, quiet: bool):
    """The log for progress lines (silent with --json) and the corpus statistics' printer."""
    from planner.reporting.costreport import fit_lines

    def log(*parts, **_kwargs) -> None:  # every console line at most costreport.WIDTH columns
        if not quiet:
            print(fit_lines(" ".join(str(p) for p in parts)))

    def on_stats(stats, target) -> None:  # statistics before the search
        from planner.corpus.dataprep import stats_lines
        from planner.reporting.report import render_stats

        log("\n".join([render_stats(stats, target), *stats_lines(stats, target)]) + "\n")

    return log, on_stats


def _check_tokens_per_param(args: argparse.Namespace) -> None:
    if args.tokens_per_param is not None and (
        args.maximize != "params" or not args.tokens_per_param > 0
    ):
        raise UserError(
            f"--tokens-per-param {args.tokens_per_param:g}: allowed only with --maximize "
            "params, and > 0",
            key="--tokens-per-param",
        )


def _maximized(spec, args: argparse.Namespace):
    """--maximize: the spec at the most tokens (or the largest model) the budget buys, and the
    answer; (None, answer) printed as NO PLAN when nothing fits."""
    from planner.pipeline import measure_corpus
    from planner.screen.maximize import TOKENS_PER_PARAM, maximize

    planned, answer = maximize(
        spec,
        measure_corpus(spec),
        what=args.maximize,
        tokens_per_param=args.tokens_per_param or TOKENS_PER_PARAM,
    )
    if planned is None:
        if args.json:
            print(json.dumps({"maximize": None, "problems": [answer]}, indent=1))
        else:
            print(f"NO PLAN: {answer}")
    return planned, answer
