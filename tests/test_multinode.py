"""Multi-node over the loopback: two `runner execute --node-rank R --master 127.0.0.1:PORT`
processes (2 nodes x 1 process) on this machine, as on a real cluster with a shared run dir.

One chained scenario keeps the suite short: kill -9 of node 1 mid-run, resume of both, SIGTERM
to node 1 (both nodes checkpoint and exit 143), a start with per-node run dirs that the ranks
refuse, resume to the end; the per-step losses equal those of 1 node x 2 processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_e2e import metrics

from runner.billing import Billing

pytestmark = pytest.mark.e2e
STEPS = 12  # BASE_PLAN's, checkpoints every 4
LATE_S = 12.0  # node 0's restart after node 1's


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_node(plan: Path, rank: int, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "execute",
            str(plan),
            "--node-rank",
            str(rank),
            "--master",
            f"127.0.0.1:{port}",
            *extra,
        ],
        cwd=plan.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def start_cluster(plan: Path, *node1_extra: str) -> list[subprocess.Popen]:
    port = free_port()
    return [start_node(plan, 0, port), start_node(plan, 1, port, *node1_extra)]


def finish(nodes: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str]]:
    out = []
    for proc in nodes:
        text, _ = proc.communicate(timeout=timeout)
        out.append((proc.returncode, text))
    return out


def wait_for_step(run: Path, step: int, nodes: list[subprocess.Popen], timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and max(metrics(run), default=-1) >= step:
            return
        if any(p.poll() is not None for p in nodes):
            raise AssertionError(f"a node ended early: {finish(nodes, 60)}")
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def test_two_nodes_kill9_sigterm_resume_match_one_node(write_plan, tmp_path, finished_run):
    reference = finished_run("gpt-dp2")[0]  # the same plan on 1 node x 2 processes
    plan = write_plan(
        {
            "job": {"output_dir": str(tmp_path / "run")},
            "parallel": {"nnodes": 2, "nproc_per_node": 1, "data_parallel_degree": 2},
        },
        "two.toml",
    )
    run = tmp_path / "run"

    # 1. node 1 crashes (kill -9 of everything on it): node 0's rank fails too. Its launcher
    #    first (its ranks die with it: PR_SET_PDEATHSIG SIGKILL), then its runner. The other
    #    order is a different fault: a runner killed while its launcher lives hands the launcher
    #    SIGTERM (runner.launch: die_with_parent), which stops every rank as a preemption notice
    #    would, and node 0 then exits 143; that window is what the pause below would widen, so
    #    with this order the outcome cannot depend on the machine's load.
    nodes = start_cluster(plan)
    wait_for_step(run, 4, nodes)  # past the checkpoint at step 4
    node1_launcher = json.loads((run / "launcher.node01.json").read_text())["process_group"]
    node1_runner = os.getpgid(nodes[1].pid)
    os.killpg(node1_launcher, signal.SIGKILL)
    time.sleep(1.0)
    with contextlib.suppress(ProcessLookupError):  # it may have ended on its own meanwhile
        os.killpg(node1_runner, signal.SIGKILL)
    (rc0, out0), _ = finish(nodes)
    assert rc0 == 1, out0[-3000:]
    killed_at = max(metrics(run))
    assert killed_at < STEPS - 1, "the kill came too late to test anything"

    # 2. resume both, node 1 first and node 0 LATE_S later (node 1's machine is billed while it
    #    waits); SIGTERM to node 1 only: every rank stops at the same step, node 0 writes the
    #    checkpoint, both runners exit 143.
    port = free_port()
    node1 = start_node(plan, 1, port)
    time.sleep(LATE_S)
    nodes = [start_node(plan, 0, port), node1]
    wait_for_step(run, killed_at + 1, nodes)
    nodes[1].send_signal(signal.SIGTERM)
    (rc0, out0), (rc1, out1) = finish(nodes)
    assert (rc0, rc1) == (143, 143), (out0[-2000:], out1[-2000:])
    assert "resuming from" in out0
    result = json.loads((run / "result.json").read_text())
    assert result["stop_reason"].startswith("signal") and not result["finished"]
    stopped = result["completed_steps"]
    assert stopped < STEPS
    assert (
        json.loads((run / "checkpoints" / f"step_{stopped:08d}" / "state.json").read_text())["step"]
        == stopped
    )
    assert "node 1: stopped: signal" in out1

    # 3. per-node run dirs (node 1 sees no checkpoint): the ranks refuse to start from
    #    different steps instead of silently diverging.
    nodes = start_cluster(plan, "--output-dir", str(tmp_path / "node1_disk"))
    (rc0, out0), (rc1, out1) = finish(nodes)
    assert rc0 == 1 and rc1 == 1
    assert "must be on storage shared by all nodes" in out0 + out1

    # 4. resume to the end: same losses, step by step, as 1 node x 2 processes.
    (rc0, out0), (rc1, out1) = finish(start_cluster(plan))
    assert (rc0, rc1) == (0, 0), (out0[-2000:], out1[-2000:])
    ref_steps, run_steps = metrics(reference), metrics(run)
    assert sorted(run_steps) == sorted(ref_steps) == list(range(STEPS))
    assert [run_steps[s]["loss"] for s in range(STEPS)] == [
        ref_steps[s]["loss"] for s in range(STEPS)
    ]
    ref_result = json.loads((reference / "result.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert result["measured"]["tokens_trained"] == ref_result["measured"]["tokens_trained"]

    # One writer of the bill (node 0: one attempt per start, the refused one included) and of
    # the report; each node keeps its own logs; the console shows runner lines only.
    assert len(Billing(run).attempts) == 4
    assert "LAUNCH INFO" not in out0 + out1 and "step 12/12" in out0
    assert "node 1: finished" in out1 and "tokens trained" not in out1
    logs = {
        node: len(list((run / "logs" / node).glob("attempt_*/workerlog.0")))
        for node in ("node_00", "node_01")
    }
    assert logs == {"node_00": 4, "node_01": 3}  # node 1's refused start logged on its disk
    every_nodes_time_is_billed(run, out0)


def every_nodes_time_is_billed(run: Path, out0: str) -> None:
    """Node 0's report, the guard's total and billing.json count node 1's own time (issue 39):
    node 1 ran LATE_S alone in step 2, which node 0's time x 2 nodes missed."""
    from runner.billing import journal_paths, parse_nodes

    node0 = Billing(run, nnodes=2)
    s0 = sum(a["last_seen"] - a["start"] for a in node0.attempts)
    s1 = sum(a["last_seen"] - a["start"] for a in Billing(run, node_rank=1).attempts)
    cluster = node0.total_seconds()  # seconds of the 2-node cluster
    assert 2 * cluster >= s0 + s1 and 2 * cluster >= 2 * s0 + LATE_S / 2, (s0, s1, cluster)
    copied = parse_nodes(journal_paths(run, 0)[0].read_text())
    assert copied is not None and len(copied.get(1, [])) == 3  # node 1's attempts on this disk
    report = json.loads((run / "report.json").read_text())
    billed = next(r for r in report["rows"] if r["metric"].startswith("total cost"))["actual"]
    # at 1 USD per node-hour: more than node 0's time x 2 nodes (what was billed before) as of
    # the report (node 0 went on with the export and closing after it)
    after = node0.attempts[-1]["last_seen"] - (run / "report.json").stat().st_mtime
    s0_at_report = s0 - max(0.0, after)
    assert billed * 3600 > 2 * s0_at_report + LATE_S / 2 - 1, (billed * 3600, s0, after, s1)
