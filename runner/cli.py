"""`runner execute PLAN.toml`: validate, prepare data, launch, account, report.

Bad input ends with one line on stderr and exit status 2; a run stopped by a signal exits 143
(so schedulers see a preemption), a crashed rank exits 1 with the tail of its log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from runner import __version__
from runner import checkpoint as ckpt
from runner import quiet_third_party_warnings
from runner.errors import BudgetError, PlanError, UserError
from runner.plan import Plan, load_plan, write_plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runner", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"runner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="run a plan as real (distributed) training")
    ex.add_argument("plan", type=Path, help="plan TOML (schema 1)")
    ex.add_argument("--dry-run", action="store_true",
                    help="validate plan, data and model build; print the launch command(s)")
    ex.add_argument("--fresh", action="store_true",
                    help="ignore existing checkpoints (the old run folder is kept, renamed)")
    ex.add_argument("--local", action="store_true",
                    help="rehearse on this machine: its devices, a few steps, settings shrunk "
                         "to fit its memory (each change is listed)")
    ex.add_argument("--max-steps", type=int, default=None, help="override training.max_steps")
    ex.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one plan field (validated like the file); repeatable")
    ex.add_argument("--memory-limit-gb", type=float, default=None, metavar="GB",
                    help="memory limit per rank (default: from the plan's modelled memory "
                         "and this machine's); the runner ends a rank above it")
    ex.add_argument("--output-dir", type=str, default=None, help="override job.output_dir")
    ex.add_argument("--node-rank", type=int, default=None,
                    help="this node's rank in a multi-node plan")
    ex.add_argument("--master", type=str, default="", help="host:port of node 0 (multi-node)")
    ex.add_argument("--export", action="store_true",
                    help="after training, export the model for inference (paddle.jit.save)")
    ex.add_argument("--json", action="store_true", help="print the final report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party_warnings()
    try:
        return execute(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status


def apply_overrides(plan: Plan, args) -> Plan:
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise PlanError(f"{args.max_steps} must be >= 1", key="--max-steps")
        t = dataclasses.replace(plan.training, max_steps=args.max_steps,
                                warmup_steps=min(plan.training.warmup_steps, args.max_steps))
        job = dataclasses.replace(plan.job, target_tokens=0)
        plan = dataclasses.replace(plan, training=t, job=job)
    if args.output_dir is not None:
        plan = dataclasses.replace(plan, job=dataclasses.replace(plan.job,
                                                                 output_dir=args.output_dir))
    return plan


def check_resume(plan: Plan, run_dir: Path, plan_file: Path) -> Path | None:
    """The newest complete checkpoint, if it belongs to this plan."""
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    if latest is None:
        return None
    state = ckpt.read_state(latest)
    if state.get("plan_fingerprint") != plan.fingerprint():
        raise PlanError(f"{latest} was written by a different plan (model, data or batch "
                        "settings changed); use --fresh to start over or set job.output_dir",
                        file=str(plan_file), key="job.output_dir")
    return latest


def check_budget(plan: Plan, spent: float, plan_file: Path) -> None:
    b, hw = plan.budget, plan.hardware
    if b.max_cost <= 0:
        return
    if spent >= b.max_cost:
        raise BudgetError(f"{spent:.4f} {b.currency} already spent (measured) reaches "
                          f"max_cost {b.max_cost}; raise budget.max_cost to continue",
                          file=str(plan_file), key="budget.max_cost")
    step_cost = hw.price_per_node_hour * plan.parallel.nnodes * plan.estimate.step_time_s / 3600
    if plan.estimate.step_time_s > 0 and step_cost > b.max_cost - spent:
        raise BudgetError(f"{b.max_cost - spent:.6g} {b.currency} left cannot buy one step "
                          f"({step_cost:.6g} {b.currency}, {plan.estimate.source} estimate); "
                          "raise budget.max_cost", file=str(plan_file), key="budget.max_cost")


def execute(args) -> int:
    from runner.data import prepare_data
    from runner.launch import check_hardware, localize, run_group
    from runner.metrics import BillingLog
    from runner.parallel import launch_commands

    from runner.overrides import load_plan_with

    if args.memory_limit_gb is not None and not 0 < args.memory_limit_gb < float("inf"):
        raise PlanError(f"{args.memory_limit_gb} must be a positive number of GB",
                        key="--memory-limit-gb")
    plan, pinned = load_plan_with(args.plan, args.set)
    plan = apply_overrides(plan, args)
    if args.local:
        from runner.rehearsal import describe, rehearse

        plan, changes = localize(plan)
        rehearsal = rehearse(plan, max_steps_given=args.max_steps is not None,
                             output_dir_given=args.output_dir is not None,
                             limit_gb=args.memory_limit_gb, pinned=pinned)
        plan = rehearsal.plan
        print("--local: rehearsing on this machine; changed:")
        for change in [*changes, *rehearsal.changes] or ["nothing"]:
            print(f"  {change}")
        for line in describe(rehearsal):
            print(line)
    run_dir = plan.run_dir
    if args.fresh and run_dir.exists() and not args.dry_run:
        backup = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}.old")
        os.replace(run_dir, backup)
        print(f"--fresh: previous run kept in {backup}")
    latest = check_resume(plan, run_dir, args.plan)
    billing = BillingLog(run_dir / "billing.json")
    spent = plan.hardware.price_per_node_hour * plan.parallel.nnodes * \
        billing.total_seconds() / 3600
    check_budget(plan, spent, args.plan)

    effective_plan = run_dir / "plan.toml"
    needs_launch = plan.parallel.world_size > 1
    if not args.local and not args.dry_run:
        print_cluster_commands(plan, args)
        check_hardware(plan, node_rank=args.node_rank)

    data = prepare_data(plan)
    print(f"data: {data.num_tokens:,} tokens ({data.meta['num_documents']:,} documents, "
          f"{data.meta['tokens_per_character']:.3f} tokens/char, measured) in {data.path}")
    attempt = len(billing.attempts) + 1
    log_dir = run_dir / "logs" / f"attempt_{attempt:03d}"
    commands = launch_commands(plan, plan_path=effective_plan, data_dir=data.path,
                               run_dir=run_dir, log_dir=log_dir, master=args.master)
    if args.dry_run:
        print_cluster_commands(plan, args)
        if needs_launch:
            print("launch command(s) this runner starts:")
            for cmd in commands:
                print(f"  node {cmd.node_rank}: {cmd.render()}")
        return dry_run(plan, data)

    if latest is not None:
        state = ckpt.read_state(latest)
        if state["step"] >= plan.training.max_steps:
            print(f"already finished: {latest} is at step {state['step']}")
            return report(plan, run_dir, args)
        print(f"resuming from {latest} (step {state['step']})")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_plan(plan, effective_plan, header=f"# effective plan of this run (from {args.plan})\n")
    ckpt.remove_incomplete(run_dir / "checkpoints")
    attempt_start = billing.start_attempt()
    if not needs_launch:
        rc = run_in_process(plan, data.path, run_dir)
    else:
        from runner.rehearsal import rank_memory_limit_bytes
        from runner.supervise import oom_kills, supervised

        limit = rank_memory_limit_bytes(plan, limit_gb=args.memory_limit_gb)
        oom_before = oom_kills()
        rc = run_group(supervised(commands[args.node_rank or 0], log_dir / "ranks", limit),
                       group_file=run_dir / "launcher.json")
    billing.touch()
    result = read_result(run_dir, since=attempt_start)
    if result is None and needs_launch:
        from runner.failure import diagnose, render
        from runner.supervise import machine_memory_bytes

        failure = diagnose(plan=plan, status_dir=log_dir / "ranks", log_dir=log_dir,
                           launcher_rc=rc, oom_kills_before=oom_before,
                           oom_kills_after=oom_kills(), machine_bytes=machine_memory_bytes(),
                           local=args.local)
        print(render(failure, log_dir), file=sys.stderr)
        return 1
    if result is None:
        tail = last_log_lines(log_dir)
        print(f"training failed (exit {rc}); last lines of the rank logs:\n{tail}",
              file=sys.stderr)
        return 1
    status = report(plan, run_dir, args)
    if args.export and result["finished"]:
        from runner.export import export_model

        print(f"exported for inference: {export_model(plan, run_dir)}")
    interrupted = not result["finished"] and result["stop_reason"].startswith("signal")
    return 143 if interrupted else status


def read_result(run_dir: Path, *, since: float) -> dict | None:
    """The result rank 0 wrote in this attempt, or None if the attempt crashed before that."""
    path = run_dir / "result.json"
    if not path.exists() or path.stat().st_mtime < since:
        return None
    return json.loads(path.read_text())


def print_cluster_commands(plan: Plan, args) -> None:
    """What to type on each node of the planned cluster."""
    p = plan.parallel
    if p.nnodes == 1:
        print(f"on the planned machine ({p.nproc_per_node} x {plan.hardware.device}, "
              f"{plan.hardware.profile}): runner execute {args.plan}")
        return
    print(f"on each of the {p.nnodes} planned nodes ({p.nproc_per_node} x "
          f"{plan.hardware.device} each, {plan.hardware.profile}):")
    master = args.master or p.master or "<NODE0_IP>:8090"
    for node in range(p.nnodes):
        print(f"  node {node}: runner execute {args.plan} --node-rank {node} --master {master}")


def run_in_process(plan: Plan, data_dir: Path, run_dir: Path) -> int:
    from runner.train import train

    train(plan, data_dir=data_dir, run_dir=run_dir)
    return 0


def dry_run(plan: Plan, data) -> int:
    from runner.data import TokenDataset
    from runner.model import build_model, parameter_count, training_flops_per_token

    dataset = TokenDataset(data, seq_len=plan.training.seq_len, packing=plan.training.packing)
    import paddle

    paddle.set_device("cpu")
    net = build_model(plan.model, dataclasses.replace(plan.parallel, tensor_parallel_degree=1,
                                                      pipeline_parallel_degree=1,
                                                      sequence_parallel=False),
                      seq_len=plan.training.seq_len)
    built = sum(int(p.numel()) for p in net.parameters())
    assert built == parameter_count(plan.model), "parameter formula out of date"
    epochs = plan.training.max_steps * plan.global_batch_size / dataset.num_samples
    print(f"model: {built:,} parameters (built), "
          f"{training_flops_per_token(plan.model, plan.training.seq_len):.3g} FLOPs/token")
    print(f"samples: {dataset.num_samples:,} of {plan.training.seq_len} tokens; "
          f"{plan.training.max_steps} steps x {plan.global_batch_size} = {epochs:.2f} epochs")
    print("dry run OK: plan, data and model are valid")
    return 0


def report(plan: Plan, run_dir: Path, args) -> int:
    from runner.metrics import BillingLog
    from runner.report import planned_vs_actual, render
    from runner.tomlconf import write_text_atomic

    result_file = run_dir / "result.json"
    if not result_file.exists():
        print("no result.json: the run ended before its first step", file=sys.stderr)
        return 1
    result = json.loads(result_file.read_text())
    billed = BillingLog(run_dir / "billing.json").total_seconds()
    data = planned_vs_actual(plan, result, billed)
    write_text_atomic(run_dir / "report.json", json.dumps(data, indent=1))
    print(json.dumps(data, indent=1) if args.json else render(data))
    return 0


def last_log_lines(log_dir: Path, lines: int = 15) -> str:
    chunks = []
    for log in sorted(Path(log_dir).glob("workerlog.*")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        chunks.append(f"--- {log}\n" + "\n".join(text))
    return "\n".join(chunks) or f"(no logs in {log_dir})"


if __name__ == "__main__":
    sys.exit(main())
