"""The interval beyond the published runs (issue 17): a query unlike every fitting row of its
generation gets a wider interval and says why; the widening is measured by leave-one-REGIME-out
(planner.screen.published), never from the held-out regime's own rows."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import tomli
from conftest import merge

from planner.market.hardware import ProfileError, load_profiles
from planner.market.offers import allowed_offers
from planner.screen import coverage
from planner.screen import published as pb
from planner.screen.evaluate import evaluate_space
from planner.spec import EMBEDDED_SPEC, spec_from_dict

BANK = tomli.loads(EMBEDDED_SPEC.read_text())


def _table(model: dict):
    spec = spec_from_dict(
        merge(BANK, {"model": model, "constraints": {"profiles": ["a100-80gb"], "budget": 0}}),
        file="spec.toml",
    )
    return evaluate_space(spec, allowed_offers(spec, load_profiles()), spec.job.target_tokens)


def test_a_family_no_published_run_used_gets_a_wider_interval_that_says_why():
    """Every A100 row is GPT-style: a Llama model on A100 is an extrapolation along the family
    axis, so its interval is wider than a GPT model's of the same size, by the generation's
    measured extra log-error, and the row names the axis."""
    gpt, llama = _table({"size": "gpt-base-110m"}), _table({"size": "llama-125m"})
    assert "llama" not in coverage.coverage("ampere").families
    ratio = {}
    for name, t in (("gpt", gpt), ("llama", llama)):
        iv = t.intervals()
        ratio[name] = (iv["tokens_per_s_p10"] / t["tokens_per_s"], iv["tokens_per_s_p90"])
    eff = load_profiles()["a100-80gb"].efficiency
    lo, hi = eff.interval_ratios(110e6)
    assert np.allclose(ratio["gpt"][0], lo)  # inside the runs: the generation's interval
    widened = math.exp(-math.sqrt(math.log(lo) ** 2 + eff.extrapolation_log_error**2))
    assert eff.extrapolation_log_error > 0.05
    assert np.allclose(ratio["llama"][0], widened)
    row = llama.row(int(np.argmin(llama["cost"])))
    assert any("llama family" in r for r in row["interval_outside_runs"])
    assert gpt.row(int(np.argmin(gpt["cost"])))["interval_outside_runs"] == []


def test_outside_axes_ranges_ladders_and_the_cap():
    cov = coverage.Coverage(
        "x", (1.0, 70.0), (8, 512), 8, 4, (1024, 8192), frozenset({"gpt"}),
        frozenset({0, 3}), frozenset({0, 3}), 10,
    )  # fmt: skip
    q = dict(params_billion=7.0, family="gpt", world=64, tp=8, pp=4, seq=2048, stage=1, recompute=2)
    axes = coverage.outside_axes(cov, **q)
    assert not any(bool(v) for v in axes.values())  # stage 1, recompute 2: between used ones
    far = q | dict(params_billion=200.0, tp=16, world=4096, seq=32768)
    n = coverage.outside_count(coverage.outside_axes(cov, **far))
    assert int(n) == coverage.MAX_OUTSIDE_AXES  # four axes out, capped
    assert len(coverage.reasons(cov, far)) == 4
    lo1, hi1 = coverage.widen(0.8, 1.2, 1, 0.3)
    lo2, hi2 = coverage.widen(0.8, 1.2, 2, 0.3)
    assert lo2 < lo1 < 0.8 and 1.2 < hi1 < hi2
    assert coverage.widen(0.8, 1.2, 0, 0.3) == pytest.approx((0.8, 1.2))


def test_leave_one_regime_out_never_fits_on_the_regimes_own_rows():
    rows = [r for r in pb.load_rows() if r.generation == "hopper"]
    mask = np.array([pb.REGIMES[">= 30B"](r) for r in rows])
    assert 3 <= mask.sum() < len(rows)
    before = pb._held_out(rows, mask.astype(int))["predicted"][mask]
    moved = [
        dataclasses.replace(
            r, measured_tokens_per_s_per_device=5 * r.measured_tokens_per_s_per_device
        )
        if m
        else r
        for r, m in zip(rows, mask, strict=True)
    ]
    after = pb._held_out(moved, mask.astype(int))["predicted"][mask]
    assert np.allclose(before, after)


def test_extrapolation_error_adds_in_quadrature_over_leave_one_row_out():
    rows = [r for r in pb.load_rows() if r.generation == "hopper"][:12]
    n = len(rows)
    mask = np.zeros(n, bool)
    mask[:6] = True
    loo = np.exp(np.full(n, 0.1))
    regime = {
        "r": {"mask": mask, "ratio": np.exp(np.full(n, 0.5))},
        "s": {"mask": mask, "ratio": loo},
    }
    e, per = pb.extrapolation_log_error(rows, loo, regime, "hopper")
    assert per["r"] == pytest.approx(math.sqrt(0.5**2 - 0.1**2), rel=1e-6)
    assert per["s"] == pytest.approx(0.0) and e == pytest.approx(per["r"])
    e1, _ = pb.extrapolation_log_error(rows, loo, {"r": regime["r"]}, "hopper")
    assert e1 == pb.DEFAULT_EXTRAPOLATION_LOG_ERROR  # one regime cannot measure it


def test_damaged_published_runs_are_one_clear_line(tmp_path, monkeypatch):
    """The planner's interval reads hardware_profiles/published_runs.csv: a damaged file is one
    line naming the file (and line and column), exit 2, never a traceback or a silently
    narrower interval."""
    from test_value_ranges import planner

    good = pb.RUNS_CSV.read_text(encoding="utf-8").splitlines()
    header, first = good[0], good[1]
    bad = tmp_path / "published_runs.csv"
    cases = {
        "garbage\n": "missing column(s)",
        header + "\n": "holds no published runs",
        header + "\n" + first.replace(",h100-80gb,", ",h900,", 1) + "\n": "not a hardware profile",
        header + "\n" + first.replace(",stage3,", ",stage9,", 1) + "\n": "sharding 'stage9'",
    }
    for text, expected in cases.items():
        bad.write_text(text, encoding="utf-8")
        with pytest.raises(ProfileError, match=re.escape(expected)) as err:
            pb.load_rows(bad)
        assert str(bad) in str(err.value)
    with pytest.raises(ProfileError, match="cannot read"):
        pb.load_rows(tmp_path / "missing.csv")
    bad.write_text("garbage\n", encoding="utf-8")
    monkeypatch.setattr(pb, "RUNS_CSV", bad)
    coverage.coverages.cache_clear()
    try:
        rc, err = planner("optimize", "--budget", "12000")
    finally:
        coverage.coverages.cache_clear()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "published_runs.csv" in err and "missing column" in err
