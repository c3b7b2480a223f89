"""The planner's structure (issue 19): no import cycle between its modules (imports inside
functions included), no dead code, no private Optuna API, short functions in autotune, and an
Optuna version bound that admits only the APIs the code uses."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_import_boundaries import imported_modules

ROOT = Path(__file__).resolve().parents[1]


def planner_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "planner").glob("*.py")):
        name = f"planner.{path.stem}"
        targets = set()
        for _, module in imported_modules(path):
            if module.startswith("planner.") and module != name:
                targets.add(".".join(module.split(".")[:2]))
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


def test_planner_modules_import_no_cycle():
    cycle = find_cycle(planner_graph())
    assert cycle is None, " -> ".join(cycle)


def test_dead_code_is_gone():
    search = (ROOT / "planner" / "search.py").read_text()
    probes = (ROOT / "planner" / "probes.py").read_text()
    assert "_powers_of_two_up_to" not in search
    assert "ProbeBackend" not in probes


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


@pytest.mark.parametrize("module", ["planner/autotune.py", "runner/cli.py", "runner/train.py"])
def test_functions_a_reader_follows_are_short(module):
    """Issue 19: no function in these modules is longer than 60 lines (after ruff format)."""
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
