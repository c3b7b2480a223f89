"""Step time of a data-parallel step: the formulas shared by the planner's cost model and the
runner's local rehearsal (`runner execute --local` says how long a step will take here).

All functions take numpy arrays (or scalars) and broadcast. planner.costmodel re-exports the
formulas; planner.search composes them for every layout (tensor, pipeline, sharding, nodes),
`data_parallel_step_time_s` composes the same terms for the one layout a rehearsal uses
(one node, data parallel), and tests/test_rehearsal.py checks both agree.
Sources: [N21] Narayanan et al. 2021 (eq. 3, recompute), [K22] Korthikanti et al. 2022
(selective recompute); the efficiency curve is empirical, calibrated per profile.
"""

from __future__ import annotations

import numpy as np

from runner.memory import ModelShape
from runner.model import training_flops_per_token
from runner.plan import Plan
from runner.profile import PerformanceData

RECOMPUTE_CODES = {"none": 0, "core_attn": 1, "full_attn": 2, "full": 3}


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


def data_parallel_step_time_s(plan: Plan, perf: PerformanceData) -> float:
    """Modelled seconds per optimizer step of `plan` (one node, data parallel) on `perf`.

    compute: tokens per rank x hardware FLOPs per token / (peak x efficiency(b, s, h));
    gradient all-reduce over the node's link, the part not hidden behind backward;
    optimizer: 16 bytes per parameter read and written (3 passes) at memory bandwidth.
    """
    t, m = plan.training, plan.model
    shape = ModelShape.from_section(m)
    ranks = plan.parallel.world_size
    mixed = t.precision != "fp32"
    eff = perf.efficiency_for(t.precision)
    peak = perf.peak_for(t.precision) * 1e12
    if peak <= 0:
        return float("nan")
    f_model = training_flops_per_token(m, t.seq_len)
    f_hw = f_model + float(recompute_extra_flops_per_token(
        shape, t.seq_len, RECOMPUTE_CODES[plan.parallel.recompute]))
    efficiency = float(compute_efficiency(
        micro_batch=t.per_device_train_batch_size, seq_len=t.seq_len,
        hidden_per_tp=m.hidden_size, eff_max=eff.max, half_tokens=eff.half_tokens,
        half_hidden=eff.half_hidden, rolloff_tokens=eff.rolloff_tokens))
    tokens_per_rank = t.per_device_train_batch_size * t.gradient_accumulation_steps * t.seq_len
    t_compute = tokens_per_rank * f_hw / (peak * efficiency)
    grad_bytes = shape.params_total * (2.0 if mixed else 4.0)
    t_dp = float(ring_allreduce_seconds(grad_bytes, ranks,
                                        perf.intra_node_gbytes_per_s * 1e9 or 1.0))
    t_opt = shape.params_total * 16 * 3 / ((perf.memory_bandwidth_gbytes_per_s or 1.0) * 1e9)
    return t_compute + (1 - eff.comm_overlap) * t_dp + t_opt
