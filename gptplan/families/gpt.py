"""GPT as PaddleNLP 2.8.1's GPTForCausalLM builds it: learned positions, GELU MLP, LayerNorm,
biases everywhere, LM head tied to the word embeddings, hidden and attention dropout."""

from __future__ import annotations

from typing import Any

from gptplan.families.base import (
    FamilySpec,
    ModelLike,
    ModelSize,
    ParallelLike,
    Problem,
    common_config,
)


def _size(vocab: int, h: int, layers: int, heads: int, ffn: int, positions: int) -> ModelSize:

    return ModelSize(vocab, h, layers, heads, ffn, positions, "gpt")


# gpt-tiny trains on one CPU core in seconds; gpt-base-110m is the bank-FAQ model (GPT-Base
# with a 30k CPM-style Chinese vocabulary: 12 x 768, 12 heads); medium to 13b are the GPT-3
# shapes (Brown et al. 2020, table 2.1) with GPT-2's 50,257 vocabulary padded to 50,304.
SIZES = {
    "gpt-tiny": _size(8000, 128, 2, 4, 512, 128),
    "gpt-mini": _size(8000, 256, 4, 4, 1024, 256),
    "gpt-small-cpu": _size(8000, 384, 6, 6, 1536, 512),
    "gpt-base-110m": _size(30000, 768, 12, 12, 3072, 1024),
    "gpt-medium-350m": _size(50304, 1024, 24, 16, 4096, 2048),
    "gpt-large-760m": _size(50304, 1536, 24, 16, 6144, 2048),
    "gpt-1.3b": _size(50304, 2048, 24, 16, 8192, 2048),
    "gpt-2.7b": _size(50304, 2560, 32, 32, 10240, 2048),
    "gpt-6.7b": _size(50304, 4096, 32, 32, 16384, 2048),
    "gpt-13b": _size(50304, 5120, 40, 40, 20480, 2048),
}


def layer_parameters(m: ModelLike) -> int:
    """QKV and output projections 4h^2 + 4h, MLP 2·h·f + f + h (biases), two LayerNorms 4h."""
    h, f = m.hidden_size, m.intermediate_size
    return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h


def activation_coefficients(m: ModelLike) -> tuple[float, float, float, float, float]:
    """[K22] table 2 (34·s·b·h + 5·a·s²·b, MLP 4h wide) with dropout: its two hidden dropout
    masks (1 byte per element each, replicated) and the attention-probability mask and
    dropout output (1 + 2 per score) are stored only when that dropout is on (Paddle's
    dropout returns its input at p = 0, as PyTorch's does): 32·s·b·h + 2·a·s²·b without."""
    hidden = float(m.hidden_dropout_prob > 0)
    attn = float(m.attention_probs_dropout_prob > 0)
    return 8.0 + 2.0 * hidden, 24.0, 2.0 + 3.0 * attn, 4.0, 18.0 + hidden


def config_kwargs(
    m: ModelLike, p: ParallelLike, *, seq_len: int, kernels: dict, no_recompute: list[int]
) -> dict:
    """GPTConfig's arguments (labels use -100 as the ignored id)."""
    return common_config(m, p, seq_len=seq_len, kernels=kernels) | dict(
        hidden_dropout_prob=m.hidden_dropout_prob,
        attention_probs_dropout_prob=m.attention_probs_dropout_prob,
        recompute_granularity=_granularity(p),
    )


# PaddleNLP 2.8.1's GPT (modeling.py) reads recompute_granularity in three places: the decoder
# recomputes each whole layer for "full_attn", the layer recomputes its attention block for
# "full_attn" too (nested inside the decoder's, both non-reentrant: Paddle refuses the first
# forward, "saved_tensors_hooks only one pair of hooks"), the attention its core for
# "core_attn"; nothing reads "full", so a plain "full" recomputes nothing. GPTForCausalLMPipe
# (modeling_pp.py) reads "full" (whole layer) and "full_attn" (the layer's attention) as meant.
# So the plan's "full" is PaddleNLP's "full_attn" with only the decoder's switch on, and the
# plan's "full_attn" is "full_attn" with only the layers' switches on.
def _granularity(p: ParallelLike) -> str:
    if p.recompute == "none":
        return "full"
    if p.recompute == "full" and p.pipeline_parallel_degree == 1:
        return "full_attn"
    return p.recompute


def enable_recompute(net: Any, recompute: str, pipeline: bool) -> None:
    """Switch on the recompute that the plan's granularity means (see _granularity)."""
    net.recompute_enable()
    decoder = getattr(getattr(net, "gpt", None), "decoder", None)
    if pipeline or decoder is None:
        return
    if recompute == "full_attn":  # the layers' attention recompute only
        decoder.enable_recompute = False
    elif recompute == "full":  # the decoder's whole-layer recompute only
        for layer in decoder.layers:
            layer.enable_recompute = False


def _no_problem(m: ModelLike, tp: int) -> Problem:
    return "", ""


SPEC = FamilySpec(
    name="gpt",
    title="GPT",
    summary="PaddleNLP GPTForCausalLM: learned positions, GELU MLP, LayerNorm, tied LM head",
    fields=(),
    sizes=SIZES,
    published_parameters={},
    has_dropout=True,
    problem=_no_problem,
    layer_parameters=layer_parameters,
    final_norm_parameters=lambda m: 2 * m.hidden_size,  # LayerNorm weight and bias
    learned_positions=True,
    lm_head_tied=lambda m: True,  # PaddleNLP's GPT always ties its LM head
    mlp_width=lambda m: m.intermediate_size,
    gated_mlp=False,
    activation_coefficients=activation_coefficients,
    # measured on the rehearsal device (bench/memory_device.py, bf16 and fp16 O2, 2 and 4
    # layers, seq 64 and 128): 42.2 bytes per s·b·h per layer where the 16-bit count is 34;
    # the LayerNorms paddle.amp.decorate keeps in fp32 (amp_initialize's need_keep_fp32) are
    # where: each keeps an fp32 input (+2 x 2), and the fp32 output of the first is cast
    # separately by each of the q, k and v projections (+2 x 2)
    amp_activation=8.0,
    column_projections=4,  # q, k, v (GPTConfig fuse_attention_qkv off) and linear1
    recompute_granularities=("full", "full_attn", "core_attn"),
    partial_recompute_why_not=(
        "PaddleNLP 2.8.1's GPT has no per-layer recompute (no_recompute_layers exists in its "
        "Llama only)"
    ),
    partial_recompute_pipeline_refuses=(),
    pipeline_why_not="",
    config_class="paddlenlp.transformers:GPTConfig",
    causal_lm_class="paddlenlp.transformers:GPTForCausalLM",
    pipeline_class="paddlenlp.transformers.gpt.modeling_pp:GPTForCausalLMPipe",
    enable_recompute=enable_recompute,
    config_kwargs=config_kwargs,
    fused_kernels=False,
    decoder_layers="",
    model_type="gpt",
    # GPTModel.__init__: self.bias = paddle.tril(paddle.ones([1, 1, s_max, s_max], "int64"))
    model_buffers=lambda m: (8.0 * m.max_position_embeddings**2, 0.0),
    # q, k, v, out_proj h x h; linear1, linear2 h x f
    layer_matrices=lambda m: (
        (m.hidden_size * m.hidden_size, 4),
        (m.hidden_size * m.intermediate_size, 2),
        (0, 0),
    ),
)
