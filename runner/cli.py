"""`runner execute PLAN.toml`: validate, prepare data, launch, account, report.

Bad input ends with one line on stderr and exit status 2; a run stopped by a signal exits 143
(so schedulers see a preemption), a crashed rank exits 1 with the tail of its log.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

from gptplan import quiet_third_party_warnings, userdata
from gptplan.cliargs import OneLineParser
from gptplan.errors import BudgetError, DataError, PlanError, UserError
from gptplan.plan import Plan, load_plan, write_plan
from gptplan.tomlconf import folder_problem
from runner import __version__, ceiling, signals
from runner import budget as budget_guard
from runner import checkpoint as ckpt
from runner.billing import Billing, Heartbeat


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


def _resume_policy_args(ex: argparse.ArgumentParser) -> None:
    """What a resume does with changed data or a diverged loss (refused by default)."""
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
        default=0,
        help="generate at least this many tokens before <eod> may end the sample",
    )
    gen.add_argument("--top-k", type=int, default=8, help="sample from the k likeliest tokens")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    gen.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    gen.add_argument("--json", action="store_true", help="print the sample as JSON")


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
        "execute": lambda a: execute(a, started_at),
        "export": cmd_export,
        "generate": cmd_generate,
    }
    try:
        userdata.apply_flag(args)
        return commands[args.command](args)
    except UserError as exc:
        if isinstance(exc, DataError) and not exc.file:
            exc.file = str(args.plan)  # corpus/tokenizer errors name the plan they came from
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_status
    except signals.Terminated as exc:
        print(
            f"stopped by {exc}; nothing since the last checkpoint was lost (run the same "
            "command again to resume)",
            file=sys.stderr,
        )
        return signals.EXIT_SIGNALLED


def apply_overrides(plan: Plan, args) -> Plan:
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise PlanError(f"{args.max_steps} must be >= 1", key="--max-steps")
        t = dataclasses.replace(
            plan.training,
            max_steps=args.max_steps,
            warmup_steps=min(plan.training.warmup_steps, args.max_steps),
        )
        job = dataclasses.replace(plan.job, target_tokens=0)
        plan = dataclasses.replace(plan, training=t, job=job)
    if args.output_dir is not None:
        plan = dataclasses.replace(
            plan, job=dataclasses.replace(plan.job, output_dir=args.output_dir)
        )
    if args.node_rank is not None and not 0 <= args.node_rank < plan.parallel.nnodes:
        raise PlanError(
            f"{args.node_rank} is not a node of this plan; allowed: 0 to "
            f"{plan.parallel.nnodes - 1} (parallel.nnodes = {plan.parallel.nnodes})",
            key="--node-rank",
        )
    return plan


def rehearsal_dir(plan: Plan, original: Plan, args) -> Plan:
    """A rehearsal (--max-steps, --local) changes the trajectory, so it trains in its own run
    directory next to the plan's (unless --output-dir says where): the real run's checkpoints
    stay resumable."""
    if args.output_dir is not None or plan.fingerprint() == original.fingerprint():
        return plan
    tags = (["local"] if args.local else []) + (
        [f"max_steps_{args.max_steps}"] if args.max_steps is not None else []
    )
    folder = original.run_dir.with_name(f"{original.run_dir.name}.{'-'.join(tags)}")
    changed = describe_differences(original.trajectory(), plan.trajectory())
    print(f"rehearsal in {folder} (the plan's run directory stays untouched); changed: {changed}")
    return dataclasses.replace(plan, job=dataclasses.replace(plan.job, output_dir=str(folder)))


def describe_differences(old: dict, new: dict, limit: int = 4) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    parts = [f"{k} {old.get(k, '(none)')!r} -> {new.get(k, '(none)')!r}" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return ", ".join(parts) or "nothing"


def check_paths(plan: Plan, plan_file: Path) -> None:
    """Folders the run writes must be folders (or not exist yet)."""
    for key, value in (
        ("job.output_dir", plan.run_dir),
        ("job.cache_dir", userdata.cache_dir(plan.job.cache_dir)),
    ):
        problem = folder_problem(str(value))
        if problem:
            raise PlanError(problem, file=str(plan_file), key=key)


def check_resume(
    plan: Plan, run_dir: Path, plan_file: Path, *, repair: bool
) -> tuple[Path | None, dict | None]:
    """The newest checkpoint that verifies and its state, if it belongs to this plan. With
    `repair`, damaged newer ones are moved aside (one line each); a dry run only reports."""
    root = run_dir / "checkpoints"
    if repair:
        latest = ckpt.resume_point(root)
    else:
        latest = next(
            (f for _, f in reversed(ckpt.complete_checkpoints(root)) if ckpt.verify(f) is None),
            None,
        )
    if latest is None:
        return None, None
    state = ckpt.read_state(latest)
    if state.get("plan_fingerprint") != plan.fingerprint():
        old = state.get("trajectory")
        what = (
            describe_differences(old, plan.trajectory())
            if isinstance(old, dict)
            else "model, data, schedule or batch settings"
        )
        raise PlanError(
            f"{latest} was written by a different plan (changed: {what}); rerun "
            "with --fresh to start over (the old run is kept, renamed), or set "
            "job.output_dir",
            file=str(plan_file),
            key="job.output_dir",
        )
    return latest, state


@dataclasses.dataclass
class Execution:
    """What `runner execute` learns, each fact once, handed from step to step."""

    args: argparse.Namespace
    plan: Plan
    pinned: frozenset
    node_rank: int
    started_at: float  # this runner process's start (billed from here)
    lock: object | None = None
    created_run_dir: bool = False
    billing: Billing | None = None
    latest: Path | None = None  # newest verified checkpoint of this plan
    state: dict | None = None  # its state.json, read once
    data: object | None = None
    log_dir: Path | None = None
    commands: list = dataclasses.field(default_factory=list)
    attempt_start: float = 0.0
    deadline: float | None = None
    original: Plan | None = None  # the user's plan (--set applied), before --local fitting
    corpus_problem: str | None = None  # runner.corpuscheck's finding for a dry run
    prep_seconds: float = 0.0  # data preparation (or its cache check) in this attempt

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    @property
    def plan_file(self) -> Path:
        return self.args.plan

    @property
    def needs_launch(self) -> bool:
        return self.plan.parallel.world_size > 1

    @property
    def step(self) -> int:
        return self.state["step"] if self.state else 0


def execute(args, started_at: float | None = None) -> int:
    """`runner execute`, top to bottom; each step is a function below."""
    ex = preflight(args, started_at or time.time())  # every check of the input, in one place
    if args.dry_run:
        return dry_run_steps(ex)
    try:
        take_run_dir(ex)  # lock, leftovers, --fresh, damaged run files moved aside
        read_resume_state(ex)  # newest verified checkpoint and the bill, each read once
        if ex.step >= ex.plan.training.max_steps:
            return finished_run(ex)  # report, and an export that did not happen yet
        spent = check_budget(ex)  # refuses (exit 2) a run that cannot buy one step
        if spent:
            with billed_attempt(ex):  # its seconds are machine time too (flagged as such)
                if ex.node_rank == 0:  # (a node > 0 keeps only its own time)
                    ex.billing.note(budget_check=1)
                print(spent)
            return 0
        with billed_attempt(ex):  # the attempt's record and heartbeat, closed at exit
            try:
                with ceiling.enforced(ex.deadline):  # the budget's deadline, start-up included
                    prepare(ex)  # data, launch commands
                    write_run_files(ex)  # effective plan, tokenizer
                    outcome = launch(ex)  # in this process or launched ranks
            except ceiling.BudgetDeadline:
                return deadline_reached(ex)
            return conclude(ex, outcome)  # diagnose, bill, report, export
    except UserError:
        drop_new_run_dir(ex)
        raise
    finally:
        if ex.lock is not None:
            ex.lock.release()


def preflight(args, started_at: float) -> Execution:
    """Plan, overrides, rehearsal, node and path checks; then Paddle and our signal handlers
    (a notice that came meanwhile is delivered now: exit 143)."""
    from runner.overrides import load_plan_with

    if args.memory_limit_gb is not None and not 0 < args.memory_limit_gb < float("inf"):
        raise PlanError(
            f"{args.memory_limit_gb} must be a positive number of GB", key="--memory-limit-gb"
        )
    original, pinned = load_plan_with(args.plan, args.set)  # --set makes the user's plan
    plan = apply_overrides(original, args)
    if args.local:
        plan = rehearse_locally(plan, args, pinned)
    node_rank = check_node_args(plan, args)
    plan = rehearsal_dir(plan, original, args)
    check_paths(plan, args.plan)
    if not args.local and not args.dry_run:
        check_cluster(plan, args)
    if args.dry_run:
        check_dry_run_memory(plan, args.plan)
    import paddle  # noqa: F401  (installs Paddle's signal handlers; ours go on top)

    signals.raise_on_signal()
    return Execution(args, plan, frozenset(pinned), node_rank, started_at, original=original)


def rehearse_locally(plan: Plan, args, pinned) -> Plan:
    """--local: the plan moved to this machine and fitted to it; each change is listed."""
    from runner.rehearsal import describe, localize, rehearse

    plan, changes = localize(plan)
    rehearsal = rehearse(
        plan,
        max_steps_given=args.max_steps is not None,
        limit_gb=args.memory_limit_gb,
        pinned=pinned,
    )
    print("--local: rehearsing on this machine; changed:")
    for change in [*changes, *rehearsal.changes] or ["nothing"]:
        print(f"  {change}")
    for line in describe(rehearsal):
        print(line)
    return rehearsal.plan


def check_cluster(plan: Plan, args) -> None:
    """A real run: this machine must be (a node of) the planned cluster."""
    from runner.launch import check_hardware

    print_cluster_commands(plan, args)
    check_hardware(plan, node_rank=args.node_rank)
    if plan.parallel.nnodes > 1 and not (args.master or plan.parallel.master):
        raise PlanError(
            f"the plan spans {plan.parallel.nnodes} nodes; give every node the "
            "same --master HOST:PORT of node 0 (or set parallel.master)",
            key="--master",
        )


def take_run_dir(ex: Execution) -> None:
    """One runner per run directory (nodes > 0 hold a lock of their own and write nothing
    but their result: node 0 writes checkpoints, billing and reports)."""
    from runner.rundir import RunDirLock
    from runner.runfiles import check_run_files

    run_dir = ex.run_dir
    if ex.node_rank > 0:
        ex.lock = RunDirLock(run_dir, lock_file=f"runner.node{ex.node_rank:02d}.lock").acquire()
        return
    ex.created_run_dir = not run_dir.exists()
    ex.lock = RunDirLock(run_dir).acquire()
    ckpt.remove_incomplete(run_dir / "checkpoints")  # first: they may be what fills the disk
    if ex.args.fresh and any(p.name != "runner.lock" for p in run_dir.iterdir()):
        backup = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}.old")
        os.replace(run_dir, backup)
        old_lock, ex.lock = ex.lock, RunDirLock(run_dir).acquire()
        old_lock.release()
        print(f"--fresh: previous run kept in {backup}")
    check_run_files(run_dir)


def read_resume_state(ex: Execution) -> None:
    """Node 0 bills the whole cluster (price x nnodes x its wall-clock time) and may repair
    the journal; other nodes only read it for the budget check."""
    writer = ex.node_rank == 0 and not ex.args.dry_run
    ex.latest, ex.state = check_resume(ex.plan, ex.run_dir, ex.plan_file, repair=writer)
    if ex.step < ex.plan.training.max_steps:
        from runner import divergence

        divergence.check_resume(ex.state, ex.latest, ex.run_dir, ignore=ex.args.ignore_divergence)
    ex.billing = Billing(ex.run_dir, repair=writer)
    if ex.billing.notice:
        print(ex.billing.notice)


def drop_new_run_dir(ex: Execution) -> None:
    """Bad input leaves nothing behind: a run directory this runner created and that holds
    only its lock is removed again."""
    if (
        ex.created_run_dir
        and ex.lock is not None
        and all(p.name == "runner.lock" for p in ex.run_dir.iterdir())
    ):
        ex.lock.release()
        ex.lock = None
        shutil.rmtree(ex.run_dir, ignore_errors=True)


def check_budget(ex: Execution) -> str | None:
    """Before anything is launched, for every plan shape: None if start-up, one step, its
    checkpoint and shutdown fit what the budget has left (measured where earlier attempts
    measured, else the stated bounds of runner.budget); else the line saying the budget is
    spent. A run that never billed anything and cannot buy one step is bad input."""
    plan, billing = ex.plan, ex.billing
    billed = billing.total_seconds() + (time.time() - ex.started_at)
    need, how = budget_guard.first_step_need_s(
        plan, billing.attempts, machine_startup_s=ceiling.machine_startup_s(plan)
    )
    crossed = budget_guard.over_limits(plan, billed_s=billed, needed_s=need)
    if not crossed:
        return None
    b, cur = plan.budget, plan.hardware.currency
    if not billing.attempts:
        key = crossed[0]
        limit = f"{b.max_cost} {b.currency}" if key == "budget.max_cost" else f"{b.max_hours} h"
        raise BudgetError(
            f"{limit} cannot buy one step with start-up and shutdown "
            f"({budget_guard.cost_of_seconds(plan, need):.6g} {cur} for "
            f"{need:.3g} s: {how}); raise {key}",
            file=str(ex.plan_file),
            key=key,
        )
    limits = []
    if "budget.max_cost" in crossed:
        limits.append(
            f"billed {budget_guard.cost_of_seconds(plan, billed):.4f} {cur} of "
            f"budget.max_cost {b.max_cost} {b.currency}"
        )
    if "budget.max_hours" in crossed:
        limits.append(f"billed {billed / 3600:.4f} h of budget.max_hours {b.max_hours} h")
    return (
        f"budget spent: {' and '.join(limits)} (measured); another step with start-up, "
        f"checkpoint and shutdown needs ~{need:.1f} s more ({how}); trained {ex.step} of "
        f"{plan.training.max_steps} steps (checkpoint at step {ex.step}); raise the limit "
        "to continue"
    )


@contextlib.contextmanager
def billed_attempt(ex: Execution):
    """Node 0 opens the attempt (from this process's start) before preparing or launching
    anything, and a heartbeat keeps it current until the attempt is closed at exit."""
    if ex.node_rank > 0:  # its own time, in its own journal (runner.billing.journal_paths)
        ex.attempt_start = time.time()
        own = Billing(ex.run_dir, repair=True, node_rank=ex.node_rank)
        own.open_attempt(ex.started_at)
        heartbeat = Heartbeat(own).start()
        try:
            yield
        finally:
            heartbeat.stop()
        return
    ex.attempt_start = ex.billing.open_attempt(ex.started_at)
    ex.deadline = budget_guard.deadline(
        ex.plan, billed_s=ex.billing.previous_seconds(), attempt_start=ex.attempt_start
    )
    heartbeat = Heartbeat(ex.billing).start()
    try:
        yield
    finally:
        heartbeat.stop()


def prepare(ex: Execution) -> None:
    """The data (prepared or verified from the cache) and the launch commands."""
    from runner.corpuscheck import check_before_launch
    from runner.parallel import launch_commands
    from runner.prepare import prepare_data

    plan = ex.plan
    began = time.time()
    ex.data = data = prepare_data(plan)
    ex.prep_seconds = time.time() - began
    print(
        f"data: {data.num_tokens:,} tokens ({data.meta['num_documents']:,} documents, "
        f"{data.meta['tokens_per_character']:.3f} tokens/char, measured) in {data.path}"
    )
    args = ex.args
    from runner.datacache import check_resume_data

    accepted = check_resume_data(
        ex.state, ex.latest, data.path, accept=args.accept_new_data, plan_file=str(args.plan)
    )
    if accepted:
        print(accepted)
    ex.corpus_problem = check_before_launch(
        ex.original or plan,
        data.num_tokens,
        plan_file=args.plan,
        rehearsal=args.local or args.max_steps is not None,
        dry_run=args.dry_run,
    )
    if not plan.training.packing:
        from runner.prepare import truncation_loss

        lost = truncation_loss(data, plan.training.seq_len)
        if lost > 0:
            print(
                f"truncation: training.packing = false cuts documents to seq_len + 1 = "
                f"{plan.training.seq_len + 1} tokens: {lost:.1%} of the corpus tokens are "
                "never trained on (measured); packing loses none"
            )
    ex.log_dir = attempt_log_dir(ex)
    ex.commands = launch_commands(
        plan,
        plan_path=ex.run_dir / "plan.toml",
        data_dir=data.path,
        run_dir=ex.run_dir,
        log_dir=ex.log_dir,
        master=ex.args.master,
    )


def write_run_files(ex: Execution) -> None:
    if ex.latest is not None:
        print(f"resuming from {ex.latest} (step {ex.step})")
    write_plan(
        ex.plan,
        ex.run_dir / "plan.toml",
        header=f"# effective plan of this run (from {ex.plan_file})\n",
    )
    if ex.node_rank == 0:  # global rank 0 (on node 0) is the one that writes checkpoints
        from runner.export import save_run_tokenizer

        save_run_tokenizer(ex.plan, ex.data.meta, ex.run_dir)


@dataclasses.dataclass
class Outcome:
    """How the training group of this attempt ended."""

    rc: int
    group: object | None = None  # runner.launch.GroupResult of launched ranks
    oom_kills_before: int = 0


def launch(ex: Execution) -> Outcome:
    ceiling.injected_delay()  # tests only: a start-up slower than any measured
    if not ex.needs_launch:
        from runner.train import train

        train(
            ex.plan,
            data_dir=ex.data.path,
            run_dir=ex.run_dir,
            ignore_divergence=ex.args.ignore_divergence,
        )
        return Outcome(0)
    from runner.rehearsal import rank_memory_limit_bytes
    from runner.supervise import oom_kills, supervised

    limit = rank_memory_limit_bytes(ex.plan, limit_gb=ex.args.memory_limit_gb)
    before = oom_kills()
    command = ex.commands[ex.node_rank]
    if ex.args.ignore_divergence:
        from runner.divergence import IGNORE_ENV

        command = dataclasses.replace(command, env=command.env | {IGNORE_ENV: "1"})
    group = run_launched(ex, supervised(command, ex.log_dir / "ranks", limit))
    return Outcome(group.rc, group, before)


def conclude(ex: Execution, outcome: Outcome) -> int:
    """The attempt's result: why it failed, or the bill, report and export."""
    from runner.divergence import STOP_DIVERGED, stopped_line
    from runner.train import STOP_DISK, STOP_SIGNAL

    stalled = outcome.group.stalled if outcome.group is not None else None
    if stalled:  # runner.watchdog ended ranks that stopped advancing
        print(stalled, file=sys.stderr)
        return 1
    if ex.node_rank > 0:
        return finish_other_node(ex, outcome.rc)
    # rank 0's measured start-up (runner start to first step): the next pre-launch check of a
    # plan of this shape on this machine knows it (runner.ceiling)
    startup = (Billing(ex.run_dir).attempts or [{}])[-1].get("startup_s")
    ceiling.record_startup(ex.plan, startup, data_prep_s=ex.prep_seconds)
    result = read_result(ex.run_dir, since=ex.attempt_start)
    if result is None:
        return explain_failure(ex, outcome)
    ex.billing.reload()  # rank 0 added its measurements
    if isinstance(result.get("loop_ended_at"), (int, float)):
        ex.billing.note(shutdown_s=max(0.0, time.time() - result["loop_ended_at"]))
    status = report(ex, result)
    if result["stop_reason"] == STOP_DIVERGED:
        print(stopped_line(result, ex.run_dir, ex.billing.total_seconds()), file=sys.stderr)
        return 1
    if result["stop_reason"] == STOP_DISK:
        print(
            f"error: stopped for lack of disk space in {ex.run_dir / 'checkpoints'} (a "
            f"checkpoint needs ~{result.get('checkpoint_bytes', 0):,} bytes); checkpoint of "
            f"step {result['last_checkpoint_step']} kept; free space and rerun",
            file=sys.stderr,
        )
        return 1
    if result["finished"]:
        export(ex)
    interrupted = not result["finished"] and result["stop_reason"] == STOP_SIGNAL
    return signals.EXIT_SIGNALLED if interrupted else status


def explain_failure(ex: Execution, outcome: Outcome) -> int:
    """No result from this attempt: the deadline, a notice, a rank's one-line error, or which
    rank died, how and why (runner.failure)."""
    group = outcome.group
    if group is not None and group.deadline_hit:
        return deadline_reached(ex)
    if group is not None and group.forwarded_signals:
        print(
            "stopped by a termination signal before the first step; nothing to save",
            file=sys.stderr,
        )
        return signals.EXIT_SIGNALLED
    line = rank_error_line(ex.log_dir)
    if line:
        print(line, file=sys.stderr)
        return 1
    from runner.failure import diagnose, render
    from runner.supervise import machine_memory_bytes, oom_kills

    failure = diagnose(
        plan=ex.plan,
        status_dir=ex.log_dir / "ranks",
        log_dir=ex.log_dir,
        launcher_rc=outcome.rc,
        oom_kills_before=outcome.oom_kills_before,
        oom_kills_after=oom_kills(),
        machine_bytes=machine_memory_bytes(),
        local=ex.args.local,
    )
    print(render(failure, ex.log_dir), file=sys.stderr)
    return 1


def deadline_reached(ex: Execution) -> int:
    """The attempt reached the budget's deadline before its ranks stopped themselves (most
    often a start-up slower than the one the pre-launch check assumed): it was ended; what it
    ran is billed, within the budget; steps since the last checkpoint are not kept."""
    ran = time.time() - ex.attempt_start
    started = (Billing(ex.run_dir).attempts or [{}])[-1].get("startup_s") is not None
    if not started:  # start-up takes at least this long: the next check knows
        ex.billing.note(startup_s=ran)
    where = "while training" if started else "during start-up"
    print(
        f"budget spent {where} ({ran:.1f} s after the runner started): ended at the budget's "
        f"deadline; billed {ex.billing.total_seconds():.1f} s; "
        f"{'the steps since the last checkpoint are lost' if started else 'trained nothing'}; "
        "raise the limit to continue"
    )
    return 0


def finished_run(ex: Execution) -> int:
    """A rerun of a finished run: its report (result.json rebuilt if it was lost), and the
    PaddleNLP export if the one after training did not happen (a full disk, a kill)."""
    print(f"already finished: {ex.latest} is at step {ex.step}")
    if ex.node_rank > 0:
        return 0
    status = report(ex, None)
    export(ex, only_if_missing=True)
    return status


def export(ex: Execution, *, only_if_missing: bool = False) -> None:
    from runner.export import PRETRAINED_DIR, export_model, export_pretrained

    marker = ex.run_dir / PRETRAINED_DIR / "gptplan_checkpoint.txt"
    found = ckpt.complete_checkpoints(ex.run_dir / "checkpoints")
    newest = found[-1][1].name if found else None
    done = marker.is_file() and marker.read_text(errors="replace").strip() == newest
    if only_if_missing and done:
        return
    path = export_pretrained(ex.plan, ex.run_dir)
    retried = " (retried: the export after training had not happened)" if only_if_missing else ""
    print(f"model + tokenizer in PaddleNLP format: {path}{retried}")
    if ex.args.export:
        print(f"exported for inference (paddle.jit.save): {export_model(ex.plan, ex.run_dir)}")


def rank_error_line(log_dir: Path) -> str | None:
    """The one-line error a rank printed (disk full, run directory not writable), if that is
    why it ended."""
    for log in sorted(Path(log_dir).glob("workerlog.*")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("error: ") and (
                "no space left" in line or "is not writable" in line
            ):
                return line
    return None


def dry_run_steps(ex: Execution) -> int:
    """--dry-run: every check a run makes, the data prepared, the commands printed, the model
    built; nothing written into the run directory."""
    read_resume_state(ex)
    spent = check_budget(ex)
    if spent:
        print(spent)
    prepare(ex)
    print_cluster_commands(ex.plan, ex.args)
    if ex.needs_launch:
        print("launch command(s) this runner starts:")
        for cmd in ex.commands:
            print(f"  node {cmd.node_rank}: {cmd.render()}")
    return dry_run(ex.plan, ex.data, ex.plan_file, corpus_problem=ex.corpus_problem)


def _run_plan(run_dir: Path) -> Plan:
    plan_file = Path(run_dir) / "plan.toml"
    if not plan_file.is_file():
        raise UserError(
            f"{plan_file} is missing: {run_dir} is not a run directory (it holds "
            "the effective plan.toml of a run)",
            key="RUN_DIR",
        )
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

    for key, value, low in (
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--top-k", args.top_k, 1),
        ("--min-new-tokens", args.min_new_tokens, 0),
    ):
        if value < low:
            raise UserError(f"{value} must be >= {low}", key=key)
    if not args.temperature > 0:
        raise UserError(f"{args.temperature} must be > 0", key="--temperature")
    _run_plan(args.run_dir)
    sample = generate(
        args.run_dir,
        prompt=args.prompt,
        checkpoint=args.checkpoint,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        top_k=args.top_k,
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


def check_node_args(plan: Plan, args) -> int:
    """This node's rank; --node-rank and --master checked against the plan (exit 2)."""
    nnodes = plan.parallel.nnodes
    node_rank = args.node_rank if args.node_rank is not None else 0
    if not 0 <= node_rank < nnodes:
        raise PlanError(
            f"{node_rank} is not a node of this plan; allowed: 0..{nnodes - 1} "
            f"(parallel.nnodes = {nnodes})",
            key="--node-rank",
        )
    master = args.master or plan.parallel.master
    if master:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise PlanError(
                f"{master!r} is not host:port (e.g. 10.0.0.1:8090)",
                key="--master" if args.master else "parallel.master",
            )
    return node_rank


def attempt_log_dir(ex: Execution) -> Path:
    """`logs/attempt_NNN` (one node, numbered like the bill's attempts), or
    `logs/node_RR/attempt_NNN` on several nodes (each node numbers its own attempts: the
    nodes' disks may be shared or not, and Paddle names rank logs by local rank)."""
    if ex.plan.parallel.nnodes == 1:  # (a dry run has opened no attempt)
        number = len(ex.billing.attempts) + (0 if ex.attempt_start else 1)
        logs = ex.run_dir / "logs"
        while (logs / f"attempt_{number:03d}").exists():  # a bill rebuilt from file times
            number += 1
        return logs / f"attempt_{number:03d}"
    node_dir = ex.run_dir / "logs" / f"node_{ex.node_rank:02d}"
    done = len(list(node_dir.glob("attempt_*"))) if node_dir.is_dir() else 0
    return node_dir / f"attempt_{done + 1:03d}"


def run_launched(ex: Execution, command):
    """Run this node's launcher; by default its output goes to `launcher.log` and the console
    shows only the lines rank 0 means for a person (runner.console)."""
    from runner.console import CONSOLE_ENV, Follower
    from runner.launch import run_group

    log_dir, node_rank = ex.log_dir, ex.node_rank
    log_dir.mkdir(parents=True, exist_ok=True)
    group_file = ex.run_dir / (
        "launcher.json" if node_rank == 0 else f"launcher.node{node_rank:02d}.json"
    )
    console_file = log_dir / "console.log"
    command = dataclasses.replace(command, env=command.env | {CONSOLE_ENV: str(console_file)})
    from runner.watchdog import Watchdog

    watch = dict(
        group_file=group_file,
        deadline=ex.deadline,
        watchdog=Watchdog.for_plan(
            ex.plan,
            status_dir=log_dir / "ranks",
            log_dir=log_dir,
            node_rank=node_rank,
            master=ex.args.master,
            attempts=ex.billing.attempts,
        ),
    )
    if ex.args.verbose:
        return run_group(command, **watch)
    print(f"launcher and rank logs: {log_dir} (--verbose shows them here)", flush=True)
    console_file.touch()
    with Follower(console_file):
        return run_group(command, log_file=log_dir / "launcher.log", **watch)


def finish_other_node(ex: Execution, rc: int) -> int:
    """Node R > 0 reports its own ranks' outcome; billing, metrics, checkpoints and the report
    are node 0's."""
    from runner.train import STOP_SIGNAL, node_result_file

    node_rank = ex.node_rank
    path = node_result_file(ex.run_dir, node_rank)
    result = read_json(path) if path.exists() and path.stat().st_mtime >= ex.attempt_start else None
    if result is None:
        print(
            f"node {node_rank}: training failed (exit {rc}); last lines of the rank logs:\n"
            f"{last_log_lines(ex.log_dir)}",
            file=sys.stderr,
        )
        return 1
    status = "finished" if result["finished"] else f"stopped: {result['stop_reason']}"
    print(
        f"node {node_rank}: {status} after {result['completed_steps']}/"
        f"{result['max_steps']} steps; metrics, checkpoints, billing and the report are "
        f"written by node 0 (into {ex.run_dir} on node 0)"
    )
    if result["stop_reason"] == "loss diverged":  # runner.divergence: node 0 says more
        return 1
    interrupted = not result["finished"] and result["stop_reason"] == STOP_SIGNAL
    return signals.EXIT_SIGNALLED if interrupted else 0


def read_json(path: Path) -> dict | None:
    """A JSON object the run wrote, or None if it is not one (a torn or garbled file)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_result(run_dir: Path, *, since: float) -> dict | None:
    """The result rank 0 wrote in this attempt, or None if the attempt crashed before that."""
    path = run_dir / "result.json"
    if not path.is_file() or path.stat().st_mtime < since:
        return None
    return read_json(path)


def print_cluster_commands(plan: Plan, args) -> None:
    """What to type on each node of the planned cluster."""
    p = plan.parallel
    if p.nnodes == 1:
        print(
            f"on the planned machine ({p.nproc_per_node} x {plan.hardware.device}, "
            f"{plan.hardware.profile}): runner execute {args.plan}"
        )
        return
    print(
        f"on each of the {p.nnodes} planned nodes ({p.nproc_per_node} x "
        f"{plan.hardware.device} each, {plan.hardware.profile}):"
    )
    master = args.master or p.master or "<NODE0_IP>:8090"
    for node in range(p.nnodes):
        print(f"  node {node}: runner execute {args.plan} --node-rank {node} --master {master}")


def check_dry_run_memory(plan: Plan, plan_file: Path) -> None:
    """The dry run builds the whole model in fp32 on this machine: refuse sizes it cannot hold
    (checked before data preparation, so bad sizes are one line and nothing is prepared)."""
    from gptplan.modelfacts import parameter_count

    need = parameter_count(plan.model) * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > have / 2:
        raise PlanError(
            f"{parameter_count(plan.model):,} parameters need {need / 1e9:.3g} GB "
            f"to build for the dry run; this machine has {have / 1e9:.3g} GB free. "
            "Check the model.* sizes",
            file=str(plan_file),
            key="model",
        )


def check_partial_recompute(plan: Plan, net, keep: list[int]) -> tuple[bool, str]:
    """The dry run's check of partial recompute (parallel.recompute_layers): the built model
    recomputes exactly the planned layers. (ok, the line to print; '' without it)."""
    from runner.model import recomputed_layers_of

    if not plan.parallel.recompute_layers or plan.parallel.recompute == "none":
        return True, ""
    L = plan.model.num_hidden_layers
    want = [i for i in range(L) if i not in keep]
    got = recomputed_layers_of(net, plan.model.family)
    if got != want:
        return False, f"the built model recomputes layers {got}, the plan {want}"
    return True, (
        f"recompute: {plan.parallel.recompute} on {len(want)} of {L} layers (PaddleNLP "
        f"no_recompute_layers holds the other {len(keep)}; checked on the built model)"
    )


def dry_run(plan: Plan, data, plan_file: Path, *, corpus_problem: str | None = None) -> int:
    from gptplan.modelfacts import parameter_count, training_flops_per_token
    from gptplan.plan import no_recompute_layers
    from runner.batches import TokenDataset
    from runner.model import build_model, kernel_choice

    dataset = TokenDataset(data, seq_len=plan.training.seq_len, packing=plan.training.packing)
    check_dry_run_memory(plan, plan_file)
    import paddle

    paddle.set_device("cpu")
    keep = no_recompute_layers(plan.model, plan.parallel)
    net = build_model(
        plan.model,
        dataclasses.replace(
            plan.parallel,
            tensor_parallel_degree=1,
            pipeline_parallel_degree=1,
            sequence_parallel=False,
        ),
        seq_len=plan.training.seq_len,
        no_recompute=keep,
    )
    ok, words = check_partial_recompute(plan, net, keep)
    if not ok:
        print(
            f"error: {plan_file}: parallel.recompute_layers: {words} (dry run FAILED)",
            file=sys.stderr,
        )
        return 2
    if words:
        print(words)
    built = sum(int(p.numel()) for p in net.parameters())
    assert built == parameter_count(plan.model), "parameter formula out of date"
    epochs = plan.training.max_steps * plan.global_batch_size / dataset.num_samples
    print(
        f"model: {plan.model.family} {built:,} parameters (built), "
        f"{training_flops_per_token(plan.model, plan.training.seq_len):.3g} FLOPs/token"
    )
    kernels = kernel_choice(
        plan.model,
        use_flash_attention=plan.training.use_flash_attention,
        precision=plan.training.precision,
    )
    print(
        "kernels on this machine: "
        + ", ".join(f"{name} {'on' if used else 'off'}" for name, used in kernels.items())
    )
    print(
        f"samples: {dataset.num_samples:,} of {plan.training.seq_len} tokens; "
        f"{plan.training.max_steps} steps x {plan.global_batch_size} = {epochs:.2f} epochs"
    )
    if corpus_problem:  # runner.corpuscheck: a full run would refuse this corpus
        print(f"error: {plan_file}: job.corpus: {corpus_problem} (dry run FAILED)", file=sys.stderr)
        return 2
    print("dry run OK: plan, data and model are valid")
    return 0


def report(ex: Execution, result: dict | None) -> int:
    """Planned vs actual (runner.report) from this attempt's result, or from result.json of a
    finished run (rebuilt from the newest checkpoint when it was lost)."""
    from gptplan.tomlconf import write_text_atomic
    from runner.report import planned_vs_actual, render

    billed = ex.billing.total_seconds()
    result_file = ex.run_dir / "result.json"
    if result is None:
        result = read_json(result_file)
    if result is None and ex.state is not None:
        from runner.runfiles import rebuild_result

        result = rebuild_result(
            ex.plan,
            ex.run_dir,
            ex.state,
            billed_seconds=billed,
            checkpoint_bytes=ckpt.checkpoint_bytes(ex.latest),
        )
        write_text_atomic(result_file, json.dumps(result, indent=1))
        print(f"{result_file} rebuilt from {ex.latest.name} and metrics.jsonl (measured)")
    if result is None:
        print("no result.json: the run ended before its first step", file=sys.stderr)
        return 1
    data = planned_vs_actual(ex.plan, result, billed)
    write_text_atomic(ex.run_dir / "report.json", json.dumps(data, indent=1))
    print(json.dumps(data, indent=1) if ex.args.json else render(data))
    return 0


def last_log_lines(log_dir: Path, lines: int = 15) -> str:
    chunks = []
    for log in sorted(Path(log_dir).glob("workerlog.*")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        chunks.append(f"--- {log}\n" + "\n".join(text))
    return "\n".join(chunks) or f"(no logs in {log_dir})"


if __name__ == "__main__":
    sys.exit(main())
