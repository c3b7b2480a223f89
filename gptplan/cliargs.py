"""Command-line parsing shared by `runner` and `planner`: a bad flag is one line, exit 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the flag (not a 10-line usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:

        if message:
            sys.stderr.write(message)
        raise SystemExit(status)
