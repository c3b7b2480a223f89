"""Reading and writing a plan: `load_plan` is strict (unknown keys, types, choices, ranges,
then the cross-field rules of gptplan.plan.checks); `write_plan` checks the text it is about to
write with the same code, then writes it atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptplan import precision as precisions
from gptplan.errors import PlanError
from gptplan.plan.checks import validate
from gptplan.plan.schema import SCHEMA_VERSION, SECTIONS, Plan
from gptplan.tomlconf import (
    from_table,
    name_problem,
    read_toml,
    unknown_key_error,
    write_text_atomic,
)


def plan_from_dict(data: dict, *, file: str = "<plan>") -> Plan:
    """Build and validate a Plan from parsed TOML."""
    allowed_top = ["schema", "name", *SECTIONS]
    for key in data:
        if key not in allowed_top:
            raise unknown_key_error(key, allowed_top, file=file, prefix="", error=PlanError)
    schema = data.get("schema")
    if isinstance(schema, bool) or schema != SCHEMA_VERSION:  # `true` is no version (bool is int)
        raise PlanError(
            f"{schema!r} is not a supported schema version; allowed: {SCHEMA_VERSION}",
            file=file,
            key="schema",
        )
    name = data.get("name")
    problem = name_problem(name)
    if problem:
        raise PlanError(problem, file=file, key="name")
    chosen = data["training"].get("precision") if isinstance(data.get("training"), dict) else None
    if isinstance(chosen, str) and chosen in precisions.TABLE.by_name:  # known, maybe unplannable
        refused = precisions.refusal(chosen)
        if refused:
            raise PlanError(refused, file=file, key="training.precision")
    sections: dict[str, Any] = {
        section: from_table(cls, data.get(section, {}), file=file, section=section, error=PlanError)
        for section, cls in SECTIONS.items()
    }
    plan = Plan(name=str(name), **sections)
    validate(plan, file=file)
    return plan


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    return plan_from_dict(read_toml(path, PlanError), file=str(path))


def write_plan(plan: Plan, path: str | Path, *, header: str = "") -> None:
    """Validate with the code that loads a plan (the text to be written, read back through
    plan_from_dict: every key's type and range, then the plan's rules, as `runner execute`
    reads it), then write atomically (temp file + rename): a plan written always loads, and
    is never half-written."""
    import tomli
    import tomli_w

    text = tomli_w.dumps(plan.to_dict())
    plan_from_dict(tomli.loads(text), file=str(path))
    write_text_atomic(Path(path), header + text)
