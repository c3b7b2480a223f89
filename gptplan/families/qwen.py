"""QWen (Qwen 1) as PaddleNLP 2.8.1's QWenForCausalLM builds it (paddlenlp/transformers/qwen/
modeling.py): rotary positions on every head dimension, RMSNorm, a fused QKV projection WITH
bias (c_attn: h -> 3h + 3h) and an output projection without (no_bias = True), a SwiGLU MLP
whose `intermediate_size` is TWICE the width of one branch (QWenMLP: ff_dim_in =
intermediate_size // 2 for w1, w2 and c_proj; Qwen-7B's 22016 is a branch width of 11008),
no dropout (emb/attn_dropout_prob 0), an untied LM head (QWenLMHead's own [h, V] weight), no
grouped-query attention, no per-layer recompute. The pipeline class QWenForCausalLMPipe
exists (modeling_pp.py).

Plan fields map to QWenConfig's names: rms_norm_eps -> layer_norm_epsilon, rope_theta ->
rotary_emb_base, kv_channels = hidden_size / num_attention_heads.
"""

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
from gptplan.families.llama import swiglu_coefficients

if TYPE_CHECKING:
    import paddle


def _size(vocab: int, h: int, layers: int, heads: int, ffn: int, positions: int) -> ModelSize:
    return ModelSize(vocab, h, layers, heads, ffn, positions, "qwen", 0, 10000.0, 1e-6)


# Qwen-7B and Qwen-14B as their Hugging Face config.json files give them (Qwen/Qwen-7B,
# Qwen/Qwen-14B: hidden_size 4096 / 5120, num_hidden_layers 32 / 40, num_attention_heads
# 32 / 40, intermediate_size 22016 / 27392, vocab_size 151936, seq_length 8192 / 2048,
# rotary_emb_base 10000, layer_norm_epsilon 1e-6; Bai et al. 2023, "Qwen Technical Report",
# arXiv:2309.16609, table 1 for the shapes). qwen-tiny is for tests and CPU probes.
SIZES = {
    "qwen-tiny": _size(8000, 128, 2, 4, 704, 256),
    "qwen-1.8b": _size(151936, 2048, 24, 16, 11008, 8192),
    "qwen-7b": _size(151936, 4096, 32, 32, 22016, 8192),
    "qwen-14b": _size(151936, 5120, 40, 40, 27392, 2048),
}

# Parameter counts as published on the models' Hugging Face pages (Qwen/Qwen-7B: 7.72B,
# Qwen/Qwen-14B: 14.2B, the safetensors' total); the formula gives 7,721,324,544 and
# 14,165,980,160.
PUBLISHED_PARAMETERS = {
    "qwen-7b": 7.72e9,
    "qwen-14b": 14.2e9,
}


def layer_parameters(m: ModelLike) -> int:
    """c_attn 3h^2 + 3h (QKV with bias), c_proj h^2 (no bias), w1, w2, c_proj of the MLP
    3·h·(f/2) (no bias), two RMSNorm weights 2h."""
    h, branch = m.hidden_size, m.intermediate_size // 2
    return 4 * h * h + 3 * h + 3 * h * branch + 2 * h


def problem(m: ModelLike, tp: int) -> Problem:
    if m.tie_word_embeddings:
        return "tie_word_embeddings", (
            "true is not supported: PaddleNLP 2.8.1's QWenForCausalLM never ties its LM "
            "head; allowed: false"
        )
    if m.intermediate_size % 2:
        return "intermediate_size", (
            f"{m.intermediate_size} is odd: QWen's intermediate_size is twice the width of "
            "one SwiGLU branch (QWenMLP uses intermediate_size // 2); use an even value"
        )
    if (m.intermediate_size // 2) % tp:
        return "tensor_parallel", (
            f"{tp} does not divide the SwiGLU branch width intermediate_size / 2 = "
            f"{m.intermediate_size // 2} (PaddleNLP splits each branch over the tensor group)"
        )
    return "", ""


def config_kwargs(
    m: ModelLike, p: ParallelLike, *, seq_len: int, kernels: dict, no_recompute: list[int]
) -> dict:
    """QWenConfig's arguments. use_dynamic_ntk and use_logn_attn (long-context tricks QWen
    applies at inference only, and only past seq_length) are off, so inference computes what
    training did."""
    return common_config(m, p, seq_len=seq_len, kernels=kernels) | dict(
        kv_channels=m.hidden_size // m.num_attention_heads,
        layer_norm_epsilon=m.rms_norm_eps,
        rotary_emb_base=m.rope_theta,
        emb_dropout_prob=0.0,
        attn_dropout_prob=0.0,
        tie_word_embeddings=False,
        use_dynamic_ntk=False,
        use_logn_attn=False,
        use_cache=False,
        recompute_granularity=(p.recompute if p.recompute != "none" else "full"),
        use_fused_rms_norm=kernels.get("fused_rms_norm", False),
        use_fused_rope=kernels.get("fused_rope", False),
    )


def traceable_attn(
    self: Any,  # a paddlenlp QWenAttention (paddlenlp is untyped)
    query: paddle.Tensor,
    key: paddle.Tensor,
    value: paddle.Tensor,
    attention_mask: paddle.Tensor | None = None,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """QWenAttention._attn (standard, non-flash path) without its Python shape check, which a
    static-graph trace of a dynamic batch/sequence cannot evaluate. Same math."""
    import math

    import paddle
    import paddle.nn.functional as F

    head_dim = query.shape[-1]
    query = query.transpose([0, 2, 1, 3])
    key = key.transpose([0, 2, 1, 3])
    value = value.transpose([0, 2, 1, 3])
    weights = paddle.matmul(query / math.sqrt(head_dim), key.transpose([0, 1, 3, 2]))
    weights = F.softmax(weights + attention_mask, axis=-1, dtype="float32").astype(value.dtype)
    out = paddle.matmul(weights, value).transpose([0, 2, 1, 3])
    return out, weights


def traceable_rotary(
    self: Any,  # a paddlenlp QWen RotaryEmbedding (paddlenlp is untyped)
    x: paddle.Tensor,
    max_seq_len: int,
    offset: int = 0,
    ntk_alpha: float = 1.0,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """RotaryEmbedding.forward without its cos/sin cache (the trace cannot assign the cached
    tensors to the layer): the same cos and sin of positions 0..s-1 from its inv_freq (the
    NTK scaling that would change inv_freq is off, see `config_kwargs`)."""
    import paddle

    seq = paddle.arange(0, paddle.shape(x)[1], dtype="float32")
    freqs = seq.unsqueeze(1) * self.inv_freq.astype("float32").unsqueeze(0)
    emb = paddle.concat([freqs, freqs], axis=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    return cos.cast(x.dtype), sin.cast(x.dtype)


SPEC = FamilySpec(
    name="qwen",
    title="QWen",
    summary="PaddleNLP QWenForCausalLM: RoPE, SwiGLU MLP (intermediate_size = 2 branches), "
    "RMSNorm, QKV bias, untied LM head",
    fields=("rms_norm_eps", "rope_theta", "tie_word_embeddings"),
    sizes=SIZES,
    published_parameters=PUBLISHED_PARAMETERS,
    has_dropout=False,
    problem=problem,
    layer_parameters=layer_parameters,
    final_norm_parameters=lambda m: m.hidden_size,  # ln_f: RMSNorm weight
    learned_positions=False,
    lm_head_tied=lambda m: False,
    mlp_width=lambda m: m.intermediate_size // 2,
    gated_mlp=True,
    activation_coefficients=lambda m: swiglu_coefficients(m, m.intermediate_size // 2),
    # PaddleNLP 2.8.1's unfused RMSNorm (`hidden_states.astype("float32")`, kept by pow and
    # the multiply: +2 bytes per norm over a 16-bit input) and RoPE (`apply_rotary_pos_emb`:
    # q and k kept before rotation and rotated-half for the cos / sin multiplies, with the
    # gathered cos and sin): measured on the rehearsal device (bench/memory_device.py, 2 and 4
    # layers, seq 64 and 128) 106 bytes per s·b·h per layer in fp32 and 57.1 in bf16 O2 where
    # the coefficients count 96 and 48: 5 more 16-bit units (the rotary part, split by tensor
    # parallel) and 4 bytes of fp32 norm inputs in 16-bit training
    unfused_activation=(5.0, 4.0),
    softmax_fp32=True,  # LlamaAttention / QWenAttention: F.softmax(dtype="float32").astype
    column_projections=3,  # c_attn (q, k, v fused), w1 and w2
    # QWenModel recomputes whole blocks under 'full' and QWenAttention the core under
    # 'core_attn'; nothing reads 'full_attn' (it would silently recompute nothing)
    recompute_granularities=("full", "core_attn"),
    partial_recompute_why_not=(
        "PaddleNLP 2.8.1's QWen has no per-layer recompute (no no_recompute_layers)"
    ),
    partial_recompute_pipeline_refuses=(),
    pipeline_why_not="",
    config_class="paddlenlp.transformers:QWenConfig",
    causal_lm_class="paddlenlp.transformers:QWenForCausalLM",
    pipeline_class="paddlenlp.transformers.qwen.modeling_pp:QWenForCausalLMPipe",
    config_kwargs=config_kwargs,
    # QWen's fused RMSNorm and RoPE paths are not checked on a GPU here: off
    fused_kernels=False,
    decoder_layers="",
    model_type="qwen",
    jit_patches=(
        JitPatch("paddlenlp.transformers.qwen.modeling:QWenAttention._attn", traceable_attn),
        JitPatch("paddlenlp.transformers.qwen.modeling:RotaryEmbedding.forward", traceable_rotary),
    ),
    # every layer's QWenAttention: logn_tensor [1, MAX_NTK_SEQ_LENGTH - 1 = 32767, 1, 1] and
    # its rotary inv_freq [head_dim / 2]
    model_buffers=lambda m: (0.0, 32767.0 + (m.hidden_size // m.num_attention_heads) / 2),
    # c_attn h x 3h, c_proj h x h, w1 / w2 / c_proj h x f/2 (intermediate_size is two branches)
    layer_matrices=lambda m: (
        (3 * m.hidden_size * m.hidden_size, 1),
        (m.hidden_size * m.hidden_size, 1),
        (m.hidden_size * (m.intermediate_size // 2), 3),
    ),
)
