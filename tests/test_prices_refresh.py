"""Fresh prices make plans better, not worse (issue 26, the prices half): instance facts give
imported rows their network, one current price per (cloud, instance, region), on-demand and
spot of one region, an outlier rule one new row cannot flip, a dated import, rates on the
command line, and a profiles table people can read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tomli
from conftest import merge

from planner.commands.main import build_parser, main
from planner.commands.overrides import spec_overrides
from planner.market.hardware import load_profiles
from planner.market.instances import facts_for
from planner.market.offers import allowed_offers
from planner.market.prices import import_catalog, price_history
from planner.reporting.costreport import hours_text, offer_summary
from planner.screen.decide import decide
from planner.screen.evaluate import evaluate_space
from planner.spec import EMBEDDED_SPEC, SpecError, load_spec, spec_from_dict

REPO = Path(__file__).resolve().parents[1]
CATALOG = REPO / "tests" / "data" / "catalogs" / "v6" / "aws" / "vms.csv"  # the 6 rows
BANK = tomli.loads(EMBEDDED_SPEC.read_text())
HEAD = "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region\n"


@pytest.fixture
def profiles_dir(tmp_path):
    """A copy of the shipped profiles to import into (the checkout stays untouched)."""
    out = tmp_path / "hardware_profiles"
    shutil.copytree(REPO / "hardware_profiles", out, ignore=shutil.ignore_patterns("local"))
    return out


def spec_of(**overrides):
    return spec_from_dict(merge(BANK, overrides), file="spec.toml")


def plan_on(spec, directory):
    offers = allowed_offers(spec, load_profiles(directory))
    table = evaluate_space(spec, offers, spec.job.target_tokens)
    return decide(spec, table, spec.job.target_tokens), table


def test_imported_instance_with_facts_is_planned_multi_node(profiles_dir):
    """Issue 26: imported rows had inter_node_gbits_per_s = 0, so an 8-node job found 'no
    valid layout'; the instance facts give p4de its 400 Gbit/s EFA."""
    out, count, skipped, warnings = import_catalog(
        CATALOG, as_of="2026-12-01", directory=profiles_dir
    )
    assert (count, skipped, warnings) == (6, [], [])
    rows = tomli.loads(out.read_text())["offers"]
    p4de = [r for r in rows if r["instance"] == "p4de.24xlarge"]
    assert {r["inter_node_gbits_per_s"] for r in p4de} == {400.0}
    assert "EFA" in p4de[0]["network_source"]
    spec = spec_of(
        constraints={
            "profiles": ["a100-80gb"],
            "offers": ["aws/p4de.24xlarge"],
            "budget": 0,
            "deadline_hours": 0,
            "max_nodes": 2,
            # costed on EFA: the launch needs a SkyPilot that attaches it (0.9.2 does not)
            "launcher_attaches_efa": True,
        },
        search={"node_counts": [2]},
    )
    decision, table = plan_on(spec, profiles_dir)
    assert decision.chosen is not None, decision.problems
    row = table.row(decision.chosen)
    assert row["nodes"] == 2 and row["offer_choice"].offer.as_of == "2026-12-01"
    # costed on what the pinned SkyPilot 0.9.2 gives (no EFA attached): single-node
    pinned = spec_of(
        constraints={
            "profiles": ["a100-80gb"],
            "offers": ["aws/p4de.24xlarge"],
            "budget": 0,
            "deadline_hours": 0,
            "max_nodes": 2,
            "launcher_attaches_efa": False,
        },
        search={"node_counts": [1, 2]},
    )
    decision, table = plan_on(pinned, profiles_dir)
    assert set(table["nodes"].tolist()) == {1}
    assert "attaches no EFA" in table.offers[0].offer.network_source


def test_instance_without_facts_is_imported_with_a_warning_and_the_reason_shown(profiles_dir):
    csv = profiles_dir.parent / "aws.csv"
    csv.write_text(HEAD + "g5.2xlarge,A10G,1,1.212,0.5,us-east-1\n")
    _, _, _, warnings = import_catalog(csv, as_of="2026-12-01", directory=profiles_dir)
    assert len(warnings) == 1 and "aws/g5.2xlarge" in warnings[0]
    assert "single-node" in warnings[0]
    spec = spec_of(
        constraints={"profiles": ["a10g"], "offers": ["aws/g5.2xlarge"], "budget": 0},
        search={"node_counts": [2]},
    )
    decision, _ = plan_on(spec, profiles_dir)
    (status,) = [r["status"] for r in offer_summary(decision, spec)]
    assert status.startswith("no valid layout") and "no instance facts for aws/g5.2xlarge" in status


def test_newer_row_replaces_older_one_row_shown_newer_price_used(profiles_dir, monkeypatch, capsys):
    import_catalog(CATALOG, as_of="2026-12-01", directory=profiles_dir)
    p4de = [o for o in load_profiles(profiles_dir)["a100-80gb"].offers if o.key.startswith("aws/")]
    # the shipped 2025-06 row (no region) is replaced by the regional rows of 2026-12-01
    assert sorted(o.region for o in p4de) == ["us-east-1", "us-west-2"]
    assert {o.as_of for o in p4de} == {"2026-12-01"}
    newer = CATALOG.read_text().replace(",27.45,9.8,us-east-1", ",26.00,9.1,us-east-1")
    (profiles_dir.parent / "aws").mkdir()
    csv = profiles_dir.parent / "aws" / "vms.csv"
    csv.write_text(newer)
    import_catalog(csv, as_of="2026-12-04", directory=profiles_dir)
    east = [
        o
        for o in load_profiles(profiles_dir)["a100-80gb"].offers
        if o.key == "aws/p4de.24xlarge" and o.region == "us-east-1"
    ]
    assert [(o.on_demand_per_hour, o.as_of) for o in east] == [(26.00, "2026-12-04")]
    history = price_history("p4de.24xlarge", profiles_dir)
    assert {(r["region"], r["as of"]): r["status"] for r in history} == {
        ("us-east-1", "2026-12-04"): "current",
        ("us-west-2", "2026-12-04"): "current",
        ("us-east-1", "2026-12-01"): "replaced (history)",  # kept by the second import
        ("us-west-2", "2026-12-01"): "replaced (history)",
        ("(not recorded)", "2025-06"): "replaced by 2026-12-04 us-west-2",  # the shipped row
    }  # (a row without a region is replaced by the newest row of any region)
    # an older catalog imported later does not win over the newer row
    import_catalog(CATALOG, as_of="2026-11-01", directory=profiles_dir)
    east = [
        o
        for o in load_profiles(profiles_dir)["a100-80gb"].offers
        if o.key == "aws/p4de.24xlarge" and o.region == "us-east-1"
    ]
    assert [o.as_of for o in east] == ["2026-12-04"]
    # `planner profiles` lists the instance once (issue 26: 'aws/p5.48xlarge' twice)
    import planner.market.hardware

    monkeypatch.setattr(
        planner.market.hardware, "load_profiles", lambda: load_profiles(profiles_dir)
    )
    assert main(["profiles"]) == 0
    listing = [line for line in capsys.readouterr().out.splitlines() if "aws/p4de" in line]
    assert len(listing) == 1 and "3.25" in listing[0]  # 26.00 / 8 per GPU-hour, the newest
    # the planner prices p4de with the newest row
    spec = spec_of(
        constraints={"profiles": ["a100-80gb"], "offers": ["aws/p4de.24xlarge"], "spot": False}
    )
    (choice,) = allowed_offers(spec, load_profiles(profiles_dir))
    assert choice.offer.on_demand_per_hour == 26.00 and "us-east-1" in choice.label


def test_on_demand_and_spot_come_from_one_region_unless_any_region(profiles_dir):
    import_catalog(CATALOG, as_of="2026-12-01", directory=profiles_dir)
    profiles = load_profiles(profiles_dir)
    spec = spec_of(constraints={"profiles": ["a100-80gb"], "offers": ["aws/p4de.24xlarge"]})
    choices = allowed_offers(spec, profiles)
    by_capacity = {c.capacity: c for c in choices}
    # on-demand is 27.45 everywhere (us-east-1 first); spot is cheapest in us-west-2
    assert by_capacity["on_demand"].offer.region == "us-east-1"
    assert by_capacity["spot"].offer.region == "us-west-2"
    assert by_capacity["spot"].offer.spot_per_hour == 8.9
    assert by_capacity["spot"].offer.on_demand_per_hour == 27.45  # its own region's
    assert "(spot us-west-2, cheapest of 2)" in by_capacity["spot"].label
    spec = spec_of(
        constraints={
            "profiles": ["a100-80gb"],
            "offers": ["aws/p4de.24xlarge"],
            "any_region": True,
        }
    )
    (choice,) = allowed_offers(spec, profiles)
    assert (choice.offer.region, choice.offer.spot_region) == ("us-east-1", "us-west-2")
    assert "on-demand us-east-1, spot us-west-2" in choice.label


def test_one_new_spot_row_does_not_flip_another_offer_to_outlier(profiles_dir):
    """Issue 26: importing the p4de row moved the median the Azure A100-80GB spot price was
    compared with, and the bank-FAQ answer jumped to one L40S. The rule now needs two other
    providers and a spot discount out of their range."""
    spec = spec_of(constraints={"profiles": ["a100-80gb"]})
    before = allowed_offers(spec, load_profiles())
    import_catalog(CATALOG, as_of="2026-12-01", directory=profiles_dir)
    after = allowed_offers(spec, load_profiles(profiles_dir))
    for choices in (before, after):
        azure = [c for c in choices if c.offer.provider == "azure"]
        assert azure and not any(c.price.outlier for c in azure)
    # what the stated rule does flag: a second other provider with a normal discount
    gcp = profiles_dir.parent / "gcp.csv"
    gcp.write_text(HEAD + "a2-ultragpu-8g,A100-80GB,8,40.22,12.0,us-central1\n")
    import_catalog(gcp, as_of="2026-12-01", directory=profiles_dir)
    flagged = [c for c in allowed_offers(spec, load_profiles(profiles_dir)) if c.price.outlier]
    assert [c.offer.provider for c in flagged] == ["azure"]
    note = flagged[0].price.outlier_note
    assert "2 other providers" in note and "own on-demand price" in note and "rule:" in note


def test_import_without_as_of_is_one_line_exit_2(capsys):
    assert main(["prices", "import", str(CATALOG)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--as-of" in err[0] and "Traceback" not in err[0]
    assert main(["prices", "import", str(CATALOG), "--as-of", "last week"]) == 2
    assert "not a date" in capsys.readouterr().err


def test_rate_on_the_command_line_works_with_currency_eur(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no planner.toml here: the embedded bank-FAQ spec (CNY)
    parse = build_parser().parse_args
    args = parse(["estimate", "--currency", "EUR", "--rate", "EUR=7.9", "--rate-date", "2026-12"])
    spec = load_spec(None, overrides=spec_overrides(args))
    assert spec.rate("USD") == pytest.approx(7.20 / 7.9)  # USD -> CNY -> EUR
    assert spec.rates_as_of == "2026-12" and "--rate EUR=7.9" in spec.rates_source
    with pytest.raises(SpecError, match="--rate EUR="):
        load_spec(None, overrides=spec_overrides(parse(["estimate", "--currency", "EUR"]))).rate(
            "USD"
        )
    for bad in (["--rate", "EUR=-1"], ["--rate", "euro=7.9"], ["--rate", "EUR"]):
        assert main(["estimate", "--currency", "EUR", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --rate:"), err


def test_profiles_table_fits_120_columns_with_price_per_gpu_hour(capsys):
    assert main(["profiles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 120
    assert "/GPU-h" in lines[0] and "spot/GPU-h" in lines[0]
    assert any("aws/p4de.24xlarge" in line and "5.12" in line for line in lines)  # 40.97 / 8
    assert main(["profiles", "--wide"]) == 0
    assert "price source" in capsys.readouterr().out
    assert (hours_text(73.6), hours_text(1760.0)) == ("73.6", "73.3 d")


def test_this_machine_is_in_cloud_tables_only_when_the_spec_asks():
    assert not [
        c for c in allowed_offers(spec_of(), load_profiles()) if c.offer.provider == "local"
    ]
    cpu = allowed_offers(spec_of(constraints={"profiles": ["cpu"]}), load_profiles())
    assert cpu and all(c.offer.provider == "local" for c in cpu)


def test_shipped_offers_agree_with_the_instance_facts():
    for name, prof in load_profiles().items():
        for offer in prof.offers:
            facts = facts_for(offer.provider, offer.instance)
            if offer.kind != "cloud" or offer.provider == "local":
                continue
            assert facts is not None, offer.key
            assert (facts.profile, facts.gpus) == (name, offer.gpus_per_node), offer.key
            assert facts.inter_node_gbits_per_s == offer.inter_node_gbits_per_s, offer.key


def test_a_killed_import_leaves_no_temporary_file(profiles_dir):
    """Issue 39: a SIGKILL in the middle of writing a price list left `offers/.NAME.toml.*.tmp`
    (16.8 MB) for good; the next import removes what a killed one left."""
    from planner.market.prices import imported_prices_dir

    folder = imported_prices_dir(profiles_dir)
    (folder / "history").mkdir(parents=True)
    for leftover in (folder / ".aws.toml.k1ll3d.tmp", folder / "history" / ".aws.toml.x.tmp"):
        leftover.write_text("[[offers]]\n" * 1000)  # what a killed write_text_atomic leaves
    import_catalog(CATALOG, as_of="2026-12-01", directory=profiles_dir)
    assert not list(folder.rglob("*.tmp"))
