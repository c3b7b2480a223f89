"""Starting and stopping the training processes, and adapting a plan to the local machine.

The launcher runs in its own process group (so we end exactly the processes we started, never
by name) and dies with us (PR_SET_PDEATHSIG): a killed runner never leaves training behind.
SIGTERM/SIGINT to the runner are forwarded to the group, which makes every rank checkpoint at
its next step end and exit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from gptplan.errors import HardwareError
from gptplan.lifeline import die_with_parent
from runner.parallel import LaunchCommand, local_device_count
from gptplan.plan import Plan
from runner.supervise import STATUS_DIR_ENV, signal_supervised_ranks

forwarded_signals: list[int] = []  # signals run_group passed on to its group (last run)
deadline_hit: list[float] = []      # when run_group killed its group at the budget deadline


def run_group(command: LaunchCommand, *, log_file: Path | None = None,
              group_file: Path | None = None, deadline: float | None = None) -> int:
    """Run one launch command in its own process group; pass on SIGTERM/SIGINT; return rc.

    `group_file` records the group id so operators (and tests) can end exactly this group.
    At `deadline` (time.time(), the budget's hard ceiling) the group is killed: the ranks
    stop themselves well before it, this only bounds a start-up slower than any measured.

    A termination notice reaches the ranks by two ways. The launcher gets it (its handler
    stops its pod), but `paddle.distributed.launch` starts every rank in a session of its own
    and its handler ends by raising SystemExit, which a bare `except:` inside its start-up
    code (Container._get_fd, Container.logs) can swallow: ranks it starts afterwards would
    then train to the end, unbilled. So the runner also tells every rank itself, through the
    rank supervisors of this launch (runner.supervise), including ranks that start later.
    """
    env = dict(os.environ) | command.env
    status_dir = command.env.get(STATUS_DIR_ENV)
    forwarded_signals.clear()
    deadline_hit.clear()
    proc = None
    started = time.time() - 1.0  # status records carry time.time() stamps
    told: set[int] = set()  # the launcher's pid and the supervisors this launch has told

    def tell() -> None:
        # The launcher once (a second notice makes it force-kill its ranks after 10 s,
        # whatever they are writing); each supervisor once, as it appears.
        if proc is not None and proc.pid not in told:
            told.add(proc.pid)
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # start_new_session: it leads its group
            except ProcessLookupError:
                pass
        if status_dir:
            told.update(signal_supervised_ranks(Path(status_dir), signal.SIGTERM,
                                                since=started, skip=told))

    def forward(signum, frame):
        forwarded_signals.append(signum)
        tell()

    # In place before the launcher exists: a notice during Popen is passed on, not lost.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    out = open(log_file, "ab") if log_file else None
    try:
        proc = subprocess.Popen(command.argv, env=env, start_new_session=True,
                                preexec_fn=die_with_parent(signal.SIGTERM),
                                stdout=out or None, stderr=subprocess.STDOUT if out else None)
        if group_file is not None:
            group_file.write_text(json.dumps({"launcher_pid": proc.pid,
                                              "process_group": proc.pid,
                                              "runner_pid": os.getpid()}))
        if forwarded_signals:  # a notice came while the launcher was being started
            tell()
        while True:
            # Short waits: ranks that start after a notice are told too (see above).
            timeout = 0.25 if forwarded_signals else 1.0
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.time()))
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                if forwarded_signals:
                    tell()
                if deadline is not None and time.time() >= deadline:
                    deadline_hit.append(time.time())
                    os.killpg(proc.pid, signal.SIGKILL)
                    deadline = None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc is not None:
            try:  # nothing of ours may outlive the run
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if out:
            out.close()


# ---- the plan's hardware vs this machine -----------------------------------------------------

def local_precisions() -> list[str]:
    """Precisions a CPU run really trains in: fp32 only. Paddle's AMP is a no-op on CPU
    ("amp_guard can only be enabled on CUDAPlace, XPUPlace, and CustomPlace"), so a bf16 or
    fp16 run here would be the fp32 run under another name."""
    return ["fp32"]


def check_hardware(plan: Plan, *, node_rank: int | None) -> None:
    """Raise HardwareError if this machine cannot run its part of the plan."""
    p, hw = plan.parallel, plan.hardware
    have = local_device_count(hw.device)
    if have < p.nproc_per_node:
        raise HardwareError(f"the plan needs {p.nproc_per_node} {hw.device} device(s) per node "
                            f"x {p.nnodes} node(s) ({hw.profile}); this machine has {have}. "
                            "Run the commands above on the planned cluster, or add --local to "
                            "rehearse on this machine", key="parallel.nproc_per_node")
    if p.nnodes > 1 and node_rank is None:
        raise HardwareError(f"the plan spans {p.nnodes} nodes; start it on each node with "
                            "--node-rank R (commands above)", key="parallel.nnodes")
    if hw.device == "cpu" and plan.training.precision not in local_precisions():
        raise HardwareError(f"{plan.training.precision!r} on CPU would run in fp32: Paddle's "
                            "AMP is a no-op on CPU; use precision = 'fp32' (allowed here: "
                            f"{', '.join(local_precisions())})", key="training.precision")


def localize(plan: Plan) -> tuple[Plan, list[str]]:
    """The plan rehearsed on this machine: per-device settings kept, topology shrunk.

    Keeps seq_len, micro-batch, accumulation, precision where possible and the model; moves to
    the local device type, one node, as many processes as fit, data parallel only. Price
    becomes 0: a rehearsal on your own machine is not billed at the cloud price.
    """
    import paddle

    changes: list[str] = []
    device = "gpu" if paddle.is_compiled_with_cuda() and local_device_count("gpu") else "cpu"
    nproc = min(plan.parallel.world_size, local_device_count(device))
    if device == "cpu":
        nproc = min(nproc, 2)
    par = plan.parallel
    # One node, data parallel only: tensor/pipeline/sharding layouts need the planned devices.
    new_par = dataclasses.replace(par, nnodes=1, nproc_per_node=nproc, master="",
                                  data_parallel_degree=nproc, tensor_parallel_degree=1,
                                  pipeline_parallel_degree=1, sharding="",
                                  sharding_parallel_degree=1, sequence_parallel=False)
    for f in dataclasses.fields(par):
        old, new = getattr(par, f.name), getattr(new_par, f.name)
        if old != new:
            changes.append(f"parallel.{f.name}: {old!r} -> {new!r}")
    t = plan.training
    precisions = local_precisions() if device == "cpu" else plan.hardware.precisions
    new_t = t
    if t.precision not in precisions:
        fallback = "bf16" if "bf16" in precisions and t.precision != "fp32" else "fp32"
        new_t = dataclasses.replace(t, precision=fallback,
                                    fp16_opt_level=t.fp16_opt_level if fallback != "fp32"
                                    else "O1")
        changes.append(f"training.precision: {t.precision!r} -> {fallback!r}")
    hw = plan.hardware
    new_hw = dataclasses.replace(hw, device=device, profile=f"local-{device}", offer="local",
                                 precisions=precisions, spot=False, price_per_node_hour=0.0,
                                 peak_tflops=0.0 if device != hw.device else hw.peak_tflops)
    for f in ("device", "profile", "price_per_node_hour"):
        if getattr(hw, f) != getattr(new_hw, f):
            changes.append(f"hardware.{f}: {getattr(hw, f)!r} -> {getattr(new_hw, f)!r}")
    budget = dataclasses.replace(plan.budget, max_cost=0.0)
    if plan.budget.max_cost:
        changes.append("budget.max_cost: not enforced locally (price 0)")
    from gptplan.plan import EstimateSection

    if plan.estimate.source != "none":
        changes.append("estimate: dropped (it describes the planned cluster, not this machine)")
    new_plan = dataclasses.replace(plan, parallel=new_par, training=new_t, hardware=new_hw,
                                   budget=budget, estimate=EstimateSection(),
                                   job=dataclasses.replace(plan.job, target_tokens=0))
    old_batch, new_batch = plan.global_batch_size, new_plan.global_batch_size
    if old_batch != new_batch:
        changes.append(f"global batch: {old_batch} -> {new_batch} sequences per step "
                       "(per-device settings kept)")
    return new_plan, changes
