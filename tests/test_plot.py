"""The --plot PNG: cloud offers only (CPU left out), at most 8 offers by cost, the chosen
plan's offer among them."""

from __future__ import annotations

import numpy as np


def test_plot_draws_at_most_8_cloud_offers_with_the_chosen_one(tmp_path):
    from planner.market.hardware import load_profiles
    from planner.pipeline import plan_space
    from planner.reporting.plots import PLOT_MAX_OFFERS, plot_pareto, plotted_offers
    from planner.screen.decide import outlier_rows
    from planner.spec import load_spec

    # every profile named, this machine's CPU too (cloud tables hold it only when asked for)
    every = sorted(load_profiles())
    spec = load_spec(None, overrides={"job.tokens_per_char": 0.8, "constraints.profiles": every})
    _, _, decision, _ = plan_space(spec, log=lambda *a: None)
    table = decision.table
    assert sum(c.profile.device != "cpu" for c in table.offers) > PLOT_MAX_OFFERS
    assert any(c.profile.device == "cpu" for c in table.offers)
    shown, left_out = plotted_offers(table, outlier_rows(table), decision.chosen)
    assert len(shown) == PLOT_MAX_OFFERS and left_out > 0
    assert all(table.offers[i].profile.device != "cpu" for i in shown)
    assert int(table["offer"][decision.chosen]) in shown
    best = [float(np.min(table["cost"][table["fits"] & (table["offer"] == i)])) for i in shown]
    assert best[0] == min(best)  # cheapest first
    out = tmp_path / "pareto.png"
    plot_pareto(decision, str(out), "CNY", spec=spec, chosen=decision.chosen)
    assert out.stat().st_size > 10_000
