"""The rehearsal device (runner/device, docs/device.md): its build and status, its collectives
(data really moves; a dead or hung peer ends with an error within the deadline; nothing left in
/dev/shm), and parallel layouts of tiny PaddleNLP GPT and Llama models trained on it against a
1-process CPU reference, with every parameter, gradient and optimizer state on the device.

The launches are shared: one reference process and one launch per process-group setup
(tp2 + tp2_sp, stage1 + stage2 + stage3, and with 4 processes pp4 + vpp4 and pp2 x tp2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from runner import device
from runner.device import selftest
from runner.parallel import DEVICE_RUN_ENV

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # per-step loss vs the 1-process reference (fp32)

needs_device = pytest.mark.skipif(
    not device.available(), reason="the rehearsal device is not built (make setup)"
)


def _shm_names(tag: str) -> set[str]:
    """This run's communicator names in /dev/shm (another run on this machine, e.g. another
    checkout's tests, has its own tag)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"{device.DEVICE_TYPE}-{tag}-")}
    except FileNotFoundError:
        return set()


def _launch(script_args: list[str], nprocs: int, cwd: Path, *, extra_env=None, timeout=600, tag=""):
    """paddle.distributed.launch on the device, as one run of its own (a fresh run tag unless
    `tag` is given: runner.parallel.DEVICE_RUN_ENV)."""
    env = device.env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env[DEVICE_RUN_ENV] = tag or uuid.uuid4().hex[:12]
    env.update(extra_env or {})
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--devices",
        device.launch_devices(nprocs),
        "--log_dir",
        str(cwd / "log"),
        *script_args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _worker_logs(cwd: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace")[-3000:] for p in sorted((cwd / "log").glob("workerlog.*"))
    )


# ---- build and status (fast) -------------------------------------------------------------------


def test_capabilities_when_not_built(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "install_dir", lambda: tmp_path / "nothing")
    caps = device.capabilities()
    assert caps["available"] is False
    assert "make setup" in caps["reason"]
    assert caps["layout_kinds"] == [] and caps["precisions"] == []
    assert caps["device_type"] == device.DEVICE_TYPE


def test_stale_build_is_not_available(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "install_dir", lambda: tmp_path)
    (tmp_path / device.LIBRARY).write_bytes(b"")
    (tmp_path / device.STAMP).write_text(json.dumps({"source_digest": "old"}))
    ok, why = device._state()
    assert not ok and "older sources" in why


def test_build_without_compiler_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(device, "compiler", lambda: None)
    with pytest.raises(device.DeviceBuildError, match="no C\\+\\+ compiler"):
        device.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_env_points_at_this_install_only():
    env = device.env({})
    assert env["CUSTOM_DEVICE_ROOT"] == str(device.install_dir())
    assert env["FLAGS_use_stride_kernel"] == "0"
    assert device.cpu_env({})["CUSTOM_DEVICE_ROOT"] == ""


@needs_device
def test_capabilities_when_built():
    caps = device.capabilities()
    assert caps["available"], caps["reason"]
    for kind in ("tp", "pp", "vpp", "sp", "sharding_stage2", "sharding_stage3"):
        assert kind in caps["layout_kinds"]
    assert caps["precisions"] == ["fp32", "bf16", "fp16"]  # AMP: the upcasting kernels
    assert caps["amp_without"] == {}  # AMP runs with every layout kind (tests/test_device_amp.py)


# ---- collectives -------------------------------------------------------------------------------

COLLECTIVES = r"""
import json, sys, time
import numpy as np, paddle, paddle.distributed as dist

dist.init_parallel_env()
r, n = dist.get_rank(), dist.get_world_size()
assert paddle.get_device() == f"gptplan_cpu:{r}", paddle.get_device()
for dt in ["float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8"]:
    x = paddle.to_tensor(np.arange(10) + r * 3, dtype=dt)
    dist.all_reduce(x)
    want = sum(np.arange(10) + k * 3 for k in range(n))
    assert np.allclose(x.astype("float64").numpy(), want), dt
    for op, want in ((dist.ReduceOp.MAX, n - 1), (dist.ReduceOp.MIN, 0)):
        y = paddle.to_tensor(np.full(6, r), dtype=dt)
        dist.all_reduce(y, op=op)
        assert np.allclose(y.astype("float64").numpy(), want), (dt, op)
p = paddle.full([3], float(r + 2)); dist.all_reduce(p, op=dist.ReduceOp.PROD)
assert float(p[0]) == 6.0
# more than one shared-memory slot (4 MB): goes through in chunks
big = paddle.arange(3_000_001, dtype="float32") * (r + 1); dist.all_reduce(big)
# Paddle's allocator statistics work on the device (the memory model is fitted to them)
# (name the device: without an argument Paddle 3.3.1 reads device 0's on every rank)
peak = paddle.device.max_memory_allocated(paddle.get_device())
assert peak >= 12_000_004, peak
assert float(big[-1]) == 3_000_000 * 3 and float(big[7]) == 21
out = []; dist.all_gather(out, paddle.full([1_500_000], float(r)))
assert [float(o[-1]) for o in out] == list(range(n))
b = paddle.full([4], float(r)); dist.broadcast(b, src=1); assert float(b[0]) == 1
rs = paddle.zeros([3])
dist.reduce_scatter(rs, [paddle.full([3], float(r * 10 + k)) for k in range(n)])
assert float(rs[0]) == sum(q * 10 + r for q in range(n))
rd = paddle.full([3], float(r + 1)); dist.reduce(rd, dst=0)
if r == 0: assert float(rd[0]) == 3
peer = 1 - r
# both ranks send twice before receiving: a send must not wait for its receive
a = paddle.full([3_000_000], float(r)); c = paddle.full([5], float(r + 10))
t1 = dist.isend(a, peer); t2 = dist.isend(c, peer)
ra = paddle.zeros([3_000_000]); rc = paddle.zeros([5])
t3 = dist.irecv(ra, peer); t4 = dist.irecv(rc, peer)
for t in (t1, t2, t3, t4): t.wait()
assert float(ra[-1]) == peer and float(rc[0]) == peer + 10
rc2 = paddle.zeros([7])
ops = [dist.P2POp(dist.isend, paddle.full([7], float(r)), peer), dist.P2POp(dist.irecv, rc2, peer)]
for t in dist.batch_isend_irecv(ops): t.wait()
assert float(rc2[0]) == peer
outs = []; dist.alltoall(outs, [paddle.full([2], float(r * 10 + k)) for k in range(n)])
assert [float(o[0]) for o in outs] == [k * 10 + r for k in range(n)]

# ranks of two runs that met at one rendezvous port: rank 1 claims another run's tag, so it
# refuses the communicator rank 0 made (this run's tag), and rank 0's ends by the deadline
import os
mine = os.environ["GPTPLAN_DEVICE_RUN"]
if r == 1:
    os.environ["GPTPLAN_DEVICE_RUN"] = "otherrun"
try:
    dist.all_reduce(paddle.ones([1]), group=dist.new_group([0, 1]))
    report = {"foreign": "no error"}
except Exception as e:
    report = {"foreign": str(e)[-400:]}
os.environ["GPTPLAN_DEVICE_RUN"] = mine
open(f"foreign.{r}.json", "w").write(json.dumps(report))

# a hung peer: rank 1 stops answering; rank 0's collective ends with an error by the deadline
group = dist.new_group([0, 1])
dist.all_reduce(paddle.ones([1]), group=group)
dist.all_reduce(paddle.ones([1]))
if r == 1:
    time.sleep(float(sys.argv[1]) * 1.6)
    import os; os._exit(0)  # then it dies
t0 = time.time()
try:
    dist.all_reduce(paddle.ones([1]), group=group)
    report["hung"] = "no error"
except Exception as e:
    report["hung"] = str(e)[-400:]
report["hung_s"] = time.time() - t0
t0 = time.time()
try:
    dist.all_reduce(paddle.ones([1]))
    report["dead"] = "no error"
except Exception as e:
    report["dead"] = str(e)[-400:]
report["dead_s"] = time.time() - t0
open("collectives.json", "w").write(json.dumps(report))
"""


@pytest.mark.e2e
@needs_device
def test_collectives_move_data_and_end_on_a_dead_or_hung_peer(tmp_path):
    """Every collective the device offers, on 2 processes; a communicator of another run is
    refused; then a hung peer (no answer within the deadline) and a dead one (its process
    gone) each end the call with an error, and no shared-memory segment of this run is left in
    /dev/shm (its names carry the run's tag)."""
    deadline_s = 4
    tag = uuid.uuid4().hex[:12]
    (tmp_path / "coll.py").write_text(COLLECTIVES)
    t0 = time.time()
    proc = _launch(
        ["coll.py", str(deadline_s)],
        2,
        tmp_path,
        extra_env={device.TIMEOUT_ENV: str(deadline_s)},
        timeout=300,
        tag=tag,
    )
    elapsed = time.time() - t0
    out = tmp_path / "collectives.json"
    assert out.is_file(), proc.stdout[-2000:] + _worker_logs(tmp_path)
    report = json.loads(out.read_text())
    # Paddle raises its generic "CustomDevice error"; the device's own line says which and why
    log0 = (tmp_path / "log" / "workerlog.0").read_text(errors="replace")
    log1 = (tmp_path / "log" / "workerlog.1").read_text(errors="replace")
    foreign = [json.loads((tmp_path / f"foreign.{r}.json").read_text())["foreign"] for r in (0, 1)]
    assert "no error" not in foreign, foreign
    assert f"belongs to another run (run tag {tag}; this rank's GPTPLAN_DEVICE_RUN: otherrun)" in (
        log1
    ), log1[-3000:]
    assert report["hung"] != "no error" and report["dead"] != "no error", report
    assert f"no answer from the other ranks within {deadline_s} s" in log0, log0[-3000:]
    assert "(pid " in log0 and "of the communicator has exited" in log0, log0[-3000:]
    assert report["hung_s"] < deadline_s + 10, report
    assert report["dead_s"] < deadline_s + 10, report
    assert elapsed < 300
    assert _shm_names(tag) == set()  # nothing of this run left behind


# ---- layouts vs the 1-process reference ----------------------------------------------------------

LAUNCHES = {  # one launch per process-group setup: its layouts and processes
    "tp2,tp2_sp": 2,
    "stage1,stage2,stage3": 2,
    "pp4,vpp4": 4,  # 1F1B and interleaved (Paddle's interleaved schedule needs pp > 2)
    "pp2_tp2": 4,  # a 4-process hybrid
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The reference on plain CPU, then every launch on the device; {layout/family: result}.
    The reference trains in this process (selftest.reference sets the CPU place), saving a
    Python that imports Paddle and PaddleNLP again."""
    out = tmp_path_factory.mktemp("device_layouts")
    selftest.reference(out)
    reference = json.loads((out / "reference.json").read_text())
    results: dict = {}
    failures: dict = {}
    for layouts, nprocs in LAUNCHES.items():
        cwd = out / layouts.replace(",", "+")
        cwd.mkdir()
        proc = _launch(
            [
                str(ROOT / "runner" / "device" / "selftest.py"),
                "run",
                "--layouts",
                layouts,
                "--out",
                str(out),
            ],
            nprocs,
            cwd,
        )
        path = out / f"{layouts.replace(',', '+')}.json"
        if proc.returncode != 0 or not path.is_file():
            for layout in layouts.split(","):
                failures[layout] = proc.stdout[-1500:] + _worker_logs(cwd)
            continue
        data = json.loads(path.read_text())
        results.update({k: v for k, v in data.items() if isinstance(v, dict)})
    return reference, results, failures, out


@pytest.mark.e2e
@needs_device
@pytest.mark.parametrize("family", selftest.FAMILIES)
@pytest.mark.parametrize("layout", [x for k in LAUNCHES for x in k.split(",")])
def test_layout_matches_reference_on_the_device(layout_runs, layout, family):
    reference, results, failures, _ = layout_runs
    assert layout not in failures, failures.get(layout)
    got = results[f"{layout}/{family}"]
    want = reference[family]["losses"]
    assert len(got["losses"]) == len(want) == selftest.STEPS
    diffs = [abs(a - b) for a, b in zip(got["losses"], want)]
    assert max(diffs) <= TOLERANCE, (got["losses"], want)
    # a matching loss alone proves nothing: every tensor must be on the device, on every rank
    off = {rank: bad for rank, bad in got["off_device_by_rank"].items() if bad}
    assert off == {}, off


@pytest.mark.e2e
@needs_device
def test_the_checks_fail_without_the_in_place_kernels(layout_runs):
    """The same stage 2/3 launch with Paddle's copying CPU fallback instead of the device's
    in-place kernels (GPTPLAN_DEVICE_PLAIN_FALLBACK=1): the updates of the sharded buffers' views
    land in copies and embedding gradients on the CPU, and the checks above see both."""
    reference, _, _, out = layout_runs
    plain = out / "plain"
    plain.mkdir()
    (plain / "init_gpt").symlink_to(out / "init_gpt")
    (plain / "init_llama").symlink_to(out / "init_llama")
    proc = _launch(
        [str(ROOT / "runner" / "device" / "selftest.py"), "run", "--layouts", "stage2,stage3"]
        + ["--out", str(plain)],
        2,
        plain,
        extra_env={"GPTPLAN_DEVICE_PLAIN_FALLBACK": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-1500:] + _worker_logs(plain)
    data = json.loads((plain / "stage2+stage3.json").read_text())
    for key in ("stage2/gpt", "stage3/gpt", "stage2/llama", "stage3/llama"):
        got = data[key]
        want = reference[key.split("/")[1]]["losses"]
        assert max(abs(a - b) for a, b in zip(got["losses"], want)) > TOLERANCE, key
        off = [bad for bad in got["off_device_by_rank"].values() if bad]
        assert any("gradient" in b and "embed" in b for bads in off for b in bads), (key, off)


def test_the_planner_asks_through_runner_probe():
    from runner import probe

    caps = probe.device_capabilities()
    assert caps["device_type"] == device.DEVICE_TYPE
    assert set(caps) >= {"available", "reason", "layout_kinds", "precisions", "env"}
