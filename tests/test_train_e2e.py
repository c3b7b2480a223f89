"""End-to-end: really tokenize, really train a tiny GPT on CPU (1 and 2 processes), really
kill -9 and resume, budget refusals, export (SIGTERM and the budget guard: test_robustness.py).
Every run goes through the `runner` CLI."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAMILIES, LLAMA, SHARED_RUNS, merge, run_cli

from runner.billing import Billing
from runner.device.support import local_precisions, support

pytestmark = pytest.mark.e2e
DP2 = {"parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}}


def metrics(run_dir: Path) -> dict[int, dict]:
    """Per step, the last logged record (a resumed run re-logs the steps it redid)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record
    return out


def execute(plan: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = run_cli("runner", "execute", str(plan), *extra, cwd=plan.parent, timeout=timeout)
    if proc.returncode not in (0, 143):
        print(proc.stdout[-4000:], proc.stderr[-4000:])
    return proc


def start_background(plan: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "runner", "execute", str(plan), *extra],
        cwd=plan.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and max(metrics(run_dir), default=-1) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout}s")


@pytest.mark.parametrize("family", FAMILIES)
def test_single_process_trains_checkpoints_reports_and_exports(finished_run, family):
    run, proc = finished_run(family)  # BASE_PLAN's run of `family`, with --export
    steps = metrics(run)
    assert sorted(steps) == list(range(12))
    assert all(math.isfinite(r["loss"]) for r in steps.values())
    assert steps[11]["loss"] < steps[0]["loss"] - 0.3  # it learns
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000008",
        "step_00000012",
    ]  # keep_last = 2
    report = json.loads((run / "report.json").read_text())
    rows = {r["metric"]: r for r in report["rows"]}
    assert rows["tokens trained"]["actual"] == 12 * 8 * 32
    assert report["finished"] and report["useful_token_fraction"] == 1.0
    assert rows["MFU"]["actual"] > 0 and rows["total cost (billed wall-clock)"]["actual"] > 0
    assert "actual (measured)" in proc.stdout
    # The exported model loads and runs for inference.
    import numpy as np
    import paddle

    net = paddle.jit.load(str(run / "export" / "model"))
    logits = net(paddle.to_tensor(np.array([[5, 6, 7]], dtype="int64")))
    assert tuple(logits.shape) == (1, 3, 4000)


def check_two_process_run(run: Path, steps: int) -> None:
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and result["finished"]
    assert result["measured"]["tokens_trained"] == steps * (4 * 2 * 2) * 32  # micro x acc x dp
    logs = sorted(p.name for p in (run / "logs" / "attempt_001").glob("workerlog.*"))
    assert logs == ["workerlog.0", "workerlog.1"]
    assert json.loads((run / "launcher.json").read_text())["process_group"] > 0
    # rank 1 waited for rank 0's TCP store (runner.parallel.wait_for_the_store): Paddle's first
    # try connected; a refused one costs the launch 3 s (tcp_utils.cc), as before the wait
    rank1 = (run / "logs" / "attempt_001" / "workerlog.1").read_text(errors="replace")
    assert "Successfully connected to" in rank1 and "Retry to connect" not in rank1


def test_two_process_data_parallel(finished_run):
    """GPT: the shared 12-step run (also the reference of kill -9 and multinode); Llama's
    2-process run is the rehearsal of test_gpu_plan_on_cpu_machine_fails_clearly_then_local_
    rehearses."""
    check_two_process_run(finished_run("gpt-dp2")[0], steps=12)


@pytest.mark.parametrize(
    "shared", ["gpt", "qwen-dp2", "llama"], ids=["1proc", "2proc-dp-qwen", "1proc-llama"]
)
def test_kill9_then_resume_matches_uninterrupted_run(write_plan, tmp_path, shared, finished_run):
    """SIGKILL every process of a run mid-way; the resumed run ends with the same tokens and
    the same per-step losses as a run that was never interrupted (the shared run of the same
    plan: 12 steps, checkpoints every 4). The 2-process case (launcher process group killed
    too) runs on QWen's shared run, which also proves that family's resume; GPT's 2-process
    run is checked by test_two_process_data_parallel and the multinode tests."""
    ref = finished_run(shared)[0]
    plan = write_plan(SHARED_RUNS[shared] | {"job": {"output_dir": str(tmp_path / "killed")}})
    run = tmp_path / "killed"
    proc = start_background(plan)
    wait_for_step(run, 4, proc)  # past the checkpoint at step 4
    groups = [os.getpgid(proc.pid)]
    if (run / "launcher.json").exists():
        groups.append(json.loads((run / "launcher.json").read_text())["process_group"])
    for group in groups:
        os.killpg(group, signal.SIGKILL)
    proc.wait(timeout=60)
    time.sleep(1)  # PDEATHSIG reaches the ranks
    done = max(metrics(run))
    assert done < 11, "the kill came too late to test anything"
    resumed = execute(plan)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resuming from" in resumed.stdout
    ref_steps, run_steps = metrics(ref), metrics(run)
    assert sorted(run_steps) == sorted(ref_steps) == list(range(12))
    assert [run_steps[s]["loss"] for s in range(12)] == [ref_steps[s]["loss"] for s in range(12)]
    ref_result = json.loads((ref / "result.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert result["measured"]["tokens_trained"] == ref_result["measured"]["tokens_trained"]
    billing = Billing(run).attempts
    assert len(billing) == 2  # the killed attempt is still billed


# SIGTERM: the runner checkpoints at the next step and exits 143 (a 2-process run) is checked
# in test_robustness.py::test_second_runner_on_same_run_dir_exits_2_naming_holder_then_sigterm_
# checkpoints, on the run it starts anyway.


# The budget guard (alert, stop within one step, billed total under max_cost) is checked on the
# first attempt of test_robustness.py::test_budget_is_a_hard_ceiling_including_reruns[max_cost],
# the same plan.


def test_budget_that_cannot_buy_one_step_is_refused(write_plan, tmp_path):
    plan = write_plan(
        {"budget": {"max_cost": 0.001}, "estimate": {"source": "model", "step_time_s": 10.0}}
    )
    proc = execute(plan)
    assert proc.returncode == 2
    assert "cannot buy one step" in proc.stderr and "budget.max_cost" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bf16_on_cpu_is_refused_not_run_as_fp32_under_its_name(write_plan, tmp_path):
    """Paddle's AMP is a no-op on CPU: a 'bf16' CPU run would be the fp32 run mislabelled."""
    assert local_precisions() == ["fp32"]
    plan = write_plan({"training": {"precision": "bf16", "max_steps": 4}})
    proc = execute(plan)
    assert proc.returncode == 2
    assert "AMP is a no-op on CPU" in proc.stderr and "training.precision" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_gpu_plan_on_cpu_machine_fails_clearly_then_local_rehearses(write_plan, tmp_path):
    """A Llama plan: its rehearsal is also the Llama family's 2-process data-parallel run."""
    plan = write_plan(
        merge(
            LLAMA,
            {
                "parallel": {"nnodes": 2, "nproc_per_node": 8, "data_parallel_degree": 16},
                "hardware": {
                    "device": "gpu",
                    "profile": "a100-80gb",
                    "precisions": ["fp32", "fp16", "bf16"],
                },
                "training": {"precision": "fp16"},
            },
        )
    )
    proc = execute(plan)
    assert proc.returncode == 2
    assert "this machine has 0" in proc.stderr and "--local" in proc.stderr
    assert "--node-rank 1" in proc.stdout  # the commands for the planned cluster
    local = execute(plan, "--local", "--max-steps", "2")
    assert local.returncode == 0, local.stderr[-3000:]
    assert "parallel.nproc_per_node: 8 -> 2" in local.stdout
    if support().on_device:  # the rehearsal device runs the plan's fp16 (docs/device.md)
        assert "training.precision" not in local.stdout
    else:
        assert "training.precision: 'fp16' ->" in local.stdout
    check_two_process_run(tmp_path / "run.local-max_steps_2", steps=2)
