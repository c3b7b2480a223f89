"""`planner optimize` as one pipeline returning one result: corpus statistics -> model search ->
probes -> calibration -> re-rank -> one decision -> the plan.

`planner.commands` parses arguments and renders an `OptimizeResult` (planner.reporting.report); the
same result feeds the tables, `--json` and the written plan, so what the screen calls "chosen" is
what the plan says. Nothing here prints: progress goes through the `log`/`on_stats`/`on_probe`
callbacks the caller passes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gptplan import userdata
from gptplan.errors import UserError
from gptplan.progress import quiet

if TYPE_CHECKING:  # annotations only (these modules import heavier ones, or this one)
    from gptplan.plan import Plan
    from planner.corpus.corpus_stats import CorpusStatistics
    from planner.screen.decide import Decision
    from planner.screen.table import CandidateRow, CandidateTable
    from planner.spec import Spec
    from planner.tuning.autotune import TuneOutcome
    from planner.tuning.calibration import Calibration

MEASURED_FIELDS = [
    "tokens_per_second",
    "step_time_s",
    "peak_memory_gb",
    "mfu",
    "hours",
    "cost",
    "cost_per_million_tokens",
    "step_time_interval_s",
    "step_time_spread",
]


@dataclass
class Tuning:
    """What probing this machine found (None in OptimizeResult when nothing was probed)."""

    profile: str
    local_rows: np.ndarray
    outcome: TuneOutcome
    calibration: Calibration | None
    calibration_path: Path | None
    calibrated_cost: dict[int, float]  # row -> cost under the calibrated model


@dataclass
class OptimizeResult:
    spec: Spec
    stats: CorpusStatistics
    target: float
    decision: Decision  # the model's search
    timings: dict
    chosen: int | None = None  # the one decision: a row of decision.table
    chosen_source: str = "model"  # "model" | "probe"
    tuning: Tuning | None = None
    plan: Plan | None = None  # the plan to write (None: no plan)
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # planner.corpus.dataprep.report(...)["json"]

    @property
    def table(self) -> CandidateTable:
        return self.decision.table

    @property
    def currency(self) -> str:
        return self.spec.constraints.currency

    def measured(self, i: int):
        """The probe result of row i, if it was probed."""
        return self.tuning.outcome.probed.get(i) if self.tuning else None

    def calibrated_cost(self, i: int) -> float | None:
        return self.tuning.calibrated_cost.get(i) if self.tuning else None

    def estimate(self, i: int) -> tuple[float, str]:
        """Best available cost of row i and where it comes from: measured > calibrated >
        modelled."""
        from planner.tuning.autotune import measured_cost

        r = self.measured(i)
        if r is not None and r.ok:
            return float(measured_cost(self.table, i, r, "mean")[0]), "measured"
        cal = self.calibrated_cost(i)
        if cal is not None:
            return float(cal), "calibrated"
        return float(self.table["cost"][i]), "modelled"


def plan_space(spec, *, log: Callable = print, on_stats: Callable | None = None):
    """Spec -> (stats, target, decision, timings): statistics first (reported through
    `on_stats(stats, target)` before the search starts), then the model's search."""
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen.decide import decide
    from planner.screen.evaluate import evaluate_space
    from planner.screen.space import target_tokens

    timings = {}
    t0 = time.perf_counter()
    profiles = load_profiles()
    offers = allowed_offers(spec, profiles)
    if not offers:
        known = ", ".join(sorted(profiles))
        raise UserError(
            f"no hardware offer matches constraints.profiles "
            f"{spec.constraints.profiles} / offers {spec.constraints.offers}; known "
            f"profiles: {known}",
            file=spec.path,
            key="constraints.profiles",
        )
    stats = measure_corpus(spec, log=log)
    timings["corpus_statistics_s"] = time.perf_counter() - t0
    sample = min(spec.constraints.seq_lens) + 1
    if (
        not stats.compute_only and stats.total_tokens < sample
    ):  # the runner refuses such a corpus too
        raise UserError(
            f"the corpus holds {stats.total_tokens:,.0f} tokens "
            f"({stats.total_tokens_source}), fewer "
            f"than one training sample of seq_len + 1 = {sample} tokens; give a "
            "larger corpus or declare job.corpus_bytes",
            file=spec.path,
            key="job.corpus",
        )
    target = target_tokens(spec, stats)
    if on_stats is not None:
        on_stats(stats, target)
    t1 = time.perf_counter()
    table = evaluate_space(spec, offers, target)
    decision = decide(spec, table, target)
    timings["search_s"] = time.perf_counter() - t1
    timings["candidates"] = len(table)
    return stats, target, decision, timings


def measure_corpus(spec, *, log: Callable = quiet):
    """The corpus statistics (planner.corpus.corpus_stats) of the spec, and the model's vocab_size
    set from the tokenizer they measured (set_planned_vocab)."""
    from planner.corpus.corpus_stats import spec_corpus_statistics

    stats = spec_corpus_statistics(spec, log=log)
    set_planned_vocab(spec, stats, log=log)
    spec.planned_corpus_tokens = stats.total_tokens  # the task's disk (pricebook.candidate_disk)
    spec.planned_corpus_bytes = stats.declared_bytes or stats.local_bytes
    return stats


def set_planned_vocab(spec, stats, *, log: Callable = quiet) -> None:
    """The model's vocab_size: the one asked for (model.vocab_size, else the named size's),
    kept unless the run's own tokenizer will have another size:

    - the run trains its tokenizer on the corpus the spec names, and that whole corpus
      supports fewer pieces than asked (sentencepiece stops short): the tokenizer's size;
    - a given tokenizer with more pieces than asked: its size (the model must hold every id).

    A sample that cannot train the asked size (job.corpus_bytes declares a larger corpus)
    extrapolates tokens per character and keeps the asked size; a declared tokens_per_char
    and a compute-only spec keep it too. Padding for tensor parallelism is the chosen plan's
    (gptplan.tokenizer.padded_vocab, in the search and the plan). Every change is one line in
    spec.model_changes (console, --json and the plan's notes)."""
    asked = spec.asked_vocab_size()
    have = int(stats.tokenizer_target_vocab or 0)
    vocab = asked
    if spec.model_pinned:  # estimate --plan: the plan's model, exactly
        pass
    elif have and not stats.compute_only and stats.tokens_per_character_source == "measured":
        trained = bool(stats.tokenizer_scheme)
        if (trained and have < asked) or have > asked:
            vocab = have
    spec.planned_vocab_size = vocab
    if vocab != asked:
        why = (
            f"the run trains its {stats.tokenizer_scheme} tokenizer on the named corpus, "
            f"which supports {have:,} of the {asked:,} asked pieces"
            if vocab < asked
            else f"the tokenizer {stats.tokenizer} has {have:,} pieces, more than the "
            f"{asked:,} asked"
        )
        model_change(spec, f"model.vocab_size {asked:,} -> {vocab:,}: {why}")


def model_change(spec, line: str) -> None:
    """Record (once) one change the planner makes to the model the spec asks for: the
    result's notes show it on the console and in --json, the plan's provenance notes keep it."""
    if line not in spec.model_changes:
        spec.model_changes.append(line)


def tune_locally(
    spec,
    decision,
    target,
    settings,
    *,
    local_profile: str,
    work_dir: Path,
    log: Callable = quiet,
    on_probe: Callable | None = None,
    write_calibration: bool = True,
) -> Tuning | None:
    """Probe the locally runnable candidates (planner.tuning.autotune), fit the calibration, and
    re-rank every local candidate with it. None when no planned offer runs here."""
    from planner.tuning import calibration
    from planner.tuning.autotune import calibrated_costs, tune
    from runner.probe import check_local_profile

    table = decision.table
    check_local_profile(local_profile)  # the rehearsal device's profile needs the device
    offers_local = [i for i, c in enumerate(table.offers) if c.profile.name == local_profile]
    if not local_profile or not offers_local:
        used = {c.profile.name: c.profile.efficiency_for("fp16").source for c in table.offers}
        which = local_profile or "unknown GPU; pass --local-profile"
        log(
            f"no planned offer runs on this machine's devices ({which}): planning from the "
            "model only; efficiency calibrations used: "
            + "; ".join(f"{k}: {v}" for k, v in used.items())
        )
        return None
    local_rows = np.flatnonzero(np.isin(table["offer"], offers_local) & table["fits"])
    log(
        f"autotuning on {local_profile}: {len(local_rows):,} runnable candidates, at most "
        f"{settings.probes} probes / {settings.probe_time_s:g} s"
    )
    outcome = tune(
        spec,
        table,
        local_rows,
        target=target,
        work_dir=work_dir,
        settings=settings,
        progress=on_probe,
        log=log,
    )
    log(
        f"study {outcome.study_name} in {outcome.storage}: {len(outcome.probed)} "
        f"configuration(s) measured, {outcome.probes_run} probe(s) run now, {outcome.reused} "
        f"reused from the probe cache, probe time {outcome.probe_wall_s:.0f} s"
    )
    profile = table.offers[offers_local[0]].profile
    fitted = calibration.fit(
        table, outcome.probed, profile, fingerprint=outcome.study_name.rsplit("-", 1)[-1]
    )
    path = calibration.write(fitted) if fitted is not None and write_calibration else None
    costs = (
        calibrated_costs(table, local_rows, outcome.probed)
        if outcome.probed
        else table["cost"][local_rows]
    )
    return Tuning(
        local_profile,
        local_rows,
        outcome,
        fitted,
        path,
        {int(i): float(c) for i, c in zip(local_rows, costs)},
    )


def step_statistics(steps, level: float = 0.95) -> dict:
    """Mean step time, its `level` interval (Student t) and the relative 10-90% spread of
    single steps, from measured step times."""
    from scipy import stats as st

    steps = np.asarray(steps, dtype=float)
    mean = float(steps.mean())
    if len(steps) < 2:
        return {"mean_s": mean, "interval_s": [mean, mean], "spread": 0.0, "steps": len(steps)}
    half = float(
        st.t.ppf(0.5 + level / 2, len(steps) - 1) * steps.std(ddof=1) / np.sqrt(len(steps))
    )
    p10, p90 = np.quantile(steps, [0.1, 0.9])
    return {
        "mean_s": mean,
        "interval_s": [mean - half, mean + half],
        "spread": float((p90 - p10) / statistics.median(steps)),
        "steps": len(steps),
    }


def measured_row(table: CandidateTable, i: int, result, target: float) -> CandidateRow:
    """Row i with the probe's measurements (mean step: what a run pays for) in place of the
    modelled numbers."""
    from planner.tuning.autotune import cost_at_step, measured_cost

    row = table.row(i)
    cost, hours = measured_cost(table, i, result, "mean")
    step = result.mean_step_time_s or result.step_time_s
    spread = step_statistics(result.step_times_s or [step])
    # the 80% interval of the mean step (as the model's p10-p90), carried to tokens/s, hours
    # and cost
    low, high = step_statistics(result.step_times_s or [step], level=0.8)["interval_s"]
    (cost_lo, hours_lo), (cost_hi, hours_hi) = (
        cost_at_step(table, i, low),
        cost_at_step(table, i, high),
    )
    return row | {
        "tokens_per_s_p10": row["tokens_per_step"] / high,
        "tokens_per_s_p90": row["tokens_per_step"] / low,
        "hours_p10": hours_lo,
        "hours_p90": hours_hi,
        "cost_p10": cost_lo,
        "cost_p90": cost_hi,
        "interval_source": f"80% interval of the mean of {spread['steps']} measured probe "
        "steps (Student t)",
        "step_time_s": step,
        "tokens_per_s": row["tokens_per_step"] / step,
        "memory_gb": result.peak_memory_gb,
        "cost": cost,
        "hours": hours,
        "cost_per_million_tokens": cost / target * 1e6,
        "mfu": row["mfu"] * row["step_time_s"] / step,
        "step_time_interval_s": spread["interval_s"],
        "step_time_spread": spread["spread"],
    }


def optimize(
    spec,
    *,
    settings=None,
    local_profile: str = "",
    work_dir: Path | None = None,
    log: Callable = quiet,
    on_stats: Callable | None = None,
    on_probe: Callable | None = None,
) -> OptimizeResult:
    """The whole `planner optimize`: model search, then (with settings.probes > 0) probes,
    calibration, re-rank and one decision; returns the result with the plan to write."""
    from planner.reporting.report import describe, race_note
    from planner.writing.planwriter import candidate_plan, decision_notes

    stats, target, decision, timings = plan_space(spec, log=log, on_stats=on_stats)
    result = OptimizeResult(spec, stats, target, decision, timings, chosen=decision.chosen)
    cur = spec.constraints.currency
    from planner.corpus import dataprep

    result.data = dataprep.report(
        stats, target, None, cache_dir=str(userdata.cache_dir(spec.job.cache_dir)), currency=cur
    )["json"]
    if decision.chosen is None:
        result.notes = [*spec.model_changes, *result.notes]
        return result
    chosen: int = decision.chosen
    notes = decision_notes(decision, lambda i: describe(decision.table, i, cur))
    if settings is not None and settings.probes > 0:
        t0 = time.perf_counter()
        result.tuning = tune_locally(
            spec,
            decision,
            target,
            settings,
            local_profile=local_profile,
            work_dir=work_dir or Path("runs") / "autotune" / spec.job.name,
            log=log,
            on_probe=on_probe,
        )
        timings["tuning_s"] = time.perf_counter() - t0
        best = result.tuning.outcome.best_row if result.tuning else None
        if result.tuning is not None and best is None:
            result.notes.append(
                "no probed configuration met the constraints: keeping the model's choice"
            )
        elif best is not None:
            chosen = result.chosen = best
            result.chosen_source = "probe"
    table = decision.table
    data = dataprep.report(
        stats,
        target,
        table.row(chosen),
        cache_dir=str(userdata.cache_dir(spec.job.cache_dir)),
        currency=cur,
    )
    result.data = data["json"]
    notes += data["notes"]
    result.notes += data["notes"][:1]  # the preparation line (the warning is shown with stats)
    tuning = result.tuning
    if result.chosen_source == "probe" and tuning is not None:
        outcome = tuning.outcome
        row = measured_row(table, chosen, outcome.probed[chosen], target)
        notes.append(
            f"autotuned: study {outcome.study_name}, {len(outcome.probed)} "
            f"configurations measured, {outcome.probes_run} probes, "
            f"{outcome.probe_wall_s:.0f} s of probes; the model's choice was "
            f"{describe(table, decision.chosen, cur)}"
        )
        if outcome.race is not None:
            measured = (row["cost_per_million_tokens"], outcome.probed[chosen].measured_steps)
            notes.append(race_note(table, outcome.race, cur, measured))
        if tuning.calibration is not None:
            notes.append(
                f"calibration: {tuning.profile} fit error {tuning.calibration.fit_error:.1%}"
            )
        result.plan = candidate_plan(
            spec,
            row,
            target=target,
            notes=notes,
            measured=MEASURED_FIELDS,
            probes=len(outcome.probed),
            stats=stats,
        )
    else:
        result.plan = candidate_plan(
            spec, table.row(chosen), target=target, notes=notes, stats=stats
        )
    from planner.writing.planwriter import vocab_padding

    padding = vocab_padding(
        spec.model_section().vocab_size, result.plan.parallel.tensor_parallel_degree
    )[1]
    if padding:
        model_change(spec, padding)
    result.notes = [*spec.model_changes, *result.notes]
    return result
