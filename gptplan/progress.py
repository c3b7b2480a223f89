"""Progress for a person at a terminal; whole log lines, or nothing, anywhere else.

A live bar (tqdm, on stderr) is drawn only when stderr is a terminal. In a pipe, a log file or
a test's captured output there is no bar, by construction: an assertion on console lines ("one
error line, exit 2") never sees one, however long the work took on a loaded machine. Work that
may run for hours unwatched (the data preparation) reports instead through its `log` callable:
a whole line every `every_s` seconds on the log channel (stdout / the run's console.log).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Protocol

Log = Callable[[str], object]  # where progress lines go (print, a run's console log)

# A bar appears once the work has taken this long (short work shows none)
DELAY_S = 5.0


def quiet(*_args: object, **_kwargs: object) -> None:
    """A `log` callable that writes nothing (the default where no one is watching)."""
    return None


def stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class ProgressBar(Protocol):
    """What `bar` gives: a tqdm bar or a LineProgress."""

    def update(self, n: float = 1, /) -> object: ...
    def set_postfix_str(self, text: str = "", /, refresh: bool = True) -> object: ...

    def close(self) -> object: ...
    def __enter__(self) -> ProgressBar: ...
    def __exit__(self, *exc: object) -> object: ...


class LineProgress:
    """The tqdm calls the callers use (update, set_postfix_str, close), as whole log lines
    every `every_s` seconds after the first `delay_s` (no `log`: silent)."""

    def __init__(
        self, *, total: float, desc: str, unit: str, log: Log | None = None, every_s: float = 30.0
    ) -> None:
        self.total, self.desc, self.unit, self.log, self.every_s = total, desc, unit, log, every_s
        self.n = 0.0
        self.postfix = ""
        self.start = self.last = time.monotonic()

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.log is None or now - self.last < self.every_s or now - self.start < DELAY_S:
            return
        self.last = now
        share = f"{self.n / self.total:.0%} of " if self.total else ""
        rate = self.n / max(now - self.start, 1e-9)
        postfix = f", {self.postfix}" if self.postfix else ""
        self.log(
            f"{self.desc}: {share}{self.total or self.n:,.0f} {self.unit} "
            f"({rate:,.0f} {self.unit}/s{postfix})"
        )

    def set_postfix_str(self, text: str = "", refresh: bool = False) -> None:
        self.postfix = text

    def close(self) -> None:
        return None

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(
    *,
    total: float,
    desc: str,
    unit: str,
    log: Log | None = None,
    every_s: float = 30.0,
    enabled: bool = True,
) -> ProgressBar:
    """A tqdm bar on a terminal; else LineProgress (lines through `log`, or silent)."""
    if enabled and stderr_is_terminal():
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=desc,
            unit=unit,
            unit_scale=True,
            delay=DELAY_S,
            mininterval=2.0,
            leave=False,
            file=sys.stderr,
        )
    return LineProgress(
        total=total, desc=desc, unit=unit, log=log if enabled else None, every_s=every_s
    )
