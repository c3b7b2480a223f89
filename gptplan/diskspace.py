"""Disk space: one check before big writes and one translation of ENOSPC for every write path.

Every place that writes run state (plan, billing, metrics, result, checkpoints) goes through
`guard_disk_writes`, so a full disk always ends as one `DiskFullError` line naming the folder
and the bytes needed, never as a traceback from whichever write happened to hit it.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from gptplan.errors import DiskFullError, NotWritableError, UserError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
NOT_WRITABLE_TEXT = ("Read-only file system", "Permission denied")  # as paddle.save words them
# A folder to write into whose path has an existing file in it (mkdir says EEXIST or ENOTDIR).
NOT_A_FOLDER = (errno.ENOTDIR, errno.EEXIST)


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem of `directory`."""
    return shutil.disk_usage(_existing(directory)).free


def _message(directory: Path, needed: int | None, setting: str = "job.output_dir") -> str:
    try:
        free = f"{free_bytes(directory):,} bytes free"
    except OSError:
        free = "free space unknown"
    need = f"{needed:,} bytes needed" if needed else "more space needed"
    return (
        f"no space left on the device of {directory}: {need}, {free}; free space there "
        f"(or point {setting} elsewhere) and rerun; nothing else was lost"
    )


def not_writable_message(directory: Path, reason: str, setting: str = "job.output_dir") -> str:
    return (
        f"{directory} is not writable ({reason}); the run stopped there, checkpoints "
        f"completed before are kept: make it writable (or point {setting} "
        "elsewhere) and rerun"
    )


def file_in_the_way(directory: Path) -> Path | None:
    """The existing file (not folder) that `directory` or one of its parents is, if any."""
    for part in (Path(directory), *Path(directory).parents):
        if part.exists() and not part.is_dir():
            return part
    return None


@contextlib.contextmanager
def guard_disk_writes(
    directory: Path, *, needed_bytes: int | None = None, setting: str = "job.output_dir"
) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT raised inside the block into one DiskFullError line, and EROFS/EACCES
    (a folder that turned read-only) into one NotWritableError line; a folder whose path is
    an existing file (a data directory or --out given as a file) is bad input, one line.
    `setting`: what the user changes to write elsewhere (the cache's writers: job.cache_dir)."""
    try:
        yield
    except OSError as exc:
        blocker = file_in_the_way(Path(directory)) if exc.errno in NOT_A_FOLDER else None
        if blocker is not None:
            raise UserError(
                f"{blocker} is an existing file, not a folder; point the path at a folder "
                "(or move the file)",
                file=str(directory),
            ) from None
        if exc.errno in NOT_WRITABLE:
            raise NotWritableError(
                not_writable_message(Path(directory), exc.strerror or "", setting)
            ) from None
        if exc.errno not in NO_SPACE:
            raise
        raise DiskFullError(_message(Path(directory), needed_bytes, setting)) from None
    except RuntimeError as exc:  # paddle.save wraps some OSErrors in RuntimeError
        text = next((t for t in NOT_WRITABLE_TEXT if t in str(exc)), None)
        if text:
            raise NotWritableError(not_writable_message(Path(directory), text, setting)) from None
        if "No space left" not in str(exc):
            raise
        raise DiskFullError(_message(Path(directory), needed_bytes, setting)) from None
