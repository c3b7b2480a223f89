"""One runner per run directory: an exclusive `fcntl.flock` on `<run_dir>/runner.lock`.

The lock is held by `runner execute` for the whole run and released by the kernel when the
process ends, however it ends (a SIGKILL included), so a stale lock never blocks a rerun.
The file records who holds it, so a second runner can say whom it is waiting for.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path

from gptplan.diskspace import guard_disk_writes
from gptplan.errors import UserError

LOCK_FILE = "runner.lock"
# Files only the runner writes into a run directory: a folder holding one is a run folder. The
# lock is created by the first runner that claims a folder and never removed (its flock is).
RUN_MARKERS = re.compile(r"^(runner(\.node\d+)?\.lock|billing(\.node\d+)?(\.copy)?\.json)$")


def foreign_folder_problem(run_dir: Path) -> str | None:
    """None for a new folder, a folder holding only (empty) folders (a mount point for
    checkpoints, say) or a run folder; else what the folder holds that the runner did not
    write (the runner never writes into, renames or moves aside such files)."""
    try:
        names = sorted(p.name for p in Path(run_dir).iterdir())
    except FileNotFoundError:
        return None
    except OSError as exc:  # NotADirectoryError is the path check's; unreadable: say so
        return f"cannot be listed ({exc.strerror or type(exc).__name__})"
    if any(RUN_MARKERS.match(name) for name in names):
        return None
    found = []
    for root, dirs, files in os.walk(run_dir):
        dirs.sort()
        here = Path(root).relative_to(run_dir)
        found += [str(here / name) for name in sorted(files)]
        found += [str(here / d) for d in dirs if os.path.islink(os.path.join(root, d))]
        if len(found) > 4:
            break
    if not found:
        return None
    shown = ", ".join(found[:4]) + (" and more" if len(found) > 4 else "")
    return (
        f"{run_dir} is not a run folder: it holds files the runner did not write ({shown}); "
        "the runner never writes into such a folder: point it at a new or empty folder"
    )


class RunDirBusy(UserError):
    """Another runner holds the run directory."""


class RunDirLock:
    def __init__(self, run_dir: Path, *, lock_file: str = LOCK_FILE):
        self.run_dir = Path(run_dir)
        self.lock_file = lock_file  # nodes > 0 of a multi-node run hold their own
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        path = self.run_dir / self.lock_file
        with guard_disk_writes(self.run_dir, needed_bytes=4096):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if path.is_symlink() or (path.exists() and not path.is_file()):
                # a folder (or a link) where the lock belongs: no runner holds it (a flock is
                # taken on a file); kept in damaged/ like any damaged run file
                from runner.billing import move_damaged

                target = move_damaged(path, self.run_dir)
                print(f"{path} was not a lock file; moved to {target}, a new lock written")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except PermissionError as exc:
                raise UserError(
                    f"the run's lock file cannot be opened for writing ({exc.strerror}); make it "
                    "writable (or remove it: it holds no state)",
                    file=str(path),
                ) from None
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

    def __exit__(self, *exc: object) -> None:

        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
