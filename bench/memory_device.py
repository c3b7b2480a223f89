"""The memory model's terms against Paddle's own allocator, on the rehearsal device (issue 35).

`python bench/memory_device.py` launches short trainings of tiny PaddleNLP GPT, Llama and QWen
models on the rehearsal device (runner/device, docs/device.md: Paddle's allocator over host
memory, real collectives between the processes), 2-8 processes, two optimizer steps per
layout, in fp32 and in AMP (bf16 / fp16, O1 / O2, built as runner/train.py builds them; a case
of a layout kind the device runs only in fp32, runner.device.AMP_WITHOUT, is skipped with that
reason and reported). Every rank records Paddle's allocator statistics
(`runner.metrics.AllocatorProbe`: allocated and reserved, current and peak):

- after the model build and its wrapping (`weights`),
- after the first optimizer step (+ gradients and optimizer states: `states`),
- the peak within the second step above what stays after the first (`dynamic`: activations,
  loss path, transient gradient buffers).

Each is compared with gptplan.memory's terms for the same layout (memory_terms, the case's
precision and AMP level, the families' unfused kernels, no runtime, communicator or
fragmentation term: the device has no CUDA context, no NCCL and a host allocator without
fragmentation, so only the device-independent terms are compared). Writes
bench/results/memory_device_<date>.csv (one row per case, rank and phase; a skipped case one
row with its reason) and .json (the raw figures), and prints the per-term table of
bench/README.md section 8. About 8 minutes on 2 shared cores. Exit status 1 when a launch or a
case failed (a skipped case is no failure).

`--cases NAME,...` runs only those cases; `--launch NAME` only one launch's cases;
`--from-json FILE` re-compares a stored run with today's model (no device); `--reuse-json FILE`
takes the launches a stored run holds and runs only the others.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STEPS = 2
VOCAB = 2048
HIDDEN = 128
HEADS = 4
LAYERS = 8  # pp 4 x 2 virtual stages
FFN = 512
SEED = 2024


@dataclass(frozen=True)
class Case:
    """One layout trained for STEPS optimizer steps on every rank of its launch."""

    name: str
    launch: str  # which process group setup (LAUNCHES)
    family: str = "gpt"
    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    sharding: str = ""  # '', stage1, stage2, stage3
    shard: int = 1
    dp: int = 1
    recompute: str = "none"
    rc_layers: int = 0  # recomputed layers of the model (0 = all)
    micro: int = 2
    acc: int = 1
    seq: int = 128
    wrap: str = "none"  # none (one model per rank), fleet, group_sharded, dp
    reference: str = ""  # stage 2: the unsharded case whose in-step growth it is compared with
    precision: str = "fp32"  # fp32, bf16, fp16 (gptplan.precision rows)
    level: str = ""  # AMP level of a 16-bit precision: O1 or O2

    @property
    def amp(self) -> bool:
        return self.precision != "fp32"

    def kinds(self) -> list[str]:
        """The device's layout kinds (runner.device.LAYOUT_KINDS) this case uses."""
        kinds = [k for k, on in (("dp", self.dp > 1), ("tp", self.tp > 1), ("sp", self.sp)) if on]
        kinds += ["pp"] if self.pp > 1 else []
        kinds += ["vpp"] if self.vpp > 1 else []
        kinds += [f"sharding_{self.sharding}"] if self.sharding else []
        return kinds

    def skip_reason(self) -> str:
        """Why the device cannot run this case ('' when it can): an AMP case of a layout kind
        the device runs only in fp32 (runner.device.AMP_WITHOUT; empty since 2026-12-06)."""
        from runner.device import AMP_WITHOUT

        if not self.amp:
            return ""
        for kind in self.kinds():
            if kind in AMP_WITHOUT:
                return f"AMP does not run with {kind} on the rehearsal device: {AMP_WITHOUT[kind]}"
        return ""


# launch name -> (fleet hybrid degrees, processes)
LAUNCHES: dict[str, tuple[dict[str, int], int]] = {
    "shard2": ({"sharding_degree": 2}, 2),
    "mp2": ({"mp_degree": 2}, 2),
    "pp2": ({"pp_degree": 2}, 2),
    "pp4": ({"pp_degree": 4}, 4),
    "shard2mp2": ({"sharding_degree": 2, "mp_degree": 2}, 4),
    "shard8": ({"sharding_degree": 8}, 8),
    # AMP cases in launches of their own: a case that fails on one rank cannot stop the others
    "shard2_amp": ({"sharding_degree": 2}, 2),
    "stage1_amp": ({"sharding_degree": 2}, 2),
    "pp2_amp": ({"pp_degree": 2}, 2),
    "pp4_amp": ({"pp_degree": 4}, 4),
    "mp2_amp": ({"mp_degree": 2}, 2),
}

CASES: tuple[Case, ...] = (
    # one model per rank (no communication): activations per recompute choice, the loss path
    Case("plain_gpt", "shard2"),
    Case("plain_llama", "shard2", family="llama"),
    Case("plain_qwen", "shard2", family="qwen"),
    Case("plain_gpt_m4", "shard2", micro=4),
    Case("plain_gpt_s256", "shard2", seq=256, micro=1),
    Case("rc_full_gpt", "shard2", recompute="full"),
    Case("rc_full_attn_gpt", "shard2", recompute="full_attn"),
    Case("rc_core_attn_gpt", "shard2", recompute="core_attn"),
    Case("rc_full_llama", "shard2", family="llama", recompute="full"),
    Case("rc_full_4of8_llama", "shard2", family="llama", recompute="full", rc_layers=4),
    Case("rc_core_attn_llama", "shard2", family="llama", recompute="core_attn"),
    # data parallel and sharding over 2 ranks
    Case("dp2_gpt", "shard2", dp=2, wrap="dp"),
    Case("stage1x2_gpt", "shard2", sharding="stage1", shard=2, wrap="fleet"),
    Case(
        "stage2x2_gpt",
        "shard2",
        sharding="stage2",
        shard=2,
        wrap="group_sharded",
        reference="plain_gpt",
    ),
    Case(
        "stage2x2_llama",
        "shard2",
        family="llama",
        sharding="stage2",
        shard=2,
        wrap="group_sharded",
        reference="plain_llama",
    ),
    Case("stage3x2_gpt", "shard2", sharding="stage3", shard=2, wrap="group_sharded"),
    # tensor parallel (+ sequence parallel)
    Case("tp2_gpt", "mp2", tp=2, wrap="fleet"),
    Case("tp2_llama", "mp2", family="llama", tp=2, wrap="fleet"),
    Case("tp2_sp_gpt", "mp2", tp=2, sp=True, wrap="fleet"),
    Case("tp2_rc_full_gpt", "mp2", tp=2, recompute="full", wrap="fleet"),
    # pipelines: 1F1B with 2 and 4 micro-batches, interleaved
    Case("pp2_m2_gpt", "pp2", pp=2, acc=2, micro=1, wrap="fleet"),
    Case("pp2_m4_gpt", "pp2", pp=2, acc=4, micro=1, wrap="fleet"),
    Case("pp2_m4_llama", "pp2", family="llama", pp=2, acc=4, micro=1, wrap="fleet"),
    Case("pp2_m4_rc_full_gpt", "pp2", pp=2, acc=4, micro=1, recompute="full", wrap="fleet"),
    Case("pp4_m8_gpt", "pp4", pp=4, acc=8, micro=1, wrap="fleet"),
    Case("vpp4x2_m8_gpt", "pp4", pp=4, vpp=2, acc=8, micro=1, wrap="fleet"),
    # sharding with tensor parallel
    Case("stage1x2_tp2_gpt", "shard2mp2", tp=2, sharding="stage1", shard=2, wrap="fleet"),
    Case(
        "stage1x2_tp2_sp_gpt", "shard2mp2", tp=2, sp=True, sharding="stage1", shard=2, wrap="fleet"
    ),
    Case(
        "stage2x2_tp2_gpt",
        "shard2mp2",
        tp=2,
        sharding="stage2",
        shard=2,
        wrap="group_sharded",
        reference="tp2_gpt",
    ),
    # stage 2 over 8 ranks (the layout), with its unsharded reference in the same launch
    Case("plain8_gpt", "shard8"),
    Case(
        "stage2x8_gpt",
        "shard8",
        sharding="stage2",
        shard=8,
        wrap="group_sharded",
        reference="plain8_gpt",
    ),
    Case("stage1x8_gpt", "shard8", sharding="stage1", shard=8, wrap="fleet"),
    Case("stage3x8_gpt", "shard8", sharding="stage3", shard=8, wrap="group_sharded"),
) + tuple(
    # AMP (bf16 / fp16, O1 / O2) through the device's upcasting kernels (docs/device.md)
    Case(name, launch, **kw)
    for name, launch, kw in (
        ("plain_gpt_bf16o2", "shard2_amp", dict(precision="bf16", level="O2")),
        ("plain_gpt_fp16o2", "shard2_amp", dict(precision="fp16", level="O2")),
        ("plain_gpt_bf16o1", "shard2_amp", dict(precision="bf16", level="O1")),
        ("plain_gpt_fp16o1", "shard2_amp", dict(precision="fp16", level="O1")),
        ("plain_llama_bf16o2", "shard2_amp", dict(family="llama", precision="bf16", level="O2")),
        ("plain_llama_fp16o1", "shard2_amp", dict(family="llama", precision="fp16", level="O1")),
        ("rc_full_gpt_bf16o2", "shard2_amp", dict(recompute="full", precision="bf16", level="O2")),
        ("rc_full_gpt_fp16o1", "shard2_amp", dict(recompute="full", precision="fp16", level="O1")),
        ("rc_full_gpt_bf16o1", "shard2_amp", dict(recompute="full", precision="bf16", level="O1")),
        (
            "rc_full_llama_bf16o2",
            "shard2_amp",
            dict(family="llama", recompute="full", precision="bf16", level="O2"),
        ),
        (
            "rc_core_attn_llama_bf16o2",
            "shard2_amp",
            dict(family="llama", recompute="core_attn", precision="bf16", level="O2"),
        ),
        ("dp2_gpt_bf16o2", "shard2_amp", dict(dp=2, wrap="dp", precision="bf16", level="O2")),
        ("dp2_gpt_fp16o1", "shard2_amp", dict(dp=2, wrap="dp", precision="fp16", level="O1")),
        (
            "stage2x2_gpt_bf16o2",
            "shard2_amp",
            dict(sharding="stage2", shard=2, wrap="group_sharded", reference="plain_gpt_bf16o2")
            | dict(precision="bf16", level="O2"),
        ),
        (
            "stage2x2_gpt_fp16o1",
            "shard2_amp",
            dict(sharding="stage2", shard=2, wrap="group_sharded", reference="plain_gpt_fp16o1")
            | dict(precision="fp16", level="O1"),
        ),
        (
            "stage2x2_llama_bf16o2",
            "shard2_amp",
            dict(sharding="stage2", shard=2, wrap="group_sharded", reference="plain_llama_bf16o2")
            | dict(family="llama", precision="bf16", level="O2"),
        ),
        (
            "stage3x2_gpt_bf16o2",
            "shard2_amp",
            dict(sharding="stage3", shard=2, wrap="group_sharded", precision="bf16", level="O2"),
        ),
        (
            "stage3x2_gpt_fp16o1",
            "shard2_amp",
            dict(sharding="stage3", shard=2, wrap="group_sharded", precision="fp16", level="O1"),
        ),
        (
            "stage1x2_llama_bf16o2",
            "stage1_amp",
            dict(family="llama", sharding="stage1", shard=2, wrap="fleet")
            | dict(precision="bf16", level="O2"),
        ),
        (
            "stage1x2_llama_fp16o2",
            "stage1_amp",
            dict(family="llama", sharding="stage1", shard=2, wrap="fleet")
            | dict(precision="fp16", level="O2"),
        ),
        (
            "stage1x2_gpt_bf16o2",
            "stage1_amp",
            dict(sharding="stage1", shard=2, wrap="fleet", precision="bf16", level="O2"),
        ),
        (
            "pp2_m4_gpt_bf16o2",
            "pp2_amp",
            dict(pp=2, acc=4, micro=1, wrap="fleet", precision="bf16", level="O2"),
        ),
        (
            "pp2_m4_gpt_fp16o1",
            "pp2_amp",
            dict(pp=2, acc=4, micro=1, wrap="fleet", precision="fp16", level="O1"),
        ),
        (
            "pp2_m4_gpt_bf16o1",
            "pp2_amp",
            dict(pp=2, acc=4, micro=1, wrap="fleet", precision="bf16", level="O1"),
        ),
        (
            "pp2_m4_llama_bf16o2",
            "pp2_amp",
            dict(family="llama", pp=2, acc=4, micro=1, wrap="fleet", precision="bf16", level="O2"),
        ),
        (
            "pp2_m4_rc_full_gpt_bf16o2",
            "pp2_amp",
            dict(pp=2, acc=4, micro=1, recompute="full", wrap="fleet")
            | dict(precision="bf16", level="O2"),
        ),
        (
            "pp4_m8_gpt_bf16o2",
            "pp4_amp",
            dict(pp=4, acc=8, micro=1, wrap="fleet", precision="bf16", level="O2"),
        ),
        (
            "vpp4x2_m8_gpt_bf16o2",
            "pp4_amp",
            dict(pp=4, vpp=2, acc=8, micro=1, wrap="fleet", precision="bf16", level="O2"),
        ),
        # tensor parallel in AMP: listed so that they run once the device has the kernels
        ("tp2_gpt_bf16o2", "mp2_amp", dict(tp=2, wrap="fleet", precision="bf16", level="O2")),
        (
            "tp2_sp_gpt_bf16o2",
            "mp2_amp",
            dict(tp=2, sp=True, wrap="fleet", precision="bf16", level="O2"),
        ),
        (
            "tp2_llama_bf16o2",
            "mp2_amp",
            dict(family="llama", tp=2, wrap="fleet", precision="bf16", level="O2"),
        ),
    )
)


def model_section(case: Case) -> Any:
    """The tiny model of `case` (gptplan.plan.ModelSection; QWen's intermediate_size counts
    both SwiGLU branches, gptplan.families)."""
    from gptplan.plan import ModelSection

    ffn = 2 * FFN if case.family == "qwen" else FFN
    return ModelSection(
        family=case.family,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=ffn,
        max_position_embeddings=max(256, case.seq),
    )


def parallel_section(case: Case) -> Any:
    """The plan's [parallel] section of `case` (gptplan.plan.ParallelSection)."""
    from gptplan.plan import ParallelSection

    world = case.tp * case.pp * case.shard * case.dp
    return ParallelSection(
        nproc_per_node=world,
        data_parallel_degree=case.dp,
        tensor_parallel_degree=case.tp,
        pipeline_parallel_degree=case.pp,
        virtual_pp_degree=case.vpp,
        sharding=case.sharding,
        sharding_parallel_degree=case.shard,
        recompute=case.recompute,
        recompute_layers=case.rc_layers,
        sequence_parallel=case.sp,
    )


# ---- the worker: one launch, every rank ---------------------------------------------------------


def _strategy(degrees: dict[str, int]) -> Any:
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    hybrid: Any = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    hybrid.update(degrees)
    strategy.hybrid_configs = hybrid
    if hybrid["pp_degree"] > 1:
        # set per case on the wrapped model (PipelineParallel.accumulate_steps)
        strategy.pipeline_configs = {
            "accumulate_steps": 2 * hybrid["pp_degree"],
            "micro_batch_size": 1,
        }
    return strategy


def _batch(case: Case, step: int, rows: int) -> tuple[Any, Any]:
    import numpy as np
    import paddle

    rng = np.random.default_rng(1000 + step)
    ids = rng.integers(3, VOCAB, size=(rows, case.seq + 1)).astype("int64")
    return paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:])


def run_case(case: Case, hcg: Any, probe: Any) -> dict[str, Any]:
    """Build, wrap and train `case` for STEPS steps; the allocator figures per phase (bytes,
    relative to what this rank held before the build)."""
    import paddle
    from paddle.distributed import fleet

    from runner.model import build_model

    gc.collect()
    base_alloc, base_res = probe.now_bytes()
    probe.reset_peaks()
    paddle.seed(SEED)
    model = build_model(
        model_section(case), parallel_section(case), seq_len=case.seq, precision=case.precision
    )
    # as runner/train.py builds them: master weights at O2 (multi_precision), a loss scaler
    # for fp16, paddle.amp.decorate O2 before the wrappers
    o2 = case.amp and case.level == "O2"
    opt = paddle.optimizer.AdamW(
        learning_rate=1e-4, parameters=model.parameters(), multi_precision=o2
    )
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024.0) if case.precision == "fp16" else None
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(case.precision, "float32")
    if o2:
        model, opt = paddle.amp.decorate(
            models=model, optimizers=opt, level="O2", dtype=dtype, master_weight=True
        )
    if case.wrap == "group_sharded":
        from paddle.distributed.sharding import group_sharded_parallel

        level = "os_g" if case.sharding == "stage2" else "p_g_os"
        model, opt, scaler = group_sharded_parallel(
            model, opt, level, scaler=scaler, group=hcg.get_sharding_parallel_group()
        )
    elif case.wrap == "dp":
        model = paddle.DataParallel(model, group=hcg.get_sharding_parallel_group())
    elif case.wrap == "fleet":
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt)
        if scaler is not None:
            scaler = fleet.distributed_scaler(scaler)
        if case.pp > 1:
            model.accumulate_steps = case.acc
            model.micro_batch_size = case.micro
    values: dict[str, Any] = {}
    values["build_peak"] = probe.peak_bytes()
    values["after_build"] = probe.now_bytes()

    def amp() -> Any:
        # disabled for fp32 (auto_cast looks its op lists up by a 16-bit dtype even then)
        low = dtype if case.amp else "float16"
        return paddle.amp.auto_cast(enable=case.amp, level=case.level or "O1", dtype=low)

    for step in range(STEPS):
        probe.reset_peaks()
        if case.pp > 1:
            x, y = _batch(case, step, case.micro * case.acc)
            with amp():
                model.train_batch([x, y], optimizer=opt, scaler=scaler)
        else:
            for _ in range(case.acc):
                x, y = _batch(case, step, case.micro)
                # as runner/train.py: the logits stay bound through backward
                with amp():
                    loss, _logits = model(x, labels=y)
                values[f"after_fwd{step + 1}"] = probe.now_bytes()
                values[f"fwd{step + 1}_peak"] = probe.peak_bytes()
                (loss if scaler is None else scaler.scale(loss)).backward()
            values[f"before_opt{step + 1}"] = probe.now_bytes()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            values[f"after_opt{step + 1}"] = probe.now_bytes()
            opt.clear_grad()
            del loss, _logits, x, y
        values[f"step{step + 1}_peak"] = probe.peak_bytes()
        values[f"after_step{step + 1}"] = probe.now_bytes()
    del model, opt, scaler
    gc.collect()
    values["after_free"] = probe.now_bytes()
    return {
        k: [v[0] - base_alloc, v[1] - base_res] if k != "after_free" else list(v)
        for k, v in values.items()
    } | {"base": [base_alloc, base_res]}


def worker(launch: str, names: list[str], out: Path) -> None:
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from runner.device import activate_if_on_device
    from runner.metrics import AllocatorProbe

    if not activate_if_on_device():
        raise SystemExit(f"not on the rehearsal device ({paddle.get_device()})")
    fleet.init(is_collective=True, strategy=_strategy(LAUNCHES[launch][0]))
    hcg = fleet.get_hybrid_communicate_group()
    probe = AllocatorProbe("custom", int(paddle.get_device().rpartition(":")[2] or 0))
    mine: dict[str, Any] = {}
    for case in CASES:
        if case.launch != launch or (names and case.name not in names):
            continue
        t0 = time.perf_counter()
        try:
            mine[case.name] = run_case(case, hcg, probe) | {"s": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001 - recorded per case, the others still run
            mine[case.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    everyone: list[Any] = []
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        tmp = out / f".{launch}.json.tmp"
        tmp.write_text(json.dumps(everyone, indent=1), encoding="utf-8")
        os.replace(tmp, out / f"{launch}.json")


# ---- the driver ---------------------------------------------------------------------------------


def launch(name: str, names: list[str], out: Path, timeout_s: float) -> list[Any] | str:
    """Run one launch's cases on the device; each rank's figures, or why not."""
    from runner.device import env

    nprocs = LAUNCHES[name][1]
    e = env(dict(os.environ))
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--devices",
        ",".join(str(i) for i in range(nprocs)),
        "--log_dir",
        str(out / f"log_{name}"),
        str(Path(__file__).resolve()),
        "worker",
        "--launch",
        name,
        "--out",
        str(out),
    ] + (["--cases", ",".join(names)] if names else [])
    try:
        proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:.0f} s"
    path = out / f"{name}.json"
    if proc.returncode != 0 or not path.exists():
        logs = sorted((out / f"log_{name}").glob("workerlog.*"))
        tail = logs[0].read_text(errors="replace")[-800:] if logs else proc.stderr[-800:]
        return f"exit {proc.returncode}: {tail}"
    return json.loads(path.read_text(encoding="utf-8"))


def modelled(case: Case) -> dict[str, float]:
    """gptplan.memory's terms for `case` on the busiest rank (bytes; fp32; no runtime,
    communicator or fragmentation term: not in a host allocator)."""
    from gptplan import precision
    from gptplan.memory import ModelShape, memory_terms
    from gptplan.steptime import RECOMPUTE_CODES

    stage = {"": 0, "stage1": 1, "stage2": 2, "stage3": 3}[case.sharding]
    terms = memory_terms(
        ModelShape.from_section(model_section(case)),
        seq_len=case.seq,
        micro_batch=case.micro,
        accumulation=case.acc,
        tp=case.tp,
        pp=case.pp,
        stage_code=stage,
        shard_degree=case.shard,
        recompute_code=RECOMPUTE_CODES[case.recompute],
        seq_parallel=case.sp,
        precision_code=precision.code(case.precision),
        overhead_gb=0.0,
        fragmentation=1.0,
        virtual_pp=case.vpp,
        recompute_layers=case.rc_layers // case.pp,
        dp=case.dp,
        amp_o1=case.amp and case.level == "O1",
        fused_kernels=False,  # the device runs the families' unfused norm and rotary code
    )
    return {k: float(v) for k, v in terms.items()}


# the comparisons of bench/README.md section 8 (measured from the allocator's figures, bytes)
TERMS_COMPARED = ("weights", "optimizer", "gradients", "dynamic", "states", "peak")
MEASURED_AS = {
    "weights": "allocated after the build and wrapping",
    "optimizer": "allocated after the first optimizer.step() minus before it",
    "gradients": "after step 1 - after build - optimizer; stage 2: + the in-step growth over "
    "the unsharded reference (the other ranks' GradStorage buffers)",
    "dynamic": "step 2's peak - allocated after step 1 (stage 2: - that growth; tp: - the "
    "device's own cross-entropy excess)",
    "states": "allocated after step 1 (weights + gradients + optimizer + kept buffers)",
    "peak": "step 2's peak allocated (tp: - the device's own cross-entropy excess)",
}
MODELLED_AS = {
    "weights": "weights",
    "optimizer": "optimizer",
    "gradients": "gradients (+ comm_buffers where paddle.DataParallel keeps them)",
    "dynamic": "activations + logits (+ the transient comm_buffers)",
    "states": "weights + gradients + optimizer (+ kept comm_buffers)",
    "peak": "the sum of the allocator terms",
}


# The device's own excess, measured in isolation (ParallelCrossEntropy over 2 ranks on the
# device, 1024 x 1024 fp32 local logits: 5 logit-sized tensors at the backward's peak, where
# paddle.nn.CrossEntropyLoss reaches 2): Paddle's custom-device path of
# c_softmax_with_cross_entropy_grad builds 3 more fp32 tensors of the local logits than the
# CUDA kernel (paddle/fluid/operators/collective/c_softmax_with_cross_entropy_op.cu copies
# the softmax into the logit gradient and subtracts the label in place). Not a GPU's memory:
# taken off the measured dynamic and peak of tensor-parallel cases, and shown.
DEVICE_TP_CROSS_ENTROPY_BYTES_PER_LOGIT = 3 * 4.0


def device_only_bytes(case: Case) -> float:
    """What the rehearsal device holds beyond a GPU for `case` (bytes): the tensor-parallel
    cross entropy's extra tensors (DEVICE_TP_CROSS_ENTROPY_BYTES_PER_LOGIT), 0 without tp."""
    if case.tp == 1:
        return 0.0
    return DEVICE_TP_CROSS_ENTROPY_BYTES_PER_LOGIT * case.micro * case.seq * VOCAB / case.tp


def kept_buffers(case: Case) -> bool:
    """Whether the comm_buffers term is paddle.DataParallel's fused buffer, kept between
    steps (gptplan.memory [DPFUSE]), rather than a copy that exists only as backward ends."""
    return case.dp > 1 and not case.sharding and case.tp == 1 and case.pp == 1


def model_parts(case: Case, t: dict[str, float]) -> dict[str, float]:
    """The modelled figure of each compared term from gptplan.memory's terms (bytes)."""
    kept = t["comm_buffers"] if kept_buffers(case) else 0.0
    dynamic = t["activations"] + t["logits"] + t["comm_buffers"] - kept
    # stage 2 at O2 makes the rank's fp32 master weights when it wraps the model
    # (GroupShardedOptimizerStage2._integration_params -> _generate_master_params), not at the
    # first step: the same bytes, allocated in the build phase
    master = t["optimizer"] / 3.0 if case.sharding == "stage2" and case.level == "O2" else 0.0
    out = {
        "weights": t["weights"] + master,
        "optimizer": t["optimizer"] - master,
        "gradients": t["gradients"] + kept,
        "dynamic": dynamic,
        "states": t["weights"] + t["gradients"] + t["optimizer"] + kept,
    }
    out["peak"] = out["states"] + dynamic
    return out


def measured_parts(case: Case, v: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, float]:
    """The measured figure of each compared term (allocated bytes); NaN where the phase
    cannot separate it (pipelines run the whole step in train_batch; stage 3 slices its
    parameters after the build)."""
    nan = float("nan")
    a = {k: float(x[0]) for k, x in v.items() if isinstance(x, list)}
    extra = device_only_bytes(case)
    dynamic = a["step2_peak"] - a["after_step1"] - extra
    out = {k: nan for k in TERMS_COMPARED}
    out["peak"] = a["step2_peak"] - extra
    out["dynamic"] = dynamic
    out["states"] = a["after_step1"]
    if case.sharding != "stage3":
        out["weights"] = a["after_build"]
    if "after_opt1" in a and case.sharding != "stage3":
        out["optimizer"] = a["after_opt1"] - a["before_opt1"]
        out["gradients"] = a["after_step1"] - a["after_build"] - out["optimizer"]
    if case.sharding == "stage2":
        out["states"] = nan  # its storages live partly within the step: see `gradients`
        if ref is None:
            out["gradients"] = out["dynamic"] = nan
        else:
            ref_dynamic = float(ref["step2_peak"][0]) - float(ref["after_step1"][0])
            grown = dynamic - (ref_dynamic - extra)
            out["gradients"] += grown
            out["dynamic"] = dynamic - grown
    return out


def busiest(per_rank: list[dict[str, Any]]) -> int:
    """The rank whose step peak is highest (the busiest device, what the model predicts)."""
    peaks = [r["step2_peak"][0] if "step2_peak" in r else -1.0 for r in per_rank]
    return max(range(len(peaks)), key=lambda i: peaks[i])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/memory_device.py", description=__doc__)
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "worker"])
    parser.add_argument("--launch", default="")
    parser.add_argument("--cases", default="")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="compare the allocator figures of an earlier run (its .json) with today's model",
    )
    parser.add_argument(
        "--reuse-json",
        type=Path,
        default=None,
        help="take the launches an earlier run (its .json) holds from it and run the others; "
        "the .json written holds both",
    )
    args = parser.parse_args(argv)
    names = [x for x in args.cases.split(",") if x]
    if args.mode == "worker":
        worker(args.launch, names, args.out)
        return 0
    # a stage-2 case brings its unsharded reference (its gradients are measured against it)
    names += [c.reference for c in CASES if c.name in names and c.reference]
    wanted = [c for c in CASES if (not names or c.name in names)]
    wanted = [c for c in wanted if not args.launch or c.launch == args.launch]
    # what the device cannot run is not launched; the report says why
    skipped = {c.name: c.skip_reason() for c in wanted if c.skip_reason()}
    results: dict[str, list[Any]] = {}
    problems: dict[str, str] = {}
    if args.reuse_json:  # a launch is reused only when it holds every case wanted of it
        stored = json.loads(args.reuse_json.read_text(encoding="utf-8"))
        results = {
            name: ranks
            for name, ranks in stored.items()
            if all(
                c.name in rank
                for rank in ranks
                for c in wanted
                if c.launch == name and c.name not in skipped
            )
        }
    launches = sorted(
        {c.launch for c in wanted if c.name not in skipped and c.launch not in results},
        key=list(LAUNCHES).index,
    )
    if args.from_json:
        results = json.loads(args.from_json.read_text(encoding="utf-8"))
        launches = []
        wanted = [c for c in wanted if c.launch in results or c.name in skipped]
    with tempfile.TemporaryDirectory(prefix="memory_device_") as tmp:
        for name in launches:
            t0 = time.perf_counter()
            mine = [c.name for c in wanted if c.launch == name and c.name not in skipped]
            got = launch(name, mine, Path(tmp), args.timeout)
            print(f"launch {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            if isinstance(got, str):
                problems[name] = got
            else:
                results[name] = got
    rows, failed = report(wanted, results, problems, skipped)
    date = datetime.date.today().isoformat()
    out = args.out or REPO / "bench" / "results" / f"memory_device_{date}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.from_json:  # the raw allocator figures per launch, rank, case and phase
        out.with_suffix(".json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    with out.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(ROW_FIELDS))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 1 if problems or failed else 0


def report(
    cases: list[Case],
    results: dict[str, list[Any]],
    problems: dict[str, str],
    skipped: dict[str, str] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Print the per-case table (busiest rank; MB = 10^6 bytes; measured by Paddle's
    allocator on the device / modelled, and the error modelled/measured - 1), the cases
    skipped with the reason and the per-term summary; return the CSV rows (every rank, every
    compared term; a skipped case one row with its reason) and the cases that failed."""
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    skipped = skipped or {}
    errors: dict[str, list[float]] = {k: [] for k in TERMS_COMPARED}
    by_name = {c.name: c for c in CASES}
    print(
        f"{'case':<22} {'rank':>4} "
        + " ".join(f"{k + ' meas/model MB':>25}" for k in TERMS_COMPARED)
    )
    blank = dict.fromkeys(ROW_FIELDS, "")
    for case in cases:
        if case.name in skipped:
            print(f"{case.name:<22} skipped: {skipped[case.name]}")
            rows.append(blank | {"case": case.name, "skipped": skipped[case.name]})
            continue
        if case.launch in problems:
            print(f"{case.name:<22} not run: {problems[case.launch][:200]}")
            failures.append(case.name)
            continue
        per_rank = [r.get(case.name, {"error": "missing"}) for r in results[case.launch]]
        failed = [r["error"] for r in per_rank if "error" in r]
        if failed:
            print(f"{case.name:<22} failed: {failed[0][:200]}")
            failures.append(case.name)
            continue
        model = model_parts(case, modelled(case))
        b = busiest(per_rank)
        ref_case = by_name.get(case.reference) if case.reference else None
        refs = results.get(ref_case.launch) if ref_case else None
        cells = []
        for rank, v in enumerate(per_rank):
            ref = refs[rank % len(refs)].get(ref_case.name) if refs and ref_case else None
            meas = measured_parts(case, v, ref)
            for k in TERMS_COMPARED:
                m = meas[k]
                err = model[k] / m - 1.0 if m == m and m > 0 else float("nan")
                rows.append(
                    {
                        "date": datetime.date.today().isoformat(),
                        "case": case.name,
                        "rank": rank,
                        "busiest": int(rank == b),
                        "term": k,
                        "measured_allocated_bytes": "" if m != m else round(m),
                        "modelled_bytes": round(model[k]),
                        "error": "" if err != err else round(err, 4),
                        "step2_peak_reserved_bytes": round(float(v["step2_peak"][1])),
                        "device_only_bytes_taken_off": round(device_only_bytes(case)),
                        "layout": json.dumps(
                            {f: x for f, x in asdict(case).items() if f != "name"}, sort_keys=True
                        ),
                        "skipped": "",
                    }
                )
                if rank == b:
                    if err == err:
                        errors[k].append(err)
                    cells.append(
                        f"{'-':>7}/{model[k] / 1e6:7.2f}{'':>8}"
                        if m != m
                        else f"{m / 1e6:7.2f}/{model[k] / 1e6:7.2f} {err:+6.1%}"
                    )
        print(f"{case.name:<22} {b:>4} " + " ".join(f"{c:>25}" for c in cells))
    print("\nper term, busiest ranks (error = modelled / measured - 1):")
    for k in TERMS_COMPARED:
        e = sorted(errors[k])
        if e:
            mid = e[len(e) // 2]
            worst = max(e, key=abs)
            print(
                f"  {k:<10} {len(e):>3} cases  median {mid:+.1%}  worst {worst:+.1%}   "
                f"measured: {MEASURED_AS[k]}; modelled: {MODELLED_AS[k]}"
            )
    for name, why in problems.items():
        print(f"launch {name} failed: {why[:400]}")
    return rows, failures


# the CSV's columns (report)
ROW_FIELDS = (
    "date",
    "case",
    "rank",
    "busiest",
    "term",
    "measured_allocated_bytes",
    "modelled_bytes",
    "error",
    "step2_peak_reserved_bytes",
    "device_only_bytes_taken_off",
    "layout",
    "skipped",
)


if __name__ == "__main__":
    raise SystemExit(main())
