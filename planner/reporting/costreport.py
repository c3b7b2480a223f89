"""What a plan costs, rendered so a person can act on it: the per-offer table (the main one),
one row per distinct decision, the price and spot-risk lines of the chosen plan, the
sensitivity line, and their JSON. Every money number carries its currency; every price its
date and age. Computation stays in planner.screen / planner.market.pricebook /
planner.market.spotrisk.
"""

from __future__ import annotations

import math

import numpy as np
from tabulate import tabulate

from gptplan import precision as precision_table
from planner.market.disks import disk_line, disk_record
from planner.market.pricebook import AGE_WIDENING, UNDATED_MONTHS
from planner.screen.decide import (
    Decision,
    outlier_rows,
    owned_fastest,
    ranked,
    tokens_bought_interval,
)
from planner.screen.table import CandidateRow, CandidateTable

WIDTH = 120


def hours_text(hours: float) -> str:
    """Table hours: '73.6' below four days, else days ('3.1 d'), never '1.76e+03'."""
    if not math.isfinite(hours):
        return "-"
    return f"{hours:,.3g}" if hours < 96 else f"{hours / 24:,.1f} d"


def money(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def capacity(table: CandidateTable, i: int, fallback_hours: float = 0.0) -> str:
    choice = table.offers[int(table["offer"][i])]
    if choice.offer.kind == "on_prem":
        return "owned"
    if not table["spot"][i]:
        return "on-demand"
    return "spot+fallback" if fallback_hours else "spot"


def family(table: CandidateTable, i: int) -> str:
    """The layout family: which kinds of parallelism, not their exact degrees and stages."""
    parts = []
    if table["tp"][i] > 1:
        parts.append(f"tp{int(table['tp'][i])}")
    if table["pp"][i] > 1:
        parts.append(f"pp{int(table['pp'][i])}")
    parts.append("zero" if table["stage_code"][i] > 0 else "dp")
    return "+".join(parts)


def short_offer(table: CandidateTable, i: int) -> str:
    c = table.offers[int(table["offer"][i])]
    return f"{c.profile.name}@{c.offer.provider}"


def distinct_rows(table: CandidateTable, rows, keep=()) -> list[int]:
    """The first row of each decision (offer, capacity, nodes, precision, layout family), in
    the order of `rows`; rows in `keep` always stay."""
    seen, out = set(), []
    for i in rows:
        i = int(i)
        key = (
            int(table["offer"][i]),
            bool(table["spot"][i]),
            int(table["nodes"][i]),
            int(table["precision_code"][i]),
            family(table, i),
        )
        if key in seen and i not in keep:
            continue
        seen.add(key)
        out.append(i)
    return out


def _fold_precisions(table: CandidateTable, rows: list[int], keep) -> list[tuple[int, list]]:
    """Decisions that differ only in precision at the same cost and hours (3 digits) share a
    row ('fp16/bf16'): the model cannot tell them apart."""
    out: list[tuple[int, list[str]]] = []
    where: dict[tuple, int] = {}
    for i in rows:
        key = (
            int(table["offer"][i]),
            bool(table["spot"][i]),
            int(table["nodes"][i]),
            family(table, i),
            f"{table['cost'][i]:.3g}",
            f"{table['hours'][i]:.3g}",
        )
        name = precision_table.name_of(table["precision_code"][i])
        if key in where and i not in keep:
            out[where[key]][1].append(name)
            continue
        where[key] = len(out)
        out.append((i, [name]))
    return out


def _cost_cell(row: CandidateRow) -> str:
    return f"{money(row['cost'])} ({money(row['cost_p10'])}-{money(row['cost_p90'])})"


def _flags(choice, spot: bool) -> str:
    flags = []
    if choice.price.stale:
        flags.append("stale")
    if spot and choice.price.outlier:
        flags.append("OUTLIER")
    return ",".join(flags)


def render_decisions(result, top: int) -> str:
    """Top distinct decisions by cost (feasible first), one row each, <= 120 columns."""
    table, cur = result.table, result.currency
    mask = result.decision.feasible if result.decision.feasible.any() else table["fits"]
    order = ranked(table, mask)[: max(top * 200, 2000)]
    keep = {int(result.chosen)} if result.chosen is not None else set()
    rows = _fold_precisions(table, distinct_rows(table, order, keep), keep)[:top]
    if result.chosen is not None and all(int(result.chosen) != i for i, _ in rows):
        rows.append((int(result.chosen), [table.row(int(result.chosen))["precision"]]))
    fb = result.spec.spot.fallback_wait_hours
    body = []
    for i, precisions in rows:
        r = table.row(i)
        body.append(
            [
                "*" if i == result.chosen else "",
                short_offer(table, i),
                capacity(table, i, fb),
                f"{r['nodes']}x{r['gpus_per_node']}",
                "/".join(precisions),
                family(table, i),
                hours_text(r["hours"]),
                _cost_cell(r),
                f"{r['preemptions']:.2g}" if r["spot"] else "-",
                _flags(r["offer_choice"], bool(r["spot"])),
            ]
        )
    head = [
        "",
        "offer",
        "capacity",
        "nodes",
        "prec",
        "layout",
        "hours",
        f"cost {cur} (p10-p90)",
        "preempt.",
        "price",
    ]
    title = (
        f"Top {len(body)} distinct decisions (offer, capacity, nodes, precision, layout "
        f"family) by cost, modelled; * = chosen; {int(mask.sum()):,} feasible of "
        f"{len(table):,}; --wide for every column"
    )
    return (
        _wrap(title) + "\n" + tabulate(body, headers=head, tablefmt="simple", disable_numparse=True)
    )


def offer_summary(decision: Decision, spec) -> list[dict]:
    """The best plan of every offer as raw numbers with unit-bearing keys, best first."""
    table, cur = decision.table, spec.constraints.currency.lower()
    out = []
    for index, choice in enumerate(table.offers):
        mine = (table["offer"] == index) if len(table) else np.zeros(0, bool)
        f = choice.price
        base = {
            "offer": choice.label,
            "price_source": choice.offer.source,
            "price_as_of": choice.offer.as_of,
            "price_age_days": f.age_days,
            "price_stale": f.stale,
            "spot_price_outlier": f.outlier,
            f"price_{choice.offer.currency.lower()}_per_node_hour_on_demand": (
                choice.offer.on_demand_per_hour
            ),
            f"price_{choice.offer.currency.lower()}_per_node_hour_spot": choice.offer.spot_per_hour,
            "preemptions_per_node_hour": f.risk.rate,
            "preemption_rate_source": f.risk.source,
        }
        pick = _best_row(spec, decision, mine)
        if pick is None:
            out.append(
                base
                | {
                    "status": "does not fit" if mine.any() else no_layout_reason(choice, spec),
                    f"modelled_cost_{cur}": None,
                    "modelled_hours": None,
                }
            )
            continue
        i, status = pick
        r = table.row(i)
        out.append(
            base
            | {
                "status": status,
                "capacity": "spot"
                if r["spot"]
                else ("owned" if choice.offer.owned else "on_demand"),
                "nodes": r["nodes"],
                "devices_per_node": r["gpus_per_node"],
                "precision": r["precision"],
                "layout_family": family(table, i),
                f"modelled_cost_{cur}": r["cost"],
                f"modelled_cost_{cur}_p10": r["cost_p10"],
                f"modelled_cost_{cur}_p90": r["cost_p90"],
                f"modelled_cost_on_demand_{cur}": _nan_none(r["cost_on_demand"]),
                "modelled_hours": r["hours"],
                "expected_preemptions": r["preemptions"] if r["spot"] else 0.0,
                **disk_record(r, spec.constraints.currency),
            }
        )
    out.sort(
        key=lambda x: (
            x["status"] != "ok",
            x[f"modelled_cost_{cur}"] if x[f"modelled_cost_{cur}"] is not None else math.inf,
        )
    )
    return out


def no_layout_reason(choice, spec) -> str:
    """'no valid layout', with the reason when it is the offer's unknown network."""
    offer = choice.offer
    if offer.kind == "cloud" and not offer.inter_node_gbits_per_s:
        why = offer.network_source.split(" in hardware_profiles/")[0]
        if "attaches no EFA" in why:
            why = "the pinned SkyPilot attaches no EFA"
        elif not why.startswith("no instance facts"):
            why = "inter-node bandwidth not stated"
        return f"no valid layout: single-node only ({why})"
    return "no valid layout"


def _nan_none(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def _best_row(spec, decision: Decision, mine: np.ndarray):
    table = decision.table
    if not len(table):
        return None
    feasible = ranked(table, decision.feasible & mine)
    if len(feasible):
        return owned_fastest(table, feasible, int(feasible[0])), "ok"
    fitting = ranked(table, table["fits"] & mine)
    if not len(fitting):
        return None
    i = int(fitting[0])
    c = spec.constraints
    reasons = [
        why
        for why, on in (
            ("outlier price", outlier_rows(table)[i] and not c.allow_outlier_prices),
            ("over budget", c.budget and table["cost"][i] > c.budget),
            ("misses deadline", c.deadline_hours and table["hours"][i] > c.deadline_hours),
        )
        if on
    ]
    return i, ", ".join(reasons) or "excluded"


def render_offers(decision: Decision, spec, *, wide: bool = False) -> str:
    """The main table: the best plan on every offer, its price's age and flags."""
    cur = spec.constraints.currency
    body = []
    for r in offer_summary(decision, spec):
        cost = r[f"modelled_cost_{cur.lower()}"]
        od = r.get(f"modelled_cost_on_demand_{cur.lower()}")
        notes = ["undated" if r["price_age_days"] is None else f"{r['price_age_days']} d"]
        notes += [
            x
            for x, on in (
                ("stale", r["price_stale"] and r["price_age_days"] is not None),
                ("spot-OUTLIER", r["spot_price_outlier"]),
                (r["status"], r["status"] != "ok"),
            )
            if on
        ]
        line = [
            r["offer"].split(" @ ")[1] if not wide else r["offer"],
            f"{r['capacity'].replace('_', '-')} {r['nodes']}x{r['devices_per_node']}"
            if "capacity" in r
            else "",
            f"{money(cost)} ({money(r[f'modelled_cost_{cur.lower()}_p10'])}-"
            f"{money(r[f'modelled_cost_{cur.lower()}_p90'])})"
            if cost is not None
            else "",
            money(od) if od is not None and r.get("capacity") == "spot" else "",
            hours_text(r["modelled_hours"]) if cost is not None else "",
            " ".join(notes),
        ]
        if wide:
            line.append(r["price_source"])
        body.append(line)
    head = [
        "offer (its best plan)",
        "capacity",
        f"cost {cur} p10-p90",
        "on-demand",
        "hours",
        "price age, flags",
    ] + (["price source"] if wide else [])
    title = (
        f"Best plan per offer (modelled; spot cost includes expected preemptions, "
        f"'on-demand' = the same plan if spot cannot be had; prices older than "
        f"{spec.constraints.max_price_age_days} d or undated are stale)"
    )
    # long offer names (an instance priced in several regions names the region) and notes
    # wrap inside their columns, so the table stays within 120 columns
    widths = None if wide else [36, None, None, None, None, 28]
    return (
        _wrap(title)
        + "\n"
        + tabulate(
            body,
            headers=head,
            tablefmt="simple",
            disable_numparse=True,
            maxcolwidths=widths,
        )
    )


def fit_lines(text: str) -> str:
    """Every line of `text` wrapped at WIDTH columns, keeping its indentation."""
    out = []
    for line in text.splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        out.append(_wrap(line.strip(), indent) if len(line) > WIDTH else line)
    return "\n".join(out)


def _wrap(text: str, indent: str = "") -> str:
    import textwrap

    return "\n".join(
        textwrap.wrap(
            text,
            WIDTH,
            initial_indent=indent,
            subsequent_indent=indent + "  ",
            break_on_hyphens=False,
        )
    )


def spread_ratio(high: float, low: float) -> float:
    """p90/p10 of an input; 1.0 where the low end is 0 or not a number (a zero low end means
    the input does not move the cost: no spread, never a division by zero)."""
    if not (low > 0 and math.isfinite(low) and math.isfinite(high)):
        return 1.0
    return max(high / low, 1.0)


def sensitivity(table: CandidateTable, i: int, target_from_tokens: bool = True, stats=None) -> dict:
    """p90/p10 ratio of the cost when each input alone varies over its 80% range (tokens per
    character: its range when extrapolated to the planned vocabulary,
    planner.corpus.corpus_stats)."""
    r = table.row(int(i))
    f = r["offer_choice"].price
    spread = f.spot_spread if r["spot"] else f.on_demand_spread
    out = {
        "price": spread_ratio(spread[1], spread[0]),
        "throughput interval": spread_ratio(r["throughput_cost_p90"], r["throughput_cost_p10"]),
        "preemption rate": spread_ratio(r["preemption_hours_p90"], r["preemption_hours_p10"]),
    }
    # tokens per character moves the cost only when the target is in epochs of the corpus;
    # with a target in tokens it moves the corpus tokens and epochs instead
    lo = getattr(stats, "tokens_per_character_p10", 0.0)
    hi = getattr(stats, "tokens_per_character_p90", 0.0)
    ratio = hi / lo if lo > 0 and hi > lo else 1.0
    if target_from_tokens:
        name = (
            f"tokens per character (target in tokens; corpus tokens and epochs x{ratio:.2f})"
            if ratio > 1
            else "tokens per character (target in tokens)"
        )
        out[name] = 1.0
    else:
        out[
            "tokens per character (extrapolated range)"
            if ratio > 1
            else "tokens per character (no spread measured)"
        ] = ratio
    return out


def sensitivity_line(sens: dict, currency: str) -> str:
    ranked_inputs = sorted(sens.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{k} x{v:.2f}" for k, v in ranked_inputs)
    return _wrap(
        f"sensitivity: the cost moves most with {ranked_inputs[0][0]} (p90/p10 of the "
        f"{currency} cost with each input alone over its 80% range: {parts})",
        "        ",
    )


def price_lines(result) -> list[str]:
    """The chosen plan's price, its age, the spot risk and the on-demand alternative."""
    table, i, spec = result.table, int(result.chosen), result.spec
    r = table.row(i)
    choice, cur = r["offer_choice"], result.currency
    f, offer = choice.price, choice.offer
    native = choice.native_node_price(spot=bool(r["spot"]))
    rate = (
        f" x {choice.rate:g} {cur}/{offer.currency} (rate as of {spec.rates_as_of or 'undated'})"
        if offer.currency != cur
        else ""
    )
    age = "undated" if f.age_days is None else f"{f.age_days} days old"
    stale = "; STALE: refresh with 'planner prices import'" if f.stale else ""
    spread = f.spot_spread if r["spot"] else f.on_demand_spread
    widened = (
        f"; interval x{spread[0]:.2f}-x{spread[1]:.2f} of the price, widened with its age "
        f"({AGE_WIDENING:.0%} per month, undated = {UNDATED_MONTHS:g} months; "
        "planner/market/pricebook.py)"
        if offer.kind == "cloud"
        else ""
    )
    lines = [
        f"price: {native:g} {offer.currency}/node-hour{rate}; price as of "
        f"{offer.as_of or '(no date)'} ({age}{stale}{widened})",
        disk_line(r, cur),
    ]
    fallback = spec.spot.fallback_wait_hours
    if r["spot"] and fallback:
        p = f.risk.unavailable_probability
        lines.append(
            f"spot with on-demand fallback: if no spot capacity after {fallback:g} h "
            f"(chance {p:.0%}, {offer.provider}), the plan runs on-demand; cost = "
            f"expected over both, hours = the later of the two"
        )
    if r["spot"]:
        od = r["cost_on_demand"]
        lines.append(
            f"spot risk: {r['preemptions']:.2g} expected preemptions at {f.risk.rate:g}/node-hour "
            f"(80% range {f.risk.low:g}-{f.risk.high:g}; source: {f.risk.source}), checkpoint "
            f"every {r['checkpoint_interval_h']:.2g} h, included in the cost; if spot cannot be "
            f"had, the same plan on-demand costs {money(od)} {cur}"
        )
    if f.outlier and r["spot"]:
        lines.append(f"WARNING: {f.outlier_note} (allowed by --allow-outlier-prices)")
    return [_wrap(x, "        ") for x in lines]


def budget_line(decision: Decision, spec) -> str:
    """What the budget buys and the least it could be, both under every other constraint."""
    c = spec.constraints
    if decision.minimum_budget is None or not c.budget:
        return ""
    within = f" within {c.deadline_hours:g} h" if c.deadline_hours else ""
    got = tokens_bought_interval(spec, decision.table, decision.target_tokens)
    odds = (
        f" (90% probability of staying within it at {got['tokens_p90_cost']:.3g}, the p90 "
        "cost of the plan that buys them)"
        if got
        else ""
    )
    return _wrap(
        f"budget: {c.budget:,.0f} {c.currency} buys about "
        f"{(decision.tokens_bought or 0):.3g} tokens{within}{odds}; the target needs at "
        f"least {money(decision.minimum_budget)} {c.currency} (modelled)",
        "        ",
    )


def excluded_outliers(table: CandidateTable) -> list[str]:
    return [c.price.outlier_note for c in table.offers if c.price.outlier]


def cost_json(result) -> dict:
    """The cost facts of `planner optimize --json` beyond the candidate records."""
    spec, decision = result.spec, result.decision
    cur = spec.constraints.currency.lower()
    out = {
        f"minimum_budget_{cur}": decision.minimum_budget,
        "tokens_bought": decision.tokens_bought,
        **{
            f"tokens_bought_{name}": got[k]
            for got in [tokens_bought_interval(spec, decision.table, decision.target_tokens)]
            for k, name in (
                ("tokens_p90_cost", "90pct_within_budget"),
                ("tokens_p10_cost", "10pct_within_budget"),
            )
            if got
        },
        "excluded_outlier_offers": excluded_outliers(decision.table),
        "rates": {
            "quote": spec.rates_quote or spec.constraints.currency,
            "as_of": spec.rates_as_of,
            "source": spec.rates_source,
            **{
                f"{spec.rates_quote or spec.constraints.currency}_per_{k}".lower(): v
                for k, v in spec.rates.items()
            },
        },
        "per_offer": offer_summary(decision, spec),
    }
    if result.chosen is not None:
        out["sensitivity_cost_p90_over_p10"] = {
            k.split(" (")[0].replace(" ", "_"): v
            for k, v in sensitivity(
                decision.table, result.chosen, spec.job.target_tokens > 0, result.stats
            ).items()
        }
    return out


def price_record(table: CandidateTable, i: int, currency: str) -> dict:
    """Price, age and spot-risk keys of one candidate (joined into its JSON record)."""
    r = table.row(int(i))
    choice = r["offer_choice"]
    f, offer, cur = choice.price, choice.offer, currency.lower()
    native = choice.native_node_price(spot=bool(r["spot"]))
    return {
        f"price_{offer.currency.lower()}_per_node_hour": native,
        f"price_{cur}_per_node_hour": r["price_node_hour"],
        "price_as_of": offer.as_of,
        "price_age_days": f.age_days,
        "price_stale": f.stale,
        "spot_price_outlier": bool(r["spot"]) and f.outlier,
        "expected_preemptions": r["preemptions"],
        "preemptions_per_node_hour": f.risk.rate if r["spot"] else 0.0,
        "preemptions_per_node_hour_p10": f.risk.low if r["spot"] else 0.0,
        "preemptions_per_node_hour_p90": f.risk.high if r["spot"] else 0.0,
        "preemption_rate_source": f.risk.source if r["spot"] else "",
        "checkpoint_interval_hours": _nan_none(float(r["checkpoint_interval_h"])),
        f"modelled_cost_on_demand_{cur}": _nan_none(r["cost_on_demand"]),
        **disk_record(r, currency),
    }
