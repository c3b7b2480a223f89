"""Real rehearsals on the rehearsal device (issue 34): a tensor-parallel plan rehearsed with
--local runs in its own layout (tp 2, 2 processes), its losses equal a 1-process reference
(fp32), a rank SIGKILLed mid-run and the rerun give the uninterrupted run's losses, and every
rank records its allocator peaks. Skipped where the device is not built (runner.device.support
says why)."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import tomli_w
from conftest import BASE_PLAN, LLAMA, QWEN, REPO, merge, run_cli, small_model_pins
from safetensors import safe_open
from test_train_e2e import metrics, start_background, wait_for_step

from gptplan.plan import REHEARSAL_PROFILE, load_plan
from runner.device import support as rehearsal_device

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not rehearsal_device.support().on_device,
        reason=f"the rehearsal device is unavailable: {rehearsal_device.support().why_not}",
    ),
]

# A GPU plan (4 A100s, tensor parallel 4 with sequence parallel), no dropout so that the layouts
# compute the same arithmetic; 6 steps, a checkpoint every 2.
TP4_GPU = {
    "model": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    # 4 micro-steps a step: the steps after the kill at step 2 must outlast the kill (at 1
    # micro-step the run could finish before a rank was killed)
    "training": {"max_steps": 6, "gradient_accumulation_steps": 4},
    "parallel": {
        "nproc_per_node": 4,
        "tensor_parallel_degree": 4,
        "data_parallel_degree": 1,
        # tp + sp: the sequence-parallel parameters' gradient hooks must run (runner.train)
        "sequence_parallel": True,
    },
    "hardware": {
        "profile": "a100-80gb",
        "device": "gpu",
        "precisions": ["fp32", "bf16"],
        "peak_tflops": 312.0,
    },
    "checkpoint": {"interval_steps": 2, "keep_last": 3},
}


def plan_file(tmp_path: Path, shared_cache: Path, overrides: dict, name: str) -> Path:
    data = merge(BASE_PLAN, {"job": {"cache_dir": str(shared_cache)}})
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(merge(data, overrides)))
    return path


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for _, r in sorted(metrics(run_dir).items())]


def reference_run(work: Path, rehearsal: Path, name: str, overrides: dict):
    """The 1-process plain-CPU reference of the rehearsal in `rehearsal` (its local plan.toml
    with `overrides`), trained into work/name; returns the rehearsal's local plan."""
    local = load_plan(rehearsal / "plan.toml")
    data = merge(
        json.loads(json.dumps(local.to_dict())),
        merge(
            {
                "parallel": {"nproc_per_node": 1},
                "hardware": {"profile": "cpu"},
                "job": {"output_dir": str(work / name)},
            },
            overrides,
        ),
    )
    plan = work / f"{name}.toml"
    plan.write_text(tomli_w.dumps(data))
    ref = run_cli("runner", "execute", str(plan), cwd=work, timeout=900)
    assert ref.returncode == 0, name + ref.stdout[-3000:] + ref.stderr[-3000:]
    return local


def rehearse(plan: Path, out: str, *extra: str):
    return run_cli(
        "runner",
        "execute",
        str(plan),
        "--local",
        "--max-steps",
        "6",
        "--output-dir",
        out,
        *extra,
        cwd=plan.parent,
        timeout=900,
    )


def kill_last_rank(run: Path, proc, wait) -> None:
    """Once `wait(run, proc)` returns, SIGKILL the run's last rank and reap its launcher
    (`proc`, from start_background; its process group is killed if it is still alive)."""
    try:
        wait(run, proc)
        records = sorted((run / "logs" / "attempt_001" / "ranks").glob("rank_*.json"))
        os.kill(json.loads(records[-1].read_text())["pid"], signal.SIGKILL)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, shared_cache):
    work = tmp_path_factory.mktemp("tp")
    plan = plan_file(work, shared_cache, TP4_GPU, "tp4")
    done = rehearse(plan, "tp")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reference_run(
        work,
        work / "tp",
        "ref",
        {"parallel": {"tensor_parallel_degree": 1, "sequence_parallel": False}},
    )
    return work, plan, done


def test_tp_plan_rehearses_as_tp2_on_the_device_with_the_reference_losses(tp_runs):
    work, _, done = tp_runs
    assert "parallel.tensor_parallel_degree: 4 -> 2" in done.stdout
    assert "runs on: the rehearsal device" in done.stdout
    local = load_plan(work / "tp" / "plan.toml")
    assert local.hardware.profile == REHEARSAL_PROFILE
    assert (local.parallel.tensor_parallel_degree, local.parallel.nproc_per_node) == (2, 2)
    a, b = losses(work / "tp"), losses(work / "ref")
    assert len(a) == len(b) == 6
    assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    report = json.loads((work / "tp" / "report.json").read_text())
    mem = report["memory_per_rank"]
    assert [r["rank"] for r in mem["ranks"]] == [0, 1]
    for row in mem["ranks"]:
        assert row["after_model_build_allocated_gb"] > 0
        assert row["after_first_step_allocated_gb"] > row["after_model_build_allocated_gb"]
        assert row["step_peak_allocated_gb"] >= row["after_first_step_allocated_gb"]
    assert set(mem["measured_over_modelled"]) == {
        "after_model_build",
        "after_first_step",
        "step_peak",
    }


def test_sigkill_of_a_rank_and_the_rerun_give_the_uninterrupted_losses(tp_runs):
    work, plan, _ = tp_runs
    run = work / "killed"
    args = ["--local", "--max-steps", "6", "--output-dir", "killed"]
    proc = start_background(plan, *args)
    # step 2 checkpointed, step 3 under way
    kill_last_rank(run, proc, lambda r, p: wait_for_step(r, 2, p, timeout=600))
    assert proc.returncode != 0
    again = rehearse(plan, "killed")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from step_" in again.stdout
    assert losses(run) == pytest.approx(losses(work / "tp"), rel=1e-6, abs=1e-6)


STAGE3_GPU = merge(
    TP4_GPU,
    {
        "parallel": {
            "nproc_per_node": 8,
            "tensor_parallel_degree": 1,
            "sequence_parallel": False,
            "sharding": "stage3",
            "sharding_parallel_degree": 8,
        },
        # micro 2 x 2 shards: the tp rehearsal's global batch (micro 4), so its 1-process
        # reference is this one's too
        "training": {"per_device_train_batch_size": 2},
    },
)


@pytest.fixture(scope="module")
def stage3_runs(tmp_path_factory, shared_cache, tp_runs):
    """The stage 3 rehearsal and its 1-process reference: tp_runs' (checked to be the same
    training: model, data, schedule and global batch)."""
    work = tmp_path_factory.mktemp("stage3")
    plan = plan_file(work, shared_cache, STAGE3_GPU, "s3")
    done = rehearse(plan, "s3")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    local = load_plan(work / "s3" / "plan.toml")
    own = merge(json.loads(json.dumps(local.to_dict())), unsharded(local))
    shared = load_plan(tp_runs[0] / "ref.toml").to_dict()
    for section in ("model", "training"):
        assert own[section] == json.loads(json.dumps(shared[section])), section
    assert (own["job"]["seed"], own["job"]["corpus"]) == (
        shared["job"]["seed"],
        shared["job"]["corpus"],
    )
    return work, plan, done, tp_runs[0] / "ref"


def unsharded(local) -> dict:
    """Overrides that make a sharded local plan's 1-process reference: the same global batch."""
    micro = local.training.per_device_train_batch_size * local.parallel.sharding_parallel_degree
    return {
        "parallel": {"sharding": "", "sharding_parallel_degree": 1},
        "training": {"per_device_train_batch_size": micro},
    }


def test_stage3_rehearses_as_stage3_x2_with_the_reference_losses(stage3_runs):
    work, _, done, ref = stage3_runs
    assert "parallel.sharding_parallel_degree: 8 -> 2" in done.stdout
    local = load_plan(work / "s3" / "plan.toml")
    assert (local.parallel.sharding, local.parallel.nproc_per_node) == ("stage3", 2)
    a, b = losses(work / "s3"), losses(ref)
    assert len(a) == len(b) == 6
    assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    # stage 3 really sliced the rehearsal's small weights (runner.train.stage3_segment_size):
    # each rank's optimizer file holds the moments of its half of the word embedding; the
    # model file is written once, whole (gathered), by sharding rank 0
    last = sorted((work / "s3" / "checkpoints").glob("step_*"))[-1]
    assert json.loads((last / "state.json").read_text())["model_files"] == [
        "model.tp00_pp00.safetensors"
    ]
    vocab, hidden = local.model.vocab_size, local.model.hidden_size
    for rank in (0, 1):
        with safe_open(str(last / f"optimizer.tp00_pp00_sd{rank:02d}.safetensors"), "np") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys() if "moment1" in k}
        assert shapes["slice@embedding_0.w_0_moment1_0"] == [vocab * hidden // 2]
    with safe_open(str(last / "model.tp00_pp00.safetensors"), "np") as f:
        assert f.get_slice("gpt.embeddings.word_embeddings.weight").get_shape() == [vocab, hidden]


def test_stage3_sigkill_and_rerun_give_the_uninterrupted_losses(stage3_runs):
    work, plan, _, _ = stage3_runs
    run = work / "killed"
    proc = start_background(plan, "--local", "--max-steps", "6", "--output-dir", "killed")
    # step 2 done: its checkpoint is being written
    kill_last_rank(run, proc, lambda r, p: wait_for_step(r, 1, p, timeout=600))
    again = rehearse(plan, "killed")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert losses(run) == pytest.approx(losses(work / "s3"), rel=1e-6, abs=1e-6)


# ---- pipelines: every layout starts from the 1-process weights (runner.train.start_weights) ----
# One tiny GPT of 8 layers (pp 4 x 2 virtual stages need whole layers), micro-batch 1 x 8
# micro-batches (the interleaved schedule needs at least 2 x pp): the three pipeline layouts and
# the 1-process reference train the same global batch, so one reference serves them all.
PIPE_MODEL = {
    "model": {"num_hidden_layers": 8},
    "training": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 8},
    "checkpoint": {"interval_steps": 1, "keep_last": 3},
}


def wait_for_checkpoint(run_dir: Path, proc, timeout: float) -> None:
    """Until the run's first whole checkpoint is in place (renamed from step_*.tmp)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(p.suffix != ".tmp" for p in (run_dir / "checkpoints").glob("step_*")):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint in {timeout}s")


PIPE_STEPS = "3"
PIPE_PLANS = {
    # pipeline 4 on 4 GPUs -> pp 2 (1F1B), 2 processes
    "pp2": {"parallel": {"nproc_per_node": 4, "pipeline_parallel_degree": 4}},
    # pipeline 4 x 2 virtual stages -> pp 4 x 2 virtual stages (interleaved), 4 processes
    "vpp": {
        "parallel": {"nproc_per_node": 4, "pipeline_parallel_degree": 4, "virtual_pp_degree": 2}
    },
    # tensor 4 x pipeline 2 on 8 GPUs -> tp 2 x pp 2, 4 processes
    "tp2pp2": {
        "parallel": {
            "nproc_per_node": 8,
            "tensor_parallel_degree": 4,
            "pipeline_parallel_degree": 2,
        }
    },
}
PIPE_LOCAL = {"pp2": (1, 2, 1, 2), "vpp": (1, 4, 2, 4), "tp2pp2": (2, 2, 1, 4)}  # tp pp vpp n


def _gpu_plan(overrides: dict) -> dict:
    base = merge(TP4_GPU, PIPE_MODEL)
    base["parallel"] = {"data_parallel_degree": 1}
    return merge(base, overrides)


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory, shared_cache):
    """The three pipeline rehearsals and their one 1-process reference (3 steps each). The pp 2
    one is SIGKILLed (its last-stage rank) after step 1's checkpoint and rerun: its losses are
    then compared with the reference like the others' (kill-and-resume in a pipeline layout:
    each stage's own shard and optimizer state)."""
    work = tmp_path_factory.mktemp("pipe")
    done = {}
    for name, overrides in PIPE_PLANS.items():
        plan = plan_file(work, shared_cache, _gpu_plan(overrides), name)
        args = ["--local", "--max-steps", PIPE_STEPS, "--output-dir", name]
        if name == "pp2":
            proc = start_background(plan, *args)
            kill_last_rank(work / name, proc, lambda r, p: wait_for_checkpoint(r, p, 600))
            assert proc.returncode != 0
        proc = run_cli("runner", "execute", str(plan), *args, cwd=work, timeout=900)
        assert proc.returncode == 0, name + proc.stdout[-3000:] + proc.stderr[-3000:]
        done[name] = proc
    reference_run(work, work / "pp2", "ref", {"parallel": {"pipeline_parallel_degree": 1}})
    return work, done


@pytest.mark.parametrize("name", list(PIPE_PLANS))
def test_pipeline_rehearsals_have_the_reference_losses(pipeline_runs, name):
    work, done = pipeline_runs
    local = load_plan(work / name / "plan.toml")
    p = local.parallel
    assert (
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.virtual_pp_degree,
        p.nproc_per_node,
    ) == PIPE_LOCAL[name]
    assert local.model.num_hidden_layers == 8
    assert local.training.gradient_accumulation_steps == 8
    assert "runs on: the rehearsal device" in done[name].stdout
    assert (work / name / "start_weights.safetensors").is_file()  # written once, by rank 0
    assert "export done, verified" in done[name].stdout  # the stages merged, logits compared
    if name == "pp2":  # the rerun after a rank's SIGKILL
        assert "resumed from step_" in done[name].stdout
    a, b = losses(work / name), losses(work / "ref")
    assert len(a) == len(b) == int(PIPE_STEPS)
    assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


# ---- AMP on the device: the device's upcasting kernels (runner/device/src/kernels.cc) ----------
# Data parallel 4 -> 2 processes, micro-batch 2: the tp fixture's 1-process fp32 reference trains
# the same global batch (micro 4 x 1). bf16/fp16 round every matmul's operands and results, so
# the losses are close to the fp32 ones, not equal (nor equal to a GPU's, bit for bit).
AMP_TOLERANCE = (
    1e-3  # relative, per step, vs the fp32 reference (measured: bf16 O2 4.2e-5, fp16 O1 2.3e-6)
)
AMP_PLANS = {
    "bf16_o2": {"training": {"precision": "bf16", "fp16_opt_level": "O2"}},
    "fp16_o1": {"training": {"precision": "fp16", "fp16_opt_level": "O1", "scale_loss": 1024.0}},
}


@pytest.mark.parametrize("name", list(AMP_PLANS))
def test_amp_rehearsal_trains_on_the_device_close_to_fp32(tp_runs, shared_cache, name):
    work, _, _ = tp_runs
    gpu = merge(
        TP4_GPU,
        {
            "parallel": {
                "nproc_per_node": 4,
                "tensor_parallel_degree": 1,
                "sequence_parallel": False,
                "data_parallel_degree": 4,
            },
            "training": {"per_device_train_batch_size": 2},
            "hardware": {"precisions": ["fp32", "bf16", "fp16"]},
        },
    )
    plan = plan_file(work, shared_cache, merge(gpu, AMP_PLANS[name]), name)
    done = rehearse(plan, name)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "training.precision" not in done.stdout  # rehearsed in the plan's precision
    local = load_plan(work / name / "plan.toml")
    want = AMP_PLANS[name]["training"]
    assert (local.training.precision, local.training.fp16_opt_level) == (
        want["precision"],
        want["fp16_opt_level"],
    )
    assert (local.parallel.data_parallel_degree, local.parallel.nproc_per_node) == (2, 2)
    amp, fp32 = losses(work / name), losses(work / "ref")
    assert len(amp) == len(fp32) == 6
    assert all(math.isfinite(x) for x in amp)
    assert amp[-1] < amp[0]
    assert amp == pytest.approx(fp32, rel=AMP_TOLERANCE)
    assert amp != pytest.approx(fp32, rel=1e-7, abs=0)  # it did not train in fp32


# ---- the other families, and per-layer recompute (the CI matrix) ------------------------------
# tp on GPUs -> tp 2 on the device, 3 steps, each against its own 1-process reference:
# QWen (whole-layer recompute) and Llama with per-layer recompute (1 of its 2 layers).
FAMILY_PLANS = {
    "qwen_tp2": merge(
        QWEN,
        {"parallel": {"recompute": "full"}, "training": {"gradient_accumulation_steps": 2}},
    ),
    "llama_tp2_per_layer": merge(
        LLAMA,
        {
            # tp 2 on 2 GPUs: 2 key/value heads allow no wider tensor split
            "parallel": {
                "nproc_per_node": 2,
                "tensor_parallel_degree": 2,
                "recompute": "full",
                "recompute_layers": 1,
            },
            "training": {"gradient_accumulation_steps": 2},
        },
    ),
}


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory, shared_cache):
    work = tmp_path_factory.mktemp("families")
    for name, overrides in FAMILY_PLANS.items():
        gpu = merge(TP4_GPU, {"parallel": {"sequence_parallel": False}})
        plan = plan_file(work, shared_cache, merge(gpu, overrides), name)
        done = run_cli(
            "runner",
            "execute",
            str(plan),
            "--local",
            "--max-steps",
            "3",
            "--output-dir",
            name,
            cwd=work,
            timeout=900,
        )
        assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-3000:]
        reference_run(work, work / name, f"{name}.ref", {"parallel": {"tensor_parallel_degree": 1}})
    return work


@pytest.mark.parametrize("name", list(FAMILY_PLANS))
def test_families_and_per_layer_recompute_rehearse_with_the_reference_losses(family_runs, name):
    local = load_plan(family_runs / name / "plan.toml")
    assert (local.parallel.tensor_parallel_degree, local.parallel.nproc_per_node) == (2, 2)
    want = FAMILY_PLANS[name]
    assert local.model.family == want["model"]["family"]
    assert local.parallel.recompute == "full"
    assert local.parallel.recompute_layers == want["parallel"].get("recompute_layers", 0)
    a, b = losses(family_runs / name), losses(family_runs / f"{name}.ref")
    assert len(a) == len(b) == 3
    assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


# ---- the shipped llama_zh plan in its own layout ------------------------------------------------
# plans/llama_zh.toml as written (ZeRO-1 x 8 on A100s, fp16 O2, its schedule and optimizer), with
# only the model and data pinned small by --set (the layout does not depend on its size; the
# full model takes about 2 min a step here, docs/rehearsal.md): localize maps it to sharding
# stage 1 x 2 on the device in the precision the device allows with stage 1. It trains 2 steps
# with the losses of its 1-process fp32 reference, and its export is verified.
LLAMA_ZH = REPO / "plans" / "llama_zh.toml"
LLAMA_ZH_PINS = [
    "job.target_tokens=0",  # the plan's 50B tokens need its batch; the micro-batch is pinned
    *small_model_pins(merge(BASE_PLAN, LLAMA)["model"]),
    "training.seq_len=32",
    "training.per_device_train_batch_size=4",
    "training.logging_steps=1",  # every step's loss (the plan logs every 100th)
]


def test_llama_zh_rehearses_as_stage1_x2_on_the_device_with_its_reference(tmp_path, shared_cache):
    from runner import rehearsal
    from runner.overrides import load_plan_with

    sets = [f"job.cache_dir={json.dumps(str(shared_cache))}"]
    sets += LLAMA_ZH_PINS
    done = run_cli(
        "runner",
        "execute",
        str(LLAMA_ZH),
        "--local",
        "--max-steps",
        "2",
        *(a for s in sets for a in ("--set", s)),
        "--output-dir",
        "zh",
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parallel.sharding_parallel_degree: 8 -> 2" in done.stdout
    assert "runs on: the rehearsal device" in done.stdout
    assert "export done, verified" in done.stdout
    assert "Skip loading" not in done.stdout + done.stderr
    local = load_plan(tmp_path / "zh" / "plan.toml")
    assert local.hardware.profile == REHEARSAL_PROFILE
    p = local.parallel
    assert (p.sharding, p.sharding_parallel_degree, p.nproc_per_node, p.world_size) == (
        "stage1",
        2,
        2,
        2,
    )
    # the layout and precision localize gives the plan (what the device allows), nothing more
    asked = load_plan_with(LLAMA_ZH, sets)[0]
    want, _ = rehearsal.localize(asked, rehearsal_device.support())
    assert local.parallel == want.parallel
    t = local.training
    # the device runs AMP with sharding stage 1: the plan's own precision is rehearsed
    assert (t.precision, t.fp16_opt_level) == (
        asked.training.precision,
        asked.training.fp16_opt_level,
    )
    assert (t.precision, t.fp16_opt_level) == (
        want.training.precision,
        want.training.fp16_opt_level,
    )
    assert local.model.family == "llama" and t.max_steps == 2
    fp32 = {"training": {"precision": "fp32", "fp16_opt_level": "O1"}}
    reference_run(tmp_path, tmp_path / "zh", "ref", merge(unsharded(local), fp32))
    a, b = losses(tmp_path / "zh"), losses(tmp_path / "ref")
    assert len(a) == len(b) == 2 and all(math.isfinite(x) for x in a)
    if t.precision == "fp32":
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    else:  # AMP on the device: close to fp32, not equal (as the AMP tests above)
        assert a == pytest.approx(b, rel=AMP_TOLERANCE)
