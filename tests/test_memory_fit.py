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
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen.decide import decide
    from planner.screen.evaluate import evaluate_space

    data = {**LLAMA_13B, "constraints": {**LLAMA_13B["constraints"], "memory_headroom": headroom}}
    spec = _spec(data)
    table = evaluate_space(spec, allowed_offers(spec, load_profiles()), spec.job.target_tokens)
    return spec, table, decide(spec, table, spec.job.target_tokens)


def _card_bytes(table, i) -> float:
    return table.offers[int(table["offer"][i])].profile.memory_gb * GIB


def test_the_13b_spec_never_chooses_a_layout_over_the_card():
    """The issue's 13B Llama spec chose ZeRO-2 micro 1 at 86.16 GB (80.2 GiB) on an 80 GiB A100,
    "may fit" with the band applied past the card. Now (issue 35) the chosen layout surely
    fits (its band's high end, each term at its worst credible error, within the usable
    memory) or its point does; no kept row's optimistic end exceeds the card; the chosen line
    gives the share of the card with the band and its widest term."""
    from planner.reporting.report import memory_line

    _, table, decision = _planned()
    i = decision.chosen
    assert i is not None
    usable = _card_bytes(table, i) * 0.9
    assert float(table["memory_gb"][i]) * 1e9 <= usable
    if not table["may_fit"][i]:
        assert float(table["memory_high_gb"][i]) * 1e9 <= usable
    fits = table["fits"].astype(bool)
    cards = np.array([_card_bytes(table, j) for j in range(len(table))])
    assert not (fits & (table["memory_low_gb"] * 1e9 > cards)).any()
    assert (table["memory_low_gb"] <= table["memory_gb"]).all()
    assert (table["memory_gb"] <= table["memory_high_gb"]).all()
    result = SimpleNamespace(table=table, chosen=i, currency="USD", decision=decision)
    line = memory_line(result)
    assert "of the 80 GiB card per device" in line and "worst credible error" in line


def test_a_may_fit_layout_is_chosen_only_past_the_stated_saving():
    """A layout inside the band ("may fit") loses to the best surely-fitting one unless it
    saves more than MAY_FIT_SAVING; when it wins, the chosen line names the alternative and
    its cost."""
    from planner.reporting.report import memory_line
    from planner.screen.decide import choose_fitting, ranked

    _, table, decision = _planned(0.8)
    may = table["may_fit"].astype(bool)
    feasible = decision.feasible
    assert (may & feasible).any() and (~may & feasible).any()
    best_sure = int(ranked(table, feasible & ~may)[0])
    # a may-fit row whose point is within the usable memory (issue 35: one whose point is
    # past it is never chosen while another row fits)
    point_fits = table["memory_point_fits"].astype(bool)
    assert (feasible & may & ~point_fits).any()
    best_may = int(ranked(table, feasible & may & point_fits)[0])
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
    published run. The p90 stays at or under the best 16-bit MFU published for the generation
    (hardware_profiles/mfu_published.csv, issue 35), unless the point itself (the model's
    median, never clamped) is above it."""
    from planner.screen import coverage

    _, table, decision = _planned()
    idx = np.arange(len(table))
    iv = table.intervals(idx)
    caps = np.array([coverage.mfu_cap(c.profile).mfu for c in table.offers])[table["offer"]]
    p90_mfu = table["mfu"] * iv["tokens_per_s_p90"] / table["tokens_per_s"]
    assert (p90_mfu <= np.maximum(caps, table["mfu"]) * (1 + 1e-9)).all()
    cap = coverage.mfu_cap(table.offers[int(table["offer"][decision.chosen])].profile)
    assert 0.3 < cap.mfu < 0.8 and cap.row_id.startswith("c")
    assert "MFU" in cap.words() and "mfu_published.csv" in cap.words()


def test_plan_memory_terms_sum_to_the_peak():
    from gptplan.memory import layout_memory_bytes
    from planner.screen import costmodel as cm

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


LLAMA_7B_40GB = {
    "job": {"name": "l7", "target_tokens": 1e9},
    "model": {"size": "llama-7b"},
    "constraints": {
        "seq_lens": [4096],
        "global_batch_tokens_min": 32768,
        "global_batch_tokens_max": 32768,
        "profiles": ["a100-40gb"],
        "precisions": ["bf16"],
        "max_nodes": 1,
        "spot": False,
    },
    "search": {
        "node_counts": [1],
        "tensor_parallel": [1],
        "pipeline_parallel": [1],
        "sharding": ["stage3"],
        "micro_batch_sizes": [1],
        "sequence_parallel": [False],
        "virtual_pp": [1],
        # full_attn on every layer "may fit" (issue 35's band) and would win on cost
        "recompute": ["none", "core_attn", "full"],
    },
}


def test_partial_recompute_is_planned_with_k_layers_and_charges_only_those():
    """A 7B Llama, ZeRO-3 over 8 A100-40GB, seq 4096: with core_attn (or none) on every layer
    it is past the card, with full recompute on k of its 32 layers under it. The search plans
    full recompute on k layers (the fewest that surely fit), the plan carries k, and the step
    time charges the recompute of those k layers only (linear between none and all 32)."""
    from gptplan.memory import layout_memory_bytes
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen import costmodel as cm
    from planner.screen.decide import decide
    from planner.screen.evaluate import evaluate_space, memory_args
    from planner.writing.planwriter import candidate_plan

    spec = _spec(LLAMA_7B_40GB)
    table = evaluate_space(spec, allowed_offers(spec, load_profiles()), 1e9)
    d = decide(spec, table, 1e9)
    i = d.chosen
    row = table.row(i)
    k, L = row["rc_layers"], 32
    assert row["recompute"] == "full" and 0 < k < L
    same = (table["offer"] == table["offer"][i]) & (table["spot"] == table["spot"][i])

    def one(code: int, rc: int) -> int:
        sel = np.flatnonzero(same & (table["recompute_code"] == code) & (table["rc_layers"] == rc))
        assert len(sel) == 1
        return int(sel[0])

    sure = table["fits"].astype(bool) & ~table["may_fit"].astype(bool)
    assert not sure[one(1, 0)] and not sure[one(0, 0)]  # every layer: not surely fitting
    # k is the fewest: k - 1 layers would not surely fit
    prof = table.offers[int(table["offer"][i])].profile
    g = {c: table[c][i : i + 1].copy() for c in table.columns}
    g["rc_layers"] = g["rc_layers"] - 1
    shape = cm.ModelShape.from_section(spec.model_section())
    fewer = layout_memory_bytes(shape, g, **memory_args(prof))[0]
    assert fewer * MEMORY_RATIO_P90 > prof.memory_gb * GIB * spec.constraints.memory_headroom
    # step time: only the k recomputed layers pay for it
    none_s, all_s = table["compute_s"][one(0, 0)], table["compute_s"][one(3, 0)]
    assert table["compute_s"][i] == pytest.approx(none_s + k / L * (all_s - none_s), rel=1e-9)
    assert (
        table["step_time_s"][one(0, 0)] < table["step_time_s"][i] < table["step_time_s"][one(3, 0)]
    )
    # written into the plan, and the runner passes the other layers to PaddleNLP
    plan = candidate_plan(spec, row, target=1e9)
    assert plan.parallel.recompute_layers == k
    from gptplan.plan import no_recompute_layers

    assert no_recompute_layers(plan.model, plan.parallel) == list(range(k, L))


def test_partial_recompute_rules_and_old_plans():
    """Old plans (no recompute_layers) load as every layer; GPT refuses per-layer recompute
    with the reason; pipeline 'full' refuses it (PaddleNLP's Pipe asserts); each stage
    recomputes its first k / pp layers."""
    import tomli
    from conftest import REPO

    from gptplan.plan import ModelSection, ParallelSection, no_recompute_layers, plan_from_dict
    from gptplan.plan import recompute_layers_problem as problem

    data = tomli.loads((REPO / "plans" / "llama_zh.toml").read_text())
    assert plan_from_dict(data).parallel.recompute_layers == 0
    llama = ModelSection(family="llama", num_hidden_layers=10)
    gpt = ModelSection(family="gpt", num_hidden_layers=10)
    assert "no per-layer recompute" in problem(
        gpt, ParallelSection(recompute="full", recompute_layers=4)
    )
    pipe = ParallelSection(
        nproc_per_node=2, pipeline_parallel_degree=2, recompute="full", recompute_layers=4
    )
    assert "asserts no_recompute_layers is empty" in problem(llama, pipe)
    pipe = ParallelSection(
        nproc_per_node=2, pipeline_parallel_degree=2, recompute="full_attn", recompute_layers=4
    )
    assert problem(llama, pipe) == ""
    # 10 layers over 2 stages of 5: each recomputes its first 2
    assert no_recompute_layers(llama, pipe) == [2, 3, 4, 7, 8, 9]
    assert "multiple of" in problem(
        llama,
        ParallelSection(
            nproc_per_node=2, pipeline_parallel_degree=2, recompute="core_attn", recompute_layers=3
        ),
    )


def test_the_dry_run_checks_partial_recompute_on_the_built_model():
    """runner.model passes no_recompute_layers to PaddleNLP's LlamaConfig; the dry run's check
    reads the built model's layers back (and fails when they differ from the plan)."""
    from conftest import BASE_PLAN, LLAMA, merge

    from gptplan.plan import no_recompute_layers, plan_from_dict
    from runner.dryrun import check_partial_recompute
    from runner.model import build_model

    data = merge(
        merge(BASE_PLAN, LLAMA), {"parallel": {"recompute": "full_attn", "recompute_layers": 1}}
    )
    plan = plan_from_dict(data)
    keep = no_recompute_layers(plan.model, plan.parallel)
    L = plan.model.num_hidden_layers
    assert keep == list(range(1, L))
    net = build_model(plan.model, plan.parallel, seq_len=32)
    assert net.config.no_recompute_layers == keep
    ok, words = check_partial_recompute(plan, net, keep)
    assert ok and f"on 1 of {L} layers" in words
    every = build_model(plan.model, plan.parallel, seq_len=32, no_recompute=[])
    ok, words = check_partial_recompute(plan, every, keep)
    assert not ok and "the built model recomputes" in words


def test_estimate_memory_prints_the_terms_and_what_frees_the_most():
    """planner estimate --memory: the chosen layout's terms (GB and share of the card) add up
    to its modelled peak, and the single change that frees the most comes first."""
    from planner.reporting.report import render_memory

    spec, table, decision = _planned()
    result = SimpleNamespace(table=table, chosen=decision.chosen, decision=decision, spec=spec)
    text = render_memory(result)
    for term in ("weights", "gradients", "optimizer", "activations", "logits", "runtime"):
        assert f"  {term}" in text
    total = float(table["memory_gb"][decision.chosen])
    assert f"{total:.2f} GB" in text
    assert "frees the most" in text
    freed = [float(x.split(": -")[1].split(" GB")[0]) for x in text.splitlines() if ": -" in x]
    assert freed == sorted(freed, reverse=True) and freed[0] > 0


def test_gpu_runs_record_each_ranks_peak_next_to_the_modelled_figure(monkeypatch):
    """On GPU the runner gathers each rank's allocator peaks (max_memory_allocated /
    max_memory_reserved) into result.json, and report.json puts them next to the plan's
    modelled peak per device; on CPU nothing changes (peak RSS in the rows)."""
    import paddle
    from conftest import BASE_PLAN

    from gptplan.plan import plan_from_dict
    from runner import metrics
    from runner.report import planned_vs_actual, render
    from runner.train import RankInfo, gather_peak_memory

    monkeypatch.setattr(paddle.device.cuda, "max_memory_allocated", lambda *a: 61.5e9)
    monkeypatch.setattr(paddle.device.cuda, "max_memory_reserved", lambda *a: 70.25e9)
    assert metrics.device_peaks_gb("gpu") == (61.5, 70.25)
    assert metrics.device_peaks_gb("cpu") is None
    plan = plan_from_dict(BASE_PLAN)
    gpu = plan_from_dict(
        BASE_PLAN
        | {
            "hardware": {"device": "gpu", "precisions": ["fp32", "bf16"]},
            "estimate": {"source": "model", "peak_memory_gb": 64.0},
        }
    )
    assert gather_peak_memory(plan, RankInfo()) is None  # cpu
    peaks = gather_peak_memory(gpu, RankInfo())
    assert peaks == [{"rank": 0, "allocated_gb": 61.5, "reserved_gb": 70.25}]
    measured = {
        "tokens_per_second": 1.0,
        "step_time_s": 1.0,
        "peak_memory_gb": 61.5,
        "peak_memory_method": "allocator peak",
        "mfu": 0.1,
        "tokens_trained": 10,
        "useful_token_fraction": 1.0,
        "padded_tokens": 0,
        "peak_memory_per_rank": metrics.per_rank_peaks([(61.5, 70.25), (60.0, 72.0)]),
    }
    result = {
        "measured": measured,
        "finished": True,
        "stop_reason": "finished",
        "completed_steps": 1,
        "max_steps": 1,
    }
    report = planned_vs_actual(gpu, result, 10.0)
    mem = report["memory_per_rank"]
    assert mem["modelled_gb_per_device"] == 64.0 and mem["busiest_rank"] == 1
    assert mem["max_reserved_gb"] == 72.0 and mem["max_allocated_gb"] == 61.5
    assert mem["max_reserved_over_modelled"] == pytest.approx(72.0 / 64.0)
    assert [r["rank"] for r in mem["ranks"]] == [0, 1]
    assert "busiest rank 1" in render(report)
    cpu = planned_vs_actual(
        plan, result | {"measured": measured | {"peak_memory_per_rank": None}}, 1.0
    )
    assert cpu["memory_per_rank"] is None


def test_the_band_constants_are_the_benchmarks():
    """MEMORY_RATIO_P10/P90 are the widest ends of the per-layout band (each term at its
    worst credible error) over the published layouts (bench/memory_accuracy.py ->
    bench/results/memory_accuracy.json), not assumed."""
    import json

    from conftest import REPO

    from gptplan.memory import MEMORY_RATIO_P10

    band = json.loads((REPO / "bench" / "results" / "memory_accuracy.json").read_text())["band"]
    assert MEMORY_RATIO_P10 == pytest.approx(band["p10"], abs=0.005)
    assert MEMORY_RATIO_P90 == pytest.approx(band["p90"], abs=0.005)


def test_spec_recompute_layers_is_checked():
    from gptplan.errors import UserError

    bad = {**LLAMA_13B, "search": {**LLAMA_13B["search"], "recompute_layers": [-1]}}
    with pytest.raises(UserError, match="search.recompute_layers"):
        _spec(bad)
    assert _spec(LLAMA_13B).search.recompute_layers == []
