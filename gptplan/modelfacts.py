"""Model facts everyone needs: named sizes, parameter count and FLOPs per token.

The runner needs them for MFU and the planner's cost model for everything; both import them
from here, so each formula exists once. What differs by family (a layer's parameters, the
final norm, position embeddings, a tied head) each family declares in gptplan.families.
"""

from __future__ import annotations

from dataclasses import asdict

from gptplan import families
from gptplan.families import ModelLike, ModelSize

GPTSize = ModelSize  # the name before families existed

# Named sizes of the built-in families (gptplan/families/<family>.py declares them with their
# sources; a plug-in family's sizes: families.all_sizes(), `named_size`).
MODEL_SIZES: dict[str, ModelSize] = families.all_sizes(extra=False)

# Parameter counts the model authors publish for named sizes (the tests pin
# `parameter_count` to them within 0.5%; each family module cites its source).
PUBLISHED_PARAMETERS: dict[str, float] = {
    name: count
    for spec in families.specs(extra=False)
    for name, count in spec.published_parameters.items()
}


def named_size(name: str) -> ModelSize:
    """A named size of any registered family (a plug-in's included)."""
    return MODEL_SIZES.get(name) or families.all_sizes()[name]


def size_fields(name: str) -> dict:
    """The ModelSection fields of a named size (a family's unused optional fields left out)."""
    fields = asdict(named_size(name))
    used = families.get(fields["family"]).fields
    for key in families.OPTIONAL_FIELDS:
        if key not in used:
            fields.pop(key, None)
    return fields


def model_problem(model: ModelLike, tensor_parallel_degree: int = 1) -> tuple[str, str]:
    """(key, message) for a model the family's PaddleNLP 2.8.1 class cannot build, or
    ('', '') when it can. Keys are relative to the [model] table, except 'tensor_parallel'."""
    return families.model_problem(model, tensor_parallel_degree)


def kv_heads(model: ModelLike) -> int:
    """Key/value heads: `num_key_value_heads` for grouped-query attention, else all heads."""
    return model.num_key_value_heads or model.num_attention_heads


def lm_head_tied(model: ModelLike) -> bool:
    """Whether the LM head shares the word embeddings (GPT always; Llama by the field)."""
    return families.get(model.family).lm_head_tied(model)


def layer_parameters(model: ModelLike) -> int:
    """Parameters of one transformer layer, exactly as PaddleNLP 2.8.1 builds it (each
    family's `layer_parameters` says how)."""
    return families.get(model.family).layer_parameters(model)


def parameter_count(model: ModelLike, *, include_embeddings: bool = True) -> int:
    """Exact parameter count of the family's PaddleNLP class.

    Layers + final norm + word embeddings + an untied LM head V·h + learned positions s·h
    where the family has them. GPT (tied LM head, learned positions) for f = 4h is Narayanan
    et al. 2021 eq. 2: 12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)). `include_embeddings=False`
    counts the layers and final norm only (the N of 6N in MFU, PaLM/torchtitan convention).
    """
    spec = families.get(model.family)
    h, L = model.hidden_size, model.num_hidden_layers
    body = L * spec.layer_parameters(model) + spec.final_norm_parameters(model)
    if not include_embeddings:
        return body
    embeddings = model.vocab_size * h * (1 if spec.lm_head_tied(model) else 2)
    positions = model.max_position_embeddings * h if spec.learned_positions else 0
    return body + embeddings + positions


def training_flops_per_token(model: ModelLike, seq_len: int) -> float:
    """Model FLOPs per trained token: 6·N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B).

    N excludes embedding parameters but the LM-head matmul (2·h·V per token forward, tied or
    not) is real compute, so it is added back: 6·(N_body + V·h) + 12·L·h·s. The 12·L·h·s term
    is the attention score/value matmuls (the O(s²) part); grouped-query attention shrinks the
    K/V projections (in N) but not this term, which depends on the query heads. Recompute is
    not counted: this is *model* FLOPs, the numerator of MFU.
    """
    n = parameter_count(model, include_embeddings=False) + model.vocab_size * model.hidden_size
    return 6.0 * n + 12.0 * model.num_hidden_layers * model.hidden_size * seq_len
