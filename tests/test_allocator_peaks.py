"""Memory as Paddle allocates it (issue 34): every rank of a run on the rehearsal device (or a
GPU) records its allocator's figures after the model build, around the first optimizer step
and for the later steps, and report.json puts them next to the memory model's figure for each
phase; plain CPU says why there are none."""

from __future__ import annotations

import dataclasses
import math

import pytest
from conftest import REPO

from gptplan.plan import load_plan
from runner.device import support as rd
from runner.metrics import ALLOCATOR_PHASES, AllocatorPhases, AllocatorProbe, per_rank_peaks
from runner.rehearsal import localize, modelled_allocator_gb
from runner.report import memory_per_rank, planned_vs_actual, render
from runner.train import RankInfo, gather_peak_memory

DEVICE = rd.Support(device="gptplan_cpu", kinds=rd.ALL_KINDS, precisions=("fp32",))


class FakeAllocator:
    """paddle.base.core's device_memory_stat_* for one custom device, driven by the test."""

    def __init__(self):
        self.now = {"Allocated": 0, "Reserved": 0}
        self.peak = dict(self.now)

    def use(self, allocated, reserved):
        self.now = {"Allocated": allocated, "Reserved": reserved}
        self.peak = {k: max(self.peak[k], v) for k, v in self.now.items()}

    def current(self, what, device_id):
        assert device_id == 1
        return self.now[what]

    def peak_value(self, what, device_id):
        return self.peak[what]

    def reset(self, what, device_id):
        self.peak[what] = self.now[what]


@pytest.fixture
def fake(monkeypatch):
    from paddle.base import core

    alloc = FakeAllocator()
    monkeypatch.setattr(core, "device_memory_stat_current_value", alloc.current, raising=False)
    monkeypatch.setattr(core, "device_memory_stat_peak_value", alloc.peak_value, raising=False)
    monkeypatch.setattr(core, "device_memory_stat_reset_peak_value", alloc.reset, raising=False)
    return alloc


def test_phases_on_the_rehearsal_device(fake):
    phases = AllocatorPhases(AllocatorProbe("custom", 1))
    fake.use(3e9, 4e9)  # building: a transient
    fake.use(1e9, 4e9)  # the model stays
    phases.after_build()
    fake.use(6e9, 7e9)  # first step: activations and the optimizer states appear
    fake.use(3e9, 7e9)
    phases.after_step(first=True)
    for peak in (5e9, 5.5e9):
        fake.use(peak, 7e9)
        fake.use(3e9, 7e9)
        phases.after_step(first=False)
    phases.finish()
    [row] = per_rank_peaks([phases.vector_gb()])
    assert row == {
        "rank": 0,
        "allocated_gb": 6.0,
        "reserved_gb": 7.0,
        "model_build_peak_allocated_gb": 3.0,
        "model_build_peak_reserved_gb": 4.0,
        "after_model_build_allocated_gb": 1.0,
        "after_model_build_reserved_gb": 4.0,
        "first_step_peak_allocated_gb": 6.0,
        "first_step_peak_reserved_gb": 7.0,
        "after_first_step_allocated_gb": 3.0,
        "after_first_step_reserved_gb": 7.0,
        "step_peak_allocated_gb": 5.5,
        "step_peak_reserved_gb": 7.0,
    }
    assert set(ALLOCATOR_PHASES) == {k[: -len("_allocated_gb")] for k in row if "_allocated" in k}


def test_report_puts_each_phase_next_to_the_model(fake):
    plan, _ = localize(load_plan(REPO / "plans" / "bank_faq.toml"), DEVICE)
    modelled = modelled_allocator_gb(plan)
    assert 0 < modelled["after_model_build_gb"] < modelled["after_first_step_gb"]
    assert modelled["after_first_step_gb"] < modelled["step_peak_gb"]
    assert modelled["step_peak_gb"] < modelled["total_with_runtime_gb"]
    rows = per_rank_peaks(
        [
            [6, 7, 3, 4, 1, 4, 6, 7, 3, 7, 5.5, 7],
            [6.5, 8, 3, 4, 1.2, 4, 6.5, 8, 3.1, 8, 5, 8],
        ]
    )
    mem = memory_per_rank(plan, {"peak_memory_per_rank": rows, "allocator_method": "m"})
    assert mem["modelled_allocator_gb"] == modelled
    assert mem["measured_over_modelled"]["after_model_build"] == pytest.approx(
        1.2 / modelled["after_model_build_gb"]
    )
    assert mem["measured_over_modelled"]["step_peak"] == pytest.approx(
        5.5 / modelled["step_peak_gb"]
    )
    assert mem["busiest_rank"] == 1 and mem["method"] == "m per rank (measured)"


def test_plain_cpu_says_why_there_are_no_allocator_peaks():
    plan, _ = localize(load_plan(REPO / "plans" / "bank_faq.toml"), rd.PLAIN_CPU)
    probe = AllocatorProbe.for_plan(plan)
    assert probe.kind == "" and "Paddle's CPU build keeps no allocator statistics" in probe.why_not
    assert gather_peak_memory(plan, RankInfo()) is None
    assert math.isnan(AllocatorPhases(probe).vector_gb()[0])
    measured = {
        "tokens_per_second": 1.0,
        "step_time_s": 1.0,
        "peak_memory_gb": 1.0,
        "peak_memory_method": "peak RSS",
        "mfu": 0.1,
        "tokens_trained": 10,
        "useful_token_fraction": 1.0,
        "padded_tokens": 0,
        "allocator_unavailable": probe.why_not,
    }
    result = {
        "measured": measured,
        "finished": True,
        "stop_reason": "finished",
        "completed_steps": 1,
        "max_steps": 1,
    }
    report = planned_vs_actual(plan, result, 1.0)
    assert report["memory_per_rank"] == {"allocator_unavailable": probe.why_not}
    assert "allocator peaks per rank: not measured (plain CPU" in render(report)


def test_a_device_plan_reads_the_custom_devices_statistics(monkeypatch):
    import paddle

    plan, _ = localize(load_plan(REPO / "plans" / "bank_faq.toml"), DEVICE)
    monkeypatch.setattr(paddle, "get_device", lambda: "gptplan_cpu:1")
    assert AllocatorProbe.for_plan(plan) == AllocatorProbe("custom", 1)
    gpu = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, device="gpu"))
    assert AllocatorProbe.for_plan(gpu).kind == "gpu"
