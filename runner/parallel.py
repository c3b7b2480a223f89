"""From the plan's [parallel] and [training] tables to Paddle: fleet strategy and launch argv.

Pure functions that return data (a dict of strategy settings, an argv list), so that GPU-only
paths (tensor, pipeline, sharding, sequence parallel, fp16 O2) are checked by unit tests on a
machine without a GPU, and the launch command printed is exactly the one run.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptplan import precision
from gptplan.plan import Plan

if TYPE_CHECKING:
    from paddle.distributed import fleet

ENTRY_SCRIPT = Path(__file__).with_name("_launch_entry.py")
# paddle.distributed.launch behind an entry that makes it safe to signal at any moment
LAUNCH_MODULE = "runner.paddle_launch"


def strategy_settings(plan: Plan) -> dict:
    """The fleet.DistributedStrategy fields this plan needs (PaddleNLP's mapping)."""
    p, t = plan.parallel, plan.training
    settings: dict = {
        "hybrid_configs": {
            "dp_degree": p.data_parallel_degree,
            "mp_degree": p.tensor_parallel_degree,
            "pp_degree": p.pipeline_parallel_degree,
            "sharding_degree": p.sharding_parallel_degree,
        },
    }
    if p.pipeline_parallel_degree > 1:
        settings["pipeline_configs"] = {
            "accumulate_steps": t.gradient_accumulation_steps,
            "micro_batch_size": t.per_device_train_batch_size,
        }
        settings["hybrid_configs"]["pp_configs"] = {"delay_scale_loss": False}
        if p.virtual_pp_degree > 1:
            # the interleaved schedule: PipelineLayer(num_virtual_pipeline_stages=v), set
            # through GPTConfig.virtual_pp_degree in runner.model; recorded here for the log
            settings["virtual_pp_degree"] = p.virtual_pp_degree
    if p.tensor_parallel_degree > 1:
        settings["tensor_parallel_configs"] = {"tensor_init_seed": plan.job.seed}
        settings["hybrid_configs"]["mp_configs"] = {
            "sync_param": True,
            "sync_grad": False,
            "sync_moment": False,
        }
    if p.sharding:
        settings["sharding_stage"] = int(p.sharding[-1])
    row = precision.row(t.precision)
    if row.mixed:
        settings["amp"] = {
            "dtype": row.paddle_dtype,
            "level": t.fp16_opt_level,
            "use_dynamic_loss_scaling": row.loss_scaling,
            "init_loss_scaling": t.scale_loss if row.loss_scaling else 1.0,
        }
    if p.recompute != "none":
        settings["recompute"] = {"granularity": p.recompute}
    return settings


def sharding_groups(plan: Plan) -> dict[str, str]:
    """Which communication groups stage2/3 group-sharded training uses: always the sharding
    group; with hybrid data parallel x sharding (data_parallel_degree > 1) also the data
    group, across which the sharded gradients are all-reduced (group_sharded_parallel's
    `group` and `dp_group`)."""
    groups = {"group": "sharding"}
    if plan.parallel.sharding and plan.parallel.data_parallel_degree > 1:
        groups["dp_group"] = "data"
    return groups


def build_strategy(plan: Plan) -> fleet.DistributedStrategy:
    """A real fleet.DistributedStrategy (imports paddle)."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    settings = strategy_settings(plan)
    hybrid: Any = dict(settings["hybrid_configs"])  # Paddle types it as its own TypedDict
    strategy.hybrid_configs = hybrid
    if "pipeline_configs" in settings:
        strategy.pipeline_configs = settings["pipeline_configs"]
    if "tensor_parallel_configs" in settings:
        strategy.tensor_parallel_configs = settings["tensor_parallel_configs"]
    return strategy


def local_device_count(device: str) -> int:
    """Devices of this type on this machine (cpu: processes worth running, one per core)."""
    if device == "cpu":
        return os.cpu_count() or 1
    import paddle

    if device == "gpu":
        return paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
    if device == "xpu":
        return paddle.device.xpu.device_count() if paddle.is_compiled_with_xpu() else 0
    return 0


@dataclass(frozen=True)
class LaunchCommand:
    node_rank: int
    argv: list[str]
    env: dict[str, str]

    def render(self) -> str:
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def worker_args(plan_path: Path, data_dir: Path, run_dir: Path) -> list[str]:
    return ["--plan", str(plan_path), "--data-dir", str(data_dir), "--run-dir", str(run_dir)]


def thread_env(plan: Plan) -> dict[str, str]:
    """On CPU, split the cores between the processes so they do not oversubscribe.

    Paddle sets its math library's threads from FLAGS_paddle_num_threads (default 1) at start-up,
    overriding OMP_NUM_THREADS/MKL_NUM_THREADS: without the flag a lone process computes on one
    core of several (a 2048x2048 fp32 matmul at about half of numpy's rate on 2 cores)."""
    if plan.hardware.device != "cpu":
        return {}
    per_proc = str(max(1, (os.cpu_count() or 1) // plan.parallel.nproc_per_node))
    return {
        "OMP_NUM_THREADS": per_proc,
        "MKL_NUM_THREADS": per_proc,
        "FLAGS_paddle_num_threads": per_proc,
    }


# Paddle's rank 0 starts the job's TCP store inside fleet.init; a rank that asks for it first is
# refused and Paddle's client (tcp_utils.cc) tries again only 3 s later. Every launch of two or
# more processes on one machine lost those 3 s (rank 0 binds its port ~30 ms after the others
# knock, measured on this machine). The others now knock themselves, every 20 ms, until the store
# accepts: Paddle's first try then connects. Bounded: past STORE_WAIT_S Paddle's own retries and
# its timeout apply, as before.
STORE_WAIT_S = 120.0
STORE_POLL_S = 0.02


def store_endpoint(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The job's TCP store as paddle.distributed.parallel.init_parallel_env finds it
    (MASTER_ADDR:MASTER_PORT, else PADDLE_MASTER, else the first trainer endpoint)."""
    env = os.environ if environ is None else environ
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        endpoint = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    else:
        endpoint = env.get("PADDLE_MASTER") or env.get("PADDLE_TRAINER_ENDPOINTS", "")
        endpoint = endpoint.split(",")[0]
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def wait_for_the_store(
    timeout_s: float = STORE_WAIT_S, environ: Mapping[str, str] | None = None
) -> float:
    """On a rank other than 0, wait until the job's TCP store accepts a connection (or
    `timeout_s` passed); seconds waited. Rank 0 (it starts the store) returns at once."""
    env = os.environ if environ is None else environ
    endpoint = store_endpoint(env)
    if endpoint is None or env.get("PADDLE_TRAINER_ID", "0") in ("", "0"):
        return 0.0
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            with socket.create_connection(endpoint, timeout=1.0):
                break
        except OSError:
            time.sleep(STORE_POLL_S)
    return time.monotonic() - began


# The rehearsal device's run tag (runner/device/src/runtime.cc): every communicator a run's
# ranks make carries it, and a rank joins only its own run's, so two runs on one machine never
# share a communicator (nor /dev/shm names), whatever ports their launchers happen to pick.
DEVICE_RUN_ENV = "GPTPLAN_DEVICE_RUN"


def device_run_tag(run_dir: Path, master: str = "") -> str:
    """One run's device tag: the same on each of its nodes and attempts (its run folder, its
    master), another for any other run on this machine (runner.lock: one run per folder)."""
    return hashlib.sha256(f"{Path(run_dir).resolve()}|{master}".encode()).hexdigest()[:12]


def is_loopback(master: str) -> bool:
    host = master.rpartition(":")[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def launcher_argv(
    plan: Plan, *, nnodes: int, log_dir: Path, python: str = sys.executable
) -> list[str]:
    """`python -m runner.paddle_launch` (paddle.distributed.launch) for `nnodes` nodes of the
    plan's processes per node, on its devices; the caller adds a node's --master/--rank and
    the entry script."""
    p = plan.parallel
    argv = [
        python,
        "-m",
        LAUNCH_MODULE,
        "--nnodes",
        str(nnodes),
        "--nproc_per_node",
        str(p.nproc_per_node),
        "--log_dir",
        str(log_dir),
        # a failed rank ends the run; resuming is the runner's job, from a checkpoint
        "--max_restart",
        "0",
    ]
    from runner.device.support import uses_device

    if plan.hardware.device in ("gpu", "xpu") or uses_device(plan):
        argv += ["--devices", ",".join(str(i) for i in range(p.nproc_per_node))]
    return argv


def launch_commands(
    plan: Plan,
    *,
    plan_path: Path,
    data_dir: Path,
    run_dir: Path,
    log_dir: Path,
    master: str = "",
    python: str = sys.executable,
) -> list[LaunchCommand]:
    """One `python -m runner.paddle_launch` (paddle.distributed.launch) argv per node (node 0
    first)."""
    p = plan.parallel
    commands = []
    for node in range(p.nnodes):
        argv = launcher_argv(plan, nnodes=p.nnodes, log_dir=log_dir, python=python)
        if p.nnodes > 1:
            argv += ["--master", master or p.master or "<NODE0_IP>:8090", "--rank", str(node)]
        argv += [str(ENTRY_SCRIPT), *worker_args(plan_path, data_dir, run_dir)]
        env = thread_env(plan)
        if p.nnodes > 1 and env and is_loopback(master or p.master):
            # every "node" runs on this machine (a loopback rehearsal): they share its cores
            per_proc = max(1, (os.cpu_count() or 1) // plan.parallel.world_size)
            env = {k: str(per_proc) for k in env}
        from runner.device.support import launch_env

        device_env = launch_env(plan)  # the rehearsal device's plugin and flags
        if device_env:
            device_env[DEVICE_RUN_ENV] = device_run_tag(run_dir, master or p.master)
        env = {**env, **device_env}
        commands.append(LaunchCommand(node, argv, env))
    return commands
