"""Screen the whole candidate space with the cost model, vectorised, and pick the cheapest.

The space: offers x node counts x spot/on-demand x precision x seq_len x micro-batch x
accumulation x tensor x pipeline x sharding stage x recompute x sequence parallel. Paddle's
divisibility and topology rules are hard constraints; the global batch (tokens per optimizer
step) stays inside the spec's range because it changes convergence, not just speed. Data
parallel and sharding split the remaining ranks: no sharding -> all ranks data parallel;
a sharding stage -> all of them sharding ranks (PaddleNLP's usual layout).

`evaluate_space` returns a columnar `CandidateTable` (numpy arrays); ranking and the Pareto
front are pure functions of it; rendering lives in planner.report.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from gptplan.memory import GIB, MEMORY_MODEL_ERROR, layout_memory_bytes
from gptplan.money import checkpoint_bytes
from gptplan.plan import PRECISIONS, RECOMPUTE_MODES, SHARDING_STAGES
from gptplan.steptime import Device, Rates, step_time_parts
from planner import costmodel as cm
from planner import coverage, spotrisk
from planner.corpus_stats import CorpusStatistics
from planner.hardware import Offer, Profile
from planner.pricebook import PriceFacts, price_facts
from planner.spec import Spec

DIAGNOSTIC_COLUMNS = frozenset(
    {"tp_s", "pp_s", "opt_s", "bubble", "tokens_per_s_per_device", "dp_sync_s"}
)


@dataclass(frozen=True)
class OfferChoice:
    profile: Profile
    offer: Offer
    rate: float  # spec currency per offer currency
    facts: PriceFacts | None = None  # age, outlier flag, spot risk (planner.pricebook)

    @property
    def label(self) -> str:
        return f"{self.profile.name} @ {self.offer.key}"

    @property
    def price(self) -> PriceFacts:
        return self.facts if self.facts is not None else price_facts([self])[0]


@dataclass
class CandidateTable:
    """One row per candidate configuration; every column a numpy array of equal length."""

    offers: list[OfferChoice]
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    fixed_hours: float = 0.0  # paid hours that do not scale with throughput (start-up)
    params_total: float = 0.0  # the model's parameters (the interval depends on its size)
    restart_hours: float = 0.0  # from a preemption to training again
    family: str = "gpt"  # the model's family (the interval checks the published runs have it)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __getitem__(self, name: str) -> np.ndarray:
        if not self.columns:  # no candidate at all: every column is empty
            return np.zeros(0)
        return self.columns[name]

    def row(self, i: int) -> dict:
        out = {k: v[i].item() for k, v in self.columns.items()}
        choice = self.offers[out["offer"]]
        out["offer_choice"] = choice
        out["precision"] = PRECISIONS[out["precision_code"]]
        out["sharding"] = SHARDING_STAGES[out["stage_code"]]
        out["recompute"] = RECOMPUTE_MODES[out["recompute_code"]]
        out.update({k: v[0].item() for k, v in self.intervals(np.array([i])).items()})
        out["interval_outside_runs"] = self.outside_reasons(i)
        return out

    def _coverage_query(self, idx: np.ndarray) -> dict:
        return dict(
            params_billion=self.params_total / 1e9,
            family=self.family,
            world=self["world"][idx],
            tp=self["tp"][idx],
            pp=self["pp"][idx],
            seq=self["seq"][idx],
            stage=self["stage_code"][idx],
            recompute=self["recompute_code"][idx],
        )

    def outside_count(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: axes on which it lies outside its generation's published runs
        (planner.coverage) and the extra log-error per such axis."""
        n = np.zeros(len(idx), dtype=int)
        extra = np.zeros(len(idx))
        offer, prec = self["offer"][idx], self["precision_code"][idx]
        for o, p in {(int(a), int(b)) for a, b in zip(offer, prec, strict=True)}:
            cov = coverage.for_profile(self.offers[o].profile, PRECISIONS[p])
            sel = (offer == o) & (prec == p)
            if cov is None:
                continue
            axes = coverage.outside_axes(cov, **self._coverage_query(idx[sel]))
            n[sel] = coverage.outside_count(axes)
            eff = self.offers[o].profile.efficiency_for(PRECISIONS[p])
            extra[sel] = eff.extrapolation_log_error
        return n, extra

    def outside_reasons(self, i: int) -> list[str]:
        """Why row i's interval is wider than its generation's, in words ([] if it is not)."""
        row = {k: self[k][i].item() for k in ("world", "tp", "pp", "seq")}
        row |= {k: self[k][i].item() for k in ("stage_code", "recompute_code")}
        prof = self.offers[int(self["offer"][i])].profile
        precision = PRECISIONS[int(self["precision_code"][i])]
        return coverage.row_reasons(prof, precision, self.params_total, self.family, row)

    def intervals(self, idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The 80% interval (tokens_per_s/hours/cost _p10/_p90) of rows `idx` (all if None).

        Computed on demand: it depends only on each row's point estimate and its profile's
        calibration spread (planner.costmodel.interval_from_throughput), so a million-row
        table need not carry six more columns."""
        idx = np.arange(len(self)) if idx is None else np.asarray(idx, dtype=int)
        ratios = np.array(
            [
                [c.profile.efficiency_for(p).interval_ratios(self.params_total) for p in PRECISIONS]
                for c in self.offers
            ]
        )
        lo, hi = ratios[..., 0], ratios[..., 1]
        offer, prec = self["offer"][idx], self["precision_code"][idx]
        p10, p90 = coverage.widen(lo[offer, prec], hi[offer, prec], *self.outside_count(idx))
        out = cm.interval_from_throughput(
            tokens_per_s=self["tokens_per_s"][idx],
            hours=self["hours"][idx],
            fixed_hours=self.fixed_hours,
            cost=self["cost"][idx],
            p10_ratio=p10,
            p90_ratio=p90,
        )
        return out | self._risk_interval(idx, out)

    def _risk_interval(self, idx: np.ndarray, tp: dict) -> dict:
        """Hours and cost p10/p90 with the preemption rate, the preemption count and the
        price added to the throughput interval (planner.spotrisk.cost_interval)."""
        facts = [c.price for c in self.offers]
        offer, spot = self["offer"][idx], self["spot"][idx].astype(bool)
        per_offer = np.array(
            [
                [f.risk.rate, f.risk.low, f.risk.high, *f.spot_spread, *f.on_demand_spread]
                for f in facts
            ]
        ).reshape(-1, 7)[offer]
        rate = np.where(spot, per_offer[:, 0], 0.0)
        common = dict(
            train_hours=self["train_hours"][idx],
            useful=self["useful_fraction"][idx],
            rate=rate,
            nodes=self["nodes"][idx],
            interval_hours=self["checkpoint_interval_h"][idx],
            restart_hours=self.restart_hours,
            fixed_hours=self.fixed_hours,
        )
        low = spotrisk.hours_at_rate(other_rate=np.where(spot, per_offer[:, 1], 0.0), **common)
        high = spotrisk.hours_at_rate(other_rate=np.where(spot, per_offer[:, 2], 0.0), **common)
        sd = spotrisk.poisson_hours_sd(
            preemptions=self["preemptions"][idx],
            interval_hours=self["checkpoint_interval_h"][idx],
            restart_hours=self.restart_hours,
        )
        h10, h90, c10, c90 = spotrisk.cost_interval(
            cost=self["cost"][idx],
            hours=self["hours"][idx],
            hours_tp_p10=tp["hours_p10"],
            hours_tp_p90=tp["hours_p90"],
            hours_rate_low=low,
            hours_rate_high=high,
            hours_sd=sd,
            price_low_ratio=np.where(spot, per_offer[:, 3], per_offer[:, 5]),
            price_high_ratio=np.where(spot, per_offer[:, 4], per_offer[:, 6]),
        )
        return {
            "hours_p10": h10,
            "hours_p90": h90,
            "cost_p10": c10,
            "cost_p90": c90,
            "throughput_cost_p10": tp["cost_p10"],
            "throughput_cost_p90": tp["cost_p90"],
            "preemption_hours_p10": low,
            "preemption_hours_p90": high,
        }

    def select(self, mask: np.ndarray) -> CandidateTable:
        return CandidateTable(
            self.offers,
            {k: v[mask] for k, v in self.columns.items()},
            self.fixed_hours,
            self.params_total,
            self.restart_hours,
            self.family,
        )


def allowed_offers(spec: Spec, profiles: dict[str, Profile]) -> list[OfferChoice]:
    c = spec.constraints
    choices = []
    for name, prof in profiles.items():
        if c.profiles and name not in c.profiles:
            continue
        for offer in prof.offers:
            if c.offers and offer.key not in c.offers:
                continue
            if offer.kind == "on_prem" and not (c.owned_hardware or offer.key in c.offers):
                continue
            choices.append(OfferChoice(prof, offer, spec.rate(offer.currency)))
    facts = price_facts(
        choices,
        stale_after_days=c.max_price_age_days,
        preemption_override=spec.spot.preemptions_per_node_hour,
    )
    return [dataclasses.replace(ch, facts=f) for ch, f in zip(choices, facts, strict=True)]


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
    ok = hi >= lo
    mult = (hi // np.maximum(pp, 1)) * pp
    candidates = [lo, hi, np.where((pp > 1) & (mult >= lo), mult, lo)]
    r = np.concatenate([np.flatnonzero(ok)] * len(candidates))
    v = np.concatenate([c[ok] for c in candidates])
    # distinct (row, value) pairs in (row, value) order: one integer key per pair (a 1-D
    # unique, several times faster than np.unique(..., axis=1) on the stacked pairs)
    width = int(v.max(initial=0)) + 1
    keys = np.unique(r.astype(np.int64) * width + v)
    return keys // width, keys % width


def tensor_parallel_divides(m, tp):
    """tp splits the heads, KV heads, hidden width, FFN width and vocabulary evenly."""
    from gptplan.modelfacts import kv_heads

    tp = np.asarray(tp)
    dims = (m.num_attention_heads, kv_heads(m), m.hidden_size, m.intermediate_size, m.vocab_size)
    return np.logical_and.reduce([x % tp == 0 for x in dims])


def layout_rules(m, gpus_per_node: int, g: dict) -> dict[str, np.ndarray]:
    """Every rule that rejects a layout (True = allowed), by name, each checked against Paddle
    3.3.1's auto_tuner (paddle/distributed/auto_tuner/prune.py) and runtime; a rule Paddle does
    not have says why (tests/test_paddle_rules.py compares the two on random layouts).
    prune.py's other rules are search heuristics, not limits (pp <= nodes when the user gave
    no candidates; pruning by the history of runs that succeeded): the planner prices those
    layouts instead. With g["acc"] absent, the accumulation rules are checked at the smallest
    accumulation that could pass (2 x pp) and applied in full once accumulation is known."""
    from gptplan.plan import (
        sequence_parallel_fits,
        tensor_parallel_fits_node,
        virtual_pipeline_fits,
    )

    tp, pp, stage = g["tp"], g["pp"], g["stage_code"]
    world = g["nodes"] * gpus_per_node
    ranks_fit = world % (tp * pp) == 0
    batch_ranks = np.where(ranks_fit, world // np.maximum(tp * pp, 1), 0)
    acc = g.get("acc", 2 * pp)
    return {
        # prune_by_num_gpus: dp x mp x pp x sharding = devices
        "ranks fill the devices": ranks_fit,
        # prune_by_mp: hidden, vocabulary and heads; also FFN width (PaddleNLP's
        # ColumnParallelLinear/RowParallelLinear split it and assert divisibility) and GQA's KV
        # heads (each rank holds whole KV heads)
        "tp divides the model": tensor_parallel_divides(m, tp),
        # not in prune.py: tensor parallel all-reduces on every layer stay on NVLink (Paddle
        # allows mp across nodes; over the network it never wins, so it is not planned)
        "tp inside a node": tensor_parallel_fits_node(tp, gpus_per_node),
        # prune_by_mp checks seq % tp with sequence parallel; PaddleNLP scatters the flattened
        # b x s tokens (ScatterOp on [b*s, h]), so b*s % tp is the runtime's own condition
        "sequence parallel splits b*s": sequence_parallel_fits(g["micro"], g["seq"], tp, g["sp"]),
        # prune_by_pp prunes layers % pp != 0, a search choice: PipelineLayer's
        # SegmentLayers.uniform places uneven stages, so only pp <= layers is required
        "pp at most the layers": pp <= m.num_hidden_layers,
        # prune_by_sharding rule 5: a sharding stage over one rank is no sharding
        "sharding over more than one rank": ~((stage > 0) & (batch_ranks <= 1)),
        # prune_by_sharding rule 3: with pp > 1 only sharding stage 1
        "pp with sharding stage 1 only": ~((pp > 1) & (stage >= 2)),
        # prune_by_mbs: accumulation >= pp (fill the pipeline)
        "pipeline filled": ~((pp > 1) & (acc < pp)),
        # prune_by_vpp (pp > 2, layers % (pp x vpp), acc % pp) and the runtime's
        # PipelineParallelWithInterleave assert acc >= 2 x pp
        "interleave": virtual_pipeline_fits(m.num_hidden_layers, pp, g["vpp"], acc),
    }


def evaluate_offer(
    spec: Spec, choice: OfferChoice, index: int, target: float
) -> dict[str, np.ndarray]:
    """All valid candidates on one offer, evaluated. Cheap integer rules filter first."""
    return _joined(_offer_parts(spec, choice, index, target))


def _joined(parts: list[dict]) -> dict[str, np.ndarray]:
    if not parts:
        return {}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _offer_parts(spec: Spec, choice: OfferChoice, index: int, target: float) -> list[dict]:
    """evaluate_offer's rows as parts (on-demand, spot) that share the columns they have in
    common: evaluate_space copies every column once, into the whole table."""
    from gptplan.plan import tensor_parallel_fits_node

    m = spec.model_section()
    prof, offer = choice.profile, choice.offer
    c, s = spec.constraints, spec.search
    gpn = offer.gpus_per_node
    precisions = [PRECISIONS.index(p) for p in c.precisions if p in prof.precisions]
    tps = [
        t
        for t in s.tensor_parallel
        if tensor_parallel_fits_node(t, gpn) and tensor_parallel_divides(m, t)
    ]
    if prof.device == "cpu":
        tps = [1]
    # uneven stages are allowed (Paddle's PipelineLayer segments L layers over p stages with
    # the remainder spread, SegmentLayers.uniform): the biggest stage, ceil(L/p) layers, sets
    # time and memory. Paddle's auto_tuner (prune.py prune_by_pp) prunes L % p != 0 as a
    # search-space choice, not a limit of the runtime; published runs use such layouts.
    pps = [
        p
        for p in s.pipeline_parallel
        if p <= m.num_hidden_layers and (prof.device != "cpu" or p == 1)
    ]
    stages = [SHARDING_STAGES.index(z) for z in s.sharding if prof.device != "cpu" or z == ""]
    nodes = sorted({n for n in s.node_counts if n <= c.max_nodes})
    if not offer.inter_node_gbits_per_s:  # unknown network: plan single-node only
        nodes = [n for n in nodes if n == 1]
    vpps = sorted(set(s.virtual_pp) | {1})
    if not (precisions and tps and pps and stages and nodes):
        return []
    g = _grid(
        nodes=nodes,
        precision_code=precisions,
        seq=c.seq_lens,
        micro=s.micro_batch_sizes,
        tp=tps,
        pp=pps,
        vpp=vpps,
        stage_code=stages,
        recompute_code=[RECOMPUTE_MODES.index(r) for r in s.recompute],
        sp=[int(v) for v in s.sequence_parallel],
    )
    ok = np.logical_and.reduce(list(layout_rules(m, gpn, g).values()))
    g = {k: v[ok] for k, v in g.items()}
    batch_ranks = g["nodes"] * gpn // (g["tp"] * g["pp"])
    # accumulation: every value meeting the global-batch range (see _accumulations)
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
    g = {k: v[ok] for k, v in g.items()}
    batch_ranks = batch_ranks[ok]
    if not len(g["nodes"]):
        return []
    # sharding degree: all batch ranks, or (hybrid) the batch ranks inside one node with data
    # parallel across nodes (sharding_parallel_degree < batch ranks)
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
        if not len(batch_ranks):
            return []
    g["flash"] = np.full(len(batch_ranks), 0)
    if s.flash_attention and prof.flash_attention and m.hidden_size // m.num_attention_heads <= 256:
        g["flash"] = (g["precision_code"] > 0).astype(int)  # fp16/bf16 only
    out = evaluate_layouts(m, prof, offer, g, memory_headroom=c.memory_headroom)
    out["offer"] = np.full(len(out["nodes"]), index)
    steps = np.ceil(target / out["tokens_per_step"])
    out["steps"] = steps
    out["train_hours"] = steps * out["step_time_s"] / 3600
    return _price(spec, choice, cm.ModelShape.from_section(m), out)


def evaluate_layouts(
    m,
    prof: Profile,
    offer: Offer,
    g: dict,
    *,
    efficiency=None,
    overlap=None,
    memory_headroom: float = 0.9,
) -> dict[str, np.ndarray]:
    """The cost model on explicit layouts (one row per entry of the columns in `g`: nodes,
    precision_code, seq, micro, acc, tp, pp, vpp, stage_code, shard_degree, dp,
    recompute_code, sp, flash). Returns per-row memory, step time and its parts, tokens/s and
    MFU. Step time is gptplan.steptime.step_time_parts, the one composition the fit and the
    runner use too. `efficiency` overrides the profile's fitted constants per precision;
    `overlap` the share of gradient sync hidden behind compute.

    Memory: a row over the usable limit (memory_gb x memory_headroom) by less than the memory
    model's own error (gptplan.memory.MEMORY_MODEL_ERROR) is kept as `may_fit` (the probe
    settles it) instead of being cut at 100% of a point estimate.
    """
    shape = cm.ModelShape.from_section(m)
    gpn = offer.gpus_per_node
    g = {k: np.asarray(v) for k, v in g.items()}
    world = g["nodes"] * gpn
    batch_ranks = g["dp"] * g["shard_degree"]
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    eff = prof.efficiency  # framework constants (memory overhead, comm overlap)
    per_precision = [prof.efficiency_for(p) for p in PRECISIONS]
    if efficiency is not None:
        per_precision = [efficiency] * len(PRECISIONS)

    def by_precision(attr: str) -> np.ndarray:
        return np.array([getattr(e, attr) for e in per_precision])[g["precision_code"]]

    mem = layout_memory_bytes(
        shape, g, overhead_gb=eff.memory_overhead_gb, fragmentation=eff.fragmentation
    )
    limit = prof.memory_gb * GIB * memory_headroom
    may_fit = (mem > limit) & (mem <= limit * (1.0 + MEMORY_MODEL_ERROR))

    peak = np.array([prof.peak_for(p) for p in PRECISIONS])[g["precision_code"]] * 1e12
    inter = offer.inter_node_gbits_per_s / 8 * 1e9 if offer.inter_node_gbits_per_s else 1.0
    dev = Device(
        peak,
        prof.sm_count,
        prof.memory_bandwidth_gbytes_per_s * 1e9,
        prof.intra_node_gbytes_per_s * 1e9,
        inter,
        gpn,
    )
    rates = Rates(
        by_precision("max"),
        by_precision("kernel_overhead_us") * 1e-6,
        eff.comm_overlap if overlap is None else overlap,
        by_precision("attention_relative"),
        by_precision("half_tokens"),
        by_precision("half_hidden"),
        by_precision("rolloff_tokens"),
    )
    parts = step_time_parts(shape, g, dev, rates)
    step_time = parts["step_time_s"]
    tokens_per_s = tokens_per_step / step_time
    f_model = cm.model_flops_per_token(m, g["seq"])
    mfu = f_model * tokens_per_s / (world * peak)
    n = len(step_time)
    return {
        "nodes": g["nodes"],
        "gpus_per_node": np.full(n, gpn),
        "world": world,
        "precision_code": g["precision_code"],
        "seq": g["seq"],
        "micro": g["micro"],
        "acc": g["acc"],
        "tp": g["tp"],
        "pp": g["pp"],
        "vpp": g["vpp"],
        "dp": g["dp"],
        "shard_degree": g["shard_degree"],
        "stage_code": g["stage_code"],
        "recompute_code": g["recompute_code"],
        "sp": g["sp"],
        "flash": g["flash"],
        "tokens_per_step": tokens_per_step,
        "memory_gb": mem / cm.GB,
        "fits": (mem <= limit) | may_fit,
        "may_fit": may_fit,
        "efficiency": parts["efficiency"],
        "hidden_per_tp": m.hidden_size / g["tp"],
        "step_time_s": step_time,
        "compute_s": parts["compute_s"],
        "comm_s": parts["comm_s"],
        "dp_sync_s": parts["dp_sync_s"],
        "tp_s": parts["tp_s"],
        "pp_s": parts["pp_s"],
        "opt_s": parts["opt_s"],
        "bubble": parts["bubble"],
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / world,
        "mfu": mfu,
    }


def _hours(rows: dict, checkpoint_hours, spot_rate: float, sp) -> tuple:
    """(paid hours, checkpoint interval, useful fraction, expected preemptions) at a spot
    interruption rate per node-hour (0 = on-demand: checkpoints at the fixed interval)."""
    n = len(rows["nodes"])
    failures = rows["nodes"] * spot_rate
    interval = (
        cm.young_daly_interval_hours(checkpoint_hours, failures)
        if spot_rate
        else np.full(n, sp.on_demand_checkpoint_hours)
    )
    useful = cm.useful_fraction(checkpoint_hours, interval, failures, sp.restart_minutes / 60)
    running = rows["train_hours"] / useful
    preemptions = spotrisk.expected_preemptions(
        nodes=rows["nodes"], rate_per_node_hour=spot_rate, running_hours=running
    )
    return running + sp.startup_minutes / 60, interval, useful, preemptions


def may_fit_note(memory_gb: float, prof: Profile, memory_headroom: float) -> str:
    """The flag a user sees on a row kept inside the memory model's own error."""
    return (
        f"may fit (modelled {memory_gb * cm.GB / 2**30:.1f} GiB of "
        f"{prof.memory_gb * memory_headroom * GIB / 2**30:.1f} GiB usable, "
        f"+-{MEMORY_MODEL_ERROR:.0%} model error): probe it before a long run"
    )


def _price(spec: Spec, choice: OfferChoice, shape: cm.ModelShape, rows: dict) -> list[dict]:
    """Duplicate rows for spot and on-demand and add time, money and energy. Spot rows carry
    their expected preemptions (the offer's interruption rate, planner.pricebook) and what the
    same plan costs on-demand; with spot.fallback_wait_hours they are priced as spot with
    on-demand fallback (the provider's chance that spot cannot be had)."""
    offer, prof, sp = choice.offer, choice.profile, spec.spot
    modes = []
    if spec.constraints.on_demand or offer.kind == "on_prem":
        modes.append(False)
    if spec.constraints.spot and offer.has_spot:
        modes.append(True)
    parts = []
    checkpoint_hours = cm.checkpoint_write_hours(
        state_bytes=checkpoint_bytes(
            shape.params_total,
            master_weights=((rows["precision_code"] > 0) & (spec.training.fp16_opt_level == "O2")),
        ),
        nodes=rows["nodes"],
        node_gbytes_per_s=sp.checkpoint_gbytes_per_s,
        storage_cap_gbytes_per_s=offer.storage_gbytes_per_s,
    )
    od_price = offer.node_price_per_hour(spot=False, tdp_w=prof.tdp_w) * choice.rate
    od_hours = _hours(rows, checkpoint_hours, 0.0, sp)[0]
    risk = choice.price.risk
    for spot in modes:
        r = dict(rows)
        n = len(r["nodes"])
        hours, interval, useful, preemptions = _hours(
            rows, checkpoint_hours, risk.rate if spot else 0.0, sp
        )
        price = offer.node_price_per_hour(spot=spot, tdp_w=prof.tdp_w) * choice.rate
        cost = price * r["nodes"] * hours
        cost_od = od_price * r["nodes"] * od_hours
        if spot and sp.fallback_wait_hours > 0 and od_price > 0:
            p = risk.unavailable_probability  # expected cost; the deadline must hold either way
            cost = (1 - p) * cost + p * cost_od
            hours = np.maximum(hours, od_hours + sp.fallback_wait_hours)
            price = cost / (r["nodes"] * hours)
            preemptions = (1 - p) * preemptions
        r["spot"] = np.full(n, spot)
        r["useful_fraction"] = useful
        r["checkpoint_interval_h"] = interval
        r["hours"] = hours
        r["price_node_hour"] = np.broadcast_to(price, (n,)).astype(float)
        r["cost"] = cost
        r["cost_on_demand"] = cost_od if od_price > 0 else np.full(n, np.nan)
        r["preemptions"] = preemptions
        r["energy_kwh"] = (
            r["world"] * prof.tdp_w * hours / 1000 * (offer.pue if offer.kind == "on_prem" else 1.0)
        )
        parts.append(r)
    return parts


def evaluate_space(spec: Spec, offers: list[OfferChoice], target: float) -> CandidateTable:
    # every offer's parts (on-demand, spot), joined once into the whole table: one copy of
    # each column; diagnostics of single evaluations (planner explain, the published-run
    # fit) stay out of the big table: concatenating a million rows is memory-bound
    tables = [
        {k: v for k, v in part.items() if k not in DIAGNOSTIC_COLUMNS}
        for i, choice in enumerate(offers)
        for part in _offer_parts(spec, choice, i, target)
    ]
    params = float(cm.ModelShape.from_section(spec.model_section()).params_total)
    family = spec.model_section().family
    if not tables:
        return CandidateTable(
            offers,
            {},
            spec.spot.startup_minutes / 60,
            params,
            spec.spot.restart_minutes / 60,
            family,
        )
    columns = {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}
    columns["cost_per_million_tokens"] = columns["cost"] / target * 1e6
    return CandidateTable(
        offers,
        columns,
        spec.spot.startup_minutes / 60,
        params,
        spec.spot.restart_minutes / 60,
        family,
    )


# ---- choosing ----------------------------------------------------------------------------------


def outlier_rows(table: CandidateTable) -> np.ndarray:
    """Spot rows on an offer whose spot price is an outlier (planner.pricebook)."""
    if not len(table):
        return np.zeros(0, bool)
    flags = np.array([c.price.outlier for c in table.offers], dtype=bool)
    return flags[table["offer"]] & table["spot"].astype(bool)


def feasible_mask(spec: Spec, table: CandidateTable) -> np.ndarray:
    c = spec.constraints
    ok = table["fits"].copy()
    if c.budget:
        ok &= table["cost"] <= c.budget
    if c.deadline_hours:
        ok &= table["hours"] <= c.deadline_hours
    if not c.allow_outlier_prices:
        ok &= ~outlier_rows(table)
    return ok


def cost_order(table: CandidateTable) -> np.ndarray:
    """Every row, cheapest first, faster first among equal cost: sorted once per table (the
    search ranks the same table under several masks) and kept while its cost and hours
    columns are the same arrays."""
    cost, hours = table["cost"], table["hours"]
    cached = getattr(table, "_cost_order", None)
    if cached is not None and cached[0] is cost and cached[1] is hours:
        return cached[2]
    order = np.lexsort((hours, cost))
    try:
        table._cost_order = (cost, hours, order)  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return order


def ranked(table: CandidateTable, mask: np.ndarray) -> np.ndarray:
    """Row indices under `mask`, cheapest first, faster first among equal cost."""
    if not len(table):
        return np.zeros(0, dtype=int)
    order = cost_order(table)
    return order[np.asarray(mask, dtype=bool)[order]]


def pareto_front(table: CandidateTable, mask: np.ndarray) -> np.ndarray:
    """Rows not beaten on both cost and hours (cheapest first)."""
    idx = ranked(table, mask)
    if not len(idx):
        return np.zeros(0, dtype=int)
    hours = table["hours"][idx]
    before = np.concatenate([[math.inf], np.minimum.accumulate(hours)[:-1]])
    return idx[hours < before].astype(int)


@dataclass
class Decision:
    chosen: int | None
    table: CandidateTable
    feasible: np.ndarray
    pareto: np.ndarray
    target_tokens: float
    problems: list[str] = field(default_factory=list)
    binding: str = ""
    minimum_budget: float | None = None  # cheapest plan meeting every other constraint
    minimum_budget_row: int | None = None
    tokens_bought: float | None = None  # what the budget buys within the deadline


def eligible_mask(spec: Spec, table: CandidateTable) -> np.ndarray:
    """Every constraint except the budget: memory, deadline, outlier prices."""
    c = spec.constraints
    ok = table["fits"].copy()
    if c.deadline_hours:
        ok &= table["hours"] <= c.deadline_hours
    if not c.allow_outlier_prices:
        ok &= ~outlier_rows(table)
    return ok


def tokens_within(spec: Spec, table: CandidateTable, target: float) -> float:
    """The most tokens the budget buys within the deadline (modelled): each plan's paid time
    scales with its tokens; the deadline caps the time, the budget the money."""
    c = spec.constraints
    usable = table["fits"] & (~outlier_rows(table) if not c.allow_outlier_prices else True)
    if not usable.any() or not c.budget:
        return 0.0
    cost, hours = table["cost"][usable], table["hours"][usable]
    fixed = table.fixed_hours
    share = c.budget / cost
    if c.deadline_hours:
        share = np.minimum(
            share, np.maximum(c.deadline_hours - fixed, 0.0) / np.maximum(hours - fixed, 1e-12)
        )
    return float(target * share.max())


def minimum_budget(spec: Spec, table: CandidateTable) -> int | None:
    """The row of the cheapest plan that meets the deadline, memory and price rules."""
    order = ranked(table, eligible_mask(spec, table))
    return int(order[0]) if len(order) else None


def decide(spec: Spec, table: CandidateTable, target: float) -> Decision:
    """The cheapest candidate meeting memory, budget and deadline, or why there is none."""
    if not len(table):
        return Decision(
            None,
            table,
            np.zeros(0, bool),
            np.zeros(0, int),
            target,
            [
                "no candidate satisfies the divisibility/batch rules; widen "
                "constraints.seq_lens, the global batch range or search lists"
            ],
        )
    fits = table["fits"]
    feasible = feasible_mask(spec, table)
    pareto = pareto_front(table, fits)
    least = minimum_budget(spec, table)
    extra = dict(
        minimum_budget=float(table["cost"][least]) if least is not None else None,
        minimum_budget_row=least,
        tokens_bought=tokens_within(spec, table, target) if spec.constraints.budget else None,
    )
    order = ranked(table, feasible)
    if len(order):
        chosen = int(order[0])
        return Decision(
            chosen,
            table,
            feasible,
            pareto,
            target,
            binding=_binding_constraint(spec, table, chosen),
            **extra,
        )
    if not fits.any():
        smallest = int(np.argmin(table["memory_gb"]))
        return Decision(
            None,
            table,
            feasible,
            pareto,
            target,
            [
                f"nothing fits in device memory: the smallest configuration needs "
                f"{table['memory_gb'][smallest]:.1f} GB per device (modelled)"
            ],
            **extra,
        )
    return Decision(
        None,
        table,
        feasible,
        pareto,
        target,
        _problems(spec, table, target, least, extra["tokens_bought"]),
        **extra,
    )


def _problems(
    spec: Spec, table: CandidateTable, target: float, least: int | None, bought: float | None
) -> list[str]:
    c, cur = spec.constraints, spec.constraints.currency
    fits = table["fits"]
    fastest = int(np.flatnonzero(fits)[np.argmin(table["hours"][fits])])
    problems = []
    within = f" within the deadline ({c.deadline_hours:g} h)" if c.deadline_hours else ""
    if c.budget and least is not None and table["cost"][least] > c.budget:
        problems.append(
            f"the budget {c.budget:,.0f} {cur} cannot reach {target:.3g} tokens{within}: the "
            f"cheapest plan that meets every other constraint costs "
            f"{table['cost'][least]:,.0f} {cur} and takes {table['hours'][least]:,.1f} h "
            f"(modelled); the budget buys about {bought or 0:.3g} tokens{within}; minimum "
            f"budget for the target: {table['cost'][least]:,.0f} {cur}"
        )
    if least is None and c.deadline_hours and table["hours"][fastest] > c.deadline_hours:
        problems.append(
            f"the deadline {c.deadline_hours:g} h cannot be met: the fastest plan takes "
            f"{table['hours'][fastest]:,.1f} h and costs {table['cost'][fastest]:,.0f} {cur} "
            "(modelled)"
        )
        cap_note = node_cap_relief(spec, table, target, int(table["nodes"][fastest]))
        if cap_note:
            problems.append(cap_note)
    if not problems:
        problems.append(
            "no plan meets the limits without an outlier spot price (pass "
            "--allow-outlier-prices to accept one)"
            if least is None
            else "no single plan meets both budget and deadline (modelled)"
        )
    return problems


def node_cap(spec: Spec) -> int:
    """The most nodes the search may use: constraints.max_nodes and search.node_counts."""
    return min(spec.constraints.max_nodes, max(spec.search.node_counts))


def node_cap_relief(spec: Spec, table: CandidateTable, target: float, fastest_nodes: int) -> str:
    """When no plan meets the deadline/budget and the fastest one already uses the node cap,
    say so, and what 8x the cap would buy (re-evaluated, modelled)."""
    import dataclasses

    cap = node_cap(spec)
    if fastest_nodes < cap:
        return ""
    wider_counts = sorted(set(spec.search.node_counts) | {cap * 2, cap * 4, cap * 8})
    wider = dataclasses.replace(
        spec,
        constraints=dataclasses.replace(spec.constraints, max_nodes=cap * 8),
        search=dataclasses.replace(spec.search, node_counts=wider_counts),
    )
    big = evaluate_space(wider, table.offers, target)
    if not len(big):
        return ""
    c, cur = spec.constraints, spec.constraints.currency
    head = (
        f"constraints.max_nodes = {c.max_nodes} / search.node_counts (most "
        f"{max(spec.search.node_counts)}) cap the job at {cap} nodes, and the fastest plan "
        f"uses all {cap}"
    )
    ok = feasible_mask(wider, big)
    if ok.any():
        best = int(ranked(big, ok)[0])
        return (
            f"{head}; with up to {cap * 8} nodes a plan meets the limits: "
            f"{int(big['nodes'][best])} nodes, {big['hours'][best]:,.1f} h, "
            f"{big['cost'][best]:,.0f} {cur} (modelled); raise constraints.max_nodes "
            "and search.node_counts"
        )
    fits = big["fits"]
    if not fits.any():
        return ""
    fastest = int(np.flatnonzero(fits)[np.argmin(big["hours"][fits])])
    return (
        f"{head}; even {int(big['nodes'][fastest])} nodes would take "
        f"{big['hours'][fastest]:,.1f} h and cost {big['cost'][fastest]:,.0f} {cur} "
        "(modelled)"
    )


def _binding_constraint(spec: Spec, table: CandidateTable, chosen: int) -> str:
    """Which limit shaped the choice: the cheaper plans it beat were excluded by what?"""
    cheaper = table["cost"] < table["cost"][chosen]
    if not cheaper.any():
        return "none: this is the cheapest configuration in the whole space"
    reasons = []
    if (cheaper & ~table["fits"]).any():
        reasons.append("device memory")
    c = spec.constraints
    if c.deadline_hours and (cheaper & table["fits"] & (table["hours"] > c.deadline_hours)).any():
        reasons.append(f"the deadline ({c.deadline_hours:g} h)")
    if not c.allow_outlier_prices and (cheaper & table["fits"] & outlier_rows(table)).any():
        reasons.append("an outlier spot price (excluded; --allow-outlier-prices)")
    return " and ".join(reasons) or "none"


def runner_up(decision: Decision) -> int | None:
    """The cheapest feasible plan on a different offer or spot mode than the chosen one."""
    if decision.chosen is None:
        return None
    t, c = decision.table, decision.chosen
    for i in ranked(t, decision.feasible):
        if (t["offer"][i], t["spot"][i]) != (t["offer"][c], t["spot"][c]):
            return int(i)
    return None
