"""`runner` / `python -m runner`: SIGTERM and SIGINT are blocked before anything else is
imported, so a notice at any moment after start is delivered to the runner's own handler
(exit 143) instead of ending the process mid-import (runner.signals)."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))


def entry() -> None:
    import os
    import sys

    from runner.billing import process_start_time

    started_at = process_start_time()
    from gptplan import paddlenlp_light
    from runner.cli import main

    paddlenlp_light.enable()  # this process's own imports: PaddleNLP's models, not all of it

    try:
        status = main(started_at=started_at)
    except SystemExit as exc:  # --help, --version, a usage error
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    # Every second in the journal: the last record is written now, and the process ends at
    # once (the interpreter's teardown of Paddle takes seconds that would go unbilled).
    import logging

    from runner.billing import last_word

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    last_word()
    if "multiprocessing.util" in sys.modules:
        # what a normal exit runs for multiprocessing (its atexit hook): pools' workers ended,
        # their semaphores unlinked, so its resource tracker has nothing to warn about after
        # our last line
        import multiprocessing.util

        try:
            multiprocessing.util._exit_function()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the exit goes on whatever a finalizer does
            pass
    os._exit(status)


if __name__ == "__main__":
    entry()
