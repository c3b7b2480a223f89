"""A probe: K real training steps of a plan's configuration, measured, in this process group.

Used by the planner's autotuner. It runs the runner's own model, optimizer, precision and
distributed setup (`train.build_*`) on synthetic token ids of the right shape (so it needs no
prepared data), discards warm-up steps and reports the median step time, its spread, tokens/s
and peak memory as JSON. Failures are classified here, from exception types, and written as
structured output; the planner adds "timeout" and "killed" from the exit status:

  ok     measured
  oom    MemoryError / Paddle ResourceExhaustedError (e.g. under --memory-limit-gb)
  crash  any other exception (with the last lines of the traceback)

Multi-process probes go through paddle.distributed.launch like a run; rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

from runner.plan import load_plan
from runner.tomlconf import write_text_atomic

FAULTS = ("", "crash", "hang")  # fault injection, for testing the classification


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vms_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def limit_memory(limit_gb: float) -> None:
    """Emulate a device of `limit_gb` GB: cap the address space at (now + what is left)."""
    headroom = int(limit_gb * 1e9) - _rss_bytes()
    cap = _vms_bytes() + max(headroom, 0)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    text = str(exc)[:2000]
    # "failed to map segment": a shared library could not be mapped for lack of address space
    return "ResourceExhausted" in name or "ResourceExhaustedError" in text or \
        "std::bad_alloc" in text or "Cannot allocate memory" in text or \
        "failed to map segment" in text


def _map_kernel_libraries(trainer) -> None:
    """One tiny forward/backward before the memory cap: Paddle loads MKL/oneDNN lazily, and
    mapping a shared library under the cap would fail as a loader error, not as an OOM."""
    import paddle

    ids = paddle.randint(0, trainer.plan.model.vocab_size, [1, 9])
    loss, _ = trainer.model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    trainer.optimizer.clear_grad()


class SyntheticBatches:
    """Stand-in for runner.data.BatchSource: random ids, same shapes, fixed token counts."""

    def __init__(self, plan, seed: int):
        import numpy as np

        self.plan = plan
        self.rng = np.random.default_rng(seed)

    def micro_batch(self, step: int, micro: int):
        from runner.data import MicroBatch

        t = self.plan.training
        ids = self.rng.integers(0, self.plan.model.vocab_size,
                                (t.per_device_train_batch_size, t.seq_len + 1))
        return MicroBatch(ids[:, :-1], ids[:, 1:], ids.shape[0] * t.seq_len, 0)


def run_probe(plan, *, steps: int, warmup: int, memory_limit_gb: float, fault: str) -> dict:
    from runner.train import Trainer, build_training_state, distribute, init_distributed

    started = time.time()
    rank = init_distributed(plan)
    model, optimizer, scaler = build_training_state(plan)
    trainer = Trainer(plan, rank, model, optimizer, scaler,
                      SyntheticBatches(plan, plan.job.seed + rank.rank))
    distribute(trainer)
    if memory_limit_gb > 0:
        _map_kernel_libraries(trainer)
        limit_memory(memory_limit_gb)
    times = []
    for step in range(warmup + steps):
        if fault == "crash" and step == 1:
            raise RuntimeError("injected crash (probe --fault crash)")
        if fault == "hang" and step == 1:
            while True:
                time.sleep(1)
        began = time.perf_counter()
        trainer.train_step(step)  # float(loss) inside synchronises
        times.append(time.perf_counter() - began)
    measured = times[warmup:]
    median = statistics.median(measured)
    tokens = plan.tokens_per_step
    return {"status": "ok", "rank": rank.rank, "world_size": rank.world,
            "step_times_s": times, "warmup_steps": warmup, "step_time_s": median,
            "step_time_spread": (max(measured) - min(measured)) / median if median else 0.0,
            "tokens_per_step": tokens, "tokens_per_second": tokens / median,
            "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
            "peak_memory_method": "peak RSS" if plan.hardware.device == "cpu" else
            "allocator peak", "wall_s": time.time() - started}


def probe_command(plan, *, plan_path: Path, out: Path, log_dir: Path, steps: int,
                  warmup: int, memory_limit_gb: float = 0.0, fault: str = ""):
    """The argv of a probe: in-process module for one device, launch for several."""
    from runner.parallel import ENTRY_SCRIPT, LaunchCommand, thread_env

    args = ["--plan", str(plan_path), "--out", str(out), "--steps", str(steps),
            "--warmup", str(warmup), "--memory-limit-gb", str(memory_limit_gb)]
    if fault:
        args += ["--fault", fault]
    if plan.parallel.world_size == 1:
        return LaunchCommand(0, [sys.executable, "-m", "runner.probe", *args], {})
    p = plan.parallel
    argv = [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "1",
            "--nproc_per_node", str(p.nproc_per_node), "--log_dir", str(log_dir),
            "--max_restart", "0"]
    if plan.hardware.device in ("gpu", "xpu"):
        argv += ["--devices", ",".join(str(i) for i in range(p.nproc_per_node))]
    return LaunchCommand(0, argv + [str(ENTRY_SCRIPT), "probe", *args], thread_env(plan))


def probe_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runner-probe", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-limit-gb", type=float, default=0.0)
    parser.add_argument("--fault", choices=FAULTS, default="")
    args = parser.parse_args(argv)
    plan = load_plan(args.plan)
    try:
        result = run_probe(plan, steps=args.steps, warmup=args.warmup,
                           memory_limit_gb=args.memory_limit_gb, fault=args.fault)
    except BaseException as exc:  # classify, then report; the parent reads the JSON
        if isinstance(exc, KeyboardInterrupt):
            raise
        status = "oom" if is_oom(exc) else "crash"
        tail = traceback.format_exc().strip().splitlines()[-6:]
        result = {"status": status, "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                  "traceback_tail": tail}
        if os.environ.get("PADDLE_TRAINER_ID", "0") == "0":
            write_text_atomic(args.out, json.dumps(result))
        return 3
    if result["rank"] == 0:
        write_text_atomic(args.out, json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(probe_main())
