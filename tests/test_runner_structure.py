"""Issue 28: `runner execute`'s steps are typed and short. The command module only parses and
renders; the records its steps hand on are frozen dataclasses, and no dataclass of the runner
holds an `object` or `Any` field (the old 16-field `Execution` bag did, to dodge imports)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEP_MODULES = ["cli", "execute", "execution", "preflight", "conclude", "dryrun", "budget"]


def _dataclasses(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = {ast.unparse(d).split("(")[0] for d in node.decorator_list}
            if names & {"dataclass", "dataclasses.dataclass"}:
                yield node


def _object_fields(source: str) -> list[str]:
    found = []
    for cls in _dataclasses(ast.parse(source)):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign):
                annotation = ast.unparse(stmt.annotation)
                words = set(
                    annotation.replace("|", " ").replace("[", " ").replace("]", " ").split()
                )
                if words & {"object", "Any", "typing.Any"}:
                    found.append(f"{cls.name}.{ast.unparse(stmt.target)}: {annotation}")
    return found


def test_the_check_finds_an_object_field():
    bag = "@dataclasses.dataclass\nclass Bag:\n    lock: object | None = None\n    n: int = 0\n"
    assert _object_fields(bag) == ["Bag.lock: object | None"]


@pytest.mark.parametrize("path", sorted((ROOT / "runner").glob("*.py")), ids=lambda p: p.name)
def test_runner_dataclasses_hold_no_object_or_any_fields(path):
    assert not _object_fields(path.read_text()), _object_fields(path.read_text())


def test_execute_hands_on_frozen_records():
    tree = ast.parse((ROOT / "runner" / "execution.py").read_text())
    classes = list(_dataclasses(tree))
    assert {c.name for c in classes} >= {"ExecuteRequest", "Run", "Resume", "Prepared", "Outcome"}
    for cls in classes:
        assert any("frozen=True" in ast.unparse(d) for d in cls.decorator_list), cls.name


@pytest.mark.parametrize("module", STEP_MODULES)
def test_execute_steps_are_short(module):
    """No function of the command module or of execute's step modules is longer than 60
    lines (after ruff format)."""
    tree = ast.parse((ROOT / "runner" / f"{module}.py").read_text())
    long = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > 60
    }
    assert not long, long


def test_the_command_module_only_parses_and_renders():
    """runner/cli.py defines no dataclass and none of execute's steps."""
    tree = ast.parse((ROOT / "runner" / "cli.py").read_text())
    assert not list(_dataclasses(tree))
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    steps = {"preflight", "prepare", "launch", "conclude", "check_budget", "billed_attempt"}
    assert not defined & steps, defined & steps
