"""SIGTERM/SIGINT (a spot preemption notice) can land at any moment: the run exits 143.

Paddle installs its own C-level handlers when it is imported (they end the process with
"FatalError: Termination signal is detected", exit 1). So both the runner and every rank block
the two signals first, import Paddle, install Python handlers, then unblock: a notice that
arrived meanwhile is delivered then, to our handler.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_SIGNALLED = 143  # 128 + SIGTERM, what schedulers expect from a preempted job


class Terminated(BaseException):
    """Raised in the runner process by a SIGTERM/SIGINT outside the training group."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def block() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def raise_on_signal() -> None:
    """Install the raising handler (after Paddle is imported), then deliver pending ones."""
    for sig in SIGNALS:
        signal.signal(sig, _raise)
    unblock()


@contextmanager
def restored_on_exit() -> Iterator[None]:
    """Give the caller back its signal mask and SIGTERM/SIGINT handlers when the block ends."""
    main_thread = threading.current_thread() is threading.main_thread()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
