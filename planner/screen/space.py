"""The candidate space of one offer: node counts x precision x seq_len x micro-batch x tensor x
pipeline, then accumulation and sharding degrees, with Paddle's divisibility and topology
rules (gptplan.plan.LAYOUT_RULES) as hard constraints and the global batch inside the spec's
range."""

from __future__ import annotations

import dataclasses

import numpy as np

from gptplan import families
from gptplan import precision as precision_table
from gptplan.plan import (
    LAYOUT_RULES,
    RECOMPUTE_MODES,
    SHARDING_STAGES,
)
from planner.corpus.corpus_stats import CorpusStatistics
from planner.market.hardware import Offer, Profile
from planner.spec import Spec


def target_tokens(spec: Spec, stats: CorpusStatistics | None) -> float:
    if spec.job.target_tokens:
        return spec.job.target_tokens
    if stats is None:
        raise ValueError("epochs need corpus statistics")
    return spec.job.epochs * stats.total_tokens


def _grid(**dims) -> dict[str, np.ndarray]:
    names = list(dims)
    mesh = np.meshgrid(*[np.asarray(dims[n]) for n in names], indexing="ij")
    return {n: m.ravel() for n, m in zip(names, mesh)}


def _accumulations(lo: np.ndarray, hi: np.ndarray, pp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the accumulation values evaluated out of the valid range [lo, hi].

    Every value in the range is valid and searched, but the time per token never rises with
    accumulation (the bubble (m + (p-1)/v)/m and the once-per-step gradient sync shrink per
    micro-batch; memory stops growing at m = p), so within one layout the largest valid value
    is never beaten and the smallest is the smallest global batch. Both are evaluated, plus,
    for pipelines, the largest multiple of pp (the interleaved schedule's rule). Returns
    (row index, accumulation) pairs."""
    ok = np.flatnonzero(hi >= lo)
    lo, hi, pp = lo[ok], hi[ok], pp[ok]
    mult = (hi // np.maximum(pp, 1)) * pp
    # per row its three values sorted, then the repeats within the row dropped: distinct
    # (row, value) pairs in (row, value) order, linear in the rows (no sort of the pairs)
    values = np.sort(np.stack([lo, hi, np.where((pp > 1) & (mult >= lo), mult, lo)], axis=1))
    new = np.ones(values.shape, dtype=bool)
    new[:, 1:] = values[:, 1:] != values[:, :-1]
    rows = np.broadcast_to(ok[:, None], values.shape)
    return rows[new].astype(np.int64), values[new].astype(np.int64)


def layout_rules(m, gpus_per_node: int, g: dict) -> dict[str, np.ndarray]:
    """Every rule that rejects a layout (True = allowed), by name: gptplan.plan.LAYOUT_RULES,
    the rules a plan's validate checks, over the candidate columns. Each is checked against
    Paddle 3.3.1's auto_tuner (paddle/distributed/auto_tuner/prune.py) and runtime; a rule
    Paddle does not have says why (tests/test_paddle_rules.py compares the two on random
    layouts). prune.py's other rules are search heuristics, not limits (pp <= nodes when the
    user gave no candidates; pruning by the history of runs that succeeded): the planner
    prices those layouts instead. With g["acc"] absent, the accumulation rules are checked at
    the smallest accumulation that could pass (2 x pp) and applied in full once accumulation
    is known. Before the sharding degree is chosen a stage may shard over all batch ranks."""
    tp, pp = g["tp"], g["pp"]
    world = g["nodes"] * gpus_per_node
    batch_ranks = np.where(world % (tp * pp) == 0, world // np.maximum(tp * pp, 1), 0)
    columns = {
        **g,
        "acc": g.get("acc", 2 * pp),
        "world": world,
        "gpus_per_node": gpus_per_node,
        "batch_ranks": batch_ranks,
        "shard_degree": batch_ranks,
    }
    shape = np.shape(tp)
    return {r.name: np.broadcast_to(r.allows(m, columns), shape) for r in LAYOUT_RULES}


def with_vocab(spec: Spec, vocab: int) -> Spec:
    """The spec with its model's vocab_size set (padded for a tensor-parallel degree)."""
    return dataclasses.replace(spec, planned_vocab_size=vocab)


def offer_node_cap(max_nodes: int, offer: Offer) -> int:
    """Most nodes of one offer: owned machines their declared count alone (constraints.max_nodes
    caps rented offers), a rented offer constraints.max_nodes (and its own cap if stated)."""
    if offer.owned and offer.max_nodes:
        return offer.max_nodes
    return min(max_nodes, offer.max_nodes) if offer.max_nodes else max_nodes


def layout_grid(
    spec: Spec, prof: Profile, offer: Offer, precisions: list[int], tps: list[int]
) -> dict | None:
    """Every layout of one offer before accumulation, filtered by the layout rules (those
    about accumulation at the smallest value that could pass); None when an axis is empty."""
    m = spec.model_section()
    family = families.get(m.family)
    c, s = spec.constraints, spec.search
    gpn = offer.gpus_per_node
    # uneven stages are allowed (Paddle's PipelineLayer segments L layers over p stages with
    # the remainder spread, SegmentLayers.uniform): the biggest stage, ceil(L/p) layers, sets
    # time and memory. Paddle's auto_tuner (prune.py prune_by_pp) prunes L % p != 0 as a
    # search-space choice, not a limit of the runtime; published runs use such layouts.
    pps = [
        p
        for p in s.pipeline_parallel
        if p <= m.num_hidden_layers
        and (not prof.plain_cpu or p == 1)
        and (p == 1 or not family.pipeline_why_not)  # gptplan.families: pp offered?
    ]
    stages = [SHARDING_STAGES.index(z) for z in s.sharding if not prof.plain_cpu or z == ""]
    nodes = sorted({n for n in s.node_counts if n <= offer_node_cap(c.max_nodes, offer)})
    if offer.owned and offer.max_nodes:  # all the owned nodes are a layout too (e.g. 3)
        nodes = sorted(set(nodes) | {offer.max_nodes})
    if not offer.inter_node_gbits_per_s:  # unknown network: plan single-node only
        nodes = [n for n in nodes if n == 1]
    vpps = sorted(set(s.virtual_pp) | {1})
    if not (precisions and tps and pps and stages and nodes):
        return None
    g = _grid(
        nodes=nodes,
        precision_code=precisions,
        seq=c.seq_lens,
        micro=s.micro_batch_sizes,
        tp=tps,
        pp=pps,
        vpp=vpps,
        stage_code=stages,
        recompute_code=[  # the granularities the family's PaddleNLP class implements
            RECOMPUTE_MODES.index(r)
            for r in s.recompute
            if r == "none" or r in family.recompute_granularities
        ],
        sp=[int(v) for v in s.sequence_parallel],
    )
    # AMP level O1 (fp32 weights, no master weights, 16-bit weight copies: gptplan.memory
    # memory_terms `amp_o1`) for the 16-bit precisions when the spec asks for it
    g["amp_o1"] = (g["precision_code"] != precision_table.code("fp32")) & (
        spec.training.fp16_opt_level == "O1"
    )
    ok = np.logical_and.reduce(list(layout_rules(m, gpn, g).values()))
    return {k: v[ok] for k, v in g.items()}


def with_accumulations(spec: Spec, gpn: int, g: dict) -> tuple[dict, np.ndarray]:
    """The layouts with accumulation: every value meeting the global-batch range (see
    _accumulations), or search.accumulation_steps; the layout rules applied in full. Returns
    them and their batch ranks (data parallel x sharding)."""
    m, c, s = spec.model_section(), spec.constraints, spec.search
    batch_ranks = g["nodes"] * gpn // (g["tp"] * g["pp"])
    per_acc = g["micro"] * g["seq"] * batch_ranks
    if s.accumulation_steps:
        accs = np.array(sorted(set(s.accumulation_steps)))
        rows = np.repeat(np.arange(len(per_acc)), len(accs))
        acc = np.tile(accs, len(per_acc))
    else:
        lo = np.maximum(1, -(-c.global_batch_tokens_min // np.maximum(per_acc, 1)))
        lo = np.where(g["pp"] > 1, np.maximum(lo, g["pp"]), lo)
        hi = (
            c.global_batch_tokens_max // np.maximum(per_acc, 1)
            if c.global_batch_tokens_max
            else np.full(len(per_acc), max(1024, int(lo.max(initial=1))))
        )
        rows, acc = _accumulations(lo, np.minimum(hi, 4096), g["pp"])
    g = {k: v[rows] for k, v in g.items()}
    g["acc"] = acc
    batch_ranks = batch_ranks[rows]
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    ok = tokens_per_step >= c.global_batch_tokens_min
    if c.global_batch_tokens_max:
        ok &= tokens_per_step <= c.global_batch_tokens_max
    ok &= np.logical_and.reduce(list(layout_rules(m, gpn, g).values()))
    return {k: v[ok] for k, v in g.items()}, batch_ranks[ok]


def with_sharding_degrees(s, gpn: int, g: dict, batch_ranks: np.ndarray) -> tuple[dict, np.ndarray]:
    """Sharding degree and data parallel of each layout: all batch ranks, or (hybrid) the
    batch ranks inside one node with data parallel across nodes (sharding_parallel_degree <
    batch ranks); search.sharding_degrees keeps those only. Returns them and their batch
    ranks."""
    in_node = np.maximum(1, gpn // (g["tp"] * g["pp"]))
    hybrid_ok = (
        (g["stage_code"] > 0)
        & (in_node > 1)
        & (in_node < batch_ranks)
        & (batch_ranks % in_node == 0)
    )
    extra = np.flatnonzero(hybrid_ok)
    g = {k: np.concatenate([v, v[extra]]) for k, v in g.items()}
    shard_degree = np.concatenate(
        [np.where(g["stage_code"][: len(batch_ranks)] > 0, batch_ranks, 1), in_node[extra]]
    )
    batch_ranks = np.concatenate([batch_ranks, batch_ranks[extra]])
    g["shard_degree"] = shard_degree
    g["dp"] = batch_ranks // shard_degree
    if s.sharding_degrees:
        keep = (g["stage_code"] == 0) | np.isin(shard_degree, s.sharding_degrees)
        g = {k: v[keep] for k, v in g.items()}
        batch_ranks = batch_ranks[keep]
    return g, batch_ranks
