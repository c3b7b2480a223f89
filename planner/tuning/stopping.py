"""A planner stopped by SIGTERM or SIGINT: end its probes, fail its running trials, one line.

`stop_on_signals()` turns the two signals into a `Stopped` exception raised in the main thread
(like KeyboardInterrupt, it is no `Exception`, so nothing swallows it); the autotuner fails the
trial it is running and ends the probe process groups it started, and the CLI prints one line
and exits 128 + the signal (143 for SIGTERM, 130 for SIGINT).

Paddle installs C-level handlers when it is imported (they print a "FatalError: Termination
signal" block); so the signals are blocked while Paddle is imported, our handlers go over
Paddle's, and a signal that arrived meanwhile is delivered then. `held()` defers a signal over
a few storage writes (asking a trial and recording who runs it), so no trial is left half-made.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_state = {"held": 0, "pending": 0}


class Stopped(BaseException):
    """The planner was asked to stop by a signal."""

    def __init__(self, signum: int):
        self.signum = signum
        self.failed_trials: list[int] = []  # trial numbers marked failed on the way out
        self.probes_ended = 0  # probe workers whose process groups were ended
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    def summary(self) -> str:
        """The one line the CLI prints."""
        name = signal.Signals(self.signum).name
        if not self.failed_trials and not self.probes_ended:
            return f"planner stopped by {name} (no probe or trial was running)"
        numbers = ", ".join(f"#{n}" for n in self.failed_trials)
        trials = (
            f"running trial {numbers} marked failed"
            if len(self.failed_trials) == 1
            else f"running trials {numbers} marked failed"
            if self.failed_trials
            else "no trial was running"
        )
        return (
            f"planner stopped by {name}: {self.probes_ended} probe worker(s) ended, "
            f"{trials}; run the same command again to resume the study"
        )


def _raise(signum, _frame) -> None:
    if _state["held"]:
        _state["pending"] = _state["pending"] or signum
        return
    raise Stopped(signum)


@contextmanager
def stop_on_signals(*, import_paddle: bool = False):
    """SIGTERM/SIGINT raise `Stopped` inside the block; the previous handlers come back after.
    `import_paddle`: import Paddle first (signals blocked), so its handlers cannot replace
    ours later."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: nothing to install
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    old = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        if import_paddle:
            import paddle  # noqa: F401  (installs its own handlers: ours go over them)
        for sig in SIGNALS:
            signal.signal(sig, _raise)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def held():
    """Defer SIGTERM/SIGINT until the block is done (a few storage writes)."""
    _state["held"] += 1
    try:
        yield
    finally:
        _state["held"] -= 1
        if not _state["held"] and _state["pending"]:
            signum, _state["pending"] = _state["pending"], 0
            raise Stopped(signum)
