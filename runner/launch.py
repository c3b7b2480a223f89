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
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from gptplan.errors import HardwareError, UserError
from gptplan.lifeline import die_with_parent
from gptplan.plan import Plan
from runner.device.support import local_precisions
from runner.parallel import LaunchCommand, local_device_count
from runner.supervise import STATUS_DIR_ENV, signal_supervised_ranks

if TYPE_CHECKING:
    from runner.watchdog import Watchdog


@dataclasses.dataclass
class GroupResult:
    """How a launched group ended."""

    rc: int = 0
    forwarded_signals: list[int] = dataclasses.field(default_factory=list)  # passed on to it
    deadline_hit: float | None = None  # when it was killed at the budget deadline
    stalled: str | None = None  # the watchdog's line, when it ended a group that stopped advancing


def run_group(
    command: LaunchCommand,
    *,
    log_file: Path | None = None,
    group_file: Path | None = None,
    deadline: float | None = None,
    watchdog: Watchdog | None = None,
) -> GroupResult:
    """Run one launch command in its own process group; pass on SIGTERM/SIGINT.

    `group_file` records the group id so operators (and tests) can end exactly this group.
    At `deadline` (time.time(), the budget's hard ceiling) the group is killed: the ranks
    stop themselves well before it, this only bounds a start-up slower than any measured.

    A termination notice reaches the ranks by two ways. The launcher gets it (its handler
    stops its pod), but `paddle.distributed.launch` starts every rank in a session of its own
    and its handler ends by raising SystemExit, which a bare `except:` inside its start-up
    code (Container._get_fd, Container.logs) can swallow: ranks it starts afterwards would
    then train to the end, unbilled. So the runner also tells every rank itself, through the
    rank supervisors of this launch (runner.supervise), including ranks that start later.

    `watchdog` (runner.watchdog.Watchdog) is asked once a second whether the ranks still
    advance; when they do not, the group and its supervised ranks are killed and its line kept.
    """
    env = dict(os.environ) | command.env
    status_dir = command.env.get(STATUS_DIR_ENV)
    result = GroupResult()
    forwarded_signals = result.forwarded_signals
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
            told.update(
                signal_supervised_ranks(Path(status_dir), signal.SIGTERM, since=started, skip=told)
            )

    def forward(signum: int, frame: FrameType | None) -> None:

        forwarded_signals.append(signum)
        tell()

    # In place before the launcher exists: a notice during Popen is passed on, not lost.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    out = open(log_file, "ab") if log_file else None
    try:
        proc = subprocess.Popen(
            command.argv,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
            stdout=out or None,
            stderr=subprocess.STDOUT if out else None,
        )
        if group_file is not None:
            record_group(group_file, proc.pid)
        if forwarded_signals:  # a notice came while the launcher was being started
            tell()
        while True:
            # Short waits: ranks that start after a notice are told too (see above).
            timeout = 0.25 if forwarded_signals else 1.0
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.time()))
            try:
                result.rc = proc.wait(timeout=timeout)
                return result
            except subprocess.TimeoutExpired:
                if forwarded_signals:
                    tell()
                if watchdog is not None and result.stalled is None and not forwarded_signals:
                    result.stalled = watchdog.check()
                    if result.stalled is not None:
                        end_group(proc.pid, status_dir)
                if deadline is not None and time.time() >= deadline:
                    result.deadline_hit = time.time()
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


def record_group(group_file: Path, pid: int) -> None:
    """Write which process group this launch is (for operators and tests), atomically; a file
    that cannot be replaced (immutable, a folder, a read-only disk) costs that record only:
    one line says so, the run goes on."""
    from gptplan.tomlconf import write_text_atomic

    text = json.dumps({"launcher_pid": pid, "process_group": pid, "runner_pid": os.getpid()})
    try:
        write_text_atomic(group_file, text)
    except (OSError, UserError) as exc:
        if group_file.is_dir():
            from runner.billing import move_damaged

            try:
                target = move_damaged(group_file, group_file.parent)
                write_text_atomic(group_file, text)
                print(f"{group_file} was a folder; moved to {target}", file=sys.stderr)
                return
            except OSError:
                pass
        print(
            f"warning: {group_file} cannot be written "
            f"({getattr(exc, 'strerror', None) or type(exc).__name__}); "
            f"the launcher's process group {pid} is not recorded there",
            file=sys.stderr,
        )


def end_group(pid: int, status_dir: str | None) -> None:
    """SIGKILL the launcher's group and the ranks its supervisors started (in sessions of their
    own), nothing else."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if status_dir:
        from runner.watchdog import end_ranks

        end_ranks(Path(status_dir))


# ---- the plan's hardware vs this machine -----------------------------------------------------


def check_hardware(plan: Plan, *, node_rank: int | None) -> None:
    """Raise HardwareError if this machine cannot run its part of the plan."""
    p, hw = plan.parallel, plan.hardware
    have = local_device_count(hw.device)
    if have < p.nproc_per_node:
        raise HardwareError(
            f"the plan needs {p.nproc_per_node} {hw.device} device(s) per node "
            f"x {p.nnodes} node(s) ({hw.profile}); this machine has {have}. "
            "Run the commands above on the planned cluster, or add --local to "
            "rehearse on this machine",
            key="parallel.nproc_per_node",
        )
    if p.nnodes > 1 and node_rank is None:
        raise HardwareError(
            f"the plan spans {p.nnodes} nodes; start it on each node with "
            "--node-rank R (commands above)",
            key="parallel.nnodes",
        )
    if hw.device == "cpu" and plan.training.precision not in local_precisions():
        raise HardwareError(
            f"{plan.training.precision!r} on CPU would run in fp32: Paddle's "
            "AMP is a no-op on CPU; use precision = 'fp32' (allowed here: "
            f"{', '.join(local_precisions())})",
            key="training.precision",
        )
