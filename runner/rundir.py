"""One runner per run directory: an exclusive `fcntl.flock` on `<run_dir>/runner.lock`.

The lock is held by `runner execute` for the whole run and released by the kernel when the
process ends, however it ends (a SIGKILL included), so a stale lock never blocks a rerun.
The file records who holds it, so a second runner can say whom it is waiting for.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from gptplan.diskspace import guard_disk_writes
from gptplan.errors import UserError

LOCK_FILE = "runner.lock"


class RunDirBusy(UserError):
    """Another runner holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: Path, *, lock_file: str = LOCK_FILE):
        self.run_dir = Path(run_dir)
        self.lock_file = lock_file  # nodes > 0 of a multi-node run hold their own
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        with guard_disk_writes(self.run_dir, needed_bytes=4096):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(
                self.run_dir / self.lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"another runner is using this run directory ({holder}); wait for "
                "it to end, or give this run its own --output-dir",
                file=str(self.run_dir),
            ) from None
        self.fd = fd
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with guard_disk_writes(self.run_dir, needed_bytes=4096):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
