"""Model facts per family against published parameter counts (Touvron et al. 2023, Llama 2
paper table 1 / model cards; Meta's Llama 3 model cards): within 0.5%."""

from __future__ import annotations

import pytest

from gptplan.modelfacts import parameter_count, training_flops_per_token
from gptplan.plan import ModelSection


def llama(h, L, a, f, V, kv=0):
    return ModelSection(
        family="llama",
        hidden_size=h,
        num_hidden_layers=L,
        num_attention_heads=a,
        num_key_value_heads=kv,
        intermediate_size=f,
        vocab_size=V,
        max_position_embeddings=4096,
    )


PUBLISHED = {
    "llama-2-7b": (llama(4096, 32, 32, 11008, 32000), 6.74e9),
    "llama-2-13b": (llama(5120, 40, 40, 13824, 32000), 13.0e9),
    "llama-2-70b": (llama(8192, 80, 64, 28672, 32000, kv=8), 69.0e9),
    "llama-3-8b": (llama(4096, 32, 32, 14336, 128256, kv=8), 8.03e9),
    "llama-3-70b": (llama(8192, 80, 64, 28672, 128256, kv=8), 70.6e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama_parameter_counts_match_published(name):
    model, published = PUBLISHED[name]
    assert parameter_count(model) == pytest.approx(published, rel=0.005)


def test_gqa_shrinks_kv_projections_not_attention_scores():
    mha = llama(8192, 80, 64, 28672, 32000)
    gqa = llama(8192, 80, 64, 28672, 32000, kv=8)
    h, L = 8192, 80
    # K and V: h x h each with MHA, h x h/8 each with 8 of 64 KV heads
    assert parameter_count(mha) - parameter_count(gqa) == L * 2 * (h * h - h * h // 8)
    # FLOPs differ by exactly 6 x that parameter difference: the score term is unchanged
    diff = training_flops_per_token(mha, 4096) - training_flops_per_token(gqa, 4096)
    assert diff == pytest.approx(6 * L * 2 * (h * h - h * h // 8))


def test_swiglu_has_three_matrices_and_untied_head_counts_twice():
    tied = ModelSection(
        family="llama",
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=96,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    untied = ModelSection(**{**vars(tied), "tie_word_embeddings": False})
    # 2 h^2 (Q, O) + 2 h^2 (K, V, MHA) + 3 h f + 2 h (norms) + final norm h + embeddings V h
    assert parameter_count(tied) == 4 * 64 * 64 + 3 * 64 * 96 + 2 * 64 + 64 + 100 * 64
    assert parameter_count(untied) - parameter_count(tied) == 100 * 64


def test_checkpoint_bytes_is_one_fact_for_numbers_and_arrays():
    """12 B/param (fp32 weights + two AdamW moments), 14 with O2's fp32 master weights; the
    planner's vectorised search and the runner's budget use the same function."""
    import numpy as np

    from gptplan.money import checkpoint_bytes, keeps_master_weights

    assert checkpoint_bytes(1000) == 12000
    assert checkpoint_bytes(1000, master_weights=True) == 14000
    out = checkpoint_bytes(np.array([1000.0, 1000.0]), master_weights=np.array([False, True]))
    assert out.tolist() == [12000.0, 14000.0]
    assert keeps_master_weights("fp16", "O2") and keeps_master_weights("bf16", "O2")
    assert not keeps_master_weights("fp32", "O2") and not keeps_master_weights("fp16", "O1")
