"""Step time of a data-parallel step: the formulas shared by the planner's cost model and the
runner's local rehearsal (`runner execute --local` says how long a step will take here).

All functions take numpy arrays (or scalars) and broadcast. planner.costmodel re-exports the
formulas; planner.search composes them for every layout (tensor, pipeline, sharding, nodes),
`data_parallel_step_time_s` composes the same terms for the one layout a rehearsal uses
(one node, data parallel), and tests/test_rehearsal.py checks both agree.
Sources: [N21] Narayanan et al. 2021 (eq. 3, recompute), [K22] Korthikanti et al. 2022
(selective recompute), [Z20] Rajbhandari et al. 2020 (ZeRO communication volume), [FA] Dao et
al. 2022 (FlashAttention recomputes the scores in backward); the efficiency curve is empirical,
calibrated per profile.
"""

from __future__ import annotations

import numpy as np

from gptplan.memory import ModelShape
from gptplan.modelfacts import training_flops_per_token
from gptplan.plan import Plan
from gptplan.profile import PerformanceData

RECOMPUTE_CODES = {"none": 0, "core_attn": 1, "full_attn": 2, "full": 3}


def recompute_extra_flops_per_token(shape: ModelShape, seq_len, recompute_code,
                                    flash_attention=False):
    """Extra forward work recompute adds per token (hardware FLOPs - model FLOPs).

    full: one more forward of every layer, 2·N_body + 4·L·h·s ([N21] eq. 3 factor 4/3);
    full_attn: the attention block's forward, 8·L·h² + 4·L·h·s;
    core_attn: only the score/value matmuls, 4·L·h·s ([K22] selective recompute).
    flash_attention: the fused kernel recomputes the scores in its backward pass, one more
    attention forward, 4·L·h·s [FA] (llm-foundry's HFU note: attention multiplier 5, not 4);
    core_attn recompute then adds nothing more (the scores are never stored).
    """
    L, h = shape.layers, shape.hidden
    s = np.asarray(seq_len, dtype=float)
    attn_core = 4.0 * L * h * s
    full = 2.0 * shape.params_body + attn_core
    full_attn = 8.0 * L * h * h + attn_core
    code = np.asarray(recompute_code)
    flash = np.asarray(flash_attention, dtype=bool)
    extra = np.select([code == 0, code == 1, code == 2, code == 3],
                      [0.0 * s, np.where(flash, 0.0, attn_core), full_attn, full])
    return extra + np.where(flash, attn_core, 0.0)


def attention_flops_per_token(shape: ModelShape, seq_len, recompute_code,
                              flash_attention=False):
    """The part of the hardware FLOPs per token spent in the attention score/value matmuls:
    12·L·h·s of model FLOPs [P22], plus 4·L·h·s for each recomputed attention forward
    (core_attn/full_attn/full recompute without flash; flash attention's backward always)."""
    L, h = shape.layers, shape.hidden
    s = np.asarray(seq_len, dtype=float)
    core = 4.0 * L * h * s
    code = np.asarray(recompute_code)
    flash = np.asarray(flash_attention, dtype=bool)
    recomputed = np.where(code == 0, 0.0, np.where((code == 1) & flash, 0.0, core))
    return 12.0 * L * h * s + recomputed + np.where(flash, core, 0.0)


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


def collective_seconds(bytes_per_rank, ranks, ranks_per_node, gpus_per_node,
                       intra_bytes_per_s, inter_bytes_per_s, passes):
    """Time of a ring collective over `ranks` ranks, `ranks_per_node` of them in each node.

    `passes` = 2 for an all-reduce, 1 for a reduce-scatter or an all-gather. Hierarchical
    (NCCL's tree/ring over nodes): inside a node the buffer moves (r-1)/r of itself over
    NVLink; across the k nodes of the group each rank carries 1/r of it, and all
    `gpus_per_node` ranks of a node (every tensor/pipeline shard runs its own group at the
    same time) share the node's network link.
    """
    n = np.asarray(ranks, dtype=float)
    r = np.minimum(n, np.maximum(np.asarray(ranks_per_node, dtype=float), 1.0))
    k = np.maximum(n / r, 1.0)
    b = np.asarray(bytes_per_rank, dtype=float)
    t_intra = passes * (r - 1.0) / r * b / intra_bytes_per_s
    t_inter = passes * (k - 1.0) / k * (b / r) * gpus_per_node / inter_bytes_per_s
    return np.where(n > 1, t_intra + t_inter, 0.0)


def gradient_sync_seconds(*, params, grad_bytes, tp, pp, dp, shard_degree, stage_code,
                          accumulation, gpus_per_node, intra_bytes_per_s, inter_bytes_per_s):
    """Gradient synchronisation per optimizer step, per rank.

    Each rank holds only its tensor x pipeline shard, G = N/(t·p) parameters [N21]; the data
    and sharding groups synchronise that shard, never the whole model. Ranks are laid out as
    Paddle's hybrid topology does (model-parallel ranks innermost, then sharding, then data),
    so r = devices_per_node/(t·p) batch ranks share a node. ZeRO [Z20]:
    - no sharding: one all-reduce of G over dp;
    - stage1: reduce-scatter grads + all-gather params over the sharding group, once a step;
    - stage2: grads reduce-scattered after every micro-batch, params gathered once a step;
    - stage3: per micro-batch two parameter all-gathers (forward, backward) + a reduce-scatter.
    Hybrid (sharding degree < batch ranks): then an all-reduce of the 1/sd shard across the
    data-parallel groups, once a step (PaddleNLP's sharding inside a node, dp across nodes).
    """
    tp = np.asarray(tp, dtype=float)
    pp = np.asarray(pp, dtype=float)
    dp = np.asarray(dp, dtype=float)
    sd = np.asarray(shard_degree, dtype=float)
    stage = np.asarray(stage_code)
    acc = np.asarray(accumulation, dtype=float)
    shard_bytes = params / (tp * pp) * np.asarray(grad_bytes, dtype=float)
    in_node = np.maximum(1.0, gpus_per_node // (tp * pp))
    links = dict(gpus_per_node=gpus_per_node, intra_bytes_per_s=intra_bytes_per_s,
                 inter_bytes_per_s=inter_bytes_per_s)
    plain = collective_seconds(shard_bytes, dp * sd, in_node, passes=2, **links)
    one_pass = collective_seconds(shard_bytes, sd, np.minimum(sd, in_node), passes=1, **links)
    sharded = np.select([stage == 1, stage == 2, stage == 3],
                        [2.0 * one_pass, (acc + 1.0) * one_pass, 3.0 * acc * one_pass],
                        0.0)
    across = collective_seconds(shard_bytes / sd, dp, np.maximum(1.0, in_node // sd),
                                passes=2, **links)
    return np.where(stage == 0, plain, sharded + np.where(dp > 1, across, 0.0))


def data_parallel_step_time_s(plan: Plan, perf: PerformanceData) -> float:
    """Modelled seconds per optimizer step of `plan` (one node, data parallel) on `perf`:
    planner.search.evaluate_layouts' terms for tp = pp = 1, no sharding, one node.

    compute: tokens per rank x hardware FLOPs per token / (peak x efficiency(b, s, h));
    gradient sync (an all-reduce over the node's link), the part not hidden behind backward;
    optimizer: 16 bytes per parameter read and written (3 passes) at memory bandwidth.
    """
    t, m = plan.training, plan.model
    shape = ModelShape.from_section(m)
    ranks = plan.parallel.world_size
    mixed = t.precision != "fp32"
    flash = bool(getattr(t, "use_flash_attention", False))
    eff = perf.efficiency_for(t.precision)
    peak = perf.peak_for(t.precision) * 1e12
    if peak <= 0:
        return float("nan")
    f_model = training_flops_per_token(m, t.seq_len)
    f_hw = f_model + float(recompute_extra_flops_per_token(
        shape, t.seq_len, RECOMPUTE_CODES[plan.parallel.recompute], flash))
    efficiency = float(compute_efficiency(
        micro_batch=t.per_device_train_batch_size, seq_len=t.seq_len,
        hidden_per_tp=m.hidden_size, eff_max=eff.max, half_tokens=eff.half_tokens,
        half_hidden=eff.half_hidden, rolloff_tokens=eff.rolloff_tokens))
    tokens_per_rank = t.per_device_train_batch_size * t.gradient_accumulation_steps * t.seq_len
    f_attn = float(attention_flops_per_token(
        shape, t.seq_len, RECOMPUTE_CODES[plan.parallel.recompute], flash))
    f_effective = f_hw - f_attn + f_attn / eff.attention_relative
    t_compute = tokens_per_rank * f_effective / (peak * efficiency)
    t_dp = float(gradient_sync_seconds(
        params=shape.params_total, grad_bytes=2.0 if mixed else 4.0, tp=1, pp=1, dp=ranks,
        shard_degree=1, stage_code=0, accumulation=t.gradient_accumulation_steps,
        gpus_per_node=plan.parallel.nproc_per_node,
        intra_bytes_per_s=perf.intra_node_gbytes_per_s * 1e9 or 1.0, inter_bytes_per_s=1.0))
    t_opt = shape.params_total * 16 * 3 / ((perf.memory_bandwidth_gbytes_per_s or 1.0) * 1e9)
    return t_compute + (1 - perf.efficiency.comm_overlap) * t_dp + t_opt
