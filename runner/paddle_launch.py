"""`python -m paddle.distributed.launch`, safe to signal from its first instant.

Paddle installs C-level SIGTERM/SIGINT handlers when it is imported; its launcher replaces them
with Python ones only once its controller exists. A notice that lands in between runs Paddle's
C handler, which is not async-signal-safe: seen here as "Fatal glibc error: malloc assertion
failure" and a launcher hung for good (a preemption notice half a second after start).

So this entry blocks the two signals, imports Paddle's launcher, installs a handler for the
moments before the controller exists (no rank has been started then: it simply exits
128 + signal), unblocks (a notice that came meanwhile is delivered now) and runs the launcher
with Paddle's own argument parsing, exactly as `python -m paddle.distributed.launch` would.
"""

import os
import signal
from types import FrameType

from runner import signals


def _before_controller(signum: int, frame: FrameType | None) -> None:

    os._exit(128 + signum)  # nothing started yet; SystemExit could be swallowed by Paddle


def main() -> None:
    signals.block()
    from paddle.distributed.launch.main import launch  # installs Paddle's C handlers

    for sig in signals.SIGNALS:
        signal.signal(sig, _before_controller)
    signals.unblock()  # a notice that came meanwhile is delivered now
    launch()  # its controller installs Paddle's Python handlers before starting any rank


if __name__ == "__main__":
    main()
