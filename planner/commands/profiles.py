"""`planner profiles`: the hardware profiles and their offers, one row per offer
(planner.reporting.profiles)."""

from __future__ import annotations

import argparse

NAME = "profiles"


def add_parser(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser(NAME, help="list hardware profiles and offers")
    prof.add_argument(
        "--wide", action="store_true", help="every column (specs, sources; wider than 120)"
    )


def run(args: argparse.Namespace) -> int:
    """One row per offer, price per GPU-hour first; --wide adds the specs, prices per
    node-hour, regions and sources."""
    from planner.market.hardware import load_profiles
    from planner.reporting.profiles import profile_rows, render_profiles

    wide = getattr(args, "wide", False)
    print(render_profiles(profile_rows(load_profiles(), wide), wide))
    return 0
