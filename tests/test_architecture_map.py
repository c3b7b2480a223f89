"""The README's architecture map names every module of the three floors, and only modules
that exist (issue 19: the map had left out 19 of them)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("gptplan", "runner", "planner")


def _map_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Architecture", 1)[1]
    return section.split("```", 2)[1]


def _mapped_modules() -> set[str]:
    modules, folder = set(), None
    for line in _map_block().splitlines():
        head = re.match(r"^([a-z_]+)/\s", line + " ")
        if head:
            folder = head.group(1)
            continue
        entry = re.match(r"^\s{2,}([A-Za-z_][\w]*\.py)\s", line + " ")
        if entry and folder in FLOORS:
            modules.add(f"{folder}/{entry.group(1)}")
    return modules


def _modules_on_disk() -> set[str]:
    return {
        f"{floor}/{p.name}"
        for floor in FLOORS
        for p in (ROOT / floor).glob("*.py")
        if p.name != "__init__.py"
    }


def test_every_module_is_on_the_map():
    missing = sorted(_modules_on_disk() - _mapped_modules())
    assert not missing, f"README architecture map lacks: {missing}"


def test_the_map_names_no_module_that_is_gone():
    gone = sorted(_mapped_modules() - _modules_on_disk())
    assert not gone, f"README architecture map names modules that do not exist: {gone}"
