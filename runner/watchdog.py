"""Progress watchdog: a launched attempt whose ranks stop advancing is ended, with one line.

Each launched rank writes `progress_<rank>.json` into its node's status folder (the one
runner.supervise writes `rank_<rank>.json` into) after every step and every checkpoint: the
step it finished, when, and the slowest step and checkpoint it has measured. The runner reads
the folder once a second while it waits on the launcher (runner.launch.run_group) and ends the
attempt (its own launcher group and the ranks its supervisors started, nothing else) when

- no rank of this node has finished a step or a checkpoint for STALL_MULTIPLE x the slowest
  step or checkpoint measured in this attempt, and at least the floor STALL_FLOOR_S (a rank
  stopped by SIGSTOP, a collective that never completes, a dead network mount); or
- no rank has finished its first step STARTUP_LIMIT_S after the launch (at least
  STARTUP_MULTIPLE x the slowest start-up measured by earlier attempts): on several nodes
  this is a rendezvous that never completes because a peer node never came.

A node whose peers go away mid-run sees its own ranks stop advancing (they wait on a
collective), so the same rule ends it. The time is billed like any attempt's (the journal's
heartbeat runs throughout); a rerun resumes from the last checkpoint.

Both limits are stated bounds, not measurements; RUNNER_STALL_FLOOR_S and
RUNNER_STARTUP_LIMIT_S change them (tests use a few seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from gptplan.plan import Plan
from runner.logtail import clean_tail
from runner.supervise import STATUS_DIR_ENV, read_status

STALL_MULTIPLE = 10.0  # x the slowest step or checkpoint measured in this attempt
STALL_FLOOR_S = 120.0  # never less: a slow first steps' warm-up, a checkpoint to slow storage
STARTUP_LIMIT_S = 600.0  # launch to the first step of every rank (rendezvous included)
STARTUP_MULTIPLE = 3.0  # x the slowest start-up measured by earlier attempts, if larger
STALL_FLOOR_ENV = "RUNNER_STALL_FLOOR_S"
STARTUP_LIMIT_ENV = "RUNNER_STARTUP_LIMIT_S"
PROGRESS_PREFIX = "progress_"


def _env_seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if 0 < value < float("inf") else default


# ---- the rank's side ----------------------------------------------------------------------


class ProgressFile:
    """What one rank writes after each step and checkpoint (nothing unless launched by the
    runner, i.e. with a status folder in its environment)."""

    def __init__(self, rank: int):
        folder = os.environ.get(STATUS_DIR_ENV)
        self.path = Path(folder) / f"{PROGRESS_PREFIX}{rank}.json" if folder else None
        # the JSON record the runner's watchdog reads
        self.record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "step": None, "at": None}
        self.record |= {"step_s": 0.0, "first_step_s": 0.0, "checkpoint_s": 0.0}

    def update(self, step: int, *, step_s: float = 0.0, checkpoint_s: float = 0.0) -> None:
        if self.path is None:
            return
        r = self.record
        if r["step"] is not None:  # the attempt's first step compiles and warms up: not typical
            r["step_s"] = max(r["step_s"], step_s)
        else:  # ... but until a second step is measured it is the only step time there is
            r["first_step_s"] = max(r["first_step_s"], step_s)
        r.update(step=step, at=time.time())
        r["checkpoint_s"] = max(r["checkpoint_s"], checkpoint_s)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(r))
            os.replace(tmp, self.path)
        except OSError:  # a full disk must not take the rank down with it
            pass


# ---- the runner's side --------------------------------------------------------------------


def read_progress(status_dir: Path) -> dict[int, dict]:
    """Every rank's progress record in `status_dir`, by rank."""
    out = {}
    for path in Path(status_dir).glob(f"{PROGRESS_PREFIX}*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int):
            out[record["rank"]] = record
    return out


def last_reported_step(status_dir: Path) -> int | None:
    """The highest step any rank of this node finished (None: none reported a step)."""
    steps = [r["step"] for r in read_progress(status_dir).values() if isinstance(r["step"], int)]
    return max(steps) if steps else None


def _state(pid: object) -> str:
    """The kernel's state letter of `pid` (R, S, D, T, Z...), '' if gone."""
    if not isinstance(pid, int):
        return ""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


STATE_WORDS = {
    "T": "stopped (SIGSTOP or a debugger)",
    "t": "stopped by a tracer",
    "D": "stuck in uninterruptible I/O (storage or a driver)",
    "Z": "dead",
    "": "gone",
}


@dataclasses.dataclass
class Watchdog:
    """Watches one node's launched ranks (see the module doc)."""

    status_dir: Path
    log_dir: Path
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master: str = ""
    startup_limit_s: float = STARTUP_LIMIT_S
    floor_s: float = STALL_FLOOR_S
    started: float = dataclasses.field(default_factory=time.time)

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        *,
        status_dir: Path,
        log_dir: Path,
        node_rank: int,
        master: str,
        attempts: list[dict],
    ) -> Watchdog:
        """The stated bounds (or their environment overrides), the start-up limit raised to
        STARTUP_MULTIPLE x the slowest start-up earlier attempts measured."""
        measured = [a["startup_s"] for a in attempts if isinstance(a.get("startup_s"), float)]
        startup = _env_seconds(STARTUP_LIMIT_ENV, 0.0) or max(
            STARTUP_LIMIT_S, STARTUP_MULTIPLE * max(measured, default=0.0)
        )
        return cls(
            status_dir=Path(status_dir),
            log_dir=Path(log_dir),
            nproc_per_node=plan.parallel.nproc_per_node,
            nnodes=plan.parallel.nnodes,
            node_rank=node_rank,
            master=master or plan.parallel.master,
            startup_limit_s=startup,
            floor_s=_env_seconds(STALL_FLOOR_ENV, STALL_FLOOR_S),
        )

    def limit_s(self, progress: dict[int, dict]) -> float:
        # a rank that has measured only its first step (slow everywhere on a rehearsal, e.g.
        # 118 s a step): that step bounds the next, or the floor would end a healthy step 2
        slowest = max(
            [
                max(
                    r.get("step_s") or r.get("first_step_s") or 0.0,
                    r.get("checkpoint_s") or 0.0,
                )
                for r in progress.values()
            ],
            default=0.0,
        )
        return max(self.floor_s, STALL_MULTIPLE * slowest)

    def check(self, now: float | None = None) -> str | None:
        """None while the ranks advance; else the one line that ends the attempt."""
        now = time.time() if now is None else now
        progress = {
            rank: r
            for rank, r in read_progress(self.status_dir).items()
            if isinstance(r.get("at"), (int, float)) and r["at"] >= self.started
        }
        if len(progress) < self.nproc_per_node:  # start-up: not every rank has stepped yet
            if now - self.started < self.startup_limit_s:
                return None
            return self._startup_line(now, progress)
        latest = max(r["at"] for r in progress.values())
        limit = self.limit_s(progress)
        if now - latest < limit:
            return None
        records = self._records()
        if records and all(r.get("ended") is not None for r in records.values()):
            return None  # every rank is done: the launcher is shutting down
        return self._stall_line(now - latest, limit, progress)

    def _records(self) -> dict[int, dict]:
        return {
            r["rank"]: r for r in read_status(self.status_dir) if isinstance(r.get("rank"), int)
        }

    def _startup_line(self, now: float, progress: dict[int, dict]) -> str:
        started = self._records()
        waited = now - self.started
        if self.nnodes > 1 and not started:
            return (
                f"node {self.node_rank}: no rank started {waited:.0f} s after the launch (limit "
                f"{self.startup_limit_s:.0f} s): the rendezvous with the other "
                f"{self.nnodes - 1} node(s) at {self.master or 'the master'} never completed; "
                "ended this node's attempt (its time is billed). Start every node with the same "
                "--master HOST:PORT of node 0 and check that node 0 runs and the port is "
                f"reachable (launcher log: {self.log_dir / 'launcher.log'})"
            )
        silent = sorted(set(started) - set(progress)) or sorted(started)
        where = "" if self.nnodes == 1 else f"node {self.node_rank}: "
        return (
            f"{where}start-up did not finish: rank(s) {_ranks(silent)} had not finished a first "
            f"step {waited:.0f} s after the launch (limit {self.startup_limit_s:.0f} s; "
            f"{self._states(silent, started)}); ended the attempt (its time is billed); "
            f"{self._tail(silent)}; rerun the same command to resume"
            + (", with every node started" if self.nnodes > 1 else "")
        )

    def _stall_line(self, silent_s: float, limit: float, progress: dict[int, dict]) -> str:
        records = self._records()
        stuck = [
            rank
            for rank, r in records.items()
            if _state(r.get("pid")) in ("T", "t", "D", "Z", "") and r.get("ended") is None
        ]
        low = min(r["step"] for r in progress.values())
        behind = [rank for rank, r in progress.items() if r["step"] == low]
        silent = sorted(stuck) or (sorted(behind) if len(behind) < len(progress) else [])
        step = max(r["step"] for r in progress.values())
        who = (
            f"rank(s) {_ranks(silent)} ({self._states(silent, records)})"
            if silent
            else f"every rank of this node (all at step {step}; waiting on a collective: "
            "a peer on another node, or the network)"
        )
        where = "" if self.nnodes == 1 else f"node {self.node_rank}: "
        return (
            f"{where}no progress for {silent_s:.0f} s (limit {limit:.0f} s = max(floor "
            f"{self.floor_s:.0f} s, {STALL_MULTIPLE:.0f} x the slowest step or checkpoint)) "
            f"after step {step}: {who}; ended the attempt (its time is billed); "
            f"{self._tail(silent)}; rerun the same command to resume from the last checkpoint; "
            "if it recurs, look at that rank's log for a collective or storage that hangs"
        )

    def _states(self, ranks: list[int], records: dict[int, dict]) -> str:
        parts = []
        for rank in ranks:
            state = _state(records.get(rank, {}).get("pid")) if rank in records else ""
            word = STATE_WORDS.get(state, "running" if state else "gone")
            parts.append(f"rank {rank} {word}" if rank in records else f"rank {rank} not started")
        return ", ".join(parts) or "no rank started"

    def _tail(self, ranks: list[int]) -> str:
        first = self.node_rank * self.nproc_per_node
        others = [r for r in range(first, first + self.nproc_per_node) if r not in ranks]
        for rank in [*ranks, *others]:  # the silent rank's own log first (rank 0's has steps)
            log = self.log_dir / f"workerlog.{rank - first}"
            try:
                lines = clean_tail(log.read_text(errors="replace"), 3)
            except OSError:
                continue
            if lines:
                shown = " | ".join(line.strip()[:160] for line in lines)
                return f"last log lines of {log}: {shown}"
        return f"no log lines yet in {self.log_dir}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def end_ranks(status_dir: Path) -> None:
    """SIGKILL every rank (and its supervisor) this launch's supervisors recorded, each checked
    to carry this very status folder in its environment (a reused pid is never touched). A
    stopped rank cannot act on SIGTERM; SIGKILL ends it."""
    marker = f"{STATUS_DIR_ENV}={status_dir}".encode()
    for record in read_status(status_dir):
        for key in ("pid", "supervisor_pid"):
            pid = record.get(key)
            if not isinstance(pid, int):
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as handle:
                    if marker not in handle.read().split(b"\0"):
                        continue
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
