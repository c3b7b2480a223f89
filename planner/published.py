"""Published training runs (hardware_profiles/published_runs.csv) and the fit of the
per-generation efficiency priors to them.

The cost model's step time is linear in 1/efficiency once the layout is fixed:
    step = compute_s(eff) · bubble + tp_s · bubble + pp_s + (1 - overlap) · dp_sync_s + opt_s,
    compute_s(eff) = work / eff,  eff = max · T/(T + T½) · H/(H + H½)   (planner.costmodel)
so each row is evaluated once through planner.search.evaluate_layouts and the fit then only
re-weights these parts (fast enough for leave-one-out over hundreds of rows). The fitted
parameters per generation are (max, T½, H½, overlap, attention_relative); the fit minimises a robust (soft-L1) loss
of log(predicted/published) tokens/s per device.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.hardware import PROFILE_DIR, Efficiency, Offer, Profile, load_profiles
from gptplan.plan import ModelSection

RUNS_CSV = PROFILE_DIR / "published_runs.csv"

# Which profiles share a fitted prior: one GPU generation each (A100 40 and 80 GB are the same
# chip; H200 is an H100 with more memory).
GENERATIONS = {"ampere": ("a100-40gb", "a100-80gb"), "hopper": ("h100-80gb", "h200-141gb")}


def generation_of(profile: str) -> str:
    for gen, members in GENERATIONS.items():
        if profile in members:
            return gen
    return ""


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
    parts: dict  # cost-model parts at the reference efficiency (see module docstring)


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


def load_rows(path: Path = RUNS_CSV, profiles: dict[str, Profile] | None = None) -> list[Row]:
    """Every row evaluated once by the cost model at a reference efficiency."""
    from planner import costmodel as cm
    from planner.search import PRECISIONS, evaluate_layouts

    profiles = profiles or load_profiles()
    reference = Efficiency(max=0.5, half_tokens=2048.0, half_hidden=384.0)
    rows = []
    with Path(path).open() as f:
        for rec in csv.DictReader(f):
            i = {k: int(rec[k]) for k in ("nodes", "gpus_per_node", "hidden", "layers", "heads",
                                          "ffn", "vocab", "seq", "micro", "acc", "dp", "tp",
                                          "pp", "vpp", "sharding_degree",
                                          "sequence_parallel", "flash_attention")}
            m = ModelSection(vocab_size=i["vocab"], hidden_size=i["hidden"],
                             num_hidden_layers=i["layers"], num_attention_heads=i["heads"],
                             intermediate_size=i["ffn"], max_position_embeddings=i["seq"])
            prof = profiles[rec["gpu_profile"]]
            offer = Offer(gpus_per_node=i["gpus_per_node"],
                          inter_node_gbits_per_s=float(rec["inter_node_gbits_per_s"]))
            g = {"nodes": [i["nodes"]],
                 "precision_code": [PRECISIONS.index(rec["precision"])],
                 "seq": [i["seq"]], "micro": [i["micro"]], "acc": [i["acc"]],
                 "tp": [i["tp"]], "pp": [i["pp"]], "vpp": [i["vpp"]],
                 "stage_code": [cm.SHARDING_STAGES.index(rec["sharding"])],
                 "shard_degree": [i["sharding_degree"]], "dp": [i["dp"]],
                 "recompute_code": [cm.RECOMPUTE_MODES.index(rec["recompute"])],
                 "sp": [i["sequence_parallel"]], "flash": [i["flash_attention"]]}
            out = evaluate_layouts(m, prof, offer, g, efficiency=reference, overlap=0.0)
            parts = {k: float(out[k][0]) for k in ("compute_s", "efficiency", "tp_s", "pp_s",
                                                   "opt_s", "dp_sync_s", "bubble",
                                                   "tokens_per_step", "world")}
            shape = cm.ModelShape.from_section(m)
            code = cm.RECOMPUTE_MODES.index(rec["recompute"])
            f_hw = float(cm.model_flops_per_token(m, i["seq"]) + cm.recompute_extra_flops_per_token(
                shape, i["seq"], code, i["flash_attention"]))
            f_attn = float(cm.attention_flops_per_token(shape, i["seq"], code,
                                                        i["flash_attention"]))
            work = parts["compute_s"] * parts["efficiency"]
            parts.update(tokens=float(i["micro"] * i["seq"]),
                         hidden_per_tp=i["hidden"] / i["tp"],
                         work_dense=work * (1 - f_attn / f_hw), work_attn=work * f_attn / f_hw)
            params = cm.ModelShape.from_section(m).params_total
            rows.append(Row(rec["id"], rec["source"], rec["gpu_profile"],
                            generation_of(rec["gpu_profile"]), params / 1e9,
                            _size_class(params), int(parts["world"]),
                            _measured_tokens(rec, m), parts))
    return rows


def _columns(rows: list[Row]) -> dict[str, np.ndarray]:
    keys = rows[0].parts.keys()
    cols = {k: np.array([r.parts[k] for r in rows]) for k in keys}
    cols["measured"] = np.array([r.measured_tokens_per_s_per_device for r in rows])
    return cols


def predict(cols: dict[str, np.ndarray], eff_max, half_tokens, half_hidden, overlap,
            attention_relative=1.0) -> np.ndarray:
    """Tokens/s per device of each row under these efficiency parameters."""
    eff = eff_max * cols["tokens"] / (cols["tokens"] + half_tokens) * \
        cols["hidden_per_tp"] / (cols["hidden_per_tp"] + half_hidden)
    work = cols["work_dense"] + cols["work_attn"] / attention_relative
    step = (work / eff + cols["tp_s"]) * cols["bubble"] + cols["pp_s"] + \
        (1.0 - overlap) * cols["dp_sync_s"] + cols["opt_s"]
    return cols["tokens_per_step"] / step / cols["world"]


@dataclass(frozen=True)
class Fit:
    eff_max: float
    half_tokens: float
    half_hidden: float
    overlap: float
    rows: int
    attention_relative: float = 1.0

    @property
    def params(self) -> tuple:
        return (self.eff_max, self.half_tokens, self.half_hidden, self.overlap,
                self.attention_relative)

    def efficiency(self, base: Efficiency, *, source: str, fit_error: float,
                   date: str) -> Efficiency:
        return dataclasses.replace(base, max=round(self.eff_max, 4),
                                   half_tokens=round(self.half_tokens, 1),
                                   half_hidden=round(self.half_hidden, 1),
                                   comm_overlap=round(self.overlap, 3),
                                   attention_relative=round(self.attention_relative, 3),
                                   source=source,
                                   calibrated_at=date, fit_error=round(fit_error, 4))


def fit(cols: dict[str, np.ndarray], mask: np.ndarray | None = None) -> Fit:
    """Least squares on log(pred/measured), soft-L1 (robust to a few odd rows).

    Parameters are bounded to physical ranges: max in (0.05, 0.95), T½ and H½ in (1, 1e5),
    overlap in (0, 0.95)."""
    from scipy.optimize import least_squares

    if mask is not None:
        cols = {k: v[mask] for k, v in cols.items()}
    lo = np.array([math.log(0.05), 0.0, 0.0, -6.0, math.log(0.25)])
    hi = np.array([math.log(0.95), math.log(1e5), math.log(1e5), 3.0, math.log(4.0)])

    def unpack(x):
        return (math.exp(x[0]), math.exp(x[1]), math.exp(x[2]), 0.95 / (1 + math.exp(-x[3])),
                math.exp(x[4]))

    def residuals(x):
        return np.log(predict(cols, *unpack(x)) / cols["measured"])

    x0 = np.array([math.log(0.55), math.log(2048.0), math.log(384.0), 0.0, 0.0])
    res = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1)
    e, t, h, o, a = unpack(res.x)
    return Fit(e, t, h, o, rows=len(cols["measured"]), attention_relative=a)


def relative_errors(cols: dict[str, np.ndarray], f: Fit) -> np.ndarray:
    """|predicted - published| / published, tokens/s per device."""
    pred = predict(cols, *f.params)
    return np.abs(pred - cols["measured"]) / cols["measured"]


def leave_one_out(rows: list[Row]) -> dict[str, np.ndarray]:
    """Per row: the prediction from a fit to the other rows of its generation (never its own).

    Returns arrays aligned with `rows`: predicted, measured, ratio (published/predicted)."""
    cols = _columns(rows)
    gens = np.array([r.generation for r in rows])
    pred = np.full(len(rows), np.nan)
    for gen in sorted(set(gens) - {""}):
        idx = np.flatnonzero(gens == gen)
        for i in idx:
            mask = (gens == gen)
            mask[i] = False
            f = fit(cols, mask)
            pred[i] = predict({k: v[i:i + 1] for k, v in cols.items()}, *f.params)[0]
    return {"predicted": pred, "measured": cols["measured"],
            "ratio": cols["measured"] / pred}


def is_large(row: Row) -> bool:
    from planner.hardware import LARGE_MODEL_PARAMS

    return row.params_billion * 1e9 >= LARGE_MODEL_PARAMS


MIN_LARGE_ROWS = 8  # fewer large-model rows than this: the generation's interval applies


def row_interval(rows: list[Row], ratios: np.ndarray, i: int) -> tuple[float, float]:
    """Row i's 80% interval from the other rows' leave-one-out ratios: p10..p90 of its
    generation, widened to p10..p90 of the generation's large models (>= LARGE_MODEL_PARAMS)
    when row i is large and there are enough of them. Row i never sets its own interval."""
    gens = np.array([r.generation for r in rows])
    large = np.array([is_large(r) for r in rows])
    ok = np.isfinite(ratios)
    ok[i] = False
    lo, hi = interval_ratios(ratios[ok & (gens == gens[i])])
    side = ok & (gens == gens[i]) & large
    if large[i] and side.sum() >= MIN_LARGE_ROWS:
        big_lo, big_hi = interval_ratios(ratios[side])
        lo, hi = min(lo, big_lo), max(hi, big_hi)
    return lo, hi


def interval_ratios(ratios: np.ndarray) -> tuple[float, float]:
    """p10 and p90 of published/modelled: the 80% interval's multipliers on throughput."""
    r = np.asarray(ratios, dtype=float)
    r = r[np.isfinite(r)]
    return float(np.quantile(r, 0.1)), float(np.quantile(r, 0.9))
