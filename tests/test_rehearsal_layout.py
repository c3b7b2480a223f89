"""`runner execute --local` keeps the plan's own layout (runner.rehearsal.localize, pure): every
kind of parallelism the plan uses, at a width this machine holds, on the rehearsal device; on
plain CPU only data parallel and ZeRO-1, and the change list says which kinds could not run."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import REPO

from gptplan.plan import load_plan, no_recompute_layers, validate
from runner.device import support as rd
from runner.rehearsal import localize

DEVICE = rd.Support(device="gptplan_cpu", kinds=rd.ALL_KINDS, precisions=("fp32",))
CPU = rd.PLAIN_CPU


def hand(training=None, layers=12, **parallel):
    """llama_zh (12 layers, 12 heads, 8 A100s) in another layout."""
    plan = load_plan(REPO / "plans" / "llama_zh.toml")
    plan = dataclasses.replace(
        plan, model=dataclasses.replace(plan.model, num_hidden_layers=layers)
    )
    base = {"sharding": "", "sharding_parallel_degree": 1}
    plan = dataclasses.replace(
        plan,
        parallel=dataclasses.replace(plan.parallel, **(base | parallel)),
        training=dataclasses.replace(plan.training, **(training or {})),
        job=dataclasses.replace(plan.job, target_tokens=0),
    )
    validate(plan)
    return plan


PLANS = {
    "tp4xpp2": lambda: hand(tensor_parallel_degree=4, pipeline_parallel_degree=2),
    "stage3x8": lambda: hand(sharding="stage3", sharding_parallel_degree=8),
    "tp4+sp x dp2": lambda: hand(
        tensor_parallel_degree=4, sequence_parallel=True, data_parallel_degree=2
    ),
    "pp4 vpp3": lambda: hand(
        pipeline_parallel_degree=4,
        virtual_pp_degree=3,
        data_parallel_degree=2,
        training={"gradient_accumulation_steps": 8},
    ),
    "pp2 per-layer recompute": lambda: hand(
        pipeline_parallel_degree=2,
        data_parallel_degree=4,
        recompute="full_attn",
        recompute_layers=6,
    ),
    "bank_faq": lambda: load_plan(REPO / "plans" / "bank_faq.toml"),
    "llama_zh": lambda: load_plan(REPO / "plans" / "llama_zh.toml"),
}

# (tp, pp, vpp, sharding, sharding degree, dp, sequence parallel, processes, layers)
ON_DEVICE = {
    "tp4xpp2": (2, 2, 1, "", 1, 1, False, 4, 12),
    "stage3x8": (1, 1, 1, "stage3", 2, 1, False, 2, 12),
    "tp4+sp x dp2": (2, 1, 1, "", 1, 2, True, 4, 12),
    "pp4 vpp3": (1, 4, 3, "", 1, 1, False, 4, 12),
    "pp2 per-layer recompute": (1, 2, 1, "", 1, 2, False, 4, 12),
    "bank_faq": (1, 1, 1, "stage1", 2, 1, False, 2, 12),
    "llama_zh": (1, 1, 1, "stage1", 2, 1, False, 2, 12),
}
ON_CPU = {
    "tp4xpp2": (1, 1, 1, "", 1, 2, False, 2, 12),
    "stage3x8": (1, 1, 1, "", 1, 2, False, 2, 12),
    "tp4+sp x dp2": (1, 1, 1, "", 1, 2, False, 2, 12),
    "pp4 vpp3": (1, 1, 1, "", 1, 2, False, 2, 12),
    "pp2 per-layer recompute": (1, 1, 1, "", 1, 2, False, 2, 12),
    "bank_faq": (1, 1, 1, "stage1", 2, 1, False, 2, 12),
    "llama_zh": (1, 1, 1, "stage1", 2, 1, False, 2, 12),
}
# the lines every change list must hold (besides hardware, price, estimate)
CHANGES_ON_DEVICE = {
    "tp4xpp2": ["parallel.tensor_parallel_degree: 4 -> 2", "parallel.nproc_per_node: 8 -> 4"],
    "stage3x8": ["parallel.sharding_parallel_degree: 8 -> 2"],
    "tp4+sp x dp2": ["parallel.tensor_parallel_degree: 4 -> 2"],
    "pp4 vpp3": [
        "layout: data parallel not rehearsed: with the rest it needs more than 4 processes",
        "parallel.data_parallel_degree: 2 -> 1",
    ],
    "pp2 per-layer recompute": ["parallel.data_parallel_degree: 4 -> 2"],
    "bank_faq": ["parallel.sharding_parallel_degree: 8 -> 2"],
    "llama_zh": ["parallel.sharding_parallel_degree: 8 -> 2"],
}
CHANGES_ON_CPU = {
    "tp4xpp2": ["layout: tensor parallel, pipeline parallel cannot run on plain CPU"],
    "stage3x8": ["layout: sharding stage3 cannot run on plain CPU"],
    "tp4+sp x dp2": ["layout: tensor parallel, sequence parallel cannot run on plain CPU"],
    "pp4 vpp3": [
        "layout: pipeline parallel, interleaved pipeline (virtual stages) cannot run on plain CPU"
    ],
    "pp2 per-layer recompute": ["layout: pipeline parallel cannot run on plain CPU"],
    "bank_faq": ["parallel.sharding_parallel_degree: 8 -> 2"],
    "llama_zh": ["parallel.sharding_parallel_degree: 8 -> 2"],
}


def layout(plan):
    p = plan.parallel
    return (
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.virtual_pp_degree,
        p.sharding,
        p.sharding_parallel_degree,
        p.data_parallel_degree,
        p.sequence_parallel,
        p.nproc_per_node,
        plan.model.num_hidden_layers,
    )


@pytest.fixture(autouse=True)
def two_cores(monkeypatch):
    from runner import rehearsal

    monkeypatch.setattr(rehearsal, "local_device_count", lambda device: 2 if device else 0)
    monkeypatch.setattr("paddle.is_compiled_with_cuda", lambda: False)


@pytest.mark.parametrize(
    ("sup", "expected", "lines"),
    [(DEVICE, ON_DEVICE, CHANGES_ON_DEVICE), (CPU, ON_CPU, CHANGES_ON_CPU)],
    ids=["device", "plain-cpu"],
)
@pytest.mark.parametrize("name", list(PLANS))
def test_local_layout(name, sup, expected, lines):
    plan = PLANS[name]()
    local, changes = localize(plan, sup)
    assert layout(local) == expected[name]
    validate(local)  # every divisibility rule holds (heads % tp, layers % (pp x vpp), ...)
    for line in lines[name]:
        assert any(c.startswith(line) for c in changes), (line, changes)
    # kept: the recompute granularity, the micro-batch, seq_len; every change is listed
    assert local.parallel.recompute == plan.parallel.recompute
    assert local.training.per_device_train_batch_size == plan.training.per_device_train_batch_size
    assert local.training.seq_len == plan.training.seq_len
    for f in dataclasses.fields(plan.parallel):
        old, new = getattr(plan.parallel, f.name), getattr(local.parallel, f.name)
        assert (old == new) or any(c.startswith(f"parallel.{f.name}: ") for c in changes)
    assert local.training.precision == "fp32"
    assert any(c.startswith("training.precision: 'fp16' -> 'fp32' (") for c in changes)
    where = "the rehearsal device (gptplan_cpu)" if sup.on_device else "plain CPU (gloo)"
    assert f"runs on: {where}, {local.parallel.world_size} process(es)" in changes


def test_per_layer_recompute_is_kept_per_stage():
    plan = PLANS["pp2 per-layer recompute"]()
    local, _ = localize(plan, DEVICE)
    assert local.parallel.recompute_layers == 6  # 3 of 6 layers per stage, as planned
    assert no_recompute_layers(local.model, local.parallel) == no_recompute_layers(
        plan.model, plan.parallel
    )


def test_interleaved_pipeline_changes_layers_only_when_no_width_divides_them():
    # pp 6 x vpp 2 over 24 layers: 4 x 2 = 8 divides 24, so the model is kept
    plan = hand(
        nproc_per_node=6,
        pipeline_parallel_degree=6,
        virtual_pp_degree=2,
        training={"gradient_accumulation_steps": 12},
        layers=24,
    )
    local, changes = localize(plan, DEVICE)
    assert layout(local)[1:3] == (4, 2) and local.model.num_hidden_layers == 24
    assert not any(c.startswith("model.") for c in changes)
    # pp 5 x vpp 2 over 10 layers: neither 4 x 2 nor 3 x 2 divides 10 -> 8 layers, listed
    odd = hand(
        nproc_per_node=5,
        pipeline_parallel_degree=5,
        virtual_pp_degree=2,
        training={"gradient_accumulation_steps": 10},
        layers=10,
    )
    local, changes = localize(odd, DEVICE)
    assert layout(local)[1:3] == (4, 2) and local.model.num_hidden_layers == 8
    assert any(c.startswith("model.num_hidden_layers: 10 -> 8 (") for c in changes)
    validate(local)


def test_accumulation_filled_for_the_local_pipeline():
    # interleaved: a multiple of the local pp (4), at least 2 x 4: 18 -> 20, listed
    plan = hand(
        nproc_per_node=6,
        pipeline_parallel_degree=6,
        virtual_pp_degree=2,
        training={"gradient_accumulation_steps": 18},
        layers=24,
    )
    local, changes = localize(plan, DEVICE)
    assert local.training.gradient_accumulation_steps == 20
    assert any(c.startswith("training.gradient_accumulation_steps: 18 -> 20 (") for c in changes)
    validate(local)


def test_a_rehearsal_device_plan_needs_the_device():
    """A plan written for the rehearsal device fails at launch with one line where the device
    is unavailable (never silently as plain-CPU data parallel)."""
    from gptplan.errors import HardwareError
    from runner.device import support as rehearsal_device

    local, _ = localize(PLANS["tp4xpp2"](), DEVICE)
    assert rehearsal_device.uses_device(local)
    rehearsal_device.support.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rehearsal_device, "support", lambda: rd._plain("not built (test)"))
            with pytest.raises(HardwareError, match="not built"):
                rehearsal_device.launch_env(local)
    finally:
        rehearsal_device.support.cache_clear()


def test_model_shrinks_only_when_micro_batch_and_seq_len_cannot_fit():
    """Layers first (whole layers per pipeline stage), then width; every change listed, the
    layout and the vocabulary (the tokenizer's) kept."""
    from gptplan.memory import GB
    from runner.rehearsal import HEADROOM, rehearse

    local, _ = localize(PLANS["tp4xpp2"](), DEVICE)
    roomy = rehearse(local, max_steps_given=True, limit_gb=64.0)
    assert roomy.plan.model == local.model  # fits: the model is the plan's
    tight = rehearse(local, max_steps_given=True, limit_gb=1.2)
    m, p = tight.plan.model, tight.plan.parallel
    assert m.num_hidden_layers < 12 and m.num_hidden_layers >= p.pipeline_parallel_degree
    assert m.vocab_size == local.model.vocab_size
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree) == (2, 2)
    assert tight.memory_bytes <= HEADROOM * 1.2 * GB
    assert any(c.startswith("model.num_hidden_layers: 12 -> ") for c in tight.changes)
    validate(tight.plan)


def test_rehearsal_prints_a_step_line_every_few_seconds_whatever_logging_steps():
    """Issue 38: `--local --max-steps 30` with logging_steps 100 printed nothing for 10 min."""
    from runner.train import REHEARSAL_LINE_EVERY_S, step_line_due

    local, _ = localize(PLANS["bank_faq"](), DEVICE)
    local = dataclasses.replace(
        local, training=dataclasses.replace(local.training, logging_steps=100, max_steps=30)
    )
    assert step_line_due(local, 3, REHEARSAL_LINE_EVERY_S + 0.1)
    assert not step_line_due(local, 3, 0.5)
    assert step_line_due(local, 30, 0.0)  # the last step, always
    planned = PLANS["bank_faq"]()  # on its cluster: logging_steps decides
    assert not step_line_due(planned, 3, 600.0)
    assert step_line_due(planned, planned.training.logging_steps, 0.0)
    assert REHEARSAL_LINE_EVERY_S <= 10


def test_a_slow_first_step_bounds_the_second(tmp_path, monkeypatch):
    """On the rehearsal device the bank-FAQ rehearsal's first step took 118 s (measured); the
    watchdog ignored it as warm-up and ended the healthy second step at its 120 s floor. Until
    a second step is measured, the first one bounds the wait (10 x)."""
    from runner.supervise import STATUS_DIR_ENV
    from runner.watchdog import STALL_MULTIPLE, ProgressFile, Watchdog, read_progress

    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    for rank in (0, 1):
        ProgressFile(rank).update(1, step_s=118.0)
    dog = Watchdog(tmp_path, tmp_path, nproc_per_node=2, floor_s=120.0)
    assert dog.limit_s(read_progress(tmp_path)) == pytest.approx(STALL_MULTIPLE * 118.0)
    # once steady steps are measured they decide, as before
    for rank in (0, 1):
        beat = ProgressFile(rank)
        beat.update(1, step_s=118.0)
        beat.update(2, step_s=20.0)
    assert dog.limit_s(read_progress(tmp_path)) == pytest.approx(STALL_MULTIPLE * 20.0)


def test_a_pipeline_step_reads_the_loss_paddle_hands_every_stage():
    """tp 2 x pp 2 on the rehearsal device: PipelineParallel.train_batch gave a stage a loss of
    shape [1] and `float(loss)` raised 'only 0-dimensional arrays can be converted'."""
    import numpy as np
    import paddle

    from runner.train import RankInfo, Trainer

    class Batch:
        input_ids = np.zeros((1, 4), dtype="int64")
        labels = np.zeros((1, 4), dtype="int64")

    class Batches:
        def micro_batch(self, step, micro):
            return Batch()

    class Pipe:
        def train_batch(self, data, optimizer=None, scaler=None):
            assert list(data[0].shape) == [2, 4]  # the step's micro-batches, concatenated
            return paddle.to_tensor([2.5], dtype="float32")

    plan, _ = localize(PLANS["tp4xpp2"](), DEVICE)
    plan = dataclasses.replace(
        plan, training=dataclasses.replace(plan.training, gradient_accumulation_steps=2)
    )

    class Optimizer:
        def set_lr(self, lr):
            pass

    trainer = Trainer(plan, RankInfo(), Pipe(), Optimizer(), None, Batches())  # type: ignore[arg-type]
    assert trainer.train_step(0) == 2.5


AMP_DEVICE = dataclasses.replace(
    DEVICE,
    precisions=("fp32", "bf16", "fp16"),
    amp_without={rd.TENSOR: "no bf16 c_identity"},
)


@pytest.mark.parametrize(
    ("name", "precision", "why"),
    [
        ("stage3x8", "fp16", None),  # kept as planned
        ("pp4 vpp3", "fp16", None),
        ("tp4xpp2", "fp32", "AMP does not run with tensor parallel on the rehearsal device"),
    ],
)
def test_amp_is_rehearsed_as_planned_where_the_device_runs_it(name, precision, why):
    local, changes = localize(PLANS[name](), AMP_DEVICE)
    assert local.training.precision == precision
    lines = [c for c in changes if c.startswith("training.precision: ")]
    if why is None:
        assert lines == []
        assert local.training.fp16_opt_level == PLANS[name]().training.fp16_opt_level
    else:
        assert lines == [f"training.precision: 'fp16' -> 'fp32' ({why}: no bf16 c_identity)"]


def test_an_amp_rehearsal_on_the_device_is_fitted_to_time_as_fp32():
    """The local profile has no fp16/bf16 peak; the device's AMP kernels compute in fp32, so the
    step is fitted to this machine's time as fp32 would be (unfitted, llama_zh kept 64
    micro-batches of 2 x 1024 a step), and the plan keeps its precision."""
    import math

    from runner.rehearsal import rehearse

    local, _ = localize(PLANS["llama_zh"](), AMP_DEVICE)
    assert local.training.precision == "fp16"  # the plan's own
    amp = rehearse(local, max_steps_given=True, limit_gb=16.0)
    fp32_plan = dataclasses.replace(
        local, training=dataclasses.replace(local.training, precision="fp32", fp16_opt_level="O1")
    )
    fp32 = rehearse(fp32_plan, max_steps_given=True, limit_gb=16.0)
    assert amp.plan.training.precision == "fp16"
    assert math.isfinite(amp.step_time_s)
    for key in ("gradient_accumulation_steps", "per_device_train_batch_size", "seq_len"):
        assert getattr(amp.plan.training, key) == getattr(fp32.plan.training, key)
    assert amp.plan.training.gradient_accumulation_steps < 64
