"""Spot risk in closed form: expected preemptions, their cost, and the 80% interval of a plan's
cost with price, throughput and preemption uncertainty together (vectorised over rows).

A job on n spot nodes is interrupted when any node is: lambda = n x rate per node-hour. With a
checkpoint every tau hours (Young/Daly, chosen for the central rate; planner.screen.costmodel) each
interruption loses on average tau/2 of work plus the restart R, so the useful share of paid
time is 1 - delta/tau - lambda (tau/2 + R) (planner.screen.costmodel.useful_fraction) and
E[preemptions] = lambda x running hours.

The interval combines independent factors in log space (p10/p90 = exp(-/+ sqrt(sum d_i^2)),
d_i the log-ratio of each factor's own p10/p90):
- throughput: the calibration residuals (planner.screen.costmodel.interval_from_throughput);
- the preemption rate's own uncertainty: hours recomputed at its p10 and p90 with the plan's
  checkpoint interval fixed (the plan does not re-tune tau when the rate turns out different);
- the count's randomness: N ~ Poisson, each loss uniform on [0, tau] + R, so the lost hours
  have variance E[N] (tau^2/3 + tau R + R^2), taken at +/-1.2816 standard deviations;
- the price: the offer's stated range, or a default spread (planner.market.pricebook).
"""

from __future__ import annotations

import numpy as np

Z80 = 1.2816  # the standard normal's 90th percentile


def expected_preemptions(*, nodes, rate_per_node_hour, running_hours):
    return (
        np.asarray(nodes, float)
        * np.asarray(rate_per_node_hour, float)
        * np.asarray(running_hours, float)
    )


def hours_at_rate(
    *, train_hours, useful, rate, other_rate, nodes, interval_hours, restart_hours, fixed_hours
):
    """Paid hours if the true rate per node-hour were `other_rate` instead of `rate`, with the
    same checkpoint interval (useful fraction is linear in the rate)."""
    tau = np.where(np.isfinite(interval_hours), interval_hours, 0.0)
    lam_delta = np.asarray(nodes, float) * (np.asarray(other_rate, float) - np.asarray(rate, float))
    useful2 = np.clip(np.asarray(useful, float) - lam_delta * (tau / 2 + restart_hours), 0.01, 1.0)
    return np.asarray(train_hours, float) / useful2 + fixed_hours


def poisson_hours_sd(*, preemptions, interval_hours, restart_hours):
    """Standard deviation of the hours lost to a Poisson number of interruptions."""
    tau = np.where(np.isfinite(interval_hours), interval_hours, 0.0)
    r = restart_hours
    return np.sqrt(np.asarray(preemptions, float) * (tau**2 / 3 + tau * r + r**2))


def _combine(*log_ratios):
    """sqrt of the sum of squares of log deviations (each an array, >= 0)."""
    return np.sqrt(sum(np.asarray(d, float) ** 2 for d in log_ratios))


def cost_interval(
    *,
    cost,
    hours,
    hours_tp_p10,
    hours_tp_p90,
    hours_rate_low,
    hours_rate_high,
    hours_sd,
    price_low_ratio,
    price_high_ratio,
):
    """(hours_p10, hours_p90, cost_p10, cost_p90): throughput, preemption rate, preemption
    count and price combined in log space (module docstring)."""
    h = np.maximum(np.asarray(hours, float), 1e-12)
    d_tp_lo = np.abs(np.log(np.asarray(hours_tp_p10, float) / h))
    d_tp_hi = np.abs(np.log(np.asarray(hours_tp_p90, float) / h))
    d_rate_lo = np.abs(np.log(np.asarray(hours_rate_low, float) / h))
    d_rate_hi = np.abs(np.log(np.asarray(hours_rate_high, float) / h))
    d_count = np.log1p(Z80 * np.asarray(hours_sd, float) / h)
    d_price_lo = np.abs(np.log(np.asarray(price_low_ratio, float)))
    d_price_hi = np.abs(np.log(np.asarray(price_high_ratio, float)))
    h_lo = _combine(d_tp_lo, d_rate_lo, d_count)
    h_hi = _combine(d_tp_hi, d_rate_hi, d_count)
    c = np.asarray(cost, float)
    return (
        h * np.exp(-h_lo),
        h * np.exp(h_hi),
        c * np.exp(-_combine(h_lo, d_price_lo)),
        c * np.exp(_combine(h_hi, d_price_hi)),
    )


def sensitivity(*, tp_ratio, rate_ratio, price_ratio, tokens_per_char_ratio=1.0) -> dict:
    """How far (p90/p10 ratio) each input alone moves the cost; the largest moves it most."""
    return {
        "price": float(price_ratio),
        "throughput interval": float(tp_ratio),
        "preemption rate": float(rate_ratio),
        "tokens per character": float(tokens_per_char_ratio),
    }
