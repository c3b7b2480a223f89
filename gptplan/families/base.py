"""What a model family declares (FamilySpec) and the shapes it reads (ModelLike, ParallelLike).

Nothing here imports the plan schema: the schema asks the registry, not the other way round
(gptplan.plan imports gptplan.families; a family module reads a [model] table through the
ModelLike protocol, which gptplan.plan.ModelSection satisfies).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class ModelLike(Protocol):
    """The [model] fields a family reads (gptplan.plan.ModelSection has them all)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_dropout_prob: float
    attention_probs_dropout_prob: float
    initializer_range: float
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool


class ParallelLike(Protocol):
    """The [parallel] fields a family's PaddleNLP config reads."""

    tensor_parallel_degree: int
    pipeline_parallel_degree: int
    virtual_pp_degree: int
    sequence_parallel: bool
    recompute: str


@dataclass(frozen=True)
class ModelSize:
    """A named size: the published shape of one model (PaddleNLP's field names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    family: str = "gpt"
    num_key_value_heads: int = 0  # 0 = as many as attention heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


# The shape fields every family has (the [model] keys a spec must give without a named size).
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)


def common_config(m: ModelLike, p: ParallelLike, *, seq_len: int, kernels: dict) -> dict:
    """The PaddleNLP config arguments every family's class takes under the same names: the
    shape (SHAPE_FIELDS), the sequence length, initialisation, the ignored label id (-100) and
    the parallel layout. A family's config_kwargs adds its own to these."""
    return {
        **{name: getattr(m, name) for name in SHAPE_FIELDS},
        "seq_length": seq_len,
        "initializer_range": m.initializer_range,
        "ignore_index": -100,
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "tensor_parallel_output": True,
        "sequence_parallel": p.sequence_parallel,
        "use_flash_attention": kernels.get("flash_attention", False),
        "virtual_pp_degree": p.virtual_pp_degree,
    }


# Fields only some families use, with the [model] defaults a family that does not use one
# must leave it at (each family's FamilySpec.fields says which of these it uses).
OPTIONAL_FIELDS: dict[str, object] = {
    "num_key_value_heads": 0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

Problem = tuple[str, str]  # (key relative to [model] or 'tensor_parallel', message); ('', '') ok
Coefficients = tuple[float, float, float, float, float]


@dataclass(frozen=True)
class JitPatch:
    """What `paddle.jit.save` needs swapped while it traces the model: `target`
    ('module:attribute' or 'module:Class.method') is replaced by `replacement`."""

    target: str
    replacement: Callable


@dataclass(frozen=True)
class FamilySpec:
    """Everything the planner, the memory and step-time model, the runner and the exporter
    need to know about one model family, in one place (the way torchtitan's ModelSpec ties a
    model to its trainer). Register one with gptplan.families.register."""

    name: str  # the [model] family value
    title: str  # how messages name it ('Llama')
    summary: str  # one line: the PaddleNLP class and the architecture
    # -- the [model] table --------------------------------------------------------------------
    fields: tuple[str, ...]  # which OPTIONAL_FIELDS the family uses
    sizes: Mapping[str, ModelSize]  # named sizes (published shapes)
    published_parameters: Mapping[str, float]  # named size -> the authors' parameter count
    has_dropout: bool  # PaddleNLP's class applies hidden/attention dropout
    problem: Callable[[ModelLike, int], Problem]  # family validity rules (model, tp degree)
    # -- parameters, FLOPs, GEMMs, memory -----------------------------------------------------
    layer_parameters: Callable[[ModelLike], int]  # one transformer layer, exactly
    final_norm_parameters: Callable[[ModelLike], int]
    learned_positions: bool  # a position-embedding table (max_position_embeddings x h)
    lm_head_tied: Callable[[ModelLike], bool]
    mlp_width: Callable[[ModelLike], int]  # the width of one MLP branch (the GEMM's N)
    gated_mlp: bool  # SwiGLU: gate and up projections, then down
    activation_coefficients: Callable[[ModelLike], Coefficients]  # gptplan.memory's units
    # -- what the runner may do ---------------------------------------------------------------
    recompute_granularities: tuple[str, ...]  # PaddleNLP recompute_granularity values it runs
    partial_recompute_why_not: str  # '' = per-layer recompute (no_recompute_layers) offered
    partial_recompute_pipeline_refuses: tuple[str, ...]  # granularities its Pipe class refuses
    pipeline_why_not: str  # '' = pipeline parallel offered (pipeline_class)
    # -- the PaddleNLP classes ('module:Class'), built by runner.model ------------------------
    config_class: str
    causal_lm_class: str
    pipeline_class: str  # '' = none
    config_kwargs: Callable[..., dict]  # (model, parallel, *, seq_len, kernels, no_recompute)
    fused_kernels: bool  # use_fused_rms_norm / use_fused_rope where the device has them
    decoder_layers: str  # attribute path of the layer list with per-layer recompute ('' none)
    # -- export --------------------------------------------------------------------------------
    model_type: str  # PaddleNLP config model_type (AutoModelForCausalLM picks the class by it)
    jit_patches: tuple[JitPatch, ...] = ()
    generate_bool_mask: bool = False  # its generate() wants a 2-D boolean attention mask
    # which of the built network's layers switch recompute on, for (net, recompute, pipeline);
    # None = PaddleNLP's recompute_enable (every layer with an enable_recompute flag)
    enable_recompute: Callable[[Any, str, bool], None] | None = None
    # -- memory (gptplan.memory) -----------------------------------------------------------
    # the class's non-parameter tensors: (bytes per model, weight elements per layer)
    model_buffers: Callable[[ModelLike], tuple[float, float]] = lambda m: (0.0, 0.0)
    # activations beyond the count of `activation_coefficients`, measured on the rehearsal
    # device (Paddle's allocator, bench/memory_device.py; gptplan.memory
    # `activation_bytes_per_layer`): bytes per s·b·h per layer that 16-bit (AMP) training
    # keeps beyond the 16-bit count (replicated under tensor parallel)
    amp_activation: float = 0.0
    # the unfused RMSNorm and RoPE (the family's Python code, where it runs no fused kernel):
    # (16-bit units per s·b·h per layer of the rotary embedding's kept tensors, split by tensor
    # parallel; bytes per s·b·h per layer the norms keep in fp32 in 16-bit training)
    unfused_activation: tuple[float, float] = (0.0, 0.0)
    # the attention softmax computed in fp32 and cast back to 16-bit (F.softmax(...,
    # dtype="float32").astype(...)): in 16-bit training 4 + 2 bytes a score, not 2
    softmax_fp32: bool = False
    # column-parallel projections a layer feeds (tensor parallel): each keeps its own input,
    # a copy (c_identity) or, with sequence parallel, the all-gathered full sequence; 0 =
    # [K22]'s count (two inputs a layer, split with sequence parallel)
    column_projections: int = 0
    # a layer's weight matrices before tensor parallelism, (elements, how many) in three slots
    layer_matrices: Callable[[ModelLike], tuple[tuple[int, int], ...]] = lambda m: (
        (4 * m.hidden_size * m.hidden_size, 1),
        (m.hidden_size * m.intermediate_size, 2),
        (0, 0),
    )
