"""Published runs, the fitted per-generation priors and the intervals every modelled estimate
carries (issue 9)."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import tomli
from conftest import merge

from planner.market.hardware import load_profiles
from planner.market.offers import allowed_offers
from planner.screen import costmodel as cm
from planner.screen import published as pb
from planner.screen.decide import decide
from planner.screen.evaluate import evaluate_space
from planner.spec import EMBEDDED_SPEC, spec_from_dict

BANK = tomli.loads(EMBEDDED_SPEC.read_text())


@pytest.fixture(scope="module")
def rows():
    return pb.load_rows()


def test_dataset_rows_have_sources_layouts_and_measurements():
    with pb.RUNS_CSV.open() as f:
        recs = list(csv.DictReader(f))
    assert len(recs) >= 100
    profiles = load_profiles()
    for rec in recs:
        assert rec["source"] and float(rec["measured"]) > 0
        assert rec["gpu_profile"] in profiles
        world = int(rec["nodes"]) * int(rec["gpus_per_node"])
        ranks = int(rec["dp"]) * int(rec["tp"]) * int(rec["pp"]) * int(rec["sharding_degree"])
        assert ranks == world, rec["id"]
    sources = " ".join(r["source"] for r in recs)
    for needed in ("llm-foundry", "Narayanan", "OPT", "BLOOM", "torchtitan"):
        assert needed in sources


def test_shipped_priors_fit_the_published_runs(rows):
    """The shipped constants of each generation reproduce its published runs (in sample)."""
    profiles = load_profiles()
    cols = pb._columns(rows)
    gens = np.array([r.generation for r in rows])
    for gen, name in (("ampere", "a100-80gb"), ("hopper", "h100-80gb")):
        e = profiles[name].efficiency
        assert e.fit_rows > 0 and "published_runs.csv" in e.source
        sub = pb._subset(cols, gens == gen)
        err = pb.relative_errors(
            sub, pb.Fit(e.max, e.kernel_overhead_us, e.comm_overlap, e.attention_relative, 0)
        )
        assert np.median(err) <= 0.10, gen
        assert e.throughput_p10 < 1 < e.throughput_p90


def test_leave_one_out_never_uses_the_row_itself(rows):
    sub = [r for r in rows if r.generation == "hopper"][:12]
    loo = pb.leave_one_out(sub)
    cols = pb._columns(sub)
    # a fit that includes row 0 predicts it at least as well as the leave-one-out fit
    full = pb.fit(cols)
    in_sample = pb.relative_errors(cols, full)
    out_sample = np.abs(loo["predicted"] - loo["measured"]) / loo["measured"]
    assert np.isfinite(out_sample).all()
    assert np.median(out_sample) >= np.median(in_sample) - 1e-9


def test_interval_math_by_hand():
    out = cm.interval_from_throughput(
        tokens_per_s=1000.0,
        hours=10.25,
        fixed_hours=0.25,
        cost=102.5,
        p10_ratio=0.8,
        p90_ratio=1.25,
    )
    assert out["tokens_per_s_p10"] == pytest.approx(800)
    assert out["tokens_per_s_p90"] == pytest.approx(1250)
    assert out["hours_p10"] == pytest.approx(10 / 1.25 + 0.25)
    assert out["hours_p90"] == pytest.approx(10 / 0.8 + 0.25)
    assert out["cost_p90"] == pytest.approx(10.0 * (10 / 0.8 + 0.25))


def test_every_candidate_carries_an_interval_around_its_estimate():
    spec = spec_from_dict(
        merge(BANK, {"constraints": {"profiles": ["a100-80gb", "t4"]}}), file="spec.toml"
    )
    table = evaluate_space(spec, allowed_offers(spec, load_profiles()), spec.job.target_tokens)
    iv = table.intervals()
    for point, lo, hi in (
        ("tokens_per_s", "tokens_per_s_p10", "tokens_per_s_p90"),
        ("hours", "hours_p10", "hours_p90"),
        ("cost", "cost_p10", "cost_p90"),
    ):
        assert (iv[lo] <= table[point] + 1e-9).all() and (table[point] <= iv[hi] + 1e-9).all()
        assert (iv[hi] > iv[lo]).all()
    d = decide(spec, table, spec.job.target_tokens)
    from planner.reporting.report import candidate_records, render_choice
    from planner.writing.planwriter import candidate_plan

    row = table.row(d.chosen)
    plan = candidate_plan(spec, row, target=spec.job.target_tokens)
    est = plan.estimate
    assert est.cost_p10 < est.cost < est.cost_p90 and est.hours_p10 < est.hours < est.hours_p90
    assert "leave-one-source-out" in est.interval
    rec = candidate_records(table, [d.chosen], "CNY", d.chosen)[0]
    assert rec["modelled_cost_cny_p10"] < rec["modelled_cost_cny"] < rec["modelled_cost_cny_p90"]
    from planner.pipeline import OptimizeResult

    result = OptimizeResult(spec, None, spec.job.target_tokens, d, {}, chosen=d.chosen, plan=plan)
    assert "80% interval" in render_choice(result)


def test_explain_names_the_dominant_uncertainty_term():
    from planner.reporting.explain import uncertainty_terms

    profile = load_profiles()["a100-80gb"]
    row = {"compute_s": 1.0, "bubble": 1.0, "tp_s": 0.1, "pp_s": 0.0, "comm_s": 0.3, "opt_s": 0.05}
    row |= {"world": 8, "tp": 1, "pp": 1, "seq": 1024, "stage_code": 0, "recompute_code": 0}
    u = uncertainty_terms(row, profile, "bf16", 1.3e9)
    assert u["dominant_term"].startswith("compute")
    assert u["shares"]["gradient sync (not hidden)"] == pytest.approx(0.2 / 1.35)
    assert "published runs" in u["interval_basis"]


def test_large_models_get_the_wider_interval():
    from planner.market.hardware import Efficiency

    e = Efficiency(
        throughput_p10=0.9, throughput_p90=1.1, throughput_p10_large=0.8, throughput_p90_large=1.2
    )
    assert e.interval_ratios(1e9) == (0.9, 1.1)
    assert e.interval_ratios(20e9) == (0.8, 1.2)
    assert Efficiency().interval_ratios(20e9) == (0.6, 1.7)  # no large interval: the default
    shipped = load_profiles()["a100-80gb"].efficiency
    lo, hi = shipped.interval_ratios(70e9)
    assert lo <= shipped.throughput_p10 and hi >= shipped.throughput_p90
