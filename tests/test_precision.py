"""The precision table (gptplan.precision) and the one strict hardware-profile reader."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from conftest import BASE_PLAN, REPO, merge

from gptplan import precision
from gptplan.plan import PRECISIONS, plan_from_dict
from gptplan.profile import DeviceProfile, ProfileError, read_performance

FP4 = dataclasses.replace(
    precision.FP8, name="fp4", code=9, gemm_bytes_per_element=0.5, gemm_peak=("fp4",)
)


def test_a_new_row_shifts_no_existing_code():
    """Codes are the rows' own: a row added anywhere (here first) leaves every code, and every
    column looked up by code, as it was. The tuple-index scheme (PRECISIONS.index, FP8 at
    len(PRECISIONS)) renumbered fp32/fp16/bf16 and fp8 whenever a precision was added."""
    grown = precision.Table((FP4, *reversed(precision.ROWS)))
    for row in precision.ROWS:
        assert grown.code(row.name) == precision.code(row.name) == row.code
        assert grown.name_of(row.code) == row.name
    codes = np.array([r.code for r in precision.ROWS])
    for field in ("bytes_per_element", "gemm_bytes_per_element", "master_weights"):
        old = precision.TABLE.column(lambda r, f=field: getattr(r, f))[codes]
        assert (grown.column(lambda r, f=field: getattr(r, f))[codes] == old).all()
    assert grown.plannable == tuple(reversed(PRECISIONS))
    assert grown.name_of(9) == "fp4" and "fp4" not in grown.plannable
    with pytest.raises(ValueError, match="unique"):
        precision.Table((*precision.ROWS, dataclasses.replace(FP4, code=precision.BF16.code)))


def test_plannable_rows_and_the_fp8_row():
    assert PRECISIONS == precision.PLANNABLE == ("fp32", "fp16", "bf16")
    assert not precision.FP8.plannable and "fitting only" in precision.FP8.why_not
    assert precision.FP8.code not in [precision.code(p) for p in PRECISIONS]
    assert precision.FP8.narrow_gemms and not any(precision.row(p).narrow_gemms for p in PRECISIONS)


def test_dtype_amp_and_loss_scaling_rule():
    """The one rule the runner's paddle.amp calls and fleet's amp config use."""
    assert [precision.paddle_dtype(p) for p in PRECISIONS] == ["float32", "float16", "bfloat16"]
    assert precision.amp_level("fp32", "O2") is precision.amp_level("fp32", "O1") is None
    assert precision.amp_level("bf16", "O2") == "O2" and precision.amp_level("fp16", "O1") == "O1"
    assert [precision.row(p).loss_scaling for p in PRECISIONS] == [False, True, False]


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_fleet_amp_settings_follow_the_table(name):
    from runner.parallel import strategy_settings

    level = "O2" if name != "fp32" else "O1"
    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            {
                "training": {"precision": name, "fp16_opt_level": level},
                "hardware": {"precisions": list(PRECISIONS)},
            },
        )
    )
    amp = strategy_settings(plan).get("amp")
    if name == "fp32":
        assert amp is None
        return
    row = precision.row(name)
    assert amp["dtype"] == row.paddle_dtype and amp["level"] == "O2"
    assert amp["use_dynamic_loss_scaling"] is row.loss_scaling


@pytest.mark.parametrize("name,level", [("fp32", "O1"), ("fp16", "O2"), ("bf16", "O1")])
def test_the_trainer_casts_and_scales_by_the_table(name, level, monkeypatch):
    """runner.train's auto_cast dtype/level and GradScaler (AMP is a no-op on this CPU, so
    the call itself is checked)."""
    import paddle

    from runner.train import amp_context, build_scaler

    calls = []
    monkeypatch.setattr(paddle.amp, "auto_cast", lambda **kw: calls.append(kw))
    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            {
                "training": {"precision": name, "fp16_opt_level": level},
                "hardware": {"precisions": list(PRECISIONS)},
            },
        )
    )
    amp_context(plan)
    row = precision.row(name)
    expected = [{"enable": True, "level": level, "dtype": row.paddle_dtype}] if row.mixed else []
    assert calls == expected
    assert (build_scaler(plan) is not None) is row.loss_scaling


def test_bf16_is_coded_as_bf16_in_the_rehearsal_step_time(monkeypatch):
    """gptplan.steptime used to code every 16-bit plan as fp16 (precision != 'fp32')."""
    from gptplan import steptime

    seen = {}

    def spy(shape, g, dev, rates):
        seen["code"] = g["precision_code"]
        return {"step_time_s": 1.0}

    monkeypatch.setattr(steptime, "step_time_parts", spy)
    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            {"training": {"precision": "bf16"}, "hardware": {"precisions": ["fp32", "bf16"]}},
        )
    )
    perf = dataclasses.replace(read_performance("cpu"), peak_tflops={"bf16": 1.0})
    assert steptime.data_parallel_step_time_s(plan, perf) == 1.0
    assert seen["code"] == precision.BF16.code != precision.FP16.code


def test_memory_bytes_come_from_the_rows():
    from gptplan.memory import model_state_bytes_per_param

    codes = [precision.code(p) for p in ("fp32", "fp16", "bf16", "fp8")]
    # [Z20]: 4 + 4 + 8 in fp32; 2 + 2 + 12 (fp32 master and moments) in 16-bit training
    assert model_state_bytes_per_param(codes, 0, 1).tolist() == [16.0, 16.0, 16.0, 16.0]
    assert model_state_bytes_per_param(codes, 1, 4).tolist() == [10.0, 7.0, 7.0, 7.0]


# Ways a precision was encoded outside the table (positions in a tuple, the FP8 side door, the
# dtype rule written out): none may come back in the packages or the benchmarks.
OLD_ENCODINGS = re.compile(
    r"PRECISIONS\[|PRECISIONS\.index\(|enumerate\(PRECISIONS\)|FP8_PRECISION_CODE"
    r"|\(\"fp32\", \"fp16\", \"bf16\"\)\[|\"float16\" if"
)


def test_no_precision_is_encoded_outside_the_table():
    files = [p for d in ("gptplan", "planner", "runner", "bench") for p in (REPO / d).rglob("*.py")]
    found = [
        f"{p.relative_to(REPO)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if OLD_ENCODINGS.search(line)
    ]
    assert not found, found


def _main_lines(main, argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    return rc, [line for line in err.getvalue().splitlines() if line.strip()]


def test_a_plan_in_fp8_is_refused_with_one_line_and_status_2(tmp_path):
    from runner.cli import main

    path = tmp_path / "fp8.toml"
    path.write_text(tomli_w.dumps(merge(BASE_PLAN, {"training": {"precision": "fp8"}})))
    rc, lines = _main_lines(main, ["execute", str(path), "--dry-run"])
    assert rc == 2 and len(lines) == 1, lines
    assert str(path) in lines[0] and "training.precision" in lines[0]
    assert "fitting only" in lines[0] and "allowed: 'fp32', 'fp16', 'bf16'" in lines[0]
    hardware = merge(BASE_PLAN, {"hardware": {"precisions": ["fp32", "fp8"]}})
    with pytest.raises(Exception, match=r"hardware\.precisions.*FP8 cannot be planned"):
        plan_from_dict(hardware, file="p.toml")


# ---- the one strict profile reader ---------------------------------------------------------


def test_planner_and_runner_read_a_profile_through_one_reader():
    from planner.market.hardware import Profile, load_profiles

    assert issubclass(Profile, DeviceProfile)
    for name in ("peak_for", "efficiency_for", "non_gemm_peak_for", "precisions"):
        assert name not in vars(Profile)  # defined once, in gptplan.profile
    for name, planner_view in load_profiles().items():
        runner_view = read_performance(name)
        for f in dataclasses.fields(DeviceProfile):
            assert getattr(runner_view, f.name) == getattr(planner_view, f.name), (name, f.name)


def test_peaks_by_the_table():
    h100 = read_performance("h100-80gb")
    assert h100.peak_for("fp32") == h100.peak_tflops["tf32"]  # TF32 where it exists
    assert h100.peak_for("fp8") == h100.peak_tflops["fp8"]  # FP8's linear GEMMs
    assert h100.non_gemm_peak_for("fp8") == h100.peak_for("bf16")  # the rest of an FP8 run
    assert h100.precisions == ["fp32", "fp16", "bf16"]
    cpu = read_performance("cpu")
    assert cpu.peak_for("fp32") == cpu.peak_tflops["fp32"] and cpu.peak_for("bf16") == 0.0


@pytest.mark.parametrize(
    "text,key,word",
    [
        ('name = "x"\nmemory_gb = "lots"\n', "memory_gb", "a number"),
        ('name = "x"\ndevice = "tpu"\n', "device", "'gpu'"),
        ('name = "x"\nmemroy_gb = 8\n', "memroy_gb", "memory_gb"),
        ('name = "x"\n[peak_tflops]\nint4 = 10.0\n', "peak_tflops.int4", "fp8"),
        ('name = "x"\npeak_tflops = 3\n', "peak_tflops", "table"),
        ('name = "y"\n', "name", "file name"),
    ],
    ids=["type", "choice", "unknown", "peak-key", "peak-table", "name"],
)
def test_bad_profile_is_one_error_naming_file_key_and_allowed(tmp_path, text, key, word):
    """The runner's reader was lenient (float('lots') raised a traceback, unknown keys and
    devices passed); both tools now read strictly, one ProfileError with file and key."""
    (tmp_path / "x.toml").write_text(text)
    for read in (lambda: read_performance("x", tmp_path), lambda: _planner_load(tmp_path)):
        with pytest.raises(ProfileError) as info:
            read()
        assert info.value.file == str(tmp_path / "x.toml") and info.value.key == key
        assert word in str(info.value)


def _planner_load(folder: Path):
    from planner.market.hardware import load_profile

    return load_profile(folder / "x.toml")


def test_the_rehearsal_stops_on_a_malformed_profile_and_skips_a_missing_one(tmp_path, monkeypatch):
    """A malformed profile or calibration was silently 'not modelled' in the rehearsal (and
    a malformed number a traceback); now it is the strict reader's one line."""
    from runner.rehearsal import local_performance

    monkeypatch.setenv("GPTPLAN_CALIBRATION_DIR", str(tmp_path))
    (tmp_path / "cpu.toml").write_text("[efficiency]\nmax = 7\n")
    plan = plan_from_dict(BASE_PLAN)
    with pytest.raises(ProfileError) as info:
        local_performance(plan)
    assert info.value.file == str(tmp_path / "cpu.toml") and info.value.key == "efficiency.max"
    gpu = {"hardware": {"device": "gpu", "profile": "no-such-gpu"}}
    assert local_performance(plan_from_dict(merge(BASE_PLAN, gpu))) is None


def test_one_offer_in_two_profiles_is_one_error_naming_both(tmp_path):
    """A price is current per (provider, instance, region) across every profile: the same
    instance in a second profile silently replaced the first's offer (an offer named like
    cpu.toml's 2-process one dropped it from the CPU space). Now one ProfileError."""
    import shutil

    from planner.market.hardware import load_profiles

    folder = tmp_path / "profiles"
    shutil.copytree(REPO / "hardware_profiles", folder)
    text = (folder / "cpu.toml").read_text().replace('name = "cpu"', 'name = "cpu2"')
    (folder / "cpu2.toml").write_text(text)
    with pytest.raises(ProfileError) as info:
        load_profiles(folder)
    assert info.value.file == str(folder / "cpu2.toml")
    assert info.value.key == "offers[0].instance" and "cpu.toml" in str(info.value)
