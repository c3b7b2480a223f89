"""Choose from the candidate table: what is feasible (budget, deadline, memory, outliers), the
cheapest-first order, the Pareto front, the decision with its runner-up and the constraint
that binds, and the tokens a budget buys."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from gptplan import precision as precision_table
from gptplan.memory import (
    GIB,
    MAY_FIT_SAVING,
)
from planner.screen.evaluate import evaluate_space
from planner.screen.memory import deciding_term
from planner.screen.table import CandidateTable
from planner.spec import Spec

# ---- choosing ----------------------------------------------------------------------------------


def outlier_rows(table: CandidateTable) -> np.ndarray:
    """Spot rows on an offer whose spot price is an outlier (planner.market.pricebook)."""
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
