"""The flags several commands share: the spec's (`--budget`, `--rate`, ...) and the autotuning's
(`--probes`, ...), and which spec or settings key each one sets (an error in its value names
the flag)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    pass


def spec_args(p: argparse.ArgumentParser) -> None:
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


def tune_args(p: argparse.ArgumentParser, default_probes: int = 0) -> None:
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


TUNE_FLAGS = {
    "probes": "--probes",
    "probe_time_s": "--probe-time",
    "trials": "--trials",
    "seed": "--seed",
    "storage": "--storage",
    "multi_objective": "--multi-objective",
    "timeout_s": "--probe-timeout",
}
