"""Fit the per-generation efficiency priors to hardware_profiles/published_runs.csv and write
them, with their provenance and 80% interval, into the [efficiency] table of each member
profile (A100 40/80 GB -> "ampere", H100/H200 -> "hopper"; see planner.published).

For each generation: one fit on all its rows (the shipped prior), a leave-one-out pass (each
row predicted by a fit to the others) whose residuals give the interval (p10/p90 of
published/modelled tokens/s) and the fit error (median absolute relative LOO error).

Run: python bench/published/fit_priors.py [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from planner import published as pb  # noqa: E402
from planner.hardware import PROFILE_DIR  # noqa: E402


def efficiency_block(fit: pb.Fit, *, rows: list, loo_err: np.ndarray, p10: float, p90: float,
                     date: str, large: tuple[float, float] | None = None) -> str:
    ids = f"{rows[0].id}..{rows[-1].id}" if rows else ""
    source = (f"fitted to {len(rows)} published runs ({ids}) of "
              f"hardware_profiles/published_runs.csv by bench/published/fit_priors.py on "
              f"{date}; leave-one-out error median {np.median(loo_err):.1%}, worst "
              f"{loo_err.max():.1%}; interval = p10/p90 of leave-one-out published/modelled "
              "(models >= 15e9 parameters: widened to those rows' own p10/p90)")
    return "\n".join([
        "[efficiency]  # written by bench/published/fit_priors.py; do not edit by hand",
        f"max = {fit.eff_max:.4f}",
        f"half_tokens = {fit.half_tokens:.1f}",
        f"half_hidden = {fit.half_hidden:.1f}",
        f"comm_overlap = {fit.overlap:.3f}",
        f"attention_relative = {fit.attention_relative:.3f}",
        f"throughput_p10 = {p10:.4f}",
        f"throughput_p90 = {p90:.4f}",
        *([f"throughput_p10_large = {large[0]:.4f}", f"throughput_p90_large = {large[1]:.4f}"]
          if large else []),
        f"fit_error = {float(np.median(loo_err)):.4f}",
        f"fit_rows = {len(rows)}",
        f'calibrated_at = "{date}"',
        f'source = "{source}"',
    ]) + "\n"


def replace_efficiency(path: Path, block: str) -> None:
    text = path.read_text()
    new, n = re.subn(r"\[efficiency\][^\n]*\n(?:(?!\[)[^\n]*\n)*?(?=\n*\[\[offers\]\]|\Z)",
                     block, text, count=1)
    if n != 1:
        raise SystemExit(f"{path}: no [efficiency] table found")
    path.write_text(new)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print, do not write profiles")
    args = parser.parse_args()
    date = dt.date.today().isoformat()
    rows = pb.load_rows()
    cols = pb._columns(rows)
    loo = pb.leave_one_out(rows)
    gens = np.array([r.generation for r in rows])
    for gen, members in pb.GENERATIONS.items():
        mask = gens == gen
        if not mask.any():
            continue
        fit = pb.fit(cols, mask)
        err = np.abs(loo["predicted"][mask] - loo["measured"][mask]) / loo["measured"][mask]
        small = mask & ~np.array([pb.is_large(r) for r in rows])
        large = mask & ~small
        p10, p90 = pb.interval_ratios(loo["ratio"][mask])
        large_interval = None
        if large.sum() >= pb.MIN_LARGE_ROWS:  # widen, never narrow, for large models
            big = pb.interval_ratios(loo["ratio"][large])
            large_interval = (min(p10, big[0]), max(p90, big[1]))
        block = efficiency_block(fit, rows=[r for r, m in zip(rows, mask) if m], loo_err=err,
                                 p10=p10, p90=p90, date=date, large=large_interval)
        print(f"{gen}: {fit}\n  LOO median {np.median(err):.1%} worst {err.max():.1%}; "
              f"interval x{p10:.3f}..x{p90:.3f}; large models {large_interval}")
        if not args.dry_run:
            for name in members:
                replace_efficiency(PROFILE_DIR / f"{name}.toml", block)
                print(f"  wrote {name}.toml [efficiency]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
