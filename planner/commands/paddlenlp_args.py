"""`planner paddlenlp-args PLAN`: the plan as PaddleNLP 2.8.1 llm/run_pretrain.py arguments
(gptplan.paddlenlp_args)."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

NAME = "paddlenlp-args"


def add_parser(sub: argparse._SubParsersAction) -> None:
    pa = sub.add_parser(
        NAME,
        help="write the plan as PaddleNLP 2.8.1 llm/run_pretrain.py arguments (JSON + config)",
    )
    pa.add_argument("plan", type=Path, help="plan TOML")
    pa.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for run_pretrain.json and model/config.json (default: PLAN.paddlenlp/)",
    )
    pa.add_argument(
        "--input-dir",
        default="data",
        help="PaddleNLP's preprocessed corpus (llm/tools/preprocess *.bin/*.idx), relative to "
        "the folder run_pretrain.py runs in (default: data)",
    )
    pa.add_argument(
        "--tokenizer",
        default="",
        help="PaddleNLP tokenizer name or folder (default: job.tokenizer when it names one, "
        "else the model folder, where a run's exported tokenizer goes)",
    )


def run(args: argparse.Namespace) -> int:
    """The plan as run_pretrain.py arguments (gptplan.paddlenlp_args): run_pretrain.json and
    model/config.json in one folder, written atomically; paths in the JSON are relative to it."""
    from gptplan.paddlenlp_args import model_config, pretrain_args
    from gptplan.plan import load_plan
    from gptplan.tomlconf import write_text_atomic

    plan = load_plan(args.plan)
    out = args.out or args.plan.with_name(args.plan.stem + ".paddlenlp")
    tokenizer = args.tokenizer
    if not tokenizer and plan.job.tokenizer != "sentencepiece":
        tokenizer = plan.job.tokenizer  # a PaddleNLP name or a folder the plan names
    arguments = pretrain_args(
        plan, model_dir="model", tokenizer=tokenizer, input_dir=args.input_dir
    )
    (out / "model").mkdir(parents=True, exist_ok=True)
    write_text_atomic(
        out / "model" / "config.json", json.dumps(model_config(plan), indent=1) + "\n"
    )
    write_text_atomic(out / "run_pretrain.json", json.dumps(arguments, indent=1) + "\n")
    p = plan.parallel
    devices = ",".join(str(i) for i in range(p.nproc_per_node))
    notes = (
        f"PaddleNLP 2.8.1 pretraining arguments written to {out / 'run_pretrain.json'} (the "
        f"model's config in {out / 'model' / 'config.json'}); run from {out} on each of the "
        f"{p.nnodes} node(s), with PaddleNLP's llm/ folder at hand:",
        f"input_dir {args.input_dir!r}: PaddleNLP's preprocessed corpus (llm/tools/preprocess), "
        "not this project's cache format. "
        + (
            f"Tokenizer: {tokenizer!r}."
            if tokenizer
            else "Tokenizer: the plan trains its own sentencepiece model; copy a run's "
            "exported tokenizer (runner export) into model/."
        ),
        "The data-parallel degree is PaddleNLP's to derive (world size / tensor / pipeline / "
        "sharding), as the plan's is; the runner's own checkpoints are not PaddleNLP's.",
    )
    for i, note in enumerate(notes):
        print(textwrap.fill(note, 120, subsequent_indent="  ", break_long_words=False))
        if i == 0:
            master = " --master <NODE0_IP>:8090" if p.nnodes > 1 else ""
            print(
                f"  python -m paddle.distributed.launch --nnodes {p.nnodes}{master} --devices "
                f"{devices} llm/run_pretrain.py run_pretrain.json"
            )
    return 0
