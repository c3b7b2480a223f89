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
import sys

from gptplan import quiet_third_party_warnings, userdata
from gptplan.cliargs import OneLineParser
from gptplan.errors import UserError
from planner import __version__
from planner.commands import (
    calibrate,
    estimate,
    explain,
    history,
    launch_file,
    optimize,
    paddlenlp_args,
    prices,
    profiles,
)

# in the order `planner --help` lists them
COMMANDS = (
    optimize,
    estimate,
    explain,
    profiles,
    calibrate,
    history,
    launch_file,
    paddlenlp_args,
    prices,
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="planner", description="Plan GPT pretraining cost.")
    parser.add_argument("--version", action="version", version=f"planner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input is one line and exit 2, a SIGTERM/SIGINT one line and exit
    143/130 (its probes ended, its running trials marked failed: planner.tuning.stopping)."""
    from planner.tuning.stopping import Stopped, stop_on_signals

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


def entry() -> int:
    """The `planner` command (and `python -m planner`): `main` in a process of its own, which
    loads only PaddleNLP's models and tokenizers when it needs them (gptplan.paddlenlp_light)."""
    from gptplan import paddlenlp_light

    paddlenlp_light.enable()
    return main()


def _dispatch(args: argparse.Namespace) -> int:
    return {command.NAME: command.run for command in COMMANDS}[args.command](args)


if __name__ == "__main__":
    sys.exit(entry())
