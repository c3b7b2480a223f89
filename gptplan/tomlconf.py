"""Strict mapping between TOML tables and typed dataclasses, and atomic TOML writes.

Every dataclass field is declared with `setting(default, "doc", ...)`; `from_table` rejects
unknown keys (with a did-you-mean hint), wrong types, values outside `Literal` choices and
out-of-range numbers, each as one `UserError` line naming the file and the dotted key.
The planner's spec and the runner's plan both use this module, so the rules are the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tempfile
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import tomli
import tomli_w

from gptplan.errors import UserError

T = TypeVar("T")


NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
NAME_RULE = (
    "1 to 64 letters, digits, '-' or '_', starting with a letter or digit (it names "
    "a file in its folder)"
)


def name_problem(value: Any) -> str | None:
    """The one name rule (plan names, spec job names, price list names): names become file
    names, so never '', spaces, '/', '..' or control characters."""
    if isinstance(value, str) and NAME_PATTERN.match(value):
        return None
    return f"{value!r} is not a valid name; use {NAME_RULE}"


def folder_problem(value: str) -> str | None:
    """A folder the program will create/write: no part of it may be an existing file."""
    path = Path(value)
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            return f"{str(value)!r}: {part} is an existing file, not a folder; point it at a folder"
    return None


# The sane-range rule: no number a user can set means anything above this (a quadrillion
# tokens, steps, bytes per second or currency units). A setting that states its own `max` uses
# that; every other numeric setting gets this one, so a typo like 1e18 or 1e30 is refused at
# load like any other bad input.
DEFAULT_MAX = 1e15


def setting(
    default: Any,
    doc: str,
    *,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    name: bool = False,
) -> Any:
    """A documented dataclass field with an optional numeric range (numbers must also be
    finite and at most DEFAULT_MAX unless `max` says otherwise) or, with `name=True`, the name
    rule."""
    if max is None and isinstance(default, (int, float)) and not isinstance(default, bool):
        max = DEFAULT_MAX
    meta = {"doc": doc, "min": min, "max": max, "min_exclusive": min_exclusive, "name": name}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def read_toml(path: Path, error: type[UserError] = UserError) -> dict:
    """Parse a TOML file; a missing file or a syntax error becomes one clear line."""
    try:
        with open(path, "rb") as handle:
            return tomli.load(handle)
    except FileNotFoundError:
        raise error("file not found", file=str(path)) from None
    except IsADirectoryError:
        raise error("is a directory, expected a TOML file", file=str(path)) from None
    except tomli.TOMLDecodeError as exc:
        raise error(
            f"malformed TOML: {exc}{_offending_key(path, str(exc))}", file=str(path)
        ) from None
    except UnicodeDecodeError:
        raise error("not UTF-8 text; TOML files must be UTF-8", file=str(path)) from None


def _offending_key(path: Path, message: str) -> str:
    """For duplicate keys/tables, name the key (tomli only gives line and column)."""
    match = re.search(r"at line (\d+)", message)
    if not match or not ("overwrite" in message or "declare" in message):
        return ""
    try:
        line = Path(path).read_text(encoding="utf-8").splitlines()[int(match.group(1)) - 1]
    except (OSError, UnicodeDecodeError, IndexError):
        return ""
    key = line.split("=", 1)[0].strip() if "=" in line else line.strip()
    return f"; {key!r} is given twice (each key and table may appear once)"


def table_array(
    data: Mapping[str, Any], key: str, *, file: str, error: type[UserError] = UserError
) -> list[dict]:
    """`data[key]` as an array of tables ([[key]]; [] when absent): anything else (a number, a
    string, one [key] table, a list of non-tables) is one line naming the file and the key."""
    value = data.get(key, [])
    if not isinstance(value, list):
        raise error(
            f"{value!r} is not an array of tables; write [[{key}]] blocks", file=file, key=key
        )
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise error(
                f"{item!r} is not a table; write [[{key}]] blocks", file=file, key=f"{key}[{i}]"
            )
    return value


def write_toml_atomic(path: Path, data: dict, header: str = "") -> None:
    """Write TOML to a temporary file in the same folder, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = header + tomli_w.dumps(data)
    write_text_atomic(path, text)


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename: never half-written. A full disk becomes
    one DiskFullError line (gptplan.diskspace)."""
    from gptplan.diskspace import guard_disk_writes

    path = Path(path)
    with guard_disk_writes(path.parent, needed_bytes=len(text.encode())):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (list, list):
        return f"a list of {_describe(get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, value) for `value` checked against the annotation `tp`."""
    origin = get_origin(tp)
    if origin is Literal:
        return (value in get_args(tp) and type(value) is type(get_args(tp)[0])), value
    if origin in (list, list):
        if not isinstance(value, list):
            return False, value
        (item_tp,) = get_args(tp)
        items = []
        for item in value:
            ok, item = _coerce(item, item_tp)
            if not ok:
                return False, value
            items.append(item)
        return True, items
    if origin in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            ok, coerced = _coerce(value, arg)
            if ok:
                return True, coerced
        return False, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return True, float(value)
    if tp is str:
        return isinstance(value, str), value
    return False, value


def _check_text(value: Any) -> str | None:
    texts = value if isinstance(value, list) else [value]
    for text in texts:
        if isinstance(text, str) and any(ord(c) < 32 or ord(c) == 127 for c in text):
            return "contains a control character (e.g. NUL); use plain text"
    return None


def _check_range(value: Any, meta: Mapping[str, Any]) -> str | None:
    if meta.get("name"):
        if name_problem(value):
            return f"is not a valid name; use {NAME_RULE}"
    problem = _check_text(value)
    if problem:
        return problem
    if isinstance(value, list):
        for item in value:
            if isinstance(item, float) and not math.isfinite(item):
                return "must hold finite numbers (no inf or nan)"
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number (no inf or nan)"
    low, high = meta.get("min"), meta.get("max")
    too_low = low is not None and (value <= low if meta.get("min_exclusive") else value < low)
    if too_low or (high is not None and value > high):
        return f"must be {range_text(meta)}"
    return None


def range_text(meta: Mapping[str, Any]) -> str:
    """The allowed range of a `setting`, e.g. '>= 0 and <= 1' ('' when unbounded)."""
    low, high = meta.get("min"), meta.get("max")
    parts = []
    if low is not None:
        parts.append(f"{'>' if meta.get('min_exclusive') else '>='} {low}")
    if high is not None:
        parts.append(f"<= {high}")
    return " and ".join(parts)


def unknown_key_error(
    key: str, allowed: list[str], *, file: str, prefix: str, error: type[UserError]
) -> UserError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return error(
        f"unknown key{hint}; allowed: {', '.join(sorted(allowed))}", file=file, key=f"{prefix}{key}"
    )


def from_table(
    cls: type[T], table: Any, *, file: str, section: str, error: type[UserError] = UserError
) -> T:
    """Build the dataclass `cls` from one TOML table, strictly."""
    if not isinstance(table, dict):
        raise error(f"must be a table ([{section}])", file=file, key=section)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    prefix = f"{section}." if section else ""
    for key in table:
        if key not in fields:
            raise unknown_key_error(key, list(fields), file=file, prefix=prefix, error=error)
    values = {}
    for name, field in fields.items():
        if name not in table:
            continue
        ok, value = _coerce(table[name], hints[name])
        if not ok:
            raise error(
                f"{table[name]!r} is not {_describe(hints[name])}", file=file, key=f"{prefix}{name}"
            )
        problem = _check_range(value, field.metadata)
        if problem:
            raise error(f"{value!r} {problem}", file=file, key=f"{prefix}{name}")
        values[name] = value
    return cls(**values)


def to_table(obj: Any) -> dict:
    """Dataclass to a plain dict fit for tomli_w (nested dataclasses become tables)."""
    out = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            value = to_table(value)
        out[field.name] = value
    return out
