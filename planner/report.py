"""Rendering only: tables (tabulate), JSON and plots from a Decision. No computation here
beyond picking rows and formatting; every number is labelled modelled or measured."""

from __future__ import annotations

import numpy as np
from tabulate import tabulate

from planner.corpus_stats import CorpusStatistics
from planner.search import CandidateTable, Decision, ranked


def _fmt_tokens(x: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.0f}"


def money(x: float) -> str:
    """Amounts: thousands separators when large, 4 significant digits when small."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.4g}"


def layout(row: dict) -> str:
    parts = [f"dp{row['dp']}"]
    if row["tp"] > 1:
        parts.append(f"tp{row['tp']}" + ("+sp" if row["sp"] else ""))
    if row["pp"] > 1:
        parts.append(f"pp{row['pp']}" + (f"v{row['vpp']}" if row.get("vpp", 1) > 1 else ""))
    if row["sharding"]:
        parts.append(f"{row['sharding']}x{row['shard_degree']}")
    if row.get("flash"):
        parts.append("flash")
    return " ".join(parts)


def describe(table: CandidateTable, i: int, currency: str) -> str:
    r = table.row(i)
    return (f"{r['offer_choice'].label} {'spot' if r['spot'] else 'on-demand'}, "
            f"{r['nodes']} node(s) x {r['gpus_per_node']}, {r['precision']}, seq {r['seq']}, "
            f"micro {r['micro']} x acc {r['acc']}, {layout(r)}, recompute {r['recompute']}: "
            f"{money(r['cost'])} {currency} (p10-p90 {money(r['cost_p10'])}-"
            f"{money(r['cost_p90'])}), {r['hours']:,.3g} h (p10-p90 {r['hours_p10']:,.3g}-"
            f"{r['hours_p90']:,.3g}) (modelled)")


def candidate_records(table: CandidateTable, rows, currency: str, chosen: int | None) -> list:
    out = []
    for i in rows:
        r = table.row(int(i))
        out.append({
            "": "*" if i == chosen else "",
            "offer": r["offer_choice"].label,
            "mode": "spot" if r["spot"] else ("owned" if r["offer_choice"].offer.kind ==
                                             "on_prem" else "on-demand"),
            "nodes x dev": f"{r['nodes']}x{r['gpus_per_node']}",
            "prec": r["precision"], "seq": r["seq"], "micro x acc": f"{r['micro']}x{r['acc']}",
            "layout": layout(r), "recompute": r["recompute"],
            "mem GB": round(r["memory_gb"], 1), "tokens/s": round(r["tokens_per_s"]),
            "MFU %": round(100 * r["mfu"], 1), "hours": float(f"{r['hours']:.3g}"),
            f"cost {currency}": float(f"{r['cost']:.4g}"),
            f"{currency}/Mtok": round(r["cost_per_million_tokens"], 4),
            # the 80% interval from the calibration residuals (planner.costmodel)
            "tokens_per_s_p10": round(r["tokens_per_s_p10"]),
            "tokens_per_s_p90": round(r["tokens_per_s_p90"]),
            "hours_p10": float(f"{r['hours_p10']:.3g}"),
            "hours_p90": float(f"{r['hours_p90']:.3g}"),
            f"cost_p10_{currency.lower()}": float(f"{r['cost_p10']:.4g}"),
            f"cost_p90_{currency.lower()}": float(f"{r['cost_p90']:.4g}"),
        })
    return out


def _with_interval_columns(records: list[dict], currency: str) -> list[dict]:
    """Terminal tables: fold the interval fields into 'p10-p90' columns."""
    out = []
    cur = currency.lower()
    for rec in records:
        rec = dict(rec)
        h10, h90 = rec.pop("hours_p10"), rec.pop("hours_p90")
        c10, c90 = rec.pop(f"cost_p10_{cur}"), rec.pop(f"cost_p90_{cur}")
        rec.pop("tokens_per_s_p10")
        rec.pop("tokens_per_s_p90")
        rec["hours p10-p90"] = f"{h10:,.3g}-{h90:,.3g}"
        rec[f"cost p10-p90 {currency}"] = f"{money(c10)}-{money(c90)}"
        out.append(rec)
    return out


def render_candidates(decision: Decision, currency: str, top: int) -> str:
    table = decision.table
    rows = ranked(table, decision.feasible)[:top]
    if not len(rows):
        rows = ranked(table, table["fits"])[:top]
    records = _with_interval_columns(candidate_records(table, rows, currency, decision.chosen),
                                     currency)
    title = (f"Top {len(records)} candidates by cost (all numbers modelled, p10-p90 = 80% "
             "interval from published-run calibration; * = chosen; "
             f"{int(decision.feasible.sum()):,} feasible of {len(table):,} evaluated)")
    return title + "\n" + tabulate(records, headers="keys", tablefmt="github")


def per_offer_records(decision: Decision, spec_budget: float, deadline: float,
                      currency: str) -> list:
    table = decision.table
    out = []
    for index, choice in enumerate(table.offers):
        mine = table["offer"] == index if len(table) else np.zeros(0, bool)
        feasible = ranked(table, decision.feasible & mine) if len(table) else []
        fitting = ranked(table, table["fits"] & mine) if len(table) else []
        if len(feasible):
            r = table.row(int(feasible[0]))
            status = "ok"
        elif len(fitting):
            r = table.row(int(fitting[0]))
            status = "over budget" if spec_budget and r["cost"] > spec_budget else \
                "misses deadline" if deadline and r["hours"] > deadline else "excluded"
        else:
            out.append({"offer": choice.label, "status": "does not fit" if mine.any() else
                        "no valid layout", "_cost": float("inf"), "cost": "", "hours": "",
                        "config": "",
                        "price source": f"{choice.offer.source[:40]} ({choice.offer.as_of})"})
            continue
        out.append({"offer": choice.label, "status": status, "_cost": r["cost"],
                    "cost": f"{money(r['cost'])} {currency} (p10-p90 {money(r['cost_p10'])}-"
                            f"{money(r['cost_p90'])})",
                    "hours": f"{r['hours']:,.3g} ({r['hours_p10']:,.3g}-{r['hours_p90']:,.3g})",
                    "config": f"{'spot' if r['spot'] else 'on-demand'} {r['nodes']}x"
                              f"{r['gpus_per_node']} {r['precision']} {layout(r)}",
                    "price source": f"{choice.offer.source[:40]} ({choice.offer.as_of})"})
    out.sort(key=lambda x: (x["status"] != "ok", x["_cost"]))
    for record in out:  # the number served the ordering; the tables show the formatted text
        del record["_cost"]
    return out


def render_per_offer(decision: Decision, budget: float, deadline: float, currency: str) -> str:
    records = per_offer_records(decision, budget, deadline, currency)
    return ("Best plan per offer (modelled)\n" +
            tabulate(records, headers="keys", tablefmt="github"))


def render_stats(stats: CorpusStatistics, target: float) -> str:
    lines = [
        f"corpus: {stats.local_documents:,} documents, {stats.local_characters:,} characters "
        f"in {stats.local_files} local file(s) (measured; skipped {stats.invalid_utf8_lines} "
        f"invalid UTF-8 lines, {stats.empty_lines} empty, {stats.duplicate_documents} "
        "duplicates)",
        f"tokens per character: {stats.tokens_per_character:.3f} (measured on "
        f"{stats.sample_documents:,} documents with {stats.tokenizer}, "
        f"{stats.tokenizer_vocab:,} pieces)",
    ]
    how = "extrapolated from the declared size" if stats.extrapolated else "measured"
    lines.append(f"corpus tokens: {_fmt_tokens(stats.total_tokens)} ({how}); target "
                 f"{_fmt_tokens(target)} tokens = {stats.epochs_for(target):.2f} epochs")
    waste = ", ".join(f"seq {k}: {v:.0%}" for k, v in stats.padding_waste.items())
    lines.append(f"padding a non-packed pipeline would waste: {waste} (measured on the "
                 "sample; the plan packs, wasting none)")
    return "\n".join(lines)


def render_choice(decision: Decision, currency: str) -> str:
    if decision.chosen is None:
        return "NO PLAN: " + "; ".join(decision.problems)
    r = decision.table.row(decision.chosen)
    return (f"chosen: {describe(decision.table, decision.chosen, currency)}\n"
            f"        {r['tokens_per_s']:,.0f} tokens/s, {r['memory_gb']:.1f} GB/device, MFU "
            f"{r['mfu']:.1%}, {r['cost_per_million_tokens']:.4f} {currency}/Mtok, "
            f"{r['energy_kwh']:,.0f} kWh (TDP upper bound) - all modelled\n"
            f"        80% interval (p10-p90, from the calibration residuals): "
            f"{r['tokens_per_s_p10']:,.0f}-{r['tokens_per_s_p90']:,.0f} tokens/s, "
            f"{r['hours_p10']:,.3g}-{r['hours_p90']:,.3g} h, {money(r['cost_p10'])}-"
            f"{money(r['cost_p90'])} {currency}\n"
            f"        binding constraint: {decision.binding}")


def plot_pareto(decision: Decision, path: str, currency: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = decision.table
    fig, ax = plt.subplots(figsize=(8, 5))
    fits = table["fits"]
    for index, choice in enumerate(table.offers):
        mine = fits & (table["offer"] == index)
        if mine.any():
            ax.scatter(table["hours"][mine], table["cost"][mine], s=4, alpha=0.3,
                       label=choice.label)
    front = decision.pareto
    if len(front):
        ax.plot(table["hours"][front], table["cost"][front], "k-", lw=1.5,
                label="Pareto front")
    if decision.chosen is not None:
        ax.scatter([table["hours"][decision.chosen]], [table["cost"][decision.chosen]],
                   marker="*", s=200, c="red", label="chosen")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("hours (modelled)")
    ax.set_ylabel(f"cost, {currency} (modelled)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
