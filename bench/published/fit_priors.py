"""Fit the four constants of each GPU generation's step-time composition
(gptplan.steptime.step_time_parts) to hardware_profiles/published_runs.csv and write them, with
their provenance and honest 80% interval, into the [efficiency] table of each member profile
(A100 40/80 GB -> "ampere", H100/H200 -> "hopper"; see planner.screen.published).

For each generation: one fit on all its rows (the shipped constants: Efficiency.max = the
attainable fraction of peak of large GEMMs, kernel_overhead_us, comm_overlap,
attention_relative); a leave-one-SOURCE-out pass (each paper/repository predicted by a fit to
the others) whose published/modelled ratios, each source weighted equally and widened for few
sources (planner.screen.published.interval_from_sources), give the interval (p10/p90) and the fit
error (median absolute relative leave-one-source-out error); models >= 15e9 parameters get the
wider of that and their own rows' interval. The basis is written in words (interval_basis).
Leave-one-REGIME-out against leave-one-row-out gives the extra log-error per axis a query lies
outside the rows on (extrapolation_log_error; planner.screen.coverage applies it).

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

from planner.market.hardware import PROFILE_DIR  # noqa: E402
from planner.screen import published as pb  # noqa: E402


def efficiency_block(
    fit: pb.Fit,
    *,
    rows: list,
    loso_err: np.ndarray,
    p10: float,
    p90: float,
    date: str,
    basis: str,
    large: tuple[float, float] | None = None,
    extrapolation_log_error: float = 0.4,
) -> str:
    ids = f"{rows[0].id}..{rows[-1].id}" if rows else ""
    source = (
        f"fitted to {len(rows)} published runs ({ids}) of "
        f"hardware_profiles/published_runs.csv by bench/published/fit_priors.py on "
        f"{date}; leave-one-source-out error median {np.median(loso_err):.1%}, worst "
        f"{loso_err.max():.1%}"
    )
    return (
        "\n".join(
            [
                "[efficiency]  # written by bench/published/fit_priors.py; do not edit by hand",
                f"max = {fit.gemm_max:.4f}  # attainable fraction of peak of large GEMMs",
                f"kernel_overhead_us = {fit.kernel_overhead_us:.2f}",
                f"comm_overlap = {fit.overlap:.3f}",
                f"attention_relative = {fit.attention_fraction:.3f}",
                f"throughput_p10 = {p10:.4f}",
                f"throughput_p90 = {p90:.4f}",
                *(
                    [
                        f"throughput_p10_large = {large[0]:.4f}",
                        f"throughput_p90_large = {large[1]:.4f}",
                    ]
                    if large
                    else []
                ),
                f"fit_error = {float(np.median(loso_err)):.4f}",
                f"extrapolation_log_error = {extrapolation_log_error:.3f}  # per axis outside"
                " the runs (planner.screen.coverage)",
                f"fit_rows = {len(rows)}",
                f'calibrated_at = "{date}"',
                f'interval_basis = "{basis}"',
                f'source = "{source}"',
            ]
        )
        + "\n"
    )


def replace_efficiency(path: Path, block: str) -> None:
    text = path.read_text()
    new, n = re.subn(
        r"\[efficiency\][^\n]*\n(?:(?!\[)[^\n]*\n)*?(?=\n*\[\[offers\]\]|\Z)", block, text, count=1
    )
    if n != 1:
        raise SystemExit(f"{path}: no [efficiency] table found")
    path.write_text(new)


def generation_interval(rows: list, ratio: np.ndarray, mask: np.ndarray):
    """(p10, p90, large interval or None, basis) of one generation's held-out ratios."""
    srcs = np.array([r.source_key for r in rows])
    p10, p90, n_src = pb.interval_from_sources(ratio[mask], srcs[mask])
    large = mask & np.array([pb.is_large(r) for r in rows])
    large_interval = None
    if large.sum() >= pb.MIN_LARGE_ROWS:  # widen, never narrow, for large models
        lo, hi, _ = pb.interval_from_sources(ratio[large], srcs[large])
        large_interval = (min(p10, lo), max(p90, hi))
    if n_src >= pb.MIN_SOURCES:
        how = f"widened x{pb.small_sample_widening(n_src):.2f} for {n_src} sources"
    else:
        how = (
            f"at least x{pb.UNMEASURED_INTERVAL[0]}..x{pb.UNMEASURED_INTERVAL[1]}: "
            f"{n_src} sources cannot measure the spread between sources"
        )
    basis = f"leave-one-source-out over {n_src} sources, {int(mask.sum())} runs, {how}"
    return p10, p90, large_interval, basis


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print, do not write profiles")
    args = parser.parse_args()
    date = dt.date.today().isoformat()
    rows = pb.load_rows()
    cols = pb._columns(rows)
    loso = pb.leave_one_source_out(rows)
    loo = pb.leave_one_out(rows)
    regime_out = pb.leave_one_regime_out(rows)
    gens = np.array([r.generation for r in rows])
    for gen, members in pb.GENERATIONS.items():
        mask = gens == gen
        if not mask.any():
            continue
        fit = pb.fit(cols, mask)
        err = np.abs(loso["predicted"][mask] - loso["measured"][mask]) / loso["measured"][mask]
        p10, p90, large_interval, basis = generation_interval(rows, loso["ratio"], mask)
        extra, per_regime = pb.extrapolation_log_error(rows, loo["ratio"], regime_out, gen)
        block = efficiency_block(
            fit,
            rows=[r for r, m in zip(rows, mask, strict=True) if m],
            loso_err=err,
            p10=p10,
            p90=p90,
            date=date,
            basis=basis,
            large=large_interval,
            extrapolation_log_error=extra,
        )
        print(
            f"{gen}: {fit}\n  leave-one-source-out median {np.median(err):.1%} worst "
            f"{err.max():.1%}; interval x{p10:.3f}..x{p90:.3f}; large models "
            f"{large_interval}; {basis}\n  extra log-error per axis outside the runs "
            f"{extra:.3f} (leave-one-regime-out: "
            + ", ".join(f"{k} {v:.3f}" for k, v in per_regime.items())
            + ")"
        )
        if not args.dry_run:
            for name in members:
                replace_efficiency(PROFILE_DIR / f"{name}.toml", block)
                print(f"  wrote {name}.toml [efficiency]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
