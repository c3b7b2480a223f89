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
from runner import budget as budget_guard
from runner import checkpoint as ckpt
from runner import signals
from gptplan import quiet_third_party_warnings
from gptplan.cliargs import OneLineParser
from gptplan.errors import BudgetError, DataError, PlanError, UserError
from gptplan.plan import Plan, load_plan, write_plan
from gptplan.tomlconf import folder_problem


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="runner", description=__doc__.splitlines()[0])
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
    ex.add_argument("--verbose", action="store_true",
                    help="show the launcher's and ranks' own output (default: only the "
                         "runner's lines; the rest is in the attempt's log folder)")
    exp = sub.add_parser("export", help="write a run's model + tokenizer in PaddleNLP format "
                                        "(save_pretrained)")
    exp.add_argument("run_dir", type=Path, help="run directory (runs/<name> or job.output_dir)")
    exp.add_argument("--checkpoint", default=None,
                     help="step number of the checkpoint to export (default: the newest)")
    exp.add_argument("--out", type=Path, default=None,
                     help="output folder (default: RUN_DIR/export/paddlenlp)")
    exp.add_argument("--jit", action="store_true",
                     help="also write the paddle.jit.save inference export (RUN_DIR/export)")
    gen = sub.add_parser("generate", help="sample text from a run's model (PaddleNLP generate)")
    gen.add_argument("run_dir", type=Path, help="run directory (runs/<name> or job.output_dir)")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--checkpoint", default=None,
                     help="step number of a checkpoint (default: the end-of-run export, else "
                          "the newest checkpoint)")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--min-new-tokens", type=int, default=0,
                     help="generate at least this many tokens before <eod> may end the sample")
    gen.add_argument("--top-k", type=int, default=8, help="sample from the k likeliest tokens")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    gen.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    gen.add_argument("--json", action="store_true", help="print the sample as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    # A notice during start-up is delivered once our handler is in place. The caller's signal
    # mask and handlers come back on return: an in-process caller (tests, notebooks) must not
    # keep SIGTERM blocked, or worker pools it starts later could never be terminated.
    with signals.restored_on_exit():
        signals.block()
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    quiet_third_party_warnings()
    commands = {"execute": execute, "export": cmd_export, "generate": cmd_generate}
    try:
        return commands[args.command](args)
    except UserError as exc:
        if isinstance(exc, DataError) and not exc.file:
            exc.file = str(args.plan)  # corpus/tokenizer errors name the plan they came from
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status
    except signals.Terminated as exc:
        print(f"stopped by {exc}; nothing since the last checkpoint was lost (run the same "
              "command again to resume)", file=sys.stderr)
        return signals.EXIT_SIGNALLED


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
    if args.node_rank is not None and not 0 <= args.node_rank < plan.parallel.nnodes:
        raise PlanError(f"{args.node_rank} is not a node of this plan; allowed: 0 to "
                        f"{plan.parallel.nnodes - 1} (parallel.nnodes = {plan.parallel.nnodes})",
                        key="--node-rank")
    return plan


def rehearsal_dir(plan: Plan, original: Plan, args) -> Plan:
    """A rehearsal (--max-steps, --local) changes the trajectory, so it trains in its own run
    directory next to the plan's (unless --output-dir says where): the real run's checkpoints
    stay resumable."""
    if args.output_dir is not None or plan.fingerprint() == original.fingerprint():
        return plan
    tags = (["local"] if args.local else []) + \
        ([f"max_steps_{args.max_steps}"] if args.max_steps is not None else [])
    folder = original.run_dir.with_name(f"{original.run_dir.name}.{'-'.join(tags)}")
    changed = describe_differences(original.trajectory(), plan.trajectory())
    print(f"rehearsal in {folder} (the plan's run directory stays untouched); "
          f"changed: {changed}")
    return dataclasses.replace(plan, job=dataclasses.replace(plan.job, output_dir=str(folder)))


def describe_differences(old: dict, new: dict, limit: int = 4) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    parts = [f"{k} {old.get(k, '(none)')!r} -> {new.get(k, '(none)')!r}" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return ", ".join(parts) or "nothing"


def check_paths(plan: Plan, plan_file: Path) -> None:
    """Folders the run writes must be folders (or not exist yet)."""
    for key, value in (("job.output_dir", plan.run_dir), ("job.cache_dir", plan.job.cache_dir)):
        problem = folder_problem(str(value))
        if problem:
            raise PlanError(problem, file=str(plan_file), key=key)


def check_resume(plan: Plan, run_dir: Path, plan_file: Path, *, repair: bool) -> Path | None:
    """The newest checkpoint that verifies, if it belongs to this plan. With `repair`,
    damaged newer ones are moved aside (one line each); a dry run only reports them."""
    root = run_dir / "checkpoints"
    if repair:
        latest = ckpt.resume_point(root)
    else:
        latest = next((f for _, f in reversed(ckpt.complete_checkpoints(root))
                       if ckpt.verify(f) is None), None)
    if latest is None:
        return None
    state = ckpt.read_state(latest)
    if state.get("plan_fingerprint") != plan.fingerprint():
        old = state.get("trajectory")
        what = describe_differences(old, plan.trajectory()) if isinstance(old, dict) else \
            "model, data, schedule or batch settings"
        raise PlanError(f"{latest} was written by a different plan (changed: {what}); rerun "
                        "with --fresh to start over (the old run is kept, renamed), or set "
                        "job.output_dir", file=str(plan_file), key="job.output_dir")
    return latest


def check_budget(plan: Plan, billing, latest: Path | None, plan_file: Path) -> str | None:
    """Before launching: None if one more step (with its checkpoint, start-up and shutdown)
    fits the budget; for a run that already spent it, the line saying so. A run that never
    started and cannot buy one step is bad input (BudgetError)."""
    b = plan.budget
    attempts = billing.attempts
    billed = billing.total_seconds()
    cur = plan.hardware.currency
    if attempts:
        costs = budget_guard.stop_costs(plan, attempts, step_times=[], checkpoint_times=[])
        need = budget_guard.startup_s(attempts) + costs.total_s
        crossed = budget_guard.over_limits(plan, billed_s=billed, needed_s=need)
        if not crossed:
            return None
        step = ckpt.read_state(latest)["step"] if latest is not None else 0
        limits = []
        if "budget.max_cost" in crossed:
            limits.append(f"billed {budget_guard.cost_of_seconds(plan, billed):.4f} {cur} of "
                          f"budget.max_cost {b.max_cost} {b.currency}")
        if "budget.max_hours" in crossed:
            limits.append(f"billed {billed / 3600:.4f} h of budget.max_hours {b.max_hours} h")
        return (f"budget spent: {' and '.join(limits)} (measured); another step with start-up, "
                f"checkpoint and shutdown needs ~{need:.1f} s more (measured); trained "
                f"{step} of {plan.training.max_steps} steps (checkpoint at step {step}); "
                f"raise the limit to continue")
    step_s, how = budget_guard.modelled_step_s(plan)
    if step_s <= 0:
        return None
    crossed = budget_guard.over_limits(plan, billed_s=0.0, needed_s=step_s)
    if "budget.max_cost" in crossed:
        raise BudgetError(f"{b.max_cost} {b.currency} cannot buy one step "
                          f"({budget_guard.cost_of_seconds(plan, step_s):.6g} {cur}, {step_s:.3g} "
                          f"s per step, {how}); raise budget.max_cost",
                          file=str(plan_file), key="budget.max_cost")
    if "budget.max_hours" in crossed:
        raise BudgetError(f"{b.max_hours} h cannot buy one step ({step_s:.3g} s per step, "
                          f"{how}); raise budget.max_hours", file=str(plan_file),
                          key="budget.max_hours")
    return None


def execute(args) -> int:
    from runner.data import prepare_data
    from runner.launch import check_hardware, deadline_hit, forwarded_signals, localize
    from runner.metrics import BillingLog
    from runner.parallel import launch_commands
    from runner.rundir import RunDirLock

    from runner.overrides import load_plan_with

    if args.memory_limit_gb is not None and not 0 < args.memory_limit_gb < float("inf"):
        raise PlanError(f"{args.memory_limit_gb} must be a positive number of GB",
                        key="--memory-limit-gb")
    original, pinned = load_plan_with(args.plan, args.set)  # --set makes the user's plan
    plan = apply_overrides(original, args)
    if args.local:
        from runner.rehearsal import describe, rehearse

        plan, changes = localize(plan)
        rehearsal = rehearse(plan, max_steps_given=args.max_steps is not None,
                             limit_gb=args.memory_limit_gb, pinned=pinned)
        plan = rehearsal.plan
        print("--local: rehearsing on this machine; changed:")
        for change in [*changes, *rehearsal.changes] or ["nothing"]:
            print(f"  {change}")
        for line in describe(rehearsal):
            print(line)
    node_rank = check_node_args(plan, args)
    plan = rehearsal_dir(plan, original, args)
    check_paths(plan, args.plan)
    import paddle  # noqa: F401  (installs Paddle's signal handlers; ours go on top)

    signals.raise_on_signal()
    run_dir = plan.run_dir
    if not (run_dir / "billing.json").exists():  # a new run: refuse before writing anything
        check_budget(plan, BillingLog(run_dir / "billing.json"), None, args.plan)
    lock = None
    if not args.dry_run and node_rank > 0:
        # the other nodes of a multi-node run share node 0's run directory (see README);
        # each holds its own lock, and only node 0 writes checkpoints, billing and reports
        lock = RunDirLock(run_dir, lock_file=f"runner.node{node_rank:02d}.lock").acquire()
    elif not args.dry_run:
        lock = RunDirLock(run_dir).acquire()  # one runner per run directory
        ckpt.remove_incomplete(run_dir / "checkpoints")  # first: they may be what fills the disk
        if args.fresh and any(p.name != "runner.lock" for p in run_dir.iterdir()):
            backup = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}.old")
            os.replace(run_dir, backup)
            old_lock, lock = lock, RunDirLock(run_dir).acquire()
            old_lock.release()
            print(f"--fresh: previous run kept in {backup}")
    latest = check_resume(plan, run_dir, args.plan,
                          repair=not args.dry_run and node_rank == 0)
    # Node 0 bills the whole cluster (price x nnodes x its wall-clock time); other nodes only
    # read the bill for the budget check (one writer: attempts are never counted twice).
    billing = BillingLog(run_dir / "billing.json")

    effective_plan = run_dir / "plan.toml"
    needs_launch = plan.parallel.world_size > 1
    if not args.local and not args.dry_run:
        print_cluster_commands(plan, args)
        check_hardware(plan, node_rank=args.node_rank)
        if plan.parallel.nnodes > 1 and not (args.master or plan.parallel.master):
            raise PlanError(f"the plan spans {plan.parallel.nnodes} nodes; give every node the "
                            "same --master HOST:PORT of node 0 (or set parallel.master)",
                            key="--master")
    if latest is not None and not args.dry_run:
        state = ckpt.read_state(latest)
        if state["step"] >= plan.training.max_steps:
            print(f"already finished: {latest} is at step {state['step']}")
            return report(plan, run_dir, args) if node_rank == 0 else 0
    spent = check_budget(plan, billing, latest, args.plan)
    if spent is not None and not args.dry_run:
        print(spent)
        return 0

    if args.dry_run:
        check_dry_run_memory(plan, args.plan)
    data = prepare_data(plan)
    print(f"data: {data.num_tokens:,} tokens ({data.meta['num_documents']:,} documents, "
          f"{data.meta['tokens_per_character']:.3f} tokens/char, measured) in {data.path}")
    if not plan.training.packing:
        from runner.data import truncation_loss

        lost = truncation_loss(data, plan.training.seq_len)
        if lost > 0:
            print(f"truncation: training.packing = false cuts documents to seq_len + 1 = "
                  f"{plan.training.seq_len + 1} tokens: {lost:.1%} of the corpus tokens are "
                  "never trained on (measured); packing loses none")
    log_dir = attempt_log_dir(run_dir, billing, plan.parallel.nnodes, node_rank)
    commands = launch_commands(plan, plan_path=effective_plan, data_dir=data.path,
                               run_dir=run_dir, log_dir=log_dir, master=args.master)
    if args.dry_run:
        print_cluster_commands(plan, args)
        if needs_launch:
            print("launch command(s) this runner starts:")
            for cmd in commands:
                print(f"  node {cmd.node_rank}: {cmd.render()}")
        return dry_run(plan, data, args.plan)

    if latest is not None:
        print(f"resuming from {latest} (step {ckpt.read_state(latest)['step']})")
    write_plan(plan, effective_plan, header=f"# effective plan of this run (from {args.plan})\n")
    if node_rank == 0:  # global rank 0 (on node 0) is the one that writes checkpoints
        from runner.export import save_run_tokenizer

        save_run_tokenizer(plan, data.meta, run_dir)
        attempt_start = billing.start_attempt()
        deadline = budget_guard.deadline(plan, billed_s=billing.previous_seconds(),
                                         attempt_start=attempt_start)
    else:
        attempt_start, deadline = time.time(), None
    if not needs_launch:
        rc = run_in_process(plan, data.path, run_dir)
    else:
        from runner.rehearsal import rank_memory_limit_bytes
        from runner.supervise import oom_kills, supervised

        limit = rank_memory_limit_bytes(plan, limit_gb=args.memory_limit_gb)
        oom_before = oom_kills()
        rc = run_launched(supervised(commands[node_rank], log_dir / "ranks", limit),
                          run_dir=run_dir, log_dir=log_dir, node_rank=node_rank,
                          verbose=args.verbose, deadline=deadline)
    if node_rank > 0:
        return finish_other_node(plan, run_dir, log_dir, node_rank, rc, since=attempt_start)
    billing.reload()  # rank 0 added its measurements
    billing.touch()
    result = read_result(run_dir, since=attempt_start)
    if result is None and deadline_hit:
        print(f"budget spent during start-up (the ranks had not begun a step): billed "
              f"{billing.total_seconds():.1f} s; trained nothing more; raise the limit to "
              "continue")
        return 0
    if result is None and forwarded_signals:
        print("stopped by a termination signal before the first step; nothing to save",
              file=sys.stderr)
        return signals.EXIT_SIGNALLED
    if result is None:
        disk = disk_full_line(log_dir)
        if disk:
            print(f"error: {disk}", file=sys.stderr)
            return 1
    if result is None and needs_launch:  # which rank died, how, and why (runner.failure)
        from runner.failure import diagnose, render
        from runner.supervise import machine_memory_bytes

        failure = diagnose(plan=plan, status_dir=log_dir / "ranks", log_dir=log_dir,
                           launcher_rc=rc, oom_kills_before=oom_before,
                           oom_kills_after=oom_kills(), machine_bytes=machine_memory_bytes(),
                           local=args.local)
        print(render(failure, log_dir), file=sys.stderr)
        return 1
        tail = last_log_lines(log_dir)
        print(f"training failed (exit {rc}); last lines of the rank logs:\n{tail}",
              file=sys.stderr)
        return 1
    if isinstance(result.get("loop_ended_at"), (int, float)):
        billing.note(shutdown_s=max(0.0, billing.attempts[-1]["last_seen"] -
                                    result["loop_ended_at"]))
    status = report(plan, run_dir, args)
    if result["stop_reason"] == "disk full":
        print(f"error: stopped for lack of disk space in {run_dir / 'checkpoints'} (a "
              f"checkpoint needs ~{result.get('checkpoint_bytes', 0):,} bytes); checkpoint of "
              f"step {result['last_checkpoint_step']} kept; free space and rerun",
              file=sys.stderr)
        return 1
    if result["finished"]:
        from runner.export import export_model, export_pretrained

        print(f"model + tokenizer in PaddleNLP format: {export_pretrained(plan, run_dir)}")
        if args.export:
            print(f"exported for inference (paddle.jit.save): {export_model(plan, run_dir)}")
    interrupted = not result["finished"] and result["stop_reason"].startswith("signal")
    return signals.EXIT_SIGNALLED if interrupted else status


def disk_full_line(log_dir: Path) -> str | None:
    """The one-line disk-full error a rank printed, if that is why it ended."""
    for log in sorted(Path(log_dir).glob("workerlog.*")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("error: no space left"):
                return line[len("error: "):]
    return None


def _run_plan(run_dir: Path) -> Plan:
    plan_file = Path(run_dir) / "plan.toml"
    if not plan_file.is_file():
        raise UserError(f"{plan_file} is missing: {run_dir} is not a run directory (it holds "
                        "the effective plan.toml of a run)", key="RUN_DIR")
    return load_plan(plan_file)


def cmd_export(args) -> int:
    from runner.export import export_model, export_pretrained

    plan = _run_plan(args.run_dir)
    out = export_pretrained(plan, args.run_dir, checkpoint=args.checkpoint, out_dir=args.out)
    print(f"PaddleNLP format (AutoModelForCausalLM / AutoTokenizer.from_pretrained): {out}")
    if args.jit:
        print(f"exported for inference (paddle.jit.save): {export_model(plan, args.run_dir)}")
    return 0


def cmd_generate(args) -> int:
    from runner.export import generate

    for key, value, low in (("--max-new-tokens", args.max_new_tokens, 1),
                            ("--top-k", args.top_k, 1),
                            ("--min-new-tokens", args.min_new_tokens, 0)):
        if value < low:
            raise UserError(f"{value} must be >= {low}", key=key)
    if not args.temperature > 0:
        raise UserError(f"{args.temperature} must be > 0", key="--temperature")
    _run_plan(args.run_dir)
    sample = generate(args.run_dir, prompt=args.prompt, checkpoint=args.checkpoint,
                      max_new_tokens=args.max_new_tokens,
                      min_new_tokens=args.min_new_tokens, top_k=args.top_k,
                      temperature=args.temperature, seed=args.seed)
    if args.json:
        print(json.dumps(sample, ensure_ascii=False, indent=1))
    else:
        print(f"sample from {sample['source']} (top-{sample['top_k']} sampling, seed "
              f"{sample['seed']}, {sample['new_tokens']} new tokens):")
        print(f"  {sample['prompt']}[{sample['continuation']}]")
    return 0


def check_node_args(plan: Plan, args) -> int:
    """This node's rank; --node-rank and --master checked against the plan (exit 2)."""
    nnodes = plan.parallel.nnodes
    node_rank = args.node_rank if args.node_rank is not None else 0
    if not 0 <= node_rank < nnodes:
        raise PlanError(f"{node_rank} is not a node of this plan; allowed: 0..{nnodes - 1} "
                        f"(parallel.nnodes = {nnodes})", key="--node-rank")
    master = args.master or plan.parallel.master
    if master:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise PlanError(f"{master!r} is not host:port (e.g. 10.0.0.1:8090)",
                            key="--master" if args.master else "parallel.master")
    return node_rank


def attempt_log_dir(run_dir: Path, billing, nnodes: int, node_rank: int) -> Path:
    """`logs/attempt_NNN` (one node, numbered like billing.json's attempts), or
    `logs/node_RR/attempt_NNN` on several nodes (each node numbers its own attempts: the
    nodes' disks may be shared or not, and Paddle names rank logs by local rank)."""
    if nnodes == 1:
        return run_dir / "logs" / f"attempt_{len(billing.attempts) + 1:03d}"
    node_dir = run_dir / "logs" / f"node_{node_rank:02d}"
    done = len(list(node_dir.glob("attempt_*"))) if node_dir.is_dir() else 0
    return node_dir / f"attempt_{done + 1:03d}"


def run_launched(command, *, run_dir: Path, log_dir: Path, node_rank: int,
                 verbose: bool, deadline: float | None = None) -> int:
    """Run this node's launcher; by default its output goes to `launcher.log` and the console
    shows only the lines rank 0 means for a person (runner.console)."""
    from runner.console import CONSOLE_ENV, Follower
    from runner.launch import run_group

    log_dir.mkdir(parents=True, exist_ok=True)
    group_file = run_dir / ("launcher.json" if node_rank == 0 else
                            f"launcher.node{node_rank:02d}.json")
    console_file = log_dir / "console.log"
    command = dataclasses.replace(command, env=command.env | {CONSOLE_ENV: str(console_file)})
    if verbose:
        return run_group(command, group_file=group_file, deadline=deadline)
    print(f"launcher and rank logs: {log_dir} (--verbose shows them here)", flush=True)
    console_file.touch()
    with Follower(console_file):
        return run_group(command, log_file=log_dir / "launcher.log", group_file=group_file,
                         deadline=deadline)


def finish_other_node(plan: Plan, run_dir: Path, log_dir: Path, node_rank: int, rc: int, *,
                      since: float) -> int:
    """Node R > 0 reports its own ranks' outcome; billing, metrics, checkpoints and the report
    are node 0's."""
    from runner.train import node_result_file

    path = node_result_file(run_dir, node_rank)
    result = None
    if path.exists() and path.stat().st_mtime >= since:
        result = json.loads(path.read_text())
    if result is None:
        print(f"node {node_rank}: training failed (exit {rc}); last lines of the rank logs:\n"
              f"{last_log_lines(log_dir)}", file=sys.stderr)
        return 1
    status = "finished" if result["finished"] else f"stopped: {result['stop_reason']}"
    print(f"node {node_rank}: {status} after {result['completed_steps']}/"
          f"{result['max_steps']} steps; metrics, checkpoints, billing and the report are "
          f"written by node 0 (into {run_dir} on node 0)")
    interrupted = not result["finished"] and result["stop_reason"].startswith("signal")
    return 143 if interrupted else 0


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


def check_dry_run_memory(plan: Plan, plan_file: Path) -> None:
    """The dry run builds the whole model in fp32 on this machine: refuse sizes it cannot hold
    (checked before data preparation, so bad sizes are one line and nothing is prepared)."""
    from gptplan.modelfacts import parameter_count

    need = parameter_count(plan.model) * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > have / 2:
        raise PlanError(f"{parameter_count(plan.model):,} parameters need {need / 1e9:.3g} GB "
                        f"to build for the dry run; this machine has {have / 1e9:.3g} GB free. "
                        "Check the model.* sizes", file=str(plan_file), key="model")


def dry_run(plan: Plan, data, plan_file: Path) -> int:
    from runner.data import TokenDataset
    from gptplan.modelfacts import parameter_count, training_flops_per_token
    from runner.model import build_model, kernel_choice

    dataset = TokenDataset(data, seq_len=plan.training.seq_len, packing=plan.training.packing)
    check_dry_run_memory(plan, plan_file)
    import paddle

    paddle.set_device("cpu")
    net = build_model(plan.model, dataclasses.replace(plan.parallel, tensor_parallel_degree=1,
                                                      pipeline_parallel_degree=1,
                                                      sequence_parallel=False),
                      seq_len=plan.training.seq_len)
    built = sum(int(p.numel()) for p in net.parameters())
    assert built == parameter_count(plan.model), "parameter formula out of date"
    epochs = plan.training.max_steps * plan.global_batch_size / dataset.num_samples
    print(f"model: {plan.model.family} {built:,} parameters (built), "
          f"{training_flops_per_token(plan.model, plan.training.seq_len):.3g} FLOPs/token")
    kernels = kernel_choice(plan.model, use_flash_attention=plan.training.use_flash_attention,
                            precision=plan.training.precision)
    print("kernels on this machine: " + ", ".join(
        f"{name} {'on' if used else 'off'}" for name, used in kernels.items()))
    print(f"samples: {dataset.num_samples:,} of {plan.training.seq_len} tokens; "
          f"{plan.training.max_steps} steps x {plan.global_batch_size} = {epochs:.2f} epochs")
    print("dry run OK: plan, data and model are valid")
    return 0


def report(plan: Plan, run_dir: Path, args) -> int:
    from runner.metrics import BillingLog
    from runner.report import planned_vs_actual, render
    from gptplan.tomlconf import write_text_atomic

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
