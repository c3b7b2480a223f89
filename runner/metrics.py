"""Every number the runner reports is computed here: tokens/s, MFU, memory, time and money.

Cost is billed wall-clock time (including start-up and work lost to preemption, summed over
all attempts of the run) x price per node-hour x nodes: what the cloud bill says, not the
sum of step times.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gptplan import money
from gptplan.modelfacts import training_flops_per_token
from gptplan.plan import Plan

WARMUP_STEPS = 2  # steps after (re)start excluded from throughput summaries (compile, caches)


def peak_memory_gb(device: str) -> tuple[float, str]:
    """(peak GB, how it was measured): allocator peak on GPU, peak RSS of this process on CPU."""
    if device == "gpu":
        import paddle

        return paddle.device.cuda.max_memory_allocated() / 1e9, "allocator peak"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "peak RSS"


def device_peaks_gb(device: str) -> tuple[float, float] | None:
    """(allocated, reserved) peak GB of this process's GPU since start (Paddle's
    paddle.device.cuda.max_memory_allocated / max_memory_reserved: the tensors' high-water
    mark and the allocator's, cache included); None off GPU (CPU runs record peak RSS)."""
    if device != "gpu":
        return None
    import paddle

    cuda = paddle.device.cuda
    return cuda.max_memory_allocated() / 1e9, cuda.max_memory_reserved() / 1e9


CPU_ALLOCATOR_WHY_NOT = (
    "plain CPU: Paddle's CPU build keeps no allocator statistics (paddle.device."
    "max_memory_allocated raises 'not supported in CPU PaddlePaddle'); the rows carry each "
    "process's peak RSS instead"
)


@dataclass(frozen=True)
class AllocatorProbe:
    """Paddle's allocator statistics for this rank's device: on GPU paddle.device.cuda's
    memory_allocated / memory_reserved and their max_ / reset_max_ functions; on the
    rehearsal device (a custom device) the same statistics through
    paddle.base.core.device_memory_stat_{current,peak,reset_peak}_value('Allocated' |
    'Reserved', device id), what paddle.device.max_memory_allocated reads for custom
    places. Plain CPU has none (`why_not`)."""

    kind: str  # 'gpu', 'custom' or '' (none)
    device_id: int = 0
    why_not: str = ""

    @classmethod
    def for_plan(cls, plan: Plan) -> AllocatorProbe:
        from runner.device.support import uses_device

        if plan.hardware.device == "gpu":
            return cls("gpu")
        if uses_device(plan):
            import paddle

            place = paddle.get_device()  # '<type>:<id>' once the launcher selected it
            return cls("custom", int(place.rpartition(":")[2] or 0))
        return cls("", why_not=CPU_ALLOCATOR_WHY_NOT if plan.hardware.device == "cpu" else "")

    @property
    def method(self) -> str:
        if self.kind == "gpu":
            return "paddle.device.cuda.max_memory_allocated / max_memory_reserved"
        if self.kind == "custom":
            return (
                "Paddle's allocator statistics of the rehearsal device (paddle.base.core."
                "device_memory_stat_peak_value 'Allocated' / 'Reserved', as paddle.device."
                "max_memory_allocated reads them for a custom device)"
            )
        return ""

    def now_bytes(self) -> tuple[float, float]:
        return self._bytes(peak=False)

    def peak_bytes(self) -> tuple[float, float]:
        return self._bytes(peak=True)

    def _bytes(self, *, peak: bool) -> tuple[float, float]:
        """(allocated, reserved) bytes, now or at their peak since the last reset; NaN where
        the device keeps no allocator statistics."""
        if self.kind == "gpu":
            import paddle

            cuda = paddle.device.cuda
            if peak:
                return float(cuda.max_memory_allocated()), float(cuda.max_memory_reserved())
            return float(cuda.memory_allocated()), float(cuda.memory_reserved())
        if self.kind == "custom":
            from paddle.base import core

            stat = (
                core.device_memory_stat_peak_value
                if peak
                else core.device_memory_stat_current_value
            )
            return float(stat("Allocated", self.device_id)), float(stat("Reserved", self.device_id))
        return math.nan, math.nan

    def reset_peaks(self) -> None:
        if self.kind == "gpu":
            import paddle

            paddle.device.cuda.reset_max_memory_allocated()
            paddle.device.cuda.reset_max_memory_reserved()
        elif self.kind == "custom":
            from paddle.base import core

            for what in ("Allocated", "Reserved"):
                core.device_memory_stat_reset_peak_value(what, self.device_id)


# The phases a rank records, in the order of the gathered vector (allocated, reserved each):
# the build's peak and what stays allocated after it (the model, restored state), the first
# optimizer step's peak and what stays after it (+ gradients and optimizer states), and the
# peak of the later steps of the attempt (the steady step).
ALLOCATOR_PHASES = (
    "model_build_peak",
    "after_model_build",
    "first_step_peak",
    "after_first_step",
    "step_peak",
)


@dataclass
class AllocatorPhases:
    """One rank's allocator figures per phase (bytes; NaN where not measured)."""

    probe: AllocatorProbe
    values: dict[str, tuple[float, float]] = field(default_factory=dict)
    later_steps: int = 0

    @property
    def available(self) -> bool:
        return bool(self.probe.kind)

    def after_build(self) -> None:
        if self.available:
            self.values["model_build_peak"] = self.probe.peak_bytes()
            self.values["after_model_build"] = self.probe.now_bytes()
            self.probe.reset_peaks()

    def after_step(self, *, first: bool) -> None:
        if not self.available:
            return
        if first:
            self.values["first_step_peak"] = self.probe.peak_bytes()
            self.values["after_first_step"] = self.probe.now_bytes()
            self.probe.reset_peaks()
        else:
            self.later_steps += 1

    def finish(self) -> None:
        if self.available and self.later_steps:
            self.values["step_peak"] = self.probe.peak_bytes()

    def vector_gb(self) -> list[float]:
        """Whole-attempt peak, then each phase: (allocated, reserved) GB, NaN if not measured."""
        if not self.values:  # never marked: the peak since the process started
            whole = self.probe.peak_bytes()
        else:
            peaks = [self.values[k] for k in ALLOCATOR_PHASES if "peak" in k and k in self.values]
            whole = (max(a for a, _ in peaks), max(r for _, r in peaks))
        out = [whole[0] / 1e9, whole[1] / 1e9]
        for key in ALLOCATOR_PHASES:
            a, r = self.values.get(key, (math.nan, math.nan))
            out += [a / 1e9, r / 1e9]
        return out


def per_rank_peaks(gathered: list) -> list[dict]:
    """The rows report.json carries for each rank's measured allocator figures (rank = list
    position): each entry (allocated, reserved[, then per ALLOCATOR_PHASES]) in GB; a phase
    appears where it was measured."""
    rows = []
    for r, values in enumerate(gathered):
        row: dict = {"rank": r, "allocated_gb": float(values[0]), "reserved_gb": float(values[1])}
        for i, key in enumerate(ALLOCATOR_PHASES):
            pair = values[2 + 2 * i : 4 + 2 * i]
            if len(pair) == 2 and not math.isnan(float(pair[0])):
                row[f"{key}_allocated_gb"] = float(pair[0])
                row[f"{key}_reserved_gb"] = float(pair[1])
        rows.append(row)
    return rows


def mfu(
    *, flops_per_token: float, tokens_per_second: float, devices: int, peak_tflops: float
) -> float:
    """Model FLOPs utilisation, PaLM definition: achieved model FLOP/s over peak FLOP/s."""
    if peak_tflops <= 0 or devices <= 0:
        return 0.0
    return flops_per_token * tokens_per_second / (peak_tflops * 1e12 * devices)


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    learning_rate: float
    step_time_s: float
    tokens: int  # real (non-padding) label tokens in the global batch
    padded_tokens: int  # padding positions in the global batch
    tokens_per_second: float
    mfu: float
    peak_memory_gb: float
    elapsed_hours: float  # billed wall-clock hours of the run so far, all attempts
    cost: float  # billed cost so far, in the plan's currency
    projected_cost: float  # cost at max_steps at the current pace
    epoch: float


class RunMeter:
    """Accumulates step records for one attempt and turns them into the run's numbers."""

    def __init__(
        self,
        plan: Plan,
        *,
        attempt_start: float,
        previous_seconds: float,
        tokens_before: int,
        padded_before: int,
        first_step: int,
    ):
        self.plan = plan
        self.attempt_start = attempt_start
        self.previous_seconds = previous_seconds
        self.tokens_total = tokens_before
        self.padded_total = padded_before
        self.first_step = first_step
        self.records: list[StepRecord] = []
        self.flops_per_token = training_flops_per_token(plan.model, plan.training.seq_len)
        self.checkpoint_seconds: list[float] = []

    # -- money and time --
    def billed_seconds(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        return self.previous_seconds + (now - self.attempt_start)

    def cost_of_seconds(self, seconds: float) -> float:
        return money.cost(
            price_per_node_hour=self.plan.hardware.price_per_node_hour,
            nodes=self.plan.parallel.nnodes,
            seconds=seconds,
        )

    def cost_so_far(self, now: float | None = None) -> float:
        return self.cost_of_seconds(self.billed_seconds(now))

    def typical_step_seconds(self) -> float:
        """A cautious per-step time for the budget guard: the slowest of the recent steps."""
        recent = [r.step_time_s for r in self.records[-5:]]
        return max(recent) if recent else 0.0

    # -- per step --
    def record(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        step_time: float,
        tokens: int,
        padded: int,
        epoch: float,
    ) -> StepRecord:
        self.tokens_total += tokens
        self.padded_total += padded
        tps = tokens / step_time if step_time > 0 else 0.0
        peak, _ = peak_memory_gb(self.plan.hardware.device)
        cost = self.cost_so_far()
        done = step + 1
        pace = self.typical_step_seconds() or step_time
        remaining = max(0, self.plan.training.max_steps - done) * pace
        record = StepRecord(
            step=step,
            loss=loss,
            learning_rate=lr,
            step_time_s=step_time,
            tokens=tokens,
            padded_tokens=padded,
            tokens_per_second=tps,
            mfu=mfu(
                flops_per_token=self.flops_per_token,
                tokens_per_second=tps,
                devices=self.plan.parallel.world_size,
                peak_tflops=self.plan.hardware.peak_tflops,
            ),
            peak_memory_gb=peak,
            elapsed_hours=self.billed_seconds() / 3600.0,
            cost=cost,
            projected_cost=cost + self.cost_of_seconds(remaining),
            epoch=epoch,
        )
        self.records.append(record)
        return record

    def steady(self) -> list[StepRecord]:
        """Records after warm-up (all of them if the attempt was too short to drop any)."""
        steady = self.records[WARMUP_STEPS:]
        return steady or self.records

    def summary(self) -> dict:
        steady = self.steady()
        times = [r.step_time_s for r in steady]
        step_time = statistics.median(times) if times else 0.0
        tokens_per_step = statistics.median([r.tokens for r in steady]) if steady else 0
        tps = tokens_per_step / step_time if step_time else 0.0
        billed = self.billed_seconds()
        cost = self.cost_of_seconds(billed)
        peak, how = peak_memory_gb(self.plan.hardware.device)
        return {
            "steps_this_attempt": len(self.records),
            "tokens_trained": self.tokens_total,
            "padded_tokens": self.padded_total,
            "useful_token_fraction": self.tokens_total
            / max(1, self.tokens_total + self.padded_total),
            "step_time_s": step_time,
            "step_time_spread_s": (max(times) - min(times)) if times else 0.0,
            "tokens_per_second": tps,
            "mfu": mfu(
                flops_per_token=self.flops_per_token,
                tokens_per_second=tps,
                devices=self.plan.parallel.world_size,
                peak_tflops=self.plan.hardware.peak_tflops,
            ),
            "peak_memory_gb": peak,
            "peak_memory_method": how,
            "billed_hours": billed / 3600.0,
            "cost": cost,
            "currency": self.plan.hardware.currency,
            "cost_per_million_tokens": cost / self.tokens_total * 1e6 if self.tokens_total else 0.0,
            "checkpoint_seconds_median": statistics.median(self.checkpoint_seconds)
            if self.checkpoint_seconds
            else 0.0,
            "final_loss": self.records[-1].loss if self.records else None,
        }


class MetricsWriter:
    """JSON lines (one object per logged step) plus VisualDL scalars, rank 0 only."""

    def __init__(self, run_dir: Path, *, enabled: bool, first_step: int = 0):
        self.enabled = enabled
        self._vdl = None
        self._file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        drop_from_step(path, first_step)
        self._file = open(path, "a", encoding="utf-8")
        try:
            from visualdl import LogWriter

            self._vdl = LogWriter(logdir=str(run_dir / "visualdl"))
        except Exception:  # VisualDL is optional: JSON lines are the record of truth
            self._vdl = None

    def write(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        from gptplan.diskspace import guard_disk_writes

        if self._file is None:  # (an enabled writer opened its file)
            return
        with guard_disk_writes(Path(self._file.name).parent):
            self._file.write(json.dumps(asdict(record)) + "\n")
            self._file.flush()
        if self._vdl is not None:
            for key in ("loss", "learning_rate", "tokens_per_second", "mfu", "cost"):
                self._vdl.add_scalar(
                    tag=f"train/{key}", value=getattr(record, key), step=record.step
                )

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._vdl is not None:
            self._vdl.close()


def drop_from_step(path: Path, first_step: int) -> None:
    """Keep one record per step: a resumed run redoes the steps after its checkpoint, so the
    records from `first_step` on (and a line torn by a kill) are removed before it logs them
    again."""
    from gptplan.tomlconf import write_text_atomic

    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
            if record["step"] < first_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    if len(keep) != len(lines):
        write_text_atomic(path, "".join(f"{line}\n" for line in keep))
