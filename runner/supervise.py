"""Each training or probe rank runs under a small supervisor: its memory limit, peak RSS and fate.

`paddle.distributed.launch` starts every rank in its own session and keeps the exit status to
itself (it reports only the lowest failed rank, which after one rank dies is usually rank 0 with
a gloo timeout). So the rank's entry point forks before importing Paddle: the child becomes the
rank, the parent (a bare Python of ~10 MB) watches it and

- reads its RSS from /proc every POLL_S and its peak (VmHWM), so a report can say how far a
  rank got, even one killed by SIGKILL;
- ends it with SIGKILL when its RSS passes the rank's memory limit, so the runner, not the
  kernel's global OOM killer (which may pick any process of the machine), ends an oversized
  rank, and says so;
- writes `rank_<N>.json` (pid, exit code, signal, peak RSS, limit, whether it ended the rank
  for memory, when) to the status folder the runner named, which runner.failure turns into a
  one-line report;
- forwards SIGTERM/SIGINT to the rank and ends the same way it did (same exit code or signal),
  so the launcher sees exactly what it would have seen without the supervisor.

Why RSS polling and not RLIMIT_AS: a Paddle CPU process maps more address space than it touches
(measured: a tiny GPT forward in one single-threaded process, VmSize 1.30 GB for VmRSS 0.56 GB;
gloo, OpenMP threads and glibc arenas add more per thread), so an address-space cap either
breaks library loading (runner.probe maps its kernels before capping for this reason) or sits
far above the real use. RSS is what the OOM killer counts. cgroup v2 memory.max would be exact
but needs a delegated cgroup, which this machine (and most containers) does not give.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Set
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from gptplan.lifeline import set_parent_death_signal

if TYPE_CHECKING:
    from runner.parallel import LaunchCommand

STATUS_DIR_ENV = "RUNNER_RANK_STATUS_DIR"
LIMIT_ENV = "RUNNER_RANK_MEMORY_LIMIT_BYTES"
OWNER_ENV = "RUNNER_OWNER_PROCESS"  # "<pid>:<start time>" of the runner that started the ranks
POLL_S = 0.05
MACHINE_SHARE = 0.9  # of the machine's memory, split between the ranks of one node


def machine_memory_bytes() -> int:
    """Memory of this machine (MemTotal), or of our cgroup if that is smaller."""
    total = 0
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except OSError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def machine_share_bytes(ranks_on_node: int) -> int:
    """The most one of `ranks_on_node` ranks may use: an equal share of 90% of the machine."""
    return int(machine_memory_bytes() * MACHINE_SHARE / max(1, ranks_on_node))


def oom_kills() -> int:
    """The kernel's count of OOM kills since boot (/proc/vmstat oom_kill, Linux >= 4.13)."""
    try:
        with open("/proc/vmstat") as handle:
            for line in handle:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def supervision_env(status_dir: Path, limit_bytes: int) -> dict[str, str]:
    """Environment that makes every rank started with it supervised (see supervise())."""
    return {
        STATUS_DIR_ENV: str(status_dir),
        LIMIT_ENV: str(int(limit_bytes)),
        OWNER_ENV: f"{os.getpid()}:{process_start(os.getpid())}",
    }


def process_start(pid: int) -> int:
    """When `pid` started (clock ticks since boot, /proc/PID/stat field 22); -1 if gone or a
    zombie (ended, not yet reaped). With the pid it names one process for good: pids are
    reused, (pid, start) pairs are not."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rpartition(")")[2].split()
        return -1 if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return -1


def owner_alive(owner: str) -> bool:
    """Is the process named by an OWNER_ENV value still running? (True if it cannot be told.)"""
    pid, _, start = owner.partition(":")
    if not (pid.isdigit() and start.lstrip("-").isdigit()) or int(start) < 0:
        return True
    return process_start(int(pid)) == int(start)


def supervised(command: LaunchCommand, status_dir: Path, limit_bytes: int) -> LaunchCommand:
    """`command` (a runner.parallel.LaunchCommand) with its ranks supervised."""
    import dataclasses

    return dataclasses.replace(command, env=command.env | supervision_env(status_dir, limit_bytes))


def _memory(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of `pid` in bytes; (0, 0) once it is gone."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return rss, hwm


def _write(path: Path, record: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:  # a full disk must not take the rank down with it
        pass


def supervise() -> None:
    """Fork; return in the child (the rank). The parent watches it and never returns.

    Does nothing unless the runner asked for it (STATUS_DIR_ENV set) and on non-Linux systems.
    """
    status_dir = os.environ.get(STATUS_DIR_ENV)
    if not status_dir or sys.platform != "linux":
        return
    rank = os.environ.get("PADDLE_TRAINER_ID", "0")
    try:
        limit = int(os.environ.get(LIMIT_ENV, "0"))
    except ValueError:
        limit = 0
    if limit <= 0:
        limit = machine_share_bytes(int(os.environ.get("PADDLE_LOCAL_SIZE", "1") or 1))
    folder = Path(status_dir)
    folder.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    set_parent_death_signal(signal.SIGKILL)  # the supervisor dies with the launcher
    pid = os.fork()
    if pid == 0:
        set_parent_death_signal(signal.SIGKILL)  # and the rank with its supervisor
        if os.getppid() != parent:
            os._exit(1)
        return
    watch(
        pid,
        rank=int(rank),
        limit_bytes=limit,
        status_file=folder / f"rank_{rank}.json",
        owner=os.environ.get(OWNER_ENV, ""),
    )


def watch(pid: int, *, rank: int, limit_bytes: int, status_file: Path, owner: str = "") -> None:
    """Supervisor loop for child `pid`; exits this process like the child ended.

    If the runner that started the ranks (`owner`) is gone, the rank gets SIGTERM (it
    checkpoints at its next step end and exits): training never goes on without the runner
    that bills it, even if the launcher in between missed its own parent-death notice.
    """

    def forward(signum: int, frame: FrameType | None) -> None:
        try:
            os.kill(pid, signum)

        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    record: dict[str, Any] = {  # the status file's JSON record
        "rank": rank,
        "pid": pid,
        "supervisor_pid": os.getpid(),
        "memory_limit_bytes": limit_bytes,
        "peak_rss_bytes": 0,
        "rss_bytes": 0,
        "started": time.time(),
        "ended": None,
        "exit_code": None,
        "signal": None,
        "killed_for_memory": False,
    }
    _write(status_file, record)
    written = checked = time.monotonic()
    orphaned = False
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            break
        rss, hwm = _memory(pid)
        record["rss_bytes"] = rss
        record["peak_rss_bytes"] = max(record["peak_rss_bytes"], rss, hwm)
        if rss > limit_bytes and not record["killed_for_memory"]:
            record["killed_for_memory"] = True
            record["killed_at_rss_bytes"] = rss
            _write(status_file, record)  # before the kill: the runner may read it any moment
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if owner and not orphaned and time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not owner_alive(owner):
                orphaned = record["runner_gone"] = True
                forward(signal.SIGTERM, None)
        if time.monotonic() - written > 1.0:  # a live view for the runner and for operators
            _write(status_file, record)
            written = time.monotonic()
        time.sleep(POLL_S)
    code = os.waitstatus_to_exitcode(status)
    record.update(
        ended=time.time(), exit_code=code, signal=signal.Signals(-code).name if code < 0 else None
    )
    _write(status_file, record)
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL/SIGSTOP cannot be caught anyway
            pass
        os.kill(os.getpid(), -code)
    os._exit(code)


def signal_supervised_ranks(
    status_dir: Path, sig: int, *, since: float = 0.0, skip: Set[int] = frozenset()
) -> set[int]:
    """Send `sig` to every live rank supervisor of `status_dir` (each forwards it to its rank);
    return the supervisor pids signalled.

    Only supervisors whose record is of this launch (started >= `since`, not ended) and whose
    environment names this very status folder are signalled: a pid the kernel has since given
    to another process is never touched.
    """
    sent: set[int] = set()
    marker = f"{STATUS_DIR_ENV}={status_dir}".encode()
    for record in read_status(status_dir):
        pid = record.get("supervisor_pid")
        if not isinstance(pid, int) or pid in skip or record.get("ended") is not None:
            continue
        if (record.get("started") or 0.0) < since:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                if marker not in handle.read().split(b"\0"):
                    continue
            os.kill(pid, sig)
        except (OSError, ProcessLookupError):
            continue
        sent.add(pid)
    return sent


def read_status(status_dir: Path) -> list[dict]:
    """Every rank's record in `status_dir`, by rank."""
    records = []
    for path in sorted(Path(status_dir).glob("rank_*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r.get("rank", 0))
