"""The candidate table: one row per candidate configuration, columns as numpy arrays joined
lazily (`Columns`), and per row its 80% interval (throughput, preemptions, price) computed on
demand from the row's point estimate."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import numpy as np

from gptplan import families
from gptplan import precision as precision_table
from gptplan.plan import (
    RECOMPUTE_MODES,
    SHARDING_STAGES,
)
from planner.market import spotrisk
from planner.market.offers import OfferChoice
from planner.screen import costmodel as cm
from planner.screen import coverage

DIAGNOSTIC_COLUMNS = frozenset(
    {"tp_s", "pp_s", "opt_s", "bubble", "tokens_per_s_per_device", "dp_sync_s"}
)


class _MeasuredKeys(TypedDict, total=False):
    """What a row measured by probes adds (planner.pipeline.measured_row)."""

    step_time_interval_s: list[float]
    step_time_spread: float
    interval_source: str


class CandidateRow(_MeasuredKeys):
    """One candidate as `CandidateTable.row` gives it: every column's value as a Python number,
    the offer it runs on, the names of its coded columns and its 80% interval. At run time a
    plain dict (rows go into JSON and plans unchanged); the keys and their types are what a
    function that takes a chosen row may read."""

    # the layout (gptplan.layout reads these)
    nodes: int
    gpus_per_node: int
    world: int
    precision_code: int
    seq: int
    micro: int
    acc: int
    tp: int
    pp: int
    vpp: int
    dp: int
    shard_degree: int
    stage_code: int
    recompute_code: int
    sp: int
    flash: int
    tokens_per_step: int
    # memory (gptplan.memory; the band of the model's error)
    memory_gb: float
    rc_layers: int
    fits: bool
    may_fit: bool
    memory_low_gb: float
    memory_high_gb: float
    memory_decider: int
    memory_point_fits: bool
    # speed
    efficiency: float
    hidden_per_tp: float
    step_time_s: float
    compute_s: float
    comm_s: float
    tokens_per_s: float
    mfu: float
    # time and money (planner.screen.pricing)
    offer: int
    steps: float
    train_hours: float
    spot: bool
    useful_fraction: float
    checkpoint_interval_h: float
    hours: float
    price_node_hour: float
    cost: float
    disk_gb: float  # the task's disk per node (planner.market.disks)
    disk_cost: float  # its cost over the run, all nodes, in the budget currency
    cost_on_demand: float
    preemptions: float
    energy_kwh: float
    cost_per_million_tokens: float
    # decoded: the offer and the names of the coded columns
    offer_choice: OfferChoice
    precision: str
    sharding: str
    recompute: str
    # the 80% interval (CandidateTable.intervals) and why it is wider
    tokens_per_s_p10: float
    tokens_per_s_p90: float
    hours_p10: float
    hours_p90: float
    cost_p10: float
    cost_p90: float
    throughput_cost_p10: float
    throughput_cost_p90: float
    preemption_hours_p10: float
    preemption_hours_p90: float
    throughput_capped: bool
    interval_outside_runs: list[str]


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

    def row(self, i: int) -> CandidateRow:
        cols = self.columns
        out: dict[str, Any]
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
        return cast(CandidateRow, out)

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
        (planner.screen.coverage) and the extra log-error per such axis."""
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
        calibration spread (planner.screen.costmodel.interval_from_throughput), so a million-row
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
        # the physical cap (planner.screen.coverage.mfu_cap): the interval's top never above the
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
        price added to the throughput interval (planner.market.spotrisk.cost_interval)."""
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
