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
    """floor/name.py for a floor's entries (two spaces in); floor/sub/name.py for the entries
    four spaces in under a subfolder line ("  market/ ..."); one line may list several modules
    separated by "|"."""
    modules, folder, sub = set(), None, None
    for line in _map_block().splitlines():
        head = re.match(r"^([a-z_]+)/\s", line + " ")
        if head:
            folder, sub = head.group(1), None
            continue
        subfolder = re.match(r"^  ([a-z_]+)/\s", line + " ")
        if subfolder:
            sub = subfolder.group(1)
            continue
        entry = re.match(r"^  ([A-Za-z_]\w*\.py)\s", line + " ")
        if entry and folder in FLOORS:
            sub = None
            modules.add(f"{folder}/{entry.group(1)}")
            continue
        listed = re.match(r"^ {4}([A-Za-z_]\w*\.py(?:\s*\|\s*[A-Za-z_]\w*\.py)*)", line)
        if listed and folder in FLOORS:
            prefix = f"{folder}/{sub}/" if sub else f"{folder}/"
            modules |= {prefix + name for name in re.findall(r"\w+\.py", listed.group(1))}
    return modules


def _modules_on_disk() -> set[str]:
    """Every module of the three floors; the planner's subpackages (by concern) included."""
    found = set()
    for floor in FLOORS:
        paths = (ROOT / floor).rglob("*.py") if floor == "planner" else (ROOT / floor).glob("*.py")
        found |= {
            p.relative_to(ROOT).as_posix()
            for p in paths
            if p.name != "__init__.py" and "__pycache__" not in p.parts
        }
    return found


def test_every_module_is_on_the_map():
    missing = sorted(_modules_on_disk() - _mapped_modules())
    assert not missing, f"README architecture map lacks: {missing}"


def test_the_map_names_no_module_that_is_gone():
    gone = sorted(_mapped_modules() - _modules_on_disk())
    assert not gone, f"README architecture map names modules that do not exist: {gone}"
