"""`runner execute PLAN --local`: the plan rehearsed on this machine, made to fit it.

`localize` moves the plan to this machine's devices (one node, data parallel,
a precision the CPU has). This module then

- predicts memory per rank with the planner's own formulas (gptplan.memory, one place) and the
  local profile's overhead (hardware_profiles/<profile>.toml via gptplan.profile); when that
  does not fit the rank's memory with HEADROOM, halves the micro-batch, then seq_len, until it
  does, raising gradient accumulation so each rank still trains the same tokens per step (the
  global batch is kept);
- keeps a rehearsal short: a few steps (DEFAULT_STEPS) unless --max-steps says otherwise, and
  when one step at the kept global batch would take longer than STEP_TARGET_S here (modelled),
  lowers accumulation, then micro-batch, saying so (a setting the user pinned with --set is
  left alone);
- fills the rehearsal's [estimate] with the local model's numbers, so the end-of-run report is
  planned (modelled here) vs actual (measured here).

`rank_memory_limit_bytes` is the per-rank memory limit every run and probe gets (enforced by
runner.supervise).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptplan import families, precision
from gptplan.errors import HardwareError
from gptplan.memory import GB, ModelShape, memory_per_device_bytes, memory_terms
from gptplan.modelfacts import training_flops_per_token
from gptplan.plan import (
    REHEARSAL_PROFILE,
    SHARDING_STAGES,
    Device,
    EstimateSection,
    ModelSection,
    ParallelSection,
    Plan,
    Precision,
    validate,
)
from gptplan.profile import DeviceProfile, ProfileError, read_performance
from gptplan.steptime import RECOMPUTE_CODES, data_parallel_step_time_s
from runner.parallel import local_device_count
from runner.supervise import machine_memory_bytes, machine_share_bytes

if TYPE_CHECKING:
    from runner.device.support import Support

# A rehearsal's modelled memory may use this share of a rank's memory: the formulas (made for
# GPUs) measured up to 1.57x low for the bank-FAQ rehearsal on CPU (see LIMIT_MARGIN).
HEADROOM = 0.6
DEFAULT_STEPS = 3  # --local without --max-steps
STEP_TARGET_S = 30.0  # a rehearsal step should take about this long here (modelled)
MIN_SEQ_LEN = 16
# Runtime limit: this multiple of the modelled memory (the bank-FAQ rehearsal, micro 2 x seq
# 512 on CPU, measured 5.23 GB peak RSS against 4.10 GB modelled as fp32, 1.28x; 3.33 GB when
# modelled as bf16, which Paddle's CPU AMP does not apply, 1.57x) ...
LIMIT_MARGIN = 2.5
LIMIT_SLACK_GB = 1.0  # ... or this much above it, whichever is more (within the machine)
STAGE_CODES = {stage: code for code, stage in enumerate(SHARDING_STAGES)}


@dataclass(frozen=True)
class Rehearsal:
    """The local plan and what was changed to get it, with the model's numbers for it."""

    plan: Plan
    changes: tuple[str, ...]
    memory_bytes: float  # modelled peak per rank
    memory_budget_bytes: float  # what the fit aimed under (HEADROOM x the rank's memory)
    memory_limit_bytes: int  # enforced per rank while it runs
    machine_memory_bytes: int
    step_time_s: float  # modelled on the local profile
    step_time_p10_s: float  # 80% interval (the profile's measured/modelled spread)
    step_time_p90_s: float
    profile: str


def local_performance(plan: Plan) -> DeviceProfile | None:
    """The profile that describes this machine's devices (cpu.toml on a CPU machine)."""
    name = "cpu" if plan.hardware.device == "cpu" else plan.hardware.profile
    try:
        return read_performance(name)
    except ProfileError as exc:
        if exc.file and Path(exc.file).is_file():
            raise  # a malformed profile or calibration: one clear line, exit 2
        return None  # no profile of that name here: the rehearsal is not modelled


def _memory_args(plan: Plan, perf: DeviceProfile | None) -> dict:
    """gptplan.memory's arguments for `plan` on `perf` (one place for both callers below)."""
    t, p = plan.training, plan.parallel
    eff = perf.efficiency_for(t.precision) if perf else None
    return dict(
        seq_len=t.seq_len,
        micro_batch=t.per_device_train_batch_size,
        accumulation=t.gradient_accumulation_steps,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        stage_code=STAGE_CODES[p.sharding],
        shard_degree=p.sharding_parallel_degree,
        recompute_code=RECOMPUTE_CODES[p.recompute],
        seq_parallel=p.sequence_parallel,
        precision_code=precision.code(t.precision),
        overhead_gb=eff.memory_overhead_gb if eff else 0.0,
        fragmentation=eff.fragmentation if eff else 1.0,
        flash_attention=t.use_flash_attention,
        virtual_pp=p.virtual_pp_degree,
        recompute_layers=p.recompute_layers // p.pipeline_parallel_degree,
        dp=p.data_parallel_degree,
        amp_o1=precision.amp_level(t.precision, t.fp16_opt_level) == "O1",
        fused_kernels=plan.hardware.device == "gpu",
    )


def modelled_memory_bytes(plan: Plan, perf: DeviceProfile | None) -> float:
    """Peak bytes per rank of `plan`, from gptplan.memory's formulas."""
    shape = ModelShape.from_section(plan.model)
    return float(memory_per_device_bytes(shape, **_memory_args(plan, perf)))


# Terms of gptplan.memory that are not in the device allocator (the process itself, the
# communicators' own buffers)
NOT_ALLOCATOR_TERMS = ("runtime", "communicators")


def modelled_allocator_gb(plan: Plan) -> dict[str, float]:
    """What the memory model says the allocator holds per rank at the phases a run records
    (runner.metrics.ALLOCATOR_PHASES), in GB (modelled): after the model build its weights;
    after the first optimizer step also the gradients and optimizer states; a step's peak
    every term but the process runtime and the communicators."""
    terms = {
        k: float(v)
        for k, v in memory_terms(
            ModelShape.from_section(plan.model), **_memory_args(plan, local_performance(plan))
        ).items()
    }
    states = terms["weights"] + terms["gradients"] + terms["optimizer"]
    peak = sum(v for k, v in terms.items() if k not in NOT_ALLOCATOR_TERMS)
    return {
        "after_model_build_gb": terms["weights"] / GB,
        "after_first_step_gb": states / GB,
        "step_peak_gb": peak / GB,
        "total_with_runtime_gb": sum(terms.values()) / GB,
    }


def rank_memory_limit_bytes(plan: Plan, *, limit_gb: float | None = None) -> int:
    """The memory one rank of `plan` may use on this machine before the runner ends it.

    An explicit `limit_gb` wins. Otherwise: on CPU, where the plan's memory is this machine's
    memory, LIMIT_MARGIN x the modelled peak (at least LIMIT_SLACK_GB above it), never more
    than the rank's share of the machine; on accelerators (host memory is not what the plan
    models) the rank's share of the machine.
    """
    if limit_gb:
        return int(limit_gb * GB)
    share = machine_share_bytes(plan.parallel.nproc_per_node)
    if plan.hardware.device != "cpu":
        return share
    modelled = modelled_memory_bytes(plan, local_performance(plan))
    return int(min(share, max(LIMIT_MARGIN * modelled, modelled + LIMIT_SLACK_GB * GB)))


def _with_training(plan: Plan, **fields: Any) -> Plan:  # TrainingSection's fields, mixed types
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, **fields))


def _changed(a: ModelSection, b: ModelSection) -> list[str]:
    return [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


def smaller_model(plan: Plan) -> Plan | None:
    """The model one step smaller, for a rehearsal that does not fit even at micro-batch 1:
    half the layers while every pipeline stage (x virtual stages) keeps whole layers, then half
    the width (hidden and FFN; the heads while tensor parallel still divides them). The
    vocabulary is the tokenizer's and stays. None when nothing can shrink."""
    m, p = plan.model, plan.parallel
    stages = p.pipeline_parallel_degree * p.virtual_pp_degree
    layers = m.num_hidden_layers // 2
    if layers >= max(2, stages) and (p.virtual_pp_degree == 1 or layers % stages == 0):
        return _with_parallel(plan, p, dataclasses.replace(m, num_hidden_layers=layers))
    tp = p.tensor_parallel_degree
    hidden, ffn = m.hidden_size // 2, m.intermediate_size // 2
    heads = m.num_attention_heads
    if (hidden // heads) < 16 and heads // 2 >= tp and (heads // 2) % tp == 0:
        heads //= 2
    kv = m.num_key_value_heads
    if kv and (kv > heads or heads % kv):
        kv = heads
    smaller = dataclasses.replace(
        m,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv,
    )
    if hidden < 64 or hidden % heads or ffn % tp or families.model_problem(smaller, tp)[1]:
        return None
    return _with_parallel(plan, p, smaller)


def _with_parallel(plan: Plan, p: ParallelSection, m: ModelSection) -> Plan:
    """`plan` with model `m`; per-layer recompute kept in proportion to its layers."""
    if p.recompute_layers and m.num_hidden_layers != plan.model.num_hidden_layers:
        share = p.recompute_layers / plan.model.num_hidden_layers
        per_stage = m.num_hidden_layers // p.pipeline_parallel_degree
        kept = max(1, min(per_stage, round(share * per_stage))) * p.pipeline_parallel_degree
        p = dataclasses.replace(p, recompute_layers=kept)
    return dataclasses.replace(plan, model=m, parallel=p)


def fit_memory(
    plan: Plan, perf: DeviceProfile | None, budget_bytes: float
) -> tuple[Plan, dict[str, str]]:
    """Halve micro-batch, then seq_len, until the modelled memory fits; keep tokens per step."""
    t = plan.training
    tokens_per_rank = t.per_device_train_batch_size * t.gradient_accumulation_steps * t.seq_len
    fitted = plan
    while modelled_memory_bytes(fitted, perf) > budget_bytes:
        ft = fitted.training
        if ft.per_device_train_batch_size > 1:
            fitted = _with_training(
                fitted, per_device_train_batch_size=max(1, ft.per_device_train_batch_size // 2)
            )
        elif ft.seq_len > MIN_SEQ_LEN:
            fitted = _with_training(fitted, seq_len=max(MIN_SEQ_LEN, ft.seq_len // 2))
        elif (smaller := smaller_model(fitted)) is not None:
            fitted = smaller
        else:
            need = modelled_memory_bytes(fitted, perf)
            m = fitted.model
            raise HardwareError(
                f"even micro-batch 1 x seq_len {ft.seq_len} with {m.num_hidden_layers} layers "
                f"of width {m.hidden_size} needs {need / GB:.2f} GB per rank (modelled), more "
                f"than {budget_bytes / GB:.2f} GB ({HEADROOM:.0%} of this machine's memory per "
                "rank); the model itself is too large to rehearse here (its vocabulary, "
                f"{m.vocab_size}, is the tokenizer's and is kept)",
                key="model",
            )
    ft = fitted.training
    reasons: dict[str, str] = {}
    if fitted.model != plan.model:
        why = (
            f"memory: modelled {modelled_memory_bytes(plan, perf) / GB:.1f} GB per rank > "
            f"{budget_bytes / GB:.1f} GB even at micro-batch 1 x seq_len {ft.seq_len}"
        )
        reasons |= {f"model.{k}": why for k in _changed(plan.model, fitted.model)}
    if ft == t:
        return fitted, reasons
    accumulation = math.ceil(tokens_per_rank / (ft.per_device_train_batch_size * ft.seq_len))
    pp = plan.parallel.pipeline_parallel_degree
    if plan.parallel.virtual_pp_degree > 1:  # the interleaved schedule: a multiple of pp
        accumulation = -(-accumulation // pp) * pp
    fitted = _with_training(fitted, gradient_accumulation_steps=accumulation)
    why = (
        f"memory: modelled {modelled_memory_bytes(plan, perf) / GB:.1f} GB per rank > "
        f"{budget_bytes / GB:.1f} GB, {HEADROOM:.0%} of the rank's memory"
    )
    reasons["per_device_train_batch_size"] = why
    if ft.seq_len != t.seq_len:
        reasons["seq_len"] = why + ", even at micro-batch 1"
    reasons["gradient_accumulation_steps"] = (
        f"memory: raised to {accumulation} to keep "
        f"{tokens_per_rank:,} tokens per rank per step, "
        "the global batch"
    )
    return fitted, reasons


def fit_time(
    plan: Plan, perf: DeviceProfile, pinned: frozenset[str]
) -> tuple[Plan, dict[str, str]]:
    """Lower accumulation, then micro-batch, until a step is modelled at <= STEP_TARGET_S."""
    before = data_parallel_step_time_s(plan, perf)
    fitted = plan
    p = plan.parallel
    floor = min_accumulation(p.pipeline_parallel_degree, p.virtual_pp_degree)
    while data_parallel_step_time_s(fitted, perf) > STEP_TARGET_S:
        ft = fitted.training
        lower = max(floor, ft.gradient_accumulation_steps // 2)
        if p.virtual_pp_degree > 1:
            lower = -(-lower // p.pipeline_parallel_degree) * p.pipeline_parallel_degree
        if (
            lower < ft.gradient_accumulation_steps
            and "training.gradient_accumulation_steps" not in pinned
        ):
            fitted = _with_training(fitted, gradient_accumulation_steps=lower)
        elif (
            ft.per_device_train_batch_size > 1
            and "training.per_device_train_batch_size" not in pinned
        ):
            fitted = _with_training(
                fitted, per_device_train_batch_size=max(1, ft.per_device_train_batch_size // 2)
            )
        else:
            break
    t, ft = plan.training, fitted.training
    why = (
        f"time: at the kept batch one step would take {before:,.0f} s here (modelled); "
        f"a rehearsal step aims at <= {STEP_TARGET_S:.0f} s; --set pins a value"
    )
    return fitted, {
        key: why
        for key in ("gradient_accumulation_steps", "per_device_train_batch_size")
        if getattr(t, key) != getattr(ft, key)
    }


def timing_precision(plan: Plan, perf: DeviceProfile | None) -> str:
    """The precision a rehearsal's step time is modelled in: the plan's where the local profile
    has a peak for it; on the rehearsal device, whose AMP kernels compute each op in fp32
    (docs/device.md), fp32 when the profile has none for the plan's bf16/fp16 (without it the
    step would not be fitted to this machine's time at all: llama_zh's bf16 rehearsal kept 64
    micro-batches of 2 x 1024 a step)."""
    from runner.device.support import uses_device

    own = plan.training.precision
    if perf is None or perf.peak_for(own) > 0 or not uses_device(plan):
        return own
    return "fp32"


def rehearse(
    plan: Plan,
    *,
    max_steps_given: bool,
    limit_gb: float | None = None,
    pinned: frozenset[str] = frozenset(),
) -> Rehearsal:
    """Fit a localized plan (localize) to this machine; see the module doc."""
    perf = local_performance(plan)
    changes: list[str] = []
    if plan.parallel.virtual_pp_degree > 1 and plan.parallel.pipeline_parallel_degree == 1:
        changes.append(
            f"parallel.virtual_pp_degree: {plan.parallel.virtual_pp_degree} -> 1 (no pipeline here)"
        )
        plan = dataclasses.replace(
            plan, parallel=dataclasses.replace(plan.parallel, virtual_pp_degree=1)
        )
    if not max_steps_given and plan.training.max_steps > DEFAULT_STEPS:
        changes.append(
            f"training.max_steps: {plan.training.max_steps} -> {DEFAULT_STEPS} "
            "(a rehearsal; --max-steps N for more)"
        )
        plan = _with_training(
            plan,
            max_steps=DEFAULT_STEPS,
            warmup_steps=min(plan.training.warmup_steps, DEFAULT_STEPS),
        )
        plan = dataclasses.replace(plan, job=dataclasses.replace(plan.job, target_tokens=0))
    nproc = plan.parallel.nproc_per_node
    rank_memory = limit_gb * GB if limit_gb else machine_share_bytes(nproc)
    budget = HEADROOM * rank_memory
    before = plan
    plan, reasons = fit_memory(plan, perf, budget)
    step_time, interval = float("nan"), (float("nan"), float("nan"))
    timed = plan
    if timing_precision(plan, perf) != plan.training.precision:
        timed = _with_training(plan, precision="fp32", fp16_opt_level="O1")
    if perf is not None and perf.peak_for(timed.training.precision) > 0:
        timed, time_reasons = fit_time(timed, perf, pinned)
        plan = _with_training(
            timed, precision=plan.training.precision, fp16_opt_level=plan.training.fp16_opt_level
        )
        for key, why in time_reasons.items():
            reasons[key] = f"{reasons[key]}; {why}" if key in reasons else why
        step_time = data_parallel_step_time_s(timed, perf)
        eff = perf.efficiency_for(timed.training.precision)
        interval = (step_time / eff.throughput_p90, step_time / eff.throughput_p10)
    for key in ("per_device_train_batch_size", "seq_len", "gradient_accumulation_steps"):
        old, new = getattr(before.training, key), getattr(plan.training, key)
        if old != new:
            changes.append(f"training.{key}: {old} -> {new} ({reasons[key]})")
    for key in _changed(before.model, plan.model):
        old, new = getattr(before.model, key), getattr(plan.model, key)
        changes.append(f"model.{key}: {old} -> {new} ({reasons[f'model.{key}']})")
    if before.parallel.recompute_layers != plan.parallel.recompute_layers:
        changes.append(
            f"parallel.recompute_layers: {before.parallel.recompute_layers} -> "
            f"{plan.parallel.recompute_layers} (the same share of the fewer layers)"
        )
    if (
        before.global_batch_size != plan.global_batch_size
        or before.training.seq_len != plan.training.seq_len
    ):
        changes.append(
            f"global batch: {before.global_batch_size} x {before.training.seq_len}"
            f" -> {plan.global_batch_size} x {plan.training.seq_len} tokens per step"
        )
    validate(plan, file="the rehearsal of the plan")  # the fitted layout still obeys every rule
    memory = modelled_memory_bytes(plan, perf)
    if perf is not None and math.isfinite(step_time):
        tokens_per_s = plan.tokens_per_step / step_time
        peak = perf.peak_for(timed.training.precision) * 1e12 * plan.parallel.world_size
        estimate = EstimateSection(
            source="model",
            tokens_per_second=tokens_per_s,
            step_time_s=step_time,
            peak_memory_gb=memory / GB,
            mfu=training_flops_per_token(plan.model, plan.training.seq_len) * tokens_per_s / peak,
            hours=plan.training.max_steps * step_time / 3600,
            tokens_per_second_p10=plan.tokens_per_step / interval[1],
            tokens_per_second_p90=plan.tokens_per_step / interval[0],
            hours_p10=plan.training.max_steps * interval[0] / 3600,
            hours_p90=plan.training.max_steps * interval[1] / 3600,
            interval=f"measured/modelled spread of the {perf.name!r} profile's efficiency "
            "(throughput_p10/p90)",
        )
        hardware = dataclasses.replace(
            plan.hardware,  # so the run's MFU uses this peak
            peak_tflops=perf.peak_for(timed.training.precision),
        )
        plan = dataclasses.replace(plan, estimate=estimate, hardware=hardware)
    return Rehearsal(
        plan=plan,
        changes=tuple(changes),
        memory_bytes=memory,
        memory_budget_bytes=budget,
        memory_limit_bytes=rank_memory_limit_bytes(plan, limit_gb=limit_gb),
        machine_memory_bytes=machine_memory_bytes(),
        step_time_s=step_time,
        step_time_p10_s=interval[0],
        step_time_p90_s=interval[1],
        profile=perf.name if perf else "",
    )


def describe(r: Rehearsal) -> list[str]:
    """The lines `runner execute --local` prints about the fitted rehearsal."""
    t = r.plan.training
    uncertainty = (
        f"80% interval {r.step_time_p10_s:.3g}-{r.step_time_p90_s:.3g} s from the "
        "profile's measured/modelled spread"
    )
    lines = [
        f"memory per rank: {r.memory_bytes / GB:.2f} GB modelled (gptplan.memory formulas, "
        f"micro-batch {t.per_device_train_batch_size} x seq_len {t.seq_len}); limit "
        f"{r.memory_limit_bytes / GB:.2f} GB per rank of {r.machine_memory_bytes / GB:.1f}"
        " GB on this machine (the runner ends a rank above it)"
    ]
    if math.isfinite(r.step_time_s):
        lines.append(
            f"step time here: {r.step_time_s:.3g} s modelled on the {r.profile!r} "
            f"profile ({uncertainty}); {t.max_steps} step(s) ~ "
            f"{t.max_steps * r.step_time_s / 60:.2g} min plus start-up"
            + (
                "; modelled as data parallel over the same processes (the local profile has "
                "no tensor/pipeline terms)"
                if r.plan.parallel.tensor_parallel_degree * r.plan.parallel.pipeline_parallel_degree
                > 1
                else ""
            )
        )
    else:
        lines.append(
            "step time here: not modelled (no peak FLOP/s for this precision in the local profile)"
        )
    return lines


def layout_kinds(p: ParallelSection) -> list[str]:
    """The layout kinds a [parallel] table uses (runner.device.support's names)."""
    from runner.device import support as rd

    kinds = []
    if p.tensor_parallel_degree > 1:
        kinds.append(rd.TENSOR)
    if p.sequence_parallel:
        kinds.append(rd.SEQUENCE)
    if p.pipeline_parallel_degree > 1:
        kinds.append(rd.PIPELINE)
    if p.virtual_pp_degree > 1:
        kinds.append(rd.INTERLEAVED)
    if p.sharding:
        kinds.append({"stage1": rd.STAGE1, "stage2": rd.STAGE2, "stage3": rd.STAGE3}[p.sharding])
    if p.data_parallel_degree > 1:
        kinds.append(rd.DATA)
    return kinds


def _pipeline_width(layers: int, pp: int, vpp: int) -> tuple[int, int]:
    """(local pp, layers): 2 stages, or with virtual stages 4 or 3 (Paddle's interleaved
    schedule needs pp > 2) whose pp x vpp divides the layers; (4, fewer layers) if none does."""
    if vpp == 1:
        return min(pp, 2), layers
    for width in (4, 3):
        if width <= pp and layers % (width * vpp) == 0:
            return width, layers
    width = 4 if layers >= 4 * vpp else 3
    return width, max(width * vpp, layers // (width * vpp) * width * vpp)


def local_layout(plan: Plan, sup: Support) -> tuple[Plan, list[str]]:
    """The plan's own kinds of parallelism at a width `sup` (runner.device.support.Support)
    holds: each degree > 1 becomes 2 (pipeline with virtual stages 4 or 3), what does not run
    here or does not fit sup.max_ranks is dropped (data parallel first, then sharding, the
    virtual stages, pipeline, sequence and tensor parallel last), and the model changes only
    where a divisibility rule needs it. Pure: no Paddle, no machine state."""
    from runner.device import support as rd

    p, m, t = plan.parallel, plan.model, plan.training
    notes: list[str] = []
    where = f"the rehearsal device ({sup.device})" if sup.on_device else "plain CPU (gloo)"
    missing = [k for k in layout_kinds(p) if k not in sup.kinds]
    if missing:
        why = f"; {sup.why_not}" if sup.why_not else ""
        notes.append(
            f"layout: {', '.join(missing)} cannot run on {where}{why}: those ranks "
            "rehearse as data parallel"
        )
    runs = set(layout_kinds(p)) - set(missing)
    # the smallest factor of the plan's tp: it divides every width the plan's tp divides
    tp_plan = p.tensor_parallel_degree
    tp = min(d for d in range(2, tp_plan + 1) if tp_plan % d == 0) if rd.TENSOR in runs else 1
    sp = rd.SEQUENCE in runs and tp > 1
    vpp = p.virtual_pp_degree if rd.INTERLEAVED in runs and rd.PIPELINE in runs else 1
    layers = m.num_hidden_layers
    if rd.PIPELINE in runs:
        pp, layers = _pipeline_width(layers, p.pipeline_parallel_degree, vpp)
    else:
        pp, vpp = 1, 1
    sharding = p.sharding if p.sharding and {rd.STAGE1, rd.STAGE2, rd.STAGE3} & runs else ""
    shard = 2 if sharding else 1
    # what does not run here becomes data parallel, like the plan's batch ranks
    dp = 2 if (rd.DATA in runs or (missing and p.world_size > 1)) else 1

    def ranks() -> int:
        return tp * pp * shard * dp

    dropped: list[str] = []
    while ranks() > sup.max_ranks:
        if dp > 1:
            dp, what = 1, "data parallel"
        elif shard > 1:
            shard, sharding, what = 1, "", f"sharding {p.sharding}"
        elif vpp > 1:
            vpp, what = 1, "the virtual pipeline stages"
            pp, layers = _pipeline_width(m.num_hidden_layers, p.pipeline_parallel_degree, 1)
        elif pp > 1:
            pp, layers, what = 1, m.num_hidden_layers, "pipeline parallel"
        else:
            tp, sp, what = 1, False, "tensor parallel"
        dropped.append(what)
    if dropped:
        notes.append(
            f"layout: {', '.join(dropped)} not rehearsed: with the rest it needs more than "
            f"{sup.max_ranks} processes, the most this machine runs"
        )
    new_p = dataclasses.replace(
        p,
        nnodes=1,
        nproc_per_node=ranks(),
        master="",
        data_parallel_degree=dp,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=pp,
        virtual_pp_degree=vpp,
        sharding=sharding,
        sharding_parallel_degree=shard,
        sequence_parallel=sp,
        recompute_layers=_recompute_layers(p, m.num_hidden_layers, layers, pp),
    )
    new_m = dataclasses.replace(m, num_hidden_layers=layers)
    new_t = t
    # the pipeline's own rules: accumulation fills the stages (>= pp; interleaved: a multiple
    # of pp, at least 2 x pp), sequence parallel splits micro x seq over tp
    need = min_accumulation(pp, vpp)
    if t.gradient_accumulation_steps < need or (vpp > 1 and t.gradient_accumulation_steps % pp):
        acc = max(need, -(-t.gradient_accumulation_steps // pp) * pp if vpp > 1 else need)
        new_t = dataclasses.replace(new_t, gradient_accumulation_steps=acc)
    return dataclasses.replace(plan, parallel=new_p, model=new_m, training=new_t), notes


def min_accumulation(pp: int, vpp: int) -> int:
    """Micro-batches a step needs to fill a pipeline of pp stages (interleaved: 2 x pp)."""
    return 2 * pp if vpp > 1 else pp


def _recompute_layers(p: ParallelSection, layers_before: int, layers: int, pp: int) -> int:
    """Per-layer recompute kept in proportion: the same share of layers per stage, a multiple
    of the local pp (0 stays 0: every layer)."""
    if p.recompute_layers == 0 or p.recompute == "none":
        return 0
    per_stage = layers // pp
    share = p.recompute_layers / layers_before
    return max(1, min(per_stage, round(share * per_stage))) * pp


def amp_blocked_by(plan: Plan, sup: Support) -> str:
    """Why AMP cannot run in `plan`'s (local) layout on `sup`'s device ('' when it can):
    a layout kind the device runs only in fp32 (runner.device.support.Support.amp_without)."""
    kinds = [k for k in layout_kinds(plan.parallel) if k in getattr(sup, "amp_without", {})]
    if not kinds or not getattr(sup, "on_device", False):
        return ""
    return f"AMP does not run with {kinds[0]} on the rehearsal device: {sup.amp_without[kinds[0]]}"


def localize(plan: Plan, sup: Support | None = None) -> tuple[Plan, list[str]]:
    """The plan rehearsed on this machine: its own kinds of parallelism, shrunk.

    Keeps seq_len, micro-batch, accumulation, precision where possible and the model; keeps
    every layout kind that runs here (runner.device.support.support(): tensor, pipeline with
    its virtual stages, sequence parallel, sharding stages, recompute on the rehearsal device;
    data parallel and ZeRO-1 on plain CPU) at degree 2 (local_layout), one node. Price
    becomes 0: a rehearsal on your own machine is not billed at the cloud price. Every change
    is listed.
    """
    from runner.device import support as device_support

    if sup is None:
        sup = device_support.support()
    changes: list[str] = []
    device: Device = "cpu"
    if sup is device_support.PLAIN_CPU or not sup.on_device:
        import paddle

        if paddle.is_compiled_with_cuda() and local_device_count("gpu"):
            device = "gpu"
    par, model = plan.parallel, plan.model
    if device == "gpu":  # a GPU machine: every kind runs, as many ranks as it has GPUs
        sup = dataclasses.replace(
            sup, kinds=device_support.ALL_KINDS, max_ranks=local_device_count("gpu")
        )
    elif not sup.on_device:
        sup = dataclasses.replace(sup, max_ranks=min(sup.max_ranks, local_device_count("cpu")))
    shrunk, notes = local_layout(plan, sup)
    new_par = shrunk.parallel
    changes += notes
    for f in dataclasses.fields(par):
        old, new = getattr(par, f.name), getattr(new_par, f.name)
        if old != new:
            changes.append(f"parallel.{f.name}: {old!r} -> {new!r}")
    if shrunk.model.num_hidden_layers != model.num_hidden_layers:
        changes.append(
            f"model.num_hidden_layers: {model.num_hidden_layers} -> "
            f"{shrunk.model.num_hidden_layers} (pipeline {new_par.pipeline_parallel_degree} x "
            f"virtual {new_par.virtual_pp_degree} stages need whole layers each)"
        )
    t = shrunk.training
    if t.gradient_accumulation_steps != plan.training.gradient_accumulation_steps:
        changes.append(
            f"training.gradient_accumulation_steps: {plan.training.gradient_accumulation_steps}"
            f" -> {t.gradient_accumulation_steps} (fills the {new_par.pipeline_parallel_degree}"
            "-stage pipeline)"
        )
    precisions = list(sup.precisions) if device == "cpu" else plan.hardware.precisions
    new_t = t
    amp_blocked = amp_blocked_by(shrunk, sup) if device == "cpu" else ""
    if amp_blocked and precision.row(t.precision).mixed:
        new_t = dataclasses.replace(t, precision="fp32", fp16_opt_level="O1")
        changes.append(f"training.precision: {t.precision!r} -> 'fp32' ({amp_blocked})")
    elif t.precision not in precisions:
        mixed = precision.row(t.precision).mixed
        fallback: Precision = "bf16" if "bf16" in precisions and mixed else "fp32"
        level = t.fp16_opt_level if precision.row(fallback).mixed else "O1"
        new_t = dataclasses.replace(t, precision=fallback, fp16_opt_level=level)
        why = (
            f"the rehearsal device runs {', '.join(precisions)}"
            if sup.on_device
            else "Paddle's AMP is a no-op on CPU"
        )
        changes.append(f"training.precision: {t.precision!r} -> {fallback!r} ({why})")
    if new_t.use_flash_attention and (device != "gpu" or not precision.row(new_t.precision).mixed):
        changes.append("training.use_flash_attention: True -> False (needs a GPU and fp16/bf16)")
        new_t = dataclasses.replace(new_t, use_flash_attention=False)
    hw = plan.hardware
    new_hw = dataclasses.replace(
        hw,
        device=device,
        profile=REHEARSAL_PROFILE if device == "cpu" and sup.on_device else f"local-{device}",
        offer="local",
        precisions=precisions,
        spot=False,
        price_per_node_hour=0.0,
        peak_tflops=0.0 if device != hw.device else hw.peak_tflops,
    )
    for key in ("device", "profile", "price_per_node_hour"):
        if getattr(hw, key) != getattr(new_hw, key):
            changes.append(f"hardware.{key}: {getattr(hw, key)!r} -> {getattr(new_hw, key)!r}")
    if device == "cpu":
        changes.append(
            f"runs on: the rehearsal device ({sup.device}), {new_par.world_size} process(es)"
            if sup.on_device
            else f"runs on: plain CPU (gloo), {new_par.world_size} process(es)"
            + (f"; the rehearsal device is unavailable: {sup.why_not}" if sup.why_not else "")
        )
    budget = dataclasses.replace(plan.budget, max_cost=0.0)
    if plan.budget.max_cost:
        changes.append("budget.max_cost: not enforced locally (price 0)")
    if plan.estimate.source != "none":
        changes.append("estimate: dropped (it describes the planned cluster, not this machine)")
    new_plan = dataclasses.replace(
        shrunk,
        training=new_t,
        hardware=new_hw,
        budget=budget,
        estimate=EstimateSection(),
        job=dataclasses.replace(plan.job, target_tokens=0),
    )
    old_batch, new_batch = plan.global_batch_size, new_plan.global_batch_size
    if old_batch != new_batch:
        changes.append(
            f"global batch: {old_batch} -> {new_batch} sequences per step "
            "(per-device settings kept)"
        )
    return new_plan, changes
