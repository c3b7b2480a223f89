"""`planner prices import FILE.csv --as-of DATE` (a SkyPilot-style catalog into price rows) and
`planner prices history INSTANCE` (every price row of an instance)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gptplan.errors import UserError

NAME = "prices"


def add_parser(sub: argparse._SubParsersAction) -> None:
    prices = sub.add_parser(NAME, help="price lists")
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


def run(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from planner.market.prices import import_catalog, price_history

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
