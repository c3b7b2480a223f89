"""Runs that end when they should (issue 29): a rank that stops advancing, a node whose peer
never comes, a start-up slower than the budget left, and a rerun of a spent run each end in a
stated time with one line, and every second the runner ran is in its journal.

The stated bounds are shortened for the tests through their environment variables
(runner.watchdog: RUNNER_STALL_FLOOR_S, RUNNER_STARTUP_LIMIT_S; runner.ceiling:
RUNNER_TEST_LAUNCH_DELAY_S slows start-up down).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import group_members, run_cli
from test_multinode import free_port
from test_train_e2e import metrics

from runner.billing import Billing
from runner.supervise import process_start

pytestmark = pytest.mark.e2e
STEPS = 12  # BASE_PLAN's
STALL_FLOOR_S = 3.0
STALL_BOUND_S = 30.0  # SIGSTOP to the runner's exit: floor + 10 x the slowest step + teardown


def one_error_line(proc: subprocess.CompletedProcess | tuple[int, str, str]) -> str:
    err = proc.stderr if isinstance(proc, subprocess.CompletedProcess) else proc[2]
    out = proc.stdout if isinstance(proc, subprocess.CompletedProcess) else proc[1]
    assert "Traceback" not in out + err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_stopped_rank_ends_the_attempt_and_the_rerun_resumes(write_plan, tmp_path, finished_run):
    reference = finished_run("gpt-dp2")[0]
    plan = write_plan({"parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}})
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "execute", str(plan)],
        cwd=tmp_path,
        env=dict(os.environ, RUNNER_STALL_FLOOR_S=str(STALL_FLOOR_S)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").exists() and max(metrics(run), default=-1) >= 5:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        rank1 = json.loads((run / "logs" / "attempt_001" / "ranks" / "rank_1.json").read_text())
        os.kill(rank1["pid"], signal.SIGSTOP)  # a stuck collective, a dead mount
        stopped_at = time.time()
        out, err = proc.communicate(timeout=STALL_BOUND_S + 30)
        took = time.time() - stopped_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = one_error_line((proc.returncode, out, err))
    print(f"SIGSTOP of rank 1 to the runner's exit: {took:.1f} s (measured); {line[:200]}")
    assert proc.returncode == 1 and took < STALL_BOUND_S, (took, line)
    assert "no progress for" in line and "rank(s) 1 (rank 1 stopped" in line, line
    assert "rerun the same command to resume" in line
    assert process_start(rank1["pid"]) == -1  # the stopped rank was ended, nothing is left
    assert not group_members(proc.pid)
    billed = Billing(run).attempts[-1]
    assert billed["last_seen"] - billed["start"] >= took  # the stall is billed

    again = run_cli("runner", "execute", str(plan), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout
    ref, ours = metrics(reference), metrics(run)
    assert [ours[s]["loss"] for s in range(STEPS)] == [ref[s]["loss"] for s in range(STEPS)]


def test_node_whose_node0_never_comes_gives_up(write_plan, tmp_path):
    plan = write_plan({"parallel": {"nnodes": 2, "nproc_per_node": 1, "data_parallel_degree": 2}})
    began = time.time()
    proc = run_cli(
        "runner",
        "execute",
        str(plan),
        "--node-rank",
        "1",
        "--master",
        f"127.0.0.1:{free_port()}",
        cwd=tmp_path,
        env={"RUNNER_STARTUP_LIMIT_S": "5"},
        timeout=240,
    )
    took = time.time() - began
    line = one_error_line(proc)
    print(f"node 1 without node 0 gave up after {took:.1f} s (measured, limit 5 s + start-up)")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert line.startswith("node 1: no rank started") and "never completed" in line, line
    own = Billing(tmp_path / "run", node_rank=1)
    assert len(own.attempts) == 1 and 5 <= own.total_seconds() <= took + 1.0
    assert not (tmp_path / "run" / "billing.json").exists()  # node 0's bill is node 0's


def test_slow_startup_never_bills_past_max_cost(write_plan, tmp_path, shared_cache, finished_run):
    """The start-up takes longer than the budget left: the runner's own clock ends it at the
    deadline (before: it slept through it, trained, and billed past max_cost)."""
    from runner.ceiling import STARTUP_FILE

    finished_run("gpt")  # the shared cache holds the data
    cache = tmp_path / "cache"
    shutil.copytree(shared_cache, cache)
    (cache / STARTUP_FILE).unlink(missing_ok=True)  # the pre-launch check uses its 15 s bound
    max_cost = 30.0 / 3600  # 30 s at 1 USD/node-hour; the check before launch needs ~18 s
    plan = write_plan({"job": {"cache_dir": str(cache)}, "budget": {"max_cost": max_cost}})
    proc = run_cli(
        "runner", "execute", str(plan), cwd=tmp_path, env={"RUNNER_TEST_LAUNCH_DELAY_S": "60"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "budget spent during start-up" in proc.stdout, proc.stdout[-2000:]
    billed = Billing(tmp_path / "run").total_seconds()
    print(f"slowed start-up: billed {billed:.2f} s of {max_cost * 3600:.0f} s (measured)")
    assert billed * 1.0 / 3600 <= max_cost


def test_rerun_of_a_spent_run_is_billed(write_plan, tmp_path, finished_run):
    """A rerun that only says "budget spent" runs seconds: they are in the journal, and the
    journal's last record is written when the process ends (billed = its wall time)."""
    source = finished_run("gpt")[0]
    run = tmp_path / "run"
    shutil.copytree(source, run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")  # stopped at step 8 of 12
    billed = Billing(run).total_seconds()
    plan = write_plan({"budget": {"max_cost": billed / 3600}})
    began = time.time()
    proc = run_cli("runner", "execute", str(plan), cwd=tmp_path)
    wall = time.time() - began
    assert proc.returncode == 0 and "budget spent:" in proc.stdout, proc.stderr[-3000:]
    attempts = Billing(run).attempts
    rerun = attempts[-1]["last_seen"] - attempts[-1]["start"]
    print(f"spent rerun: billed {rerun:.2f} s, wall {wall:.2f} s (measured)")
    assert len(attempts) == 2 and attempts[-1]["budget_check"] == 1
    assert abs(rerun - wall) < 1.0
