"""`runner execute`, top to bottom (runner.cli parses the command line into an ExecuteRequest).

Each step is a function below (runner.preflight checks the input, runner.budget holds the
budget policy, runner.conclude turns an attempt's end into an exit status); the records they
hand on are in runner.execution, each frozen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from gptplan.errors import UserError
from gptplan.plan import write_plan
from runner import ceiling
from runner import checkpoint as ckpt
from runner.billing import Billing
from runner.budget import Attempt, billed_attempt, check_budget
from runner.conclude import conclude, deadline_reached, finished_run
from runner.datacache import PreparedData
from runner.dryrun import dry_run
from runner.execution import ExecuteRequest, Outcome, Prepared, Resume, Run
from runner.launch import GroupResult
from runner.parallel import LaunchCommand
from runner.preflight import check_resume, preflight, print_cluster_commands
from runner.rundir import RunDirLock


def execute(request: ExecuteRequest) -> int:
    """`runner execute`, top to bottom; each step is a function below."""
    run = preflight(request)  # every check of the input, in one place
    if request.dry_run:
        return dry_run_steps(run)
    with claimed_run_dir(run):  # lock, leftovers, --fresh, damaged run files moved aside
        resume = read_resume_state(run)  # newest verified checkpoint and the bill, read once
        if resume.step >= run.plan.training.max_steps:
            with open_attempt(run, resume) as attempt:  # billed if it does work, else idle
                return finished_run(run, resume, attempt)  # report, an export not done yet
        spent = budget_check(run, resume)  # refuses (exit 2) a run that cannot buy one step
        if spent:
            with open_attempt(run, resume) as attempt:  # kept, flagged, not billed
                if attempt.journal is not None:
                    attempt.journal.note(budget_check=1)
                print(spent)
            return 0
        with open_attempt(run, resume) as attempt:  # its record and heartbeat, closed at exit
            try:
                with ceiling.enforced(attempt.deadline):  # the budget's deadline, start-up too
                    prepared = prepare(run, resume, attempt)  # data, launch commands
                    write_run_files(run, resume, prepared)  # effective plan, tokenizer
                    outcome = launch(run, resume, prepared, attempt)  # here, or ranks
            except ceiling.BudgetDeadline:
                return deadline_reached(run, resume.billing, attempt)
            return conclude(run, resume, attempt, prepared, outcome)  # diagnose, bill, report


def budget_check(run: Run, resume: Resume) -> str | None:
    """runner.budget.check_budget for this run: None, or the line saying the budget is spent."""
    return check_budget(
        run.plan,
        resume.billing,
        started_at=run.request.started_at,
        step=resume.step,
        plan_file=run.plan_file,
    )


def open_attempt(run: Run, resume: Resume) -> contextlib.AbstractContextManager[Attempt]:
    """runner.budget.billed_attempt for this run: the attempt opened in the bill, with its
    heartbeat, closed at exit."""
    return billed_attempt(
        run.plan, resume.billing, node_rank=run.node_rank, started_at=run.request.started_at
    )


@contextlib.contextmanager
def claimed_run_dir(run: Run) -> Iterator[None]:
    """One runner per run directory (nodes > 0 hold a lock of their own and write nothing
    but their result: node 0 writes checkpoints, billing and reports). Released at exit; bad
    input leaves nothing behind: a run directory this runner created and that holds only its
    lock is removed again."""
    from runner.runfiles import check_run_files

    run_dir = run.run_dir
    if run.node_rank > 0:
        with RunDirLock(run_dir, lock_file=f"runner.node{run.node_rank:02d}.lock"):
            yield
        return
    created = not run_dir.exists()
    lock = RunDirLock(run_dir).acquire()
    try:
        ckpt.remove_incomplete(run_dir / "checkpoints")  # first: they may be what fills the disk
        if run.request.fresh and any(p.name != "runner.lock" for p in run_dir.iterdir()):
            lock = keep_old_run(run_dir, lock)
        check_run_files(run_dir)
        yield
    except UserError:
        if created and all(p.name == "runner.lock" for p in run_dir.iterdir()):
            lock.release()
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        lock.release()


def keep_old_run(run_dir: Path, lock: RunDirLock) -> RunDirLock:
    """--fresh: the previous run renamed aside; the lock of the new, empty run directory."""
    backup = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}.old")
    os.replace(run_dir, backup)
    new_lock = RunDirLock(run_dir).acquire()
    lock.release()
    print(f"--fresh: previous run kept in {backup}")
    return new_lock


def read_resume_state(run: Run) -> Resume:
    """Node 0 bills the whole cluster (price x nnodes x its wall-clock time) and may repair
    the journal; other nodes only read it for the budget check."""
    writer = run.node_rank == 0 and not run.request.dry_run
    latest, state = check_resume(
        run.plan,
        run.run_dir,
        run.plan_file,
        repair=writer,
        trust_pickled=run.request.trust_pickled_checkpoint,
    )
    step = int(state["step"]) if state else 0
    if step < run.plan.training.max_steps:
        from runner import divergence

        divergence.check_resume(state, latest, run.run_dir, ignore=run.request.ignore_divergence)
    billing = Billing(run.run_dir, repair=writer, nnodes=run.plan.parallel.nnodes)
    if billing.notice:
        print(billing.notice)
    return Resume(latest, state, billing)


def dry_run_steps(run: Run) -> int:
    """--dry-run: every check a run makes, the data prepared, the commands printed, the model
    built; nothing written into the run directory."""
    resume = read_resume_state(run)
    spent = budget_check(run, resume)
    if spent:
        print(spent)
    prepared = prepare(run, resume, None)
    print_cluster_commands(run.plan, run.request)
    if run.needs_launch:
        print("launch command(s) this runner starts:")
        for cmd in prepared.commands:
            print(f"  node {cmd.node_rank}: {cmd.render()}")
    return dry_run(run.plan, prepared.data, run.plan_file, corpus_problem=prepared.corpus_problem)


def prepare(run: Run, resume: Resume, attempt: Attempt | None) -> Prepared:
    """The data (prepared or verified from the cache) and the launch commands (`attempt`:
    None in a dry run, which opens none)."""
    from runner.corpuscheck import check_before_launch
    from runner.datacache import check_resume_data
    from runner.parallel import launch_commands
    from runner.prepare import prepare_data

    plan, request = run.plan, run.request
    began = time.time()
    data = prepare_data(plan)
    prep_seconds = time.time() - began
    print(
        f"data: {data.num_tokens:,} tokens ({data.meta['num_documents']:,} documents, "
        f"{data.meta['tokens_per_character']:.3f} tokens/char, measured) in {data.path}"
    )
    accepted = check_resume_data(
        resume.state,
        resume.latest,
        data.path,
        accept=request.accept_new_data,
        plan_file=str(request.plan_file),
    )
    if accepted:
        print(accepted)
    corpus_problem = check_before_launch(
        run.original,
        data.num_tokens,
        plan_file=request.plan_file,
        rehearsal=request.local or request.max_steps is not None,
        dry_run=request.dry_run,
    )
    if not plan.training.packing:
        print_truncation(run, data)
    log_dir = attempt_log_dir(run, resume.billing, opened=attempt is not None)
    commands = launch_commands(
        plan,
        plan_path=run.run_dir / "plan.toml",
        data_dir=data.path,
        run_dir=run.run_dir,
        log_dir=log_dir,
        master=request.master,
    )
    return Prepared(data, log_dir, tuple(commands), corpus_problem, prep_seconds)


def print_truncation(run: Run, data: PreparedData) -> None:
    """Without packing, the share of the corpus a run never trains on (measured)."""
    from runner.prepare import truncation_loss

    seq_len = run.plan.training.seq_len
    lost = truncation_loss(data, seq_len)
    if lost > 0:
        print(
            f"truncation: training.packing = false cuts documents to seq_len + 1 = "
            f"{seq_len + 1} tokens: {lost:.1%} of the corpus tokens are "
            "never trained on (measured); packing loses none"
        )


def attempt_log_dir(run: Run, billing: Billing, *, opened: bool) -> Path:
    """`logs/attempt_NNN` (one node, numbered like the bill's attempts), or
    `logs/node_RR/attempt_NNN` on several nodes (each node numbers its own attempts: the
    nodes' disks may be shared or not, and Paddle names rank logs by local rank). `opened`:
    the bill holds this attempt already (a dry run has opened none)."""
    if run.plan.parallel.nnodes == 1:
        number = len(billing.attempts) + (0 if opened else 1)
        logs = run.run_dir / "logs"
        while (logs / f"attempt_{number:03d}").exists():  # a bill rebuilt from file times
            number += 1
        return logs / f"attempt_{number:03d}"
    node_dir = run.run_dir / "logs" / f"node_{run.node_rank:02d}"
    done = len(list(node_dir.glob("attempt_*"))) if node_dir.is_dir() else 0
    return node_dir / f"attempt_{done + 1:03d}"


def write_run_files(run: Run, resume: Resume, prepared: Prepared) -> None:
    if resume.latest is not None:
        print(f"resuming from {resume.latest} (step {resume.step})")
    write_plan(
        run.plan,
        run.run_dir / "plan.toml",
        header=f"# effective plan of this run (from {run.plan_file})\n",
    )
    if run.node_rank == 0:  # global rank 0 (on node 0) is the one that writes checkpoints
        from runner.export import save_run_tokenizer

        save_run_tokenizer(run.plan, prepared.data.meta, run.run_dir)


def launch(run: Run, resume: Resume, prepared: Prepared, attempt: Attempt) -> Outcome:
    ceiling.injected_delay()  # tests only: a start-up slower than any measured
    if not run.needs_launch:
        from runner.train import train

        train(
            run.plan,
            data_dir=prepared.data.path,
            run_dir=run.run_dir,
            ignore_divergence=run.request.ignore_divergence,
        )
        return Outcome(0)
    from runner.rehearsal import rank_memory_limit_bytes
    from runner.supervise import oom_kills, supervised

    limit = rank_memory_limit_bytes(run.plan, limit_gb=run.request.memory_limit_gb)
    before = oom_kills()
    command = prepared.commands[run.node_rank]
    if run.request.ignore_divergence:
        from runner.divergence import IGNORE_ENV

        command = dataclasses.replace(command, env=command.env | {IGNORE_ENV: "1"})
    supervised_command = supervised(command, prepared.log_dir / "ranks", limit)
    group = run_launched(run, resume, prepared, attempt, supervised_command)
    return Outcome(group.rc, group, before)


def run_launched(
    run: Run, resume: Resume, prepared: Prepared, attempt: Attempt, command: LaunchCommand
) -> GroupResult:
    """Run this node's launcher; by default its output goes to `launcher.log` and the console
    shows only the lines rank 0 means for a person (runner.console)."""
    from runner.console import CONSOLE_ENV, Follower
    from runner.launch import run_group
    from runner.watchdog import Watchdog

    log_dir, node_rank = prepared.log_dir, run.node_rank
    log_dir.mkdir(parents=True, exist_ok=True)
    group_file = run.run_dir / (
        "launcher.json" if node_rank == 0 else f"launcher.node{node_rank:02d}.json"
    )
    console_file = log_dir / "console.log"
    command = dataclasses.replace(command, env=command.env | {CONSOLE_ENV: str(console_file)})
    watchdog = Watchdog.for_plan(
        run.plan,
        status_dir=log_dir / "ranks",
        log_dir=log_dir,
        node_rank=node_rank,
        master=run.request.master,
        attempts=resume.billing.attempts,
    )
    if run.request.verbose:
        return run_group(
            command, group_file=group_file, deadline=attempt.deadline, watchdog=watchdog
        )
    print(f"launcher and rank logs: {log_dir} (--verbose shows them here)", flush=True)
    console_file.touch()
    with Follower(console_file):
        return run_group(
            command,
            log_file=log_dir / "launcher.log",
            group_file=group_file,
            deadline=attempt.deadline,
            watchdog=watchdog,
        )
