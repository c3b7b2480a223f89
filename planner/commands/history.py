"""`planner history`: the autotuning study's trials (and, with --plot, the best measured cost
after each)."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptplan.errors import UserError
from planner.commands.flags import spec_args
from planner.commands.overrides import check_writable_file, spec_overrides

NAME = "history"


def add_parser(sub: argparse._SubParsersAction) -> None:
    hist = sub.add_parser(NAME, help="the autotuning study's trials")
    spec_args(hist)
    hist.add_argument("--storage", default="", help="study storage (default: the run's SQLite)")
    hist.add_argument("--plot", type=Path, default=None, help="save optimisation history PNG")


def run(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from planner.spec import load_spec
    from planner.tuning.autotune import history_rows, study_name
    from planner.tuning.probes import hardware_fingerprint
    from planner.tuning.study import sqlite_damage

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
        from planner.reporting.plots import plot_history

        plot_history(rows, args.plot, spec.constraints.currency)
        print(f"wrote {args.plot}")
    return 0
