"""Children that die with their parent: PR_SET_PDEATHSIG, set in the child before exec.

Used for every process we start that must not outlive its starter (probe launchers and
probe workers under the planner). The kernel delivers the signal when the parent thread ends,
however it ends (SIGKILL included); the launched ranks carry the same setting towards their
launcher (runner/_launch_entry.py), so the whole chain goes down within a moment.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent ends; False if unsupported."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return False
    return True


TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def default_signal_state() -> None:
    """Give this process the default signal mask and actions for SIGTERM/SIGINT.

    For the first thing a child we start runs (a pool worker's initializer): a `spawn` child
    inherits its starter's signal mask through exec, and the runner blocks both signals while
    it starts (runner.__main__), so without this Pool.terminate() could never end a worker and
    the pool's join would wait for good.
    """
    for sig in TERMINATION_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINATION_SIGNALS)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen (Linux; None elsewhere)."""
    if sys.platform != "linux":
        return None
    parent = os.getpid()

    def preexec() -> None:
        if set_parent_death_signal(sig) and os.getppid() != parent:
            os.kill(os.getpid(), sig)  # the parent died before the prctl took effect

    return preexec
