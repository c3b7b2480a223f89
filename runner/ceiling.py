"""The budget's deadline on the runner's own clock, from its first second to its last.

runner.budget computes when an attempt must be over (`deadline`: the runner's process start
plus what the budget has left, less the teardown). Launched ranks stop themselves before it at
a step boundary, and runner.launch.run_group kills a launcher still running at it; but data
preparation, writing the run's files, an in-process rank's start-up and the wait before the
launcher exists happen in this process. An interval timer (SIGALRM) set for the deadline
covers them all: at the deadline whatever runs is interrupted (BudgetDeadline), its pool
workers and launched group are ended by their own clean-up, and the attempt is closed.

Start-up (without data preparation: a cold cache is a one-off) is also remembered per machine
and plan shape (`startup_seconds.json` in the cache folder, the slowest seen): the pre-launch
check of the next run of that shape on this machine uses it instead of the stated bound when
it is larger.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from gptplan import userdata
from gptplan.plan import Plan

STARTUP_FILE = "startup_seconds.json"
# Test-only: seconds to sleep in the launch path (a start-up slower than any measured).
LAUNCH_DELAY_ENV = "RUNNER_TEST_LAUNCH_DELAY_S"


class BudgetDeadline(BaseException):
    """Raised in the runner's main thread when the attempt reaches the budget's deadline."""


def _raise(signum: int, frame: FrameType | None) -> None:
    raise BudgetDeadline()


@contextmanager
def enforced(deadline: float | None) -> Iterator[None]:
    """Raise BudgetDeadline in this (main) thread at `deadline` (time.time()) if the block is
    still running then; nothing without a deadline or off the main thread."""
    if deadline is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline - time.time()))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def injected_delay() -> None:
    """Sleep for RUNNER_TEST_LAUNCH_DELAY_S seconds (tests slow start-up down with it)."""
    try:
        seconds = float(os.environ.get(LAUNCH_DELAY_ENV, "0") or 0)
    except ValueError:
        return
    if 0 < seconds < float("inf"):
        time.sleep(seconds)


def shape_key(plan: Plan) -> str:
    """Plans of one shape start up alike on one machine: device, processes, model size."""
    from gptplan.modelfacts import parameter_count

    p = plan.parallel
    return (
        f"{plan.hardware.device}:{p.nnodes}x{p.nproc_per_node}:"
        f"{plan.model.family}:{parameter_count(plan.model)}"
    )


def _startup_file(plan: Plan) -> Path:
    return userdata.cache_dir(plan.job.cache_dir) / STARTUP_FILE


def machine_startup_s(plan: Plan) -> float | None:
    """The slowest start-up measured on this machine for plans of this shape, if any."""
    data = userdata.read_json_record(_startup_file(plan), what="measured start-up record")
    try:
        value = (data or {})[shape_key(plan)]["slowest_s"]
    except (KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and 0 < value < 1e7 else None


def record_startup(plan: Plan, seconds: float | None, *, data_prep_s: float = 0.0) -> None:
    """Keep `seconds` (measured runner start to first step, less the attempt's data
    preparation: a cold cache is a one-off) if slower than any seen."""
    if not isinstance(seconds, (int, float)) or not 0 < seconds < 1e7:
        return
    seconds -= min(seconds, max(0.0, data_prep_s))
    if seconds <= 0:
        return
    from gptplan.tomlconf import write_text_atomic

    path = _startup_file(plan)
    data = userdata.read_json_record(path, what="measured start-up record") or {}
    key = shape_key(plan)
    old = data.get(key, {}).get("slowest_s", 0.0) if isinstance(data.get(key), dict) else 0.0
    if isinstance(old, (int, float)) and old >= seconds:
        return
    data[key] = {
        "slowest_s": round(float(seconds), 3),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, indent=1))
    except OSError:  # a full or read-only cache loses a hint, never the run
        pass
