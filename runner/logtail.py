"""A rank's log without Paddle's banners, info logs and warnings: what the failure line
(runner.failure) and the watchdog's stall line (runner.watchdog) show of it."""

from __future__ import annotations

import re

_NOISE = [
    re.compile(p)
    for p in (
        r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[\s*(INFO|WARNING|DEBUG)\]",  # paddle/paddlenlp loggers
        r"^[IWD]\d{4} \d\d:\d\d:\d\d",  # glog info/warning
        r"^=+( Modified FLAGS detected =+)?$",
        r"^FLAGS\(name=",
        r"^-{5,}",  # the FLAGS banner
        r"^\S+\.py:\d+: \w*Warning: ",
        r"^\s+warnings\.warn\(",  # Python warnings
        r"^LAUNCH (INFO|WARNING)",
        r"^\s*$",
    )
]


def clean_tail(text: str, lines: int = 12) -> list[str]:
    """The last `lines` lines that are not Paddle banners, info logs or warnings."""
    kept = [line for line in text.splitlines() if not any(p.search(line) for p in _NOISE)]
    return kept[-lines:]
