"""`runner` / `python -m runner`: SIGTERM and SIGINT are blocked before anything else is
imported, so a notice at any moment after start is delivered to the runner's own handler
(exit 143) instead of ending the process mid-import (runner.signals)."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))


def entry() -> None:
    import sys

    from runner.billing import process_start_time
    from runner.cli import main

    sys.exit(main(started_at=process_start_time()))


if __name__ == "__main__":
    entry()
