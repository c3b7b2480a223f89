"""The analytic cost model: every formula the planner uses, each with its source.

All functions take numpy arrays (or scalars) and broadcast, so the whole candidate space is
evaluated at once. Units are explicit in the names: bytes, seconds, hours, FLOP/s.

Sources (see ../shared/REFERENCES.md section 1):
- [N21]  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
         Clusters": parameter count (eq. 2), FLOPs per iteration with/without recompute (eq. 3),
         pipeline bubble (p-1)/m.
- [P22]  Chowdhery et al. 2022, PaLM, appendix B: model FLOPs per token 6N + 12·L·h·s and MFU.
- [K22], [Z20]: memory per device (activations, model states) lives in runner.memory, shared
         with the runner's local rehearsal, and is re-exported here.
- [Z20]  Rajbhandari et al. 2020, ZeRO: communication volume of each sharding stage.
- [FA]   Dao et al. 2022, FlashAttention: scores recomputed in the backward pass.
- [YD]   Young 1974 / Daly 2006: optimal checkpoint interval sqrt(2·delta/lambda).
The model FLOPs and parameter count are shared with the runner (runner.model), so MFU means the
same thing in a plan and in a run report.
"""

from __future__ import annotations

import numpy as np

from runner.memory import (GB, ModelShape, activation_bytes_per_layer,  # noqa: F401
                           memory_per_device_bytes, model_state_bytes_per_param)
from runner.model import training_flops_per_token
from runner.plan import ModelSection

RECOMPUTE_MODES = ("none", "core_attn", "full_attn", "full")
SHARDING_STAGES = ("", "stage1", "stage2", "stage3")


# ---- FLOPs -------------------------------------------------------------------------------------

def model_flops_per_token(m: ModelSection, seq_len):
    """[P22] 6N + 12·L·h·s (vectorised over seq_len); see runner.model for the exact N."""
    seq_len = np.asarray(seq_len)
    base = training_flops_per_token(m, 0)
    return base + 12.0 * m.num_hidden_layers * m.hidden_size * seq_len


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


def pipeline_bubble_factor(pp, accumulation, virtual_pp=1):
    """[N21] 1F1B: time scales by (m + p - 1)/m for m micro-batches and p stages; the
    interleaved schedule with v model chunks per stage shrinks the bubble v-fold,
    (m + (p - 1)/v)/m ([N21] section 2.2.2), at v times the point-to-point traffic."""
    m = np.asarray(accumulation, dtype=float)
    p = np.asarray(pp, dtype=float)
    v = np.asarray(virtual_pp, dtype=float)
    return (m + (p - 1.0) / v) / m


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


# ---- uncertainty -------------------------------------------------------------------------------

def interval_from_throughput(*, tokens_per_s, hours, fixed_hours, cost, p10_ratio, p90_ratio):
    """The 80% interval (p10..p90) on modelled throughput, hours and cost.

    p10_ratio/p90_ratio are the 10th/90th percentiles of measured/modelled tokens/s from the
    fit's leave-one-out residuals (hardware profile [efficiency]). Time that scales with
    throughput (training, checkpoints, lost work) scales by 1/ratio; fixed time (start-up)
    does not; cost follows hours. The fast end of throughput is the short, cheap end:
    hours_p10 comes from throughput_p90.
    """
    tps = np.asarray(tokens_per_s, dtype=float)
    h = np.asarray(hours, dtype=float)
    fixed = np.asarray(fixed_hours, dtype=float)
    lo, hi = np.asarray(p10_ratio, dtype=float), np.asarray(p90_ratio, dtype=float)
    variable = np.maximum(h - fixed, 0.0)
    per_hour = np.asarray(cost, dtype=float) / np.maximum(h, 1e-12)
    hours_p10 = variable / hi + fixed
    hours_p90 = variable / lo + fixed
    return {"tokens_per_s_p10": tps * lo, "tokens_per_s_p90": tps * hi,
            "hours_p10": hours_p10, "hours_p90": hours_p90,
            "cost_p10": per_hour * hours_p10, "cost_p90": per_hour * hours_p90}


# ---- spot and checkpoints ------------------------------------------------------------------

def checkpoint_write_hours(*, state_bytes, nodes, node_gbytes_per_s,
                           storage_cap_gbytes_per_s=0.0):
    """Time to write one checkpoint: every node writes its own shards in parallel, so each
    writes state_bytes/nodes at its own bandwidth, capped by what the offer's storage states
    per node (0 = no stated cap)."""
    bw = node_gbytes_per_s if not storage_cap_gbytes_per_s else \
        min(node_gbytes_per_s, storage_cap_gbytes_per_s)
    return np.asarray(state_bytes, dtype=float) / np.maximum(np.asarray(nodes, dtype=float),
                                                             1.0) / (bw * 1e9) / 3600


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
