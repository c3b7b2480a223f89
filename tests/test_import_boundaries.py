"""The three floors (DESIGN.md): the core `gptplan` imports neither tool; the runner imports the
core only; the planner imports the core and `runner.probe` only. Checked on the source (every
import statement, including the ones inside functions), not on what happens to be loaded."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED = {
    "gptplan": {"gptplan"},
    "runner": {"gptplan", "runner"},
    "planner": {"gptplan", "planner", "runner.probe"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from runner import probe` names the module runner.probe
            found += [
                (node.lineno, f"{node.module}.{alias.name}")
                for alias in node.names
                if node.module in ALLOWED
            ]
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top not in ALLOWED or module in ALLOWED[package]:
                continue
            if any(module == a or module.startswith(a + ".") for a in ALLOWED[package]):
                continue
            if top == module and any(a.startswith(top + ".") for a in ALLOWED[package]):
                continue  # `from runner import probe`: judged by the submodule entry
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_only_downward(package):
    assert violations(package) == []


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    (tmp_path / "gptplan").mkdir()
    (tmp_path / "gptplan" / "bad.py").write_text("def f():\n    from runner.train import train\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert violations("gptplan") == ["gptplan/bad.py:2 imports runner.train"]


# Inside the planner, by concern (planner/__init__.py): each part may import only the parts
# named here (and the package root, which holds the version); a part's own modules import
# each other freely. An import into a part not listed is a new arrow in the house's map:
# add it here on purpose, or move the code.
PLANNER_PARTS = {
    "spec": set(),
    "market": {"spec"},
    "corpus": {"spec", "market"},
    "screen": {"spec", "market", "corpus"},
    "writing": {"spec", "market", "corpus", "screen"},
    "tuning": {"spec", "market", "corpus", "screen", "writing"},
    "reporting": {"spec", "market", "corpus", "screen", "writing", "tuning"},
    "pipeline": {"spec", "market", "corpus", "screen", "writing", "tuning", "reporting"},
    "commands": {
        "spec",
        "market",
        "corpus",
        "screen",
        "writing",
        "tuning",
        "reporting",
        "pipeline",
    },
    "__main__": {"commands"},
}


def planner_part(module: str) -> str | None:
    """planner.screen.table -> 'screen'; planner.spec -> 'spec'; the package root (and a name
    it holds, planner.__version__) -> None."""
    parts = module.split(".")
    if parts[0] != "planner" or len(parts) < 2 or parts[1] == "__version__":
        return None
    return parts[1]


def planner_edge_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "planner").rglob("*.py")):
        rel = path.relative_to(root)
        parts = rel.with_suffix("").parts
        mine = planner_part(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        if mine is None:  # planner/__init__.py: the version only
            continue
        assert mine in PLANNER_PARTS, f"{rel}: a part of the planner missing from PLANNER_PARTS"
        for line, module in imported_modules(path):
            theirs = planner_part(module)
            if theirs is None or theirs == mine or theirs in PLANNER_PARTS[mine]:
                continue
            bad.append(f"{rel}:{line} imports {module} ({mine} -> {theirs} is not allowed)")
    return bad


def test_each_part_of_the_planner_imports_only_the_parts_below_it():
    assert planner_edge_violations() == []


def test_every_planner_package_and_module_is_a_known_part():
    found = {planner_part(f"planner.{p.name}") for p in (ROOT / "planner").iterdir()}
    found = {p.removesuffix(".py") for p in found if p and not p.startswith("__init__")}
    assert found - {"specs", "__pycache__"} == set(PLANNER_PARTS)
    # each part has its own short docstring saying what it owns and what it may import
    for part in PLANNER_PARTS:
        init = ROOT / "planner" / part / "__init__.py"
        if init.exists():
            assert "May import" in init.read_text(), init


def test_the_checker_sees_a_forbidden_edge_inside_the_planner(tmp_path):
    (tmp_path / "planner" / "market").mkdir(parents=True)
    (tmp_path / "planner" / "market" / "bad.py").write_text(
        "def f():\n    from planner.screen.table import CandidateTable\n"
    )
    (tmp_path / "planner" / "market" / "good.py").write_text(
        "from planner.market.hardware import Offer\nfrom planner.spec import Spec\n"
    )
    assert planner_edge_violations(tmp_path) == [
        "planner/market/bad.py:2 imports planner.screen.table (market -> screen is not allowed)"
    ]
