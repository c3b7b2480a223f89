"""What a plan really costs (issue 18): currencies never mix, outlier spot prices stay out of
the headline, preemptions are in the cost and its interval, the minimum budget meets the
deadline, explain works for any plan, and the console fits 120 columns."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import tomli
from conftest import merge, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.market.hardware import load_profiles
from planner.market.offers import allowed_offers
from planner.screen.decide import decide
from planner.screen.evaluate import evaluate_space
from planner.spec import EMBEDDED_SPEC, SpecError, spec_from_dict

BANK = tomli.loads(EMBEDDED_SPEC.read_text())


def spec_of(**overrides):
    return spec_from_dict(merge(BANK, overrides), file="spec.toml")


def plan_for(spec):
    offers = allowed_offers(spec, load_profiles())
    table = evaluate_space(spec, offers, spec.job.target_tokens)
    return decide(spec, table, spec.job.target_tokens), table


def test_currency_eur_without_a_rate_exits_2(tmp_path):
    proc = run_cli("planner", "optimize", "--budget", "12000", "--currency", "EUR", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "rates.EUR" in proc.stderr and "CNY per EUR" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "plans").exists()


def test_rates_are_quoted_in_one_currency_and_crossed_explicitly():
    spec = spec_of(constraints={"currency": "EUR"}, rates={"quote": "CNY", "USD": 7.2, "EUR": 8.0})
    assert spec.rate("USD") == pytest.approx(7.2 / 8.0)
    assert spec.rate("CNY") == pytest.approx(1 / 8.0)
    no_eur = spec_of(constraints={"currency": "EUR"}, rates={"quote": "CNY", "USD": 7.2})
    with pytest.raises(SpecError, match=r"rates\.EUR"):
        no_eur.rate("USD")


@settings(max_examples=8, deadline=None)
@given(
    currency=st.sampled_from(["CNY", "EUR", "JPY", "GBP"]),
    usd=st.floats(0.01, 200.0),
    budget_rate=st.floats(0.01, 200.0),
)
def test_every_cost_is_price_times_rate_times_hours(currency, usd, budget_rate):
    from planner.reporting.costreport import price_record
    from planner.reporting.report import candidate_record

    rates = {"quote": "CHF", "USD": usd, currency: budget_rate}
    spec = spec_of(constraints={"currency": currency, "profiles": ["t4"], "budget": 0}, rates=rates)
    decision, table = plan_for(spec)
    from planner.market.disks import disk_cost_per_node_hour, disk_price

    rate = usd / budget_rate
    for i in [decision.chosen, *np.flatnonzero(table["fits"])[:20]]:
        r = table.row(int(i))
        offer = r["offer_choice"].offer
        native = offer.node_price_per_hour(spot=bool(r["spot"]), tdp_w=70.0)
        # the task's disk (planner.pricebook; USD per GB-month, converted like the node)
        disk = float(disk_cost_per_node_hour(r["disk_gb"], disk_price(offer), rate))
        assert disk > 0 and r["disk_cost"] == pytest.approx(disk * r["nodes"] * r["hours"])
        expected = (native * rate + disk) * r["nodes"] * r["hours"]
        assert r["cost"] == pytest.approx(expected, rel=1e-9)
        rec = candidate_record(table, int(i), currency, chosen=decision.chosen)
        assert rec[f"modelled_cost_{currency.lower()}"] == pytest.approx(expected, rel=1e-9)
        prices = price_record(table, int(i), currency)
        assert prices["price_usd_per_node_hour"] * rate + disk == pytest.approx(
            prices[f"price_{currency.lower()}_per_node_hour"]
        )
    # printed: the per-offer table shows each best plan's cost = price x rate x nodes x hours
    from planner.reporting.costreport import money, offer_summary, render_offers

    text = render_offers(decision, spec)
    for rec in offer_summary(decision, spec):
        cost = rec[f"modelled_cost_{currency.lower()}"]
        native = rec[f"price_usd_per_node_hour_{rec['capacity']}"]
        disk = rec[f"modelled_disk_cost_{currency.lower()}"]
        assert cost == pytest.approx(
            native * rate * rec["nodes"] * rec["modelled_hours"] + disk, rel=1e-9
        )
        assert f"{money(cost)} (" in text and f"cost {currency}" in text


def test_outlier_spot_price_is_flagged_and_kept_out_of_the_headline():
    spec = spec_of(constraints={"profiles": ["a100-40gb"]})
    decision, table = plan_for(spec)
    chosen = table.row(decision.chosen)
    assert not (
        chosen["spot"] and chosen["offer_choice"].offer.key == "azure/Standard_ND96asr_v4"
    )  # the old headline's row
    flagged = [c for c in table.offers if c.price.outlier]
    assert [c.offer.key for c in flagged] == ["azure/Standard_ND96asr_v4"]
    assert "median" in flagged[0].price.outlier_note
    assert not (chosen["spot"] and chosen["offer_choice"].price.outlier)
    allowed, table2 = plan_for(
        spec_of(constraints={"profiles": ["a100-40gb"], "allow_outlier_prices": True})
    )
    row = table2.row(allowed.chosen)
    assert row["spot"] and row["offer_choice"].offer.key == "azure/Standard_ND96asr_v4"
    assert row["cost"] < chosen["cost"]


def _with_risk(spec, low, high):
    from planner.market.pricebook import SpotRisk

    offers = allowed_offers(spec, load_profiles())
    return [
        dataclasses.replace(
            c, facts=dataclasses.replace(c.price, risk=SpotRisk(0.05, low, high, 0.5, "test"))
        )
        for c in offers
    ]


def test_spot_cost_includes_preemptions_and_interval_widens_with_rate_uncertainty():
    spec = spec_of(constraints={"profiles": ["t4"], "on_demand": False, "budget": 0})
    narrow = evaluate_space(spec, _with_risk(spec, 0.05, 0.05), spec.job.target_tokens)
    wide = evaluate_space(spec, _with_risk(spec, 0.005, 0.5), spec.job.target_tokens)
    spot = narrow["spot"].astype(bool)
    assert spot.all() and (narrow["preemptions"] > 0).all()
    # preemptions cost lost work and restarts: more paid hours than training alone
    assert (narrow["hours"] > narrow["train_hours"] + narrow.fixed_hours).all()
    assert np.allclose(
        narrow["preemptions"], narrow["nodes"] * 0.05 * (narrow["hours"] - narrow.fixed_hours)
    )
    a, b = narrow.intervals(), wide.intervals()
    assert np.allclose(narrow["cost"], wide["cost"])
    assert (b["cost_p90"] > a["cost_p90"]).all() and (b["cost_p10"] < a["cost_p10"]).all()


def test_minimum_budget_of_a_deadline_bound_job_meets_the_deadline():
    probe, table = plan_for(
        spec_of(constraints={"profiles": ["t4", "a100-80gb"], "budget": 0, "deadline_hours": 0})
    )
    fits = table["fits"]
    cheapest = int(np.flatnonzero(fits)[np.argmin(table["cost"][fits])])
    deadline = table["hours"][cheapest] / 2  # the cheapest plan misses it
    spec = spec_of(
        constraints={
            "profiles": ["t4", "a100-80gb"],
            "budget": 1.0,
            "deadline_hours": float(deadline),
        }
    )
    decision, table = plan_for(spec)
    assert decision.chosen is None
    expected = table["cost"][fits & (table["hours"] <= deadline)].min()  # no outlier here
    text = " ".join(decision.problems)
    assert f"minimum budget for the target: {expected:,.0f} CNY" in text
    assert "max_nodes" not in text  # the node cap does not bind here
    assert decision.minimum_budget == pytest.approx(expected)
    assert table["hours"][decision.minimum_budget_row] <= deadline
    assert decision.tokens_bought is not None and 0 < decision.tokens_bought < 50e9


def test_explain_works_on_a_usd_plan_without_the_articles_claims(tmp_path):
    from gptplan.plan import write_plan
    from planner.reporting.explain import explain_plan
    from planner.writing.planwriter import candidate_plan

    data = copy.deepcopy(BANK)
    del data["rates"]
    data = merge(
        data,
        {
            "job": {"name": "usd_job"},
            "constraints": {"currency": "USD", "budget": 5000, "profiles": ["t4"]},
        },
    )
    spec_file = tmp_path / "usd.toml"
    import tomli_w

    spec_file.write_text(tomli_w.dumps(data))
    spec = spec_from_dict(data, file=str(spec_file))
    decision, table = plan_for(spec)
    plan = candidate_plan(spec, table.row(decision.chosen), target=spec.job.target_tokens)
    write_plan(plan, tmp_path / "usd_job.toml")
    out = explain_plan(tmp_path / "usd_job.toml", spec_path=str(spec_file))
    assert out["currency"] == "USD" and out["claims"] == []
    proc = run_cli(
        "planner", "explain", str(tmp_path / "usd_job.toml"), "--spec", str(spec_file), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "about 7 days on 8 cards" not in proc.stdout and "190k steps" not in proc.stdout


@pytest.fixture(scope="module")
def console(bank_optimized, bank_optimized_json):
    """`planner optimize --budget 12000` (with --plot) in a fresh folder, then with --json."""
    return bank_optimized[1], bank_optimized_json


def test_console_fits_120_columns_and_shows_spot_risk(console):
    proc, _ = console
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout[proc.stdout.index("Best plan per offer") :]
    assert max(len(line) for line in out.splitlines()) <= 120
    chosen = " ".join(out[out.index("chosen:") :].split())
    assert "expected preemptions" in chosen and "on-demand costs" in chosen
    assert "price as of" in chosen and ("days old" in chosen or "undated" in chosen)
    assert "sensitivity: the cost moves most with" in chosen
    assert "spot-OUTLIER" in out and "stale" in out and "undated" in out


def test_json_carries_cost_facts_under_unit_keys(console):
    _, proc = console
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    chosen = data["chosen"]
    for key in (
        "price_usd_per_node_hour",
        "price_cny_per_node_hour",
        "price_age_days",
        "expected_preemptions",
        "preemptions_per_node_hour",
        "modelled_cost_on_demand_cny",
        "price_as_of",
        "spot_price_outlier",
    ):
        assert key in chosen, key
    assert chosen["spot_price_outlier"] is False
    assert chosen["modelled_cost_on_demand_cny"] > chosen["modelled_cost_cny"]
    assert data["minimum_budget_cny"] == pytest.approx(chosen["modelled_cost_cny"])
    assert data["tokens_bought"] > 50e9
    assert data["excluded_outlier_offers"] and data["rates"]["quote"] == "CNY"
