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
        return out

    def select(self, mask: np.ndarray) -> "CandidateTable":
        return CandidateTable(self.offers, {k: v[mask] for k, v in self.columns.items()})


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


def _powers_of_two_up_to(n: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, n))) + 1)]


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


def evaluate_offer(spec: Spec, choice: OfferChoice, index: int, target: float
                   ) -> dict[str, np.ndarray]:
    """All valid candidates on one offer, evaluated. Cheap integer rules filter first."""
    m = spec.model_section()
    shape = cm.ModelShape.from_section(m)
    prof, offer = choice.profile, choice.offer
    c, s = spec.constraints, spec.search
    gpn = offer.gpus_per_node
    precisions = [PRECISIONS.index(p) for p in c.precisions if p in prof.precisions]
    tps = [t for t in s.tensor_parallel if t <= gpn and all(
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
    accs = s.accumulation_steps or _powers_of_two_up_to(1024)
    if not (precisions and tps and pps and stages and nodes):
        return {}
    g = _grid(nodes=nodes, precision_code=precisions, seq=c.seq_lens, micro=s.micro_batch_sizes,
              tp=tps, pp=pps, stage_code=stages,
              recompute_code=[cm.RECOMPUTE_MODES.index(r) for r in s.recompute],
              sp=[int(v) for v in s.sequence_parallel], acc=accs)
    world = g["nodes"] * gpn
    model_ranks = g["tp"] * g["pp"]
    ok = (world % model_ranks == 0)
    batch_ranks = np.where(ok, world // np.maximum(model_ranks, 1), 0)
    ok &= ~((g["stage_code"] > 0) & (batch_ranks <= 1))          # sharding over 1 rank
    ok &= ~((g["pp"] > 1) & (g["stage_code"] >= 2))               # PaddleNLP: pp + stage2/3
    ok &= ~((g["sp"] == 1) & (g["tp"] == 1))                      # sp needs tp
    ok &= ~((g["pp"] > 1) & (g["acc"] < g["pp"]))                 # fill the pipeline
    ok &= g["tp"] <= gpn                                          # tp inside a node
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    ok &= tokens_per_step >= c.global_batch_tokens_min
    if c.global_batch_tokens_max:
        ok &= tokens_per_step <= c.global_batch_tokens_max
    g = {k: v[ok] for k, v in g.items()}
    if not len(g["nodes"]):
        return {}
    world = g["nodes"] * gpn
    batch_ranks = world // (g["tp"] * g["pp"])
    sharded = g["stage_code"] > 0
    dp = np.where(sharded, 1, batch_ranks)
    shard_degree = np.where(sharded, batch_ranks, 1)
    mixed = g["precision_code"] > 0
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    eff = prof.efficiency  # framework constants (memory overhead, comm overlap)
    per_precision = [prof.efficiency_for(p) for p in PRECISIONS]

    def by_precision(attr: str) -> np.ndarray:
        return np.array([getattr(e, attr) for e in per_precision])[g["precision_code"]]

    # memory
    mem = cm.memory_per_device_bytes(
        shape, seq_len=g["seq"], micro_batch=g["micro"], accumulation=g["acc"], tp=g["tp"],
        pp=g["pp"], stage_code=g["stage_code"], shard_degree=shard_degree,
        recompute_code=g["recompute_code"], seq_parallel=g["sp"], mixed_precision=mixed,
        overhead_gb=eff.memory_overhead_gb, fragmentation=eff.fragmentation)
    fits = mem <= prof.memory_gb * cm.GB * c.memory_headroom

    # compute
    peak = np.array([prof.peak_for(p) for p in PRECISIONS])[g["precision_code"]] * 1e12
    f_model = cm.model_flops_per_token(m, g["seq"])
    f_hw = f_model + cm.recompute_extra_flops_per_token(shape, g["seq"], g["recompute_code"])
    tokens_per_rank = g["micro"] * g["acc"] * g["seq"]
    efficiency = cm.compute_efficiency(micro_batch=g["micro"], seq_len=g["seq"],
                                       hidden_per_tp=m.hidden_size / g["tp"],
                                       eff_max=by_precision("max"),
                                       half_tokens=by_precision("half_tokens"),
                                       half_hidden=by_precision("half_hidden"),
                                       rolloff_tokens=by_precision("rolloff_tokens"))
    t_compute = tokens_per_rank * f_hw / (g["tp"] * g["pp"]) / (peak * efficiency)

    # communication
    act_bytes = np.where(mixed, 2.0, 4.0)
    intra = prof.intra_node_gbytes_per_s * 1e9
    inter = offer.inter_node_gbits_per_s / 8 * 1e9 if offer.inter_node_gbits_per_s else 1.0
    tp_bytes = g["micro"] * g["seq"] * m.hidden_size * act_bytes
    t_tp = (m.num_hidden_layers / g["pp"]) * g["acc"] * 4 * \
        cm.ring_allreduce_seconds(tp_bytes, g["tp"], intra)
    pp_link = np.where(g["nodes"] > 1, inter, intra)
    t_pp = np.where(g["pp"] > 1, 2.0 * g["acc"] * tp_bytes / pp_link, 0.0)
    grad_bytes_device = shape.params_total / (g["tp"] * g["pp"]) * act_bytes
    ranks_in_node = np.maximum(1, gpn // (g["tp"] * g["pp"]))
    t_dp = cm.ring_allreduce_seconds(grad_bytes_device, np.minimum(batch_ranks, ranks_in_node),
                                     intra)
    t_dp = t_dp + np.where(g["nodes"] > 1, cm.ring_allreduce_seconds(
        shape.params_total * act_bytes, g["nodes"], inter), 0.0)
    t_dp = t_dp * np.where(g["stage_code"] == 3, 2.0, 1.0)  # stage3 re-gathers parameters
    t_opt = shape.params_total / (g["tp"] * g["pp"] * shard_degree) * 16 * 3 / \
        (prof.memory_bandwidth_gbytes_per_s * 1e9)
    step_time = (t_compute + t_tp) * cm.pipeline_bubble_factor(g["pp"], g["acc"]) + t_pp + \
        (1 - eff.comm_overlap) * t_dp + t_opt

    tokens_per_s = tokens_per_step / step_time
    steps = np.ceil(target / tokens_per_step)
    train_hours = steps * step_time / 3600
    mfu = f_model * tokens_per_s / (world * peak)

    out = {"offer": np.full(len(step_time), index), "nodes": g["nodes"],
           "gpus_per_node": np.full(len(step_time), gpn), "world": world,
           "precision_code": g["precision_code"], "seq": g["seq"], "micro": g["micro"],
           "acc": g["acc"], "tp": g["tp"], "pp": g["pp"], "dp": dp,
           "shard_degree": shard_degree, "stage_code": g["stage_code"],
           "recompute_code": g["recompute_code"], "sp": g["sp"],
           "tokens_per_step": tokens_per_step, "memory_gb": mem / cm.GB, "fits": fits,
           "efficiency": efficiency, "hidden_per_tp": m.hidden_size / g["tp"],
           "step_time_s": step_time,
           "compute_s": t_compute, "comm_s": t_tp + t_pp + (1 - eff.comm_overlap) * t_dp,
           "tokens_per_s": tokens_per_s, "steps": steps, "train_hours": train_hours,
           "mfu": mfu}
    return _price(spec, choice, shape, out)


def _price(spec: Spec, choice: OfferChoice, shape: cm.ModelShape, rows: dict) -> dict:
    """Duplicate rows for spot and on-demand and add time, money and energy."""
    offer, prof, sp = choice.offer, choice.profile, spec.spot
    modes = []
    if spec.constraints.on_demand or offer.kind == "on_prem":
        modes.append(False)
    if spec.constraints.spot and offer.has_spot:
        modes.append(True)
    parts = []
    checkpoint_hours = shape.params_total * 16 / (sp.checkpoint_gbytes_per_s * 1e9) / 3600
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
    tables = [t for t in tables if t]
    if not tables:
        return CandidateTable(offers, {})
    columns = {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}
    columns["cost_per_million_tokens"] = columns["cost"] / target * 1e6
    return CandidateTable(offers, columns)


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
    front, best_hours = [], math.inf
    for i in idx:
        if table["hours"][i] < best_hours:
            front.append(i)
            best_hours = table["hours"][i]
    return np.array(front, dtype=int)


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
    return Decision(None, table, feasible, pareto, target, problems)


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
