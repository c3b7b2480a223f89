"""The local rehearsal's fitting, its agreement with the planner's model, `--set`, and the
failure report's pieces (fast: no training here; tests/test_failure_e2e.py runs the real thing)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import REPO

from gptplan.errors import PlanError
from gptplan.memory import GB
from gptplan.plan import load_plan, plan_from_dict
from gptplan.profile import read_performance
from gptplan.steptime import data_parallel_step_time_s
from runner.failure import _culprit, clean_tail, suggested_micro_batch
from runner.overrides import load_plan_with
from runner.rehearsal import (
    DEFAULT_STEPS,
    HEADROOM,
    LIMIT_MARGIN,
    STEP_TARGET_S,
    localize,
    modelled_memory_bytes,
    rank_memory_limit_bytes,
    rehearse,
)

BANK = REPO / "plans" / "bank_faq.toml"


@pytest.fixture(scope="module")
def bank_local():
    plan, _ = localize(load_plan(BANK))
    return plan


def test_bank_faq_rehearsal_fits_memory_and_keeps_tokens_per_rank(bank_local):
    limit_gb = 6.0
    r = rehearse(
        bank_local,
        max_steps_given=False,
        limit_gb=limit_gb,
        pinned=frozenset(
            {"training.gradient_accumulation_steps", "training.per_device_train_batch_size"}
        ),
    )
    t, before = r.plan.training, bank_local.training
    assert r.memory_bytes <= HEADROOM * limit_gb * GB
    assert t.per_device_train_batch_size < before.per_device_train_batch_size
    # the global batch is kept through accumulation (time fitting was pinned off)
    assert (
        t.per_device_train_batch_size * t.gradient_accumulation_steps * t.seq_len
        == before.per_device_train_batch_size * before.gradient_accumulation_steps * before.seq_len
    )
    assert t.max_steps == DEFAULT_STEPS
    assert r.memory_limit_bytes == int(limit_gb * GB)
    assert any(
        c.startswith("training.per_device_train_batch_size: 64 -> ") and "memory:" in c
        for c in r.changes
    )
    # the estimate is the local model's, so the report is planned-vs-actual for the rehearsal
    assert r.plan.estimate.source == "model"
    assert r.plan.estimate.step_time_s == pytest.approx(r.step_time_s)


def test_rehearsal_shrinks_seq_len_when_micro_batch_one_does_not_fit(bank_local):
    # 3.5 GB: micro-batch 1 at seq 512 is modelled above its headroom (the rehearsal runs the
    # plan's fp16 O2 on the device: 2.25 GB; in fp32 it needed more)
    r = rehearse(bank_local, max_steps_given=True, limit_gb=3.5)
    assert r.plan.training.per_device_train_batch_size == 1
    assert r.plan.training.seq_len < 512
    assert r.memory_bytes <= HEADROOM * 3.5 * GB
    assert r.plan.training.max_steps == bank_local.training.max_steps  # --max-steps given


def test_rehearsal_step_is_short_unless_pinned(bank_local):
    r = rehearse(bank_local, max_steps_given=False)
    assert r.step_time_s <= STEP_TARGET_S
    assert any("time:" in c for c in r.changes)


def test_model_too_big_for_any_rehearsal_is_one_clear_error(bank_local):
    with pytest.raises(Exception, match="too large to rehearse here"):
        rehearse(bank_local, max_steps_given=False, limit_gb=0.5)


def test_fitting_plan_is_unchanged_except_steps(write_plan):
    plan, _ = localize(load_plan(write_plan()))
    r = rehearse(plan, max_steps_given=False)
    assert [c.split(":")[0] for c in r.changes] == ["training.max_steps"]
    assert (
        dataclasses.replace(
            r.plan.training,
            max_steps=plan.training.max_steps,
            warmup_steps=plan.training.warmup_steps,
        )
        == plan.training
    )


def test_runner_step_time_and_memory_agree_with_the_planner():
    """One formula, two callers: the runner's rehearsal model must equal the planner's
    candidate evaluation for the same data-parallel configuration on the cpu profile."""
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen.evaluate import evaluate_offer
    from planner.spec import load_spec

    spec = load_spec(str(REPO / "planner" / "specs" / "cpu_demo.toml"))
    choice = [c for c in allowed_offers(spec, load_profiles()) if c.offer.gpus_per_node == 2][0]
    rows = evaluate_offer(spec, choice, 0, 1e6)
    pick = np.flatnonzero((rows["precision_code"] == 0) & (rows["recompute_code"] == 0))[0]
    model = dataclasses.asdict(spec.model_section())
    plan = plan_from_dict(
        {
            "schema": 1,
            "name": "agree",
            "model": model,
            "training": {
                "seq_len": int(rows["seq"][pick]),
                "per_device_train_batch_size": int(rows["micro"][pick]),
                "gradient_accumulation_steps": int(rows["acc"][pick]),
                "max_steps": 10,
                "warmup_steps": 1,
                "precision": "fp32",
            },
            "parallel": {"nproc_per_node": 2, "data_parallel_degree": 2},
            "hardware": {"profile": "cpu", "device": "cpu", "precisions": ["fp32"]},
        }
    )
    perf = read_performance("cpu")
    assert data_parallel_step_time_s(plan, perf) == pytest.approx(
        rows["step_time_s"][pick], rel=1e-9
    )
    assert modelled_memory_bytes(plan, perf) == pytest.approx(
        rows["memory_gb"][pick] * GB, rel=1e-9
    )


def test_rank_limit_follows_the_plan_within_the_machine(write_plan):
    plan = load_plan(write_plan())
    modelled = modelled_memory_bytes(plan, read_performance("cpu"))
    limit = rank_memory_limit_bytes(plan)
    assert modelled < limit <= max(LIMIT_MARGIN * modelled, modelled + GB) + 1
    assert rank_memory_limit_bytes(plan, limit_gb=0.9) == int(0.9 * GB)


# ---- --set -------------------------------------------------------------------------------------


def test_set_overrides_are_validated_like_the_file(write_plan):
    path = write_plan()
    plan, pinned = load_plan_with(
        path, ["training.per_device_train_batch_size=16", "training.precision=bf16", "job.seed=3"]
    )
    assert plan.training.per_device_train_batch_size == 16
    assert plan.training.precision == "bf16" and plan.job.seed == 3
    assert pinned == {"training.per_device_train_batch_size", "training.precision", "job.seed"}
    for bad, says in [
        ("training.per_device_batch=4", "training.per_device_batch"),
        ("training.seq_len=abc", "training.seq_len"),
        ("training.seq_len=100000", "training.seq_len"),
        ("nosuch.key=1", "not a plan section"),
        ("seq_len=4", "SECTION.KEY=VALUE"),
    ]:
        with pytest.raises(PlanError) as info:
            load_plan_with(path, [bad])
        assert says in str(info.value) and "\n" not in str(info.value)


# ---- failure report pieces ---------------------------------------------------------------------

LOG = """[2026-12-03 07:13:24,876] [    INFO] distributed_strategy.py:341 - initialized
======================= Modified FLAGS detected =======================
FLAGS(name='FLAGS_enable_pir_in_executor', current_value=True, default_value=False)
=======================================================================
I1203 07:13:24.878587  8877 tcp_utils.cc:109] Retry to connect to 127.0.0.1:60145
/x/paddle/distributed/communication/group.py:145: UserWarning: Current global rank 1 is not
  warnings.warn(
training t: 40 steps x 512 tokens, world size 2
step 1/40 | loss 8.3111
Traceback (most recent call last):
MemoryError: std::bad_alloc
"""


def test_log_tail_leaves_out_banners_and_warnings():
    assert clean_tail(LOG) == [
        "training t: 40 steps x 512 tokens, world size 2",
        "step 1/40 | loss 8.3111",
        "Traceback (most recent call last):",
        "MemoryError: std::bad_alloc",
    ]


def test_first_rank_that_died_on_its_own_is_the_cause(tmp_path):
    (tmp_path / "workerlog.0").write_text(
        "terminate called after throwing an instance of 'gloo::IoException'\n"
    )
    (tmp_path / "workerlog.1").write_text("step 3\n")
    records = [
        {"rank": 0, "exit_code": -6, "signal": "SIGABRT", "ended": 10.0},
        {"rank": 1, "exit_code": -9, "signal": "SIGKILL", "ended": 10.2},
    ]
    assert _culprit(records, tmp_path)["rank"] == 1
    records[0]["signal"], records[0]["exit_code"] = None, 1
    assert _culprit(records, tmp_path)["rank"] == 1  # gloo text marks rank 0 as a consequence
    (tmp_path / "workerlog.0").write_text("ValueError: boom\n")
    assert _culprit(records, tmp_path)["rank"] == 0
    records.append(
        {"rank": 2, "exit_code": -9, "signal": "SIGKILL", "ended": 11.0, "killed_for_memory": True}
    )
    assert _culprit(records, tmp_path)["rank"] == 2


def test_suggested_micro_batch_scales_with_the_overshoot(write_plan):
    plan, _ = load_plan_with(write_plan(), ["training.per_device_train_batch_size=64"])
    assert suggested_micro_batch(plan, 2 * GB, 1 * GB) == 25
    assert suggested_micro_batch(plan, 1.01 * GB, 1 * GB) == 32
    assert math.isfinite(suggested_micro_batch(plan, 0, 0))
