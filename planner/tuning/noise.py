"""What a set of probes says about each configuration's cost, with its own noise.

A probe reports the median of its steady-state steps (warm-up discarded), so a load spike
during a few steps moves it little; what the median cannot remove is drift between probes (the
machine's load changes between minutes). So one probe of a configuration is one noisy reading
of its log cost per token, with a variance of

  `spread_ratio` x the within-probe variance of its median step (from the MAD of its log step
  times; at least the median of that over every probe of the session, as 3-5 steps say little
  on their own), at least `repeat_sd`^2, times `load_inflation` for a probe flagged as taken
  under load (planner.tuning.probes.under_load).

`spread_ratio` is how much more the medians of repeated probes of one configuration differ than
their steps say (between-probe over within-probe variance: drift of the machine between
minutes), learned from the recordings that were not held out (bench/replay_quality.py): on a
machine whose steps are noisy, probes are noisy in proportion.

Repeats of a configuration replace the floor with what they show: when their medians differ
more than the floor says, every reading's variance grows by that ratio.

The cost model's calibrated estimate is a prior on each log cost with sd `prior_sd` (0 = no
prior), learned from how far the calibrated model was from the truth on the other recordings:
with few probes a configuration the model ranks well is pulled towards the model's view.

`Belief` is the posterior (mean and variance of log cost) of every probed configuration;
`separation` says how sure the pick is against the runner-up: the probability that the pick is
the cheaper one (normal approximation) and the runner-up's extra cost with its interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAD_TO_SD = 1.4826  # sd of a normal distribution / its median absolute deviation


@dataclass(frozen=True)
class NoiseModel:
    """How noisy a probe is taken to be, and how much the model's prior weighs."""

    # the defaults are planner.tuning.autotune.TuneSettings' (which builds this with noise_model)
    repeat_sd: float = 0.01  # floor of a probe's sd of log(median step)
    load_inflation: float = 2.0  # variance multiplier for a probe taken under load
    spread_ratio: float = 19.8  # between-probe / within-probe variance of the median step
    prior_sd: float = 0.15  # sd of the calibrated model's log cost error (0 = no prior)
    confidence: float = 0.8  # the pick must be cheaper than the runner-up with this probability


@dataclass(frozen=True)
class Belief:
    mean: float  # posterior mean of log cost
    var: float  # its variance
    readings: int  # probes behind it

    @property
    def cost(self) -> float:
        return math.exp(self.mean)


@dataclass(frozen=True)
class Separation:
    """The pick against the runner-up."""

    probability: float  # P(pick is cheaper), normal approximation on log cost
    difference: float  # runner-up's cost / the pick's - 1 (posterior means)
    interval: tuple  # two-sided interval of that difference at `level`
    level: float

    @property
    def half_width(self) -> float:
        return (self.interval[1] - self.interval[0]) / 2


def within_variance(step_times) -> float:
    """Variance of a probe's median log step from its own steps (MAD-based; 0 for one step)."""
    steps = np.log(np.asarray(step_times, dtype=float))
    if len(steps) < 2:
        return 0.0
    mad = float(np.median(np.abs(steps - np.median(steps))))
    return (MAD_TO_SD * mad) ** 2 * (math.pi / 2) / len(steps)


def reading(
    log_cost: float, step_times, *, under_load: bool, noise: NoiseModel, pooled: float = 0.0
):
    """(log cost, variance) of one probe (see the module docstring); `pooled` is the typical
    within-probe variance of the session's probes."""
    within = max(within_variance(step_times), pooled)
    var = max(noise.spread_ratio * within, noise.repeat_sd**2)
    return log_cost, var * (noise.load_inflation if under_load else 1.0)


def belief(readings: list[tuple[float, float]], prior: float | None, noise: NoiseModel) -> Belief:
    """Posterior of one configuration's log cost from its probes' readings (see `reading`)
    and the model's log cost `prior` (ignored when noise.prior_sd is 0)."""
    y = np.array([r[0] for r in readings], dtype=float)
    v = np.array([r[1] for r in readings], dtype=float)
    if len(y) >= 2:  # the repeats' own spread, when it exceeds what the readings assumed
        spread = float(np.var(y, ddof=1))
        v = v * max(1.0, spread / float(np.mean(v)))
    precision = float(np.sum(1 / v))
    total = float(np.sum(y / v))
    if prior is not None and noise.prior_sd > 0:
        precision += 1 / noise.prior_sd**2
        total += prior / noise.prior_sd**2
    return Belief(total / precision, 1 / precision, len(y))


def normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def normal_quantile(p: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)


def separation(pick: Belief, other: Belief, level: float) -> Separation:
    """How sure the pick is cheaper than `other`, and other's extra cost with its interval."""
    d = other.mean - pick.mean
    se = math.sqrt(pick.var + other.var)
    p = normal_cdf(d / se) if se > 0 else (1.0 if d > 0 else 0.5)
    z = normal_quantile(0.5 + level / 2)
    return Separation(p, math.expm1(d), (math.expm1(d - z * se), math.expm1(d + z * se)), level)


def ranked(beliefs: dict) -> list:
    """Keys by posterior mean, cheapest first."""
    return sorted(beliefs, key=lambda k: (beliefs[k].mean, k))


def spread_ratio_from(recordings) -> float:
    """Between-probe over within-probe variance of the median log step, learned from
    recordings: the median over their configurations with 2+ recorded probes."""
    ratios = []
    for rec in recordings:
        for config in rec.configs.values():
            probes = [p for p in config.probes if p["status"] == "ok" and len(p["steps_s"]) >= 2]
            if len(probes) < 2:
                continue
            medians = np.log([float(np.median(p["steps_s"])) for p in probes])
            within = float(np.mean([within_variance(p["steps_s"]) for p in probes]))
            if within > 0:
                ratios.append(float(np.var(medians, ddof=1)) / within)
    return float(np.median(ratios)) if ratios else NoiseModel.spread_ratio
