"""One error hierarchy for everything a user can get wrong.

A `UserError` is bad input: the CLIs print its one-line message and exit with status 2, without
a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: names the file, the key, what is allowed and how to fix it."""

    exit_status = 2

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file = file
        self.key = key
        self.detail = message
        super().__init__(message)

    def __str__(self) -> str:
        where = ": ".join(part for part in (self.file, self.key) if part)
        return f"{where}: {self.detail}" if where else self.detail


class PlanError(UserError):
    """The plan TOML is malformed or describes an impossible run."""


class DataError(UserError):
    """The corpus or tokenizer cannot be used (missing, empty, not UTF-8)."""


class HardwareError(UserError):
    """The plan asks for hardware this machine does not have."""


class BudgetError(UserError):
    """The budget cannot buy what was asked (not even one step)."""


class DiskFullError(UserError):
    """A write failed (or would fail) for lack of space: one line naming the folder and the
    bytes needed; exit status 1 (the input was fine, the machine is not)."""

    exit_status = 1


class NotWritableError(UserError):
    """A folder the run writes stopped accepting writes (read-only file system, permissions):
    one line naming it; exit status 1 (the input was fine, the machine is not)."""

    exit_status = 1
