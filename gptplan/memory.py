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

from gptplan.modelfacts import parameter_count
from gptplan.plan import ModelSection

GB = 1e9  # modelled bytes are shown in GB (10^9)
# A device's memory (profile memory_gb, plan hardware.memory_gb) is in binary gigabytes: an
# "80 GB" H100 or A100 has 81,920 MiB of HBM (nvidia-smi), a "40 GB" A100 40,960 MiB, and the
# CPU profile is half of a 24 GiB machine. Counting them as 10^9 bytes cut 7% off every device.
GIB = 2**30
# The memory model's own relative error, used as the "may fit" margin: a layout modelled over
# the usable limit by less than this is kept and flagged, not cut. 12% is MEASURED: the median
# absolute error of the model against the measured peak memory of Paddle runs, 52 held-out
# configurations (bench/README.md section 2, bench/results/plan_quality.json
# memory_ape_median 0.1197, worst 0.20; CPU, the only hardware where Paddle ran here). On GPUs
# the published runs bound it from one side: every run there ran, and the model says 63 of 252
# need more than their device (llm-foundry's FSDP runs without recompute by up to 21%: no
# dropout, 16-bit logits; torchtitan's per-op checkpointing by 63%), so on GPUs it
# overestimates at least that much for those frameworks (bench/estimate_accuracy.py).
MEMORY_MODEL_ERROR = 0.12


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
        return cls(
            m.num_hidden_layers,
            m.hidden_size,
            m.num_attention_heads,
            m.intermediate_size,
            m.vocab_size,
            parameter_count(m),
            parameter_count(m, include_embeddings=False),
            *activation_coefficients(m),
            m.num_key_value_heads or m.num_attention_heads,
            m.family == "llama",
        )

    @property
    def kv_fraction(self):
        """Key/value heads over query heads (1 without grouped-query attention)."""
        kv = np.asarray(self.kv_heads, dtype=float)
        heads = np.asarray(self.heads, dtype=float)
        return np.where(kv > 0, kv / heads, 1.0)


def activation_coefficients(m: ModelSection) -> tuple[float, float, float, float, float]:
    """(replicated, split, scores, kept_replicated, kept_split) per family, 16-bit units.

    GPT: [K22] table 2 (34·s·b·h + 5·a·s²·b, MLP 4h wide) with dropout: its two hidden
    dropout masks (1 byte per element each, replicated) and the attention-probability mask and
    dropout output (1 + 2 per score) are stored only when that dropout is on (Paddle's dropout
    returns its input at p = 0, as PyTorch's does): 32·s·b·h + 2·a·s²·b without any.
    Llama as PaddleNLP 2.8.1 runs it (no dropout): two RMSNorm inputs 4, the attention and MLP
    inputs 2 + 2 (replicated); Q, K, V (K and V repeated to all heads before the score matmul
    when not flash) and the attention output 2 each, the SwiGLU gate, up, SiLU(gate) and their
    product 2·f/h each (split); scores: the softmax kept in fp32 plus its 16-bit cast, 3·a·s²·b.
    """
    if m.family != "llama":
        hidden = float(m.hidden_dropout_prob > 0)
        attn = float(m.attention_probs_dropout_prob > 0)
        return 8.0 + 2.0 * hidden, 24.0, 2.0 + 3.0 * attn, 4.0, 18.0 + hidden
    mlp = 8.0 * m.intermediate_size / m.hidden_size
    return 8.0, 8.0 + mlp, 3.0, 4.0, 2.0 + mlp


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


def memory_per_device_bytes(
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
    mixed_precision,
    overhead_gb,
    fragmentation,
    flash_attention=False,
    virtual_pp=1,
):
    """Peak bytes on the busiest device: model states + activations + logits + overhead.

    Uneven pipeline stages (L not divisible by p, which Paddle's PipelineLayer segments
    allow): the biggest stage, ceil(L/p) layers, sets the peak.
    Pipeline: the first stage holds activations of min(p, m) micro-batches in flight (1F1B),
    i.e. about L layers' worth [K22]; the interleaved schedule with v chunks per stage holds
    (1 + (p-1)/(p·v)) times more ([K22] section 4.2.3). Logits b·s·V/t in fp32 plus their
    gradient live on the
    last stage. A fragmentation margin multiplies the dynamic part.
    """
    t = np.asarray(tp, dtype=float)
    p = np.asarray(pp, dtype=float)
    # uneven stages (layers not divisible by pp): the biggest stage holds ceil(L/p) layers
    stage_layers = np.ceil(np.asarray(shape.layers, dtype=float) / p)
    params_per_device = shape.params_total / (t * p) * stage_layers * p / shape.layers
    states = params_per_device * model_state_bytes_per_param(
        mixed_precision, stage_code, shard_degree
    )
    act_bytes = np.where(np.asarray(mixed_precision, dtype=bool), 2.0, 4.0)
    per_layer = activation_bytes_per_layer(
        shape, seq_len, micro_batch, tp, seq_parallel, recompute_code, act_bytes, flash_attention
    )
    v = np.asarray(virtual_pp, dtype=float)
    in_flight = np.minimum(p, np.asarray(accumulation, dtype=float)) * np.where(
        v > 1, 1.0 + (p - 1.0) / (p * v), 1.0
    )
    activations = per_layer * stage_layers * in_flight
    logits = 2.0 * 4.0 * np.asarray(micro_batch) * np.asarray(seq_len) * shape.vocab / t
    dynamic = (activations + logits) * fragmentation
    return states + dynamic + overhead_gb * GB


def layout_memory_bytes(shape: ModelShape, g: dict, *, overhead_gb, fragmentation):
    """`memory_per_device_bytes` of layout columns `g` (the names gptplan.steptime uses: seq,
    micro, acc, tp, pp, vpp, stage_code, shard_degree, recompute_code, sp, flash,
    precision_code): the one call the planner's search and the published-run check share."""
    return memory_per_device_bytes(
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
        mixed_precision=np.asarray(g["precision_code"]) > 0,
        overhead_gb=overhead_gb,
        fragmentation=fragmentation,
        flash_attention=g["flash"],
        virtual_pp=g["vpp"],
    )
