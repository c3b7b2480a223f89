"""AMP on the rehearsal device in the layouts that used to rehearse in fp32 (issue 34).

- Fleet's sharding stage 1 with GPT in fp16 O2 (the bank-FAQ plan's layout, stage 1 x 2): the
  loss scaler's unscale (`check_finite_and_unscale`) of the fp32 gradients (GPT's LayerNorm
  weights stay fp32 in O2) fell back to Paddle's CPU kernel, whose outputs stay on the CPU; the
  stage-1 gradient reduce then stopped with "interface not found".
- Tensor parallel and tensor + sequence parallel in bf16 O2 and fp16 O1: Paddle 3.3.1 registers
  its custom-device `c_identity`, `mp_allreduce_sum` and `c_softmax_with_cross_entropy(_grad)`
  for fp32/fp16 only.

Tiny GPT and Llama (runner.device.selftest), 3 steps, each per-step loss within AMP_TOLERANCE of
the 1-process fp32 reference, and every parameter, gradient, optimizer state and master weight
of every rank on the device after the first backward and after the first optimizer step (the
loss scaler's unscale included). And, pure: the bank-FAQ plan and a tensor-parallel plan keep
their precision in the local change list.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from gptplan.plan import load_plan
from runner import device
from runner.device import selftest
from runner.device import support as device_support
from runner.rehearsal import localize

# relative, per step, vs the fp32 reference: the AMP rehearsals' tolerance
# (tests/test_rehearsal_device_e2e.py); measured here 6e-6 to 5.3e-5
AMP_TOLERANCE = 1e-3

# one launch per process-group setup: (layouts, precisions, families)
LAUNCHES = {
    "stage1_fp16": ("stage1", ("fp16_o2",), ("gpt",)),  # the bank-FAQ plan's layout
    "tp": ("tp2,tp2_sp", ("bf16_o2", "fp16_o1"), selftest.FAMILIES),
}
RUNS = [
    (f"{layout}/{family}/{precision}", launch)
    for launch, (layouts, precisions, families) in LAUNCHES.items()
    for layout in layouts.split(",")
    for family in families
    for precision in precisions
]


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def amp_runs(tmp_path_factory):
    """The fp32 reference on plain CPU, then each launch on the device; (reference, results,
    failures by launch)."""
    out = tmp_path_factory.mktemp("device_amp")
    ref = _run(
        ["-m", "runner.device.selftest", "reference", "--out", str(out)], out, device.cpu_env()
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = json.loads((out / "reference.json").read_text())
    results: dict = {}
    failures: dict = {}
    for launch, (layouts, precisions, families) in LAUNCHES.items():
        cwd = out / launch
        cwd.mkdir()
        proc = _run(
            [
                "-m",
                "paddle.distributed.launch",
                "--devices",
                device.launch_devices(2),
                "--log_dir",
                str(cwd / "log"),
                str(REPO / "runner" / "device" / "selftest.py"),
                "run",
                "--layouts",
                layouts,
                "--precisions",
                ",".join(precisions),
                "--families",
                ",".join(families),
                "--out",
                str(out),
            ],
            cwd,
            device.env(),
        )
        path = out / f"{layouts.replace(',', '+')}.{'+'.join(precisions)}.json"
        if proc.returncode != 0 or not path.is_file():
            logs = sorted((cwd / "log").glob("workerlog.*"))
            failures[launch] = proc.stdout[-1000:] + "".join(
                p.read_text(errors="replace")[-2500:] for p in logs
            )
            continue
        results.update(json.loads(path.read_text()))
    return reference, results, failures


@pytest.mark.e2e
@pytest.mark.skipif(not device.available(), reason="the rehearsal device is not built")
@pytest.mark.parametrize(("key", "launch"), RUNS)
def test_amp_trains_on_the_device_close_to_fp32(amp_runs, key, launch):
    reference, results, failures = amp_runs
    assert launch not in failures, failures.get(launch)
    got = results[key]
    want = reference[key.split("/")[1]]["losses"]
    assert len(got["losses"]) == len(want) == selftest.STEPS
    assert got["losses"] == pytest.approx(want, rel=AMP_TOLERANCE)
    assert got["losses"] != pytest.approx(want, rel=1e-7, abs=0)  # it did not train in fp32
    off = {rank: bad for rank, bad in got["off_device_by_rank"].items() if bad}
    assert off == {}, off


# ---- the change list (pure): the plan's precision is rehearsed as planned ----------------------


@pytest.fixture
def built_device(monkeypatch) -> device_support.Support:
    """What support() answers where the device is built and loads (this device's real
    capabilities, whether or not it is built here)."""
    monkeypatch.setattr(device, "_state", lambda: (True, ""))
    return device_support.support_from(device.capabilities())


def test_the_bank_faq_rehearsal_keeps_fp16_o2(built_device):
    plan = load_plan(REPO / "plans" / "bank_faq.toml")
    assert (plan.training.precision, plan.training.fp16_opt_level) == ("fp16", "O2")
    local, changes = localize(plan, built_device)
    assert (local.parallel.sharding, local.parallel.sharding_parallel_degree) == ("stage1", 2)
    assert (local.training.precision, local.training.fp16_opt_level) == ("fp16", "O2")
    assert [c for c in changes if c.startswith("training.precision")] == []


def test_a_tensor_parallel_rehearsal_keeps_bf16(built_device):
    plan = load_plan(REPO / "plans" / "llama_zh.toml")
    plan = dataclasses.replace(
        plan,
        parallel=dataclasses.replace(
            plan.parallel,
            tensor_parallel_degree=4,
            sequence_parallel=True,
            data_parallel_degree=2,
            sharding="",
            sharding_parallel_degree=1,
        ),
        training=dataclasses.replace(plan.training, precision="bf16", fp16_opt_level="O2"),
    )
    local, changes = localize(plan, built_device)
    assert local.parallel.tensor_parallel_degree == 2 and local.parallel.sequence_parallel
    assert (local.training.precision, local.training.fp16_opt_level) == ("bf16", "O2")
    assert [c for c in changes if c.startswith("training.precision")] == []


def test_the_runner_checks_placement_after_the_update_before_the_gradients_are_cleared():
    """The update's own ops (the loss scaler's unscale) can move gradients; clearing them can
    hide it: Trainer.check_update (runner.train.check_placement in a run) runs once, between."""
    import numpy as np
    import paddle

    from runner.train import RankInfo, Trainer

    events: list[str] = []

    class Model(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.w = self.create_parameter([2])

        def forward(self, x, labels=None):
            return self.w.sum(), None

    class Optimizer:
        def set_lr(self, lr):
            pass

        def step(self):
            events.append("step")

        def clear_grad(self):
            events.append("clear")

    class Batch:
        input_ids = np.zeros((1, 4), dtype="int64")
        labels = input_ids

    class Batches:
        def micro_batch(self, step, micro):
            return Batch()

    plan = load_plan(REPO / "plans" / "bank_faq.toml")
    plan = dataclasses.replace(
        plan, training=dataclasses.replace(plan.training, precision="fp32", fp16_opt_level="O1")
    )
    trainer = Trainer(plan, RankInfo(), Model(), Optimizer(), None, Batches())  # type: ignore[arg-type]
    trainer.check_update = lambda t: events.append("check")
    trainer.train_step(0)
    trainer.train_step(1)
    assert events == ["step", "check", "clear", "step", "clear"]
