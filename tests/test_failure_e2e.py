"""Real 2-process runs that fail: a rank over its memory limit, a rank killed by SIGKILL; each
ends with the one-line report (exact wording) and leaves no process behind. And the same
oversized plan rehearsed with --local is shrunk to fit and runs."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_train_e2e import DP2, execute, start_background, wait_for_step

pytestmark = pytest.mark.e2e
BIG_MICRO = ["--set", "training.per_device_train_batch_size=512"]
GB_NUMBER = r"\d+\.\d+"


def rank_records(run_dir: Path) -> list[dict]:
    folder = run_dir / "logs" / "attempt_001" / "ranks"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank_*.json"))]


def assert_no_orphans(run_dir: Path) -> None:
    """Launcher, supervisors and ranks of the run are all gone (pids from their records)."""
    pids = [json.loads((run_dir / "launcher.json").read_text())["launcher_pid"]]
    for record in rank_records(run_dir):
        pids += [record["pid"], record["supervisor_pid"]]
    deadline = time.time() + 10
    alive = pids
    while alive and time.time() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.2)
    assert not alive, f"left behind: {alive}"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_rank_over_its_memory_limit_is_ended_and_reported_then_local_fits(write_plan, tmp_path):
    plan = write_plan(
        DP2 | {"training": {"max_steps": 1, "warmup_steps": 1, "gradient_accumulation_steps": 1}}
    )
    proc = execute(plan, "--memory-limit-gb", "1.2", *BIG_MICRO)
    assert proc.returncode == 1
    pattern = (
        rf"out of memory: rank [01] reached {GB_NUMBER} GB of its 1\.20 GB limit "
        rf"\({GB_NUMBER} GB machine; peak RSS, measured\), so the runner ended it "
        r"\(signal SIGKILL, exit -9\); try --local with a smaller micro-batch or --set "
        r"training\.per_device_train_batch_size=(\d+)"
    )
    lines = [line for line in proc.stderr.splitlines() if re.fullmatch(pattern, line)]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert int(re.fullmatch(pattern, lines[0]).group(1)) < 512
    assert "Modified FLAGS" not in proc.stderr.split(lines[0])[1]  # the tail is without banners
    run = tmp_path / "run"
    killed = [r for r in rank_records(run) if r["killed_for_memory"]]
    assert killed and all(r["killed_at_rss_bytes"] > 1.2e9 for r in killed)
    assert_no_orphans(run)

    # The same oversized settings rehearsed locally: shrunk to fit the limit, then trained.
    local = execute(plan, "--local", "--memory-limit-gb", "1.2", *BIG_MICRO)
    assert local.returncode == 0, local.stderr[-3000:]
    change = re.search(
        r"training\.per_device_train_batch_size: 512 -> (\d+) \(memory: ", local.stdout
    )
    assert change and int(change.group(1)) < 512, local.stdout
    assert re.search(
        r"training\.gradient_accumulation_steps: 1 -> \d+ \(memory: raised to "
        r"\d+ to keep 16,384 tokens",
        local.stdout,
    ), local.stdout
    assert "step time here:" in local.stdout and "modelled" in local.stdout
    assert "planned (model)" in local.stdout  # planned-vs-actual of the rehearsal
    local_run = tmp_path / "run.local"  # the rehearsal keeps out of the real run's folder
    assert f"rehearsal in {local_run} " in local.stdout
    assert not any(r["killed_for_memory"] for r in rank_records(local_run))


def test_sigkill_of_one_rank_names_it(write_plan, tmp_path):
    plan = write_plan(DP2 | {"training": {"max_steps": 400}})
    run = tmp_path / "run"
    proc = start_background(plan)
    try:
        wait_for_step(run, 1, proc)
        victim = [r for r in rank_records(run) if r["rank"] == 1][0]
        os.kill(victim["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-3000:]
    pattern = (
        rf"rank 1 was killed by SIGKILL \(exit -9\) at {GB_NUMBER} GB \(peak RSS, "
        rf"measured\) of {GB_NUMBER} GB, not by this runner nor the kernel's OOM killer; "
        r"rerun the same command to resume from the last checkpoint"
    )
    assert any(re.fullmatch(pattern, line) for line in out.splitlines()), out[-3000:]
    assert_no_orphans(run)
