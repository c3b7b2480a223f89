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
import datetime as dt
import functools
import math
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field

import numpy as np

from gptplan import families, money
from gptplan import precision as precision_table
from gptplan.memory import (
    GIB,
    MAY_FIT_SAVING,
    MEMORY_RATIO_P90,
    TERMS,
    device_memory_args,
    layout_memory_bytes,
    memory_band,
    memory_fit,
)
from gptplan.money import checkpoint_bytes
from gptplan.plan import (
    LAYOUT_RULES,
    RECOMPUTE_MODES,
    SHARDING_STAGES,
    tensor_parallel_divides,
)
from gptplan.steptime import Device, Rates, step_time_parts
from gptplan.tokenizer import padded_vocab
from planner import costmodel as cm
from planner import coverage, spotrisk
from planner.corpus_stats import CorpusStatistics
from planner.hardware import Offer, Profile
from planner.pricebook import PriceFacts, candidate_disk, price_date, price_facts
from planner.skyfacts import EFA_SKYPILOT, PINNED_SKYPILOT
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
    capacity: str = ""  # "spot" / "on_demand": this region is priced for that capacity only
    where: str = ""  # which region(s) the prices come from, when the instance has several

    @property
    def label(self) -> str:
        return f"{self.profile.name} @ {self.offer.key}" + (
            f" ({self.where})" if self.where else ""
        )

    @property
    def price(self) -> PriceFacts:
        return self.facts if self.facts is not None else price_facts([self])[0]


class Columns(MutableMapping[str, np.ndarray]):
    """A table's columns kept as the offers' parts, each column joined into one array the
    first time it is read (then the parts' copies are dropped): choosing reads a few of the
    forty columns, and joining every column of millions of rows was the search's largest
    memory-bound cost. `derived`: columns computed from the joined ones when first read."""

    def __init__(self, parts: list[dict], derived: dict[str, Callable] | None = None) -> None:
        self._parts = parts
        self._derived = dict(derived or {})
        self._names = list(parts[0]) + [k for k in self._derived if k not in parts[0]]
        self._joined: dict[str, np.ndarray] = {}
        self._ends = np.cumsum([len(next(iter(p.values()))) for p in parts])

    @property
    def rows(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._joined:
            if name in self._derived:
                self._joined[name] = self._derived[name](self)
            elif name in self._names:
                self._joined[name] = np.concatenate([p.pop(name) for p in self._parts])
            else:
                raise KeyError(name)
        return self._joined[name]

    def item(self, name: str, i: int):
        """Row i of a column, without joining it (a Python number)."""
        if name in self._joined or name in self._derived:
            return self[name][i].item()
        part = int(np.searchsorted(self._ends, i, side="right"))
        start = int(self._ends[part - 1]) if part else 0
        return self._parts[part][name][i - start].item()

    def __setitem__(self, name: str, values: np.ndarray) -> None:
        for p in self._parts:
            p.pop(name, None)
        self._derived.pop(name, None)
        self._joined[name] = values
        if name not in self._names:
            self._names.append(name)

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)
        for p in self._parts:
            p.pop(name, None)
        self._derived.pop(name, None)
        self._joined.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._names  # without joining it

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class CandidateTable:
    """One row per candidate configuration; every column a numpy array of equal length."""

    offers: list[OfferChoice]
    columns: MutableMapping[str, np.ndarray] = field(default_factory=dict)
    fixed_hours: float = 0.0  # paid hours that do not scale with throughput (start-up)
    params_total: float = 0.0  # the model's parameters (the interval depends on its size)
    restart_hours: float = 0.0  # from a preemption to training again
    family: str = families.DEFAULT_FAMILY  # the interval checks the published runs have it

    def __len__(self) -> int:
        if isinstance(self.columns, Columns):
            return self.columns.rows
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __getitem__(self, name: str) -> np.ndarray:
        if not self.columns:  # no candidate at all: every column is empty
            return np.zeros(0)
        return self.columns[name]

    def row(self, i: int) -> dict:
        cols = self.columns
        if isinstance(cols, Columns):
            out = {k: cols.item(k, i) for k in cols}
        else:
            out = {k: v[i].item() for k, v in cols.items()}
        choice = self.offers[out["offer"]]
        out["offer_choice"] = choice
        out["precision"] = precision_table.name_of(out["precision_code"])
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
            cov = coverage.for_profile(self.offers[o].profile, precision_table.name_of(p))
            sel = (offer == o) & (prec == p)
            if cov is None:
                continue
            axes = coverage.outside_axes(cov, **self._coverage_query(idx[sel]))
            n[sel] = coverage.outside_count(axes)
            eff = self.offers[o].profile.efficiency_for(precision_table.name_of(p))
            extra[sel] = eff.extrapolation_log_error
        return n, extra

    def outside_reasons(self, i: int) -> list[str]:
        """Why row i's interval is wider than its generation's, in words ([] if it is not)."""
        row = {k: self[k][i].item() for k in ("world", "tp", "pp", "seq")}
        row |= {k: self[k][i].item() for k in ("stage_code", "recompute_code")}
        prof = self.offers[int(self["offer"][i])].profile
        precision = precision_table.name_of(self["precision_code"][i])
        return coverage.row_reasons(prof, precision, self.params_total, self.family, row)

    def intervals(self, idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The 80% interval (tokens_per_s/hours/cost _p10/_p90) of rows `idx` (all if None).

        Computed on demand: it depends only on each row's point estimate and its profile's
        calibration spread (planner.costmodel.interval_from_throughput), so a million-row
        table need not carry six more columns."""
        idx = np.arange(len(self)) if idx is None else np.asarray(idx, dtype=int)

        def by_code(c: OfferChoice) -> np.ndarray:  # [precision code, (p10, p90)]
            return precision_table.TABLE.column(
                lambda r: c.profile.efficiency_for(r.name).interval_ratios(self.params_total),
                fill=(1.0, 1.0),
            )

        ratios = np.array([by_code(c) for c in self.offers])
        lo, hi = ratios[..., 0], ratios[..., 1]
        offer, prec = self["offer"][idx], self["precision_code"][idx]
        p10, p90 = coverage.widen(lo[offer, prec], hi[offer, prec], *self.outside_count(idx))
        # the physical cap (planner.coverage.mfu_cap): the interval's top never above the
        # best 16-bit MFU published for the generation; the point estimate (the model's
        # median) is never clamped, so a point at or past the cap makes the top the point
        caps = np.array([getattr(coverage.mfu_cap(c.profile), "mfu", np.inf) for c in self.offers])
        ceiling = caps[offer] / np.maximum(self["mfu"][idx], 1e-12)
        capped = p90 > ceiling
        p90 = np.maximum(np.minimum(p90, ceiling), 1.0)
        p10 = np.minimum(p10, p90)
        out = cm.interval_from_throughput(
            tokens_per_s=self["tokens_per_s"][idx],
            hours=self["hours"][idx],
            fixed_hours=self.fixed_hours,
            cost=self["cost"][idx],
            p10_ratio=p10,
            p90_ratio=p90,
        )
        return out | self._risk_interval(idx, out) | {"throughput_capped": capped}

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
    """The offers the spec allows, one price per capacity: of an instance priced in several
    regions, on-demand and spot come from one region each (the cheapest region for that
    capacity; both from one region when it is the cheapest for both), or with
    constraints.any_region from the cheapest region of each. This machine's own offers
    (provider 'local') only when the spec names its profile or offer."""
    c = spec.constraints
    groups: dict[tuple[str, str], list[Offer]] = {}
    for name, prof in profiles.items():
        if c.profiles and name not in c.profiles:
            continue
        for offer in (*prof.offers, *owned_offers(spec, profiles).get(name, ())):
            if c.offers and offer.key not in c.offers:
                continue
            # shipped owned machines are examples: planned only when named; owned machines
            # of a user-data price list with constraints.owned_hardware; the spec's [[owned]]
            # always (they are what the team declared)
            if offer.owned and offer.example and offer.key not in c.offers:
                continue
            if (
                offer.owned
                and not offer.declared
                and not (c.owned_hardware or offer.key in c.offers)
            ):
                continue
            if offer.provider == "local" and not (name in c.profiles or offer.key in c.offers):
                continue
            groups.setdefault((name, offer.key), []).append(launchable(offer, c))
    choices = []
    for (name, _), offers in groups.items():
        prof = profiles[name]
        for offer, capacity, where in region_choices(offers, any_region=c.any_region):
            if (capacity == "spot" and not c.spot) or (capacity == "on_demand" and not c.on_demand):
                continue
            choices.append(
                OfferChoice(prof, offer, spec.rate(offer.currency), capacity=capacity, where=where)
            )
    facts = price_facts(
        choices,
        stale_after_days=c.max_price_age_days,
        preemption_override=spec.spot.preemptions_per_node_hour,
    )
    return [dataclasses.replace(ch, facts=f) for ch, f in zip(choices, facts, strict=True)]


def launchable(offer: Offer, c) -> Offer:
    """The offer as the launch path gets it. The pinned SkyPilot 0.9.2 attaches no EFA to EC2
    VMs; 0.10.3 is the first that does (planner.skyfacts, PINNED_SKYPILOT / EFA_SKYPILOT, with
    the sources). By default (constraints.launcher_attaches_efa = false) an AWS instance whose
    network is EFA has no inter-node figure it would get, and is planned single-node; with true
    it is costed on EFA, its task sets resources.network_tier: best and says what the launch
    needs (planner.skyfacts.efa_requirement)."""
    if (
        offer.provider == "aws"
        and "EFA" in offer.network_source
        and offer.inter_node_gbits_per_s > 0
        and not c.launcher_attaches_efa
    ):
        return dataclasses.replace(
            offer,
            inter_node_gbits_per_s=0.0,
            network_source=f"{offer.network_source}; but SkyPilot {PINNED_SKYPILOT} (the pinned "
            f"launcher) attaches no EFA: planned single-node (constraints.launcher_attaches_efa "
            f"= true to cost it on EFA, launched with SkyPilot >= {EFA_SKYPILOT})",
        )
    return offer


def owned_offers(spec: Spec, profiles: dict[str, Profile]) -> dict[str, list[Offer]]:
    """The spec's [[owned]] machines as offers, by profile; an unknown profile is the spec's
    error (its file and key)."""
    from planner.spec import SpecError

    out: dict[str, list[Offer]] = {}
    for i, o in enumerate(spec.owned):
        if o.profile not in profiles:
            raise SpecError(
                f"{o.profile!r} is not a hardware profile; allowed: {', '.join(profiles)}",
                file=spec.path,
                key=f"owned[{i}].profile",
            )
        fields = {k: v for k, v in o.offer_fields().items() if k != "profile"}
        out.setdefault(o.profile, []).append(Offer(**fields, declared=True))
    return out


def region_choices(
    offers: list[Offer], *, any_region: bool = False
) -> list[tuple[Offer, str, str]]:
    """(offer, capacity it is priced for ('' = both), which region) for the current price rows
    of one instance. One row: itself. Several regions: the cheapest on-demand region and the
    cheapest spot region, each with its own region's other price (one row when they are the
    same region); with any_region, one offer with the cheapest of each, regions named."""
    if len(offers) <= 1 or offers[0].kind != "cloud":
        return [(o, "", "") for o in offers]
    n = len({o.region for o in offers})
    od = min(
        (o for o in offers if o.on_demand_per_hour > 0),
        key=lambda o: (o.on_demand_per_hour, o.region),
        default=None,
    )
    # a region whose spot price looks like a placeholder (Offer.price_flag) is the spot
    # region only when no other region sells spot; then it is flagged like an outlier
    spot_rows = [o for o in offers if o.spot_per_hour > 0]
    sp = min(
        [o for o in spot_rows if not o.price_flag] or spot_rows,
        key=lambda o: (o.spot_per_hour, o.region),
        default=None,
    )
    if any_region and od is not None and sp is not None and od is not sp:
        older = min((od, sp), key=lambda o: price_date(o.as_of) or dt.date.min)
        merged = dataclasses.replace(
            od,
            spot_per_hour=sp.spot_per_hour,
            spot_region=sp.region,
            price_flag=sp.price_flag,
            as_of=older.as_of,
            source=f"on-demand: {od.source}; spot: {sp.source}",
        )
        return [(merged, "", f"on-demand {od.region}, spot {sp.region}")]
    if od is None or sp is None or od is sp:
        best = od or sp
        assert best is not None
        return [(best, "", f"{best.region}, cheapest of {n}")]
    return [
        (od, "on_demand", f"on-demand {od.region}, cheapest of {n}"),
        (sp, "spot", f"spot {sp.region}, cheapest of {n}"),
    ]


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
    common: evaluate_space joins each column once, into the whole table."""
    from gptplan.plan import tensor_parallel_fits_node

    m = spec.model_section()
    prof, offer = choice.profile, choice.offer
    c, s = spec.constraints, spec.search
    gpn = offer.gpus_per_node
    precisions = [precision_table.code(p) for p in c.precisions if p in prof.precisions]
    tps = [1] if prof.device == "cpu" else s.tensor_parallel
    # each tensor-parallel degree with the vocabulary it needs (padded_vocab: unchanged where
    # tp divides it), so every row is priced with the model its plan would write
    by_vocab: dict[int, list[int]] = {}
    for t in tps:
        if tensor_parallel_fits_node(t, gpn):
            by_vocab.setdefault(padded_vocab(m.vocab_size, t), []).append(t)
    out = []
    for vocab, group in by_vocab.items():
        padded = spec if vocab == m.vocab_size else with_vocab(spec, vocab)
        pm = padded.model_section()
        group = [t for t in group if tensor_parallel_divides(pm, t)]
        if group:
            out += _offer_layout_parts(padded, choice, index, target, precisions, group)
    return out


def with_vocab(spec: Spec, vocab: int) -> Spec:
    """The spec with its model's vocab_size set (padded for a tensor-parallel degree)."""
    return dataclasses.replace(spec, planned_vocab_size=vocab)


def _offer_layout_parts(
    spec: Spec, choice: OfferChoice, index: int, target: float, precisions, tps
) -> list[dict]:
    prof, offer = choice.profile, choice.offer
    s = spec.search
    gpn = offer.gpus_per_node
    g = _layout_grid(spec, prof, offer, precisions, tps)
    if g is None:
        return []
    g, batch_ranks = _with_accumulations(spec, gpn, g)
    if not len(batch_ranks):
        return []
    g, batch_ranks = _with_sharding_degrees(s, gpn, g, batch_ranks)
    if not len(batch_ranks):
        return []
    return _evaluated_parts(spec, choice, index, target, g)


def offer_node_cap(max_nodes: int, offer: Offer) -> int:
    """Most nodes of one offer: owned machines their declared count alone (constraints.max_nodes
    caps rented offers), a rented offer constraints.max_nodes (and its own cap if stated)."""
    if offer.owned and offer.max_nodes:
        return offer.max_nodes
    return min(max_nodes, offer.max_nodes) if offer.max_nodes else max_nodes


def _layout_grid(
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
        and (prof.device != "cpu" or p == 1)
        and (p == 1 or not family.pipeline_why_not)  # gptplan.families: pp offered?
    ]
    stages = [SHARDING_STAGES.index(z) for z in s.sharding if prof.device != "cpu" or z == ""]
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
    ok = np.logical_and.reduce(list(layout_rules(m, gpn, g).values()))
    return {k: v[ok] for k, v in g.items()}


def _with_accumulations(spec: Spec, gpn: int, g: dict) -> tuple[dict, np.ndarray]:
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


def _with_sharding_degrees(
    s, gpn: int, g: dict, batch_ranks: np.ndarray
) -> tuple[dict, np.ndarray]:
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


def _evaluated_parts(
    spec: Spec, choice: OfferChoice, index: int, target: float, g: dict
) -> list[dict]:
    """The layouts `g` of one offer with flash attention and partial recompute, evaluated and
    priced (on-demand and spot parts)."""
    m = spec.model_section()
    prof, offer = choice.profile, choice.offer
    c, s = spec.constraints, spec.search
    batch_ranks = g["dp"] * g["shard_degree"]
    g["flash"] = np.full(len(batch_ranks), 0)
    if s.flash_attention and prof.flash_attention and m.hidden_size // m.num_attention_heads <= 256:
        g["flash"] = precision_table.of_codes("flash_attention", g["precision_code"]).astype(int)
    g = partial_recompute_rows(m, prof, g, c.memory_headroom, s.recompute_layers)
    out = evaluate_layouts(m, prof, offer, g, memory_headroom=c.memory_headroom)
    out["offer"] = np.full(len(out["nodes"]), index)
    steps = np.ceil(target / out["tokens_per_step"])
    out["steps"] = steps
    out["train_hours"] = steps * out["step_time_s"] / 3600
    return _price(spec, choice, cm.ModelShape.from_section(m), out)


def partial_recompute_rows(m, prof: Profile, g: dict, headroom: float, pinned) -> dict:
    """Partial recompute as a search dimension (column rc_layers: layers recomputed per
    pipeline stage, 0 = all). Only for a family with per-layer recompute (gptplan.families:
    FamilySpec.partial_recompute_why_not says why not), and not at the granularities its
    pipeline class refuses (Llama: 'full', LlamaForCausalLMPipe asserts no_recompute_layers is
    empty). `pinned` (search.recompute_layers, per stage): exactly those values. Otherwise
    every row that recomputes also gets, as an added row, the fewest layers per stage k at
    which it surely fits (memory is linear in k: closed form, vectorised), when 0 < k <
    ceil(L/p): it runs faster than recomputing every layer, at the same memory rule."""
    n = len(g["tp"])
    g["rc_layers"] = np.zeros(n, dtype=int)
    code, pp = g["recompute_code"], g["pp"]
    family = families.get(m.family)
    refused = [RECOMPUTE_MODES.index(r) for r in family.partial_recompute_pipeline_refuses]
    ok = (code > 0) & ~((pp > 1) & np.isin(code, refused))
    ok &= not family.partial_recompute_why_not
    stage_layers = np.ceil(m.num_hidden_layers / pp).astype(int)
    if pinned:
        parts = []
        for k in pinned:
            sel = np.flatnonzero((k == 0) | (ok & (k < stage_layers)))
            part = {key: v[sel] for key, v in g.items()}
            part["rc_layers"] = np.where(part["recompute_code"] > 0, k, 0)
            parts.append(part)
        return {key: np.concatenate([p[key] for p in parts]) for key in g}
    idx = np.flatnonzero(ok)
    if not len(idx):
        return g
    shape = cm.ModelShape.from_section(m)
    sub = {key: v[idx] for key, v in g.items()}
    args = memory_args(prof)
    every = layout_memory_bytes(shape, sub, **args)
    plain = layout_memory_bytes(shape, {**sub, "recompute_code": np.zeros(len(idx), int)}, **args)
    S = stage_layers[idx]
    per_layer = (plain - every) / S  # bytes one more recomputed layer saves
    target = prof.memory_gb * GIB * headroom / MEMORY_RATIO_P90
    saves = per_layer > 0
    k = np.where(saves, np.ceil((plain - target) / np.where(saves, per_layer, 1.0)), 0.0)
    k = np.clip(k, 0, S).astype(int)
    add = saves & (k >= 1) & (k < S)
    extra = {key: v[idx[add]] for key, v in g.items()}
    extra["rc_layers"] = k[add]
    return {key: np.concatenate([g[key], extra[key]]) for key in g}


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

    Memory (gptplan.memory.memory_band / memory_fit): a row whose band's high end (each
    term at its worst credible error) is within the usable limit (memory_gb x
    memory_headroom) surely fits; past it but with its optimistic end within the card's
    physical memory it is kept as `may_fit` (chosen only past MAY_FIT_SAVING, `decide`);
    only where even the optimistic end exceeds the card is it cut.
    """
    shape = cm.ModelShape.from_section(m)
    gpn = offer.gpus_per_node
    g = {k: np.asarray(v) for k, v in g.items()}
    world = g["nodes"] * gpn
    batch_ranks = g["dp"] * g["shard_degree"]
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    eff = prof.efficiency  # framework constants (memory overhead, comm overlap)

    def by_precision(attr: str) -> np.ndarray:
        return precision_table.TABLE.column(
            lambda r: getattr(
                efficiency if efficiency is not None else prof.efficiency_for(r.name), attr
            )
        )[g["precision_code"]]

    g.setdefault("rc_layers", np.zeros(len(g["tp"]), dtype=int))
    fit = _memory_columns(shape, g, prof, memory_headroom)

    peak = precision_table.TABLE.column(lambda r: prof.peak_for(r.name))[g["precision_code"]] * 1e12
    dev = _device(prof, offer, peak)
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
    speed = _speed(m, prof, g["seq"], parts["step_time_s"], tokens_per_step, world, peak)
    return _layout_columns(m, g, gpn, tokens_per_step, fit, parts, speed)


def _memory_columns(shape, g: dict, prof: Profile, memory_headroom: float) -> dict:
    """Modelled memory per row (GB) with its band (gptplan.memory.memory_band), the widest
    term and the verdict (memory_fit); `memory_point_fits`: the point itself within the
    usable memory (a "may fit" row past it is never chosen while another fits)."""
    terms = layout_memory_bytes(shape, g, terms=True, **memory_args(prof))
    low, mem, high, decider = memory_band(terms)
    usable = prof.memory_gb * GIB * memory_headroom
    sure, may_fit = memory_fit(low, high, prof.memory_gb * GIB, memory_headroom)
    return {
        "memory_gb": mem / cm.GB,
        "fits": sure | may_fit,
        "may_fit": may_fit,
        "memory_low_gb": low / cm.GB,
        "memory_high_gb": high / cm.GB,
        "memory_decider": decider,
        "memory_point_fits": mem <= usable,
    }


def _speed(m, prof: Profile, seq, step_time, tokens_per_step, world, peak) -> dict:
    """Step time, tokens/s and MFU per row: the model's median, never clamped (only the
    interval's top is held to planner.coverage.mfu_cap, `CandidateTable.intervals`)."""
    f_model = cm.model_flops_per_token(m, seq)
    tokens_per_s = tokens_per_step / step_time
    mfu = f_model * tokens_per_s / (world * peak)
    return {"step_time_s": step_time, "tokens_per_s": tokens_per_s, "mfu": mfu}


def memory_args(prof: Profile) -> dict:
    """The profile's terms of gptplan.memory.layout_memory_bytes beyond the layout: the cited
    GPU-side terms on a GPU, the profile's measured ones elsewhere
    (gptplan.memory.device_memory_args)."""
    eff = prof.efficiency
    return device_memory_args(prof.device, eff.memory_overhead_gb, eff.fragmentation)


def _device(prof: Profile, offer: Offer, peak: np.ndarray) -> Device:
    """What the step-time composition needs of the offer's devices, at `peak` FLOP/s per row."""
    inter = offer.inter_node_gbits_per_s / 8 * 1e9 if offer.inter_node_gbits_per_s else 1.0
    return Device(
        peak,
        prof.sm_count,
        prof.memory_bandwidth_gbytes_per_s * 1e9,
        prof.intra_node_gbytes_per_s * 1e9,
        inter,
        offer.gpus_per_node,
    )


def _layout_columns(
    m, g: dict, gpn: int, tokens_per_step: np.ndarray, fit: dict, parts: dict, speed: dict
) -> dict[str, np.ndarray]:
    """evaluate_layouts' columns, in the table's order."""
    n = len(speed["step_time_s"])
    world = g["nodes"] * gpn
    layout = "nodes precision_code seq micro acc tp pp vpp dp shard_degree stage_code"
    out = {"nodes": g["nodes"], "gpus_per_node": np.full(n, gpn), "world": world}
    out |= {k: g[k] for k in layout.split()[1:] + ["recompute_code", "sp", "flash"]}
    out |= {"tokens_per_step": tokens_per_step, "memory_gb": fit["memory_gb"]}
    out |= {"rc_layers": g["rc_layers"], "fits": fit["fits"], "may_fit": fit["may_fit"]}
    keys = ("memory_low_gb", "memory_high_gb", "memory_decider", "memory_point_fits")
    out |= {k: fit[k] for k in keys}
    out |= {"efficiency": parts["efficiency"], "hidden_per_tp": m.hidden_size / g["tp"]}
    out["step_time_s"] = speed["step_time_s"]
    out |= {k: parts[k] for k in ("compute_s", "comm_s", "dp_sync_s", "tp_s", "pp_s", "opt_s")}
    out |= {"bubble": parts["bubble"], "tokens_per_s": speed["tokens_per_s"]}
    out["tokens_per_s_per_device"] = speed["tokens_per_s"] / world
    out["mfu"] = speed["mfu"]
    return out


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


def memory_breakdown(m, prof: Profile, row: dict, gpus_per_node: int) -> dict:
    """One layout's modelled peak per device, term by term (gptplan.memory.memory_terms), in
    GB, and the single changes that free the most (each re-evaluated with the same terms):
    {"terms": {name: GB}, "total_gb", "changes": [(words, GB freed)] most first}. `row`
    holds the layout columns (a candidate table row)."""
    shape = cm.ModelShape.from_section(m)
    args = memory_args(prof)
    names = (
        "seq micro acc tp pp vpp stage_code shard_degree recompute_code sp flash "
        "precision_code dp rc_layers nodes"
    ).split()
    base = {k: np.array([row.get(k, 0)]) for k in names}

    def total(g):
        return float(layout_memory_bytes(shape, g, **args)[0]) / cm.GB

    terms = layout_memory_bytes(shape, base, terms=True, **args)
    now = total(base)
    changes = []
    for words, change in _memory_alternatives(m, row, gpus_per_node):
        g = dict(base) | {k: np.array([v]) for k, v in change.items()}
        changes.append((words, now - total(g)))
    changes.sort(key=lambda c: -c[1])
    return {
        "terms": {k: float(v[0]) / cm.GB for k, v in terms.items()},
        "total_gb": now,
        "changes": [c for c in changes if c[1] > 0],
    }


def _memory_alternatives(m, row: dict, gpus_per_node: int) -> list[tuple[str, dict]]:
    """memory_breakdown's single changes to a layout row: (words, changed columns)."""
    world = int(row["nodes"]) * gpus_per_node
    batch = int(row["dp"]) * int(row["shard_degree"])
    alts: list[tuple[str, dict]] = []
    stage, code, tp, pp = (int(row[k]) for k in ("stage_code", "recompute_code", "tp", "pp"))
    if batch > 1 and stage < 3 and (pp == 1 or stage < 1):
        alts.append(
            (
                f"sharding {SHARDING_STAGES[stage + 1]} over {batch} ranks",
                {"stage_code": stage + 1, "shard_degree": batch, "dp": 1},
            )
        )
    if code < 3 or int(row.get("rc_layers", 0)):
        alts.append(
            (
                f"recompute {RECOMPUTE_MODES[3]} on every layer",
                {"recompute_code": 3, "rc_layers": 0},
            )
        )
    if tp > 1 and not int(row["sp"]):
        alts.append(("sequence parallel", {"sp": 1}))
    if int(row["micro"]) > 1:
        alts.append(
            (
                f"micro-batch {int(row['micro']) // 2} x accumulation {int(row['acc']) * 2}",
                {"micro": int(row["micro"]) // 2, "acc": int(row["acc"]) * 2},
            )
        )
    if 2 * tp <= gpus_per_node and bool(tensor_parallel_divides(m, 2 * tp)) and batch % 2 == 0:
        alts.append(
            (
                f"tensor parallel {2 * tp}",
                {
                    "tp": 2 * tp,
                    "dp": max(1, int(row["dp"]) // 2) if stage == 0 else int(row["dp"]),
                    "shard_degree": int(row["shard_degree"]) // 2 if stage else 1,
                },
            )
        )
    if (
        2 * pp <= m.num_hidden_layers
        and world % (tp * pp * 2) == 0
        and batch % 2 == 0
        and stage < 2
    ):
        alts.append(
            (
                f"pipeline parallel {2 * pp}",
                {
                    "pp": 2 * pp,
                    "dp": max(1, int(row["dp"]) // 2) if stage == 0 else int(row["dp"]),
                    "shard_degree": int(row["shard_degree"]) // 2 if stage else 1,
                    "acc": max(int(row["acc"]), 2 * pp),
                },
            )
        )
    return alts


def memory_share(row, prof: Profile) -> tuple[float, float, float]:
    """A layout row's modelled peak per device as a share of the card's physical memory,
    with its band (gptplan.memory.memory_band: each term's worst credible error):
    (point, low, high)."""
    card = prof.memory_gb * GIB if prof.memory_gb else float("nan")
    return tuple(float(row[k]) * 1e9 / card for k in MEMORY_GB_KEYS)  # type: ignore[return-value]


MEMORY_GB_KEYS = ("memory_gb", "memory_low_gb", "memory_high_gb")


def deciding_term(row) -> str:
    """The memory term whose error moves the band's top the most (gptplan.memory.TERMS)."""
    return TERMS[int(row["memory_decider"])].replace("_", " ")


def may_fit_note(row, prof: Profile, memory_headroom: float) -> str:
    """The flag a user sees on a row kept inside the memory model's band."""
    share, lo, hi = memory_share(row, prof)
    return (
        f"may fit (modelled {float(row['memory_gb']) * cm.GB / 2**30:.1f} GiB = {share:.0%} "
        f"of the {prof.memory_gb:g} GiB card, band {lo:.0%}-{hi:.0%} from each term's worst "
        f"credible error, decided by the {deciding_term(row)} term; usable "
        f"{memory_headroom:.0%}): probe it before a long run"
    )


def _price(spec: Spec, choice: OfferChoice, shape: cm.ModelShape, rows: dict) -> list[dict]:
    """Duplicate rows for spot and on-demand and add time, money and energy. Spot rows carry
    their expected preemptions (the offer's interruption rate, planner.pricebook) and what the
    same plan costs on-demand; with spot.fallback_wait_hours they are priced as spot with
    on-demand fallback (the provider's chance that spot cannot be had)."""
    offer, prof, sp = choice.offer, choice.profile, spec.spot
    modes = []
    if (
        (spec.constraints.on_demand or offer.owned)
        and offer.has_on_demand
        and choice.capacity != "spot"
    ):
        modes.append(False)
    if spec.constraints.spot and offer.has_spot and choice.capacity != "on_demand":
        modes.append(True)
    parts = []
    checkpoint_hours = cm.checkpoint_write_hours(
        state_bytes=checkpoint_bytes(
            shape.params_total,
            master_weights=(
                precision_table.of_codes("master_weights", rows["precision_code"])
                & (spec.training.fp16_opt_level == "O2")
            ),
        ),
        nodes=rows["nodes"],
        node_gbytes_per_s=sp.checkpoint_gbytes_per_s,
        storage_cap_gbytes_per_s=offer.storage_gbytes_per_s,
    )
    od_price = offer.node_price_per_hour(spot=False, tdp_w=prof.tdp_w) * choice.rate
    od_hours = _hours(rows, checkpoint_hours, 0.0, sp)[0]
    disk_gb, disk_rate = candidate_disk(spec, choice, shape.params_total, rows)
    od_node = od_price + disk_rate  # the same plan on-demand, with the task's disk
    risk = choice.price.risk
    for spot in modes:
        r = dict(rows)
        n = len(r["nodes"])
        hours, interval, useful, preemptions = _hours(
            rows, checkpoint_hours, risk.rate if spot else 0.0, sp
        )
        price = offer.node_price_per_hour(spot=spot, tdp_w=prof.tdp_w) * choice.rate + disk_rate
        cost = money.cost_of_hours(price_per_node_hour=price, nodes=r["nodes"], hours=hours)
        cost_od = money.cost_of_hours(price_per_node_hour=od_node, nodes=r["nodes"], hours=od_hours)
        if spot and sp.fallback_wait_hours > 0 and od_price > 0:
            p = risk.unavailable_probability  # expected cost; the deadline must hold either way
            cost = (1 - p) * cost + p * cost_od
            hours = np.maximum(hours, od_hours + sp.fallback_wait_hours)
            price = money.price_of(cost=cost, nodes=r["nodes"], hours=hours)
            preemptions = (1 - p) * preemptions
        r["spot"] = np.full(n, spot)
        r["useful_fraction"] = useful
        r["checkpoint_interval_h"] = interval
        r["hours"] = hours
        r["price_node_hour"] = np.broadcast_to(price, (n,)).astype(float)
        r["cost"], r["disk_gb"], r["disk_cost"] = cost, disk_gb, disk_rate * r["nodes"] * hours
        r["cost_on_demand"] = cost_od if od_price > 0 else np.full(n, np.nan)
        r["preemptions"] = preemptions
        # what the cost counts: an owned node's devices, host and PUE (Offer.node_power_kw)
        r["energy_kwh"] = r["nodes"] * offer.node_power_kw(prof.tdp_w) * hours
        parts.append(r)
    return parts


def _cost_per_million_tokens(columns: Columns, target: float) -> np.ndarray:
    return columns["cost"] / target * 1e6


def evaluate_space(spec: Spec, offers: list[OfferChoice], target: float) -> CandidateTable:
    # every offer's parts (on-demand, spot), each column joined into the whole table when
    # first read (Columns): concatenating a million rows is memory-bound; diagnostics of
    # single evaluations (planner explain, the published-run fit) stay out of the big table
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
    per_million = functools.partial(_cost_per_million_tokens, target=target)
    columns = Columns(tables, {"cost_per_million_tokens": per_million})
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
    """The rows that fit, cheapest first, faster first among equal cost (then by row): sorted
    once per table (the search ranks the same table under several masks, all within the
    fitting rows) and kept while its cost, hours and fits columns are the same arrays."""
    cols = (table["cost"], table["hours"], table["fits"])
    cached = getattr(table, "_cost_order", None)
    if cached is not None and all(a is b for a, b in zip(cached[0], cols, strict=True)):
        return cached[1]
    order = cheapest_first(cols[0], cols[1], np.flatnonzero(cols[2]))
    try:
        table._cost_order = (cols, order)  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return order


def cheapest_first(cost: np.ndarray, hours: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rows `idx` in the order of np.lexsort((hours, cost)) over them (cost, then hours, then
    row), faster: one unstable sort by cost, then each run of equal cost (or NaN) put in row
    order by one sort of (run, row) keys, and only runs whose hours differ sorted by hours."""
    order = idx[np.argsort(cost[idx])]
    c = cost[order]
    tied = (c[1:] == c[:-1]) | (np.isnan(c[1:]) & np.isnan(c[:-1]))
    if not tied.any():
        return order
    at = np.zeros(len(order), dtype=bool)
    at[1:] |= tied
    at[:-1] |= tied
    pos = np.flatnonzero(at)
    starts = np.ones(len(pos), dtype=bool)
    starts[1:] = ~tied[pos[1:] - 1]  # a tied position whose predecessor is not its equal
    run = np.cumsum(starts) - 1
    n = max(int(order.max()) + 1, 1)
    keys = np.sort(run.astype(np.int64) * n + order[pos])
    rows = keys % n
    order[pos] = rows
    h = hours[rows]
    first = np.flatnonzero(starts)
    differs = np.zeros(len(first), dtype=bool)
    differs[run[h != h[first][run]]] = True  # NaN hours differ from themselves: sorted too
    mixed = np.flatnonzero(differs[run])
    if len(mixed):  # runs with more than one value of hours: the two-key sort on them alone
        sub = rows[mixed]
        order[pos[mixed]] = sub[np.lexsort((hours[sub], run[mixed]))]
    return order


def ranked(table: CandidateTable, mask: np.ndarray) -> np.ndarray:
    """Row indices under `mask`, cheapest first, faster first among equal cost."""
    if not len(table):
        return np.zeros(0, dtype=int)
    mask = np.asarray(mask, dtype=bool)
    if (mask & ~table["fits"]).any():  # not within the fitting rows: sorted on its own
        return cheapest_first(table["cost"], table["hours"], np.flatnonzero(mask))
    order = cost_order(table)
    return order[mask[order]]


def first_ranked(table: CandidateTable, mask: np.ndarray) -> int | None:
    """ranked(table, mask)[0] without sorting: the cheapest row, the fastest of equal cost,
    the first of equal both (None when the mask is empty)."""
    idx = np.flatnonzero(mask)
    if not len(idx):
        return None
    cost, hours = table["cost"][idx], table["hours"][idx]
    if np.isnan(cost).any() or np.isnan(hours).any():
        return int(ranked(table, mask)[0])
    best = idx[cost == cost.min()]
    return int(best[np.argmin(table["hours"][best])])


# On owned machines time is free up to their count: a plan on more of them costs the same
# energy (GPU-hours) plus a little communication. Of owned plans whose cost is within the cost
# model's own error of the cheapest one (the profile's median held-out error, fit_error, at
# least OWNED_EQUAL_COST): equal cost as far as the model can tell, so the fastest is chosen
# (2 nodes for 3 days rather than 1 node for 6).
OWNED_EQUAL_COST = 0.05


def owned_fastest(table: CandidateTable, idx: np.ndarray, best: int) -> int:
    """`best`, or, when it runs on owned machines, the fastest row of the same owned offer
    whose cost is equal to its within the model's error (see OWNED_EQUAL_COST)."""
    offer = int(table["offer"][best])
    choice = table.offers[offer]
    if not choice.offer.owned:
        return best
    tolerance = max(OWNED_EQUAL_COST, choice.profile.efficiency.fit_error)
    cost, hours = table["cost"], table["hours"]
    same = idx[(table["offer"][idx] == offer) & (cost[idx] <= cost[best] * (1 + tolerance))]
    if not len(same):
        return best
    return int(same[np.argmin(hours[same])])


def pareto_front(table: CandidateTable, mask: np.ndarray) -> np.ndarray:
    """Rows not beaten on both cost and hours (cheapest first)."""
    idx = np.flatnonzero(mask)
    if not len(idx):
        return np.zeros(0, dtype=int)
    cost, hours = table["cost"], table["hours"]
    idx = cheapest_first(cost, hours, _undominated(cost, hours, idx))
    h = hours[idx]
    before = np.concatenate([[math.inf], np.minimum.accumulate(h)[:-1]])
    return idx[h < before].astype(int)


def _undominated(cost: np.ndarray, hours: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rows `idx` less those a strictly cheaper row beats or equals on hours (never on the
    front, and dropping them changes no survivor's verdict: whatever beats one, a survivor
    beats too): costs cut into bins at a sample of themselves, and a row dropped when an
    earlier bin holds a row as fast. Linear; the front is then sorted from far fewer rows."""
    if len(idx) < 4096:
        return idx
    c, h = cost[idx], hours[idx]
    edges = np.unique(c[:: len(c) // 1024])
    b = np.searchsorted(edges, c, side="right")  # bin b: edges[b-1] <= cost < edges[b]
    fastest = np.full(len(edges) + 1, np.inf)
    with np.errstate(invalid="ignore"):  # NaN hours: their bin's minimum NaN, none dropped
        np.minimum.at(fastest, b, h)
    before = np.concatenate([[np.inf], np.minimum.accumulate(fastest)[:-1]])
    return idx[~(h >= before[b])]


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
    # when the chosen row only "may fit": the cheapest feasible row that surely fits (None when
    # no row surely fits); a may-fit row is chosen only MAY_FIT_SAVING cheaper than it
    sure_alternative: int | None = None
    smallest_memory_row: int | None = None  # when nothing fits: the layout needing least


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


def tokens_bought_interval(spec: Spec, table: CandidateTable, target: float) -> dict:
    """What the budget buys (tokens_within) with the cost interval of the plan that buys it:
    tokens at which that plan's modelled cost meets the budget (50% probability of staying
    within it), its p90 cost (90%) and its p10 cost (10%); modelled. {} without a budget."""
    c = spec.constraints
    usable = table["fits"] & (~outlier_rows(table) if not c.allow_outlier_prices else True)
    if not usable.any() or not c.budget:
        return {}
    rows = np.flatnonzero(usable)
    cost, hours = table["cost"][rows], table["hours"][rows]
    fixed = table.fixed_hours
    deadline_share = (
        np.maximum(c.deadline_hours - fixed, 0.0) / np.maximum(hours - fixed, 1e-12)
        if c.deadline_hours
        else np.full(len(rows), np.inf)
    )
    share = np.minimum(c.budget / cost, deadline_share)
    k = int(np.argmax(share))
    iv = table.intervals(np.array([rows[k]]))
    p10, p90 = float(iv["cost_p10"][0]), float(iv["cost_p90"][0])
    cap = float(deadline_share[k])
    return {
        "tokens": float(target * share[k]),
        "tokens_p90_cost": float(target * min(c.budget / p90, cap)),
        "tokens_p10_cost": float(target * min(c.budget / p10, cap)),
        "row": int(rows[k]),
    }


def minimum_budget(spec: Spec, table: CandidateTable) -> int | None:
    """The row of the cheapest plan that meets the deadline, memory and price rules."""
    return first_ranked(table, eligible_mask(spec, table))


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
    least = minimum_budget(spec, table)
    base = Decision(
        None,
        table,
        feasible,
        pareto_front(table, fits),
        target,
        minimum_budget=float(table["cost"][least]) if least is not None else None,
        minimum_budget_row=least,
        tokens_bought=tokens_within(spec, table, target) if spec.constraints.budget else None,
    )
    cheapest = first_ranked(table, feasible)
    if cheapest is not None:  # owned machines: the fastest plan of equal cost
        cheapest = owned_fastest(table, np.flatnonzero(feasible), cheapest)
    if cheapest is not None:
        chosen, alternative = choose_fitting(table, feasible, cheapest)
        safer = precision_by_risk(table, feasible, chosen)
        if safer is not None:
            chosen, alternative = choose_fitting(
                table, feasible & (table["precision_code"] == table["precision_code"][safer]), safer
            )
        return dataclasses.replace(
            base,
            chosen=chosen,
            binding=_binding_constraint(spec, table, chosen),
            sure_alternative=alternative,
        )
    if not fits.any():
        return _nothing_fits(base)
    return dataclasses.replace(
        base, problems=_problems(spec, table, target, least, base.tokens_bought)
    )


def precision_by_risk(table: CandidateTable, feasible: np.ndarray, chosen: int) -> int | None:
    """The bf16 row to choose instead of an fp16 `chosen`, or None: for a model of at least
    gptplan.precision.BF16_PREFERRED_ABOVE_PARAMS parameters, the cheapest feasible bf16 row
    when fp16 is not more than FP16_MARGIN cheaper (the sources are in gptplan.precision)."""
    fp16, bf16 = precision_table.code("fp16"), precision_table.code("bf16")
    if int(table["precision_code"][chosen]) != fp16 or not precision_table.prefers_bf16(
        table.params_total
    ):
        return None
    best = first_ranked(table, feasible & (table["precision_code"] == bf16))
    if best is None:
        return None
    limit = table["cost"][chosen] / (1.0 - precision_table.FP16_MARGIN)
    return best if table["cost"][best] <= limit else None


def _nothing_fits(base: Decision) -> Decision:
    """The decision when no layout fits in device memory: the one needing the least."""
    table = base.table
    smallest = int(np.argmin(table["memory_gb"]))
    prof = table.offers[int(table["offer"][smallest])].profile
    need = float(table["memory_gb"][smallest])
    low = float(table["memory_low_gb"][smallest])
    return dataclasses.replace(
        base,
        problems=[
            f"nothing fits in device memory: the smallest configuration needs "
            f"{need:.1f} GB per device (modelled; {need * 1e9 / GIB:.1f} GiB; even the "
            f"band's optimistic end, {low * 1e9 / GIB:.1f} GiB, exceeds the "
            f"{prof.memory_gb:g} GiB card; the {deciding_term(table.row(smallest))} term "
            "decides the band's width); planner estimate --memory shows its terms"
        ],
        smallest_memory_row=smallest,
    )


def choose_fitting(table: CandidateTable, feasible: np.ndarray, cheapest: int):
    """The feasibility rule: (chosen row, surely-fitting alternative or None). The cheapest
    feasible row is chosen when it surely fits; a "may fit" row only when it costs more than
    MAY_FIT_SAVING less than the cheapest feasible row that surely fits (then that row is the
    alternative the chosen line prints), or when no row surely fits. A "may fit" row whose
    modelled point itself is past the usable memory is chosen only when nothing else fits."""
    if not bool(table["may_fit"][cheapest]):
        return cheapest, None
    point_fits = table["memory_point_fits"].astype(bool)
    best_sure = first_ranked(table, feasible & ~table["may_fit"].astype(bool))
    if best_sure is None:
        if point_fits[cheapest]:
            return cheapest, None
        best_point = first_ranked(table, feasible & point_fits)
        return (cheapest if best_point is None else best_point), None
    if point_fits[cheapest] and (
        table["cost"][cheapest] < (1.0 - MAY_FIT_SAVING) * table["cost"][best_sure]
    ):
        return cheapest, best_sure
    if not point_fits[cheapest]:
        best_point = first_ranked(table, feasible & point_fits & table["may_fit"].astype(bool))
        if best_point is not None and (
            table["cost"][best_point] < (1.0 - MAY_FIT_SAVING) * table["cost"][best_sure]
        ):
            return best_point, best_sure
    return best_sure, None


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
            f"(modelled); the budget buys about {bought or 0:.3g} tokens{within}"
            f"{_bought_interval(spec, table, target)}; minimum "
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


def _bought_interval(spec: Spec, table: CandidateTable, target: float) -> str:
    """', with 50% probability ... 90% ...' of what the budget buys (tokens_bought_interval)."""
    got = tokens_bought_interval(spec, table, target)
    if not got:
        return ""
    return (
        f" (50% probability of staying within the budget at that many; 90% at "
        f"{got['tokens_p90_cost']:.3g} tokens, where the plan's p90 cost meets it; 10% at "
        f"{got['tokens_p10_cost']:.3g}, its p10 cost; planner optimize --maximize tokens "
        "plans it)"
    )


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
        best = first_ranked(big, ok)
        assert best is not None
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
    """Which limit shaped the choice: why the next cheaper candidate (the cheapest the chosen
    one beat; every row at that cost) was not taken. Device memory only when it did not fit."""
    cost = table["cost"]
    cheaper = np.flatnonzero(cost < cost[chosen])
    if not len(cheaper):
        n = len(table)
        return (
            "none: the only configuration evaluated"
            if n == 1
            else f"none: the cheapest of the {n:,} configurations evaluated"
        )
    nearest = cheaper[cost[cheaper] == cost[cheaper].max()]
    fits = table["fits"][nearest]
    c = spec.constraints
    reasons = []
    if (~fits).any():
        i = int(nearest[~fits][0])
        prof = table.offers[int(table["offer"][i])].profile
        reasons.append(
            f"device memory (the next cheaper candidate needs {table['memory_gb'][i]:.1f} GB "
            f"per device, modelled, on the {prof.memory_gb:g} GiB card)"
        )
    if c.deadline_hours and (fits & (table["hours"][nearest] > c.deadline_hours)).any():
        reasons.append(f"the deadline ({c.deadline_hours:g} h)")
    if not c.allow_outlier_prices and (fits & outlier_rows(table)[nearest]).any():
        reasons.append("an outlier spot price (excluded; --allow-outlier-prices)")
    if not reasons and (fits & table["may_fit"][nearest].astype(bool)).any():
        reasons.append(
            "the memory model's error band (the next cheaper candidate may not fit; "
            f"chosen only when more than {MAY_FIT_SAVING:.0%} cheaper)"
        )
    fp16 = precision_table.code("fp16")
    if not reasons and (table["precision_code"][nearest] == fp16).any():
        reasons.append(
            f"precision risk: bf16 preferred to fp16 within {precision_table.FP16_MARGIN:.0%} "
            f"of its cost for a model of {table.params_total / 1e9:.3g}B parameters (at least "
            f"{precision_table.BF16_PREFERRED_ABOVE_PARAMS / 1e9:g}B; gptplan.precision)"
        )
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
