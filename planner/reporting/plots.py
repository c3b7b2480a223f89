"""The Pareto plot (cost against hours, one front per offer, the chosen plan marked): matplotlib,
written as a PNG next to the plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from planner.screen.decide import Decision, ranked
from planner.screen.table import CandidateTable

PLOT_MAX_OFFERS = 8  # offers drawn, cheapest first (more are unreadable on one axis)


def _offer_front(table: CandidateTable, mask: np.ndarray) -> np.ndarray:
    """Rows of `mask` on its own Pareto front (cost vs hours), cheapest first."""
    idx = ranked(table, mask)
    if not len(idx):
        return idx
    hours = table["hours"][idx]
    before = np.concatenate([[np.inf], np.minimum.accumulate(hours)[:-1]])
    return idx[hours < before]


def plotted_offers(table, excluded: np.ndarray, chosen: int | None) -> tuple[list[int], int]:
    """The offers the plot draws: cloud offers only (CPU profiles are left out: their hours
    would stretch the axis by orders of magnitude), the PLOT_MAX_OFFERS whose best fitting
    plan is cheapest, the chosen plan's offer always among them. (offers, offers left out)."""
    best = []
    for index, choice in enumerate(table.offers):
        if choice.profile.device == "cpu":
            continue
        mine = table["fits"] & (table["offer"] == index)
        if mine.any():
            cost = table["cost"][mine & ~excluded] if (mine & ~excluded).any() else None
            best.append((float(cost.min()) if cost is not None else np.inf, index))
    best.sort()
    keep = [i for _, i in best[:PLOT_MAX_OFFERS]]
    if chosen is not None and int(table["offer"][chosen]) not in keep:
        keep = [*keep[: PLOT_MAX_OFFERS - 1], int(table["offer"][chosen])]
    return keep, len(best) - len(keep)


def plot_pareto(
    decision: Decision, path: str, currency: str, *, spec=None, chosen: int | None = None
) -> None:
    """Per-offer Pareto fronts of the cheapest cloud offers (at most PLOT_MAX_OFFERS, a
    distinct marker and colour each, p10-p90 whiskers on every point), log-scaled hours and
    cost, the budget and deadline lines, the chosen plan labelled; the legend sits outside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = decision.table
    chosen = decision.chosen if chosen is None else chosen
    fig, ax = plt.subplots(figsize=(11, 6))
    markers = "os^vDPX*"
    cmap = plt.get_cmap("tab10")
    from planner.screen.decide import outlier_rows

    excluded = (
        outlier_rows(table)
        if not (spec and spec.constraints.allow_outlier_prices)
        else np.zeros(len(table), bool)
    )
    shown, left_out = plotted_offers(table, excluded, chosen)
    for k, index in enumerate(shown):
        choice = table.offers[index]
        mine = table["fits"] & (table["offer"] == index)
        for rows, outlier in ((mine & ~excluded, False), (mine & excluded, True)):
            front = _offer_front(table, rows)
            if not len(front):
                continue
            iv = table.intervals(front)
            x, y = table["hours"][front], table["cost"][front]
            ax.errorbar(
                x,
                y,
                xerr=[x - iv["hours_p10"], iv["hours_p90"] - x],
                yerr=[y - iv["cost_p10"], iv["cost_p90"] - y],
                marker=markers[k % len(markers)],
                color="grey" if outlier else cmap(k % 10),
                ms=6,
                lw=1,
                ls="--" if outlier else "-",
                mfc="none" if outlier else None,
                elinewidth=0.6,
                capsize=2,
                alpha=0.9,
                label=f"{choice.label} spot: outlier price, excluded" if outlier else choice.label,
            )
    c = spec.constraints if spec is not None else None
    if c is not None and c.budget:
        ax.axhline(c.budget, color="red", ls="--", lw=1, label=f"budget {c.budget:,.0f} {currency}")
    if c is not None and c.deadline_hours:
        ax.axvline(
            c.deadline_hours,
            color="purple",
            ls=":",
            lw=1.2,
            label=f"deadline {c.deadline_hours:g} h",
        )
    if chosen is not None:
        x, y = table["hours"][chosen], table["cost"][chosen]
        ax.scatter(
            [x], [y], marker="*", s=260, c="gold", edgecolors="black", zorder=5, label="chosen"
        )
        ax.annotate(
            f"chosen: {table.offers[int(table['offer'][chosen])].label}\n"
            f"{y:,.0f} {currency}, {x:,.3g} h",
            (x, y),
            xytext=(25, 30),
            textcoords="offset points",
            fontsize=8,
            arrowprops={"arrowstyle": "->", "lw": 0.8},
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("hours (modelled)")
    ax.set_ylabel(f"cost, {currency} (modelled, incl. expected preemptions)")
    from planner.reporting.report import fmt_tokens

    job = (
        f"{spec.job.name}: {spec.model.size or 'custom'} on "
        f"{fmt_tokens(decision.target_tokens)} tokens"
        if spec is not None
        else "planner"
    )
    more = f", {left_out} more not drawn" if left_out else ""
    ax.set_title(
        f"{job}\ncheapest-vs-fastest front of the {len(shown)} cheapest cloud offers "
        f"(CPU left out{more})\nwhiskers: p10-p90 of cost and hours",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # every folder written into is made
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_history(rows: list[dict], path: Path, currency: str) -> None:
    """The autotuning study's best measured cost after each trial (`planner history --plot`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [r["measured cost"] for r in rows]
    best, xs, ys = float("inf"), [], []
    for r, v in zip(rows, values):
        if v is not None:
            best = min(best, v)
            xs.append(r["trial"])
            ys.append(best)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(xs, ys, where="post")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"best measured cost, {currency}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
