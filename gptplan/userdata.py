"""The user data directory: what this machine adds to the shipped, read-only data.

The package's own files (hardware_profiles/, planner/specs/) are never written. What a user's
machine adds lives in one folder, layered over them:

  offers/        price lists written by `planner prices import` (read after the shipped ones)
  calibration/   this machine's fitted efficiency per profile (`planner calibrate`, probes)
  cache/         trained tokenizers, tokenized corpora, corpus statistics, probe results and
                 the measured data-preparation rate (a plan's or spec's `job.cache_dir`, when
                 that is '')

The folder is `$GPTPLAN_DATA_DIR` if set (both tools' `--data-dir DIR` sets it for themselves
and every process they start), else the platform's user data folder for "gptplan" (XDG on
Linux: `$XDG_DATA_HOME/gptplan`, by default `~/.local/share/gptplan`; platformdirs' rule).
`$GPTPLAN_CALIBRATION_DIR`, where set, still moves the calibration folder alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gptplan.progress import Log

DATA_ENV = "GPTPLAN_DATA_DIR"
CALIBRATION_ENV = "GPTPLAN_CALIBRATION_DIR"
APP = "gptplan"


def _platform_data_home() -> Path:
    """platformdirs.user_data_dir's folder for the platform (without the dependency)."""
    try:
        import platformdirs

        return Path(platformdirs.user_data_dir(APP, appauthor=False))
    except ImportError:
        pass
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / APP
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local") / APP
    xdg = os.environ.get("XDG_DATA_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else home / ".local" / "share") / APP


def data_dir() -> Path:
    """The user data directory (created by whoever writes into it, never by reading)."""
    override = os.environ.get(DATA_ENV, "")
    return Path(override).expanduser() if override else _platform_data_home()


def offers_dir() -> Path:
    """Where `planner prices import` writes price lists."""
    return data_dir() / "offers"


def calibration_dir() -> Path:
    """Where this machine's calibrations are written and read."""
    override = os.environ.get(CALIBRATION_ENV, "")
    return Path(override).expanduser() if override else data_dir() / "calibration"


def cache_dir(setting: str | Path = "") -> Path:
    """A plan's or spec's `job.cache_dir`: itself when given, else the user data cache."""
    return Path(setting) if str(setting) else data_dir() / "cache"


def add_flag(parser: argparse.ArgumentParser, *, top: bool = True) -> None:
    """`--data-dir DIR` on a tool's parser and on each of its (nested) subcommands, so that it
    may stand before or after the command."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None if top else argparse.SUPPRESS,
        metavar="DIR",
        help=f"user data directory: imported prices, calibration, caches (default: "
        f"${DATA_ENV}, else ~/.local/share/{APP} or the platform's equivalent)",
    )
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                add_flag(sub, top=False)


def apply_flag(args: argparse.Namespace) -> None:
    """Make `--data-dir` this process's and its children's data directory (a UserError, one
    line, when it names an existing file)."""
    from gptplan.errors import UserError
    from gptplan.tomlconf import folder_problem

    folder = getattr(args, "data_dir", None)
    if folder is None:
        return
    folder = Path(folder).expanduser().absolute()
    problem = folder_problem(str(folder))
    if problem:
        raise UserError(problem, key="--data-dir")
    os.environ[DATA_ENV] = str(folder)


def read_json_record(path: Path, *, what: str, log: Log | None = None) -> dict | None:
    """A JSON object this machine recorded in a cache (a measured rate, a start-up time,
    corpus statistics), or None when there is none. A damaged one (not UTF-8, not JSON, not
    an object; a folder, a link or an unreadable file in its place) is never a traceback: it
    is moved aside to `<name>.damaged.<time>` (kept, never deleted) with one line on stderr,
    and None is returned, so the value is measured again and written anew. `log`: where the
    line goes (default: stderr, as a warning)."""
    import json
    import time

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    problem = None
    data = None
    if path.is_symlink() or not path.is_file():
        problem = "not a regular file"
    else:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            problem = f"not readable: {exc.strerror or type(exc).__name__}"
        except UnicodeDecodeError:
            problem = "not UTF-8 text"
        except ValueError:
            problem = "not JSON"
        else:
            if not isinstance(data, dict):
                problem = "not a JSON object"
    if problem is None:
        return data
    target = path.with_name(f"{path.name}.damaged.{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.replace(path, target)
        done = f"moved to {target.name}; measured again"
    except OSError as exc:
        done = f"ignored (it cannot be moved aside: {exc.strerror}); measured again"
    line = f"{what} {path} is damaged ({problem}); {done}"
    if log is None:
        print(f"warning: {line}", file=sys.stderr)
    else:
        log(line)
    return None
