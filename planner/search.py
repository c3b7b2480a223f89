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

import math
from dataclasses import dataclass, field

import numpy as np

from planner import costmodel as cm
from planner.corpus_stats import CorpusStatistics
from planner.hardware import Offer, Profile
from planner.spec import Spec

PRECISIONS = ("fp32", "fp16", "bf16")
DIAGNOSTIC_COLUMNS = frozenset({"tp_s", "pp_s", "opt_s", "bubble", "tokens_per_s_per_device",
                                "dp_sync_s"})


@dataclass(frozen=True)
class OfferChoice:
    profile: Profile
    offer: Offer
    rate: float  # spec currency per offer currency

    @property
    def label(self) -> str:
        return f"{self.profile.name} @ {self.offer.key}"


@dataclass
class CandidateTable:
    """One row per candidate configuration; every column a numpy array of equal length."""

    offers: list[OfferChoice]
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    fixed_hours: float = 0.0  # paid hours that do not scale with throughput (start-up)
    params_total: float = 0.0  # the model's parameters (the interval depends on its size)

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
        out["sharding"] = cm.SHARDING_STAGES[out["stage_code"]]
        out["recompute"] = cm.RECOMPUTE_MODES[out["recompute_code"]]
        out.update({k: v[0].item() for k, v in self.intervals(np.array([i])).items()})
        return out

    def intervals(self, idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The 80% interval (tokens_per_s/hours/cost _p10/_p90) of rows `idx` (all if None).

        Computed on demand: it depends only on each row's point estimate and its profile's
        calibration spread (planner.costmodel.interval_from_throughput), so a million-row
        table need not carry six more columns."""
        idx = np.arange(len(self)) if idx is None else np.asarray(idx, dtype=int)
        ratios = np.array([[c.profile.efficiency_for(p).interval_ratios(self.params_total)
                            for p in PRECISIONS] for c in self.offers])
        lo, hi = ratios[..., 0], ratios[..., 1]
        offer, prec = self["offer"][idx], self["precision_code"][idx]
        return cm.interval_from_throughput(
            tokens_per_s=self["tokens_per_s"][idx], hours=self["hours"][idx],
            fixed_hours=self.fixed_hours, cost=self["cost"][idx], p10_ratio=lo[offer, prec],
            p90_ratio=hi[offer, prec])

    def select(self, mask: np.ndarray) -> "CandidateTable":
        return CandidateTable(self.offers, {k: v[mask] for k, v in self.columns.items()},
                              self.fixed_hours, self.params_total)


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
    return choices


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


def _accumulations(lo: np.ndarray, hi: np.ndarray, pp: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
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
    pairs = np.unique(np.stack([r, v]), axis=1)
    return pairs[0], pairs[1]


def evaluate_offer(spec: Spec, choice: OfferChoice, index: int, target: float
                   ) -> dict[str, np.ndarray]:
    """All valid candidates on one offer, evaluated. Cheap integer rules filter first."""
    from gptplan.plan import (sequence_parallel_fits, tensor_parallel_fits_node,
                             virtual_pipeline_fits)

    m = spec.model_section()
    prof, offer = choice.profile, choice.offer
    c, s = spec.constraints, spec.search
    gpn = offer.gpus_per_node
    precisions = [PRECISIONS.index(p) for p in c.precisions if p in prof.precisions]
    tps = [t for t in s.tensor_parallel if tensor_parallel_fits_node(t, gpn) and all(
        x % t == 0 for x in (m.num_attention_heads, m.hidden_size, m.intermediate_size,
                             m.vocab_size))]
    if prof.device == "cpu":
        tps = [1]
    pps = [p for p in s.pipeline_parallel if m.num_hidden_layers % p == 0 and
           (prof.device != "cpu" or p == 1)]
    stages = [cm.SHARDING_STAGES.index(z) for z in s.sharding
              if prof.device != "cpu" or z == ""]
    nodes = sorted({n for n in s.node_counts if n <= c.max_nodes})
    if not offer.inter_node_gbits_per_s:  # unknown network: plan single-node only
        nodes = [n for n in nodes if n == 1]
    vpps = sorted(set(s.virtual_pp) | {1})
    if not (precisions and tps and pps and stages and nodes):
        return {}
    g = _grid(nodes=nodes, precision_code=precisions, seq=c.seq_lens, micro=s.micro_batch_sizes,
              tp=tps, pp=pps, vpp=vpps, stage_code=stages,
              recompute_code=[cm.RECOMPUTE_MODES.index(r) for r in s.recompute],
              sp=[int(v) for v in s.sequence_parallel])
    world = g["nodes"] * gpn
    model_ranks = g["tp"] * g["pp"]
    ok = (world % model_ranks == 0)
    batch_ranks = np.where(ok, world // np.maximum(model_ranks, 1), 0)
    ok &= ~((g["stage_code"] > 0) & (batch_ranks <= 1))          # sharding over 1 rank
    ok &= ~((g["pp"] > 1) & (g["stage_code"] >= 2))               # PaddleNLP: pp + stage2/3
    ok &= sequence_parallel_fits(g["micro"], g["seq"], g["tp"], g["sp"])
    ok &= tensor_parallel_fits_node(g["tp"], gpn)
    # the accumulation-free part of gptplan.plan.virtual_pipeline_fits, applied again in full
    # once accumulation is known (it prunes before the accumulation expansion)
    ok &= virtual_pipeline_fits(m.num_hidden_layers, g["pp"], g["vpp"], 2 * g["pp"])
    g = {k: v[ok] for k, v in g.items()}
    batch_ranks = batch_ranks[ok]
    # accumulation: every value meeting the global-batch range (see _accumulations)
    per_acc = g["micro"] * g["seq"] * batch_ranks
    if s.accumulation_steps:
        accs = np.array(sorted(set(s.accumulation_steps)))
        rows = np.repeat(np.arange(len(per_acc)), len(accs))
        acc = np.tile(accs, len(per_acc))
    else:
        lo = np.maximum(1, -(-c.global_batch_tokens_min // np.maximum(per_acc, 1)))
        lo = np.where(g["pp"] > 1, np.maximum(lo, g["pp"]), lo)
        hi = (c.global_batch_tokens_max // np.maximum(per_acc, 1) if c.global_batch_tokens_max
              else np.full(len(per_acc), max(1024, int(lo.max(initial=1)))))
        rows, acc = _accumulations(lo, np.minimum(hi, 4096), g["pp"])
    g = {k: v[rows] for k, v in g.items()}
    g["acc"] = acc
    batch_ranks = batch_ranks[rows]
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    ok = tokens_per_step >= c.global_batch_tokens_min
    if c.global_batch_tokens_max:
        ok &= tokens_per_step <= c.global_batch_tokens_max
    ok &= ~((g["pp"] > 1) & (g["acc"] < g["pp"]))                 # fill the pipeline
    ok &= virtual_pipeline_fits(m.num_hidden_layers, g["pp"], g["vpp"], g["acc"])
    g = {k: v[ok] for k, v in g.items()}
    batch_ranks = batch_ranks[ok]
    if not len(g["nodes"]):
        return {}
    # sharding degree: all batch ranks, or (hybrid) the batch ranks inside one node with data
    # parallel across nodes (sharding_parallel_degree < batch ranks)
    in_node = np.maximum(1, gpn // (g["tp"] * g["pp"]))
    hybrid_ok = (g["stage_code"] > 0) & (in_node > 1) & (in_node < batch_ranks) & \
        (batch_ranks % in_node == 0)
    extra = np.flatnonzero(hybrid_ok)
    g = {k: np.concatenate([v, v[extra]]) for k, v in g.items()}
    shard_degree = np.concatenate([np.where(g["stage_code"][:len(batch_ranks)] > 0,
                                            batch_ranks, 1), in_node[extra]])
    batch_ranks = np.concatenate([batch_ranks, batch_ranks[extra]])
    g["shard_degree"] = shard_degree
    g["dp"] = batch_ranks // shard_degree
    if s.sharding_degrees:
        keep = (g["stage_code"] == 0) | np.isin(shard_degree, s.sharding_degrees)
        g = {k: v[keep] for k, v in g.items()}
        batch_ranks = batch_ranks[keep]
        if not len(batch_ranks):
            return {}
    g["flash"] = np.full(len(batch_ranks), 0)
    if s.flash_attention and prof.flash_attention and \
            m.hidden_size // m.num_attention_heads <= 256:
        g["flash"] = (g["precision_code"] > 0).astype(int)  # fp16/bf16 only
    out = evaluate_layouts(m, prof, offer, g, memory_headroom=c.memory_headroom)
    out["offer"] = np.full(len(out["nodes"]), index)
    steps = np.ceil(target / out["tokens_per_step"])
    out["steps"] = steps
    out["train_hours"] = steps * out["step_time_s"] / 3600
    return _price(spec, choice, cm.ModelShape.from_section(m), out)


def evaluate_layouts(m, prof: Profile, offer: Offer, g: dict, *, efficiency=None,
                     overlap=None, memory_headroom: float = 0.9) -> dict[str, np.ndarray]:
    """The cost model on explicit layouts (one row per entry of the columns in `g`: nodes,
    precision_code, seq, micro, acc, tp, pp, vpp, stage_code, shard_degree, dp,
    recompute_code, sp, flash). Returns per-row memory, step time and its parts, tokens/s and
    MFU. `efficiency` overrides the profile's (max, half_tokens, half_hidden) per precision
    (used by the fitting script); `overlap` the share of gradient sync hidden behind compute.
    """
    shape = cm.ModelShape.from_section(m)
    gpn = offer.gpus_per_node
    g = {k: np.asarray(v) for k, v in g.items()}
    world = g["nodes"] * gpn
    batch_ranks = g["dp"] * g["shard_degree"]
    mixed = g["precision_code"] > 0
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    eff = prof.efficiency  # framework constants (memory overhead, comm overlap)
    per_precision = [prof.efficiency_for(p) for p in PRECISIONS]
    if efficiency is not None:
        per_precision = [efficiency] * len(PRECISIONS)

    def by_precision(attr: str) -> np.ndarray:
        return np.array([getattr(e, attr) for e in per_precision])[g["precision_code"]]

    # memory
    mem = cm.memory_per_device_bytes(
        shape, seq_len=g["seq"], micro_batch=g["micro"], accumulation=g["acc"], tp=g["tp"],
        pp=g["pp"], stage_code=g["stage_code"], shard_degree=g["shard_degree"],
        recompute_code=g["recompute_code"], seq_parallel=g["sp"], mixed_precision=mixed,
        overhead_gb=eff.memory_overhead_gb, fragmentation=eff.fragmentation,
        flash_attention=g["flash"], virtual_pp=g["vpp"])
    fits = mem <= prof.memory_gb * cm.GB * memory_headroom

    # compute
    peak = np.array([prof.peak_for(p) for p in PRECISIONS])[g["precision_code"]] * 1e12
    f_model = cm.model_flops_per_token(m, g["seq"])
    f_hw = f_model + cm.recompute_extra_flops_per_token(shape, g["seq"], g["recompute_code"],
                                                        g["flash"])
    tokens_per_rank = g["micro"] * g["acc"] * g["seq"]
    efficiency_ = cm.compute_efficiency(micro_batch=g["micro"], seq_len=g["seq"],
                                        hidden_per_tp=m.hidden_size / g["tp"],
                                        eff_max=by_precision("max"),
                                        half_tokens=by_precision("half_tokens"),
                                        half_hidden=by_precision("half_hidden"),
                                        rolloff_tokens=by_precision("rolloff_tokens"))
    # attention matmuls run at their own relative efficiency (fitted per generation)
    f_attn = cm.attention_flops_per_token(shape, g["seq"], g["recompute_code"], g["flash"])
    f_effective = f_hw - f_attn + f_attn / by_precision("attention_relative")
    t_compute = tokens_per_rank * f_effective / (g["tp"] * g["pp"]) / (peak * efficiency_)

    # communication
    act_bytes = np.where(mixed, 2.0, 4.0)
    intra = prof.intra_node_gbytes_per_s * 1e9
    inter = offer.inter_node_gbits_per_s / 8 * 1e9 if offer.inter_node_gbits_per_s else 1.0
    tp_bytes = g["micro"] * g["seq"] * m.hidden_size * act_bytes
    t_tp = (m.num_hidden_layers / g["pp"]) * g["acc"] * 4 * \
        cm.ring_allreduce_seconds(tp_bytes, g["tp"], intra)
    pp_link = np.where(g["nodes"] > 1, inter, intra)
    p2p_bytes = tp_bytes / np.where(g["sp"] > 0, g["tp"], 1)
    t_pp = np.where(g["pp"] > 1, 2.0 * g["acc"] * g["vpp"] * p2p_bytes / pp_link, 0.0)
    t_dp = cm.gradient_sync_seconds(
        params=shape.params_total, grad_bytes=act_bytes, tp=g["tp"], pp=g["pp"], dp=g["dp"],
        shard_degree=g["shard_degree"], stage_code=g["stage_code"], accumulation=g["acc"],
        gpus_per_node=gpn, intra_bytes_per_s=intra, inter_bytes_per_s=inter)
    t_opt = shape.params_total / (g["tp"] * g["pp"] * g["shard_degree"]) * 16 * 3 / \
        (prof.memory_bandwidth_gbytes_per_s * 1e9)
    hidden_share = eff.comm_overlap if overlap is None else overlap
    bubble = cm.pipeline_bubble_factor(g["pp"], g["acc"], g["vpp"])
    step_time = (t_compute + t_tp) * bubble + t_pp + (1 - hidden_share) * t_dp + t_opt

    tokens_per_s = tokens_per_step / step_time
    mfu = f_model * tokens_per_s / (world * peak)
    n = len(step_time)
    return {"nodes": g["nodes"], "gpus_per_node": np.full(n, gpn), "world": world,
            "precision_code": g["precision_code"], "seq": g["seq"], "micro": g["micro"],
            "acc": g["acc"], "tp": g["tp"], "pp": g["pp"], "vpp": g["vpp"], "dp": g["dp"],
            "shard_degree": g["shard_degree"], "stage_code": g["stage_code"],
            "recompute_code": g["recompute_code"], "sp": g["sp"], "flash": g["flash"],
            "tokens_per_step": tokens_per_step, "memory_gb": mem / cm.GB, "fits": fits,
            "efficiency": efficiency_, "hidden_per_tp": m.hidden_size / g["tp"],
            "step_time_s": step_time, "compute_s": t_compute,
            "comm_s": t_tp + t_pp + (1 - hidden_share) * t_dp,
            "dp_sync_s": t_dp, "tp_s": t_tp, "pp_s": t_pp, "opt_s": t_opt, "bubble": bubble,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / world, "mfu": mfu}


def _price(spec: Spec, choice: OfferChoice, shape: cm.ModelShape, rows: dict) -> dict:
    """Duplicate rows for spot and on-demand and add time, money and energy."""
    offer, prof, sp = choice.offer, choice.profile, spec.spot
    modes = []
    if spec.constraints.on_demand or offer.kind == "on_prem":
        modes.append(False)
    if spec.constraints.spot and offer.has_spot:
        modes.append(True)
    parts = []
    checkpoint_hours = cm.checkpoint_write_hours(
        state_bytes=shape.params_total * 16.0, nodes=rows["nodes"],
        node_gbytes_per_s=sp.checkpoint_gbytes_per_s,
        storage_cap_gbytes_per_s=offer.storage_gbytes_per_s)
    restart_hours = sp.restart_minutes / 60
    for spot in modes:
        r = dict(rows)
        n = len(r["nodes"])
        failures = r["nodes"] * sp.preemptions_per_node_hour if spot else np.zeros(n)
        interval = cm.young_daly_interval_hours(checkpoint_hours, failures) if spot else \
            np.full(n, sp.on_demand_checkpoint_hours)
        useful = cm.useful_fraction(checkpoint_hours, interval, failures, restart_hours)
        hours = r["train_hours"] / useful + sp.startup_minutes / 60
        price = offer.node_price_per_hour(spot=spot, tdp_w=prof.tdp_w) * choice.rate
        r["spot"] = np.full(n, spot)
        r["useful_fraction"] = useful
        r["checkpoint_interval_h"] = interval
        r["hours"] = hours
        r["price_node_hour"] = np.full(n, price)
        r["cost"] = price * r["nodes"] * hours
        r["energy_kwh"] = r["world"] * prof.tdp_w * hours / 1000 * \
            (offer.pue if offer.kind == "on_prem" else 1.0)
        parts.append(r)
    if not parts:
        return {}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def evaluate_space(spec: Spec, offers: list[OfferChoice], target: float) -> CandidateTable:
    tables = [evaluate_offer(spec, choice, i, target) for i, choice in enumerate(offers)]
    # diagnostics of single evaluations (planner explain, the published-run fit) stay out of
    # the big table: concatenating a million rows is memory-bound
    tables = [{k: v for k, v in t.items() if k not in DIAGNOSTIC_COLUMNS} for t in tables if t]
    params = float(cm.ModelShape.from_section(spec.model_section()).params_total)
    if not tables:
        return CandidateTable(offers, {}, spec.spot.startup_minutes / 60, params)
    columns = {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}
    columns["cost_per_million_tokens"] = columns["cost"] / target * 1e6
    return CandidateTable(offers, columns, spec.spot.startup_minutes / 60, params)


# ---- choosing ----------------------------------------------------------------------------------

def feasible_mask(spec: Spec, table: CandidateTable) -> np.ndarray:
    c = spec.constraints
    ok = table["fits"].copy()
    if c.budget:
        ok &= table["cost"] <= c.budget
    if c.deadline_hours:
        ok &= table["hours"] <= c.deadline_hours
    return ok


def ranked(table: CandidateTable, mask: np.ndarray) -> np.ndarray:
    """Row indices under `mask`, cheapest first, faster first among equal cost."""
    idx = np.flatnonzero(mask)
    order = np.lexsort((table["hours"][idx], table["cost"][idx]))
    return idx[order]


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


def decide(spec: Spec, table: CandidateTable, target: float) -> Decision:
    """The cheapest candidate meeting memory, budget and deadline, or why there is none."""
    c = spec.constraints
    cur = c.currency
    if not len(table):
        return Decision(None, table, np.zeros(0, bool), np.zeros(0, int), target,
                        ["no candidate satisfies the divisibility/batch rules; widen "
                         "constraints.seq_lens, the global batch range or search lists"])
    fits = table["fits"]
    feasible = feasible_mask(spec, table)
    pareto = pareto_front(table, fits)
    order = ranked(table, feasible)
    if len(order):
        chosen = int(order[0])
        return Decision(chosen, table, feasible, pareto, target,
                        binding=_binding_constraint(spec, table, chosen))
    problems = []
    if not fits.any():
        smallest = int(np.argmin(table["memory_gb"]))
        problems.append(f"nothing fits in device memory: the smallest configuration needs "
                        f"{table['memory_gb'][smallest]:.1f} GB per device (modelled)")
        return Decision(None, table, feasible, pareto, target, problems)
    cheapest = int(ranked(table, fits)[0])
    fastest = int(np.flatnonzero(fits)[np.argmin(table["hours"][fits])])
    if c.budget and table["cost"][cheapest] > c.budget:
        per_token = table["cost"][cheapest] / target
        problems.append(
            f"the budget {c.budget:,.0f} {cur} cannot reach {target:.3g} tokens: the cheapest "
            f"plan costs {table['cost'][cheapest]:,.0f} {cur} (modelled); the budget buys "
            f"about {c.budget / per_token:.3g} tokens; minimum budget for the target: "
            f"{table['cost'][cheapest]:,.0f} {cur}")
    if c.deadline_hours and table["hours"][fastest] > c.deadline_hours:
        problems.append(
            f"the deadline {c.deadline_hours:g} h cannot be met: the fastest plan takes "
            f"{table['hours'][fastest]:,.1f} h and costs {table['cost'][fastest]:,.0f} {cur} "
            "(modelled)")
    if not problems:
        problems.append("no single plan meets both budget and deadline: the cheapest takes "
                        f"{table['hours'][cheapest]:,.1f} h, the fastest costs "
                        f"{table['cost'][fastest]:,.0f} {cur} (modelled)")
    cap_note = node_cap_relief(spec, table, target, int(table["nodes"][fastest]))
    if cap_note:
        problems.append(cap_note)
    return Decision(None, table, feasible, pareto, target, problems)


def node_cap(spec: Spec) -> int:
    """The most nodes the search may use: constraints.max_nodes and search.node_counts."""
    return min(spec.constraints.max_nodes, max(spec.search.node_counts))


def node_cap_relief(spec: Spec, table: CandidateTable, target: float,
                    fastest_nodes: int) -> str:
    """When no plan meets the deadline/budget and the fastest one already uses the node cap,
    say so, and what 8x the cap would buy (re-evaluated, modelled)."""
    import dataclasses

    cap = node_cap(spec)
    if fastest_nodes < cap:
        return ""
    wider_counts = sorted(set(spec.search.node_counts) | {cap * 2, cap * 4, cap * 8})
    wider = dataclasses.replace(
        spec, constraints=dataclasses.replace(spec.constraints, max_nodes=cap * 8),
        search=dataclasses.replace(spec.search, node_counts=wider_counts))
    big = evaluate_space(wider, table.offers, target)
    if not len(big):
        return ""
    c, cur = spec.constraints, spec.constraints.currency
    head = (f"constraints.max_nodes = {c.max_nodes} / search.node_counts (most "
            f"{max(spec.search.node_counts)}) cap the job at {cap} nodes, and the fastest plan "
            f"uses all {cap}")
    ok = feasible_mask(wider, big)
    if ok.any():
        best = int(ranked(big, ok)[0])
        return (f"{head}; with up to {cap * 8} nodes a plan meets the limits: "
                f"{int(big['nodes'][best])} nodes, {big['hours'][best]:,.1f} h, "
                f"{big['cost'][best]:,.0f} {cur} (modelled); raise constraints.max_nodes "
                "and search.node_counts")
    fits = big["fits"]
    if not fits.any():
        return ""
    fastest = int(np.flatnonzero(fits)[np.argmin(big["hours"][fits])])
    return (f"{head}; even {int(big['nodes'][fastest])} nodes would take "
            f"{big['hours'][fastest]:,.1f} h and cost {big['cost'][fastest]:,.0f} {cur} "
            "(modelled)")


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
