"""Damaged run files (issue 20): each class ends in one line or a recovery, never a traceback,
and the rerun finishes with the same per-step losses as an undisturbed run. Also: a run
directory that turns read-only mid-run, an export that did not happen, SIGTERM at the very
start of `runner execute`. Every test runs the real runner CLI (one process, the test model)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
from conftest import BASE_PLAN, merge, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.billing import COPY, JOURNAL, Billing

pytestmark = pytest.mark.e2e
RUN = {"training": {"max_steps": 40}, "checkpoint": {"interval_steps": 4, "keep_last": 2}}


def make_plan(folder: Path, cache: Path, output: Path, name: str = "plan.toml") -> Path:
    data = merge(
        merge(BASE_PLAN, RUN), {"job": {"cache_dir": str(cache), "output_dir": str(output)}}
    )
    path = folder / name
    path.write_text(tomli_w.dumps(data))
    return path


def execute(plan: Path) -> subprocess.CompletedProcess:
    return run_cli("runner", "execute", str(plan), cwd=plan.parent, timeout=600)


def losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
            out[record["step"]] = record["loss"]
        except (ValueError, KeyError, TypeError):
            continue
    return out


def at_most_one_line(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) <= 1, proc.stderr[-3000:]
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shared_cache):
    """An undisturbed, finished run: its folder and its per-step losses."""
    folder = tmp_path_factory.mktemp("reference")
    plan = make_plan(folder, shared_cache, folder / "run")
    proc = execute(plan)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "run", losses(folder / "run")


def stopped_mid_run(plan: Path, run: Path) -> None:
    """A run stopped by SIGTERM after its checkpoint at step 4 (it checkpoints and exits 143)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "execute", str(plan)],
        cwd=plan.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_00000004").is_dir():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, shared_cache) -> Path:
    """A run stopped mid-way (stopped_mid_run), once per module: the cases copy it."""
    folder = tmp_path_factory.mktemp("stopped")
    stopped_mid_run(make_plan(folder, shared_cache, folder / "run"), folder / "run")
    return folder / "run"


def garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 12] = b"\x00\xff#garbled#\n"
    path.write_bytes(bytes(data))


def as_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "x").write_text("x")


# What the damage is, and whether it hits a finished run or one stopped at step 5.
CASES = {
    "result.json garbled": (True, lambda run: garble(run / "result.json")),
    "result.json a folder": (True, lambda run: as_folder(run / "result.json")),
    "report.json garbled": (True, lambda run: garble(run / "report.json")),
    "metrics.jsonl garbled": (False, lambda run: garble(run / "metrics.jsonl")),
    "metrics.jsonl a folder": (False, lambda run: as_folder(run / "metrics.jsonl")),
    "checkpoints a file": (
        False,
        lambda run: (shutil.rmtree(run / "checkpoints"), (run / "checkpoints").write_text("x")),
    ),
    "both billing copies lost": (
        False,
        lambda run: ((run / JOURNAL).write_text("{oops"), (run / COPY).unlink()),
    ),
    "export did not happen": (True, lambda run: shutil.rmtree(run / "export")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_run_file_ends_in_one_line_or_recovery(
    case, reference, stopped, tmp_path, shared_cache
):
    ref_run, ref_losses = reference
    finished, damage = CASES[case]
    run = tmp_path / "run"
    plan = make_plan(tmp_path, shared_cache, run)
    shutil.copytree(ref_run if finished else stopped, run)
    damage(run)
    proc = execute(plan)
    lines = at_most_one_line(proc)
    if proc.returncode != 0:  # one line, then the rerun finishes
        assert proc.returncode in (1, 2) and lines, proc.stderr
        proc = execute(plan)
        at_most_one_line(proc)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] and result["completed_steps"] == 40
    assert json.loads((run / "report.json").read_text())["finished"]
    got = losses(run)
    assert 39 in got and all(got[s] == ref_losses[s] for s in got), case
    assert (
        run / "export" / "paddlenlp" / "gptplan_checkpoint.txt"
    ).read_text().strip() == "step_00000040"
    if case.startswith("result.json"):
        assert "rebuilt from step_00000040" in proc.stdout
        assert result["measured"]["final_loss"] == ref_losses[39]
    if case == "export did not happen":
        assert "retried" in proc.stdout
    if case == "both billing copies lost":
        assert "upper bound" in proc.stdout and Billing(run).total_seconds() > 0
    if case == "checkpoints a file":
        assert list((run / "damaged").glob("checkpoints.*"))


@pytest.fixture
def checkpoints_mount(tmp_path):
    """The run's checkpoints folder as a bind mount of itself, so that it can be turned
    read-only while the run goes on (root ignores permission bits; needs root)."""
    if os.geteuid() != 0:
        pytest.skip("bind mounts need root")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_run_directory_turning_read_only_mid_run_is_one_line(
    reference, checkpoints_mount, tmp_path, shared_cache
):
    run = tmp_path / "run"
    plan = make_plan(tmp_path, shared_cache, run)
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "execute", str(plan)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not (checkpoints_mount / "step_00000004").is_dir():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.02)
    while subprocess.run(
        ["mount", "-o", "remount,bind,ro", str(checkpoints_mount)], capture_output=True
    ).returncode:  # busy while a checkpoint is written
        assert proc.poll() is None
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "is not writable" in lines[0], err
    assert str(checkpoints_mount) in lines[0]
    subprocess.run(["umount", "-l", str(checkpoints_mount)], check=True)
    assert (checkpoints_mount / "step_00000004" / "state.json").is_file()  # kept
    again = execute(plan)
    assert again.returncode == 0, again.stderr[-3000:]
    got, ref = losses(run), reference[1]
    assert 39 in got and all(got[s] == ref[s] for s in got)


def test_sigterm_at_the_very_start_exits_143(tmp_path, shared_cache):
    """The notice lands while Python is still importing the runner's modules (right after
    gptplan.errors, which the runner's CLI needs first): the runner exits 143, no traceback."""
    plan = make_plan(tmp_path, shared_cache, tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "runner", "execute", str(plan)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        if line.split("|")[-1].strip() == "gptplan.errors":
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (out[-2000:], err[-2000:])
    assert "Traceback" not in err and "stopped by SIGTERM" in err
    assert not (tmp_path / "run").exists()


# ---- a property: any run file, any damage -----------------------------------------------------

FILES = [
    "result.json",
    "report.json",
    "metrics.jsonl",
    JOURNAL,
    COPY,
    "plan.toml",
    "checkpoints/step_00000040/state.json",
    "tokenizer/tokenizer_config.json",
]


def damage_file(path: Path, how: str, data: bytes) -> None:
    if how == "truncate":
        os.truncate(path, len(path.read_bytes()) // 3)
    elif how == "garble":
        raw = bytearray(path.read_bytes())
        at = len(raw) // 2
        raw[at : at + len(data)] = data
        path.write_bytes(bytes(raw))
    elif how == "delete":
        path.unlink()
    else:
        as_folder(path)


@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    name=st.sampled_from(FILES),
    how=st.sampled_from(["truncate", "garble", "delete", "folder"]),
    data=st.binary(min_size=1, max_size=16),
)
def test_any_damaged_run_file_never_ends_in_a_traceback(
    reference, tmp_path_factory, shared_cache, name, how, data
):
    folder = tmp_path_factory.mktemp("damaged")
    run = folder / "run"
    shutil.copytree(reference[0], run)
    damage_file(run / name, how, data)
    plan = make_plan(folder, shared_cache, run)
    proc = execute(plan)
    lines = at_most_one_line(proc)
    assert proc.returncode == 0 or (proc.returncode in (1, 2) and len(lines) == 1), (
        name,
        how,
        proc.stderr[-2000:],
    )
    if proc.returncode != 0:
        proc = execute(plan)
    assert proc.returncode == 0, (name, how, proc.stderr[-2000:])
    assert json.loads((run / "result.json").read_text())["finished"]


def test_a_folder_that_is_not_a_run_is_never_written(tmp_path, shared_cache):
    """An output folder holding the user's own files (a plan.toml, a result.json of their
    own) is refused in one line, exit 2; nothing in it is overwritten, moved or added
    (issue 39). A new, an empty and a run folder are used as before."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "plan.toml").write_text("# my own plan, not a run's\n")
    (mine / "result.json").write_text("not json: mine\n")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    plan = make_plan(tmp_path, shared_cache, mine)
    for extra in ((), ("--fresh",), ("--dry-run",)):
        proc = run_cli("runner", "execute", str(plan), *extra, cwd=tmp_path)
        assert proc.returncode == 2, (extra, proc.stdout[-2000:], proc.stderr[-2000:])
        (line,) = at_most_one_line(proc)
        assert "job.output_dir" in line and "is not a run folder" in line and "plan.toml" in line
        assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
        assert not list(tmp_path.glob("mine.*"))  # --fresh renamed nothing aside


def test_lock_folder_and_unwritable_launcher_file_are_one_line(
    finished_run, tmp_path, monkeypatch, capsys
):
    """Issue 39: `runner.lock` as a folder (was an IsADirectoryError traceback) is moved to
    damaged/ with one line and the rerun goes on; a `launcher.json` that cannot be replaced
    (immutable: EPERM; was a PermissionError traceback) costs one warning line, not the run."""
    import errno

    from conftest import run_main

    from runner import launch
    from runner.cli import main

    run, _ = finished_run("gpt")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "runner.lock").unlink()
    (copy / "runner.lock").mkdir()
    rc, out, err = run_main(
        main, ["execute", str(run.parent / "plan.toml"), "--output-dir", str(copy)]
    )
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "runner.lock was not a lock file; moved to" in out and "already finished" in out
    assert (copy / "runner.lock").is_file() and list((copy / "damaged").glob("runner.lock.*"))

    group_file = tmp_path / "launcher.json"
    group_file.write_text("{}")

    def immutable(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(dst))

    monkeypatch.setattr("os.replace", immutable)
    launch.record_group(group_file, 4242)
    monkeypatch.undo()
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"warning: {group_file} cannot be written (")
    assert "\n" not in line and "4242" in line and group_file.read_text() == "{}"
    assert not list(tmp_path.glob(".launcher.json.*"))  # no temporary file left
    group_file.unlink()
    group_file.mkdir()  # a folder in its place: moved aside, written
    launch.record_group(group_file, 4243)
    assert json.loads(group_file.read_text())["process_group"] == 4243
