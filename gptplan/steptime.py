"""Step time of a training step, composed from where a GPU spends it: ONE composition
(`step_time_parts`) shared by the planner's search (planner.screen.evaluate), the fit to
published runs (planner.screen.published) and the runner's local rehearsal
(`data_parallel_step_time_s`); tests/test_rehearsal.py checks the planner and runner agree.

All functions take numpy arrays (or scalars) and broadcast, model shapes included (the fit
evaluates rows of different models at once). Per device, per micro-batch and layer:
1. GEMMs from their (m, n, k) shapes after tensor/sequence-parallel sharding, forward, data-
   and weight-gradient, each timed by tile and wave quantisation [MM] and the roofline [RL];
2. attention score/value matmuls (flash or not) at their own rate;
3. memory-bound work (norms, activations, dropout, residuals, softmax without flash) as bytes
   over HBM bandwidth [RL], and a per-kernel overhead;
4. communication, alpha-beta: per-message latency plus bytes over bandwidth [NC], NVLink in a
   node, the network across nodes, gradients in 32 MB buckets, ZeRO-3's per-layer gathers;
5. the pipeline bubble [N21], recompute [N21, K22], the optimizer update.
Fitted per GPU generation (bench/published/fit_priors.py): the attainable fraction of peak of
large GEMMs (Efficiency.max), the per-kernel overhead, the share of data-parallel traffic
hidden behind compute, and the attention kernels' rate relative to large GEMMs. Devices with
no tile model (no sm_count: CPUs, NPUs) keep their calibrated whole-layer curve
(`curve_efficiency`) for the GEMM and attention terms.

Sources: [N21] Narayanan et al. 2021 (eq. 3, pipeline bubble), [K22] Korthikanti et al. 2022
(selective recompute, sequence parallel), [Z20] Rajbhandari et al. 2020 (ZeRO communication),
[FA] Dao et al. 2022 (FlashAttention recomputes the scores in backward), [MM] NVIDIA "Matrix
Multiplication Background User's Guide" (tile and wave quantisation), [RL] Williams et al.
2009, "Roofline", [NC] NVIDIA nccl-tests PERFORMANCE.md (ring/tree algorithm bandwidth and
latency; small-message latency of a few microseconds per ring step), [TE] NVIDIA Transformer
Engine documentation, "Using FP8 with Transformer Engine" (delayed scaling, FP8 GEMMs inside
the transformer layers, fused cast-transpose).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from gptplan import precision
from gptplan.memory import ModelShape, activation_bytes_per_layer
from gptplan.plan import RECOMPUTE_MODES, Plan
from gptplan.profile import DeviceProfile

RECOMPUTE_CODES = {mode: code for code, mode in enumerate(RECOMPUTE_MODES)}


def recompute_extra_flops_per_token(
    shape: ModelShape, seq_len: Any, recompute_code: Any, flash_attention: Any = False
) -> Any:
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
    extra = np.select(
        [code == 0, code == 1, code == 2, code == 3],
        [0.0 * s, np.where(flash, 0.0, attn_core), full_attn, full],
    )
    return extra + np.where(flash, attn_core, 0.0)


def attention_flops_per_token(
    shape: ModelShape, seq_len: Any, recompute_code: Any, flash_attention: Any = False
) -> Any:
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


# ---- constants (not fitted; each with its source) ------------------------------------------

TILE_M = TILE_N = 128  # [MM]: cuBLAS/CUTLASS output tiles of 128x128 (also 256x128) on A100/H100
MIN_SPLIT_K = 1024  # split-K only splits a reduction longer than this (CUTLASS split-K)
KERNELS_PER_LAYER = 36  # forward ~12 kernels (2 norms, 4 GEMMs, attention, activation,
#                         dropouts, residual adds), backward about twice as many
ELEMENTWISE_PASSES = 3.0  # each stored activation [K22] is written (forward), read (backward)
#                           and its gradient written once: memory-bound bytes per layer
CAUSAL_FLASH_WORK = 0.5  # causal flash attention: blocks above the diagonal are skipped
BUCKET_BYTES = 32 * 2**20  # gradient buckets (PaddleNLP/PyTorch DDP default 25-32 MB)
BUCKET_BYTES_PER_RANK = 2e6  # Megatron-LM: 1M parameters (bf16) per data-parallel rank
ALPHA_LAUNCH_S = 10e-6  # [NC] per collective: launch and synchronisation
ALPHA_NVLINK_S = 1e-6  # [NC] per ring step inside a node (LL protocol over NVLink)
ALPHA_NETWORK_S = 5e-6  # [NC] per ring step across nodes (InfiniBand/RoCE RDMA round trip)
# FP8 (published runs only: PaddleNLP 2.8.1 cannot train in FP8, so no plan chooses it; the
# row gptplan.precision.FP8, fitting only). A row with narrow GEMMs is a Transformer Engine
# "hybrid" run [TE]: the linear layers' GEMMs at the FP8 peak with 1-byte operands, everything
# else (attention, the LM head, norms, communication) in bf16. TE casts each GEMM input to FP8
# with a transposed copy for the backward pass (fused cast-transpose: read 2 bytes, write 2 x 1
# byte per element) and does the same for the output gradient in the backward pass; its
# amax/scale bookkeeping adds about one kernel per cast.
FP8_CAST_BYTES_PER_ELEMENT = 4.0
FP8_KERNELS_PER_GEMM = 3.0


@dataclass(frozen=True)
class Device:
    """What the composition needs of a device (arrays per row are fine)."""

    peak_flops: Any  # dense FLOP/s of the precision used
    sm_count: Any  # streaming multiprocessors; 0 = no tile model (the curve applies)
    hbm_bytes_per_s: Any
    intra_bytes_per_s: Any  # device-to-device in a node
    inter_bytes_per_s: Any  # the node's network link
    gpus_per_node: Any
    fp8_peak_flops: Any = 0.0  # dense FP8 FLOP/s (Hopper and later); 0 = none


@dataclass(frozen=True)
class Rates:
    """The fitted constants of a generation (gptplan.profile.Efficiency)."""

    gemm_max: Any  # attainable fraction of peak of a large, well-shaped GEMM
    kernel_overhead_s: Any  # per kernel: launch, tail and synchronisation
    overlap: Any  # share of data-parallel/sharding traffic hidden behind compute
    attention_fraction: Any  # attention kernels' rate relative to large GEMMs
    half_tokens: Any = 2048.0  # the curve (devices without sm_count only)
    half_hidden: Any = 384.0
    rolloff_tokens: Any = 0.0

    @classmethod
    def of(cls, eff: Any) -> Rates:
        return cls(
            eff.max,
            eff.kernel_overhead_us * 1e-6,
            eff.comm_overlap,
            eff.attention_relative,
            eff.half_tokens,
            eff.half_hidden,
            eff.rolloff_tokens,
        )


def curve_efficiency(
    *,
    micro_batch: Any,
    seq_len: Any,
    hidden_per_tp: Any,
    eff_max: Any,
    half_tokens: Any,
    half_hidden: Any,
    rolloff_tokens: Any = 0.0,
) -> Any:
    """Devices without a tile model (CPUs, NPUs): achieved/peak FLOP/s of a whole layer,
    eff = max · T/(T + T½) · H/(H + H½) · 1/(1 + T/R), T = b·s, H = h/t (calibrated per machine
    by `planner calibrate`; empirical, no paper; R = 0 leaves the cache roll-off out)."""
    tokens = np.asarray(micro_batch, dtype=float) * np.asarray(seq_len, dtype=float)
    hid = np.asarray(hidden_per_tp, dtype=float)
    rolloff = np.asarray(rolloff_tokens, dtype=float)
    falloff = np.where(rolloff > 0, 1.0 / (1.0 + tokens / np.maximum(rolloff, 1e-9)), 1.0)
    return eff_max * tokens / (tokens + half_tokens) * hid / (hid + half_hidden) * falloff


def gemm_seconds(
    m: Any, n: Any, k: Any, dev: Device, gemm_max: Any, elem_bytes: Any, peak_flops: Any = None
) -> Any:
    """One GEMM (m x k)·(k x n) on a device with a tile model [MM], [RL].

    Tiles of TILE_M x TILE_N outputs are spread over the SMs in waves: a partial tile or a
    partial last wave costs as much as a full one (tile and wave quantisation). When there are
    fewer tiles than SMs, the reduction is split (split-K) over the idle SMs. The time is the
    larger of the quantised FLOPs at gemm_max of peak and the operands' bytes over HBM
    bandwidth (the roofline: skinny GEMMs are memory-bound). `peak_flops` overrides the
    device's peak (the FP8 peak for an FP8 GEMM).
    """
    m, n, k = (np.asarray(x, dtype=float) for x in (m, n, k))
    sm = np.maximum(np.asarray(dev.sm_count, dtype=float), 1.0)
    tiles = np.ceil(m / TILE_M) * np.ceil(n / TILE_N)
    splits = np.clip(np.floor(sm / tiles), 1.0, np.maximum(np.floor(k / MIN_SPLIT_K), 1.0))
    waves = np.ceil(tiles * splits / sm)
    padded_flops = waves * sm * TILE_M * TILE_N * np.ceil(k / splits) * 2.0
    peak = dev.peak_flops if peak_flops is None else peak_flops
    t_flops = padded_flops / (np.asarray(peak, dtype=float) * gemm_max)
    t_bytes = elem_bytes * (m * k + k * n + m * n) / np.asarray(dev.hbm_bytes_per_s, dtype=float)
    return np.maximum(t_flops, t_bytes)


def _layer_gemms(shape: ModelShape, tp: Any) -> Any:
    """(n, k) of a layer's four GEMMs on one tensor-parallel rank (m = tokens): QKV (GQA: K and
    V of kv/a the width), attention output, MLP up (SwiGLU: gate and up), MLP down."""
    h = np.asarray(shape.hidden, dtype=float)
    f = np.asarray(shape.ffn, dtype=float)
    t = np.asarray(tp, dtype=float)
    up = np.where(np.asarray(shape.gated, dtype=bool), 2.0, 1.0) * f
    return [(h * (1.0 + 2.0 * shape.kv_fraction) / t, h), (h, h / t), (up / t, h), (h, f / t)]


def _gemm_pass_seconds(
    m: Any, n: Any, k: Any, dev: Any, gemm_max: Any, elem_bytes: Any, peak_flops: Any = None
) -> Any:
    """Forward, data-gradient and weight-gradient GEMMs of one linear layer."""
    return (
        gemm_seconds(m, n, k, dev, gemm_max, elem_bytes, peak_flops),
        gemm_seconds(m, k, n, dev, gemm_max, elem_bytes, peak_flops)
        + gemm_seconds(n, k, m, dev, gemm_max, elem_bytes, peak_flops),
    )


def layer_compute_seconds(shape: ModelShape, g: dict, dev: Device, rates: Rates) -> Any:
    """Per layer and micro-batch on one device: GEMM, attention, memory-bound and kernel-overhead
    seconds (a dict), recompute included [N21], [K22]."""
    T = np.asarray(g["micro"], dtype=float) * np.asarray(g["seq"], dtype=float)
    code = np.asarray(g["recompute_code"])
    fp8 = precision.of_codes("narrow_gemms", g["precision_code"])
    elem = precision.of_codes("bytes_per_element", g["precision_code"])
    gemm_elem = precision.of_codes("gemm_bytes_per_element", g["precision_code"])
    tiled = np.asarray(dev.sm_count, dtype=float) > 0
    h = np.asarray(shape.hidden, dtype=float)
    gemm_peak = np.where(fp8, dev.fp8_peak_flops, dev.peak_flops)
    curve = curve_efficiency(
        micro_batch=g["micro"],
        seq_len=g["seq"],
        hidden_per_tp=h / np.asarray(g["tp"], dtype=float),
        eff_max=rates.gemm_max,
        half_tokens=rates.half_tokens,
        half_hidden=rates.half_hidden,
        rolloff_tokens=rates.rolloff_tokens,
    )
    gemm = 0.0
    curve_gemm = 0.0
    cast_bytes = 0.0  # FP8 only: cast-transpose of the GEMM inputs and output gradients [TE]
    for i, (n, k) in enumerate(_layer_gemms(shape, g["tp"])):
        fwd, bwd = _gemm_pass_seconds(T, n, k, dev, rates.gemm_max, gemm_elem, gemm_peak)
        redo = (code == 3) | ((code == 2) & (i < 2))  # full: all; full_attn: QKV and output
        gemm = gemm + fwd * np.where(redo, 2.0, 1.0) + bwd
        curve_gemm = curve_gemm + 2.0 * T * n * k * np.where(redo, 4.0, 3.0)
        cast_bytes = cast_bytes + FP8_CAST_BYTES_PER_ELEMENT * T * (
            k * np.where(redo, 2.0, 1.0) + n
        )
    L = np.asarray(shape.layers, dtype=float)
    attn_flops = (
        attention_flops_per_token(shape, g["seq"], code, g["flash"])
        / L
        * T
        / np.asarray(g["tp"], dtype=float)
    )
    peak = np.asarray(dev.peak_flops, dtype=float)
    attn_rate = peak * rates.attention_fraction * np.where(tiled, rates.gemm_max, curve)
    # a causal flash kernel skips the blocks above the diagonal: about half the s² work
    # (Dao 2023, FlashAttention-2, section 3.1.1); unfused attention computes all of it
    attn_flops = attn_flops * np.where(np.asarray(g["flash"]) > 0, CAUSAL_FLASH_WORK, 1.0)
    act = activation_bytes_per_layer(
        shape, g["seq"], g["micro"], g["tp"], g["sp"], 0, elem, g["flash"], extras=False
    )
    redo_share = np.where(code == 3, 4.0 / 3.0, 1.0)
    moved = ELEMENTWISE_PASSES * act * redo_share + np.where(fp8, cast_bytes, 0.0)
    kernels = KERNELS_PER_LAYER * redo_share + np.where(fp8, 4 * 2 * FP8_KERNELS_PER_GEMM, 0.0)
    return {
        "gemm": np.where(tiled, gemm, curve_gemm / (peak * curve)),
        "attention": attn_flops / attn_rate,
        "memory": np.where(tiled, moved / np.asarray(dev.hbm_bytes_per_s, dtype=float), 0.0),
        "kernels": np.where(tiled, kernels * rates.kernel_overhead_s, 0.0),
    }


# ---- evaluating once per distinct layout ------------------------------------------------------
# The search's columns are long (a million rows) but a term reads only a few of them, which
# take a few values each: the term is evaluated once per distinct combination of the columns
# it reads and broadcast back, the same arithmetic on the same numbers, so the same result.

LAYER_COLUMNS = ("micro", "seq", "tp", "recompute_code", "precision_code", "flash", "sp")
SYNC_COLUMNS = ("tp", "pp", "dp", "shard_degree", "stage_code", "acc", "precision_code")
TP_COLUMNS = ("tp", "recompute_code", "micro", "seq", "sp", "precision_code")
HEAD_COLUMNS = ("micro", "seq", "tp", "precision_code")


def _codes(col: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Each entry's rank among the column's distinct values, and how many there are (a table
    over the value range, linear, when the values are small; a sort otherwise); None unless
    non-negative integers."""
    if not np.issubdtype(col.dtype, np.integer) or not len(col) or col.min() < 0:
        return None
    top = int(col.max())
    if top > 4 * len(col) + 4096:
        values, inverse = np.unique(col, return_inverse=True)
        return inverse.reshape(col.shape), len(values)
    present = np.zeros(top + 1, dtype=bool)
    present[col] = True
    rank = np.cumsum(present) - 1
    return rank[col], int(rank[-1]) + 1


def _renumbered(key: np.ndarray) -> tuple[np.ndarray, int]:
    coded = _codes(key)
    assert coded is not None  # a key is a non-negative integer
    return coded


def distinct_rows(
    columns: list, fields: list, cache: dict | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(one row of each distinct combination of `columns`, each row's combination) when they
    are equally long columns of non-negative integers that take fewer combinations than half
    the rows, and every per-row array in `fields` is the same within a combination (checked);
    None otherwise (evaluate every row)."""
    cols = [np.asarray(c) for c in columns]
    n = len(cols[0]) if cols and cols[0].ndim == 1 else 0
    if n < 64 or any(c.shape != (n,) for c in cols):
        return None
    key, size = np.zeros(n, dtype=np.int64), 1
    cache = {} if cache is None else cache  # id -> (column, its codes): each column coded once
    for c in cols:
        if id(c) not in cache:
            cache[id(c)] = (c, _codes(c))
        coded = cache[id(c)][1]
        if coded is None:
            return None
        key, size = key * coded[1] + coded[0], size * coded[1]
        if size > n:  # renumber the combinations seen so far: the key stays below n
            key, size = _renumbered(key)
    inverse, count = _renumbered(key)
    if count > n // 2:
        return None
    first = np.zeros(count, dtype=np.int64)
    first[inverse] = np.arange(n)
    rep = first[inverse]
    for f in fields:
        a = np.asarray(f)
        if a.ndim and (a.shape != (n,) or not np.array_equal(a, a[rep])):
            return None
    return first, inverse


def _flat(value: Any) -> list:
    """The arrays and numbers inside an argument (a dict of columns, a Device, Rates)."""
    if isinstance(value, dict):
        return list(value.values())
    if dataclasses.is_dataclass(value):
        return [getattr(value, f.name) for f in dataclasses.fields(value)]
    return [value]


def _cut(value: Any, first: np.ndarray, n: int) -> Any:
    if isinstance(value, dict):
        return {k: _cut(v, first, n) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _rows_of(value, first, (n,))
    return np.asarray(value)[first] if np.ndim(value) else value


def per_distinct(
    fn: Any, columns: list, *args: Any, cache: dict | None = None, checked: Any = frozenset()
) -> Any:
    """fn(*args), evaluated once per distinct row of `columns` (distinct_rows) when every
    per-row array in args is the same within each distinct row, and broadcast back; fn(*args)
    over every row otherwise. fn must be elementwise over rows. `cache`: column codes shared
    between calls on the same columns; `checked`: ids of arrays known to be the same within
    each distinct row of a coarser grouping (not checked again)."""
    checked = checked | {id(c) for c in columns}
    fields = [v for a in args for v in _flat(a) if id(v) not in checked]
    found = distinct_rows(columns, fields, cache)
    if found is None:
        return fn(*args)
    first, inverse = found
    out = fn(*(_cut(a, first, len(inverse)) for a in args))
    if isinstance(out, dict):
        return {k: np.broadcast_to(v, first.shape)[inverse] for k, v in out.items()}
    return np.broadcast_to(out, first.shape)[inverse]


def _layer_seconds(
    shape: ModelShape,
    g: dict,
    dev: Device,
    rates: Rates,
    cache: Any = None,
    checked: Any = frozenset(),
) -> dict:
    """layer_compute_seconds, once per distinct row of the columns it reads."""
    sub = {k: g[k] for k in LAYER_COLUMNS}
    return per_distinct(
        layer_compute_seconds,
        list(sub.values()),
        shape,
        sub,
        dev,
        rates,
        cache=cache,
        checked=checked,
    )


def _same_per_precision(g: dict, cache: dict, *records: Any) -> frozenset:
    """Ids of the per-row arrays of `records` (Device, Rates, ModelShape, arrays) that are the
    same for every row of one precision (checked): every grouping of the step-time terms holds
    the precision, so they need no check per term."""
    fields = [v for r in records for v in _flat(r)]
    if distinct_rows([g["precision_code"]], fields, cache) is None:
        return frozenset()
    return frozenset(id(v) for v in fields)


def ring_allreduce_seconds(bytes_: Any, ranks: Any, bandwidth_bytes_per_s: Any) -> Any:
    """Ring all-reduce moves 2·(n-1)/n of the buffer through each rank's link."""
    n = np.asarray(ranks, dtype=float)
    return np.where(n > 1, 2.0 * (n - 1) / np.maximum(n, 1) * bytes_ / bandwidth_bytes_per_s, 0.0)


def collective_latency_seconds(ranks: Any, ranks_per_node: Any, passes: Any) -> Any:
    """[NC] alpha of one collective over `ranks` ranks: a launch, then one step per rank of a
    ring per pass (all-gather and reduce-scatter: NCCL's ring), each step as slow as its slowest
    link (the network once the group spans nodes). An all-reduce (passes = 2) takes NCCL's tree
    when that is faster: 2·(r-1) NVLink steps in the node and 2·log2(nodes) network steps."""
    n = np.asarray(ranks, dtype=float)
    r = np.minimum(n, np.maximum(np.asarray(ranks_per_node, dtype=float), 1.0))
    k = np.maximum(n / r, 1.0)
    step = np.where(k > 1, ALPHA_NETWORK_S, ALPHA_NVLINK_S)
    ring = passes * (n - 1.0) * step
    tree = 2.0 * (r - 1.0) * ALPHA_NVLINK_S + 2.0 * np.log2(k) * ALPHA_NETWORK_S
    alpha = ring if passes < 2 else np.minimum(ring, tree)
    return np.where(n > 1, ALPHA_LAUNCH_S + alpha, 0.0)


def collective_seconds(
    bytes_per_rank: Any,
    ranks: Any,
    ranks_per_node: Any,
    gpus_per_node: Any,
    intra_bytes_per_s: Any,
    inter_bytes_per_s: Any,
    passes: Any,
    messages: Any = 1.0,
) -> Any:
    """Time of `messages` ring collectives moving `bytes_per_rank` in all over `ranks` ranks,
    `ranks_per_node` of them in each node: alpha per message (collective_latency_seconds) plus
    bytes over bandwidth.

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
    alpha = np.asarray(messages, dtype=float) * collective_latency_seconds(n, r, passes)
    return np.where(n > 1, t_intra + t_inter + alpha, 0.0)


def gradient_sync_seconds(
    *,
    params: Any,
    grad_bytes: Any,
    tp: Any,
    pp: Any,
    dp: Any,
    shard_degree: Any,
    stage_code: Any,
    accumulation: Any,
    gpus_per_node: Any,
    intra_bytes_per_s: Any,
    inter_bytes_per_s: Any,
    stage_layers: Any = 1.0,
) -> Any:
    """Gradient and parameter traffic per optimizer step, per rank.

    Each rank holds only its tensor x pipeline shard, G = N/(t·p) parameters [N21]; the data
    and sharding groups synchronise that shard, never the whole model. Ranks are laid out as
    Paddle's hybrid topology does (model-parallel ranks innermost, then sharding, then data),
    so r = devices_per_node/(t·p) batch ranks share a node. Gradients travel in 32 MB buckets,
    each one message with its own latency. ZeRO [Z20]:
    - no sharding: one all-reduce of G over dp;
    - stage1: reduce-scatter grads + all-gather params over the sharding group, once a step;
    - stage2: grads reduce-scattered after every micro-batch, params gathered once a step;
    - stage3: per micro-batch and layer, two parameter all-gathers (forward, backward) and a
      gradient reduce-scatter: 3·layers messages a micro-batch, so a flat group of 1,000+
      ranks pays per-message ring latency (n-1 network steps each).
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
    # buckets grow with the group (Megatron-LM: max(40M, 1M x dp) parameters per bucket), so a
    # large group pays the ring latency on few messages
    bucket = np.maximum(BUCKET_BYTES, BUCKET_BYTES_PER_RANK * dp * sd)
    buckets = np.maximum(np.ceil(shard_bytes / bucket), 1.0)
    in_node = np.maximum(1.0, gpus_per_node // (tp * pp))
    links = dict(
        gpus_per_node=gpus_per_node,
        intra_bytes_per_s=intra_bytes_per_s,
        inter_bytes_per_s=inter_bytes_per_s,
    )
    plain = collective_seconds(shard_bytes, dp * sd, in_node, passes=2, messages=buckets, **links)

    def one_pass(messages: Any) -> Any:
        return collective_seconds(
            shard_bytes, sd, np.minimum(sd, in_node), passes=1, messages=messages, **links
        )

    per_layer = np.asarray(stage_layers, dtype=float)  # ZeRO-3 gathers one layer at a time
    sharded = np.select(
        [stage == 1, stage == 2, stage == 3],
        [2.0 * one_pass(buckets), (acc + 1.0) * one_pass(buckets), 3.0 * acc * one_pass(per_layer)],
        0.0,
    )
    across = collective_seconds(
        shard_bytes / sd,
        dp,
        np.maximum(1.0, in_node // sd),
        passes=2,
        messages=np.maximum(np.ceil(buckets / sd), 1.0),
        **links,
    )
    return np.where(stage == 0, plain, sharded + np.where(dp > 1, across, 0.0))


def pipeline_bubble_factor(pp: Any, accumulation: Any, virtual_pp: Any = 1) -> Any:
    """[N21] 1F1B: time scales by (m + p - 1)/m for m micro-batches and p stages; the
    interleaved schedule with v model chunks per stage shrinks the bubble v-fold,
    (m + (p - 1)/v)/m ([N21] section 2.2.2), at v times the point-to-point traffic."""
    m = np.asarray(accumulation, dtype=float)
    p = np.asarray(pp, dtype=float)
    v = np.asarray(virtual_pp, dtype=float)
    return (m + (p - 1.0) / v) / m


def _rows_of(record: Any, idx: Any, shape: Any) -> Any:
    """`record` (Device or Rates) with its per-row array fields cut to rows `idx`."""
    import dataclasses

    def take(v: Any) -> Any:
        a = np.asarray(v)
        return np.atleast_1d(np.broadcast_to(a, shape))[idx] if a.shape == shape != () else v

    return dataclasses.replace(
        record, **{f.name: take(getattr(record, f.name)) for f in dataclasses.fields(record)}
    )


def recomputed_share(g: dict, stage_layers: Any) -> np.ndarray:
    """Per row, the share of a stage's layers that recompute: rc_layers (k per stage, PaddleNLP
    2.8.1 no_recompute_layers holds the others) over ceil(L/p), or 1 (every layer: rc_layers
    0 or absent, or no recompute at all)."""
    n = np.broadcast_to(np.asarray(g["tp"]), np.shape(stage_layers)).shape
    k = np.asarray(g.get("rc_layers", np.zeros(n)), dtype=float)
    code = np.asarray(g["recompute_code"])
    return np.where((k > 0) & (code > 0), np.minimum(k / stage_layers, 1.0), 1.0) * np.ones(n)


def _tensor_parallel_seconds(
    shape: ModelShape, g: dict, dev: Device, act_bytes: Any, share: Any = 1.0
) -> Any:
    """Per layer and micro-batch: the tensor-parallel all-reduces of b·s·h activations, two in
    forward and two in backward [N21] (one more per recomputed block), or with sequence
    parallel a reduce-scatter and an all-gather each (same bytes, twice the messages) [K22]."""
    t = np.asarray(g["tp"], dtype=float)
    code = np.asarray(g["recompute_code"])
    count = 4.0 + np.select([code == 3, code == 2], [2.0, 1.0], 0.0) * share
    msg = (
        np.asarray(g["micro"], dtype=float)
        * np.asarray(g["seq"], dtype=float)
        * np.asarray(shape.hidden, dtype=float)
        * act_bytes
    )
    bw = ring_allreduce_seconds(msg, t, np.asarray(dev.intra_bytes_per_s, dtype=float))
    latency = collective_latency_seconds(t, t, 2.0) * np.where(np.asarray(g["sp"]) > 0, 2.0, 1.0)
    return count * (bw + latency)


def _sync_seconds(
    shape: Any,
    grad_bytes: Any,
    tp: Any,
    pp: Any,
    dp: Any,
    shard_degree: Any,
    stage_code: Any,
    acc: Any,
    dev: Any,
) -> Any:
    """gradient_sync_seconds of layout rows (positional, for per_distinct)."""
    pp = pp.astype(float)
    layers = np.ceil(np.asarray(shape.layers, dtype=float) / pp)
    return gradient_sync_seconds(
        params=shape.params_total,
        grad_bytes=grad_bytes,
        tp=tp.astype(float),
        pp=pp,
        dp=dp,
        shard_degree=shard_degree,
        stage_code=stage_code,
        accumulation=acc.astype(float),
        gpus_per_node=dev.gpus_per_node,
        intra_bytes_per_s=dev.intra_bytes_per_s,
        inter_bytes_per_s=dev.inter_bytes_per_s,
        stage_layers=layers,
    )


def _head_seconds(shape: ModelShape, g: dict, dev: Device, rates: Rates, act_bytes: Any) -> dict:
    """Per micro-batch: the LM head's GEMMs (forward and backward, on the last stage), and the
    curve efficiency of each row (devices without a tile model)."""
    T = g["micro"] * g["seq"].astype(float)
    tp = g["tp"].astype(float)
    tiled = np.asarray(dev.sm_count, dtype=float) > 0
    vocab = np.asarray(shape.vocab, dtype=float)
    head_fwd, head_bwd = _gemm_pass_seconds(
        T, vocab / tp, shape.hidden, dev, rates.gemm_max, act_bytes
    )
    curve = curve_efficiency(
        micro_batch=g["micro"],
        seq_len=g["seq"],
        hidden_per_tp=shape.hidden / tp,
        eff_max=rates.gemm_max,
        half_tokens=rates.half_tokens,
        half_hidden=rates.half_hidden,
        rolloff_tokens=rates.rolloff_tokens,
    )
    head_curve = 6.0 * T * vocab / tp * shape.hidden / (dev.peak_flops * curve)
    return {"head": np.where(tiled, head_fwd + head_bwd, head_curve), "curve": curve}


def step_time_parts(shape: ModelShape, g: dict, dev: Device, rates: Rates) -> dict:
    """Seconds per optimizer step of each layout row in `g` (columns nodes, precision_code,
    seq, micro, acc, tp, pp, vpp, dp, shard_degree, stage_code, recompute_code, sp, flash),
    and its parts. The slowest pipeline stage (ceil(L/p) layers, plus the LM head on the last)
    sets the pace; (stage compute + tensor-parallel traffic) is stretched by the bubble [N21];
    point-to-point, the unhidden data-parallel share and the optimizer update add to it.
    """
    g = {k: np.asarray(v) for k, v in g.items()}
    act_bytes = precision.of_codes("bytes_per_element", g["precision_code"])
    tp, pp = g["tp"].astype(float), g["pp"].astype(float)
    L = np.asarray(shape.layers, dtype=float)
    stage_layers = np.ceil(L / pp)
    cache: dict = {}
    checked = _same_per_precision(g, cache, shape, dev, rates, act_bytes)
    layer = _layer_seconds(shape, g, dev, rates, cache, checked)
    # partial recompute (rc_layers = k > 0 of a stage's layers, PaddleNLP no_recompute_layers):
    # only those k layers pay the granularity's recompute, the others run as without it
    share = recomputed_share(g, stage_layers)
    if np.any(share < 1.0):
        # evaluated on the partial rows only (the search's columns are long)
        partial = np.flatnonzero(np.atleast_1d(share) < 1.0)
        sub = {k: np.atleast_1d(np.broadcast_to(v, share.shape))[partial] for k, v in g.items()}
        sub["recompute_code"] = np.zeros(len(partial), dtype=int)
        plain = _layer_seconds(
            shape, sub, _rows_of(dev, partial, share.shape), _rows_of(rates, partial, share.shape)
        )
        for k in layer:
            blended = np.atleast_1d(np.broadcast_to(layer[k], share.shape)).astype(float)
            f = np.atleast_1d(share)[partial]
            blended[partial] = f * blended[partial] + (1 - f) * plain[k]
            layer[k] = blended.reshape(share.shape)
    T = g["micro"] * g["seq"].astype(float)
    tiled = np.asarray(dev.sm_count, dtype=float) > 0
    cols = {k: g[k] for k in HEAD_COLUMNS}
    last = per_distinct(
        _head_seconds,
        list(cols.values()),
        shape,
        cols,
        dev,
        rates,
        act_bytes,
        cache=cache,
        checked=checked,
    )
    head, curve = last["head"], last["curve"]
    per_layer = layer["gemm"] + layer["attention"] + layer["memory"] + layer["kernels"]
    acc = g["acc"].astype(float)
    compute = acc * (stage_layers * per_layer + head)
    t_tp = (
        acc
        * stage_layers
        * per_distinct(
            _tensor_parallel_seconds,
            [g[k] for k in TP_COLUMNS],
            shape,
            {k: g[k] for k in TP_COLUMNS},
            dev,
            act_bytes,
            share,
            cache=cache,
            checked=checked,
        )
    )
    link = np.where(g["nodes"] > 1, dev.inter_bytes_per_s, dev.intra_bytes_per_s)
    p2p_bytes = T * shape.hidden * act_bytes / np.where(g["sp"] > 0, tp, 1.0)
    t_pp = np.where(
        pp > 1,
        2.0
        * acc
        * g["vpp"]
        * (
            p2p_bytes / link
            + ALPHA_LAUNCH_S
            + np.where(g["nodes"] > 1, ALPHA_NETWORK_S, ALPHA_NVLINK_S)
        ),
        0.0,
    )
    t_dp = per_distinct(
        _sync_seconds,
        [g[k] for k in SYNC_COLUMNS],
        shape,
        act_bytes,
        g["tp"],
        g["pp"],
        g["dp"],
        g["shard_degree"],
        g["stage_code"],
        g["acc"],
        dev,
        cache=cache,
        checked=checked,
    )
    t_opt = shape.params_total / (tp * pp * g["shard_degree"]) * 16 * 3 / dev.hbm_bytes_per_s
    bubble = pipeline_bubble_factor(pp, acc, g["vpp"])
    exposed_dp = (1.0 - rates.overlap) * t_dp
    step = (compute + t_tp) * bubble + t_pp + exposed_dp + t_opt
    sums = {k: acc * stage_layers * v for k, v in layer.items()}
    return {
        "step_time_s": step,
        "compute_s": compute,
        "gemm_s": sums["gemm"] + acc * head,
        "attention_s": sums["attention"],
        "memory_bound_s": sums["memory"],
        "kernel_overhead_s": sums["kernels"],
        "tp_s": t_tp,
        "pp_s": t_pp,
        "dp_sync_s": t_dp,
        "comm_s": t_tp + t_pp + exposed_dp,
        "opt_s": t_opt,
        "bubble": bubble,
        "stage_layers": stage_layers,
        # what compute time scales with (planner.tuning.calibration): the curve, or gemm_max
        "efficiency": np.where(tiled, rates.gemm_max, curve) * np.ones_like(step),
    }


def data_parallel_step_time_s(plan: Plan, perf: DeviceProfile) -> float:
    """Modelled seconds per optimizer step of `plan` (one node, data parallel) on `perf`:
    step_time_parts for tp = pp = 1, no sharding, one node (the same composition the
    planner's search uses)."""
    t, m = plan.training, plan.model
    peak = perf.peak_for(t.precision) * 1e12
    if peak <= 0:
        return float("nan")
    g = {
        "nodes": 1,
        "precision_code": precision.code(t.precision),
        "seq": t.seq_len,
        "micro": t.per_device_train_batch_size,
        "acc": t.gradient_accumulation_steps,
        "tp": 1,
        "pp": 1,
        "vpp": 1,
        "dp": plan.parallel.world_size,
        "shard_degree": 1,
        "stage_code": 0,
        "recompute_code": RECOMPUTE_CODES[plan.parallel.recompute],
        "rc_layers": plan.parallel.recompute_layers,
        "sp": 0,
        "flash": int(bool(getattr(t, "use_flash_attention", False))),
    }
    dev = Device(
        peak,
        perf.sm_count,
        (perf.memory_bandwidth_gbytes_per_s or 1.0) * 1e9,
        perf.intra_node_gbytes_per_s * 1e9 or 1.0,
        1.0,
        plan.parallel.nproc_per_node,
    )
    parts = step_time_parts(
        ModelShape.from_section(m), g, dev, Rates.of(perf.efficiency_for(t.precision))
    )
    return float(parts["step_time_s"])
