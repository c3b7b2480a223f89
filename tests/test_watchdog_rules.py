"""The watchdog's rules and the failure wording on made-up status folders (no training)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import BASE_PLAN

from gptplan.plan import plan_from_dict
from runner.failure import diagnose
from runner.watchdog import Watchdog


def write(folder: Path, name: str, record: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(record))


def test_ranks_that_advance_are_left_alone_and_silence_past_the_limit_is_named(tmp_path):
    status = tmp_path / "ranks"
    dog = Watchdog(status, tmp_path, nproc_per_node=2, floor_s=5.0, started=100.0)
    assert dog.check(now=101.0) is None  # start-up, nothing reported yet
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while time.time() < deadline:  # the kernel shows it stopped
            if Path(f"/proc/{sleeper.pid}/stat").read_text().rpartition(")")[2].split()[0] == "T":
                break
            time.sleep(0.01)
        for rank, pid in ((0, os.getpid()), (1, sleeper.pid)):
            write(status, f"rank_{rank}.json", {"rank": rank, "pid": pid, "ended": None})
            write(
                status,
                f"progress_{rank}.json",
                {"rank": rank, "step": 7, "at": 110.0, "step_s": 1.0, "checkpoint_s": 0.2},
            )
        (tmp_path / "workerlog.1").write_text("step 7/12 | loss 7.1\nwaiting\n")
        assert dog.check(now=119.0) is None  # 9 s < 10 x the slowest step
        line = dog.check(now=121.0)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert line is not None and "\n" not in line
    assert "no progress for 11 s (limit 10 s" in line and "after step 7" in line
    assert "rank(s) 1 (rank 1 stopped (SIGSTOP" in line
    assert "step 7/12 | loss 7.1 | waiting" in line and "rerun the same command" in line


def test_a_start_up_that_never_finishes_and_a_peer_node_that_never_comes(tmp_path):
    single = Watchdog(tmp_path / "a", tmp_path, nproc_per_node=1, startup_limit_s=30.0, started=0)
    assert single.check(now=29.0) is None
    line = single.check(now=31.0)
    assert line is not None and line.startswith("start-up did not finish")
    node1 = Watchdog(
        tmp_path / "b",
        tmp_path,
        nproc_per_node=1,
        nnodes=2,
        node_rank=1,
        master="10.0.0.1:8090",
        startup_limit_s=30.0,
        started=0,
    )
    line = node1.check(now=31.0)
    assert line is not None and line.startswith("node 1: no rank started 31 s after the launch")
    assert "10.0.0.1:8090 never completed" in line


def test_limits_come_from_the_environment_and_earlier_start_ups(monkeypatch, tmp_path):
    plan = plan_from_dict(BASE_PLAN)
    common = dict(status_dir=tmp_path, log_dir=tmp_path, node_rank=0, master="")
    dog = Watchdog.for_plan(plan, attempts=[{"startup_s": 400.0}], **common)
    assert dog.startup_limit_s == 1200.0 and dog.floor_s == 120.0  # 3 x 400 s measured
    monkeypatch.setenv("RUNNER_STALL_FLOOR_S", "3")
    monkeypatch.setenv("RUNNER_STARTUP_LIMIT_S", "5")
    dog = Watchdog.for_plan(plan, attempts=[], **common)
    assert (dog.floor_s, dog.startup_limit_s) == (3.0, 5.0)


def test_failure_wording_follows_what_the_ranks_reported(tmp_path):
    """A launcher that failed after its ranks reported steps must not say 'before any rank
    reported' (seen on a multi-node failure after 6 steps)."""
    plan = plan_from_dict(BASE_PLAN)
    status = tmp_path / "ranks"
    args = dict(
        plan=plan,
        status_dir=status,
        log_dir=tmp_path,
        launcher_rc=1,
        oom_kills_before=0,
        oom_kills_after=0,
        machine_bytes=1 << 34,
        local=False,
    )
    assert "before any rank started" in diagnose(**args).line
    write(status, "rank_0.json", {"rank": 0, "pid": 1, "ended": None, "exit_code": None})
    write(status, "progress_0.json", {"rank": 0, "step": 6, "at": 1.0})
    line = diagnose(**args).line
    assert "after step 6" in line and "before any rank" not in line


def test_a_stopped_rank_is_blamed_not_the_healthy_one_gloo_aborted(tmp_path):
    """Issue 39: rank 1 stopped (SIGSTOP), rank 0 waited in a collective until gloo's timeout
    aborted it (SIGABRT): the line blamed rank 0 ("killed by SIGABRT")."""
    plan = plan_from_dict(BASE_PLAN)
    status = tmp_path / "ranks"
    write(
        status,
        "rank_0.json",
        {"rank": 0, "pid": 1, "ended": 5.0, "exit_code": -6, "signal": "SIGABRT"},
    )
    write(status, "rank_1.json", {"rank": 1, "pid": 2, "ended": None, "exit_code": None})
    (tmp_path / "workerlog.0").write_text(
        "terminate called after 'gloo::EnforceNotMet' ... Timed out\n"
    )
    failure = diagnose(
        plan=plan,
        status_dir=status,
        log_dir=tmp_path,
        launcher_rc=1,
        oom_kills_before=0,
        oom_kills_after=0,
        machine_bytes=1 << 34,
        local=False,
    )
    assert failure.cause == "peer_lost"
    assert (
        failure.line.startswith("rank(s) 1 stopped answering")
        and "rank 0 is not the cause" in failure.line
    )
    assert "killed by" not in failure.line


def test_planner_stop_line_names_trial_numbers():
    from planner.tuning.stopping import Stopped

    stopped = Stopped(signal.SIGTERM)
    stopped.probes_ended, stopped.failed_trials = 1, [0]
    assert "running trial #0 marked failed;" in stopped.summary()
    stopped.failed_trials = [3, 4]
    assert "running trials #3, #4 marked failed;" in stopped.summary()
