"""Plans that fit the card they rent (issue 25): the feasibility rule, the chosen line's memory,
partial recompute and the physical cap on the throughput interval."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from gptplan.memory import GIB, MAY_FIT_SAVING, MEMORY_RATIO_P90

LLAMA_13B = {
    "job": {"name": "llama13b", "target_tokens": 260e9},
    "model": {"size": "llama-13b"},
    "constraints": {
        "currency": "USD",
        "seq_lens": [4096],
        "global_batch_tokens_min": 2_000_000,
        "global_batch_tokens_max": 4_200_000,
        "profiles": ["a100-80gb", "h100-80gb"],
        "max_nodes": 8,
    },
    "search": {"node_counts": [8]},
}


def _spec(data: dict):
    from planner.spec import spec_from_dict

    return spec_from_dict(data, file="spec.toml")


@functools.lru_cache(maxsize=4)
def _planned(headroom: float = 0.9):
    from planner.hardware import load_profiles
    from planner.search import allowed_offers, decide, evaluate_space

    data = {**LLAMA_13B, "constraints": {**LLAMA_13B["constraints"], "memory_headroom": headroom}}
    spec = _spec(data)
    table = evaluate_space(spec, allowed_offers(spec, load_profiles()), spec.job.target_tokens)
    return spec, table, decide(spec, table, spec.job.target_tokens)


def _card_bytes(table, i) -> float:
    return table.offers[int(table["offer"][i])].profile.memory_gb * GIB


def test_the_13b_spec_never_chooses_a_layout_over_the_card():
    """The issue's 13B Llama spec chose ZeRO-2 micro 1 at 86.16 GB (80.2 GiB) on an 80 GiB A100,
    "may fit" with the band applied past the card. Now the chosen layout's modelled memory plus
    its band stays within the card, and the console's chosen line gives it as a share of the
    card with its interval."""
    from planner.report import memory_line

    _, table, decision = _planned()
    i = decision.chosen
    assert i is not None
    mem = float(table["memory_gb"][i]) * 1e9
    assert mem * MEMORY_RATIO_P90 <= _card_bytes(table, i)
    # no row over the card is kept at all
    fits = table["fits"].astype(bool)
    over = table["memory_gb"] * 1e9 * MEMORY_RATIO_P90 > np.array(
        [_card_bytes(table, j) for j in range(len(table))]
    )
    assert not (fits & over).any()
    result = SimpleNamespace(table=table, chosen=i, currency="USD", decision=decision)
    line = memory_line(result)
    assert "of the 80 GiB card per device" in line and "80% interval" in line


def test_a_may_fit_layout_is_chosen_only_past_the_stated_saving():
    """A layout inside the band ("may fit") loses to the best surely-fitting one unless it
    saves more than MAY_FIT_SAVING; when it wins, the chosen line names the alternative and
    its cost."""
    from planner.report import memory_line
    from planner.search import choose_fitting, ranked

    _, table, decision = _planned(0.8)
    may = table["may_fit"].astype(bool)
    feasible = decision.feasible
    assert (may & feasible).any() and (~may & feasible).any()
    best_sure = int(ranked(table, feasible & ~may)[0])
    best_may = int(ranked(table, feasible & may)[0])
    cost = table.columns["cost"]
    saved = cost.copy()
    try:
        # just under the saving: the surely-fitting row wins
        cost[best_may] = cost[best_sure] * (1 - MAY_FIT_SAVING * 0.9)
        assert choose_fitting(table, feasible, best_may) == (best_sure, None)
        # past it: the may-fit row wins, with the alternative
        cost[best_may] = cost[best_sure] * (1 - MAY_FIT_SAVING * 1.5)
        chosen, alt = choose_fitting(table, feasible, best_may)
        assert (chosen, alt) == (best_may, best_sure)
        d = SimpleNamespace(sure_alternative=alt)
        line = memory_line(SimpleNamespace(table=table, chosen=chosen, currency="USD", decision=d))
        assert "MAY NOT FIT" in line and "surely-fitting" in line
        assert f"{cost[best_sure]:,.0f} USD" in line
    finally:
        cost[:] = saved


def test_no_p90_throughput_exceeds_the_generation_cap():
    """The 13B plan's p90 reached 201,603 tokens/s on 64 A100s, 88% MFU, above every
    published run. The p90 (and the point estimate) now stay at or under the highest MFU of
    the generation's fitted published runs."""
    from planner import coverage

    _, table, decision = _planned()
    idx = np.arange(len(table))
    iv = table.intervals(idx)
    caps = np.array([coverage.mfu_cap(c.profile).mfu for c in table.offers])[table["offer"]]
    p90_mfu = table["mfu"] * iv["tokens_per_s_p90"] / table["tokens_per_s"]
    assert (p90_mfu <= caps * (1 + 1e-9)).all()
    assert (table["mfu"] <= caps * (1 + 1e-9)).all()
    cap = coverage.mfu_cap(table.offers[int(table["offer"][decision.chosen])].profile)
    assert 0.3 < cap.mfu < 0.8 and cap.row_id.startswith("r")
    assert "MFU" in cap.words() and "published_runs.csv" in cap.words()


def test_plan_memory_terms_sum_to_the_peak():
    from gptplan.memory import layout_memory_bytes
    from planner import costmodel as cm

    _, table, decision = _planned()
    i = decision.chosen
    shape = cm.ModelShape.from_section(_spec(LLAMA_13B).model_section())
    g = {k: table[k][i : i + 1] for k in table.columns}
    args = dict(overhead_gb=1.5, fragmentation=1.1, communicator_gb=0.5)
    terms = layout_memory_bytes(shape, g, terms=True, **args)
    assert set(terms) >= {"weights", "gradients", "optimizer", "activations", "logits", "runtime"}
    assert sum(float(v[0]) for v in terms.values()) == pytest.approx(
        float(layout_memory_bytes(shape, g, **args)[0])
    )
