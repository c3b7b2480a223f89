"""The training loop: one process (rank) of a run. Reads top to bottom.

    train()                      build everything, resume, loop, final checkpoint, result
      train_step()               accumulation micro-steps -> clip -> optimizer step
        forward_backward()       one micro-batch: autocast forward, loss, (scaled) backward

Every rank runs this; rank 0 also logs and writes. The plan is the only input: the loop never
re-decides anything the planner chose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

from gptplan import families, money, precision
from gptplan.diskspace import free_bytes, guard_disk_writes
from gptplan.errors import UserError
from gptplan.plan import Plan, TrainingSection, load_plan
from gptplan.progress import stderr_is_terminal
from gptplan.tomlconf import write_text_atomic
from runner import budget as budget_guard
from runner import checkpoint as ckpt
from runner import signals
from runner.batches import BatchSource, DeterministicSampler, TokenDataset
from runner.billing import Billing
from runner.console import say
from runner.datacache import content_key, data_identity, open_prepared
from runner.divergence import PATIENCE, STOP_DIVERGED, DivergenceGuard, ignoring
from runner.metrics import AllocatorPhases, AllocatorProbe, MetricsWriter, RunMeter, StepRecord
from runner.model import build_model
from runner.parallel import build_strategy, sharding_groups, wait_for_the_store
from runner.watchdog import ProgressFile

if TYPE_CHECKING:
    from types import FrameType

    import numpy as np
    import paddle
    from tqdm import tqdm

    from runner.batches import MicroBatch

STOP_SIGNAL = "signal (preemption notice)"
STOP_DISK = "disk full"
STOP_ORDER = (STOP_SIGNAL, "budget.max_cost", "budget.max_hours", STOP_DISK)  # first one wins


# ---- schedule --------------------------------------------------------------------------------


REHEARSAL_LINE_EVERY_S = 5.0  # a rehearsal's step line at least this often (logging_steps aside)


def learning_rate_at(step: int, t: TrainingSection) -> float:
    """Linear warm-up, then cosine/linear decay to min_learning_rate; a function of step only,
    so a resumed run needs no scheduler state."""
    if step < t.warmup_steps:
        return t.learning_rate * (step + 1) / t.warmup_steps
    if t.lr_scheduler_type == "constant":
        return t.learning_rate
    span = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_scheduler_type == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_learning_rate + (t.learning_rate - t.min_learning_rate) * decay


def dropout_seed(seed: int, step: int, rank: int, world: int) -> int:
    """Dropout masks depend on (seed, step, rank) only: resuming needs no RNG state."""
    return (seed * 1_000_003 + step * world + rank) % (2**31 - 1)


# ---- distributed environment -----------------------------------------------------------------


@dataclass
class RankInfo:
    rank: int = 0
    world: int = 1
    batch_rank: int = 0  # which slice of the global batch this rank trains on
    data_parallel_rank: int = 0
    shard: ckpt.ShardId = ckpt.ShardId()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(plan: Plan) -> RankInfo:
    import paddle

    from runner.device.support import uses_device

    if uses_device(plan):  # the rehearsal device: Paddle placed this rank there (--devices)
        from runner import device

        if not device.activate_if_on_device():
            raise RuntimeError(
                f"this rank runs on {paddle.get_device()}, not on the rehearsal device "
                f"({device.DEVICE_TYPE}): the launch did not select it"
            )
    elif plan.hardware.device == "cpu":
        paddle.set_device("cpu")
    if plan.parallel.world_size == 1:
        return RankInfo()
    from paddle.distributed import fleet

    wait_for_the_store()  # else Paddle's first try may be refused and it waits 3 s
    fleet.init(is_collective=True, strategy=build_strategy(plan))
    hcg = fleet.get_hybrid_communicate_group()
    dp_rank = hcg.get_data_parallel_rank()
    sd_rank = hcg.get_sharding_parallel_rank()
    shard = ckpt.ShardId(hcg.get_model_parallel_rank(), hcg.get_stage_id(), sd_rank)
    info = RankInfo(
        rank=paddle.distributed.get_rank(),
        world=paddle.distributed.get_world_size(),
        batch_rank=dp_rank * plan.parallel.sharding_parallel_degree + sd_rank,
        data_parallel_rank=dp_rank,
        shard=shard,
    )
    if plan.parallel.tensor_parallel_degree > 1:
        from gptplan import paddlenlp_light

        paddlenlp_light.trainer_utils().set_hyrbid_parallel_seed(
            plan.job.seed, info.batch_rank, shard.tensor_rank, shard.pipeline_rank
        )
    return info


# ---- construction ----------------------------------------------------------------------------


def build_optimizer(plan: Plan, model: paddle.nn.Layer) -> paddle.optimizer.Optimizer:
    import paddle

    t = plan.training
    # No weight decay on biases and layer norms (matched by structured name, applied by
    # Paddle's internal parameter name).
    no_decay = {p.name for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n}
    clip = paddle.nn.ClipGradByGlobalNorm(t.max_grad_norm) if t.max_grad_norm > 0 else None
    return paddle.optimizer.AdamW(
        learning_rate=t.learning_rate,
        parameters=model.parameters(),
        beta1=t.adam_beta1,
        beta2=t.adam_beta2,
        weight_decay=t.weight_decay,
        grad_clip=clip,
        apply_decay_param_fun=lambda name: name not in no_decay,
        multi_precision=money.keeps_master_weights(t.precision, t.fp16_opt_level),
    )


def build_scaler(plan: Plan) -> paddle.amp.GradScaler | None:
    import paddle

    if not precision.row(plan.training.precision).loss_scaling:
        return None
    return paddle.amp.GradScaler(init_loss_scaling=plan.training.scale_loss)


def amp_context(plan: Plan) -> contextlib.AbstractContextManager[None]:
    import paddle

    t = plan.training
    level = precision.amp_level(t.precision, t.fp16_opt_level)
    if level is None:
        return contextlib.nullcontext()
    return paddle.amp.auto_cast(enable=True, level=level, dtype=precision.paddle_dtype(t.precision))


class Batches(Protocol):
    """What the loop asks of its data: runner.batches.BatchSource, or runner.probe's
    synthetic stand-in."""

    def micro_batch(self, step: int, micro_step: int) -> MicroBatch: ...


B = TypeVar("B", bound=Batches)


@dataclass
class Trainer(Generic[B]):
    plan: Plan
    rank: RankInfo
    model: paddle.nn.Layer  # fleet's or group-sharded wrapper once distributed
    optimizer: paddle.optimizer.Optimizer
    scaler: paddle.amp.GradScaler | None
    batches: B
    # called once, after the first optimizer update and before the gradients are cleared (the
    # update's own ops, e.g. the loss scaler's unscale, can move gradients: check_placement)
    check_update: Callable[[Trainer[B]], None] | None = None

    # ---- one optimizer step ----
    def forward_backward(self, step: int, micro_step: int, *, sync: bool) -> float:
        import paddle

        batch = self.batches.micro_batch(step, micro_step)
        inputs = paddle.to_tensor(batch.input_ids)
        labels = paddle.to_tensor(batch.labels)
        no_sync = getattr(self.model, "no_sync", None)
        sync_ctx = contextlib.nullcontext() if sync or no_sync is None else no_sync()
        with sync_ctx:
            with amp_context(self.plan):
                loss, _ = self.model(inputs, labels=labels)
            loss = loss / self.plan.training.gradient_accumulation_steps
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        return float(loss)

    def train_step(self, step: int) -> float:
        """Accumulate gradients over the micro-batches, then one optimizer update."""
        import paddle

        t = self.plan.training
        self.optimizer.set_lr(learning_rate_at(step, t))
        paddle.seed(dropout_seed(self.plan.job.seed, step, self.rank.rank, self.rank.world))
        if self.plan.parallel.pipeline_parallel_degree > 1:
            return self._pipeline_step(step)
        loss = 0.0
        for micro_step in range(t.gradient_accumulation_steps):
            loss += self.forward_backward(
                step, micro_step, sync=micro_step == t.gradient_accumulation_steps - 1
            )
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.check_update is not None:
            check, self.check_update = self.check_update, None
            check(self)
        self.optimizer.clear_grad()
        return loss

    def _pipeline_step(self, step: int) -> float:
        """Pipeline parallel: PaddleNLP's PipelineParallel runs the 1F1B schedule itself."""
        import numpy as np
        import paddle

        t = self.plan.training
        parts = [self.batches.micro_batch(step, m) for m in range(t.gradient_accumulation_steps)]
        inputs = paddle.to_tensor(np.concatenate([p.input_ids for p in parts]))
        labels = paddle.to_tensor(np.concatenate([p.labels for p in parts]))
        with amp_context(self.plan):
            loss = self.model.train_batch(
                [inputs, labels], optimizer=self.optimizer, scaler=self.scaler
            )
        # every stage gets the last stage's loss (Paddle broadcasts it), shaped [1] on some
        return float(np.asarray(loss.numpy()).reshape(-1)[0])

    def global_loss(self, loss: float) -> float:
        """Mean loss over data-parallel ranks (for logging; the gradients are already synced)."""
        if self.rank.world == 1:
            return loss
        import paddle
        import paddle.distributed as dist

        value = paddle.to_tensor([loss], dtype="float32")
        dist.all_reduce(value)
        return number(value) / self.rank.world

    # ---- checkpoints ----
    def save(self, root: Path, step: int, state: dict) -> float:
        started = time.time()
        tmp = Path(root) / f"step_{step:08d}.tmp"
        if self.rank.is_main:
            ckpt.begin(root, step)
        barrier(self.rank)
        writer = self.rank.data_parallel_rank == 0
        scaler_state = dict(self.scaler.state_dict()) if self.scaler is not None else None
        if self.plan.parallel.sharding == "stage3":
            # the sliced parameters whole again on every rank (a collective of the sharding
            # group; Paddle's stage 3 holds only each rank's slice between steps)
            self.model.get_all_parameters()
        ckpt.write_shard(
            tmp,
            self.rank.shard,
            model_state=ckpt.model_state(self.model),  # canonical names, any wrapper
            optimizer_state=self.optimizer.state_dict(),  # stage 3: this rank's slices
            scaler_state=scaler_state,
            # one writer per model shard: the weights are whole on every sharding rank
            write_model=writer and self.rank.shard.sharding_rank == 0,
            write_optimizer=writer,
        )
        barrier(self.rank)
        if self.rank.is_main:
            ckpt.commit(tmp, state, keep_last=self.plan.checkpoint.keep_last)
        barrier(self.rank)
        return time.time() - started

    def restore(self, path: Path) -> None:
        model_state, optimizer_state, scaler_state = ckpt.load_shard(path, self.rank.shard)
        # every name and shape must match (an error naming them, never a skipped key)
        ckpt.load_model_state(self.model, model_state, source=str(path))
        self.optimizer.set_state_dict(optimizer_state)
        if self.scaler is not None and scaler_state is not None:
            # a plain dict from JSON; Paddle types the scaler's state as a TypedDict
            self.scaler.load_state_dict(scaler_state)  # type: ignore[arg-type]


def number(tensor: paddle.Tensor) -> int | float:
    """The value of a one-element tensor (Tensor.item() is typed float | bool | complex)."""
    value = tensor.item()
    if isinstance(value, complex):
        raise TypeError(f"a real number expected, got {value!r}")
    return value


def barrier(rank: RankInfo) -> None:
    if rank.world > 1:
        import paddle.distributed as dist

        dist.barrier()


def gather_peak_memory(
    plan: Plan, rank: RankInfo, phases: AllocatorPhases | None = None
) -> list[dict] | None:
    """Every rank's allocator figures (runner.metrics.AllocatorPhases: the whole attempt's
    peak, and per phase where `phases` recorded them), gathered to all ranks in rank order:
    [{rank, allocated_gb, reserved_gb, <phase>_allocated_gb, ...}]; None where Paddle keeps
    no allocator statistics (plain CPU)."""
    from runner.metrics import per_rank_peaks

    if phases is None:
        phases = AllocatorPhases(AllocatorProbe.for_plan(plan))
    if not phases.available:
        return None
    mine = phases.vector_gb()
    if rank.world == 1:
        return per_rank_peaks([mine])
    import paddle
    import paddle.distributed as dist

    parts: list = []
    dist.all_gather(parts, paddle.to_tensor(mine, dtype="float64"))
    return per_rank_peaks([[float(x) for x in t.numpy()] for t in parts])


def agree_on_stop(flags: list[int], rank: RankInfo) -> list[int]:
    """Every rank must stop at the same step: take the max of each flag over all ranks."""
    if rank.world == 1:
        return flags
    import paddle
    import paddle.distributed as dist

    tensor = paddle.to_tensor(flags, dtype="int32")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.numpy()]


def agree_on_data(data_dir: Path, rank: RankInfo) -> None:
    """Every node prepares the data into its own cache; all must hold the same tokens.
    Compared by content (counts, and the manifest's per-chunk hashes of every token id and
    document offset, runner.datacache), not by file names."""
    if rank.world == 1:
        return
    import paddle
    import paddle.distributed as dist

    key = content_key(data_dir)
    low = paddle.to_tensor([key], dtype="int64")
    high = paddle.to_tensor([key], dtype="int64")
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if int(number(low)) != int(number(high)):
        raise RuntimeError(
            f"rank {rank.rank} prepared other data ({data_dir}) than its peers "
            "(another corpus or tokenizer on this node); give every node the "
            "same corpus files and job.tokenizer"
        )


def agree_on_checkpoint(latest: Path | None, rank: RankInfo) -> Path | None:
    """Every rank must resume from the same step. On several nodes that needs the run
    directory on storage all nodes share; a node that sees another newest checkpoint than its
    peers (per-node disks) is refused instead of silently training from another step."""
    if rank.world == 1:
        return latest
    import paddle
    import paddle.distributed as dist

    step = ckpt.read_state(latest)["step"] if latest is not None else -1
    low = paddle.to_tensor([step], dtype="int64")
    high = paddle.to_tensor([step], dtype="int64")
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if int(number(low)) != int(number(high)):
        seen = f"step {step}" if step >= 0 else "no checkpoint"
        raise RuntimeError(
            f"rank {rank.rank} sees {seen} in {latest.parent if latest else 'its run dir'}, "
            f"other ranks see steps {int(number(low))}..{int(number(high))} (-1 = none): the run "
            "directory (job.output_dir / --output-dir) must be on storage shared by all nodes, "
            "e.g. the bucket the SkyPilot task mounts"
        )
    return latest


class StopSignal:
    """SIGTERM/SIGINT (a spot preemption notice) asks for a checkpoint at the next step end."""

    def __init__(self) -> None:
        self.received = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum


@dataclass(frozen=True)
class Stop:
    """What the stop rules decided after a step ('' = go on)."""

    reason: str = ""

    @property
    def out_of_disk(self) -> bool:
        return self.reason == STOP_DISK

    @property
    def diverged(self) -> bool:
        return self.reason == STOP_DIVERGED


@dataclass
class StopRules:
    """Every stop decision of the loop, asked once per step: a termination notice, the budget
    (would one more step, its checkpoint and shutdown cross budget.max_cost / max_hours?,
    runner.budget with measured costs), and the disk (room for the next checkpoint). Rank 0
    decides the budget and the disk, every rank its signals; all ranks agree on the result, so
    every rank stops after the same step."""

    plan: Plan
    rank: RankInfo
    meter: RunMeter
    previous_attempts: list[dict]
    root: Path
    checkpoint_bytes: int
    notice: StopSignal = dataclasses.field(default_factory=StopSignal)
    alerted: bool = False
    alerted_projection: bool = False

    def decide(self, step: int, *, checkpoint_due: bool, diverged: bool = False) -> Stop:
        flags = dict.fromkeys(STOP_ORDER, 0)
        flags[STOP_SIGNAL] = int(bool(self.notice.received))
        if self.rank.is_main and step < self.plan.training.max_steps:
            for limit in self._limits_crossed():
                flags[limit] = 1
        if (
            self.rank.is_main
            and (checkpoint_due or any(flags.values()))
            and self.checkpoint_bytes
            and free_bytes(self.root) < self.checkpoint_bytes
        ):
            flags[STOP_DISK] = 1  # stop cleanly (last good checkpoint kept), never half-write
        # the divergence guard's verdict (on the loss averaged over ranks) goes first
        *agreed, any_diverged = agree_on_stop(
            [*(flags[k] for k in STOP_ORDER), int(diverged)], self.rank
        )
        if any_diverged:
            return Stop(STOP_DIVERGED)
        if step >= self.plan.training.max_steps and not agreed[STOP_ORDER.index(STOP_DISK)]:
            return Stop()
        return Stop(next((k for k, f in zip(STOP_ORDER, agreed, strict=True) if f), ""))

    def _limits_crossed(self) -> list[str]:
        costs = budget_guard.stop_costs(
            self.plan,
            self.previous_attempts,
            step_times=[r.step_time_s for r in self.meter.records],
            checkpoint_times=self.meter.checkpoint_seconds,
        )
        crossed = budget_guard.over_limits(
            self.plan, billed_s=self.meter.billed_seconds(), needed_s=costs.total_s
        )
        self._alert()
        return crossed

    def _alert(self) -> None:
        budget = self.plan.budget
        spent = self.meter.cost_so_far()
        line = budget_guard.projection_alert(self.plan, self.meter.records)
        if line and not self.alerted_projection:
            self.alerted_projection = True
            say(line)
        if budget.max_cost > 0 and not self.alerted and spent >= budget.alert_at * budget.max_cost:
            self.alerted = True
            say(
                f"WARNING: spent {spent:.4f} {budget.currency} (measured), "
                f"{spent / budget.max_cost:.0%} of budget.max_cost "
                f"{budget.max_cost} {budget.currency}"
            )


# ---- the run ---------------------------------------------------------------------------------


def build_trainer(
    plan: Plan, data_dir: Path, rank: RankInfo, start: StartWeights | None = None
) -> Trainer[BatchSource]:
    """The rank's model, optimizer, scaler and data; `start`: a rehearsal's 1-process start
    weights (`start_weights`), None to keep the model's own initialisation."""
    data = open_prepared(data_dir)
    if data.meta["vocab_size"] > plan.model.vocab_size:
        raise RuntimeError("prepared data vocabulary exceeds model.vocab_size")
    dataset = TokenDataset(data, seq_len=plan.training.seq_len, packing=plan.training.packing)
    sampler = DeterministicSampler(
        dataset.num_samples,
        seed=plan.job.seed,
        micro_batch=plan.training.per_device_train_batch_size,
        accumulation=plan.training.gradient_accumulation_steps,
        batch_ranks=plan.parallel.batch_ranks,
    )
    model, optimizer, scaler = build_training_state(plan, start=start)
    if plan.parallel.pipeline_parallel_degree == 1:
        from runner.model import mask_padding_in_loss

        mask_padding_in_loss(model, int(data.meta["vocab_size"]))
    return Trainer(
        plan,
        rank,
        model,
        optimizer,
        scaler,
        BatchSource(dataset, sampler, rank=rank.batch_rank),
        check_update=functools.partial(check_placement, plan),
    )


def build_training_state(
    plan: Plan, *, start: StartWeights | None = None
) -> tuple[paddle.nn.Layer, paddle.optimizer.Optimizer, paddle.amp.GradScaler | None]:
    """Model, optimizer and loss scaler exactly as a run builds them (probes use this too);
    `start`: the 1-process start weights this rank takes its slice of (`start_weights`)."""
    import paddle
    from paddle.utils import unique_name

    paddle.seed(plan.job.seed)
    with unique_name.guard():  # stable parameter names -> optimizer state keys match on resume
        model = build_model(
            plan.model,
            plan.parallel,
            seq_len=plan.training.seq_len,
            use_flash_attention=plan.training.use_flash_attention,
            precision=plan.training.precision,
        )
        optimizer = build_optimizer(plan, model)
    if start is not None:
        load_slice(plan, model, start)
    if plan.parallel.sequence_parallel and plan.parallel.tensor_parallel_degree > 1:
        # as PaddleNLP's llm/run_pretrain.py does: the gradients of the parameters every
        # tensor-parallel rank holds whole (norms, biases) are partial sums over the rank's
        # sequence slice until summed over the tensor-parallel group (without it, tp + sp
        # trained GPT 1.1e-2 off the 1-process losses on the rehearsal device)
        from paddle.distributed.fleet.utils.sequence_parallel_utils import (
            register_sequence_parallel_allreduce_hooks,
        )

        register_sequence_parallel_allreduce_hooks(
            model, plan.training.gradient_accumulation_steps, False
        )
    scaler = build_scaler(plan)
    if precision.amp_level(plan.training.precision, plan.training.fp16_opt_level) == "O2":
        dtype = precision.paddle_dtype(plan.training.precision)
        model, optimizer = paddle.amp.decorate(
            models=model, optimizers=optimizer, level="O2", dtype=dtype, master_weight=True
        )
    return model, optimizer, scaler


# ---- a rehearsal's start: the 1-process weights, each rank its slice ---------------------------

START_WEIGHTS = "start_weights.safetensors"  # in the run folder (runner.checkpoint's format)


@dataclass(frozen=True)
class StartWeights:
    """The weights a 1-process run of the plan's seed starts from, under its structured names
    (numpy arrays), and the names that share a tensor ({alias: name}: GPT's lm_head is the
    word embedding)."""

    state: dict[str, np.ndarray]
    tied: dict[str, str]


def needs_start_weights(plan: Plan) -> bool:
    """A rehearsal (hardware.offer 'local') whose layout initialises its weights otherwise than
    one process of the same seed: tensor parallel (Paddle initialises each shard from its own
    random stream) and pipeline parallel (each stage builds only its layers, from its own
    stream). Data parallel and sharding build the whole model from the seed on every rank."""
    p = plan.parallel
    if plan.hardware.offer != "local":
        return False
    return p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1


def single_process_plan(plan: Plan) -> Plan:
    """The plan as one process trains it (the rehearsal's reference layout)."""
    single = dataclasses.replace(
        plan.parallel,
        tensor_parallel_degree=1,
        pipeline_parallel_degree=1,
        virtual_pp_degree=1,
        sequence_parallel=False,
        data_parallel_degree=1,
        sharding="",
        sharding_parallel_degree=1,
        nproc_per_node=1,
        nnodes=1,
    )
    return dataclasses.replace(plan, parallel=single)


def write_start_weights(plan: Plan, path: Path) -> None:
    """Build the model as one process of the plan's seed builds it and write its weights to
    `path` (safetensors, runner.checkpoint's model format; written whole or not at all)."""
    import paddle
    from paddle.utils import unique_name

    single = single_process_plan(plan)
    paddle.seed(plan.job.seed)
    with unique_name.guard():
        full = build_model(
            single.model,
            single.parallel,
            seq_len=plan.training.seq_len,
            use_flash_attention=plan.training.use_flash_attention,
            precision=plan.training.precision,
        )
    tmp = path.with_name(path.name + ".tmp")
    with guard_disk_writes(path.parent):
        ckpt.save_tensors(tmp, ckpt.untie(dict(full.state_dict())), kind="model")
        os.replace(tmp, path)


def start_weights(plan: Plan, rank: RankInfo, run_dir: Path) -> StartWeights | None:
    """A fresh rehearsal's start (`needs_start_weights`; None otherwise): global rank 0 writes
    the 1-process start weights once into the run folder (START_WEIGHTS), every rank reads
    them after a barrier and later loads its slice (`load_slice`), so every layout starts from
    the weights its 1-process reference starts from and their losses can be compared."""
    if not needs_start_weights(plan):
        return None
    path = Path(run_dir) / START_WEIGHTS
    if rank.is_main:
        write_start_weights(plan, path)
    barrier(rank)
    state = ckpt.load_tensors(path, kind="model")
    tied = dict(state.pop(ckpt.TIED_KEY, None) or {})
    return StartWeights({k: v.numpy() for k, v in state.items()}, tied)


def load_slice(plan: Plan, model: paddle.nn.Layer, start: StartWeights) -> None:
    """Load this rank's slice of `start` into its freshly built model: the tensor-parallel
    split by the family's own mappings (`tensor_parallel_slice`), the pipeline stage's layers
    by their structured names (a PaddleNLP pipeline model's state dict maps its stage's names,
    virtual stages included, back to the 1-process names). Every tensor of the rank must be
    found, in its shape: anything else is an error naming them, never a tensor left at its
    own random start."""
    state = dict(start.state)
    if plan.parallel.tensor_parallel_degree > 1:
        state = tensor_parallel_slice(plan, state)
    for alias, name in start.tied.items():  # a shared tensor: the slice of its first name
        state[alias] = state[name]
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    shapes = [
        f"{k} {list(state[k].shape)} (rank: {list(expected[k].shape)})"
        for k in expected
        if k in state and list(state[k].shape) != list(expected[k].shape)
    ]
    if missing or shapes:
        raise RuntimeError(
            f"the 1-process start weights ({START_WEIGHTS}) do not fit this rank's model: "
            f"{len(missing)} missing ({', '.join(missing[:3])}), {len(shapes)} of another shape "
            f"({'; '.join(shapes[:2])})"
        )
    weights: dict[str, Any] = {k: state[k] for k in expected}  # numpy arrays: Paddle copies them
    model.set_state_dict(weights)


def tensor_parallel_slice(plan: Plan, state: dict[str, Any]) -> dict[str, Any]:
    """This tensor-parallel rank's slice of a 1-process state dict, by the family's own
    PaddleNLP split mappings (`_get_tensor_parallel_mappings(config, is_split=True)`)."""
    from paddle.distributed import fleet

    from runner.model import _import, build_config

    spec = families.get(plan.model.family)
    config = build_config(plan.model, plan.parallel, seq_len=plan.training.seq_len)
    config.tensor_parallel_degree = plan.parallel.tensor_parallel_degree
    config.tensor_parallel_rank = fleet.get_hybrid_communicate_group().get_model_parallel_rank()
    cls = _import(spec.causal_lm_class)
    actions = cls._get_tensor_parallel_mappings(config, is_split=True)
    names = cls._resolve_prefix_keys(actions.keys(), state.keys(), ignore_error=True)
    split = {full: actions[short] for short, full in names.items()}
    return {k: (split[k](v) if k in split else v) for k, v in state.items()}


STAGE3_SEGMENT = 2**20  # Paddle's default: stage 3 slices parameters of at least this many
REHEARSAL_STAGE3_SEGMENT = 2**10  # elements; a rehearsal's shrunk model: its weight matrices too


def stage3_segment_size(plan: Plan) -> int:
    """The smallest parameter (elements) sharding stage 3 slices over its ranks; smaller ones
    every rank holds whole. A rehearsal's model is shrunk until its weights are all below
    Paddle's 2^20, where stage 3 would slice nothing and the rehearsal would not exercise the
    sliced parameters, gathers and optimizer shards of the planned run: it slices from 2^10."""
    return REHEARSAL_STAGE3_SEGMENT if plan.hardware.offer == "local" else STAGE3_SEGMENT


def distribute(trainer: Trainer[B]) -> None:
    """Wrap model/optimizer/scaler for fleet (after restoring plain state dicts)."""
    if trainer.rank.world == 1:
        return
    from paddle.distributed import fleet

    plan = trainer.plan
    if plan.parallel.sharding in ("stage2", "stage3"):
        from paddle.distributed.sharding import group_sharded_parallel

        level: Literal["os_g", "p_g_os"] = (
            "os_g" if plan.parallel.sharding == "stage2" else "p_g_os"
        )
        hcg = fleet.get_hybrid_communicate_group()
        by_name = {"sharding": hcg.get_sharding_parallel_group, "data": hcg.get_data_parallel_group}
        groups = {k: by_name[v]() for k, v in sharding_groups(plan).items()}
        trainer.model, trainer.optimizer, trainer.scaler = group_sharded_parallel(
            trainer.model,
            trainer.optimizer,
            level,
            scaler=trainer.scaler,
            group=groups["group"],
            dp_group=groups.get("dp_group"),
            segment_size=stage3_segment_size(plan),
        )
        return
    trainer.model = fleet.distributed_model(trainer.model)
    trainer.optimizer = fleet.distributed_optimizer(trainer.optimizer)
    if trainer.scaler is not None:
        trainer.scaler = fleet.distributed_scaler(trainer.scaler)


def log_line(plan: Plan, rec: StepRecord) -> str:
    cur = plan.hardware.currency
    mfu = f"MFU {rec.mfu * 100:.2f}%" if plan.hardware.peak_tflops > 0 else "MFU peak unknown"
    return (
        f"step {rec.step + 1}/{plan.training.max_steps} | loss {rec.loss:.4f} | "
        f"lr {rec.learning_rate:.2e} | {rec.step_time_s * 1000:.0f} ms/step | "
        f"{rec.tokens_per_second:,.0f} tok/s | {mfu} | "
        f"mem {rec.peak_memory_gb:.2f} GB | cost {rec.cost:.4f} {cur} | "
        f"projected {rec.projected_cost:.4f} {cur}   (all measured)"
    )


@dataclass
class Attempt:
    """One rank's attempt at the plan: what the loop carries from step to step."""

    plan: Plan
    run_dir: Path
    trainer: Trainer[BatchSource]
    meter: RunMeter
    writer: MetricsWriter
    rules: StopRules
    billing: Billing
    start_step: int
    latest: Path | None
    progress: tqdm | None = None  # rank 0's progress bar, on a terminal only
    beat: ProgressFile | None = None  # what the runner's watchdog reads (runner.watchdog)
    guard: DivergenceGuard = dataclasses.field(default_factory=DivergenceGuard)
    ignore_divergence: bool = False
    data: dict = dataclasses.field(default_factory=dict)  # runner.datacache.data_identity
    divergence: dict | None = None  # why the guard stopped the run
    last_line_at: float = dataclasses.field(default_factory=time.monotonic)  # rank 0's last line
    allocator: AllocatorPhases | None = None  # this rank's allocator figures

    @property
    def is_main(self) -> bool:
        return self.trainer.rank.is_main


def train(
    plan: Plan, *, data_dir: Path, run_dir: Path, ignore_divergence: bool | None = None
) -> dict:
    """Run (or resume) the plan on this rank; returns the result dict rank 0 also writes.
    `ignore_divergence` (default: runner.divergence.IGNORE_ENV) keeps training a diverged
    loss."""
    run = start_attempt(plan, Path(data_dir), Path(run_dir))
    run.ignore_divergence = ignoring() if ignore_divergence is None else ignore_divergence
    t = plan.training
    step, stop = run.start_step, Stop()
    last_saved = step if run.latest else -1
    while step < t.max_steps:
        loss = run_step(run, step)
        step += 1
        diverged = watch_loss(run, step, loss)
        checkpoint_due = step % plan.checkpoint.interval_steps == 0 or step == t.max_steps
        stop = run.rules.decide(step, checkpoint_due=checkpoint_due, diverged=diverged)
        if (checkpoint_due or stop.reason) and not (stop.out_of_disk or stop.diverged):
            save_checkpoint(run, step, loss)
            last_saved = step
        if stop.reason:
            if run.is_main:
                say(stop_line(run, step, stop, last_saved))
            break
    return finish(run, step, stop, last_saved)


def watch_loss(run: Attempt, step: int, loss: float) -> bool:
    """The divergence guard (runner.divergence): True when the run must stop."""
    reason = run.guard.observe(step, loss)
    if reason is None:
        return False
    if run.ignore_divergence:
        first = run.guard.streak == (1 if not math.isfinite(loss) else PATIENCE)
        if run.is_main and first:
            say(f"WARNING: {reason}; training on (--ignore-divergence)")
        return False
    run.divergence = {"step": step, "loss": loss if math.isfinite(loss) else str(loss)}
    run.divergence["reason"] = reason
    return True


def stop_line(run: Attempt, step: int, stop: Stop, last_saved: int) -> str:
    if stop.out_of_disk:
        return (
            f"stopping after step {step}: disk full, {free_bytes(run.rules.root):,} "
            f"bytes free in {run.rules.root}, a checkpoint needs about "
            f"{run.rules.checkpoint_bytes:,}; the last good checkpoint (step "
            f"{last_saved}) is kept"
        )
    if stop.diverged:
        return (
            f"stopping after step {step}: {(run.divergence or {}).get('reason', stop.reason)}; "
            "no checkpoint of the diverged model written"
        )
    return f"stopping after step {step}: {stop.reason}; checkpoint saved"


def start_attempt(plan: Plan, data_dir: Path, run_dir: Path) -> Attempt:
    """Build the rank's model and data, restore the newest checkpoint, set up meters."""
    rank = init_distributed(plan)
    agree_on_data(data_dir, rank)
    root = run_dir / "checkpoints"
    latest = agree_on_checkpoint(ckpt.latest_checkpoint(root), rank)
    start = start_weights(plan, rank, run_dir) if latest is None else None
    trainer = build_trainer(plan, data_dir, rank, start)
    notice = StopSignal()  # after importing paddle, which installs its own handlers
    signals.unblock()  # a notice that came during start-up is delivered now
    # the runner opened this attempt (runner.billing); the other nodes' time is in the bill
    billing = Billing(run_dir, nnodes=plan.parallel.nnodes)
    attempt_start = billing.attempts[-1]["start"] if billing.attempts else time.time()
    start_step, tokens_before, padded_before = 0, 0, 0
    state = None
    if latest is not None:
        state = ckpt.read_state(latest)
        trainer.restore(latest)
        start_step, tokens_before, padded_before = (
            state["step"],
            state["tokens_trained"],
            state["padded_tokens"],
        )
    distribute(trainer)
    allocator = AllocatorPhases(AllocatorProbe.for_plan(plan))
    allocator.after_build()  # the model (and restored state) as the allocator holds it
    meter = RunMeter(
        plan,
        attempt_start=attempt_start,
        previous_seconds=billing.previous_seconds(),
        tokens_before=tokens_before,
        padded_before=padded_before,
        first_step=start_step,
    )
    # Room a checkpoint needs: the previous one's size (measured), before the first one the
    # modelled size (gptplan.money.checkpoint_bytes).
    needed = ckpt.checkpoint_bytes(latest) if latest else budget_guard.checkpoint_prior_bytes(plan)
    rules = StopRules(plan, rank, meter, billing.attempts[:-1], root, needed, notice)
    run = Attempt(
        plan,
        run_dir,
        trainer,
        meter,
        MetricsWriter(run_dir, enabled=rank.is_main, first_step=start_step),
        rules,
        billing,
        start_step,
        latest,
        guard=DivergenceGuard.from_state(state),
        data=data_identity(data_dir),
        allocator=allocator,
    )
    run.beat = ProgressFile(rank.rank)
    if rank.is_main:
        _announce(run, rank)
    return run


def _announce(run: Attempt, rank: RankInfo) -> None:
    """Rank 0's first line of the attempt, and a progress bar where a person watches (launched
    ranks log to files; the bar is drawn on stderr, on a terminal only)."""
    plan, t = run.plan, run.plan.training
    resumed = f", resumed from {run.latest.name}" if run.latest else ""
    say(
        f"training {plan.name}: {t.max_steps} steps x {plan.tokens_per_step} tokens, "
        f"world size {rank.world}{resumed}"
    )
    if sys.stdout.isatty() and stderr_is_terminal():
        from tqdm import tqdm

        run.progress = tqdm(
            total=t.max_steps, initial=run.start_step, unit="step", dynamic_ncols=True
        )


def check_placement(plan: Plan, trainer: Trainer) -> None:
    """A rehearsal on the device proves a layout only if it ran there: after its first
    optimizer update (before the gradients are cleared: Trainer.check_update) and after its
    first step, every parameter, gradient, optimizer state and master weight of this rank is on
    the device, or the rank stops with one line naming what is not (a matching loss alone
    proves nothing: Paddle's CPU fallback of a missing kernel moves tensors silently; the loss
    scaler's unscale did, of fp32 gradients, until the device ran it in place)."""
    from runner.device.support import uses_device

    if not uses_device(plan):
        return
    from runner import device

    off = device.off_device(trainer.model, trainer.optimizer)
    if off:
        raise RuntimeError(
            f"{len(off)} tensor(s) of this rank left the rehearsal device in the first step "
            f"(first: {'; '.join(off[:3])}); the rehearsal proves nothing about this layout"
        )


def run_step(run: Attempt, step: int) -> float:
    """One optimizer step, measured and logged; returns the loss (mean over ranks)."""
    plan, trainer = run.plan, run.trainer
    began = time.perf_counter()
    if run.is_main and step == run.start_step:
        run.billing.note(startup_s=time.time() - run.meter.attempt_start)
    loss = trainer.global_loss(trainer.train_step(step))  # float() synchronised the device
    step_time = time.perf_counter() - began
    if run.allocator is not None:
        run.allocator.after_step(first=step == run.start_step)
    if step == run.start_step:
        check_placement(plan, trainer)
    if run.beat is not None:
        run.beat.update(step + 1, step_s=step_time)
    real, padded = trainer.batches.step_token_counts(step)
    record = run.meter.record(
        step=step,
        loss=loss,
        lr=learning_rate_at(step, plan.training),
        step_time=step_time,
        tokens=real,
        padded=padded,
        epoch=trainer.batches.sampler.epoch_at(step + 1),
    )
    if not run.is_main:
        return loss
    done = step + 1
    if run.progress is not None:
        run.progress.update(1)
        run.progress.set_postfix(
            loss=f"{loss:.3f}",
            tok_s=f"{record.tokens_per_second:,.0f}",
            cost=f"{record.cost:.4f}",
            refresh=False,
        )
    due = done % plan.training.logging_steps == 0 or done == plan.training.max_steps
    if due:
        run.writer.write(record)
    if step_line_due(plan, done, time.monotonic() - run.last_line_at):
        (run.progress.write if run.progress is not None else say)(log_line(plan, record))
        run.last_line_at = time.monotonic()
    return loss


def step_line_due(plan: Plan, done: int, quiet_s: float) -> bool:
    """Whether rank 0 prints the line of step `done` (1-based): every logging_steps and the
    last step; in a rehearsal (hardware.offer 'local', whose steps are slow here) also when
    no line came for REHEARSAL_LINE_EVERY_S, whatever the plan's logging_steps."""
    t = plan.training
    if done % t.logging_steps == 0 or done == t.max_steps:
        return True
    return plan.hardware.offer == "local" and quiet_s >= REHEARSAL_LINE_EVERY_S


def save_checkpoint(run: Attempt, step: int, loss: float) -> None:
    plan, meter = run.plan, run.meter
    state = {
        "step": step,
        "tokens_trained": meter.tokens_total,
        "padded_tokens": meter.padded_total,
        "plan_fingerprint": plan.fingerprint(),
        "trajectory": plan.trajectory(),
        "billed_seconds": meter.billed_seconds(),
        "loss": loss,
        "saved_at": time.time(),
        "data": run.data,  # the prepared corpus trained on (a resume checks it)
        **run.guard.state(),
    }
    seconds = run.trainer.save(run.rules.root, step, state)
    meter.checkpoint_seconds.append(seconds)
    if run.beat is not None:
        run.beat.update(step, checkpoint_s=seconds)
    if run.is_main:
        run.rules.checkpoint_bytes = ckpt.checkpoint_bytes(ckpt.step_dir(run.rules.root, step))
        run.billing.note(checkpoint_s=seconds)


def finish(run: Attempt, step: int, stop: Stop, last_saved: int) -> dict:
    """The attempt's result: written by rank 0 (result.json) and each node's first rank."""
    plan, meter, rank = run.plan, run.meter, run.trainer.rank
    run.writer.close()
    if run.progress is not None:
        run.progress.close()
    finished = step >= plan.training.max_steps and not (stop.out_of_disk or stop.diverged)
    result: dict[str, Any] = {
        "plan": plan.name,
        "completed_steps": step,
        "max_steps": plan.training.max_steps,
        "finished": finished,
        "stop_reason": stop.reason or ("finished" if finished else ""),
        "last_checkpoint_step": last_saved,
        "resumed_from_step": run.start_step,
        "world_size": rank.world,
        "loop_ended_at": time.time(),
        "checkpoint_bytes": run.rules.checkpoint_bytes,
        "divergence": run.divergence,
        "measured": meter.summary(),
        "last_step": asdict(meter.records[-1]) if meter.records else None,
    }
    allocator = run.allocator or AllocatorPhases(AllocatorProbe.for_plan(plan))
    allocator.finish()
    peaks = gather_peak_memory(plan, rank, allocator)  # a collective: every rank calls it
    if peaks is not None:
        result["measured"]["peak_memory_per_rank"] = peaks
        result["measured"]["allocator_method"] = allocator.probe.method
    else:
        result["measured"]["allocator_unavailable"] = allocator.probe.why_not or (
            f"no allocator statistics on {plan.hardware.device}"
        )
    if rank.is_main:
        steady = meter.steady()
        if steady:
            run.billing.note(step_s=max(r.step_time_s for r in steady))
        write_text_atomic(run.run_dir / "result.json", json.dumps(result, indent=1))
    elif rank.rank % plan.parallel.nproc_per_node == 0:  # first rank of node > 0
        node = rank.rank // plan.parallel.nproc_per_node
        write_text_atomic(node_result_file(run.run_dir, node), json.dumps(result, indent=1))
    return result


def node_result_file(run_dir: Path, node: int) -> Path:
    """Where the first rank of node `node` > 0 writes the result its node's runner reads
    (node 0's runner reads result.json, written by global rank 0)."""
    return Path(run_dir) / f"result.node{node:02d}.json"


def worker_main(argv: list[str] | None = None) -> int:
    """Entry of each launched process (see runner/_launch_entry.py)."""
    import argparse

    signals.block()  # until our handlers replace Paddle's (see runner.signals)
    parser = argparse.ArgumentParser(prog="runner-worker")
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    plan = load_plan(args.plan)
    try:
        result = train(plan, data_dir=args.data_dir, run_dir=args.run_dir)
    except UserError as exc:  # a full or unwritable run directory: one line for the runner
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_status
    # A stop for a signal exits non-zero so that launchers and schedulers see an interruption.
    interrupted = not result["finished"] and result["stop_reason"] == STOP_SIGNAL
    return signals.EXIT_SIGNALLED if interrupted else 0


if __name__ == "__main__":
    sys.exit(worker_main())
