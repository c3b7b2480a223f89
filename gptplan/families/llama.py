"""Llama as PaddleNLP 2.8.1's LlamaForCausalLM builds it: RoPE, SwiGLU MLP, RMSNorm, no
biases, grouped-query attention, untied LM head, no dropout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gptplan.families.base import (
    FamilySpec,
    JitPatch,
    ModelLike,
    ModelSize,
    ParallelLike,
    Problem,
    common_config,
)

if TYPE_CHECKING:
    import paddle


def _size(
    vocab: int,
    h: int,
    layers: int,
    heads: int,
    ffn: int,
    positions: int,
    kv: int = 0,
    theta: float = 10000.0,
    eps: float = 1e-6,
) -> ModelSize:
    return ModelSize(vocab, h, layers, heads, ffn, positions, "llama", kv, theta, eps)


# llama-tiny is for tests and CPU probes; 125m/350m are GPT-3 table 2.1 shapes with a SwiGLU
# width of about 8h/3 and a 32k vocabulary; llama-1b is TinyLlama 1.1B (Zhang et al. 2024);
# 7b/13b/70b are Llama 2 (Touvron et al. 2023), llama3-* Llama 3 (Meta's model cards).
SIZES = {
    "llama-tiny": _size(8000, 128, 2, 4, 352, 256, kv=2),
    "llama-125m": _size(32000, 768, 12, 12, 2048, 2048),
    "llama-350m": _size(32000, 1024, 24, 16, 2816, 2048),
    "llama-1b": _size(32000, 2048, 22, 32, 5632, 2048, kv=4, eps=1e-5),
    "llama-7b": _size(32000, 4096, 32, 32, 11008, 4096, eps=1e-5),
    "llama-13b": _size(32000, 5120, 40, 40, 13824, 4096, eps=1e-5),
    "llama-70b": _size(32000, 8192, 80, 64, 28672, 4096, kv=8, eps=1e-5),
    "llama3-8b": _size(128256, 4096, 32, 32, 14336, 8192, kv=8, theta=500000.0, eps=1e-5),
    "llama3-70b": _size(128256, 8192, 80, 64, 28672, 8192, kv=8, theta=500000.0, eps=1e-5),
}

# Parameter counts the model authors publish (the tests pin the formula to them within 0.5%):
# TinyLlama's paper, Llama 2 table 1 / model cards, Llama 3 model cards.
PUBLISHED_PARAMETERS = {
    "llama-1b": 1.1e9,
    "llama-7b": 6.74e9,
    "llama-13b": 13.0e9,
    "llama-70b": 69.0e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
}


def kv_heads(m: ModelLike) -> int:
    return m.num_key_value_heads or m.num_attention_heads


def layer_parameters(m: ModelLike) -> int:
    """Q and O h^2 each, K and V h·(h·kv/a) each (grouped-query attention), SwiGLU gate, up
    and down 3·h·f, no biases, two RMSNorm weights 2h."""
    h, f = m.hidden_size, m.intermediate_size
    kv = h * kv_heads(m) // m.num_attention_heads
    return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h


def swiglu_coefficients(m: ModelLike, branch: int) -> tuple[float, float, float, float, float]:
    """A pre-norm SwiGLU decoder without dropout, as PaddleNLP 2.8.1 runs Llama and QWen: two
    RMSNorm inputs 4, the attention and MLP inputs 2 + 2 (replicated); Q, K, V (K and V
    repeated to all heads before the score matmul when not flash) and the attention output 2
    each, the SwiGLU gate, up, SiLU(gate) and their product 2·`branch`/h each (split);
    scores: the softmax, 2·a·s²·b in these units (4 bytes in fp32 training, measured on the
    rehearsal device; in 16-bit training the family's `softmax_fp32` adds its fp32 output
    and 16-bit cast: 6 bytes a score, gptplan.memory `activation_bytes_per_layer`)."""
    mlp = 8.0 * branch / m.hidden_size
    return 8.0, 8.0 + mlp, 2.0, 4.0, 2.0 + mlp


def problem(m: ModelLike, tp: int) -> Problem:
    kv = kv_heads(m)
    if m.tie_word_embeddings:
        return "tie_word_embeddings", (
            "true is not supported: PaddleNLP 2.8.1's "
            "LlamaForCausalLM never ties its LM head; allowed: false"
        )
    a = m.num_attention_heads
    if kv > a or a % kv:
        allowed = [d for d in range(1, a + 1) if a % d == 0]
        return "num_key_value_heads", (
            f"{m.num_key_value_heads} does not divide num_attention_heads = {a}; allowed: "
            f"0 (= all heads), {', '.join(map(str, allowed))}"
        )
    if kv % tp:
        allowed = [d for d in range(1, kv + 1) if kv % d == 0]
        return "tensor_parallel", (
            f"{tp} does not divide the {kv} key/value heads (PaddleNLP splits whole KV heads "
            f"over the tensor group); allowed: {', '.join(map(str, allowed))}"
        )
    return "", ""


def config_kwargs(
    m: ModelLike, p: ParallelLike, *, seq_len: int, kernels: dict, no_recompute: list[int]
) -> dict:
    """LlamaConfig's arguments (no dropout in PaddleNLP's Llama; labels -100).
    `no_recompute`: the layers that keep every activation (partial recompute)."""
    return common_config(m, p, seq_len=seq_len, kernels=kernels) | dict(
        num_key_value_heads=kv_heads(m),
        rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_word_embeddings,
        use_cache=False,
        use_recompute=p.recompute != "none",
        recompute_granularity=(p.recompute if p.recompute != "none" else "full"),
        no_recompute_layers=no_recompute or None,
        use_fused_rms_norm=kernels.get("fused_rms_norm", False),
        use_fused_rope=kernels.get("fused_rope", False),
    )


def traceable_attention(
    query_states: paddle.Tensor,
    config: Any,  # a paddlenlp LlamaConfig (paddlenlp is untyped)
    key_states: paddle.Tensor,
    value_states: paddle.Tensor,
    attention_mask: paddle.Tensor,
    output_attentions: bool,
    alibi: paddle.Tensor | None = None,
    sequence_parallel: bool = False,
    reshard_layer: Any = None,
    npu_is_casual: bool = False,
) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
    """PaddleNLP 2.8.1's standard (non-flash) Llama attention without its Python shape checks
    (`if attn_weights.shape != [bsz, ...]`), which the static-graph trace of a dynamic
    batch/sequence turns into bool(Tensor) and refuses. Same math: softmax(QK^T/sqrt(d) +
    mask) V, the softmax in fp32."""
    import math

    import paddle
    import paddle.nn.functional as F

    head_dim = query_states.shape[-1]
    num_heads = query_states.shape[-2]
    q = paddle.transpose(query_states, [0, 2, 1, 3])
    k = paddle.transpose(key_states, [0, 2, 1, 3])
    v = paddle.transpose(value_states, [0, 2, 1, 3])
    weights = paddle.matmul(q / math.sqrt(head_dim), k.transpose([0, 1, 3, 2]))
    weights = F.softmax(weights + attention_mask, axis=-1, dtype="float32").astype(q.dtype)
    out = paddle.matmul(weights, v).transpose([0, 2, 1, 3])
    out = out.reshape([0, 0, head_dim * num_heads])
    return (out, weights) if output_attentions else out


SPEC = FamilySpec(
    name="llama",
    title="Llama",
    summary="PaddleNLP LlamaForCausalLM: RoPE, SwiGLU MLP, RMSNorm, GQA, untied LM head",
    fields=("num_key_value_heads", "rms_norm_eps", "rope_theta", "tie_word_embeddings"),
    sizes=SIZES,
    published_parameters=PUBLISHED_PARAMETERS,
    has_dropout=False,
    problem=problem,
    layer_parameters=layer_parameters,
    final_norm_parameters=lambda m: m.hidden_size,  # RMSNorm weight
    learned_positions=False,
    lm_head_tied=lambda m: m.tie_word_embeddings,
    mlp_width=lambda m: m.intermediate_size,
    gated_mlp=True,
    activation_coefficients=lambda m: swiglu_coefficients(m, m.intermediate_size),
    # PaddleNLP 2.8.1's unfused RMSNorm (`hidden_states.astype("float32")`, kept by pow and
    # the multiply: +2 bytes per norm over a 16-bit input) and RoPE (`apply_rotary_pos_emb`:
    # q and k kept before rotation and rotated-half for the cos / sin multiplies, with the
    # gathered cos and sin): measured on the rehearsal device (bench/memory_device.py, 2 and 4
    # layers, seq 64 and 128) 106 bytes per s·b·h per layer in fp32 and 57.1 in bf16 O2 where
    # the coefficients count 96 and 48: 5 more 16-bit units (the rotary part, split by tensor
    # parallel) and 4 bytes of fp32 norm inputs in 16-bit training
    unfused_activation=(5.0, 4.0),
    softmax_fp32=True,  # LlamaAttention / QWenAttention: F.softmax(dtype="float32").astype
    column_projections=5,  # q, k, v, gate and up (fuse_attention_qkv / fuse_attention_ffn off)
    recompute_granularities=("full", "full_attn", "core_attn"),
    partial_recompute_why_not="",
    # LlamaForCausalLMPipe asserts no_recompute_layers is empty under 'full'
    partial_recompute_pipeline_refuses=("full",),
    pipeline_why_not="",
    config_class="paddlenlp.transformers:LlamaConfig",
    causal_lm_class="paddlenlp.transformers:LlamaForCausalLM",
    pipeline_class="paddlenlp.transformers.llama.modeling_pp:LlamaForCausalLMPipe",
    config_kwargs=config_kwargs,
    fused_kernels=True,
    decoder_layers="llama.layers",
    model_type="llama",
    jit_patches=(
        JitPatch(
            "paddlenlp.transformers.llama.modeling:scaled_dot_product_attention",
            traceable_attention,
        ),
    ),
    # PaddleNLP 2.8.1's generate builds a 4-D float mask that its Llama refuses (it wants a
    # boolean one); a 2-D all-ones mask of the prompt goes through Llama's own path
    generate_bool_mask=True,
    # every layer's LlamaRotaryEmbedding: cos_cached and sin_cached [1, s_max, 1, head_dim]
    # and inv_freq [head_dim / 2]
    model_buffers=lambda m: (
        0.0,
        2.0 * m.max_position_embeddings * (m.hidden_size // m.num_attention_heads)
        + (m.hidden_size // m.num_attention_heads) / 2,
    ),
    # q and o h x h, k and v h x (h·kv/a), gate / up / down h x f
    layer_matrices=lambda m: (
        (m.hidden_size * m.hidden_size, 2),
        (m.hidden_size * m.hidden_size * kv_heads(m) // m.num_attention_heads, 2),
        (m.hidden_size * m.intermediate_size, 3),
    ),
)
