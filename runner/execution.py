"""What `runner execute`'s steps hand on (runner.execute): one frozen record per step.

`ExecuteRequest` is the command line, checked for types by runner.cli; `Run` is what
runner.preflight made of it (the plan to run, this node); `Resume` the newest checkpoint and
the bill, read once; `Prepared` the data and launch commands of this attempt; `Outcome` how
its training group ended. Each step takes the records it needs and returns its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gptplan.plan import Plan
from runner.billing import Billing
from runner.datacache import PreparedData
from runner.launch import GroupResult
from runner.parallel import LaunchCommand


@dataclass(frozen=True)
class ExecuteRequest:
    """`runner execute PLAN.toml [options]`, as given (runner.cli builds it from argparse)."""

    plan_file: Path
    started_at: float  # this runner process's start (billed from here)
    dry_run: bool = False
    fresh: bool = False
    accept_new_data: bool = False
    ignore_divergence: bool = False
    trust_pickled_checkpoint: bool = False  # convert a pickled checkpoint (runs its code)
    local: bool = False
    max_steps: int | None = None
    overrides: tuple[str, ...] = ()  # --set SECTION.KEY=VALUE, in order
    memory_limit_gb: float | None = None
    output_dir: str | None = None
    node_rank: int | None = None  # as given (None: node 0)
    master: str = ""
    export: bool = False
    json: bool = False
    verbose: bool = False


@dataclass(frozen=True)
class Run:
    """The checked request: the plan this runner runs (overrides, --local fitting and the
    rehearsal's run directory applied), the user's plan before fitting, and this node."""

    request: ExecuteRequest
    plan: Plan
    original: Plan  # the user's plan (--set applied), before --local fitting
    pinned: frozenset[str]  # keys --set fixed (--local does not change them)
    node_rank: int

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    @property
    def plan_file(self) -> Path:
        return self.request.plan_file

    @property
    def needs_launch(self) -> bool:
        """More than one process, or the rehearsal device (Paddle selects a custom device
        only in processes that paddle.distributed.launch starts with --devices)."""
        from runner.device.support import uses_device

        return self.plan.parallel.world_size > 1 or uses_device(self.plan)


@dataclass(frozen=True)
class Resume:
    """The newest verified checkpoint of this plan, its state.json and the bill, each read
    once (the bill is appended to as the attempt goes on)."""

    latest: Path | None
    state: dict | None  # the checkpoint's state.json (runner.checkpoint.read_state)
    billing: Billing

    @property
    def step(self) -> int:
        return int(self.state["step"]) if self.state else 0


@dataclass(frozen=True)
class Prepared:
    """This attempt's data (prepared or verified from the cache) and launch commands."""

    data: PreparedData
    log_dir: Path
    commands: tuple[LaunchCommand, ...]
    corpus_problem: str | None  # runner.corpuscheck's finding for a dry run
    prep_seconds: float  # data preparation (or its cache check) in this attempt


@dataclass(frozen=True)
class Outcome:
    """How the training group of this attempt ended."""

    rc: int
    group: GroupResult | None = None  # launched ranks (None: trained in this process)
    oom_kills_before: int = 0
