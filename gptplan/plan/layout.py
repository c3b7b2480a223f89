"""The parallel layout's rules: which layouts Paddle 3.3.1 and PaddleNLP 2.8.1 run.

Each rule is written once (LAYOUT_RULES) for both readers: a plan's validation
(gptplan.plan.checks, with `layout_columns(plan)`, one row of ints) and the planner's candidate
table (numpy columns, one row per candidate). The layout itself, its fields and their names in
the plan and the table, is gptplan.layout.Layout; this module only judges it. Also PaddleNLP's
`no_recompute_layers` for a plan's partial recompute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gptplan import families
from gptplan.columns import Numbers
from gptplan.plan.schema import ModelSection, ParallelSection, Plan, divisors


def tensor_parallel_fits_node(tp: Numbers, devices_per_node: Numbers) -> Numbers:
    """Tensor parallel stays inside one node (its all-reduces run on every layer): the degree
    divides the devices of a node. The one place this rule lives."""
    return (tp <= devices_per_node) & (devices_per_node % tp == 0)


def tensor_parallel_divides(m: ModelSection, tp: Numbers) -> Numbers:
    """tp splits the heads, KV heads, hidden width, FFN (branch) width and vocabulary evenly."""
    from gptplan.modelfacts import kv_heads

    ffn = families.get(m.family).mlp_width(m)
    dims = (m.num_attention_heads, kv_heads(m), m.hidden_size, ffn, m.vocab_size)
    if getattr(tp, "ndim", 0) and tp.size and tp.dtype.kind in "iu" and tp.min() >= 1:
        import numpy as np  # the search's long column of a few values: each checked once

        once = np.array([all(x % t == 0 for x in dims) for t in range(1, int(tp.max()) + 1)])
        return once[tp - 1]
    ok: Numbers = True
    for size in dims:
        ok = (size % tp == 0) & ok
    return ok


def sequence_parallel_fits(
    micro_batch: Numbers, seq_len: Numbers, tp: Numbers, sequence_parallel: Numbers
) -> Numbers:
    """PaddleNLP scatters the b·s tokens of a micro-batch over the tensor-parallel group:
    sequence parallel needs tp > 1 and b·s divisible by tp."""
    return (sequence_parallel == 0) | ((tp > 1) & ((micro_batch * seq_len) % tp == 0))


def virtual_pipeline_fits(
    layers: Numbers, pp: Numbers, vpp: Numbers, accumulation: Numbers
) -> Numbers:
    """Paddle's interleaved schedule (fleet PipelineParallelWithInterleave, 3.3.1): pp > 2,
    layers divisible by pp x vpp (segments of whole layers), accumulation a multiple of pp and
    at least 2 x pp."""
    return (vpp == 1) | (
        (pp > 2) & (layers % (pp * vpp) == 0) & (accumulation % pp == 0) & (accumulation >= 2 * pp)
    )


@dataclass(frozen=True)
class LayoutRule:
    """A rule that rejects a parallel layout, written once for one plan (validate) and for the
    planner's candidate table (planner.screen.space.layout_rules).

    `allows(m, c)` is True where the layout is allowed; the columns `c` are ints for a plan and
    numpy arrays (one row per candidate) in the search, so a rule uses only operators both
    understand (&, |, comparisons, %): tp, pp, vpp (virtual stages), micro (batch per device),
    seq, sp (sequence parallel 0/1), acc (accumulation), stage_code (SHARDING_STAGES index),
    world (devices), gpus_per_node, batch_ranks (data x sharding parallel) and shard_degree
    (ranks a sharding stage splits the states over). `key` is the plan key a rejected plan's
    error names and `message(plan)` its text."""

    name: str
    key: str
    allows: Callable[[ModelSection, Mapping[str, Numbers]], Numbers]

    message: Callable[[Plan], str]


def _ranks_message(plan: Plan) -> str:
    p = plan.parallel
    tp, pp, dp, sd = (
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.data_parallel_degree,
        p.sharding_parallel_degree,
    )
    return (
        f"data {dp} x tensor {tp} x pipeline {pp} x sharding {sd} = {dp * tp * pp * sd} must "
        f"equal nnodes {p.nnodes} x nproc_per_node {p.nproc_per_node} = {p.world_size}"
    )


def _tp_model_message(plan: Plan) -> str:
    m, tp = plan.model, plan.parallel.tensor_parallel_degree
    sizes = (
        ("num_attention_heads", m.num_attention_heads),
        ("hidden_size", m.hidden_size),
        ("intermediate_size", m.intermediate_size),
        ("vocab_size", m.vocab_size),
    )
    for what, size in sizes:
        if size % tp:
            common = math.gcd(*(s for _, s in sizes))
            return f"{tp} does not divide model.{what} = {size}; allowed: {divisors(common)}"
    from gptplan.modelfacts import model_problem

    return model_problem(m, tp)[1]  # the key/value heads


def _sequence_parallel_message(plan: Plan) -> str:
    t, tp = plan.training, plan.parallel.tensor_parallel_degree
    if tp == 1:
        return (
            "true needs tensor_parallel_degree > 1; set it to false or raise tensor_parallel_degree"
        )
    return (
        f"true needs per_device_train_batch_size x seq_len "
        f"= {t.per_device_train_batch_size * t.seq_len} divisible by "
        f"tensor_parallel_degree = {tp} (PaddleNLP scatters the tokens over the tensor "
        "group); change the micro-batch or seq_len, or set it to false"
    )


def _interleave_message(plan: Plan) -> str:
    p, t = plan.parallel, plan.training
    pp, layers = p.pipeline_parallel_degree, plan.model.num_hidden_layers
    return (
        f"{p.virtual_pp_degree} needs (Paddle's interleaved "
        f"schedule) pipeline_parallel_degree > 2 (is {pp}), model.num_hidden_layers = "
        f"{layers} divisible by pipeline x virtual = "
        f"{pp * p.virtual_pp_degree}, and gradient_accumulation_steps = "
        f"{t.gradient_accumulation_steps} a multiple of {pp} and at least {2 * pp}; "
        "or set it to 1"
    )


# Each rule checked against Paddle 3.3.1's auto_tuner (paddle/distributed/auto_tuner/prune.py)
# and runtime; a rule Paddle does not have says why (tests/test_paddle_rules.py compares the
# two on random layouts). In the order validate reports them.
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    # prune_by_num_gpus: dp x mp x pp x sharding = devices
    LayoutRule(
        "ranks fill the devices",
        "parallel.data_parallel_degree",
        lambda m, c: c["tp"] * c["pp"] * c["batch_ranks"] == c["world"],
        _ranks_message,
    ),
    # prune_by_mp: hidden, vocabulary and heads; also FFN width (PaddleNLP's
    # ColumnParallelLinear/RowParallelLinear split it and assert divisibility) and GQA's KV
    # heads (each rank holds whole KV heads)
    LayoutRule(
        "tp divides the model",
        "parallel.tensor_parallel_degree",
        lambda m, c: tensor_parallel_divides(m, c["tp"]),
        _tp_model_message,
    ),
    # prune_by_pp prunes layers % pp != 0, a search choice: PipelineLayer's
    # SegmentLayers.uniform places uneven stages (the last L % pp one layer longer), so only
    # pp <= layers is required: every stage needs a layer
    LayoutRule(
        "pp at most the layers",
        "parallel.pipeline_parallel_degree",
        lambda m, c: c["pp"] <= m.num_hidden_layers,
        lambda plan: (
            f"{plan.parallel.pipeline_parallel_degree} stages for model.num_hidden_layers = "
            f"{plan.model.num_hidden_layers}: every stage needs a layer; allowed: 1 to "
            f"{plan.model.num_hidden_layers}"
        ),
    ),
    # prune_by_mp checks seq % tp with sequence parallel; PaddleNLP scatters the flattened
    # b x s tokens (ScatterOp on [b*s, h]), so b*s % tp is the runtime's own condition
    LayoutRule(
        "sequence parallel splits b*s",
        "parallel.sequence_parallel",
        lambda m, c: sequence_parallel_fits(c["micro"], c["seq"], c["tp"], c["sp"]),
        _sequence_parallel_message,
    ),
    # not in prune.py: tensor parallel all-reduces on every layer stay on NVLink (Paddle
    # allows mp across nodes; over the network it never wins, so it is not planned)
    LayoutRule(
        "tp inside a node",
        "parallel.tensor_parallel_degree",
        lambda m, c: tensor_parallel_fits_node(c["tp"], c["gpus_per_node"]),
        lambda plan: (
            f"{plan.parallel.tensor_parallel_degree} must divide nproc_per_node = "
            f"{plan.parallel.nproc_per_node} (tensor parallel stays inside a node); allowed: "
            f"{divisors(plan.parallel.nproc_per_node)}"
        ),
    ),
    # prune_by_vpp (pp > 2, layers % (pp x vpp), acc % pp) and the runtime's
    # PipelineParallelWithInterleave assert acc >= 2 x pp
    LayoutRule(
        "interleave",
        "parallel.virtual_pp_degree",
        lambda m, c: virtual_pipeline_fits(m.num_hidden_layers, c["pp"], c["vpp"], c["acc"]),
        _interleave_message,
    ),
    # prune_by_sharding rule 3: with pp > 1 only sharding stage 1
    LayoutRule(
        "pp with sharding stage 1 only",
        "parallel.sharding",
        lambda m, c: (c["pp"] == 1) | (c["stage_code"] < 2),
        lambda plan: (
            f"{plan.parallel.sharding!r} cannot be combined with pipeline parallel "
            "(PaddleNLP); allowed with pipeline: '', 'stage1'"
        ),
    ),
    # prune_by_sharding rule 5: a sharding stage over one rank is no sharding
    LayoutRule(
        "sharding over more than one rank",
        "parallel.sharding",
        lambda m, c: (c["stage_code"] == 0) | (c["shard_degree"] > 1),
        lambda plan: (
            f"{plan.parallel.sharding!r} with sharding_parallel_degree = 1 shards "
            "nothing; raise the degree or set sharding = ''"
        ),
    ),
    # prune_by_mbs: accumulation >= pp (fill the pipeline)
    LayoutRule(
        "pipeline filled",
        "training.gradient_accumulation_steps",
        lambda m, c: (c["pp"] == 1) | (c["acc"] >= c["pp"]),
        lambda plan: (
            f"{plan.training.gradient_accumulation_steps} micro-batches cannot fill "
            f"{plan.parallel.pipeline_parallel_degree} pipeline stages; use at least "
            f"{plan.parallel.pipeline_parallel_degree}"
        ),
    ),
)
RULES_BY_NAME = {rule.name: rule for rule in LAYOUT_RULES}


def layout_columns(plan: Plan) -> dict[str, int | str]:
    """A plan's layout as the columns LAYOUT_RULES read (one row of ints): the candidate
    table's columns of its gptplan.layout.Layout (where the names are mapped, once), and the
    devices it fills."""
    from gptplan.layout import Layout  # imports this package's vocabularies

    return {
        **Layout.from_plan(plan).search_columns(),
        "world": plan.parallel.world_size,
        "batch_ranks": plan.parallel.batch_ranks,
    }


def no_recompute_layers(m: ModelSection, p: ParallelSection) -> list[int]:
    """PaddleNLP's no_recompute_layers for the plan: every layer but the first
    recompute_layers / pp of each pipeline stage (stages as Paddle's SegmentLayers.uniform
    cuts them: the last L % pp stages one layer longer); [] when every layer recomputes."""
    if p.recompute_layers == 0 or p.recompute == "none":
        return []
    L, pp = m.num_hidden_layers, p.pipeline_parallel_degree
    per_stage = p.recompute_layers // pp
    base, extra = divmod(L, pp)
    start, keep = 0, []
    for stage in range(pp):
        size = base + (1 if stage >= pp - extra else 0)
        keep += list(range(start + per_stage, start + size))
        start += size
    return keep
