"""`planner calibrate`: probe this machine, fit and save its efficiency."""

from __future__ import annotations

import argparse
from pathlib import Path

from gptplan.errors import UserError
from planner.commands.flags import spec_args, tune_args
from planner.commands.overrides import local_profile_name, spec_overrides, tune_settings

NAME = "calibrate"


def add_parser(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser(NAME, help="probe this machine, fit and save its efficiency")
    spec_args(cal)
    tune_args(cal, default_probes=6)


def run(args: argparse.Namespace) -> int:
    from planner.pipeline import plan_space, tune_locally
    from planner.reporting.answer import probe_logger
    from planner.reporting.costreport import fit_lines
    from planner.reporting.report import render_calibration
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
