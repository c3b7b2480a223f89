"""The analytic cost model: every formula the planner uses, each with its source.

All functions take numpy arrays (or scalars) and broadcast, so the whole candidate space is
evaluated at once. Units are explicit in the names: bytes, seconds, hours, FLOP/s.

Sources (see ../shared/REFERENCES.md section 1):
- [N21]  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
         Clusters": parameter count (eq. 2), FLOPs per iteration with/without recompute (eq. 3),
         pipeline bubble (p-1)/m.
- [P22]  Chowdhery et al. 2022, PaLM, appendix B: model FLOPs per token 6N + 12·L·h·s and MFU.
- [K22]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
         Models", table 2: activation memory per layer.
- [Z20]  Rajbhandari et al. 2020, ZeRO: bytes per parameter of model states under sharding.
- [YD]   Young 1974 / Daly 2006: optimal checkpoint interval sqrt(2·delta/lambda).
The model FLOPs and parameter count are shared with the runner (runner.model), so MFU means the
same thing in a plan and in a run report.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.model import parameter_count, training_flops_per_token
from runner.plan import ModelSection

GB = 1e9
RECOMPUTE_MODES = ("none", "core_attn", "full_attn", "full")
SHARDING_STAGES = ("", "stage1", "stage2", "stage3")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    params_total: int
    params_body: int  # without embeddings

    @classmethod
    def from_section(cls, m: ModelSection) -> "ModelShape":
        return cls(m.num_hidden_layers, m.hidden_size, m.num_attention_heads,
                   m.intermediate_size, m.vocab_size, parameter_count(m),
                   parameter_count(m, include_embeddings=False))


# ---- FLOPs -------------------------------------------------------------------------------------

def model_flops_per_token(m: ModelSection, seq_len):
    """[P22] 6N + 12·L·h·s (vectorised over seq_len); see runner.model for the exact N."""
    seq_len = np.asarray(seq_len)
    base = training_flops_per_token(m, 0)
    return base + 12.0 * m.num_hidden_layers * m.hidden_size * seq_len


def recompute_extra_flops_per_token(shape: ModelShape, seq_len, recompute_code):
    """Extra forward work recompute adds per token (hardware FLOPs - model FLOPs).

    full: one more forward of every layer, 2·N_body + 4·L·h·s ([N21] eq. 3 factor 4/3);
    full_attn: the attention block's forward, 8·L·h² + 4·L·h·s;
    core_attn: only the score/value matmuls, 4·L·h·s ([K22] selective recompute).
    """
    L, h = shape.layers, shape.hidden
    s = np.asarray(seq_len, dtype=float)
    attn_core = 4.0 * L * h * s
    full = 2.0 * shape.params_body + attn_core
    full_attn = 8.0 * L * h * h + attn_core
    code = np.asarray(recompute_code)
    return np.select([code == 0, code == 1, code == 2, code == 3],
                     [0.0 * s, attn_core, full_attn, full])


# ---- memory ------------------------------------------------------------------------------------

def model_state_bytes_per_param(mixed_precision, stage_code, shard_degree):
    """[Z20] bytes per parameter for weights + grads + AdamW states on one rank.

    Mixed precision (fp16/bf16): 2 + 2 + 12 (fp32 master, momentum, variance). fp32: 4 + 4 + 8.
    stage1 shards optimizer states, stage2 also grads, stage3 also weights, over shard_degree.
    """
    mixed = np.asarray(mixed_precision, dtype=bool)
    w = np.where(mixed, 2.0, 4.0)
    g = np.where(mixed, 2.0, 4.0)
    o = np.where(mixed, 12.0, 8.0)
    d = np.asarray(shard_degree, dtype=float)
    stage = np.asarray(stage_code)
    return np.select([stage == 0, stage == 1, stage == 2, stage == 3],
                     [w + g + o, w + g + o / d, w + (g + o) / d, (w + g + o) / d])


def activation_bytes_per_layer(shape: ModelShape, seq_len, micro_batch, tp, seq_parallel,
                               recompute_code, act_bytes):
    """[K22] table 2, scaled from 16-bit to `act_bytes` per element.

    none:      s·b·h·(34 + 5·a·s/h)            (tp: 10 + 24/t + 5as/(ht); tp+sp: all / t)
    core_attn: drops the 5·a·s/h term (selective recompute)
    full_attn: keeps layer input, MLP and norms: s·b·h·23 (/t where split)
    full:      only each layer's input, 2·s·b·h
    """
    s = np.asarray(seq_len, dtype=float)
    b = np.asarray(micro_batch, dtype=float)
    t = np.asarray(tp, dtype=float)
    sp = np.asarray(seq_parallel, dtype=bool)
    h, a = shape.hidden, shape.heads
    sbh = s * b * h
    attn_scores = 5.0 * a * s / h
    linear_part = np.where(sp, 34.0 / t, np.where(t > 1, 10.0 + 24.0 / t, 34.0))
    scores_part = attn_scores / t
    code = np.asarray(recompute_code)
    per_layer_16bit = np.select(
        [code == 0, code == 1, code == 2, code == 3],
        [sbh * (linear_part + scores_part), sbh * linear_part,
         sbh * np.where(sp, 23.0 / t, np.where(t > 1, 4.0 + 19.0 / t, 23.0)), 2.0 * sbh])
    return per_layer_16bit * (np.asarray(act_bytes, dtype=float) / 2.0)


def memory_per_device_bytes(shape: ModelShape, *, seq_len, micro_batch, accumulation, tp, pp,
                            stage_code, shard_degree, recompute_code, seq_parallel,
                            mixed_precision, overhead_gb, fragmentation):
    """Peak bytes on the busiest device: model states + activations + logits + overhead.

    Pipeline: the first stage holds activations of min(p, m) micro-batches in flight (1F1B),
    i.e. about L layers' worth [K22]. Logits b·s·V/t in fp32 plus their gradient live on the
    last stage. A fragmentation margin multiplies the dynamic part.
    """
    t = np.asarray(tp, dtype=float)
    p = np.asarray(pp, dtype=float)
    params_per_device = shape.params_total / (t * p)
    states = params_per_device * model_state_bytes_per_param(mixed_precision, stage_code,
                                                             shard_degree)
    act_bytes = np.where(np.asarray(mixed_precision, dtype=bool), 2.0, 4.0)
    per_layer = activation_bytes_per_layer(shape, seq_len, micro_batch, tp, seq_parallel,
                                           recompute_code, act_bytes)
    in_flight = np.minimum(p, np.asarray(accumulation, dtype=float))
    activations = per_layer * (shape.layers / p) * in_flight
    logits = 2.0 * 4.0 * np.asarray(micro_batch) * np.asarray(seq_len) * shape.vocab / t
    dynamic = (activations + logits) * fragmentation
    return states + dynamic + overhead_gb * GB


# ---- time --------------------------------------------------------------------------------------

def compute_efficiency(*, micro_batch, seq_len, hidden_per_tp, eff_max, half_tokens,
                       half_hidden, rolloff_tokens=0.0):
    """Achieved/peak FLOP/s as a function of work per device (calibrated per profile).

    Small micro-batches (few tokens per GEMM) and small hidden sizes run far below peak:
    eff = eff_max · T/(T + T½) · H/(H + H½) · 1/(1 + T/R), T = b·s tokens per micro-batch,
    H = h/t. The last factor is empirical (no paper): on CPUs, efficiency falls again once a
    micro-batch's working set outgrows the caches; R = 0 (the GPU priors) leaves it out, and
    calibration fits it from probes.
    """
    tokens = np.asarray(micro_batch, dtype=float) * np.asarray(seq_len, dtype=float)
    hid = np.asarray(hidden_per_tp, dtype=float)
    rolloff = np.asarray(rolloff_tokens, dtype=float)
    falloff = np.where(rolloff > 0, 1.0 / (1.0 + tokens / np.maximum(rolloff, 1e-9)), 1.0)
    return eff_max * tokens / (tokens + half_tokens) * hid / (hid + half_hidden) * falloff


def ring_allreduce_seconds(bytes_, ranks, bandwidth_bytes_per_s):
    """Ring all-reduce moves 2·(n-1)/n of the buffer through each rank's link."""
    n = np.asarray(ranks, dtype=float)
    return np.where(n > 1, 2.0 * (n - 1) / np.maximum(n, 1) * bytes_ / bandwidth_bytes_per_s,
                    0.0)


def pipeline_bubble_factor(pp, accumulation):
    """[N21] 1F1B: time scales by (m + p - 1)/m for m micro-batches and p stages."""
    m = np.asarray(accumulation, dtype=float)
    p = np.asarray(pp, dtype=float)
    return (m + p - 1.0) / m


# ---- spot and checkpoints ------------------------------------------------------------------

def young_daly_interval_hours(checkpoint_hours, failures_per_hour):
    """[YD] tau = sqrt(2·delta/lambda); infinite when nothing fails."""
    lam = np.asarray(failures_per_hour, dtype=float)
    with np.errstate(divide="ignore"):
        return np.where(lam > 0, np.sqrt(2.0 * checkpoint_hours / np.maximum(lam, 1e-30)),
                        np.inf)


def useful_fraction(checkpoint_hours, interval_hours, failures_per_hour, restart_hours):
    """[YD] 1 - delta/tau - lambda·(tau/2 + R): the share of paid time that trains.

    Clipped at 1% so a hopeless configuration stays finite (it will not be chosen)."""
    tau = np.asarray(interval_hours, dtype=float)
    lam = np.asarray(failures_per_hour, dtype=float)
    finite = np.isfinite(tau)
    safe_tau = np.where(finite, tau, 1.0)
    lost = np.where(finite, checkpoint_hours / safe_tau + lam * (safe_tau / 2 + restart_hours),
                    0.0)
    return np.clip(1.0 - lost, 0.01, 1.0)
