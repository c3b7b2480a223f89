"""Model facts everyone needs: named sizes, parameter count and FLOPs per token.

The runner needs them for MFU and the planner's cost model for everything; both import them
from here, so each formula exists once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gptplan.plan import ModelSection


@dataclass(frozen=True)
class GPTSize:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int


# Named sizes. gpt-tiny trains on one CPU core in seconds; gpt-base-110m is the bank-FAQ model
# (GPT-Base with a 30k CPM-style Chinese vocabulary: 12 x 768, 12 heads).
MODEL_SIZES: dict[str, GPTSize] = {
    "gpt-tiny": GPTSize(8000, 128, 2, 4, 512, 128),
    "gpt-mini": GPTSize(8000, 256, 4, 4, 1024, 256),
    "gpt-small-cpu": GPTSize(8000, 384, 6, 6, 1536, 512),
    "gpt-base-110m": GPTSize(30000, 768, 12, 12, 3072, 1024),
    "gpt-medium-350m": GPTSize(50304, 1024, 24, 16, 4096, 2048),
    "gpt-large-760m": GPTSize(50304, 1536, 24, 16, 6144, 2048),
    "gpt-1.3b": GPTSize(50304, 2048, 24, 16, 8192, 2048),
    "gpt-2.7b": GPTSize(50304, 2560, 32, 32, 10240, 2048),
    "gpt-6.7b": GPTSize(50304, 4096, 32, 32, 16384, 2048),
    "gpt-13b": GPTSize(50304, 5120, 40, 40, 20480, 2048),
}


def size_fields(name: str) -> dict:
    return asdict(MODEL_SIZES[name])


def kv_heads(model: ModelSection) -> int:
    """Key/value heads: `num_key_value_heads` for grouped-query attention, else all heads."""
    return model.num_key_value_heads or model.num_attention_heads


def lm_head_tied(model: ModelSection) -> bool:
    """PaddleNLP's GPT always ties its LM head to the word embeddings; Llama by the field."""
    return model.family == "gpt" or model.tie_word_embeddings


def layer_parameters(model: ModelSection) -> int:
    """Parameters of one transformer layer, exactly as PaddleNLP 2.8.1 builds it.

    GPT: QKV and output projections 4h^2 + 4h, MLP 2·h·f + f + h (biases), two LayerNorms 4h.
    Llama: Q and O h^2 each, K and V h·(h·kv/a) each (grouped-query attention), SwiGLU gate, up
    and down 3·h·f, no biases, two RMSNorm weights 2h.
    """
    h, f = model.hidden_size, model.intermediate_size
    if model.family == "llama":
        kv = h * kv_heads(model) // model.num_attention_heads
        return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h


def parameter_count(model: ModelSection, *, include_embeddings: bool = True) -> int:
    """Exact parameter count of PaddleNLP's GPTForCausalLM / LlamaForCausalLM.

    GPT (tied LM head) for f = 4h is Narayanan et al. 2021 eq. 2:
    12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)). Llama: layers + final RMSNorm + word embeddings
    + an untied LM head V·h (no position embeddings: RoPE). `include_embeddings=False` counts
    the layers and final norm only (the N of 6N in MFU, PaLM/torchtitan convention).
    """
    h, L = model.hidden_size, model.num_hidden_layers
    final_norm = h if model.family == "llama" else 2 * h
    body = L * layer_parameters(model) + final_norm
    if not include_embeddings:
        return body
    embeddings = model.vocab_size * h
    if model.family == "llama":
        return body + embeddings * (1 if lm_head_tied(model) else 2)
    return body + embeddings + model.max_position_embeddings * h


def training_flops_per_token(model: ModelSection, seq_len: int) -> float:
    """Model FLOPs per trained token: 6·N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B).

    N excludes embedding parameters but the LM-head matmul (2·h·V per token forward, tied or
    not) is real compute, so it is added back: 6·(N_body + V·h) + 12·L·h·s. The 12·L·h·s term
    is the attention score/value matmuls (the O(s²) part); grouped-query attention shrinks the
    K/V projections (in N) but not this term, which depends on the query heads. Recompute is
    not counted: this is *model* FLOPs, the numerator of MFU.
    """
    n = parameter_count(model, include_embeddings=False) + model.vocab_size * model.hidden_size
    return 6.0 * n + 12.0 * model.num_hidden_layers * model.hidden_size * seq_len
