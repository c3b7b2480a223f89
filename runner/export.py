"""Export the trained model for inference with paddle.jit.save (static graph + params)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from runner import checkpoint as ckpt
from runner.errors import UserError
from runner.model import build_model
from runner.plan import Plan


def export_model(plan: Plan, run_dir: Path) -> Path:
    import paddle
    from paddle.static import InputSpec

    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    if latest is None:
        raise UserError(f"no checkpoint in {run_dir / 'checkpoints'} to export")
    if plan.parallel.tensor_parallel_degree > 1 or plan.parallel.pipeline_parallel_degree > 1:
        raise UserError("export of tensor/pipeline-parallel shards is not supported; merge "
                        "the shards first", key="parallel")
    paddle.set_device("cpu")
    single = dataclasses.replace(plan.parallel, recompute="none")
    net = build_model(plan.model, single, seq_len=plan.training.seq_len)
    state, _, _ = ckpt.load_shard(latest, ckpt.ShardId())
    net.set_state_dict(state)
    net.eval()
    prefix = run_dir / "export" / "model"
    paddle.jit.save(net, str(prefix), input_spec=[InputSpec([None, None], "int64",
                                                            name="input_ids")])
    return prefix
