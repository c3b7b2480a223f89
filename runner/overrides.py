"""`--set section.key=value`: change one plan field on the command line, validated like the file.

The value is read as a TOML value (`8`, `1e-3`, `"bf16"`, `true`, `[1, 2]`); a bare word that
is not valid TOML is taken as a string (`--set training.precision=bf16`). The overridden plan
goes through the same strict loader as the file (plan.plan_from_dict), so an unknown key, a
wrong type or a broken cross-field rule is one line naming the key, exit status 2.
"""

from __future__ import annotations

import copy
from pathlib import Path

import tomli

from gptplan.errors import PlanError
from gptplan.plan import SECTIONS, Plan, plan_from_dict
from gptplan.tomlconf import read_toml


def parse_assignment(text: str) -> tuple[list[str], object]:
    """'training.seq_len=256' -> (['training', 'seq_len'], 256)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise PlanError(
            f"{text!r} is not SECTION.KEY=VALUE (e.g. "
            "training.per_device_train_batch_size=8); sections: "
            f"{', '.join(SECTIONS)}",
            key="--set",
        )
    if parts[0] not in SECTIONS:
        raise PlanError(
            f"{parts[0]!r} is not a plan section; allowed: {', '.join(SECTIONS)}", key="--set"
        )
    try:
        value = tomli.loads(f"v = {raw.strip()}")["v"]
    except tomli.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def load_plan_with(path: Path, assignments: list[str]) -> tuple[Plan, frozenset[str]]:
    """The plan at `path` with `--set` assignments applied; also the keys that were set."""
    path = Path(path)
    data = read_toml(path, PlanError)
    if not assignments:
        return plan_from_dict(data, file=str(path)), frozenset()
    data = copy.deepcopy(data)
    keys = []
    for text in assignments:
        (section, key), value = parse_assignment(text)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise PlanError(f"must be a table ([{section}])", file=str(path), key=section)
        table[key] = value
        keys.append(f"{section}.{key}")
    return plan_from_dict(data, file=f"{path} with --set {' '.join(assignments)}"), frozenset(keys)
