"""Probe workers die with their planner, even mid-probe; a killed planner's Optuna trial is
marked FAIL when the study is resumed (issue 10)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from conftest import BASE_PLAN, REPO, merge

PLANNER_SCRIPT = """
import sys
from pathlib import Path
from planner.probes import LocalProbe
from runner.plan import load_plan

plan = load_plan(sys.argv[1])
probe = LocalProbe(Path(sys.argv[2]), steps=100000, warmup=1, timeout_s=600)
print(probe._worker_for(plan).proc.pid, flush=True)
probe.run(plan)
"""


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


@pytest.mark.e2e
def test_probe_ranks_die_within_seconds_of_a_killed_planner(tmp_path):
    plan = tmp_path / "probe.toml"
    plan.write_text(tomli_w.dumps(merge(BASE_PLAN, {
        "parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}})))
    planner = subprocess.Popen([sys.executable, "-c", PLANNER_SCRIPT, str(plan),
                                str(tmp_path / "work")], cwd=REPO, stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        pgid = int(planner.stdout.readline())
        deadline = time.time() + 300
        logs = list((tmp_path / "work").glob("workers/*/logs/workerlog.1"))
        while time.time() < deadline and not any(
                "probe" in p.read_text(errors="replace") or p.stat().st_size > 2000
                for p in logs):
            time.sleep(0.5)
            logs = list((tmp_path / "work").glob("workers/*/logs/workerlog.1"))
        assert len(group_members(pgid)) >= 3, "launcher and both ranks should be running"
        time.sleep(3)  # mid-probe
    finally:
        os.killpg(planner.pid, signal.SIGKILL)  # the planner only (its own group)
        planner.wait()
    killed = time.time()
    while group_members(pgid) and time.time() - killed < 5:
        time.sleep(0.1)
    assert group_members(pgid) == [], "probe processes outlived their planner"
    print(f"probe group gone {time.time() - killed:.2f} s after the planner was killed")


def test_running_trial_of_a_killed_planner_is_failed_on_resume(tmp_path, monkeypatch):
    import optuna

    from planner import autotune

    monkeypatch.setattr(autotune, "HEARTBEAT_S", 1)
    monkeypatch.setattr(autotune, "STALE_AFTER_S", 2)
    settings = autotune.TuneSettings()
    storage, _ = autotune.storage_for(settings, tmp_path)
    study = autotune.open_study("s", storage)
    trial = study.ask()
    autotune.heartbeat(study, trial).set()  # one beat, then the planner "dies"
    time.sleep(3)
    storage, _ = autotune.storage_for(settings, tmp_path)  # a new planner resumes
    resumed = autotune.open_study("s", storage)
    assert [t.state for t in resumed.get_trials()] == [optuna.trial.TrialState.FAIL]
