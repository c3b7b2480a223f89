"""`planner launch-file PLAN`: the plan as a SkyPilot task YAML (sky jobs launch)."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

NAME = "launch-file"


def add_parser(sub: argparse._SubParsersAction) -> None:
    lf = sub.add_parser(NAME, help="write a SkyPilot task YAML for a plan (sky jobs launch)")
    lf.add_argument("plan", type=Path, help="plan TOML (inside this project: it is synced)")
    lf.add_argument("--out", type=Path, default=None, help="YAML file (default: PLAN.sky.yaml)")
    lf.add_argument(
        "--bucket", default="", help="checkpoint bucket name (default: gptplan-<plan name>-<hash>)"
    )
    lf.add_argument(
        "--region",
        default=None,
        help="cloud region (default: the region the price was seen in, if recorded)",
    )
    lf.add_argument(
        "--corpus-bucket",
        default="",
        metavar="URI",
        help="bucket holding the full corpus, mounted at /corpus on the nodes and "
        "used as job.corpus: s3://BUCKET[/PREFIX][/GLOB] (also gs://, r2://, "
        "https://ACCOUNT.blob.core.windows.net/CONTAINER/...); default: the "
        "plan's job.corpus as synced with the project",
    )
    lf.add_argument(
        "--store",
        default="",
        choices=("s3", "gcs", "azure", "r2", "ibm", "oci", "nebius"),
        help="bucket store for the run directory (default: the cloud's own; S3 for a cloud "
        "without one, e.g. Lambda)",
    )


def run(args: argparse.Namespace) -> int:
    from gptplan.plan import load_plan
    from planner.writing.skypilot import write_launch_file

    plan = load_plan(args.plan)
    import yaml

    from planner.writing.skypilot import corpus_note, disk_plan, interconnect_note, store_note

    out = write_launch_file(
        plan,
        plan_path=args.plan,
        out=args.out,
        bucket=args.bucket,
        region=args.region,
        corpus_bucket=args.corpus_bucket,
        store=args.store,
    )
    task = yaml.safe_load(out.read_text())
    notes = (
        f"SkyPilot task written to {out}; launch it from this directory as a managed job "
        "(relaunched after preemption, resuming from the bucket's checkpoints):",
        store_note(task, plan),
        interconnect_note(task, plan),
        corpus_note(task, plan),
        disk_plan(plan)[1],
    )
    for i, note in enumerate(notes):  # at most 120 columns, as every planner output
        print(textwrap.fill(note, 120, subsequent_indent="  ", break_long_words=False))
        if i == 0:
            print(f"  sky jobs launch -n {plan.name} {out}")
    return 0
