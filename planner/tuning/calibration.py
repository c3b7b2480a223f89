"""Fit a profile's efficiency curve to probe measurements, and write it as a local override.

The cost model's compute time is FLOPs / (peak x eff(T, H)) with
eff = max · T/(T + T½) · H/(H + H½) · 1/(1 + T/R) (gptplan.steptime.curve_efficiency;
devices with sm_count scale their GEMM
rate by `max` instead, see gptplan.steptime).
From a measured step time we subtract the modelled non-compute part (communication, optimizer)
to get the efficiency the hardware really reached, then fit per precision by least squares in
log space: `max` always, `T½` with two or more work sizes T among the probes, and the roll-off
`R` with three or more (fitted as 1/R, so "no roll-off" is the bound 0). `H½` keeps its
prior: the probes of one model all share h, so it is not
identifiable from them). The fit error is the median absolute relative error of the step
times the calibrated model predicts for the probed points.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w

from gptplan import precision as precision_table
from gptplan.plan import PRECISIONS
from gptplan.tomlconf import write_text_atomic
from planner.market.hardware import Efficiency, Profile, calibration_dir
from planner.screen.table import CandidateTable
from planner.tuning.probes import ProbeResult


@dataclass(frozen=True)
class Calibration:
    profile: str
    by_precision: dict[str, Efficiency]  # precision -> its calibrated efficiency
    points: int
    fit_error: float  # median |predicted - measured| / measured, step time
    worst_error: float


def _achieved_efficiency(table: CandidateTable, i: int, measured_step: float) -> float | None:
    other = table["step_time_s"][i] - table["compute_s"][i]  # pp = 1 on probed hardware
    compute = measured_step - other
    if compute <= 0:
        return None
    return float(table["efficiency"][i] * table["compute_s"][i] / compute)


def _curve(params, tokens, hidden, half_hidden):
    """gptplan.steptime.curve_efficiency with (max, T½, 1/R) as the fitted parameters."""
    emax, half_tokens, inverse_rolloff = params
    return (
        emax
        * tokens
        / (tokens + half_tokens)
        * hidden
        / (hidden + half_hidden)
        / (1.0 + tokens * inverse_rolloff)
    )


def _inverse(rolloff: float) -> float:
    return 1.0 / rolloff if rolloff > 0 else 0.0


def _tiled(table: CandidateTable, i: int) -> bool:
    """A GPU with a tile model (sm_count): its compute time scales with 1/max alone."""
    return table.offers[int(table["offer"][i])].profile.sm_count > 0


def predicted_step(table: CandidateTable, i: int, eff: Efficiency) -> float:
    tokens = table["micro"][i] * table["seq"][i]
    hidden = _hidden_per_tp(table, i)
    new = (
        eff.max
        if _tiled(table, i)
        else _curve(
            (eff.max, eff.half_tokens, _inverse(eff.rolloff_tokens)),
            tokens,
            hidden,
            eff.half_hidden,
        )
    )
    other = table["step_time_s"][i] - table["compute_s"][i]
    return float(table["compute_s"][i] * table["efficiency"][i] / new + other)


def _hidden_per_tp(table: CandidateTable, i: int) -> float:
    # efficiency = emax·T/(T+t½)·H/(H+h½) was evaluated with the model's h / tp
    return float(table["hidden_per_tp"][i])


def fit(
    table: CandidateTable, probed: dict[int, ProbeResult], profile: Profile, *, fingerprint: str
) -> Calibration | None:
    from scipy.optimize import least_squares

    by_precision: dict[str, Efficiency] = {}
    for precision in PRECISIONS:
        code = precision_table.code(precision)
        rows = [(i, r) for i, r in probed.items() if r.ok and table["precision_code"][i] == code]
        points = []
        for i, r in rows:
            achieved = _achieved_efficiency(table, i, r.step_time_s)
            if achieved:
                points.append(
                    (table["micro"][i] * table["seq"][i], _hidden_per_tp(table, i), achieved)
                )
        if not points:
            continue
        prior = profile.efficiency_for(precision)
        tokens = np.array([p[0] for p in points], dtype=float)
        hidden = np.array([p[1] for p in points], dtype=float)
        measured = np.array([p[2] for p in points])
        distinct = len(set(tokens.tolist()))
        half_hidden = prior.half_hidden
        if profile.sm_count:  # the tile model sets the shape effects: only the level is fitted
            distinct, half_hidden = 1, 0.0

        def residual(
            params, tokens=tokens, hidden=hidden, half_hidden=half_hidden, measured=measured
        ):  # bound now: the fit runs in this iteration
            return np.log(_curve(params, tokens, hidden, half_hidden)) - np.log(measured)

        emax, half, inverse = (
            min(0.99, prior.max),
            prior.half_tokens,
            _inverse(prior.rolloff_tokens),
        )
        if distinct >= 3:  # rise and fall with work size: all three are identifiable
            sol = least_squares(
                residual,
                x0=[emax, half, max(inverse, 1e-6)],
                bounds=([1e-4, 1.0, 0.0], [1.0, 1e7, 1 / 64]),
            )
            emax, half, inverse = sol.x
        elif distinct == 2:
            sol = least_squares(
                lambda p, inverse=inverse: residual([p[0], p[1], inverse]),
                x0=[emax, half],
                bounds=([1e-4, 1.0], [1.0, 1e7]),
            )
            emax, half = sol.x
        else:  # one work size (or a tile model): only the level is identifiable
            if profile.sm_count:
                half, inverse = 0.0, 0.0
            sol = least_squares(
                lambda p, half=half, inverse=inverse: residual([p[0], half, inverse]),
                x0=[emax],
                bounds=([1e-4], [1.0]),
            )
            emax = sol.x[0]
        rolloff = 1.0 / inverse if inverse > 1e-9 else 0.0
        by_precision[precision] = dataclasses.replace(
            prior,
            max=float(emax),
            half_tokens=float(half),
            rolloff_tokens=float(rolloff),
            source=f"calibrated from {len(points)} probe(s) on this machine",
            calibrated_on=fingerprint,
            calibrated_at=dt.date.today().isoformat(),
        )
    if not by_precision:
        return None
    errors, ratios = [], []
    for i, r in probed.items():
        precision = precision_table.name_of(table["precision_code"][i])
        if r.ok and precision in by_precision:
            predicted = predicted_step(table, i, by_precision[precision])
            errors.append(abs(predicted - r.step_time_s) / r.step_time_s)
            ratios.append(predicted / r.step_time_s)  # measured/modelled tokens/s
    fit_error = statistics.median(errors) if errors else 0.0
    # the interval of a calibrated profile is the probes' measured spread around the fit
    spread: dict[str, Any] = (
        {"throughput_p10": round(min(ratios), 4), "throughput_p90": round(max(ratios), 4)}
        if len(ratios) >= 2 and min(ratios) < 1 < max(ratios)
        else {}
    )
    by_precision = {
        p: dataclasses.replace(e, fit_error=round(fit_error, 4), **spread)
        for p, e in by_precision.items()
    }
    return Calibration(
        profile.name, by_precision, len(errors), fit_error, max(errors) if errors else 0.0
    )


def write(calibration: Calibration, directory: Path | None = None) -> Path:
    """<directory or the user data directory's calibration/>/<profile>.toml: an
    [efficiency_<precision>] table per fitted precision (never into the package)."""
    data = {f"efficiency_{p}": dataclasses.asdict(e) for p, e in calibration.by_precision.items()}
    header = (
        f"# Calibration of profile '{calibration.profile}' written by the planner on "
        f"{dt.date.today().isoformat()} from {calibration.points} probe(s); median "
        f"step-time error {calibration.fit_error:.1%}. Machine-specific: not in git.\n"
    )
    path = Path(directory or calibration_dir()) / f"{calibration.profile}.toml"
    write_text_atomic(path, header + tomli_w.dumps(data))
    return path
