"""What a person watching `runner execute` sees: the runner's own lines, nothing else.

`paddle.distributed.launch` prints about 40 `LAUNCH INFO` lines, Paddle's FLAGS banner and
library warnings before the first step. By default the runner sends the launcher's and the
ranks' output to the per-attempt log files and shows only the lines the training loop meant
for a person (start, step lines, budget warnings, stop reason). Rank 0 writes those lines to
its stdout (the rank log, as before) and appends them to the attempt's `console.log`, whose
path it gets from the environment; the parent `runner execute` follows that file. `--verbose`
shows the launcher's own output instead.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import TextIO

CONSOLE_ENV = "GPTPLAN_CONSOLE_FILE"


def say(text: str) -> None:
    """Print a line meant for the person running the job (rank 0 calls this)."""
    print(text, flush=True)
    path = os.environ.get(CONSOLE_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(text + "\n")
        except OSError:  # the console copy is a convenience; the rank log has the line
            pass


def quiet_paddlenlp() -> None:
    """PaddleNLP logs every saved and loaded file at INFO; keep its warnings and errors."""
    from gptplan import paddlenlp_light

    try:
        paddlenlp_light.load()
        from paddlenlp.utils.log import logger
    except ImportError:
        return
    logger.set_level("WARNING")


class Follower:
    """Print the lines appended to a file while a launched run is going (a `tail -f`)."""

    def __init__(self, path: Path, *, out: TextIO | None = None, interval: float = 0.2) -> None:
        self.path = Path(path)
        self.out = out or sys.stdout
        self.interval = interval
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, name="console-follower", daemon=True)

    def __enter__(self) -> Follower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:

        self._stop.set()
        self._thread.join(timeout=5)
        self._drain()  # whatever was written after the last poll

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._drain()

    def _drain(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # only whole lines
        if end:
            self._offset += end
            self.out.write(data[:end].decode("utf-8", errors="replace"))
            self.out.flush()
