"""`planner explain PLAN`: why this plan, and which of the reference article's claims hold."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "explain"


def add_parser(sub: argparse._SubParsersAction) -> None:
    exp = sub.add_parser(NAME, help="why this plan, and which reference claims hold")
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


def run(args: argparse.Namespace) -> int:
    from planner.reporting.explain import explain_plan, render_explanation

    result = explain_plan(args.plan, spec_path=args.spec, claims=args.claims)
    print(json.dumps(result, indent=1) if args.json else render_explanation(result))
    return 0
