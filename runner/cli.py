"""`runner execute PLAN.toml`: validate, prepare data, launch, account, report.

Bad input ends with one line on stderr and exit status 2; a run stopped by a signal exits 143
(so schedulers see a preemption), a crashed rank exits 1 with the tail of its log.

This module parses the command line and runs the command: `execute` becomes an
ExecuteRequest (runner.execution) that runner.execute runs step by step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gptplan import quiet_third_party_warnings, userdata
from gptplan.cliargs import OneLineParser
from gptplan.errors import DataError, UserError
from gptplan.plan import Plan, load_plan
from runner import __version__, signals
from runner.execution import ExecuteRequest


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="runner", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"runner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _execute_args(sub.add_parser("execute", help="run a plan as real (distributed) training"))
    _export_args(
        sub.add_parser(
            "export", help="write a run's model + tokenizer in PaddleNLP format (save_pretrained)"
        )
    )
    _generate_args(
        sub.add_parser("generate", help="sample text from a run's model (PaddleNLP generate)")
    )
    return parser


def _execute_args(ex: argparse.ArgumentParser) -> None:
    ex.add_argument("plan", type=Path, help="plan TOML (schema 1)")
    ex.add_argument(
        "--dry-run",
        action="store_true",
        help="validate plan, data and model build; print the launch command(s)",
    )
    ex.add_argument(
        "--fresh",
        action="store_true",
        help="ignore existing checkpoints (the old run folder is kept, renamed)",
    )
    _resume_policy_args(ex)
    ex.add_argument(
        "--local",
        action="store_true",
        help="rehearse on this machine: its devices, a few steps, settings shrunk "
        "to fit its memory (each change is listed)",
    )
    ex.add_argument("--max-steps", type=int, default=None, help="override training.max_steps")
    ex.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one plan field (validated like the file); repeatable",
    )
    ex.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        metavar="GB",
        help="memory limit per rank (default: from the plan's modelled memory "
        "and this machine's); the runner ends a rank above it",
    )
    ex.add_argument("--output-dir", type=str, default=None, help="override job.output_dir")
    ex.add_argument(
        "--node-rank", type=int, default=None, help="this node's rank in a multi-node plan"
    )
    ex.add_argument("--master", type=str, default="", help="host:port of node 0 (multi-node)")
    ex.add_argument(
        "--export",
        action="store_true",
        help="after training, export the model for inference (paddle.jit.save)",
    )
    ex.add_argument("--json", action="store_true", help="print the final report as JSON")
    ex.add_argument(
        "--verbose",
        action="store_true",
        help="show the launcher's and ranks' own output (default: only the "
        "runner's lines; the rest is in the attempt's log folder)",
    )


TRUST_PICKLED_HELP = (
    "read a checkpoint of the earlier pickled format (model.*.pdparams) and convert it once "
    "into safetensors; unpickling RUNS ANY CODE the file holds: only for run directories you "
    "wrote yourself (default: refused, exit 2)"
)


def _trust_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trust-pickled-checkpoint", action="store_true", help=TRUST_PICKLED_HELP)


def _resume_policy_args(ex: argparse.ArgumentParser) -> None:
    """What a resume does with changed data or a diverged loss (refused by default)."""
    _trust_arg(ex)
    ex.add_argument(
        "--accept-new-data",
        action="store_true",
        help="resume although the prepared corpus differs from the one the checkpoint was "
        "trained on (default: refused, exit 2)",
    )
    ex.add_argument(
        "--ignore-divergence",
        action="store_true",
        help="train on when the loss diverges (default: stop with exit 1, runner.divergence)",
    )


def _export_args(exp: argparse.ArgumentParser) -> None:
    exp.add_argument("run_dir", type=Path, help="run directory (runs/<name> or job.output_dir)")
    exp.add_argument(
        "--checkpoint",
        default=None,
        help="step number of the checkpoint to export (default: the newest)",
    )
    exp.add_argument(
        "--out", type=Path, default=None, help="output folder (default: RUN_DIR/export/paddlenlp)"
    )
    exp.add_argument(
        "--jit",
        action="store_true",
        help="also write the paddle.jit.save inference export (RUN_DIR/export)",
    )
    _trust_arg(exp)


def _generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("run_dir", type=Path, help="run directory (runs/<name> or job.output_dir)")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument(
        "--checkpoint",
        default=None,
        help="step number of a checkpoint (default: the end-of-run export, else "
        "the newest checkpoint)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument(
        "--min-new-tokens",
        type=int,
        default=None,
        help="generate at least this many tokens before <eod> may end the sample (default: "
        "half of --max-new-tokens; 0 lets <eod> end it at once)",
    )
    gen.add_argument("--top-k", type=int, default=8, help="sample from the k likeliest tokens")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    gen.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    gen.add_argument("--json", action="store_true", help="print the sample as JSON")
    _trust_arg(gen)


def main(argv: list[str] | None = None, *, started_at: float | None = None) -> int:
    """`started_at`: when this runner's process started (runner.__main__ passes it; billing
    counts from there), else now."""
    # A notice during start-up is delivered once our handler is in place. The caller's signal
    # mask and handlers come back on return: an in-process caller (tests, notebooks) must not
    # keep SIGTERM blocked, or worker pools it starts later could never be terminated.
    with signals.restored_on_exit():
        signals.block()
        return _main(argv, started_at or time.time())


def _main(argv: list[str] | None, started_at: float) -> int:
    parser = build_parser()
    userdata.add_flag(parser)  # --data-dir before or after any command
    args = parser.parse_args(argv)
    quiet_third_party_warnings()
    commands = {
        "execute": lambda a: cmd_execute(a, started_at),
        "export": cmd_export,
        "generate": cmd_generate,
    }
    try:
        userdata.apply_flag(args)
        return commands[args.command](args)
    except UserError as exc:
        plan_file = getattr(args, "plan", None)
        if plan_file is not None and not exc.file and _from_the_plan(exc):
            exc.file = str(plan_file)  # a plan key (or corpus/tokenizer) checked after loading
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status
    except signals.Terminated as exc:
        print(
            f"stopped by {exc}; nothing since the last checkpoint was lost (run the same "
            "command again to resume)",
            file=sys.stderr,
        )
        return signals.EXIT_SIGNALLED


def _from_the_plan(exc: UserError) -> bool:
    """Whether `exc` is about the plan file's content: a corpus/tokenizer error, or one naming a
    plan key (section.key) rather than a flag (--master) or a folder of the machine."""
    if isinstance(exc, DataError):
        return True
    key = exc.key or ""
    return exc.exit_status == 2 and bool(key) and not key.startswith("-")


def cmd_execute(args: argparse.Namespace, started_at: float) -> int:
    """`runner execute`: the arguments as an ExecuteRequest, run by runner.execute."""
    from runner.execute import execute

    return execute(execute_request(args, started_at))


def execute_request(args: argparse.Namespace, started_at: float) -> ExecuteRequest:
    return ExecuteRequest(
        plan_file=args.plan,
        started_at=started_at,
        dry_run=args.dry_run,
        fresh=args.fresh,
        accept_new_data=args.accept_new_data,
        ignore_divergence=args.ignore_divergence,
        trust_pickled_checkpoint=args.trust_pickled_checkpoint,
        local=args.local,
        max_steps=args.max_steps,
        overrides=tuple(args.set),
        memory_limit_gb=args.memory_limit_gb,
        output_dir=args.output_dir,
        node_rank=args.node_rank,
        master=args.master,
        export=args.export,
        json=args.json,
        verbose=args.verbose,
    )


def _run_plan(run_dir: Path) -> Plan:
    plan_file = Path(run_dir) / "plan.toml"
    if not plan_file.is_file():
        raise UserError(
            f"{plan_file} is missing: {run_dir} is not a run directory (it holds "
            "the effective plan.toml of a run)",
            key="RUN_DIR",
        )
    return load_plan(plan_file)


def cmd_export(args: argparse.Namespace) -> int:
    from runner.export import export_model, export_pretrained, export_summary

    plan = _run_plan(args.run_dir)
    trust = args.trust_pickled_checkpoint
    out = export_pretrained(
        plan, args.run_dir, checkpoint=args.checkpoint, out_dir=args.out, trust_pickled=trust
    )
    print(f"PaddleNLP format (AutoModelForCausalLM / AutoTokenizer.from_pretrained): {out}")
    if args.jit:
        print(
            "exported for inference (paddle.jit.save): "
            f"{export_model(plan, args.run_dir, checkpoint=args.checkpoint, trust_pickled=trust)}"
        )
    jit_dir = args.run_dir if args.jit else None
    print(f"export done, verified: {export_summary(out, jit_run_dir=jit_dir)}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:

    from runner.export import generate

    for key, value, low in (
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--top-k", args.top_k, 1),
        ("--min-new-tokens", args.min_new_tokens, 0),
    ):
        if value is not None and value < low:
            raise UserError(f"{value} must be >= {low}", key=key)
    if not args.temperature > 0:
        raise UserError(f"{args.temperature} must be > 0", key="--temperature")
    _run_plan(args.run_dir)
    sample = generate(
        args.run_dir,
        prompt=args.prompt,
        checkpoint=args.checkpoint,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=(
            args.max_new_tokens // 2 if args.min_new_tokens is None else args.min_new_tokens
        ),
        top_k=args.top_k,
        trust_pickled=args.trust_pickled_checkpoint,
        temperature=args.temperature,
        seed=args.seed,
    )
    if args.json:
        print(json.dumps(sample, ensure_ascii=False, indent=1))
    else:
        print(
            f"sample from {sample['source']} (top-{sample['top_k']} sampling, seed "
            f"{sample['seed']}, {sample['new_tokens']} new tokens):"
        )
        print(f"  {sample['prompt']}[{sample['continuation']}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
