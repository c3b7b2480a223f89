"""Where the published runs reach, and how much wider the interval gets beyond them.

The 80% interval on modelled throughput (gptplan.profile.Efficiency.throughput_p10/p90) comes
from leave-one-source-out ratios: it says how wrong the model is on a NEW SOURCE whose runs look
like the fitting rows. A query unlike every row (tp 16 when no run of the generation used more
than 8, 3 B parameters when the rows start at 7 B, a sharding stage no run used) is an
extrapolation, and leave-one-REGIME-out measures what that costs: each regime (tp > 1, pp > 1,
> 256 GPUs, >= 30B) predicted by a fit to the rows outside it (planner.screen.published). The ratio
of its held-out error beyond the same rows' leave-one-row-out error is the generation's extra
log-error per outside axis e (Efficiency.extrapolation_log_error, written by
bench/published/fit_priors.py; planner.screen.published.extrapolation_log_error).

Here: a generation's coverage (the ranges and kinds of its rows), and per query the axes it
lies outside. Each outside axis (at most MAX_OUTSIDE_AXES) adds e in quadrature to the log
half-widths of the interval around the point estimate, and the interval's basis names the axes
("tp 16 is outside the hopper runs (tp <= 8)").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gptplan import families
from gptplan.plan import RECOMPUTE_MODES, SHARDING_STAGES

# A continuous axis counts as covered up to this factor beyond the rows' extremes (model size,
# devices, sequence length): within it the composition's terms scale as they do in the rows.
RANGE_FACTOR = 1.5
MAX_OUTSIDE_AXES = 2  # more outside axes widen no further: the interval is already wide


@dataclass(frozen=True)
class Coverage:
    """The published rows of one GPU generation: ranges of the continuous axes, kinds seen."""

    generation: str
    params_billion: tuple[float, float]
    world: tuple[int, int]
    tp_max: int
    pp_max: int
    seq: tuple[int, int]
    families: frozenset[str]
    stages: frozenset[int]  # sharding stage codes (SHARDING_STAGES)
    recompute: frozenset[int]  # recompute codes (RECOMPUTE_MODES)
    rows: int


@functools.lru_cache(maxsize=1)
def coverages() -> dict[str, Coverage]:
    """The coverage of each generation's rows in hardware_profiles/published_runs.csv, read
    once per process."""
    from planner.screen import published as pb

    by_gen: dict[str, list] = {}
    for r in pb.load_rows(pb.RUNS_CSV):
        if r.generation:
            by_gen.setdefault(r.generation, []).append(r)
    return {gen: _coverage(gen, rows) for gen, rows in by_gen.items()}


def coverage(generation: str) -> Coverage | None:
    """`generation`'s coverage (None when it has no published runs)."""
    return coverages().get(generation)


def _coverage(generation: str, rows: list) -> Coverage:
    rec = [r.record for r in rows]
    seqs = [int(x["seq"]) for x in rec]
    return Coverage(
        generation,
        (min(r.params_billion for r in rows), max(r.params_billion for r in rows)),
        (min(r.world for r in rows), max(r.world for r in rows)),
        max(r.tp for r in rows),
        max(r.pp for r in rows),
        (min(seqs), max(seqs)),
        frozenset(x.get("family") or families.DEFAULT_FAMILY for x in rec),
        frozenset(SHARDING_STAGES.index(x["sharding"]) for x in rec),
        frozenset(RECOMPUTE_MODES.index(x["recompute"]) for x in rec),
        len(rows),
    )


def outside_axes(cov: Coverage, *, params_billion, family, world, tp, pp, seq, stage, recompute):
    """Per query (arrays broadcast): a dict axis -> boolean array, True where the query lies
    outside the generation's rows on that axis."""
    lo_p, hi_p = cov.params_billion
    world = np.asarray(world, dtype=float)
    seq = np.asarray(seq, dtype=float)
    return {
        "model size": np.broadcast_to(
            (params_billion < lo_p / RANGE_FACTOR) | (params_billion > hi_p * RANGE_FACTOR),
            world.shape,
        ),
        "family": np.broadcast_to(family not in cov.families, world.shape),
        "devices": world > cov.world[1] * RANGE_FACTOR,
        "tp": np.asarray(tp) > cov.tp_max,
        "pp": np.asarray(pp) > cov.pp_max,
        "seq": (seq < cov.seq[0] / RANGE_FACTOR) | (seq > cov.seq[1] * RANGE_FACTOR),
        # ordered ladders (more sharding, more recompute): between two that runs used is inside
        "sharding": (np.asarray(stage) < min(cov.stages)) | (np.asarray(stage) > max(cov.stages)),
        "recompute": (np.asarray(recompute) < min(cov.recompute))
        | (np.asarray(recompute) > max(cov.recompute)),
    }


def outside_count(axes: dict) -> np.ndarray:
    """Axes outside the rows per query, at most MAX_OUTSIDE_AXES."""
    return np.minimum(sum(np.asarray(v, dtype=int) for v in axes.values()), MAX_OUTSIDE_AXES)


def widen(p10, p90, outside, log_error):
    """The 80% interval (ratios around the point estimate 1) with `outside` axes' extra
    log-error added in quadrature to each half-width."""
    extra = np.asarray(outside, dtype=float) * np.asarray(log_error, dtype=float) ** 2
    lo = np.exp(-np.sqrt(np.log(p10) ** 2 + extra))
    hi = np.exp(np.sqrt(np.log(p90) ** 2 + extra))
    return lo, hi


def reasons(cov: Coverage, query: dict) -> list[str]:
    """Why one query (scalars: params_billion, family, world, tp, pp, seq, stage, recompute)
    lies outside the rows, in words; [] when inside."""
    axes = outside_axes(cov, **query)
    gen = cov.generation
    text = {
        "model size": f"{query['params_billion']:.3g}B parameters "
        f"(runs {cov.params_billion[0]:.3g}-{cov.params_billion[1]:.3g}B)",
        "family": f"the {query['family']} family (runs: {', '.join(sorted(cov.families))})",
        "devices": f"{int(query['world'])} devices (runs up to {cov.world[1]})",
        "tp": f"tp {int(query['tp'])} (runs tp <= {cov.tp_max})",
        "pp": f"pp {int(query['pp'])} (runs pp <= {cov.pp_max})",
        "seq": f"seq {int(query['seq'])} (runs {cov.seq[0]}-{cov.seq[1]})",
        "sharding": f"sharding {SHARDING_STAGES[int(query['stage'])] or 'none'} "
        f"(runs: {', '.join(SHARDING_STAGES[s] or 'none' for s in sorted(cov.stages))})",
        "recompute": f"recompute {RECOMPUTE_MODES[int(query['recompute'])]} "
        f"(runs: {', '.join(RECOMPUTE_MODES[s] for s in sorted(cov.recompute))})",
    }
    return [f"{text[k]} is outside the {gen} runs" for k, v in axes.items() if bool(np.any(v))]


def for_profile(profile, precision: str) -> Coverage | None:
    """The published runs behind `profile`'s interval at `precision` (None when the interval
    is not from published runs: a local calibration or hardware with no fitted rows)."""
    from planner.screen.published import generation_of

    eff = profile.efficiency_for(precision)
    if not eff.fit_rows or eff.calibrated_on:
        return None
    return coverage(generation_of(profile.name))


def row_reasons(profile, precision: str, params_total: float, family: str, row: dict) -> list[str]:
    """`reasons` for one evaluated layout (a dict with world, tp, pp, seq, stage_code and
    recompute_code)."""
    cov = for_profile(profile, precision)
    if cov is None:
        return []
    query = dict(
        params_billion=params_total / 1e9,
        family=family,
        world=row["world"],
        tp=row["tp"],
        pp=row["pp"],
        seq=row["seq"],
        stage=row["stage_code"],
        recompute=row["recompute_code"],
    )
    return reasons(cov, query)


def basis_words(eff, outside: list[str]) -> str:
    """The interval's basis in a few words, with why it was widened (if it was)."""
    base = eff.interval_basis or "uncalibrated default spread"
    if not outside:
        return base
    n = min(len(outside), MAX_OUTSIDE_AXES)
    e = eff.extrapolation_log_error
    return (
        f"{base}; widened for {n} {'axis' if n == 1 else 'axes'} outside the published runs "
        f"(+{e:.2f} log-error each, leave-one-regime-out): {'; '.join(outside)}"
    )


# ---- the physical cap ----------------------------------------------------------------------


@dataclass(frozen=True)
class MfuCap:
    """The highest 16-bit model FLOPs utilisation (PaLM definition, over the dense 16-bit
    peak) published for a generation by any framework in the allowed sources, end-to-end
    training or the best 16-bit kernel (the physical ceiling a layer's work can approach):
    hardware_profiles/mfu_published.csv. Only the top of a throughput interval is held to it
    (planner.screen): the point estimate is the model's median, never clamped."""

    generation: str
    mfu: float
    row_id: str
    source: str

    def words(self) -> str:
        return (
            f"capped at {self.mfu:.1%} MFU, the best 16-bit utilisation published for "
            f"{self.generation} ({self.row_id}: {self.source}; hardware_profiles/mfu_published.csv)"
        )


MFU_CSV = "mfu_published.csv"
_CAPS: dict[str, MfuCap] = {}


def mfu_caps() -> dict[str, MfuCap]:
    """Per generation (and "" for hardware outside every generation: the highest of all), the
    MfuCap of its published rows, read once per process."""
    if not _CAPS:
        _CAPS.update(_read_caps())
    return _CAPS


def _read_caps() -> dict[str, MfuCap]:
    import csv

    from planner.market.hardware import PROFILE_DIR, ProfileError

    path = PROFILE_DIR / MFU_CSV
    best: dict[str, MfuCap] = {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        for r in rows:
            mfu = float(r["mfu"])
            if not 0 < mfu < 1:
                raise ValueError(f"mfu {mfu} is not a share in (0, 1)")
            for gen in (r["generation"], ""):
                if gen not in best or mfu > best[gen].mfu:
                    best[gen] = MfuCap(gen or "all", mfu, r["id"], r["source"])
    except (OSError, KeyError, ValueError) as e:
        raise ProfileError(
            f"{path}: {e}; each row needs id, generation, mfu in (0, 1), source"
        ) from None
    return best


def mfu_cap(profile) -> MfuCap | None:
    """The cap for `profile`'s generation, else the highest of all generations (None when no
    published run could be read)."""
    from planner.screen.published import generation_of

    caps = mfu_caps()
    return caps.get(generation_of(profile.name)) or caps.get("")
