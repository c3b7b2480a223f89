"""Why a run's ranks failed, in one line: which rank, how (signal or exit code), its peak RSS
against the machine, the likely cause and a concrete fix; then that rank's last log lines
without Paddle's banners and warnings.

The facts come from runner.supervise's per-rank records (exit status, peak RSS, whether the
runner ended the rank for exceeding its memory limit), the kernel's OOM-kill counter
(/proc/vmstat) and the rank's log. The first rank to end abnormally is the cause; the others
usually die of it (a gloo timeout or connection error on their side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from gptplan.memory import GB
from gptplan.plan import Plan
from runner.logtail import clean_tail
from runner.supervise import read_status
from runner.watchdog import last_reported_step

OOM_TEXT = (
    "MemoryError",
    "ResourceExhausted",
    "std::bad_alloc",
    "Cannot allocate memory",
    "out of memory",
)
PEER_LOST_TEXT = (
    "gloo::IoException",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
)


@dataclass(frozen=True)
class Failure:
    """One run's failure, as data; `line` is what the console shows."""

    cause: str  # memory_limit | oom_killer | oom_error | peer_lost | signal | exit | unknown
    rank: int | None
    exit_code: int | None
    signal: str | None
    peak_rss_bytes: int
    memory_limit_bytes: int
    machine_memory_bytes: int
    line: str
    log_tail: tuple[str, ...]


def _gb(value: float) -> str:
    """Bytes as GB with 3 significant figures: 0.903 GB, 12.0 GB, 25.3 GB."""
    gb = value / GB
    return f"{gb:.1f}" if gb >= 10 else f"{gb:.2f}" if gb >= 1 else f"{gb:.3f}"


def _is_consequence(record: dict, log_dir: Path) -> bool:
    """A rank that died because a peer did: gloo lost its connection (often as SIGABRT)."""
    tail = "\n".join(_tail(log_dir, record["rank"]))
    return record.get("signal") == "SIGABRT" or any(text in tail for text in PEER_LOST_TEXT)


def _culprit(records: list[dict], log_dir: Path) -> dict | None:
    """The rank that failed first for a reason of its own (see the module doc)."""
    ours = [r for r in records if r.get("killed_for_memory")]
    if ours:
        return min(ours, key=lambda r: r.get("ended") or math.inf)
    ended = [r for r in records if r.get("exit_code") not in (None, 0)]
    if not ended:
        return None
    return min(ended, key=lambda r: (_is_consequence(r, log_dir), r["ended"]))


def suggested_micro_batch(plan: Plan, peak_bytes: float, limit_bytes: float) -> int:
    """A micro-batch that should fit: scaled by how far the rank overshot, halved at least."""
    micro = plan.training.per_device_train_batch_size
    if peak_bytes <= 0 or limit_bytes <= 0:
        return max(1, micro // 2)
    return max(1, min(micro // 2, int(micro * 0.8 * limit_bytes / peak_bytes)))


def _fix(plan: Plan, local: bool, peak: float, limit: float) -> str:
    micro = suggested_micro_batch(plan, peak, limit)
    if plan.training.per_device_train_batch_size == 1:
        setting = f"training.seq_len={max(16, plan.training.seq_len // 2)}"
    else:
        setting = f"training.per_device_train_batch_size={micro}"
    if local:
        return f"try --set {setting} (with --local) or a larger --memory-limit-gb"
    return f"try --local with a smaller micro-batch or --set {setting}"


def diagnose(
    *,
    plan: Plan,
    status_dir: Path,
    log_dir: Path,
    launcher_rc: int | None,
    oom_kills_before: int,
    oom_kills_after: int,
    machine_bytes: int,
    local: bool,
) -> Failure:
    """Classify the failure of one attempt (see the module doc)."""
    records = read_status(status_dir)
    culprit = _culprit(records, log_dir)
    if culprit is None:
        tail = _tail(log_dir, None)
        step = last_reported_step(status_dir)
        if step is not None:  # what the ranks reported, not what they did not
            when = f"after step {step} (no rank's own end was recorded)"
        elif records:
            when = f"after {len(records)} rank(s) started, before any finished a step"
        else:
            when = "before any rank started"
        line = f"training failed (launcher exit {launcher_rc}) {when}; see {log_dir}"
        return Failure("unknown", None, launcher_rc, None, 0, 0, machine_bytes, line, tuple(tail))
    rank, code = culprit["rank"], culprit["exit_code"]
    sig = culprit.get("signal")
    peak = max(culprit.get("peak_rss_bytes") or 0, culprit.get("killed_at_rss_bytes") or 0)
    limit = culprit.get("memory_limit_bytes") or 0
    tail = _tail(log_dir, rank)
    how = f"signal {sig}, exit {code}" if sig else f"exit code {code}"
    fix = _fix(plan, local, peak, limit)
    if culprit.get("killed_for_memory"):
        cause = "memory_limit"
        line = (
            f"out of memory: rank {rank} reached {_gb(peak)} GB of its {_gb(limit)} GB "
            f"limit ({_gb(machine_bytes)} GB machine; peak RSS, measured), so the runner "
            f"ended it ({how}); {fix}"
        )
    elif sig == "SIGKILL" and oom_kills_after > oom_kills_before >= 0:
        cause = "oom_killer"
        line = (
            f"out of memory: rank {rank} reached {_gb(peak)} GB (peak RSS, measured) of "
            f"{_gb(machine_bytes)} GB and the kernel's OOM killer ended it ({how}); {fix}"
        )
    elif len(records) > 1 and _is_consequence(culprit, log_dir):
        # every rank that ended did so because a peer stopped answering (gloo's timeout
        # aborts the healthy ranks with SIGABRT): the cause is a rank that has not ended or
        # ended without a record (stopped, hung in a collective, on a dead mount)
        cause = "peer_lost"
        silent = [r["rank"] for r in records if r.get("exit_code") is None]
        who = (
            f"rank(s) {', '.join(map(str, silent))} stopped answering (still running or "
            "stopped, no end recorded)"
            if silent
            else "a peer rank stopped answering first"
        )
        line = (
            f"{who}; rank {rank} waited for it in a collective until gloo gave up and ended "
            f"({how}): rank {rank} is not the cause; rerun the same command to resume from "
            "the last checkpoint"
        )
    elif any(word in "\n".join(tail) for word in OOM_TEXT):
        cause = "oom_error"
        line = (
            f"out of memory: rank {rank} could not allocate memory at {_gb(peak)} GB "
            f"(peak RSS, measured) of {_gb(machine_bytes)} GB ({how}); {fix}"
        )
    elif sig:
        cause = "signal"
        line = (
            f"rank {rank} was killed by {sig} (exit {code}) at {_gb(peak)} GB (peak "
            f"RSS, measured) of {_gb(machine_bytes)} GB, not by this runner nor the kernel's OOM "
            "killer; rerun the same command to resume from the last checkpoint"
        )
    else:
        cause = "exit"
        line = (
            f"rank {rank} failed with exit code {code} at {_gb(peak)} GB (peak RSS, "
            f"measured) of {_gb(machine_bytes)} GB; its last log lines follow"
        )
    return Failure(cause, rank, code, sig, peak, limit, machine_bytes, line, tuple(tail))


def _tail(log_dir: Path, rank: int | None) -> list[str]:
    names = [f"workerlog.{rank}"] if rank is not None else []
    for name in names + sorted(p.name for p in Path(log_dir).glob("workerlog.*")):
        path = Path(log_dir) / name
        if path.is_file():
            return clean_tail(path.read_text(errors="replace"))
    return []


def render(failure: Failure, log_dir: Path) -> str:
    """The one line, then the rank's log tail (indented) and where the full logs are."""
    lines = [failure.line]
    if failure.log_tail:
        where = f"workerlog.{failure.rank}" if failure.rank is not None else "rank logs"
        lines.append(
            f"last lines of {Path(log_dir) / where} (Paddle banners and warnings left out):"
        )
        lines += [f"  {line}" for line in failure.log_tail]
    return "\n".join(lines)
