"""What Paddle 3.3.1's own sharding code allocates, computed by running that code on a
parameter list (no device, no tensors): the reference the memory model's stage-2 gradient
term is tested against (tests/test_memory_paddle.py) and the per-term table of
bench/memory_accuracy.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from gptplan.plan import ModelSection


def gpt_params(m: ModelSection, dtype_16, dtype_32):
    """The parameters PaddleNLP 2.8.1's GPTForCausalLM holds, as (name, shape, dtype), with
    paddle.amp.decorate O2's dtypes (LayerNorm weights stay fp32)."""
    h, f, v, s = m.hidden_size, m.intermediate_size, m.vocab_size, m.max_position_embeddings
    out = [("word_embeddings", (v, h), dtype_16), ("position_embeddings", (s, h), dtype_16)]
    for i in range(m.num_hidden_layers):
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += [(f"{name}_{i}.w", (h, h), dtype_16), (f"{name}_{i}.b", (h,), dtype_16)]
        out += [(f"linear1_{i}.w", (h, f), dtype_16), (f"linear1_{i}.b", (f,), dtype_16)]
        out += [(f"linear2_{i}.w", (f, h), dtype_16), (f"linear2_{i}.b", (h,), dtype_16)]
        for name in ("norm1", "norm2"):
            out += [(f"{name}_{i}.w", (h,), dtype_32), (f"{name}_{i}.b", (h,), dtype_32)]
    return out + [("norm.w", (h,), dtype_32), ("norm.b", (h,), dtype_32)]


class Param(SimpleNamespace):
    """What Paddle's sharding partition code reads of a parameter (no tensor behind it)."""

    def _numel(self) -> int:
        return int(np.prod(self.shape))


def paddle_stage2_gradient_bytes(m: ModelSection, ranks: int) -> float:
    """The gradient bytes the busiest rank holds through backward under Paddle 3.3.1's group
    sharded stage 2, computed by Paddle's own code: GroupShardedOptimizerStage2's partition
    (`_segment_params`, `dtype_rank_params`, `rank_buffer_size`) and GroupShardedStage2's
    storage size (`_rank_buffer_size`), then `_setup_use_grad_storage`'s assignment (params
    sorted by size into one GradStorage per dtype and owning rank, `can_add_grad_view`)."""
    import paddle
    from paddle.distributed.fleet.meta_parallel.sharding import (
        group_sharded_optimizer_stage2 as opt2,
    )
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage2 as st2
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_storage import (
        GradStorage,
    )

    params = [
        Param(name=n, shape=s, dtype=d, trainable=True)
        for n, s, d in gpt_params(m, paddle.bfloat16, paddle.float32)
    ]
    opt = object.__new__(opt2.GroupShardedOptimizerStage2)
    opt.__dict__.update(
        _GroupShardedOptimizerStage2__segment_params=[],
        _local_params=params,
        world_size=ranks,
        _param2rank={},
        _dtype_rank_params={},
        _rank_buffer_size={},
        _param2align={},
        _default_device="gpu",
    )
    model = SimpleNamespace(_sharding_optimizers=[opt])
    total = sum(p._numel() for p in params)
    buffer = st2.GroupShardedStage2._rank_buffer_size(model, 2**23, total)
    itemsize = {paddle.bfloat16: 2, paddle.float32: 4}

    trainable = sorted(params, key=lambda p: p._numel())  # GroupShardedStage2._fresh_trainable
    storages: dict = {}
    stored: set = set()
    for p in trainable:
        dst = opt.param2rank[p.name]
        key = (p.dtype, dst)
        if key not in storages:
            g = object.__new__(GradStorage)
            g.__dict__.update(_fill=0, _max_size=buffer[p.dtype], _param_ids=set())
            storages[key] = g
        g, align = storages[key], opt._param2align[p.name]
        if GradStorage.can_add_grad_view(g, p, align):
            g._fill += p._numel() + align  # GradStorage.add_grad's bookkeeping
            g._param_ids.add(id(p))
            stored.add(p.name)
    per_rank = []
    for r in range(ranks):
        # every storage is allocated whole (GradStorage.rebuild: paddle.zeros([max_size])):
        # its own for the whole step, the others' from forward to their reduce
        held = sum(g._max_size * itemsize[d] for (d, _), g in storages.items())
        own = [p for p in params if opt.param2rank[p.name] == r and p.name not in stored]
        held += sum(p._numel() * itemsize[p.dtype] for p in own)
        others = [p for p in params if opt.param2rank[p.name] != r and p.name not in stored]
        held += max((p._numel() * itemsize[p.dtype] for p in others), default=0)
        per_rank.append(held)
    return float(max(per_rank))
