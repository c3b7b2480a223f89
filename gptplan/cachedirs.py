"""Temporary folders of cache entries that a killed process cannot leave behind for good.

A cache entry (a trained tokenizer, a tokenized corpus) is written into `<name>.XXXX.tmp` next
to its final place and renamed when complete. The writer holds an exclusive `flock` on a file
inside the temporary folder for as long as it writes; the kernel drops that lock when the
process ends, however it ends (SIGKILL included). `remove_stale` therefore removes exactly the
temporary folders whose writer is gone, and never one that another live process is filling
(two runners may share one cache). A folder without the lock file is a writer's first instant
or a folder from before this rule: it is removed once it is older than `UNLOCKED_GRACE_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gptplan.progress import Log

SUFFIX = ".tmp"
LOCK_FILE = ".writer.lock"
UNLOCKED_GRACE_S = 600.0


@contextlib.contextmanager
def writing(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh temporary folder in `parent`, locked while the block runs; removed if the block
    raises (the caller renames it into place on success)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix + ".", suffix=SUFFIX, dir=parent))
    fd = os.open(tmp / LOCK_FILE, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def publish(tmp: Path, out: Path) -> bool:
    """Rename a finished temporary folder to `out` (its lock file dropped); False, and the
    folder removed, when another process published `out` first."""
    (Path(tmp) / LOCK_FILE).unlink(missing_ok=True)
    if Path(out).exists():
        shutil.rmtree(tmp)
        return False
    os.replace(tmp, out)
    return True


def _writer_alive(folder: Path, now: float) -> bool:
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        try:
            return now - folder.stat().st_mtime < UNLOCKED_GRACE_S
        except FileNotFoundError:
            return True  # gone meanwhile: nothing to remove
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return False


def remove_stale(parent: Path, *, log: Log = print) -> list[Path]:
    """Remove the temporary folders in `parent` whose writer has ended; one line if any."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    now = time.time()
    removed = []
    for folder in sorted(parent.glob(f"*{SUFFIX}")):
        if folder.is_dir() and not folder.is_symlink() and not _writer_alive(folder, now):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        names = ", ".join(p.name for p in removed[:3]) + (
            f" and {len(removed) - 3} more" if len(removed) > 3 else ""
        )
        log(
            f"removed {len(removed)} temporary folder(s) left in {parent} by an interrupted "
            f"preparation ({names})"
        )
    return removed
