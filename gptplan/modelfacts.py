"""Model facts everyone needs: named sizes, parameter count and FLOPs per token.

The runner needs them for MFU and the planner's cost model for everything; both import them
from here, so each formula exists once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: gptplan.plan's validate imports this module
    from gptplan.plan import ModelSection


@dataclass(frozen=True)
class GPTSize:
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


def _llama(vocab, h, layers, heads, ffn, positions, kv=0, theta=10000.0, eps=1e-6) -> GPTSize:
    return GPTSize(vocab, h, layers, heads, ffn, positions, "llama", kv, theta, eps)


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
    # Llama-style (RoPE, SwiGLU, RMSNorm, untied LM head). llama-tiny is for tests and CPU
    # probes; 125m/350m are GPT-3 table 2.1 shapes with a SwiGLU width of about 8h/3 and a 32k
    # vocabulary; llama-1b is TinyLlama 1.1B (Zhang et al. 2024); 7b/13b/70b are Llama 2
    # (Touvron et al. 2023), llama3-* Llama 3 (Meta's model cards).
    "llama-tiny": _llama(8000, 128, 2, 4, 352, 256, kv=2),
    "llama-125m": _llama(32000, 768, 12, 12, 2048, 2048),
    "llama-350m": _llama(32000, 1024, 24, 16, 2816, 2048),
    "llama-1b": _llama(32000, 2048, 22, 32, 5632, 2048, kv=4, eps=1e-5),
    "llama-7b": _llama(32000, 4096, 32, 32, 11008, 4096, eps=1e-5),
    "llama-13b": _llama(32000, 5120, 40, 40, 13824, 4096, eps=1e-5),
    "llama-70b": _llama(32000, 8192, 80, 64, 28672, 4096, kv=8, eps=1e-5),
    "llama3-8b": _llama(128256, 4096, 32, 32, 14336, 8192, kv=8, theta=500000.0, eps=1e-5),
    "llama3-70b": _llama(128256, 8192, 80, 64, 28672, 8192, kv=8, theta=500000.0, eps=1e-5),
}

# Parameter counts the model authors publish for the named sizes (the tests pin
# `parameter_count` to them within 0.5%): TinyLlama's paper, Llama 2 table 1 / model cards,
# Llama 3 model cards.
PUBLISHED_PARAMETERS: dict[str, float] = {
    "llama-1b": 1.1e9,
    "llama-7b": 6.74e9,
    "llama-13b": 13.0e9,
    "llama-70b": 69.0e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
}

# Fields only the Llama family has, with their defaults (a GPT model must leave them alone).
LLAMA_ONLY_FIELDS = {
    "num_key_value_heads": 0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def size_fields(name: str) -> dict:
    """The ModelSection fields of a named size (GPT sizes leave the Llama-only ones out)."""
    fields = asdict(MODEL_SIZES[name])
    if fields["family"] == "gpt":
        for key in ("num_key_value_heads", "rope_theta", "rms_norm_eps"):
            fields.pop(key)
    return fields


def model_problem(model: ModelSection, tensor_parallel_degree: int = 1) -> tuple[str, str]:
    """(key, message) for a model the family's PaddleNLP 2.8.1 class cannot build, or
    ('', '') when it can. Keys are relative to the [model] table, except 'tensor_parallel'."""
    kv = kv_heads(model)
    if model.family == "gpt":
        for name, default in LLAMA_ONLY_FIELDS.items():
            if getattr(model, name) != default:
                return name, (
                    "is a Llama field; family 'gpt' does not use it (remove it or "
                    "set family = 'llama')"
                )
        return "", ""
    if model.tie_word_embeddings:
        return "tie_word_embeddings", (
            "true is not supported: PaddleNLP 2.8.1's "
            "LlamaForCausalLM never ties its LM head; allowed: false"
        )
    if kv > model.num_attention_heads or model.num_attention_heads % kv:
        allowed = [
            d for d in range(1, model.num_attention_heads + 1) if model.num_attention_heads % d == 0
        ]
        return "num_key_value_heads", (
            f"{model.num_key_value_heads} does not divide num_attention_heads = "
            f"{model.num_attention_heads}; allowed: 0 (= all heads), "
            f"{', '.join(map(str, allowed))}"
        )
    if kv % tensor_parallel_degree:
        allowed = [d for d in range(1, kv + 1) if kv % d == 0]
        return "tensor_parallel", (
            f"{tensor_parallel_degree} does not divide the {kv} key/value heads (PaddleNLP "
            f"splits whole KV heads over the tensor group); allowed: "
            f"{', '.join(map(str, allowed))}"
        )
    return "", ""


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
