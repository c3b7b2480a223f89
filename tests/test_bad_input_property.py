"""Property: any single-key mutation of a shipped plan or spec ends in exit 0, or exit 2 with
one line naming the file (or the flag), never a traceback, and nothing written when rejected.

Runs in-process (`runner.cli.main`, `planner.commands.main.main`) so each case costs milliseconds to
a second, each in a folder of its own (a mutated relative path such as job.cache_dir = "usd"
lands there, never in the checkout). Cases: PLAN_CASES runner dry runs + SPEC_CASES planner
runs (estimate or optimize); raise them with GPTPLAN_PROPERTY_CASES=N (each) for a deeper
search.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import tomli
import tomli_w
from conftest import REPO
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

PLAN_CASES = int(os.environ.get("GPTPLAN_PROPERTY_CASES", 30))
SPEC_CASES = int(os.environ.get("GPTPLAN_PROPERTY_CASES", 20))
PLANS = sorted((REPO / "plans").glob("*.toml"))
SPECS = sorted((REPO / "planner" / "specs").glob("*.toml"))
DELETE = object()
VALUES = [
    0,
    -1,
    1,
    3,
    2**62,
    10**18,
    1e18,
    -1e-9,
    0.5,
    math.inf,
    -math.inf,
    math.nan,
    "",
    "has space",
    "../x",
    "sub/dir",
    "a\x00b",
    "abc",
    "usd",
    "XYZ",
    True,
    False,
    [],
    [100000],
    [0],
    [-1],
    ["x"],
    [math.inf],
    {},
    {"k": 1},
    DELETE,
]


def keys_of(path: Path) -> list[tuple[str, ...]]:
    data = tomli.loads(path.read_text())
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += [(key, sub) for sub in value] + [(key, "no_such_key")]
        else:
            out.append((key,))
    return out + [("no_such_section",)]


def mutate(path: Path, key: tuple[str, ...], value, out_dir: Path) -> Path:
    data = tomli.loads(path.read_text())
    table = data
    for part in key[:-1]:
        table = table.setdefault(part, {})
    if value is DELETE:
        table.pop(key[-1], None)
    else:
        table[key[-1]] = value
    target = out_dir / path.name
    target.write_text(tomli_w.dumps(data))
    return target


def call(main, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """main(argv) in `cwd` (created), as a user in that folder would run it."""
    cwd.mkdir(parents=True, exist_ok=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def error_lines(stderr: str) -> list[str]:
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and "Warning" not in line and not line.strip().startswith("warnings.warn")
    ]


def in_the_checkout(value) -> Path | None:
    """Where a mutated relative path would land had the case run in the checkout's folder."""
    if isinstance(value, str) and value and "\x00" not in value:
        return REPO / value
    return None


def check_outcome(rc, stdout: str, stderr: str, *, names: list[str]) -> None:
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    if rc == 0:
        return
    if rc == 1 and "NO PLAN" in stdout:  # a valid spec nothing satisfies
        return
    assert rc == 2, (rc, stdout[-2000:], stderr[-2000:])
    lines = error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    assert any(name in lines[0] for name in names), lines[0]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("property-cache")


def plan_keys():
    return [(p, k) for p in PLANS for k in keys_of(p)]


def spec_keys():
    return [(p, k) for p in SPECS for k in keys_of(p)]


@settings(
    max_examples=PLAN_CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(target=st.sampled_from(plan_keys()), value=st.sampled_from(VALUES))
@example(target=(REPO / "plans" / "bank_faq.toml", ("job", "cache_dir")), value="usd")
def test_mutated_plans_through_runner_dry_run(target, value, cache_dir):
    from runner.cli import main

    path, key = target
    work = Path(tempfile.mkdtemp(prefix="mutated-plan-"))
    try:
        base = tomli.loads(path.read_text())
        base.setdefault("job", {})
        base["job"]["cache_dir"] = str(cache_dir)  # tokenize the shipped corpora once
        base["job"]["output_dir"] = str(work / "run")
        base["job"]["max_documents"] = 2000
        (work / "base.toml").write_text(tomli_w.dumps(base))
        plan = mutate(work / "base.toml", key, value, work / "")
        (work / "cwd").mkdir()
        before = sorted(p.name for p in work.iterdir())
        stray = in_the_checkout(value)
        existed = stray is not None and stray.exists()
        rc, stdout, stderr = call(main, ["execute", str(plan), "--dry-run"], work / "cwd")
        check_outcome(rc, stdout, stderr, names=[str(plan)])
        assert sorted(p.name for p in work.iterdir()) == before  # a dry run writes nothing
        assert existed or stray is None or not stray.exists()  # nor into the checkout
    finally:
        shutil.rmtree(work, ignore_errors=True)


@settings(
    max_examples=SPEC_CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    target=st.sampled_from(spec_keys()),
    value=st.sampled_from(VALUES),
    command=st.sampled_from(["estimate", "optimize"]),
)
def test_mutated_specs_through_planner(target, value, command, cache_dir):
    from planner.commands.main import main

    path, key = target
    work = Path(tempfile.mkdtemp(prefix="mutated-spec-"))
    try:
        base = tomli.loads(path.read_text())
        base.setdefault("job", {})["cache_dir"] = str(cache_dir)
        base["job"]["sample_documents"] = 500
        (work / "base.toml").write_text(tomli_w.dumps(base))
        spec = mutate(work / "base.toml", key, value, work / "")
        out = work / "out" / "plan.toml"
        argv = [command, "--spec", str(spec)] + (
            ["--out", str(out)] if command == "optimize" else []
        )
        rc, stdout, stderr = call(main, argv, work / "cwd")
        check_outcome(rc, stdout, stderr, names=[spec.name, "--"])
        if rc != 0:
            assert not out.exists()  # nothing half-written for rejected input
    finally:
        shutil.rmtree(work, ignore_errors=True)
