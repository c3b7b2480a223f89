"""Hand a plan to SkyPilot: the task YAML that provisions the planned offer and runs the plan.

`planner launch-file PLAN` writes `<plan>.sky.yaml`:

  resources   cloud, instance_type, accelerators (SkyPilot's name and count), use_spot, and
              the region the price was seen in (when the price list recorded one)
  num_nodes   the plan's nnodes
  workdir     this project (synced to every node)
  file_mounts a bucket at /checkpoints holding the run directory (checkpoints, billing,
              metrics, report), shared by all nodes and kept across preemptions: on the
              cloud's own bucket store, or for a cloud without one (Lambda, RunPod, ...) on
              the store `--store` names (S3 unless told), which the header says; with
              `--corpus-bucket URI` the user's corpus bucket at /corpus (read as it is
              needed), and job.corpus pointed at it on the command line (`--set`)
  disk_size   prepared data + checkpoints + the corpus mount's cache + the image, with
              headroom (`disk_plan` says how much of each, and the header repeats it)
  envs        the interconnect settings of a multi-node plan on the cloud's RDMA network
              (AWS EFA, Azure InfiniBand), with their sources in the header
  setup       a Python 3.11 virtual environment made by uv (pinned version; uv downloads its
              own CPython 3.11 whatever the cloud image ships, as constraints.txt needs
              Python >= 3.11), then this project with the `gpu` extra and the pinned
              constraints
  run         `runner execute` with the node rank and master from SKYPILOT_NODE_RANK /
              SKYPILOT_NODE_IPS, the run directory in the bucket

`sky jobs launch` recovers a preempted spot job by starting the task again; the runner resumes
from the newest complete checkpoint in the bucket by itself (its automatic resume), and
billing.json there keeps counting every attempt against the budget.

The result is plain data (`task_dict`) so that a test can check it against SkyPilot's own
schema; `render` adds the explanatory comments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
import textwrap
from pathlib import Path

from gptplan.errors import UserError
from gptplan.plan import Plan
from planner.market.skyfacts import (  # noqa: F401  (re-exported: the task's facts live there)
    DISK_HEADROOM,
    EFA_SKYPILOT,
    EFA_SOURCES,
    IMAGE_GB,
    OFFSET_BYTES_PER_TOKEN,
    PINNED_SKYPILOT,
    disk_gb,
    disk_parts,
    efa_requirement,
)

# Our profile -> SkyPilot's accelerator name: the inverse of the catalog import's mapping
# (planner.market.prices.ACCELERATORS), so that the two always meet. A10 (Azure) and A10G (AWS) both
# map to our a10g profile; the provider decides.
PROVIDER_ACCELERATOR = {("azure", "a10g"): "A10"}
CLOUDS = {
    "aws": "aws",
    "gcp": "gcp",
    "azure": "azure",
    "lambda": "lambda",
    "oci": "oci",
    "runpod": "runpod",
    "paperspace": "paperspace",
    "fluidstack": "fluidstack",
    "cudo": "cudo",
    "ibm": "ibm",
    "nebius": "nebius",
    "do": "do",
    "vast": "vast",
}
BUCKET_STORES = {
    "aws": "s3",
    "gcp": "gcs",
    "azure": "azure",
    "ibm": "ibm",
    "oci": "oci",
    "nebius": "nebius",
}
MOUNT = "/checkpoints"
CORPUS_MOUNT = "/corpus"
# Existing buckets SkyPilot mounts by URI (`source`), by scheme
CORPUS_SCHEMES = ("s3", "gs", "r2", "https", "cos", "oci", "nebius")
GLOB_CHARS = set("*?[")
MASTER_PORT = 8090
GPU_INDEX = "https://www.paddlepaddle.org.cn/packages/stable/cu126/"
# The nodes' Python: constraints.txt pins numpy 2.4, pandas 3.1, scipy 1.17 (Python >= 3.11),
# and cloud images ship anything from 3.8 to 3.12. uv (one static binary, installed at a pinned
# version by its documented installer URL) creates the environment with its own managed
# CPython 3.11 (UV_PYTHON_PREFERENCE=only-managed: never the image's), so every cloud gets the
# same interpreter.
PYTHON_VERSION = "3.11"
UV_VERSION = "0.13.8"
UV_INSTALLER = f"https://astral.sh/uv/{UV_VERSION}/install.sh"
VENV = "~/gptplan-venv"
# A store for the checkpoint bucket on clouds that have none of their own (`--store`)
DEFAULT_FOREIGN_STORE = "s3"
STORES = ("s3", "gcs", "azure", "r2", "ibm", "oci", "nebius")  # SkyPilot's StoreType


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """What a multi-node plan on a cloud's RDMA network needs from the task."""

    name: str
    envs: dict
    image_id: str
    note: str
    sources: str


# Chosen by what the offer's own network_source says the instance has (the figure the plan's
# communication time was modelled with), per cloud.
INTERCONNECTS = {
    ("aws", "EFA"): Interconnect(
        name="EFA",
        envs={"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"},
        image_id="",
        note="NCCL reaches EFA through libfabric and the aws-ofi-nccl plugin, which the AWS "
        "Deep Learning AMIs carry; setup checks for the EFA device (fi_info -p efa) and says "
        "if NCCL will fall back to TCP (slower than planned)",
        sources="AWS EC2 User Guide, 'Get started with EFA and NCCL' (FI_PROVIDER, "
        f"FI_EFA_USE_DEVICE_RDMA, FI_EFA_FORK_SAFE); {EFA_SOURCES}",
    ),
    ("azure", "InfiniBand"): Interconnect(
        name="InfiniBand",
        envs={
            "NCCL_IB_PCI_RELAXED_ORDERING": "1",
            "UCX_IB_PCI_RELAXED_ORDERING": "on",
            "NCCL_SOCKET_IFNAME": "eth0",
        },
        image_id="microsoft-dsvm:ubuntu-hpc:2204:latest",
        note="the Azure HPC image (InfiniBand drivers, NCCL topology files) as image_id; "
        "NCCL uses InfiniBand with GPUDirect RDMA",
        sources="Microsoft Learn, 'ND A100 v4-series' and 'ND H100 v5-series'; the "
        "azhpc-images NCCL settings (NCCL_IB_PCI_RELAXED_ORDERING, NCCL_TOPO_FILE)",
    ),
}
# The Azure HPC image's NCCL topology file per ND family (instance name pattern -> file)
AZURE_TOPOLOGY = {
    "A100_v4": "/opt/microsoft/ndv4-topo.xml",
    "asr_v4": "/opt/microsoft/ndv4-topo.xml",
    "H100_v5": "/opt/microsoft/ndv5-topo.xml",
}


def sky_accelerator(profile: str, provider: str) -> str:
    from planner.market.prices import ACCELERATORS

    if (provider, profile) in PROVIDER_ACCELERATOR:
        return PROVIDER_ACCELERATOR[(provider, profile)]
    names = [name for name, prof in ACCELERATORS.items() if prof == profile]
    if not names:
        raise UserError(
            f"{profile!r} has no SkyPilot accelerator name; allowed profiles: "
            f"{', '.join(sorted(set(ACCELERATORS.values())))}",
            key="hardware.profile",
        )
    return names[0]


def default_bucket(plan: Plan) -> str:
    """A bucket name valid on S3 and GCS: lowercase, digits, hyphens, 3-63 characters."""
    digest = hashlib.sha256(plan.fingerprint().encode()).hexdigest()[:8]
    base = re.sub(r"[^a-z0-9-]+", "-", plan.name.lower()).strip("-")[:40] or "run"
    return f"gptplan-{base}-{digest}"


def plan_offer(plan: Plan):
    """The price-list row (region) the plan was priced with (None when no list holds it)."""
    from planner.market.hardware import load_profiles
    from planner.market.offers import region_choices

    profile = load_profiles().get(plan.hardware.profile)
    mine = [o for o in (profile.offers if profile else ()) if o.key == plan.hardware.offer]
    # the region the planner priced this capacity in (planner.market.offers.region_choices)
    capacity = "spot" if plan.hardware.spot else "on_demand"
    for offer, only, _ in region_choices(mine) if mine else ():
        if only in ("", capacity):
            return offer
    return None


def offer_region(plan: Plan) -> str:
    """Region of the plan's price, from the price list ('' when it recorded none)."""
    offer = plan_offer(plan)
    if offer is None:
        return ""
    return offer.spot_region if plan.hardware.spot and offer.spot_region else offer.region


def interconnect(plan: Plan, cloud: str) -> Interconnect | None:
    """The RDMA settings a multi-node plan needs on its cloud (None: single node, or plain
    TCP networking, as the offer's network_source says)."""
    if plan.parallel.nnodes <= 1:
        return None
    offer = plan_offer(plan)
    source = offer.network_source if offer is not None else ""
    for (where, name), settings in INTERCONNECTS.items():
        if where == cloud and name.lower() in source.lower():
            instance = plan.hardware.offer.split("/", 1)[1]
            topology = [f for part, f in AZURE_TOPOLOGY.items() if part in instance]
            if cloud == "azure" and topology:
                envs = settings.envs | {"NCCL_TOPO_FILE": topology[0]}
                return dataclasses.replace(settings, envs=envs)
            return settings
    return None


def setup_script(*, python_version: str = PYTHON_VERSION, efa_check: bool = False) -> str:
    """Make the Python environment with uv, then install this project into it."""
    uv = "~/.local/bin/uv"
    lines = [
        "set -e",
        f"# Python {python_version} (constraints.txt needs >= 3.11) from uv {UV_VERSION}, "
        "whatever the image's own python",
        f"if [ ! -x {uv} ]; then curl -LsSf {UV_INSTALLER} | sh; fi",
        f"[ -x {VENV}/bin/python ] || UV_PYTHON_PREFERENCE=only-managed "
        f"{uv} venv --seed --python {python_version} {VENV}",
        f"{VENV}/bin/python -c 'import sys; assert sys.version_info >= (3, 11), sys.version'",
        "# this project with the GPU extra; every other package pinned by constraints.txt",
        f"{uv} pip install --python {VENV}/bin/python --quiet -c constraints.txt -e '.[gpu]' "
        f"--extra-index-url {GPU_INDEX} --index-strategy unsafe-best-match",
    ]
    if efa_check:
        lines.append(
            "fi_info -p efa >/dev/null 2>&1 || echo 'warning: no EFA device or libfabric on "
            "this image: NCCL will use TCP between nodes (slower than planned)'"
        )
    return "\n".join(lines) + "\n"


def corpus_mount(uri: str) -> tuple[str, str]:
    """'s3://bucket/text/*.jsonl' -> (bucket source to mount, job.corpus glob under
    CORPUS_MOUNT). Without a glob in the last part every file under the prefix is read."""
    scheme, sep, rest = uri.partition("://")
    parts = [p for p in rest.split("/") if p]
    if (
        not sep
        or scheme not in CORPUS_SCHEMES
        or not parts
        or (scheme == "https" and len(parts) < 2)
    ):
        raise UserError(
            f"{uri!r} is not a bucket URI; allowed: "
            f"{', '.join(s + '://BUCKET[/PREFIX][/GLOB]' for s in CORPUS_SCHEMES[:3])}"
            ", https://ACCOUNT.blob.core.windows.net/CONTAINER[/PREFIX][/GLOB] "
            "(Azure), cos://, oci://, nebius://",
            key="--corpus-bucket",
        )
    keep = 2 if scheme == "https" else 1  # Azure: the account host, then the container
    source = f"{scheme}://{'/'.join(parts[:keep])}"
    inner = parts[keep:]
    if not inner or not GLOB_CHARS & set(inner[-1]):
        inner.append("**/*")
    return source, "/".join([CORPUS_MOUNT, *inner])


def disk_plan(plan: Plan) -> tuple[int, str]:
    """Boot disk in GB for the task, and how it was reckoned (modelled)."""
    from gptplan.modelfacts import parameter_count
    from gptplan.money import keeps_master_weights

    job = plan.job
    tokens = job.corpus_tokens or plan.training.max_steps * plan.tokens_per_step
    tokens_how = (
        "job.corpus_tokens"
        if job.corpus_tokens
        else "the trained tokens (job.corpus_tokens not recorded)"
    )
    t = plan.training
    parts = disk_parts(
        tokens=tokens,
        vocab_size=plan.model.vocab_size,
        params=parameter_count(plan.model),
        master_weights=keeps_master_weights(t.precision, t.fp16_opt_level),
        keep_last=plan.checkpoint.keep_last,
        corpus_bytes=job.corpus_bytes,
    )
    gb = int(disk_gb(parts))
    width = 2 if plan.model.vocab_size < 65535 else 4
    prepared, checkpoints, corpus = (float(parts[k]) for k in ("prepared", "checkpoints", "corpus"))
    why = (
        f"disk_size {gb} GB (modelled) = {IMAGE_GB:g} GB image and venv + "
        f"{DISK_HEADROOM:g} x (prepared data {prepared / 1e9:,.1f} GB: {tokens:,.0f} "
        f"tokens from {tokens_how} x {width + OFFSET_BYTES_PER_TOKEN:g} bytes; checkpoints "
        f"{checkpoints / 1e9:,.1f} GB: keep_last {plan.checkpoint.keep_last} + 1 being "
        f"written, cached locally by the bucket mount; corpus {corpus / 1e9:,.1f} GB for the "
        "mount's read cache)"
    )
    return gb, why


def _mounts_and_run(
    plan: Plan, *, plan_path: str, bucket: str, store: str, corpus_bucket: str, venv: str
) -> tuple[dict, str]:
    """file_mounts (checkpoint bucket, and the corpus bucket if given) and the run script."""
    mounts = {MOUNT: {"name": bucket, "store": store, "mode": "MOUNT_CACHED", "persistent": True}}
    corpus = ""
    if corpus_bucket:
        source, pattern = corpus_mount(corpus_bucket)
        mounts[CORPUS_MOUNT] = {"source": source, "mode": "MOUNT"}
        corpus = " --set " + shlex.quote(f"job.corpus={json.dumps([pattern])}")
    run = (
        "\n".join(
            [
                "set -e",
                'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)',
                f"{venv}/bin/runner execute {shlex.quote(plan_path)} --output-dir "
                f"{MOUNT}/{plan.name}{corpus} --node-rank $SKYPILOT_NODE_RANK "
                f"--master $MASTER_ADDR:{MASTER_PORT}",
            ]
        )
        + "\n"
    )
    return mounts, run


def task_dict(
    plan: Plan,
    *,
    plan_path: str,
    bucket: str = "",
    region: str | None = None,
    corpus_bucket: str = "",
    store: str = "",
) -> dict:
    """The SkyPilot task for `plan` as plain data (see the module docstring)."""
    hw, p = plan.hardware, plan.parallel
    if hw.device != "gpu" or "/" not in hw.offer:
        raise UserError(
            f"{hw.offer!r} ({hw.device}) is not a cloud GPU offer; a SkyPilot task "
            "needs a plan for a cloud provider's instance (provider/instance)",
            key="hardware.offer",
        )
    provider, instance = hw.offer.split("/", 1)
    cloud = CLOUDS.get(provider)
    if cloud is None:
        raise UserError(
            f"{provider!r} is not a SkyPilot cloud; allowed: {', '.join(sorted(CLOUDS))}",
            key="hardware.offer",
        )
    if store and store not in STORES:
        raise UserError(
            f"{store!r} is not a SkyPilot store; allowed: {', '.join(STORES)}", key="--store"
        )
    store = store or BUCKET_STORES.get(cloud) or DEFAULT_FOREIGN_STORE
    region = offer_region(plan) if region is None else region
    resources = {
        "cloud": cloud,
        "instance_type": instance,
        "accelerators": f"{sky_accelerator(hw.profile, provider)}:{p.nproc_per_node}",
        "use_spot": bool(hw.spot),
        "disk_size": disk_plan(plan)[0],
    }
    if region:
        resources["region"] = region
    if hw.spot:
        # A preempted managed job is relaunched (same region first, then others); the runner's
        # own resume picks up the checkpoints in the bucket.
        resources["job_recovery"] = {"strategy": "FAILOVER", "max_restarts_on_errors": 1}
    bucket = bucket or default_bucket(plan)
    net = interconnect(plan, cloud)
    if net is not None and net.image_id:
        resources["image_id"] = net.image_id
    if net is not None and net.name == "EFA":
        resources["network_tier"] = "best"  # attaches EFA from SkyPilot EFA_SKYPILOT on
    mounts, run = _mounts_and_run(
        plan,
        plan_path=plan_path,
        bucket=bucket,
        store=store,
        corpus_bucket=corpus_bucket,
        venv=VENV,
    )
    task = {
        "name": plan.name,
        "workdir": ".",
        "num_nodes": p.nnodes,
        "resources": resources,
        "file_mounts": mounts,
        "setup": setup_script(efa_check=net is not None and net.name == "EFA"),
        "run": run,
    }
    if net is not None:
        task["envs"] = dict(net.envs)
    return task


def store_note(task: dict, plan: Plan) -> str:
    """Where the run directory lives, and on which store."""
    cloud = task["resources"]["cloud"]
    store = task["file_mounts"][MOUNT]["store"]
    own = BUCKET_STORES.get(cloud)
    where = f"bucket {task['file_mounts'][MOUNT]['name']} on {store}"
    if own == store:
        return f"run directory: {where} ({cloud}'s own store), mounted at {MOUNT}"
    why = (
        f"{cloud} has no bucket store in SkyPilot"
        if own is None
        else f"asked for with --store instead of {cloud}'s {own}"
    )
    return (
        f"run directory: {where} ({why}; --store names another: {', '.join(STORES)}), "
        f"mounted at {MOUNT}; the nodes need that store's credentials (sky check {store})"
    )


def interconnect_note(task: dict, plan: Plan) -> str:
    """One sentence on the network between the nodes."""
    if plan.parallel.nnodes <= 1:
        return "interconnect: one node, no inter-node network"
    offer = plan_offer(plan)
    net = interconnect(plan, task["resources"]["cloud"])
    figure = (
        f"{offer.inter_node_gbits_per_s:g} Gbit/s ({offer.network_source})"
        if offer is not None
        else "not recorded (no price list holds the offer)"
    )
    if net is None:
        return f"interconnect: TCP between nodes, as planned with {figure}"
    envs = ", ".join(f"{k}={v}" for k, v in net.envs.items())
    image = f"; image_id {net.image_id}" if net.image_id else ""
    launch = ""
    if net.name == "EFA":
        need = efa_requirement(plan.hardware.offer)
        launch = f"; resources.network_tier: best: the launch {need}"
    return (
        f"interconnect: {net.name} as planned with {figure}: envs {envs}{image}{launch}; "
        f"{net.note} (sources: {net.sources})"
    )


def corpus_note(task: dict, plan: Plan) -> str:
    """One sentence on where the nodes find the corpus."""
    planned = (
        f"the planned {plan.job.corpus_tokens / 1e9:,.3g}B tokens"
        if plan.job.corpus_tokens
        else "what the plan records"
    )
    mount = task["file_mounts"].get(CORPUS_MOUNT)
    if mount:
        pattern = json.loads(shlex.split(task["run"].split("--set ", 1)[1])[0].split("=", 1)[1])[0]
        return (
            f"corpus: {mount['source']} mounted at {CORPUS_MOUNT} (read as needed), "
            f"job.corpus = {pattern} (--set on the run line); the runner checks it holds "
            f"{planned} before training"
        )
    return (
        f"corpus: no --corpus-bucket: the nodes read job.corpus = "
        f"{', '.join(plan.job.corpus)} from the synced project; the runner refuses a "
        f"corpus much smaller than {planned}; pass --corpus-bucket s3://BUCKET/PREFIX to "
        "mount the full corpus"
    )


def render(task: dict, plan: Plan, *, plan_path: str, out_path: str) -> str:
    """YAML text with a header saying what it is, where the price came from, how to launch."""
    import yaml

    hw = plan.hardware
    region = task["resources"].get("region")
    header = [
        f"# SkyPilot task for plan {plan.name!r} ({plan_path}), written by gptplan's planner.",
        f"# Offer: {hw.offer}, {plan.parallel.nnodes} node(s) x {plan.parallel.nproc_per_node} "
        f"{hw.profile}, {'spot' if hw.spot else 'on-demand'}, "
        f"{hw.price_per_node_hour:g} {hw.currency} per node-hour (the node and its disk).",
        f"# Price source: {plan.provenance.prices_source or 'not recorded'} "
        f"(as of {plan.provenance.prices_as_of or 'unknown'}).",
        "# Region: "
        + (
            f"{region}, where the price was seen."
            if region
            else "not recorded with the price (the price list gives the lowest over "
            "regions); SkyPilot picks the cheapest region that has capacity."
        ),
        "# Run from the project root (workdir '.'); as a managed job that survives preemption:",
        f"#   sky jobs launch -n {plan.name} {out_path}",
        "# Checkpoints, billing, metrics and the report live in the bucket mounted at "
        f"{MOUNT} (shared by all nodes, kept after the job); a relaunched job resumes from "
        "the newest complete checkpoint there (the runner's automatic resume).",
        f"# {corpus_note(task, plan)[0].upper()}{corpus_note(task, plan)[1:]}.",
        f"# {store_note(task, plan)[0].upper()}{store_note(task, plan)[1:]}.",
        f"# {interconnect_note(task, plan)[0].upper()}{interconnect_note(task, plan)[1:]}.",
        f"# Python: a uv {UV_VERSION} virtual environment at {VENV} with CPython "
        f"{PYTHON_VERSION} (setup), whatever the image ships.",
        f"# Boot {disk_plan(plan)[1]}.",
    ]

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):  # multi-line scripts as YAML block literals
        return dumper.represent_scalar(
            "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None
        )

    Dumper.add_representer(str, text)
    body = yaml.dump(
        task,
        Dumper=Dumper,
        sort_keys=False,
        default_flow_style=False,
        width=1000,
        allow_unicode=True,
    )
    wrapped = [
        line
        for text_line in header
        for line in textwrap.wrap(text_line, 99, subsequent_indent="#   ")
    ]
    return "\n".join(wrapped) + "\n" + body


def write_launch_file(
    plan: Plan,
    *,
    plan_path: Path,
    out: Path | None = None,
    bucket: str = "",
    region: str | None = None,
    corpus_bucket: str = "",
    store: str = "",
) -> Path:
    """Write the task YAML next to the plan (atomically); returns its path."""
    from gptplan.tomlconf import write_text_atomic

    out = Path(out) if out else Path(plan_path).with_suffix(".sky.yaml")
    try:  # SkyPilot syncs the working directory: the plan must be inside it
        relative = Path(plan_path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        raise UserError(
            f"{plan_path} is outside the current directory; run launch-file from "
            "the project root with a plan inside it (SkyPilot syncs that folder "
            "to the nodes)",
            key="PLAN",
        ) from None
    if bucket and not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise UserError(
            f"{bucket!r} is not a valid bucket name; allowed: 3-63 lowercase "
            "letters, digits, '.' and '-'",
            key="--bucket",
        )
    task = task_dict(
        plan,
        plan_path=relative,
        bucket=bucket,
        region=region,
        corpus_bucket=corpus_bucket,
        store=store,
    )
    write_text_atomic(out, render(task, plan, plan_path=relative, out_path=str(out)))
    return out
