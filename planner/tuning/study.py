"""The autotuning study's storage, checked when it is opened, and who runs each trial.

- Storage: SQLite in the work directory by default, any RDB URL, or an Optuna journal file
  (several machines, one study). A SQLite file that fails SQLite's own check (truncated,
  garbled, a folder in its place) is moved aside (`<name>.damaged-<time>`) with one line
  saying so, and a new study is made; the autotuner refills it from the probe cache.
- Trials: each RUNNING trial records its planner (host, process id, process start time) and a
  lease (the latest time its probe can end) in its user attributes, through Optuna's public
  API. When a study is opened, RUNNING trials whose planner is gone (a dead process on this
  host; an expired lease elsewhere) are told FAIL, so a killed planner's trial neither blocks
  nor counts, even on an immediate rerun.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from gptplan.errors import UserError

STALE_AFTER_S = 60  # a RUNNING trial from elsewhere, past its lease by this much, is gone
OWNER_ATTR = "planner"
LEASE_ATTR = "lease_until_unix_s"
SQLITE = "sqlite:///"


def study_url(storage: str, work_dir: Path) -> str:
    """'' -> SQLite in `work_dir`; an RDB URL, a journal path or ':memory:' as given."""
    if storage:
        return storage
    work_dir.mkdir(parents=True, exist_ok=True)
    return f"{SQLITE}{work_dir / 'study.db'}"


def open_storage(url: str):
    import optuna

    if url == ":memory:":  # replay benchmarks: thousands of short studies
        return optuna.storages.InMemoryStorage()
    if "://" in url:
        if url.startswith(SQLITE):  # every folder a command writes into is created
            _create_folder_of(Path(url[len(SQLITE) :]), key="--storage")
        return _rdb_storage(url)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    _create_folder_of(Path(url), key="--storage")
    return JournalStorage(JournalFileBackend(url))


def _create_folder_of(path: Path, *, key: str) -> None:
    """The folder a storage file goes into, created (one line when it cannot be)."""
    from gptplan.diskspace import guard_disk_writes
    from gptplan.tomlconf import folder_problem

    problem = folder_problem(str(path.parent))
    if problem:
        raise UserError(problem, key=key)
    with guard_disk_writes(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)


def _rdb_storage(url: str, attempts: int = 8):
    """RDBStorage, retried: planners starting together race to create the schema."""
    import random

    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
        except (IntegrityError, OperationalError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 + random.random() * (attempt + 1))
    raise AssertionError("unreachable")


def sqlite_damage(path: Path) -> str | None:
    """What is wrong with a SQLite file (None: nothing, or it does not exist yet)."""
    if not path.exists():
        return None
    if path.is_dir():
        return "a folder stands where the database should be"
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)) as db:
            rows = db.execute("PRAGMA quick_check").fetchall()
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            return None  # another planner is writing: busy, not damaged
        if "unable to open" in str(exc):
            raise UserError(
                f"cannot open the study database: {exc}; check its permissions", file=str(path)
            ) from None
        return str(exc)
    except sqlite3.DatabaseError as exc:
        return str(exc)
    return None if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows[:3])


def repair_sqlite(url: str) -> str | None:
    """Move a damaged SQLite study aside; returns the line saying so (None: it was fine)."""
    if not url.startswith(SQLITE):
        return None
    path = Path(url[len(SQLITE) :])
    problem = sqlite_damage(path)
    if problem is None:
        return None
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    for suffix in ("", "-journal", "-wal", "-shm"):
        try:
            Path(f"{path}{suffix}").rename(f"{aside}{suffix}")
        except FileNotFoundError:
            pass  # absent, or another planner moved it first
    return f"study {path} was damaged ({problem}): moved aside to {aside.name}"


def open_study(name: str, storage, *, sampler=None, directions=("minimize",)):
    """Create or resume the study. Returns (study, numbers of the trials a gone planner had
    left RUNNING, now marked FAIL)."""
    import optuna

    study = optuna.create_study(
        study_name=name,
        storage=storage,
        sampler=sampler,
        directions=list(directions),
        load_if_exists=True,
    )
    return study, fail_stale_trials(study)


def _me() -> dict:
    import psutil

    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_unix_s": round(psutil.Process().create_time(), 2),
    }


def claim(trial, lease_s: float) -> None:
    """Record who runs `trial` and until when its work can last at most."""
    trial.set_user_attr(OWNER_ATTR, _me())
    trial.set_user_attr(LEASE_ATTR, time.time() + lease_s)


def _owner_gone(owner) -> bool | None:
    """True/False for a planner on this host; None when this host cannot tell."""
    import psutil

    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return None
    try:
        process = psutil.Process(int(owner["pid"]))
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        started = process.create_time()
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None
    return abs(started - float(owner.get("started_unix_s", started))) > 1.0  # pid reused


def is_stale(trial, now: float) -> bool:
    """Whether a RUNNING trial's planner is gone."""
    gone = _owner_gone(trial.user_attrs.get(OWNER_ATTR))
    if gone is not None:
        return gone
    lease = trial.user_attrs.get(LEASE_ATTR)
    if isinstance(lease, (int, float)):
        return now > lease + STALE_AFTER_S
    start = trial.datetime_start  # no bookkeeping (an older planner): by age
    return start is None or now - start.timestamp() > STALE_AFTER_S


def fail_stale_trials(study) -> list[int]:
    """Tell FAIL every RUNNING trial whose planner is gone; returns their numbers."""
    import optuna

    failed = []
    now = time.time()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if is_stale(trial, now):
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            failed.append(trial.number)
    return failed
