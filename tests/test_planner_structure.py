"""The project's structure (issues 19, 28): no import cycle between the modules of gptplan,
runner and planner (imports inside functions included), no dead code, no private Optuna API,
short functions, and an Optuna version bound that admits only the APIs the code uses."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_import_boundaries import imported_modules

ROOT = Path(__file__).resolve().parents[1]


PACKAGES = ("gptplan", "runner", "planner")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_lines(path: Path) -> set[int]:
    """Lines of the imports under `if TYPE_CHECKING:`: annotations only, never executed, so
    no import cycle at run time."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file but under
    TYPE_CHECKING), over every module of the three packages."""
    paths = sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name, skip = module_name(path, root), type_checking_lines(path)
        targets = set()
        for line, module in imported_modules(path):
            # `from gptplan.families.gpt import X` names gptplan.families.gpt; `from gptplan
            # import plan` names gptplan.plan (imported_modules adds it); a package alone
            # (`import gptplan`) runs its __init__
            known = [m for m in modules if module == m or module.startswith(m + ".")]
            if line in skip or not known:
                continue
            target = max(known, key=len)
            if target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_modules_of_all_packages_import_no_cycle():
    graph = import_graph()
    assert {"gptplan.plan", "runner.cli", "planner.search"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle_through_an_import_inside_a_function(tmp_path):
    (tmp_path / "gptplan").mkdir()
    (tmp_path / "gptplan" / "a.py").write_text("from gptplan.b import f\n")
    (tmp_path / "gptplan" / "b.py").write_text("def f():\n    from gptplan import a\n")
    (tmp_path / "gptplan" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gptplan import a\n"
    )
    for package in ("runner", "planner"):
        (tmp_path / package).mkdir()
    graph = import_graph(tmp_path)
    assert graph["gptplan.c"] == set()  # annotations only
    assert find_cycle(graph) == ["gptplan.a", "gptplan.b", "gptplan.a"]


def test_dead_code_is_gone():
    search = (ROOT / "planner" / "search.py").read_text()
    probes = (ROOT / "planner" / "probes.py").read_text()
    assert "_powers_of_two_up_to" not in search
    assert "ProbeBackend" not in probes
    # issue 28: functions nothing called (tests and bench/ included)
    gone = {
        "planner/calibration.py": "def apply(",
        "planner/pricebook.py": "def age_text(",
        "planner/hardware.py": "def supersedes(",
        "planner/prices.py": "def _key(",
        "planner/cli.py": "def _quiet(",
        "runner/billing.py": "def node_journals(",
    }
    for path, definition in gone.items():
        assert definition not in (ROOT / path).read_text(), path


def test_the_quiet_log_is_defined_once():
    defined = [
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "def _quiet(" in path.read_text() or "def quiet(" in path.read_text()
    ]
    assert defined == ["gptplan/progress.py"], defined


def test_no_private_optuna_api():
    for path in sorted((ROOT / "planner").glob("*.py")):
        text = path.read_text()
        for private in ("optuna.storages._", "._storage", "._trial_id", "_heartbeat", "._study_id"):
            assert private not in text, f"{path.name}: {private}"


def function_lengths(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text())
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


@pytest.mark.parametrize(
    "module", ["gptplan/plan.py", "planner/autotune.py", "runner/cli.py", "runner/train.py"]
)
def test_functions_a_reader_follows_are_short(module):
    """Issues 19 and 28: no function in these modules is longer than 60 lines (after ruff
    format)."""
    lengths = function_lengths(ROOT / module)
    long = {name: n for name, n in lengths.items() if n > 60}
    assert not long, long


def test_optuna_bound_matches_the_api_used():
    """The code uses Trial.set_constraint (Optuna 5): pyproject must not admit Optuna 4, and
    the pinned version must satisfy the bound."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    bound = re.search(r'"optuna([^"]*)"', pyproject).group(1)
    assert ">=5" in bound and "<6" in bound, bound
    pin = re.search(r"^optuna==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert pin.split(".")[0] == "5", pin
