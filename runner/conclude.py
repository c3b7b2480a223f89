"""`runner execute`'s last step: an attempt's end turned into an exit status (runner.execute).

The result rank 0 wrote, or why there is none (the budget's deadline, a notice, a rank's
one-line error, runner.failure's diagnosis); the bill, the report (runner.report) and the
export of a finished run. Exit 0 done, 1 a failed or diverged run, 143 stopped by a signal.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runner import ceiling, signals
from runner import checkpoint as ckpt
from runner.billing import Billing
from runner.budget import Attempt
from runner.execution import Outcome, Prepared, Resume, Run


def conclude(
    run: Run, resume: Resume, attempt: Attempt, prepared: Prepared, outcome: Outcome
) -> int:
    """The attempt's result: why it failed, or the bill, report and export."""
    from runner.divergence import STOP_DIVERGED, stopped_line
    from runner.train import STOP_DISK, STOP_SIGNAL

    stalled = outcome.group.stalled if outcome.group is not None else None
    if stalled:  # runner.watchdog ended ranks that stopped advancing
        print(stalled, file=sys.stderr)
        return 1
    if run.node_rank > 0:
        return finish_other_node(run, attempt, prepared.log_dir, outcome.rc)
    # rank 0's measured start-up (runner start to first step): the next pre-launch check of a
    # plan of this shape on this machine knows it (runner.ceiling)
    startup = (Billing(run.run_dir).attempts or [{}])[-1].get("startup_s")
    ceiling.record_startup(run.plan, startup, data_prep_s=prepared.prep_seconds)
    result = read_result(run.run_dir, since=attempt.start)
    if result is None:
        return explain_failure(run, resume.billing, attempt, prepared, outcome)
    billing = resume.billing
    billing.reload()  # rank 0 added its measurements
    if isinstance(result.get("loop_ended_at"), (int, float)):
        billing.note(shutdown_s=max(0.0, time.time() - result["loop_ended_at"]))
    status = report(run, resume, result)
    if result["stop_reason"] == STOP_DIVERGED:
        print(stopped_line(result, run.run_dir, billing.total_seconds()), file=sys.stderr)
        return 1
    if result["stop_reason"] == STOP_DISK:
        print(
            f"error: stopped for lack of disk space in {run.run_dir / 'checkpoints'} (a "
            f"checkpoint needs ~{result.get('checkpoint_bytes', 0):,} bytes); checkpoint of "
            f"step {result['last_checkpoint_step']} kept; free space and rerun",
            file=sys.stderr,
        )
        return 1
    if result["finished"]:
        within_budget(attempt, "the export after training", lambda: export(run))
    interrupted = not result["finished"] and result["stop_reason"] == STOP_SIGNAL
    return signals.EXIT_SIGNALLED if interrupted else status


def explain_failure(
    run: Run, billing: Billing, attempt: Attempt, prepared: Prepared, outcome: Outcome
) -> int:
    """No result from this attempt: the deadline, a notice, a rank's one-line error, or which
    rank died, how and why (runner.failure)."""
    group = outcome.group
    if group is not None and group.deadline_hit:
        return deadline_reached(run, billing, attempt)
    if group is not None and group.forwarded_signals:
        print(
            "stopped by a termination signal before the first step; nothing to save",
            file=sys.stderr,
        )
        return signals.EXIT_SIGNALLED
    log_dir = prepared.log_dir
    line = rank_error_line(log_dir)
    if line:
        print(line, file=sys.stderr)
        return 1
    from runner.failure import diagnose, render
    from runner.supervise import machine_memory_bytes, oom_kills

    failure = diagnose(
        plan=run.plan,
        status_dir=log_dir / "ranks",
        log_dir=log_dir,
        launcher_rc=outcome.rc,
        oom_kills_before=outcome.oom_kills_before,
        oom_kills_after=oom_kills(),
        machine_bytes=machine_memory_bytes(),
        local=run.request.local,
    )
    print(render(failure, log_dir), file=sys.stderr)
    return 1


def deadline_reached(run: Run, billing: Billing, attempt: Attempt) -> int:
    """The attempt reached the budget's deadline before its ranks stopped themselves (most
    often a start-up slower than the one the pre-launch check assumed): it was ended; what it
    ran is billed, within the budget; steps since the last checkpoint are not kept."""
    ran = time.time() - attempt.start
    started = (Billing(run.run_dir).attempts or [{}])[-1].get("startup_s") is not None
    if not started:  # start-up takes at least this long: the next check knows
        billing.note(startup_s=ran)
    where = "while training" if started else "during start-up"
    print(
        f"budget spent {where} ({ran:.1f} s after the runner started): ended at the budget's "
        f"deadline; billed {billing.total_seconds():.1f} s; "
        f"{'the steps since the last checkpoint are lost' if started else 'trained nothing'}; "
        "raise the limit to continue"
    )
    return 0


def finished_run(run: Run, resume: Resume, attempt: Attempt) -> int:
    """A rerun of a finished run: its report (result.json rebuilt if it was lost), and the
    PaddleNLP export if the one after training did not happen (a full disk, a kill). Its
    attempt is kept but not billed (`idle`) unless it does work (runner.billing)."""
    if attempt.journal is not None:
        attempt.journal.note(idle=1)
    print(f"already finished: {resume.latest} is at step {resume.step}")
    if run.node_rank > 0:
        return 0
    status = report(run, resume, None)
    if not export_done(run):
        within_budget(attempt, "the export", lambda: export(run, only_if_missing=True))
    return status


def within_budget(attempt: Attempt, what: str, work: Callable[[], object]) -> None:
    """Work after training (an export, a retried one): billed (`work` in the bill) and held to
    the attempt's budget deadline (runner.ceiling), so that the billed total stays within the
    budget: not started when the budget is spent, ended at the deadline; one line says so."""
    if attempt.deadline is not None and time.time() >= attempt.deadline:
        print(
            f"budget spent: {what} was not done; raise the limit and rerun, or run "
            "`runner export RUN_DIR` (not billed by the runner)"
        )
        return
    if attempt.journal is not None:
        attempt.journal.note(work=1)
    try:
        with ceiling.enforced(attempt.deadline):
            work()
    except ceiling.BudgetDeadline:
        print(
            f"budget spent during {what}: ended at the budget's deadline; its files are "
            "redone by the next run; raise the limit and rerun, or run `runner export RUN_DIR`"
        )


def export_done(run: Run) -> bool:
    """Every export this run asks for is whole and verified for the newest checkpoint, and a
    killed export left nothing behind (runner.export's records)."""
    from runner.export import PRETRAINED_DIR, verified_export, verified_jit

    found = ckpt.complete_checkpoints(run.run_dir / "checkpoints")
    newest = found[-1][1].name if found else None
    export_dir = run.run_dir / "export"
    leftovers = export_dir.is_dir() and any(
        c.name.startswith((".paddlenlp.", ".jit.")) or c.name.endswith(".old")
        for c in export_dir.iterdir()
    )
    if leftovers or not verified_export(run.run_dir / PRETRAINED_DIR, newest):
        return False
    return not run.request.export or verified_jit(run.run_dir, newest) is not None


def export(run: Run, *, only_if_missing: bool = False) -> None:
    """The PaddleNLP-format export (and with --export the jit one) of the newest checkpoint,
    each verified by logits (runner.export); with `only_if_missing` (a rerun of a finished
    run) only the ones that are not whole and verified for that checkpoint are redone, and
    what a killed export left is removed."""
    from runner.export import (
        PRETRAINED_DIR,
        export_model,
        export_pretrained,
        export_summary,
        remove_partial_exports,
        verified_export,
        verified_jit,
    )

    found = ckpt.complete_checkpoints(run.run_dir / "checkpoints")
    newest = found[-1][1].name if found else None
    pretrained = run.run_dir / PRETRAINED_DIR
    trust = run.request.trust_pickled_checkpoint
    remove_partial_exports(run.run_dir)
    retried = " (retried: the export after training had not finished)" if only_if_missing else ""
    did = False
    if not (only_if_missing and verified_export(pretrained, newest)):
        path = export_pretrained(run.plan, run.run_dir, trust_pickled=trust)
        print(f"model + tokenizer in PaddleNLP format: {path}{retried}")
        did = True
    if run.request.export and not (only_if_missing and verified_jit(run.run_dir, newest)):
        path = export_model(run.plan, run.run_dir, trust_pickled=trust)
        print(f"exported for inference (paddle.jit.save): {path}{retried}")
        did = True
    if did:
        jit_dir = run.run_dir if run.request.export else None
        print(f"export done, verified: {export_summary(pretrained, jit_run_dir=jit_dir)}")


def report(run: Run, resume: Resume, result: dict | None) -> int:
    """Planned vs actual (runner.report) from this attempt's result, or from result.json of a
    finished run (rebuilt from the newest checkpoint when it was lost)."""
    from gptplan.tomlconf import write_text_atomic
    from runner.report import planned_vs_actual, render

    billed = resume.billing.total_seconds()
    result_file = run.run_dir / "result.json"
    if result is None:
        result = read_json(result_file)
    if result is None and resume.state is not None and resume.latest is not None:
        from runner.runfiles import rebuild_result

        result = rebuild_result(
            run.plan,
            run.run_dir,
            resume.state,
            billed_seconds=billed,
            checkpoint_bytes=ckpt.checkpoint_bytes(resume.latest),
        )
        write_text_atomic(result_file, json.dumps(result, indent=1))
        print(f"{result_file} rebuilt from {resume.latest.name} and metrics.jsonl (measured)")
    if result is None:
        print("no result.json: the run ended before its first step", file=sys.stderr)
        return 1
    data = planned_vs_actual(run.plan, result, billed)
    write_text_atomic(run.run_dir / "report.json", json.dumps(data, indent=1))
    print(json.dumps(data, indent=1) if run.request.json else render(data))
    return 0


def finish_other_node(run: Run, attempt: Attempt, log_dir: Path, rc: int) -> int:
    """Node R > 0 reports its own ranks' outcome; billing, metrics, checkpoints and the report
    are node 0's."""
    from runner.train import STOP_SIGNAL, node_result_file

    node_rank = run.node_rank
    path = node_result_file(run.run_dir, node_rank)
    fresh = path.exists() and path.stat().st_mtime >= attempt.start
    result = read_json(path) if fresh else None
    if result is None:
        print(
            f"node {node_rank}: training failed (exit {rc}); last lines of the rank logs:\n"
            f"{last_log_lines(log_dir)}",
            file=sys.stderr,
        )
        return 1
    status = "finished" if result["finished"] else f"stopped: {result['stop_reason']}"
    print(
        f"node {node_rank}: {status} after {result['completed_steps']}/"
        f"{result['max_steps']} steps; metrics, checkpoints, billing and the report are "
        f"written by node 0 (into {run.run_dir} on node 0)"
    )
    if result["stop_reason"] == "loss diverged":  # runner.divergence: node 0 says more
        return 1
    interrupted = not result["finished"] and result["stop_reason"] == STOP_SIGNAL
    return signals.EXIT_SIGNALLED if interrupted else 0


def rank_error_line(log_dir: Path) -> str | None:
    """The one-line error a rank printed (disk full, run directory not writable), if that is
    why it ended."""
    for log in sorted(Path(log_dir).glob("workerlog.*")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("error: ") and (
                "no space left" in line
                or "is not writable" in line
                or line.startswith("error: checkpoint ")
            ):
                return line
    return None


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


def last_log_lines(log_dir: Path, lines: int = 15) -> str:
    chunks = []
    for log in sorted(Path(log_dir).glob("workerlog.*")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        chunks.append(f"--- {log}\n" + "\n".join(text))
    return "\n".join(chunks) or f"(no logs in {log_dir})"
