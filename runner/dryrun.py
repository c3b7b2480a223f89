"""`runner execute --dry-run`: the model built on this machine from the plan, its parameters
counted against the formula, partial recompute checked on the built model, the kernels and the
samples listed (runner.execute.dry_run_steps prepares the data first; nothing is written into
the run directory)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gptplan.errors import PlanError
from gptplan.plan import Plan
from runner.datacache import PreparedData

if TYPE_CHECKING:
    import paddle


def check_dry_run_memory(plan: Plan, plan_file: Path) -> None:
    """The dry run builds the whole model in fp32 on this machine: refuse sizes it cannot hold
    (checked before data preparation, so bad sizes are one line and nothing is prepared)."""
    from gptplan.modelfacts import parameter_count

    need = parameter_count(plan.model) * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > have / 2:
        raise PlanError(
            f"{parameter_count(plan.model):,} parameters need {need / 1e9:.3g} GB "
            f"to build for the dry run; this machine has {have / 1e9:.3g} GB free. "
            "Check the model.* sizes",
            file=str(plan_file),
            key="model",
        )


def check_partial_recompute(plan: Plan, net: paddle.nn.Layer, keep: list[int]) -> tuple[bool, str]:
    """The dry run's check of partial recompute (parallel.recompute_layers): the built model
    recomputes exactly the planned layers. (ok, the line to print; '' without it)."""
    from runner.model import recomputed_layers_of

    if not plan.parallel.recompute_layers or plan.parallel.recompute == "none":
        return True, ""
    L = plan.model.num_hidden_layers
    want = [i for i in range(L) if i not in keep]
    got = recomputed_layers_of(net, plan.model.family)
    if got != want:
        return False, f"the built model recomputes layers {got}, the plan {want}"
    return True, (
        f"recompute: {plan.parallel.recompute} on {len(want)} of {L} layers (PaddleNLP "
        f"no_recompute_layers holds the other {len(keep)}; checked on the built model)"
    )


def dry_run(
    plan: Plan, data: PreparedData, plan_file: Path, *, corpus_problem: str | None = None
) -> int:
    from gptplan.modelfacts import parameter_count, training_flops_per_token
    from gptplan.plan import no_recompute_layers
    from runner.batches import TokenDataset
    from runner.model import build_model, kernel_choice

    dataset = TokenDataset(data, seq_len=plan.training.seq_len, packing=plan.training.packing)
    check_dry_run_memory(plan, plan_file)
    import paddle

    paddle.set_device("cpu")
    keep = no_recompute_layers(plan.model, plan.parallel)
    net = build_model(
        plan.model,
        dataclasses.replace(
            plan.parallel,
            tensor_parallel_degree=1,
            pipeline_parallel_degree=1,
            sequence_parallel=False,
        ),
        seq_len=plan.training.seq_len,
        no_recompute=keep,
    )
    ok, words = check_partial_recompute(plan, net, keep)
    if not ok:
        print(
            f"error: {plan_file}: parallel.recompute_layers: {words} (dry run FAILED)",
            file=sys.stderr,
        )
        return 2
    if words:
        print(words)
    built = sum(int(p.numel()) for p in net.parameters())
    assert built == parameter_count(plan.model), "parameter formula out of date"
    epochs = plan.training.max_steps * plan.global_batch_size / dataset.num_samples
    print(
        f"model: {plan.model.family} {built:,} parameters (built), "
        f"{training_flops_per_token(plan.model, plan.training.seq_len):.3g} FLOPs/token"
    )
    kernels = kernel_choice(
        plan.model,
        use_flash_attention=plan.training.use_flash_attention,
        precision=plan.training.precision,
    )
    print(
        "kernels on this machine: "
        + ", ".join(f"{name} {'on' if used else 'off'}" for name, used in kernels.items())
    )
    print(
        f"samples: {dataset.num_samples:,} of {plan.training.seq_len} tokens; "
        f"{plan.training.max_steps} steps x {plan.global_batch_size} = {epochs:.2f} epochs"
    )
    if corpus_problem:  # runner.corpuscheck: a full run would refuse this corpus
        print(f"error: {plan_file}: job.corpus: {corpus_problem} (dry run FAILED)", file=sys.stderr)
        return 2
    print("dry run OK: plan, data and model are valid")
    return 0
