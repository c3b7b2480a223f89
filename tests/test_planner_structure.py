"""The project's structure (issues 19, 28): no import cycle between the modules of gptplan,
runner and planner (imports inside functions included), no dead code, no private Optuna API,
short functions, and an Optuna version bound that admits only the APIs the code uses."""

from __future__ import annotations

import ast
import functools
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


PACKAGES = ("gptplan", "runner", "planner")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for the tests of this file."""
    return ast.parse(path.read_text(encoding="utf-8"))


def runtime_imports(path: Path) -> list[str]:
    """Every module a file imports (inside functions too; `from a import b` names a and a.b),
    except under `if TYPE_CHECKING:`: annotations only, never executed, so no import cycle."""
    found = []
    stack: list[ast.AST] = [parsed(path)]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            stack += node.orelse  # the body runs for the type checker only
        elif isinstance(node, (ast.stmt, ast.Module, ast.excepthandler, ast.match_case)):
            stack += [
                child
                for child in ast.iter_child_nodes(node)
                if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case)
            ]
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports at run time, over every module of the three
    packages."""
    paths = sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = module_name(path, root)
        targets = set()
        for module in runtime_imports(path):
            parts = module.split(".")  # the longest prefix that is a module of the project
            prefixes = (".".join(parts[:k]) for k in range(len(parts), 0, -1))
            target = next((m for m in prefixes if m in modules), None)
            if target is not None and target != name:
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
    assert {"gptplan.plan", "runner.cli", "planner.screen"} <= set(graph)
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
    screen = "".join(p.read_text() for p in sorted((ROOT / "planner" / "screen").glob("*.py")))
    probes = (ROOT / "planner" / "tuning" / "probes.py").read_text()
    assert "_powers_of_two_up_to" not in screen
    # issue 28 removed an unused ProbeBackend; issue 38 brought it back as the protocol that
    # tune() takes and both backends implement (tests/test_replay.py checks them)
    assert "class ProbeBackend(Protocol)" in probes
    # issue 28: functions nothing called (tests and bench/ included)
    gone = {
        "planner/tuning/calibration.py": "def apply(",
        "planner/market/pricebook.py": "def age_text(",
        "planner/market/hardware.py": "def supersedes(",
        "planner/market/prices.py": "def _key(",
        "planner/commands/main.py": "def _quiet(",
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
    for path in sorted((ROOT / "planner").rglob("*.py")):
        text = path.read_text()
        for private in ("optuna.storages._", "._storage", "._trial_id", "_heartbeat", "._study_id"):
            assert private not in text, f"{path.name}: {private}"


def function_lengths(path: Path) -> dict[str, int]:
    tree = parsed(path)
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


COMMAND_MODULES = sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "planner" / "commands").glob("*.py")
)


@pytest.mark.parametrize(
    "module",
    [
        *(f"gptplan/plan/{m}.py" for m in ("schema", "layout", "checks", "io")),
        "planner/tuning/autotune.py",
        "runner/cli.py",
        "runner/train.py",
        *COMMAND_MODULES,
    ],
)
def test_functions_a_reader_follows_are_short(module):
    """Issues 19 and 28: no function in these modules is longer than 60 lines (after ruff
    format)."""
    lengths = function_lengths(ROOT / module)
    long = {name: n for name, n in lengths.items() if n > 60}
    assert not long, long


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_each_command_module_is_short(module):
    """Issue 38: the command line is parsing and dispatch only, one module per command, each
    under about 150 lines (the work lives in the planner's other parts)."""
    lines = len((ROOT / module).read_text().splitlines())
    assert lines <= 150, f"{module}: {lines} lines"


def test_the_planner_is_grouped_by_concern():
    """Issue 38: no module sits flat in planner/ but the spec schema and the optimize flow;
    every other module lives in its concern's subpackage (planner/__init__.py lists them)."""
    flat = sorted(p.name for p in (ROOT / "planner").glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "pipeline.py", "spec.py"], flat
    parts = sorted(p.name for p in (ROOT / "planner").iterdir() if (p / "__init__.py").exists())
    assert parts == [
        "commands",
        "corpus",
        "market",
        "reporting",
        "screen",
        "tuning",
        "writing",
    ], parts
    assert len(COMMAND_MODULES) >= 10  # the scans above see the subpackages


def test_optuna_bound_matches_the_api_used():
    """The code uses Trial.set_constraint (Optuna 5): pyproject must not admit Optuna 4, and
    the pinned version must satisfy the bound."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    bound = re.search(r'"optuna([^"]*)"', pyproject).group(1)
    assert ">=5" in bound and "<6" in bound, bound
    pin = re.search(r"^optuna==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert pin.split(".")[0] == "5", pin


def test_each_vocabulary_is_written_once():
    """Issue 28: the recompute modes, sharding stages and device kinds are listed in
    gptplan/plan/schema.py only (as a tuple or a Literal); every other module imports them."""
    from gptplan.plan import RECOMPUTE_MODES, SHARDING_STAGES, Device

    vocabularies = [set(RECOMPUTE_MODES), set(SHARDING_STAGES), set(typing.get_args(Device))]
    copies = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(parsed(path)):
                if not isinstance(node, (ast.Tuple, ast.List)):
                    continue
                words = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if len(words) == len(node.elts) and words in vocabularies:
                    copies.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert all(c.startswith("gptplan/plan/schema.py:") for c in copies), copies
    assert len(copies) >= len(vocabularies), copies  # the scan finds the originals
