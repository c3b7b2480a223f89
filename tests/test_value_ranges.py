"""Values outside what makes sense are refused at load like every other bad input (issue 20):
one line naming the file, the key and the allowed range, exit status 2. The ranges live in the
schema (gptplan.plan, planner.spec, planner.autotune.TuneSettings), so every loader gets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import tempfile
from pathlib import Path

import pytest
import tomli_w
from conftest import BASE_PLAN, REPO, merge
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptplan.errors import UserError
from gptplan.plan import load_plan, plan_from_dict

SEED_MAX = 2**32 - 1

CPU_SPEC = REPO / "planner" / "specs" / "cpu_demo.toml"
FAST = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def refused(path, section: str, key: str, value) -> str:
    data = merge(BASE_PLAN, {section: {key: value}})
    path.write_text(tomli_w.dumps(data))
    with pytest.raises(UserError) as info:
        load_plan(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))
    assert f"{section}.{key}" in message
    return message


@FAST
@given(
    mfu=st.one_of(
        st.floats(min_value=1.0, exclude_min=True, allow_infinity=False, allow_nan=False),
        st.floats(max_value=0.0, exclude_max=True, allow_infinity=False, allow_nan=False),
    )
)
def test_mfu_outside_0_to_1_is_refused(mfu, tmp_path_factory):
    path = tmp_path_factory.mktemp("mfu") / "plan.toml"
    message = refused(path, "estimate", "mfu", mfu)
    assert ">= 0 and <= 1" in message


def test_mfu_zero_means_not_estimated_and_loads(tmp_path):
    """estimate.* is what the planner expected, informational; 0 = not given (a plan by hand
    with a step time only), so it loads whatever the source; only > 1 or < 0 are refused."""
    plan_from_dict(merge(BASE_PLAN, {"estimate": {"source": "none", "mfu": 0.0}}))
    plan_from_dict(
        merge(BASE_PLAN, {"estimate": {"source": "model", "mfu": 0.0, "step_time_s": 10.0}})
    )


@FAST
@given(mfu=st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
def test_mfu_in_range_loads(mfu):
    plan = plan_from_dict(merge(BASE_PLAN, {"estimate": {"source": "model", "mfu": mfu}}))
    assert plan.estimate.mfu == mfu


@FAST
@given(
    decay=st.one_of(
        st.floats(min_value=1.0, exclude_min=True, allow_infinity=False, allow_nan=False),
        st.floats(max_value=0.0, exclude_max=True, allow_infinity=False, allow_nan=False),
    )
)
def test_weight_decay_outside_0_to_1_is_refused(decay, tmp_path_factory):
    path = tmp_path_factory.mktemp("wd") / "plan.toml"
    message = refused(path, "training", "weight_decay", decay)
    assert ">= 0 and <= 1" in message


@FAST
@given(
    seed=st.one_of(
        st.integers(min_value=SEED_MAX + 1, max_value=2**63 - 1),
        st.integers(min_value=-(2**63), max_value=-1),
    )
)
def test_seed_outside_32_bits_is_refused(seed, tmp_path_factory):
    path = tmp_path_factory.mktemp("seed") / "plan.toml"
    message = refused(path, "job", "seed", seed)
    assert f"<= {SEED_MAX}" in message


@FAST
@given(seed=st.integers(min_value=0, max_value=SEED_MAX))
def test_seed_in_32_bits_loads(seed):
    assert plan_from_dict(merge(BASE_PLAN, {"job": {"seed": seed}})).job.seed == seed


def planner(*argv: str) -> tuple[int, str]:
    """`planner ARGV` in-process, in a fresh folder (a command that is not refused writes
    plans/ and runs/ where it runs)."""
    from planner.cli import main

    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix="planner-"))
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as exc:
                rc = exc.code
    finally:
        os.chdir(cwd)
    return rc, err.getvalue()


@pytest.mark.parametrize(
    "section,key,value",
    [("job", "seed", 10**18), ("training", "weight_decay", 7.0), ("job", "seed", -1)],
)
def test_spec_values_out_of_range_are_one_line(tmp_path, section, key, value):
    import tomli

    data = tomli.loads(CPU_SPEC.read_text())
    data.setdefault(section, {})[key] = value
    spec = tmp_path / "spec.toml"
    spec.write_text(tomli_w.dumps(data))
    rc, err = planner("estimate", "--spec", str(spec))
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert str(spec) in lines[0] and f"{section}.{key}" in lines[0] and "<=" in lines[0]


def test_spec_breaking_a_plan_rule_is_the_specs_error_not_the_output_plans(tmp_path):
    """Found by the mutated-spec property test: min_learning_rate 1 > learning_rate loaded as a
    spec and then failed at plan write, naming the output plan instead of the spec."""
    import tomli

    from planner.cli import write_spec_plan
    from planner.spec import SpecError, load_spec

    data = tomli.loads(CPU_SPEC.read_text())
    data.setdefault("training", {})["min_learning_rate"] = 1.0
    spec = tmp_path / "spec.toml"
    spec.write_text(tomli_w.dumps(data))
    out = tmp_path / "out" / "plan.toml"
    rc, err = planner("optimize", "--spec", str(spec), "--out", str(out))
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert str(spec) in lines[0] and "training.min_learning_rate" in lines[0]
    assert not out.exists()
    # any other plan rule the spec's values break is still reported against the spec
    data["training"]["min_learning_rate"] = 1e-5
    spec.write_text(tomli_w.dumps(data))
    plan = load_plan(Path(__file__).resolve().parent.parent / "plans" / "cpu_tiny_dp2.toml")
    bad = dataclasses.replace(plan, training=dataclasses.replace(plan.training, warmup_steps=10**6))
    loaded = load_spec(spec)
    with pytest.raises(SpecError, match="in the plan this spec gives") as info:
        write_spec_plan(bad, out, loaded)
    assert info.value.file == loaded.path and info.value.key == "training.warmup_steps"
    assert not out.exists()


@FAST
@given(
    flag=st.sampled_from(
        ["--top", "--probes", "--trials", "--seed", "--probe-timeout", "--probe-time"]
    ),
    value=st.integers(min_value=-(10**6), max_value=-1),
)
def test_negative_counts_on_the_command_line_are_refused(flag, value):
    rc, err = planner("optimize", "--spec", str(CPU_SPEC), flag, str(value))
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {flag}: {value}") and "must be >" in lines[0]
