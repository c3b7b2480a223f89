"""Values outside what makes sense are refused at load like every other bad input (issue 20):
one line naming the file, the key and the allowed range, exit status 2. The ranges live in the
schema (gptplan.plan, planner.spec, planner.tuning.autotune.TuneSettings), so every loader gets
them.
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
    from planner.commands.main import main

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

    from planner.spec import SpecError, load_spec
    from planner.writing.planwriter import write_spec_plan

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


# ---- issue 29: values outside sense are refused as a rule class ---------------------------


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("training", "learning_rate", 1e30),
        ("estimate", "cost_per_million_tokens", 1e18),
        ("provenance", "probes", 10**18),
        ("job", "target_tokens", 10**18),
        ("training", "max_steps", 10**18),
    ],
)
def test_values_outside_sense_are_one_line(tmp_path, section, key, value):
    """Each was loaded before issue 29 (no upper bound)."""
    message = refused(tmp_path / "plan.toml", section, key, value)
    assert "must be >= 0 and <= " in message or "must be >= 1 and <= " in message


def numeric_settings():
    """(section, key, metadata, type) of every number a plan holds."""
    import dataclasses as dc
    import typing

    from gptplan.plan import SECTIONS

    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for field in dc.fields(cls):
            if hints[field.name] in (int, float):
                yield section, field.name, field.metadata, hints[field.name]


def test_every_number_of_the_plan_has_a_sane_upper_bound():
    """The rule class: no numeric setting is unbounded (gptplan.tomlconf.DEFAULT_MAX unless
    the schema states a tighter range); the spec and autotune settings use the same helper."""
    import dataclasses as dc
    import typing

    from gptplan.tomlconf import DEFAULT_MAX
    from planner import spec as specs
    from planner.tuning.autotune import TuneSettings

    unbounded = [f"{s}.{k}" for s, k, meta, _ in numeric_settings() if meta.get("max") is None]
    assert not unbounded

    def spec_fields(cls, prefix):
        hints = typing.get_type_hints(cls)
        for field in dc.fields(cls):
            tp = hints[field.name]
            if dc.is_dataclass(tp):
                yield from spec_fields(tp, f"{prefix}{field.name}.")
            elif tp in (int, float):
                yield f"{prefix}{field.name}", field.metadata

    classes = (
        specs.JobSpec,
        specs.ModelSpec,
        specs.ConstraintSpec,
        specs.SearchSpec,
        specs.SpotSpec,
        specs.TrainingSpec,
        TuneSettings,
    )
    for cls in classes:
        for name, meta in spec_fields(cls, f"{cls.__name__}."):
            assert meta.get("max") is not None and meta["max"] <= DEFAULT_MAX, name


def test_every_number_above_its_bound_is_refused(tmp_path):
    """Exhaustive over the plan's numeric settings: ten times the bound is one line naming the
    key (no key is only bounded on paper)."""
    path = tmp_path / "plan.toml"
    for section, key, meta, tp in numeric_settings():
        value = tp(meta["max"] * 10)
        message = refused(path, section, key, value)
        assert "<=" in message, (section, key, message)


def test_interval_must_hold_its_value(tmp_path):
    """p10 <= value <= p90 wherever an interval is given; both ends 0 = no interval."""
    base = {"hours": 5.0, "hours_p10": 4.0, "hours_p90": 0.0}
    path = tmp_path / "plan.toml"
    data = merge(BASE_PLAN, {"estimate": base})
    path.write_text(tomli_w.dumps(data))
    with pytest.raises(UserError) as info:
        load_plan(path)
    message = str(info.value)
    assert "estimate.hours_p90" in message and "below estimate.hours = 5.0" in message
    for bad, key in (
        ({"cost": 10.0, "cost_p10": 11.0, "cost_p90": 20.0}, "estimate.cost_p10"),
        (
            {"tokens_per_second": 100.0, "tokens_per_second_p10": 50.0},
            "estimate.tokens_per_second_p90",
        ),
    ):
        with pytest.raises(UserError, match=key):
            plan_from_dict(merge(BASE_PLAN, {"estimate": bad}))
    plan_from_dict(merge(BASE_PLAN, {"estimate": {"hours": 5.0}}))  # no interval
    plan_from_dict(
        merge(BASE_PLAN, {"estimate": {"hours": 5.0, "hours_p10": 4.0, "hours_p90": 6.0}})
    )


def test_shipped_plans_hold_their_intervals():
    for path in sorted((REPO / "plans").glob("*.toml")):
        load_plan(path)


@pytest.mark.parametrize("value", ["1e18", "1000000000000000000"])
def test_planner_set_outside_sense_is_one_line(value):
    rc, err = planner(
        "estimate", "--spec", str(CPU_SPEC), "--set", f"constraints.max_nodes={value}"
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert "constraints.max_nodes" in lines[0]


def test_runner_set_outside_sense_is_one_line(tmp_path):
    from runner.overrides import load_plan_with

    path = tmp_path / "plan.toml"
    path.write_text(tomli_w.dumps(BASE_PLAN))
    with pytest.raises(UserError, match="training.learning_rate"):
        load_plan_with(path, ["training.learning_rate=1e30"])
