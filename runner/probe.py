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

`--queue-dir DIR` keeps a probe worker alive across many configurations of one parallel layout, so
the ~5 s of importing Paddle and PaddleNLP and initialising fleet is paid once, not per probe:
the planner writes numbered requests into DIR, every rank runs them in order, rank 0 writes each
result. Peak memory is reset per probe (/proc/self/clear_refs), and a worker exits after any
failed probe (its state is suspect), so the planner starts a fresh one for the next request.
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
from typing import TYPE_CHECKING

from gptplan.plan import load_plan
from gptplan.tomlconf import write_text_atomic

if TYPE_CHECKING:
    from gptplan.layout import WorkerKey
    from gptplan.plan import Plan
    from runner.batches import MicroBatch
    from runner.parallel import LaunchCommand
    from runner.train import RankInfo, Trainer

FAULTS = ("", "crash", "hang")  # fault injection, for testing the classification


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vms_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux >= 4.0): a served probe reports its own peak only."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """VmHWM: the peak RSS since the last reset (or since the process started)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_memory() -> None:
    """Give the last probe's memory back to the system before the next one is measured."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
    return (
        "ResourceExhausted" in name
        or "ResourceExhaustedError" in text
        or "std::bad_alloc" in text
        or "Cannot allocate memory" in text
        or "failed to map segment" in text
    )


def _map_kernel_libraries(trainer: Trainer[SyntheticBatches]) -> None:
    """One tiny forward/backward before the memory cap: Paddle loads MKL/oneDNN lazily, and
    mapping a shared library under the cap would fail as a loader error, not as an OOM."""
    import paddle

    ids = paddle.randint(0, trainer.plan.model.vocab_size, [1, 9])
    loss, _ = trainer.model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    trainer.optimizer.clear_grad()


class SyntheticBatches:
    """Stand-in for runner.batches.BatchSource: random ids, same shapes, fixed token counts."""

    def __init__(self, plan: Plan, seed: int) -> None:
        import numpy as np

        self.plan = plan
        self.rng = np.random.default_rng(seed)

    def micro_batch(self, step: int, micro_step: int) -> MicroBatch:
        from runner.batches import MicroBatch

        t = self.plan.training
        ids = self.rng.integers(
            0, self.plan.model.vocab_size, (t.per_device_train_batch_size, t.seq_len + 1)
        )
        return MicroBatch(ids[:, :-1], ids[:, 1:], ids.shape[0] * t.seq_len, 0)


def run_probe(
    plan: Plan,
    *,
    steps: int,
    warmup: int,
    memory_limit_gb: float,
    fault: str,
    rank: RankInfo | None = None,
) -> dict:
    """Build the plan's training state and time `warmup + steps` steps; `rank` is given when
    the process (a served worker) has initialised its distributed environment already."""
    from runner.train import Trainer, build_training_state, distribute, init_distributed

    started = time.time()
    if rank is None:
        rank = init_distributed(plan)
    reset_peak_rss()
    model, optimizer, scaler = build_training_state(plan)
    trainer = Trainer(
        plan, rank, model, optimizer, scaler, SyntheticBatches(plan, plan.job.seed + rank.rank)
    )
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
    return {
        "status": "ok",
        "rank": rank.rank,
        "world_size": rank.world,
        "step_times_s": times,
        "warmup_steps": warmup,
        "step_time_s": median,
        "mean_step_time_s": statistics.fmean(measured),
        "step_time_spread": (max(measured) - min(measured)) / median if median else 0.0,
        "tokens_per_step": tokens,
        "tokens_per_second": tokens / median,
        "peak_memory_gb": peak_rss_bytes() / 1e9,
        "peak_memory_method": "peak RSS" if plan.hardware.device == "cpu" else "allocator peak",
        "wall_s": time.time() - started,
    }


def probe_command(
    plan: Plan,
    *,
    plan_path: Path,
    out: Path,
    log_dir: Path,
    steps: int,
    warmup: int,
    memory_limit_gb: float = 0.0,
    fault: str = "",
) -> LaunchCommand:
    """The argv of one probe in its own processes."""
    args = [
        "--plan",
        str(plan_path),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--memory-limit-gb",
        str(memory_limit_gb),
    ]
    if fault:
        args += ["--fault", fault]
    return _command(plan, args, log_dir)


def serve_command(plan: Plan, *, queue_dir: Path, log_dir: Path, parent_pid: int) -> LaunchCommand:
    """The argv of a probe worker for the plan's parallel layout, serving `queue_dir`."""
    return _command(plan, ["--queue-dir", str(queue_dir), "--parent-pid", str(parent_pid)], log_dir)


def _command(plan: Plan, args: list[str], log_dir: Path) -> LaunchCommand:
    """In-process module for one device, paddle.distributed.launch for several (on the
    rehearsal device for a plan on its profile: the plugin's environment and this worker's own
    run tag, so no other run's ranks share its communicators)."""
    from runner.device.support import launch_env
    from runner.parallel import (
        DEVICE_RUN_ENV,
        ENTRY_SCRIPT,
        LaunchCommand,
        device_run_tag,
        launcher_argv,
        thread_env,
    )
    from runner.supervise import machine_share_bytes, supervision_env

    # Every probe rank is supervised (runner.supervise): limited to its share of this machine
    # (a probe explores sizes the model may misjudge, so not the plan's modelled memory).
    env = supervision_env(
        Path(log_dir) / "ranks", machine_share_bytes(plan.parallel.nproc_per_node)
    )
    device_env = launch_env(plan)  # {} off the device; HardwareError when it is unavailable
    if device_env:
        env |= device_env | {DEVICE_RUN_ENV: device_run_tag(Path(log_dir))}
    if plan.parallel.world_size == 1:
        return LaunchCommand(
            0, [sys.executable, "-m", "runner.probe", *args], thread_env(plan) | env
        )
    argv = launcher_argv(plan, nnodes=1, log_dir=log_dir)
    return LaunchCommand(0, argv + [str(ENTRY_SCRIPT), "probe", *args], thread_env(plan) | env)


def device_capabilities(*, check_load: bool = False) -> dict:
    """What the rehearsal device (runner.device, docs/device.md) can run here, for the planner
    (which may import runner.probe only): {'available', 'reason', 'device_type', 'layout_kinds',
    'precisions', 'env', ...}. `env` is what a probe launched on the device needs."""
    from runner import device

    return device.capabilities(check_load=check_load)


def check_local_profile(profile: str) -> None:
    """Probes on the rehearsal device's profile need the device built and loadable here: else
    one line (HardwareError, exit 2) before any probe."""
    from gptplan.plan import REHEARSAL_PROFILE
    from runner.device.support import require_device

    if profile == REHEARSAL_PROFILE:
        require_device(key="--local-profile", instead="probe on 'cpu'")


def layout_key(plan: Plan) -> WorkerKey:
    """What a served worker fixes at start-up (fleet is initialised once): device and layout
    (gptplan.layout.Layout.worker_key)."""
    from gptplan.layout import Layout

    return Layout.from_plan(plan).worker_key(plan.hardware.device)


def request_path(queue_dir: Path, number: int) -> Path:
    return Path(queue_dir) / f"{number:06d}.request.json"


def _failure(exc: BaseException) -> dict:
    status = "oom" if is_oom(exc) else "crash"
    return {
        "status": status,
        "error": f"{type(exc).__name__}: {str(exc)[:500]}",
        "traceback_tail": traceback.format_exc().strip().splitlines()[-6:],
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    return True


def serve(queue_dir: Path, *, parent_pid: int = 0, poll_s: float = 0.01) -> int:
    """Run numbered probe requests from `queue_dir` in order until a stop request or a failure.

    A request is JSON {"plan", "out", "steps", "warmup", "fault"} or {"stop": true}; the
    planner writes it atomically after the plan file. Every rank reads the same sequence.
    The worker also ends when the planner (`parent_pid`) is gone, so none is left behind.
    """
    rank, layout, number = None, None, 0
    is_rank0 = os.environ.get("PADDLE_TRAINER_ID", "0") == "0"
    while True:
        path = request_path(queue_dir, number)
        idle_since = time.monotonic()
        checked = idle_since
        while not path.exists():
            idle = time.monotonic() - idle_since
            time.sleep(poll_s if idle < 1 else 5 * poll_s)  # idle workers barely wake
            if parent_pid and time.monotonic() - checked > 1:
                checked = time.monotonic()
                if not _alive(parent_pid):
                    return 0
        request = json.loads(path.read_text())
        if request.get("stop"):
            return 0
        plan = load_plan(Path(request["plan"]))
        try:
            if layout is not None and layout_key(plan) != layout:
                raise RuntimeError(f"worker serves layout {layout}, not {layout_key(plan)}")
            if rank is None:
                from runner.train import init_distributed

                rank, layout = init_distributed(plan), layout_key(plan)
            result = run_probe(
                plan,
                steps=request["steps"],
                warmup=request["warmup"],
                memory_limit_gb=0.0,
                fault=request.get("fault", ""),
                rank=rank,
            )
        except Exception as exc:  # classify, report, and end this worker: its state is suspect
            if is_rank0:
                write_text_atomic(Path(request["out"]), json.dumps(_failure(exc)))
            return 3
        if is_rank0:
            write_text_atomic(Path(request["out"]), json.dumps(result))
        release_memory()
        number += 1


def probe_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runner-probe", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--queue-dir",
        type=Path,
        metavar="DIR",
        help="serve numbered probe requests from DIR (one worker, many probes)",
    )
    parser.add_argument(
        "--parent-pid", type=int, default=0, help="with --queue-dir: stop when this process is gone"
    )
    parser.add_argument("--plan", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-limit-gb", type=float, default=0.0)
    parser.add_argument("--fault", choices=FAULTS, default="")
    args = parser.parse_args(argv)
    if args.queue_dir:
        return serve(args.queue_dir, parent_pid=args.parent_pid)
    if not (args.plan and args.out):
        parser.error("--plan and --out are required (or --queue-dir DIR)")
    plan = load_plan(args.plan)
    try:
        result = run_probe(
            plan,
            steps=args.steps,
            warmup=args.warmup,
            memory_limit_gb=args.memory_limit_gb,
            fault=args.fault,
        )
    except Exception as exc:  # classify, then report; the parent reads the JSON
        result = _failure(exc)
        if os.environ.get("PADDLE_TRAINER_ID", "0") == "0":
            write_text_atomic(args.out, json.dumps(result))
        return 3
    if result["rank"] == 0:
        write_text_atomic(args.out, json.dumps(result))
    return 0


if __name__ == "__main__":
    from gptplan import paddlenlp_light
    from runner.supervise import supervise

    supervise()  # memory limit, peak RSS and exit status of this rank (runner.supervise)
    paddlenlp_light.enable()  # PaddleNLP's models without the rest of it
    sys.exit(probe_main())
