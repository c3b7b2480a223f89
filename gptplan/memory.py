"""Memory per device: the formulas shared by the planner's cost model and the runner's
local rehearsal (`runner execute --local`), so both predict the same bytes.

All functions take numpy arrays (or scalars) and broadcast. Sources:
- [K22]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
         Models", table 2: activation memory per layer.
- [Z20]  Rajbhandari et al. 2020, ZeRO: bytes per parameter of model states under sharding.
The planner re-exports these from planner.costmodel (its one formula module); the runner may
not import the planner, so they live here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gptplan import families, precision
from gptplan.modelfacts import parameter_count
from gptplan.plan import ModelSection

GB = 1e9  # modelled bytes are shown in GB (10^9)
# A device's memory (profile memory_gb, plan hardware.memory_gb) is in binary gigabytes: an
# "80 GB" H100 or A100 has 81,920 MiB of HBM (nvidia-smi), a "40 GB" A100 40,960 MiB, and the
# CPU profile is half of a 24 GiB machine. Counting them as 10^9 bytes cut 7% off every device.
GIB = 2**30
# The memory model's median absolute error against the measured peak memory of Paddle runs,
# 52 held-out configurations (bench/README.md section 2, bench/results/plan_quality.json
# memory_ape_median 0.1197, worst 0.20; CPU, the only hardware where Paddle ran here).
MEMORY_MODEL_ERROR = 0.12
# The feasibility band: the 10th and 90th percentiles of MEASURED / MODELLED peak memory per
# device over every measurement of an allowed source (bench/memory_accuracy.py writes them to
# bench/results/memory_accuracy.json; bench/README.md section "Memory"): Paddle's own peaks
# from the CPU rehearsals and torchtitan's published per-device peaks. A layout whose modelled
# memory x MEMORY_RATIO_P90 exceeds the usable memory (card x headroom) may not fit; one whose
# modelled memory x MEMORY_RATIO_P90 exceeds the card's physical memory is never planned.
MEMORY_RATIO_P10 = 0.96
MEMORY_RATIO_P90 = 1.12
# A "may fit" layout is chosen only when it costs at least this share less than the best
# layout that surely fits (planner.search.decide); otherwise the surely-fitting one is chosen.
MAY_FIT_SAVING = 0.05


def memory_fit(mem_bytes, physical_bytes, headroom):
    """(surely fits, may fit) per layout: modelled peak x the band's top within the usable
    memory (physical x headroom), or past it but within the card's physical memory."""
    upper = np.asarray(mem_bytes, dtype=float) * MEMORY_RATIO_P90
    physical = np.asarray(physical_bytes, dtype=float)
    sure = upper <= physical * headroom
    return sure, ~sure & (upper <= physical)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    params_total: int
    params_body: int  # without embeddings
    # Activation bytes per layer in units of s·b·h at 16 bit, by family (see
    # `activation_coefficients`); GPT's are [K22] table 2's.
    act_replicated: float = 10.0  # not split by tensor parallel (norm and matmul inputs)
    act_split: float = 24.0  # split by tensor parallel
    act_scores: float = 5.0  # times a·s/h: the stored attention scores
    kept_replicated: float = 4.0  # full_attn recompute keeps the norms ...
    kept_split: float = 19.0  # ... and the MLP
    kv_heads: int = 0  # grouped-query attention (Llama); 0 = as many as heads
    gated: bool = False  # SwiGLU MLP (Llama: gate, up and down projections)

    @classmethod
    def from_section(cls, m: ModelSection) -> ModelShape:
        """The family's shape (gptplan.families): `ffn` is the width of one MLP branch (QWen's
        intermediate_size counts both SwiGLU branches), `gated` its SwiGLU."""
        spec = families.get(m.family)
        return cls(
            m.num_hidden_layers,
            m.hidden_size,
            m.num_attention_heads,
            spec.mlp_width(m),
            m.vocab_size,
            parameter_count(m),
            parameter_count(m, include_embeddings=False),
            *activation_coefficients(m),
            m.num_key_value_heads or m.num_attention_heads,
            spec.gated_mlp,
        )

    @property
    def kv_fraction(self):
        """Key/value heads over query heads (1 without grouped-query attention)."""
        kv = np.asarray(self.kv_heads, dtype=float)
        heads = np.asarray(self.heads, dtype=float)
        return np.where(kv > 0, kv / heads, 1.0)


def activation_coefficients(m: ModelSection) -> tuple[float, float, float, float, float]:
    """(replicated, split, scores, kept_replicated, kept_split) per family, 16-bit units:
    each family's `activation_coefficients` (gptplan.families). GPT's are [K22] table 2's
    with its dropout terms; Llama and QWen (no dropout) a pre-norm SwiGLU decoder's."""
    return families.get(m.family).activation_coefficients(m)


# ---- memory ------------------------------------------------------------------------------------


def model_state_bytes_per_param(precision_code, stage_code, shard_degree):
    """[Z20] bytes per parameter for weights + grads + AdamW states on one rank, by the
    precision's row (gptplan.precision; codes, numbers or arrays).

    Mixed precision (fp16/bf16): 2 + 2 + 12 (fp32 master, momentum, variance). fp32: 4 + 4 + 8.
    stage1 shards optimizer states, stage2 also grads, stage3 also weights, over shard_degree.
    """
    w = g = precision.of_codes("bytes_per_element", precision_code)
    o = precision.of_codes("optimizer_bytes_per_param", precision_code)
    d = np.asarray(shard_degree, dtype=float)
    stage = np.asarray(stage_code)
    return np.select(
        [stage == 0, stage == 1, stage == 2, stage == 3],
        [w + g + o, w + g + o / d, w + (g + o) / d, (w + g + o) / d],
    )


def activation_bytes_per_layer(
    shape: ModelShape,
    seq_len,
    micro_batch,
    tp,
    seq_parallel,
    recompute_code,
    act_bytes,
    flash_attention=False,
):
    """[K22] table 2, scaled from 16-bit to `act_bytes` per element.

    none:      s·b·h·(34 + 5·a·s/h)            (tp: 10 + 24/t + 5as/(ht); tp+sp: all / t)
               (GPT's coefficients; each family's come from `activation_coefficients`)
    core_attn: drops the 5·a·s/h term (selective recompute)
    full_attn: keeps layer input, MLP and norms: s·b·h·23 (/t where split)
    full:      only each layer's input, 2·s·b·h
    flash_attention: the fused kernel never stores the b·a·s² scores, softmax or dropout mask
    (Dao et al. 2022, FlashAttention), so the 5·a·s/h term goes, as with core_attn.
    """
    s = np.asarray(seq_len, dtype=float)
    b = np.asarray(micro_batch, dtype=float)
    t = np.asarray(tp, dtype=float)
    sp = np.asarray(seq_parallel, dtype=bool)
    h, a = np.asarray(shape.hidden, dtype=float), np.asarray(shape.heads, dtype=float)
    sbh = s * b * h
    attn_scores = shape.act_scores * a * s / h
    rep, split = shape.act_replicated, shape.act_split
    kept_rep, kept_split = shape.kept_replicated, shape.kept_split
    linear_part = np.where(sp, (rep + split) / t, np.where(t > 1, rep + split / t, rep + split))
    scores_part = np.where(np.asarray(flash_attention, dtype=bool), 0.0, attn_scores / t)
    code = np.asarray(recompute_code)
    kept = np.where(
        sp,
        (kept_rep + kept_split) / t,
        np.where(t > 1, kept_rep + kept_split / t, kept_rep + kept_split),
    )
    per_layer_16bit = np.select(
        [code == 0, code == 1, code == 2, code == 3],
        [sbh * (linear_part + scores_part), sbh * linear_part, sbh * kept, 2.0 * sbh],
    )
    return per_layer_16bit * (np.asarray(act_bytes, dtype=float) / 2.0)


# ---- the runtime: what a GPU process holds beyond tensors the model owns ---------------------
# [CUDA] NVIDIA CUDA C++ Programming Guide, "Lazy Loading" and context creation; [NCCL] NVIDIA
# NCCL User Guide, "Environment Variables": NCCL_BUFFSIZE (4 MiB per channel and peer, send and
# receive), NCCL_MAX_NCHANNELS (up to 32 on NVLink A100/H100); [PADDLE-ALLOC] Paddle's
# auto_growth allocator (FLAGS_allocator_strategy, the default since Paddle 2.0) keeps freed
# blocks cached, so reserved exceeds allocated.
# Each communication group of more than one rank (data, tensor, pipeline, sharding, plus the
# global one) is its own NCCL communicator with its own buffers: 4 MiB x 2 (send, receive)
# x 2 ring neighbours x 32 channels = 512 MiB upper bound, fewer channels in practice. MODELLED,
# an assumption with its source, not measured here (no GPU on this project's machines).
NCCL_GB_PER_COMMUNICATOR = 0.5


def communicators(*, world, tp, pp, shard_degree, dp) -> np.ndarray:
    """NCCL communicators a rank of this layout joins (groups of more than one rank): the
    global group, data, tensor, pipeline (Paddle builds one p2p group per stage pair) and
    sharding. [NCCL] each holds its own buffers."""
    one = np.ones_like(np.asarray(world, dtype=float))
    return sum(
        (np.asarray(x, dtype=float) > 1) * one for x in (world, dp, tp, pp, pp, shard_degree)
    )


def memory_terms(
    shape: ModelShape,
    *,
    seq_len,
    micro_batch,
    accumulation,
    tp,
    pp,
    stage_code,
    shard_degree,
    recompute_code,
    seq_parallel,
    precision_code,
    overhead_gb,
    fragmentation,
    flash_attention=False,
    virtual_pp=1,
    recompute_layers=0,
    dp=1,
    communicator_gb=0.0,
) -> dict[str, np.ndarray]:
    """Peak bytes on the busiest device, term by term (each an array; their sum is the peak).

    weights, gradients, optimizer: [Z20] per sharding stage; 16-bit training keeps bf16/fp16
      weights and gradients (paddle.amp.decorate level O2, 2 + 2 bytes) and the AdamW fp32
      master weight and two moments in the optimizer (multi_precision=True, 12 bytes);
      stage1 shards the optimizer (Paddle DygraphShardingOptimizer), stage2 also the gradients
      (GroupShardedStage2), stage3 also the weights (GroupShardedStage3).
    activations: per layer by recompute choice (`activation_bytes_per_layer`, [K22] table 2
      with each family's coefficients); with `recompute_layers` k > 0 only k of a stage's
      ceil(L/p) layers keep the recompute granularity's bytes and the others keep everything
      (PaddleNLP 2.8.1 LlamaModel / LlamaForCausalLMPipe `no_recompute_layers`). The first
      pipeline stage holds min(p, m) micro-batches in flight (1F1B; interleaved: x (1 +
      (p-1)/(p·v)), [K22] section 4.2.3).
    logits: the loss path as PaddleNLP 2.8.1 computes it (LlamaPretrainingCriterion and
      GPTPretrainingCriterion: `prediction_scores.astype("float32")` into CrossEntropyLoss, or
      ParallelCrossEntropy under tp, whose softmax is kept for backward). The runner keeps
      the model's logits alive through the step (`loss, _ = model(...)`, runner/train.py), so
      at the loss kernel the 16-bit logits (2 bytes), their fp32 copy (4) and the fp32 softmax
      (4) are all alive, and in backward the logits, the softmax and the fp32 logit gradient
      (4): 10 bytes a logit in 16-bit training; 12 in fp32 (Paddle's cast to the same dtype
      copies); b·s·V/t logits.
    allocator: the fragmentation margin on the dynamic part (activations + logits),
      [PADDLE-ALLOC].
    runtime: the profile's fixed overhead (CUDA context, cuBLAS/cuDNN handles and workspaces;
      on CPU the Python + Paddle process, measured) plus `communicator_gb` per NCCL
      communicator (`communicators`; 0 on CPU, where gloo's buffers are in the measured
      overhead).
    """
    t = np.asarray(tp, dtype=float)
    p = np.asarray(pp, dtype=float)
    # uneven stages (layers not divisible by pp): the biggest stage holds ceil(L/p) layers
    stage_layers = np.ceil(np.asarray(shape.layers, dtype=float) / p)
    params_per_device = shape.params_total / (t * p) * stage_layers * p / shape.layers
    d = np.asarray(shard_degree, dtype=float)
    stage = np.asarray(stage_code)
    w = precision.of_codes("bytes_per_element", precision_code)  # gptplan.precision's rows
    o = precision.of_codes("optimizer_bytes_per_param", precision_code)
    weights = params_per_device * w / np.where(stage >= 3, d, 1.0)
    gradients = params_per_device * w / np.where(stage >= 2, d, 1.0)
    optimizer = params_per_device * o / np.where(stage >= 1, d, 1.0)
    act_bytes = w
    args = (shape, seq_len, micro_batch, tp, seq_parallel)
    per_layer = activation_bytes_per_layer(*args, recompute_code, act_bytes, flash_attention)
    k = np.minimum(np.asarray(recompute_layers, dtype=float), stage_layers)
    partial = (k > 0) & (np.asarray(recompute_code) > 0)
    if np.any(partial):
        keep_all = activation_bytes_per_layer(*args, 0, act_bytes, flash_attention)
        stage_acts = np.where(
            partial, k * per_layer + (stage_layers - k) * keep_all, stage_layers * per_layer
        )
    else:
        stage_acts = stage_layers * per_layer
    v = np.asarray(virtual_pp, dtype=float)
    in_flight = np.minimum(p, np.asarray(accumulation, dtype=float)) * np.where(
        v > 1, 1.0 + (p - 1.0) / (p * v), 1.0
    )
    activations = stage_acts * in_flight
    per_logit = precision.of_codes("logit_bytes", precision_code)
    logits = per_logit * np.asarray(micro_batch) * np.asarray(seq_len) * shape.vocab / t
    allocator = (activations + logits) * (np.asarray(fragmentation, dtype=float) - 1.0)
    world = t * p * d * np.asarray(dp, dtype=float)
    comms = communicators(world=world, tp=t, pp=p, shard_degree=d, dp=dp)
    runtime = (np.asarray(overhead_gb, dtype=float) + comms * communicator_gb) * GB
    ones = np.ones_like(weights + activations + logits + runtime)
    return {
        "weights": weights * ones,
        "gradients": gradients * ones,
        "optimizer": optimizer * ones,
        "activations": activations * ones,
        "logits": logits * ones,
        "allocator": allocator * ones,
        "runtime": runtime * ones,
    }


def memory_per_device_bytes(shape: ModelShape, **kwargs):
    """Peak bytes on the busiest device: the sum of `memory_terms` (model states +
    activations + logits + allocator margin + runtime).

    Uneven pipeline stages (L not divisible by p, which Paddle's PipelineLayer segments
    allow): the biggest stage, ceil(L/p) layers, sets the peak. Logits live on the last stage
    and are added to the first stage's activations (an upper bound)."""
    return sum(memory_terms(shape, **kwargs).values())


def layout_memory_bytes(
    shape: ModelShape, g: dict, *, overhead_gb, fragmentation, communicator_gb=0.0, terms=False
):
    """`memory_per_device_bytes` of layout columns `g` (the names gptplan.steptime uses: seq,
    micro, acc, tp, pp, vpp, stage_code, shard_degree, recompute_code, sp, flash,
    precision_code; optional dp and rc_layers, the recomputed layers per stage): the one call
    the planner's search and the published-run check share. `terms=True`: the dict of
    `memory_terms` instead of the sum."""
    n = np.asarray(g["tp"]).shape
    terms_ = memory_terms(
        shape,
        seq_len=g["seq"],
        micro_batch=g["micro"],
        accumulation=g["acc"],
        tp=g["tp"],
        pp=g["pp"],
        stage_code=g["stage_code"],
        shard_degree=g["shard_degree"],
        recompute_code=g["recompute_code"],
        seq_parallel=g["sp"],
        precision_code=g["precision_code"],
        overhead_gb=overhead_gb,
        fragmentation=fragmentation,
        flash_attention=g["flash"],
        virtual_pp=g["vpp"],
        recompute_layers=g.get("rc_layers", np.zeros(n)),
        dp=g.get("dp", np.ones(n)),
        communicator_gb=communicator_gb,
    )
    return terms_ if terms else sum(terms_.values())
