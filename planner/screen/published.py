"""Published training runs (hardware_profiles/published_runs.csv) and the fit of the
per-generation constants of the step-time composition (gptplan.steptime.step_time_parts) to
them.

Every row is evaluated by the same composition the planner's search and the runner use; the
fit varies the four constants of a GPU generation (the attainable fraction of peak of large
GEMMs, the per-kernel overhead, the share of data-parallel traffic hidden behind compute, the
attention kernels' rate relative to large GEMMs), minimising a robust (soft-L1) loss of
log(predicted/published) tokens/s per device, each source weighted by the square root of its
row count (one repository's 200 rows do not drown a paper's 4), with a weak prior on each
constant (so a fit to few rows stays physical).

The interval is grouped cross-validation: each SOURCE (paper or repository) is predicted by a
fit to the other sources of its generation; its rows' published/modelled ratios, each source
weighted equally, give p10/p90, widened for few sources (see `interval_from_sources`).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptplan import families
from gptplan import precision as precision_table
from gptplan.memory import ModelShape
from gptplan.modelfacts import parameter_count
from gptplan.plan import RECOMPUTE_MODES, SHARDING_STAGES, ModelSection
from gptplan.steptime import Device, Rates, step_time_parts
from planner.market.hardware import PROFILE_DIR, Profile, ProfileError, load_profiles

RUNS_CSV = PROFILE_DIR / "published_runs.csv"

# Which profiles share fitted constants: one GPU generation each (A100 40 and 80 GB are the same
# chip; H200 is an H100 with more memory).
GENERATIONS = {
    "ampere": ("a100-40gb", "a100-80gb"),
    "hopper": ("h100-80gb", "h200-141gb", "h100-pcie"),
}
# A run's precision is any row of gptplan.precision: the planner's, plus "fp8" for published
# Transformer Engine runs (GEMMs in FP8, the rest bf16; fitting only, never a plan's choice).
# The prior each constant is pulled towards (weakly: PRIOR_SIGMA in log space), and bounds.
PRIOR = {"gemm_max": 0.7, "kernel_overhead_us": 5.0, "overlap": 0.5, "attention_fraction": 0.7}
PRIOR_SIGMA = 5.0  # log units: only breaks ties a few rows cannot settle


def generation_of(profile: str) -> str:
    for gen, members in GENERATIONS.items():
        if profile in members:
            return gen
    return ""


def source_key(source: str) -> str:
    """The paper or repository a row comes from: its source up to the table/path/comma."""
    return re.split(r",| table| scripts/| benchmarks/| section", source)[0].strip()


@dataclass(frozen=True)
class Row:
    id: str
    source: str
    profile: str
    generation: str
    params_billion: float
    size_class: str
    world: int
    measured_tokens_per_s_per_device: float
    source_key: str = ""
    tp: int = 1
    pp: int = 1
    record: dict = field(default_factory=dict, repr=False, compare=False)  # the CSV row
    model: ModelSection = field(default_factory=ModelSection, repr=False, compare=False)
    prof: Profile = field(default_factory=Profile, repr=False, compare=False)


def _size_class(params: float) -> str:
    if params < 1.5e9:
        return "<1.5B"
    if params < 15e9:
        return "1.5-15B"
    if params < 100e9:
        return "15-100B"
    return ">=100B"


def _measured_tokens(rec: dict, m: ModelSection) -> float:
    value, unit = float(rec["measured"]), rec["measured_unit"]
    if unit == "tokens_per_s_per_device":
        return value
    if unit == "tflops_per_device_megatron_eq3":
        # Narayanan et al. 2021 eq. 3 per token (with recompute): 96·L·h²·(1 + s/6h + V/16Lh)
        L, h, s, V = m.num_hidden_layers, m.hidden_size, int(rec["seq"]), m.vocab_size
        flops = 96.0 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
        return value * 1e12 / flops
    raise ValueError(f"unknown measured_unit {unit!r}")


def _model(rec: dict) -> ModelSection:
    i = {k: int(rec[k]) for k in ("hidden", "layers", "heads", "ffn", "vocab", "seq")}
    return ModelSection(
        family=rec.get("family") or families.DEFAULT_FAMILY,
        vocab_size=i["vocab"],
        hidden_size=i["hidden"],
        num_hidden_layers=i["layers"],
        num_attention_heads=i["heads"],
        intermediate_size=i["ffn"],
        max_position_embeddings=i["seq"],
        num_key_value_heads=int(rec.get("kv_heads") or 0),
        # dropout as the source states it ("" = not stated: GPT-3's 0.1)
        hidden_dropout_prob=float(rec.get("dropout") or 0.1),
        attention_probs_dropout_prob=float(rec.get("dropout") or 0.1),
    )


REQUIRED_COLUMNS = (
    "id", "source", "gpu_profile", "nodes", "gpus_per_node", "hidden", "layers", "heads", "ffn",
    "vocab", "seq", "micro", "acc", "dp", "tp", "pp", "vpp", "sharding", "sharding_degree",
    "recompute", "sequence_parallel", "flash_attention", "precision", "inter_node_gbits_per_s",
    "measured", "measured_unit",
)  # fmt: skip
POSITIVE_INTS = ("nodes", "gpus_per_node", "hidden", "layers", "heads", "ffn", "vocab", "seq",
                 "micro", "acc", "dp", "tp", "pp", "vpp", "sharding_degree")  # fmt: skip


def _row(rec: dict, profiles: dict[str, Profile]) -> Row:
    """One CSV record as a Row; ValueError (with the column) for a value out of its range."""
    if rec["gpu_profile"] not in profiles:
        raise ValueError(f"gpu_profile {rec['gpu_profile']!r} is not a hardware profile")
    for key, allowed in (
        ("precision", precision_table.TABLE.by_name),
        ("sharding", SHARDING_STAGES),
        ("recompute", RECOMPUTE_MODES),
    ):
        if rec[key] not in allowed:
            raise ValueError(f"{key} {rec[key]!r}; allowed: {', '.join(map(repr, allowed))}")
    for key in POSITIVE_INTS:
        if int(rec[key]) < 1:
            raise ValueError(f"{key} {rec[key]!r} must be a positive integer")
    if not float(rec["measured"]) > 0:
        raise ValueError(f"measured {rec['measured']!r} must be positive")
    prof = profiles[rec["gpu_profile"]]
    row = precision_table.row(rec["precision"])
    if row.narrow_gemms and not prof.peak_for(row.name):
        raise ValueError(
            f"precision {row.name} on {rec['gpu_profile']}, whose profile has no "
            f"{' or '.join(row.gemm_peak)} peak"
        )
    m = _model(rec)
    params = parameter_count(m)
    return Row(
        rec["id"],
        rec["source"],
        rec["gpu_profile"],
        generation_of(rec["gpu_profile"]),
        params / 1e9,
        _size_class(params),
        int(rec["nodes"]) * int(rec["gpus_per_node"]),
        _measured_tokens(rec, m),
        source_key(rec["source"]),
        int(rec["tp"]),
        int(rec["pp"]),
        rec,
        m,
        prof,
    )


def load_rows(path: Path = RUNS_CSV, profiles: dict[str, Profile] | None = None) -> list[Row]:
    """Every row with its layout (kept in `_columns`, evaluated vectorised by `predict`).
    A file that cannot be read, lacks a column or holds a bad value is one ProfileError naming
    the file, the line and the column (the planner's interval reads it: planner.screen.coverage)."""
    profiles = profiles or load_profiles()
    file = str(path)
    rows: list[Row] = []
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ProfileError(
                    f"missing column(s) {', '.join(missing)}", file=file, key="header"
                )
            for line, rec in enumerate(reader, start=2):
                try:
                    rows.append(_row(rec, profiles))
                except (KeyError, ValueError, TypeError, ZeroDivisionError) as exc:
                    raise ProfileError(
                        f"{exc}", file=file, key=f"line {line} (id {rec.get('id')!r})"
                    ) from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ProfileError(f"cannot read the published runs: {exc}", file=file) from None
    if not rows:
        raise ProfileError("holds no published runs", file=file)
    return rows


def _columns(rows: list[Row]) -> dict:
    """The rows as arrays: model shape, layout, device and published tokens/s per device."""
    recs = [(r.record, r.model, r.prof) for r in rows]

    def col(key, fn=int):
        return np.array([fn(rec[key]) for rec, _, _ in recs])

    # none of the published runs ran on Paddle: no PaddleNLP buffers or Paddle partitions
    shapes = [ModelShape.from_section(m).framework_neutral() for _, m, _ in recs]
    shape = _shape_columns(
        {f: np.array([getattr(sh, f) for sh in shapes]) for f in ModelShape.__dataclass_fields__}
    )
    g = {
        "nodes": col("nodes"),
        "seq": col("seq"),
        "micro": col("micro"),
        "acc": col("acc"),
        "tp": col("tp"),
        "pp": col("pp"),
        "vpp": col("vpp"),
        "dp": col("dp"),
        "shard_degree": col("sharding_degree"),
        "sp": col("sequence_parallel"),
        "flash": col("flash_attention"),
        "precision_code": col("precision", precision_table.code),
        "stage_code": col("sharding", SHARDING_STAGES.index),
        "recompute_code": col("recompute", RECOMPUTE_MODES.index),
    }
    profs = [p for _, _, p in recs]

    dev = Device(
        np.array(
            [
                float(rec.get("device_peak_tflops") or p.non_gemm_peak_for(rec["precision"])) * 1e12
                for rec, _, p in recs
            ]
        ),
        np.array([p.sm_count for p in profs]),
        np.array(
            [
                float(rec.get("device_hbm_gbytes_per_s") or p.memory_bandwidth_gbytes_per_s) * 1e9
                for rec, _, p in recs
            ]
        ),
        np.array([p.intra_node_gbytes_per_s * 1e9 for p in profs]),
        col("inter_node_gbits_per_s", float) / 8 * 1e9,
        col("gpus_per_node"),
        # the narrow GEMMs' own peak (FP8 runs; gptplan.precision's narrow_gemms rows)
        np.array([p.peak_for(rec["precision"]) * 1e12 for rec, _, p in recs]),
    )
    return {
        "shape": shape,
        "g": g,
        "dev": dev,
        "tokens_per_step": g["micro"] * g["acc"] * g["seq"] * g["dp"] * g["shard_degree"],
        "world": col("nodes") * col("gpus_per_node"),
        "measured": np.array([r.measured_tokens_per_s_per_device for r in rows]),
        "source": np.array([r.source_key for r in rows]),
    }


def _shape_columns(columns: dict[str, Any]) -> ModelShape:
    """A ModelShape of numpy columns, one entry per row (gptplan.memory's formulas take
    numbers or arrays alike)."""
    return ModelShape(**columns)


def _subset(cols: dict, mask) -> dict:
    idx = (
        np.flatnonzero(np.broadcast_to(mask, cols["measured"].shape))
        if np.asarray(mask).dtype == bool
        else np.asarray(mask)
    )
    sh = cols["shape"]
    shape = _shape_columns({f: np.asarray(getattr(sh, f))[idx] for f in sh.__dataclass_fields__})
    return {
        "shape": shape,
        "g": {k: v[idx] for k, v in cols["g"].items()},
        "dev": Device(
            *(np.asarray(getattr(cols["dev"], f))[idx] for f in cols["dev"].__dataclass_fields__)
        ),
        **{k: cols[k][idx] for k in ("tokens_per_step", "world", "measured", "source")},
    }


def predict(cols: dict, gemm_max, kernel_overhead_us, overlap, attention_fraction) -> np.ndarray:
    """Tokens/s per device of each row under these constants (step_time_parts)."""
    parts = step_time_parts(
        cols["shape"],
        cols["g"],
        cols["dev"],
        Rates(gemm_max, kernel_overhead_us * 1e-6, overlap, attention_fraction),
    )
    return cols["tokens_per_step"] / parts["step_time_s"] / cols["world"]


def modelled_memory_over_device(rows: list[Row]) -> np.ndarray:
    """Per row: the memory model's peak per device (gptplan.memory, the planner's own rule)
    over the device's memory. Every published run ran, so a ratio above 1 is an overestimate
    of at least that much."""
    from gptplan.memory import GIB

    mem = sum(published_memory_terms(rows).values())
    return mem / (np.array([r.prof.memory_gb for r in rows]) * GIB)


def published_memory_terms(rows: list[Row]) -> dict:
    """Per row the memory model's terms (gptplan.memory.memory_terms) with the GPU-side terms
    (every published run ran on GPUs; gptplan.memory.device_memory_args)."""
    from gptplan.memory import (
        OPTIMISTIC_FLOOR,
        TERMS,
        device_memory_args,
        layout_memory_bytes,
        memory_band,
    )

    cols = _columns(rows)
    args = device_memory_args("gpu", 0.0, 1.0)
    terms = layout_memory_bytes(cols["shape"], cols["g"], terms=True, **args)
    # every published run is another framework's: its selective recompute is its own scheme,
    # at least what full recompute keeps (gptplan.memory [SELECTIVE])
    code = cols["g"]["recompute_code"]
    selective = np.isin(code, [RECOMPUTE_MODES.index(m) for m in ("core_attn", "full_attn")])
    if selective.any():
        full = dict(
            cols["g"], recompute_code=np.where(selective, RECOMPUTE_MODES.index("full"), code)
        )
        floor, _, _, _ = memory_band(layout_memory_bytes(cols["shape"], full, terms=True, **args))
        point = sum(np.asarray(terms[k], dtype=float) for k in TERMS)
        terms[OPTIMISTIC_FLOOR] = np.where(selective, floor, point)
    return terms


@dataclass(frozen=True)
class Fit:
    gemm_max: float
    kernel_overhead_us: float
    overlap: float
    attention_fraction: float
    rows: int

    @property
    def params(self) -> tuple:
        return (self.gemm_max, self.kernel_overhead_us, self.overlap, self.attention_fraction)


def source_weights(sources: np.ndarray) -> np.ndarray:
    """Per row 1/sqrt(rows of its source) on the squared residual scale: a source's total
    weight grows with the square root of its size."""
    _, inverse, counts = np.unique(sources, return_inverse=True, return_counts=True)
    return 1.0 / np.sqrt(counts[inverse])


def fit(cols: dict, mask: np.ndarray | None = None) -> Fit:
    """Robust least squares (soft-L1) on log(pred/published), sources weighted (see module
    docstring), each constant pulled weakly towards PRIOR. Bounds: GEMM fraction 0.2-0.95,
    kernel overhead 0.5-100 us, overlap 0-0.95, attention fraction 0.2-2."""
    from scipy.optimize import least_squares

    if mask is not None:
        cols = _subset(cols, mask)
    w = np.sqrt(source_weights(cols["source"]))
    names = ("gemm_max", "kernel_overhead_us", "overlap", "attention_fraction")
    prior = np.log([PRIOR[n] for n in names])
    lo = np.log([0.2, 0.5, 1e-3, 0.2])
    hi = np.log([0.95, 100.0, 0.95, 2.0])

    def residuals(x):
        pred = predict(cols, *np.exp(x))
        return np.concatenate([w * np.log(pred / cols["measured"]), (x - prior) / PRIOR_SIGMA])

    res = least_squares(
        residuals,
        np.clip(prior, lo + 1e-6, hi - 1e-6),
        bounds=(lo, hi),
        loss="soft_l1",
        f_scale=0.1,
    )
    gemm_max, overhead_us, overlap, attention = (float(v) for v in np.exp(res.x))
    return Fit(gemm_max, overhead_us, overlap, attention, rows=len(cols["measured"]))


def relative_errors(cols: dict, f: Fit) -> np.ndarray:
    """|predicted - published| / published, tokens/s per device."""
    pred = predict(cols, *f.params)
    return np.abs(pred - cols["measured"]) / cols["measured"]


def _held_out(rows: list[Row], groups: np.ndarray) -> dict[str, np.ndarray]:
    """Per row: the prediction from a fit to the rows of its generation outside its group."""
    cols = _columns(rows)
    gens = np.array([r.generation for r in rows])
    pred = np.full(len(rows), np.nan)
    for gen in sorted(set(gens) - {""}):
        for grp in sorted(set(groups[gens == gen])):
            test = (gens == gen) & (groups == grp)
            train = (gens == gen) & (groups != grp)
            if not train.any():
                continue
            f = fit(cols, train)
            pred[test] = predict(_subset(cols, test), *f.params)
    return {"predicted": pred, "measured": cols["measured"], "ratio": cols["measured"] / pred}


def leave_one_out(rows: list[Row]) -> dict[str, np.ndarray]:
    """Leave-one-ROW-out: each row predicted by a fit to the other rows of its generation."""
    return _held_out(rows, np.arange(len(rows)))


def leave_one_source_out(rows: list[Row]) -> dict[str, np.ndarray]:
    """Leave-one-SOURCE-out: each row predicted by a fit to the OTHER sources of its
    generation (never its own paper or repository), the error a user meets on a new source."""
    return _held_out(rows, np.array([r.source_key for r in rows]))


# Regimes held out one at a time (issue 17): each is predicted by a fit to the rows of its
# generation outside it, which measures extrapolation along one axis (planner.screen.coverage checks
# the same axes of a query).
REGIMES = {
    "tp > 1": lambda r: r.tp > 1,
    "pp > 1": lambda r: r.pp > 1,
    "> 256 GPUs": lambda r: r.world > 256,
    ">= 30B": lambda r: r.params_billion >= 30,
    "ZeRO-3": lambda r: r.record.get("sharding") == "stage3",
    "full recompute": lambda r: r.record.get("recompute") == "full",
    "llama family": lambda r: r.record.get("family") == "llama",
    "seq > 2048": lambda r: int(r.record.get("seq") or 0) > 2048,
}
MIN_REGIMES = 2  # fewer measurable regimes: DEFAULT_EXTRAPOLATION_LOG_ERROR (stated)
DEFAULT_EXTRAPOLATION_LOG_ERROR = 0.4  # about x1.5 either way, not measured


def leave_one_regime_out(rows: list[Row]) -> dict[str, dict[str, np.ndarray]]:
    """Per regime: its rows' predictions from a fit to the rows of their generation OUTSIDE
    the regime ("mask" marks the regime's rows; elsewhere the values are a fit to the regime,
    not used)."""
    out = {}
    for name, test in REGIMES.items():
        mask = np.array([test(r) for r in rows])
        out[name] = {"mask": mask, **_held_out(rows, mask.astype(int))}
    return out


def extrapolation_log_error(
    rows: list[Row], loo_ratio: np.ndarray, regime_out: dict, generation: str
) -> tuple[float, dict[str, float]]:
    """The generation's extra error per axis a query lies outside the rows on
    (planner.screen.coverage): per regime with >= 3 rows and rows outside it, e = sqrt(max(q_regime²
    - q_loo², 0)), q the 80th percentile of |log(published/modelled)| of the regime's rows with the
    regime held out and with only the row held out (both fits keep the rows' sources, so the
    difference is what leaving the regime's range costs; sources weighted equally; independent
    errors add in quadrature). The largest over the regimes; with fewer than MIN_REGIMES measurable
    regimes DEFAULT_EXTRAPOLATION_LOG_ERROR. Returns (e, per-regime e)."""
    gens = np.array([r.generation for r in rows])
    srcs = np.array([r.source_key for r in rows])
    per = {}
    for name, reg in regime_out.items():
        m = reg["mask"] & (gens == generation) & np.isfinite(reg["ratio"]) & np.isfinite(loo_ratio)
        if m.sum() < 3 or not ((gens == generation) & ~reg["mask"]).any():
            continue
        _, inv, cnt = np.unique(srcs[m], return_inverse=True, return_counts=True)
        w = 1.0 / cnt[inv]
        held = weighted_quantile(np.abs(np.log(reg["ratio"][m])), w, 0.8)
        base = weighted_quantile(np.abs(np.log(loo_ratio[m])), w, 0.8)
        per[name] = math.sqrt(max(held**2 - base**2, 0.0))
    if len(per) < MIN_REGIMES:
        return DEFAULT_EXTRAPOLATION_LOG_ERROR, per
    return max(per.values()), per


def is_large(row: Row) -> bool:
    from planner.market.hardware import LARGE_MODEL_PARAMS

    return row.params_billion * 1e9 >= LARGE_MODEL_PARAMS


MIN_LARGE_ROWS = 8  # fewer large-model rows than this: the generation's interval applies
Z90 = 1.2816  # the standard normal's 90th percentile


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    v, w = np.asarray(values)[order], np.asarray(weights, dtype=float)[order]
    cum = (np.cumsum(w) - 0.5 * w) / w.sum()
    return float(np.interp(q, cum, v))


MIN_SOURCES = 3  # fewer cannot measure the spread between sources
UNMEASURED_INTERVAL = (0.6, 1.7)  # gptplan.profile.Efficiency's default for unfitted hardware


def small_sample_widening(sources: int) -> float:
    """The stated rule for few sources: the log-interval is stretched by t(0.9, n-1)/z(0.9),
    Student's t over the normal at n sources (a predictive interval from n groups)."""
    from scipy.stats import t

    return float(t.ppf(0.9, max(sources, 2) - 1) / Z90)


def interval_from_sources(ratios: np.ndarray, sources: np.ndarray) -> tuple[float, float, int]:
    """p10, p90 of held-out published/modelled ratios, each SOURCE weighted equally (a row's
    weight 1/rows of its source), widened around the median by `small_sample_widening`; with
    fewer than MIN_SOURCES sources the spread between sources is not measured at all, so the
    interval is at least UNMEASURED_INTERVAL (unwidened). Returns (p10, p90, sources)."""
    ok = np.isfinite(ratios)
    r, src = np.log(ratios[ok]), sources[ok]
    _, inverse, counts = np.unique(src, return_inverse=True, return_counts=True)
    w = 1.0 / counts[inverse]
    med = weighted_quantile(r, w, 0.5)
    k = small_sample_widening(len(counts)) if len(counts) >= MIN_SOURCES else 1.0
    lo = math.exp(min(med + (weighted_quantile(r, w, 0.1) - med) * k, 0.0))
    hi = math.exp(max(med + (weighted_quantile(r, w, 0.9) - med) * k, 0.0))
    if len(counts) < MIN_SOURCES:
        lo, hi = min(lo, UNMEASURED_INTERVAL[0]), max(hi, UNMEASURED_INTERVAL[1])
    return lo, hi, len(counts)


def row_interval(rows: list[Row], ratios: np.ndarray, i: int) -> tuple[float, float]:
    """Row i's 80% interval from the held-out ratios of the OTHER sources of its generation
    (its own source never sets it): `interval_from_sources`, and for a large model the wider of
    that and the large rows' own (when there are MIN_LARGE_ROWS of them)."""
    gens = np.array([r.generation for r in rows])
    srcs = np.array([r.source_key for r in rows])
    large = np.array([is_large(r) for r in rows])
    ok = np.isfinite(ratios) & (gens == gens[i]) & (srcs != srcs[i])
    if not ok.any():
        return float("nan"), float("nan")
    lo, hi, _ = interval_from_sources(ratios[ok], srcs[ok])
    side = ok & large
    if large[i] and side.sum() >= MIN_LARGE_ROWS:
        big_lo, big_hi, _ = interval_from_sources(ratios[side], srcs[side])
        lo, hi = min(lo, big_lo), max(hi, big_hi)
    return lo, hi
