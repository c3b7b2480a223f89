"""Bad input of the wrong shape in the hardware data and price files: one line naming the file
and the key, exit 2, no traceback, nothing written (classes a mutation campaign found:
an array of tables given as a number, a non-finite or absurd peak, an unreadable CSV row)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import tomli
import tomli_w
from conftest import call_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptplan import userdata
from gptplan.profile import PROFILE_DIR


def call(main, argv):
    rc, _, lines = call_main(main, argv)
    return rc, lines


def one_line(rc, lines, *names):
    assert rc == 2, (rc, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for name in names:
        assert name in lines[0], (name, lines[0])


# Not an array of tables: a number, a bool, a string, a list of scalars, one table.
NOT_TABLES = [7, 2.5, True, "abc", [1], ["x"], [[]], {"k": 1}]


@pytest.mark.parametrize("value", NOT_TABLES, ids=repr)
def test_imported_price_list_offers_of_the_wrong_shape(value):
    from planner.commands.main import main

    price_list = userdata.offers_dir() / "mine.toml"
    price_list.parent.mkdir(parents=True, exist_ok=True)
    price_list.write_text(tomli_w.dumps({"offers": value}))
    rc, lines = call(main, ["profiles"])
    one_line(rc, lines, str(price_list), "offers")


@pytest.mark.parametrize("value", NOT_TABLES, ids=repr)
def test_profile_offers_and_instance_facts_of_the_wrong_shape(tmp_path, value):
    from planner.market.hardware import ProfileError, load_profile
    from planner.market.instances import instance_facts

    data = tomli.loads((PROFILE_DIR / "a100-80gb.toml").read_text())
    data["offers"] = value
    profile = tmp_path / "a100-80gb.toml"
    profile.write_text(tomli_w.dumps(data))
    with pytest.raises(ProfileError) as caught:
        load_profile(profile)
    assert caught.value.file == str(profile) and caught.value.key.startswith("offers")
    (tmp_path / "instances").mkdir()
    (tmp_path / "instances" / "facts.toml").write_text(tomli_w.dumps({"instances": value}))
    with pytest.raises(ProfileError) as caught:
        instance_facts(tmp_path)
    assert caught.value.key.startswith("instances")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, 0, -1, True, "312"], ids=repr)
def test_profile_peak_must_be_a_finite_sane_number(tmp_path, value):
    from planner.market.hardware import ProfileError, load_profile

    text = (PROFILE_DIR / "a100-80gb.toml").read_text()
    data = tomli.loads(text)
    data["peak_tflops"]["bf16"] = value
    profile = tmp_path / "a100-80gb.toml"
    profile.write_text(tomli_w.dumps(data))
    with pytest.raises(ProfileError) as caught:
        load_profile(profile)
    assert caught.value.file == str(profile) and caught.value.key == "peak_tflops.bf16"


@pytest.mark.parametrize(
    "row",
    [
        "p5,H100,8," + "x" * 200_000 + ",1,us\n",  # over the csv module's field limit
    ],
    ids=["huge field"],
)
def test_unreadable_catalog_row_is_one_line_and_nothing_written(tmp_path, row):
    from planner.commands.main import main

    catalog = tmp_path / "aws.csv"
    catalog.write_text(
        "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region\n" + row
    )
    rc, lines = call(main, ["prices", "import", str(catalog), "--as-of", "2026-12-01"])
    one_line(rc, lines, str(catalog), "line 2")
    assert not userdata.offers_dir().exists() or not any(userdata.offers_dir().iterdir())


def test_shipped_profiles_still_load():
    """The stricter reader accepts every shipped profile, price list and facts file."""
    from planner.market.hardware import load_profiles
    from planner.market.instances import instance_facts

    assert load_profiles(PROFILE_DIR)
    assert instance_facts(PROFILE_DIR)


@pytest.mark.parametrize("under", ["file", "file/sub"])
def test_writing_under_an_existing_file_is_one_line(tmp_path, under):
    """The shared atomic writer: a folder whose path is an existing file is bad input (exit 2),
    not NotADirectoryError/FileExistsError."""
    from gptplan.errors import UserError
    from gptplan.tomlconf import write_text_atomic

    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as caught:
        write_text_atomic(tmp_path / under / "out.toml", "a = 1\n")
    assert caught.value.exit_status == 2 and str(tmp_path / "file") in str(caught.value)


def test_data_dir_that_is_a_file_and_plot_under_a_file(tmp_path, monkeypatch):
    from planner.commands.main import main

    blocker = tmp_path / "afile"
    blocker.write_text("x")
    catalog = PROFILE_DIR.parent / "tests" / "data" / "catalogs" / "v6" / "aws" / "vms.csv"
    monkeypatch.setenv(userdata.DATA_ENV, str(blocker))
    rc, lines = call(main, ["prices", "import", str(catalog), "--as-of", "2026-12-01"])
    one_line(rc, lines, str(blocker), "not a folder")
    assert blocker.read_text() == "x"
    monkeypatch.setenv(userdata.DATA_ENV, str(tmp_path / "data"))
    spec = PROFILE_DIR.parent / "planner" / "specs" / "cpu_demo.toml"
    out = tmp_path / "plan.toml"
    argv = ["optimize", "--spec", str(spec), "--out", str(out), "--plot", str(blocker / "p.png")]
    rc, lines = call(main, argv)
    one_line(rc, lines, "--plot", str(blocker))
    assert not out.exists()  # refused before any work


@pytest.mark.parametrize(
    "item", ["constraints.spot=1", "constraints.budget=-1", "job.target_tokens='x'", "search.top=0"]
)
def test_a_bad_set_value_names_the_set_flag_not_another_flag(item):
    """--set KEY=VALUE for a key a dedicated flag also sets (--spot, --budget, ...): the error
    names what the user typed."""
    from planner.commands.main import main

    spec = PROFILE_DIR.parent / "planner" / "specs" / "cpu_demo.toml"
    rc, lines = call(main, ["estimate", "--spec", str(spec), "--set", item])
    one_line(rc, lines, f"error: --set {item.split('=')[0]}: ")


@pytest.mark.parametrize(
    "rates",
    [
        [{"k": 1}],
        5,
        "abc",
        {"EUR": float("inf")},
        {"EUR": float("nan")},
        {"EUR": 1e300},
        {"as_of": {}},
        {"source": 3},
    ],
    ids=repr,
)
def test_spec_rates_of_the_wrong_shape_or_not_finite(rates):
    from planner.spec import SpecError, spec_from_dict

    data = tomli.loads((PROFILE_DIR.parent / "planner" / "specs" / "bank_faq.toml").read_text())
    data["rates"] = rates
    with pytest.raises(SpecError) as caught:
        spec_from_dict(data, file="spec.toml")
    assert caught.value.file == "spec.toml" and caught.value.key.startswith("rates")


@pytest.mark.parametrize(
    "section, flags",
    [
        ("constraints", ["--budget", "5"]),
        ("job", ["--set", "job.seed=1"]),
        ("rates", ["--rate", "EUR=7"]),
    ],
)
def test_a_flag_into_a_section_that_is_not_a_table(tmp_path, section, flags):
    from planner.commands.main import main

    spec = tmp_path / "spec.toml"
    spec.write_text(f"{section} = 5\n")
    rc, lines = call(main, ["estimate", "--spec", str(spec), *flags])
    one_line(rc, lines, str(spec), f"{section}: must be a table")


@pytest.mark.parametrize(
    "text",
    [
        "providers = 5\n",
        "[providers.aws]\npreemptions_per_node_hour = inf\nlow = 0.0\nhigh = inf\n",
        "[default]\npreemptions_per_node_hour = 0.1\nlow = 0.0\nhigh = inf\n",
    ],
    ids=["providers not tables", "inf rate", "inf high"],
)
def test_spot_interruption_table_of_the_wrong_shape_or_not_finite(tmp_path, text):
    import dataclasses

    from planner.market.hardware import ProfileError, load_profiles
    from planner.market.pricebook import spot_risk

    offer = next(
        o
        for p in load_profiles().values()
        for o in p.offers
        if o.has_spot and not o.spot_interruptions_per_node_hour
    )
    (tmp_path / "spot").mkdir()
    (tmp_path / "spot" / "interruptions.toml").write_text(text)
    with pytest.raises(ProfileError) as caught:
        spot_risk(dataclasses.replace(offer, provider="aws"), directory=tmp_path)
    assert caught.value.file.endswith("interruptions.toml")


@pytest.mark.parametrize(
    "content",
    ["[tool]\nplanner = 5\n", b"\xff\xfe\x00binary", "[tool.planner]\njob = 5\n", "[tool\n"],
    ids=["planner not a table", "binary", "job not a table", "syntax"],
)
def test_pyproject_tool_planner_of_the_wrong_shape(tmp_path, content):
    """The spec found in ./pyproject.toml's [tool.planner] when --spec is not given."""
    from planner.spec import SpecError, load_spec

    pyproject = tmp_path / "pyproject.toml"
    if isinstance(content, bytes):
        pyproject.write_bytes(content)
    else:
        pyproject.write_text(content)
    with pytest.raises(SpecError) as caught:
        load_spec(cwd=tmp_path)
    assert "pyproject.toml" in str(caught.value)


# ---- property: any single-key mutation of a shipped profile, price list or calibration ----

MUTANTS = [
    0,
    -1,
    1e300,
    float("inf"),
    float("nan"),
    "",
    "../x",
    "a\x00b",
    True,
    [],
    [1],
    {},
    {"k": 1},
]
DELETE = object()


def _key_paths(data, prefix=()):
    out = []
    for key, value in data.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out += _key_paths(value, (*prefix, key))
        elif isinstance(value, list):
            for i, item in enumerate(value[:2]):
                if isinstance(item, dict):
                    out += _key_paths(item, (*prefix, key, i))
    return out + [(*prefix, "no_such_key")]


def _mutated(data, path, value):
    table = data
    for part in path[:-1]:
        table = table[part]
    if value is DELETE:
        table.pop(path[-1], None)
    else:
        table[path[-1]] = value
    return data


PROFILE_TEXT = (PROFILE_DIR / "a100-80gb.toml").read_text()
PRICE_TEXT = (PROFILE_DIR / "offers" / "lambda.toml").read_text()
CALIBRATION = {"efficiency": {"max": 0.3, "half_tokens": 100.0}, "efficiency_fp32": {"max": 0.2}}
CASES = (
    [("profile", p) for p in _key_paths(tomli.loads(PROFILE_TEXT))]
    + [("prices", p) for p in _key_paths(tomli.loads(PRICE_TEXT))]
    + [("calibration", p) for p in _key_paths(CALIBRATION)]
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(CASES), value=st.sampled_from([*MUTANTS, DELETE]))
def test_mutated_hardware_data_loads_or_names_file_and_key(case, value):
    from gptplan.profile import calibration_tables
    from planner.market.hardware import ProfileError, load_profile, load_profiles, read_price_file

    kind, path = case
    base = {"profile": PROFILE_TEXT, "prices": PRICE_TEXT}.get(kind)
    data = _mutated(
        tomli.loads(base) if base else tomli.loads(tomli_w.dumps(CALIBRATION)), path, value
    )
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / ("a100-80gb.toml" if kind == "profile" else f"{kind}.toml")
        file.write_text(tomli_w.dumps(data))
        read = {
            "profile": lambda: load_profile(file),
            "prices": lambda: read_price_file(file, load_profiles()),
            "calibration": lambda: calibration_tables(file),
        }[kind]
        try:
            read()
        except ProfileError as exc:
            assert exc.file == str(file), exc
            named = [str(p) for p in path if isinstance(p, str)]
            assert exc.key and any(name in exc.key for name in named), (path, str(exc))
