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
from planner.tuning.probes import LocalProbe
from gptplan.plan import load_plan

plan = load_plan(sys.argv[1])
probe = LocalProbe(Path(sys.argv[2]), steps=100000, warmup=1, timeout_s=600)
print(probe._worker_for(plan).proc.pid, flush=True)
probe.run(plan)
"""


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) processes below `pid` (ranks run in process groups of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


@pytest.mark.e2e
def test_probe_ranks_die_within_seconds_of_a_killed_planner(tmp_path):
    plan = tmp_path / "probe.toml"
    plan.write_text(
        tomli_w.dumps(
            merge(BASE_PLAN, {"parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}})
        )
    )
    planner = subprocess.Popen(
        [sys.executable, "-c", PLANNER_SCRIPT, str(plan), str(tmp_path / "work")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        launcher = int(planner.stdout.readline())
        deadline = time.time() + 300
        while time.time() < deadline:  # both ranks have joined the group: the probe runs
            logs = list((tmp_path / "work").glob("workers/*/logs/workerlog.*"))
            if len(logs) == 2 and all(
                "HybridParallelInfo" in p.read_text(errors="replace") for p in logs
            ):
                break
            time.sleep(0.5)
        time.sleep(3)  # mid-probe
        chain = [launcher] + descendants(launcher)
        assert len(alive(chain)) >= 3, "launcher and both ranks should be running"
    finally:
        os.killpg(planner.pid, signal.SIGKILL)  # the planner only (its own group)
        planner.wait()
    killed = time.time()
    while alive(chain) and time.time() - killed < 5:
        time.sleep(0.1)
    assert alive(chain) == [], "probe processes outlived their planner"
    print(f"probe processes gone {time.time() - killed:.2f} s after the planner was killed")


def test_running_trial_of_a_killed_planner_is_failed_on_resume(tmp_path, monkeypatch):
    """A trial whose planner ran on another host is failed once its lease has run out (a
    planner on this host is checked by its process: tests/test_planner_faults.py)."""
    import optuna

    from planner.tuning import study as studies

    monkeypatch.setattr(studies, "STALE_AFTER_S", 0)
    url = studies.study_url("", tmp_path)
    study, _ = studies.open_study("s", studies.open_storage(url))
    trial = study.ask()
    studies.claim(trial, lease_s=0)
    trial.set_user_attr(studies.OWNER_ATTR, {"host": "elsewhere", "pid": 1})
    time.sleep(0.1)  # then that planner "dies"; a new one resumes
    resumed, failed = studies.open_study("s", studies.open_storage(url))
    assert failed == [0]
    assert [t.state for t in resumed.get_trials()] == [optuna.trial.TrialState.FAIL]
