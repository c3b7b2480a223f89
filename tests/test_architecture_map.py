"""The architecture map (docs/architecture.md) names every module of the three floors, at any
depth, and only modules that exist (issue 19: the map had left out 19 of them; issue 38: it
moved out of the README, and subpackages count too)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
FLOORS = ("gptplan", "runner", "planner")


def _map_block(text: str) -> str:
    section = text.split("\n## The map", 1)[1]
    return section.split("```", 2)[1]


def mapped(block: str) -> tuple[set[str], set[str]]:
    """(modules, subpackages) the map names, as paths from the repository root.

    A line at column 0 `floor/` opens a floor; below it, an indented line's first word is a
    module (`name.py`, or `sub/name.py`) or a subpackage (`sub/`). A subpackage line also opens
    that folder for the lines indented deeper than it."""
    modules: set[str] = set()
    packages: set[str] = set()
    floor: str | None = None
    stack: list[tuple[int, str]] = []  # (indent, folder) of the open subpackages
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        word = line.split()[0]
        if indent == 0:
            floor = word.rstrip("/") if word.rstrip("/") in FLOORS else None
            stack = []
            continue
        if floor is None:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "/".join([floor, *(folder for _, folder in stack)])
        if re.fullmatch(r"[A-Za-z_][\w/]*\.py", word):
            modules.add(f"{prefix}/{word}")
            if "/" in word:
                packages.add(f"{prefix}/{word.rsplit('/', 1)[0]}")
        elif re.fullmatch(r"[A-Za-z_][\w/]*/", word):
            packages.add(f"{prefix}/{word.rstrip('/')}")
            stack.append((indent, word.rstrip("/")))
    return modules, packages


def on_disk(root: Path = ROOT) -> tuple[set[str], set[str]]:
    """(modules other than __init__.py, subpackages) under the three floors, at any depth."""
    modules, packages = set(), set()
    for floor in FLOORS:
        for path in (root / floor).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" in rel:
                continue
            if path.name == "__init__.py":
                if path.parent != root / floor:
                    packages.add(path.parent.relative_to(root).as_posix())
            else:
                modules.add(rel)
    return modules, packages


def _both() -> tuple[tuple[set[str], set[str]], tuple[set[str], set[str]]]:
    return mapped(_map_block(PAGE.read_text(encoding="utf-8"))), on_disk()


def test_every_module_and_subpackage_is_on_the_map():
    (mods, pkgs), (disk_mods, disk_pkgs) = _both()
    missing = sorted((disk_mods - mods) | (disk_pkgs - pkgs))
    assert not missing, f"docs/architecture.md's map lacks: {missing}"


def test_the_map_names_no_module_that_is_gone():
    (mods, pkgs), (disk_mods, disk_pkgs) = _both()
    init = {m for m in mods if m.endswith("/__init__.py")}
    gone = sorted((mods - init - disk_mods) | (pkgs - disk_pkgs))
    gone += sorted(m for m in init if not (ROOT / m).exists())
    assert not gone, f"docs/architecture.md's map names modules that do not exist: {gone}"


def test_the_parser_reads_nested_and_flat_subpackages():
    block = (
        "planner/   the search\n"
        "  cli.py     commands\n"
        "  market/    prices and offers\n"
        "    prices.py   import\n"
        "    offers.py   offers\n"
        "  screen/search.py  the screen\n"
        "  top.py     back at the floor\n"
        "plans/     not a floor\n"
        "  x.py     ignored\n"
    )
    mods, pkgs = mapped(block)
    assert mods == {
        "planner/cli.py",
        "planner/market/prices.py",
        "planner/market/offers.py",
        "planner/screen/search.py",
        "planner/top.py",
    }
    assert pkgs == {"planner/market", "planner/screen"}
