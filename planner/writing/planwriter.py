"""Turn one chosen candidate into the runner's plan (gptplan.plan is the schema)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from pathlib import Path

from gptplan import money
from gptplan.layout import Layout
from gptplan.plan import (
    BudgetSection,
    CheckpointSection,
    EstimateSection,
    HardwareSection,
    JobSection,
    ParallelSection,
    Plan,
    ProvenanceSection,
    TrainingSection,
)
from planner import __version__
from planner.market.disks import disk_line
from planner.market.hardware import Profile
from planner.screen import coverage
from planner.screen.decide import Decision
from planner.screen.table import CandidateRow
from planner.spec import Spec


def _sig(x: float, digits: int = 6) -> float:
    """Round to significant digits: plans are read by people; 3.3600000000000003 is noise."""
    return float(f"{x:.{digits}g}")


def _interval_source(prof: Profile, precision: str, row: CandidateRow) -> str:
    """The plan's interval in words: its ratios around the estimate and their basis (widened
    where the layout lies outside the published runs, planner.screen.coverage)."""
    eff = prof.efficiency_for(precision)
    lo = row["tokens_per_s_p10"] / row["tokens_per_s"]
    hi = row["tokens_per_s_p90"] / row["tokens_per_s"]
    if eff.calibrated_on:
        where = f"measured spread of the probes around the calibration ({eff.source})"
    elif eff.fit_rows:
        where = (
            f"{coverage.basis_words(eff, row.get('interval_outside_runs', []))} "
            f"(hardware_profiles/published_runs.csv, fitted {eff.calibrated_at})"
        )
    else:
        where = (
            "no published runs for this hardware: the default (wide) spread of an "
            "uncalibrated prior"
        )
    cap = coverage.mfu_cap(prof)
    if row.get("throughput_capped") and cap is not None:
        where += f"; p90 {cap.words()}"
        if hi <= 1.0 + 1e-9:  # the point (never clamped) is at or past the cap: the top is it
            where += "; the point estimate is at or above the cap, so it is the interval's top"
    return (
        f"80% interval on throughput x{lo:.3g}..x{hi:.3g}: {where}; hours and cost add the "
        "price spread and the spot preemption rate's range (planner.market.spotrisk)"
    )


def planned_corpus(spec: Spec, stats, *, trained_tokens: float) -> dict:
    """JobSection fields recording the corpus as planned (planner.corpus.corpus_stats statistics),
    apart from the sample they were measured on; {} without statistics, only the tokenizer's
    size when the corpus size is unknown (compute-only)."""
    if stats is None:
        return {}
    # the size the runner asks the trained tokenizer for: the planned vocabulary before any
    # padding for tensor parallelism (the asked size, or the run's own tokenizer's; the
    # model's rows above it are masked)
    vocab = {
        "tokenizer_vocab_size": spec.model_section().vocab_size
        if spec.job.tokenizer == "sentencepiece"
        else 0
    }
    if not stats.total_tokens:
        return vocab
    return vocab | {
        "corpus_sample": list(spec.job.corpus),
        "corpus_bytes": _sig(stats.declared_bytes or stats.local_bytes),
        "corpus_tokens": _sig(stats.total_tokens),
        "corpus_tokens_source": stats.total_tokens_source,
        "tokens_per_char": _sig(stats.tokens_per_character),
        "tokens_per_char_source": stats.tokens_per_character_source,
        "tokens_per_char_p10": _sig(stats.tokens_per_character_p10),
        "tokens_per_char_p90": _sig(stats.tokens_per_character_p90),
        "planned_epochs": _sig(trained_tokens / stats.total_tokens),
    }


def vocab_padding(vocab: int, tp: int) -> tuple[int, str]:
    """The plan's vocab_size for the chosen tensor-parallel degree and the line saying so
    ('' = unchanged): padded only where tp does not divide it (gptplan.tokenizer.padded_vocab),
    so a published vocabulary keeps its shape whenever it can."""
    from gptplan.tokenizer import padded_vocab

    padded = padded_vocab(vocab, tp)
    if padded == vocab:
        return vocab, ""
    return padded, (
        f"model.vocab_size {vocab:,} -> {padded:,}: padded to a multiple of the plan's "
        f"tensor-parallel degree {tp} (Paddle splits the vocabulary evenly); the "
        f"{padded - vocab:,} padding rows are masked in training and sampling"
    )


def planned_model(spec: Spec, tp: int):
    """The plan's [model]: the spec's (with the planner's vocabulary, planner.pipeline), its
    vocab_size padded for the chosen tensor-parallel degree (vocab_padding)."""
    model = spec.model_section()
    vocab, _ = vocab_padding(model.vocab_size, tp)
    return model if vocab == model.vocab_size else dataclasses.replace(model, vocab_size=vocab)


def _memory_notes(spec: Spec, row: CandidateRow) -> list[str]:
    """A plan kept inside the memory model's own error says so (planner.screen.memory.may_fit_note),
    and how its pipeline stages split when the layers do not divide evenly."""
    from planner.screen.memory import may_fit_note

    out = []
    if row.get("may_fit"):
        out.append(may_fit_note(row, row["offer_choice"].profile, spec.constraints.memory_headroom))
    layers, pp = spec.model_section().num_hidden_layers, int(row.get("pp", 1))
    if pp > 1 and layers % pp:
        out.append(
            f"uneven pipeline stages: {layers % pp} of {pp} stages hold "
            f"{layers // pp + 1} layers, the rest {layers // pp} (Paddle's uniform "
            "segmentation); the biggest stage sets step time and memory"
        )
    return out


def candidate_plan(
    spec: Spec,
    row: CandidateRow,
    *,
    target: float,
    notes: list[str] | None = None,
    measured: list[str] | None = None,
    probes: int = 0,
    stats=None,
) -> Plan:
    choice = row["offer_choice"]
    prof, offer = choice.profile, choice.offer
    steps = int(row["steps"])
    tr = spec.training
    precision = row["precision"]
    interval_steps = row["checkpoint_interval_h"] * 3600 / row["step_time_s"]
    interval_steps = max(
        1, min(steps, int(interval_steps) if math.isfinite(interval_steps) else steps)
    )
    cur = spec.constraints.currency
    price_note = (
        f"price {choice.native_node_price(spot=row['spot']):g} "
        f"{offer.currency}/node-hour x rate {choice.rate:g} {cur}/{offer.currency}"
        + (f" ({spec.rates_source})" if offer.currency != cur and spec.rates_source else "")
    )
    notes = [*_risk_notes(row, cur), *(notes or [])]
    # the row's layout as the plan's fields (gptplan.layout: the one translation)
    fields = Layout.from_row(row, fp16_opt_level=tr.fp16_opt_level).plan_fields()
    return Plan(
        name=spec.job.name,
        job=JobSection(
            corpus=list(spec.job.corpus),
            tokenizer=spec.job.tokenizer,
            target_tokens=int(target),
            seed=spec.job.seed,
            cache_dir=spec.job.cache_dir,
            **planned_corpus(spec, stats, trained_tokens=steps * row["tokens_per_step"]),
        ),
        model=planned_model(spec, int(row["tp"])),
        training=TrainingSection(
            **fields["training"],
            max_steps=steps,
            learning_rate=tr.learning_rate,
            min_learning_rate=tr.min_learning_rate,
            warmup_steps=max(1, int(steps * tr.warmup_fraction)),
            weight_decay=tr.weight_decay,
            packing=tr.packing,
            logging_steps=max(1, min(100, steps // 20)),
        ),
        parallel=ParallelSection(**fields["parallel"]),
        hardware=HardwareSection(
            profile=prof.name,
            offer=offer.key,
            device=prof.device,
            precisions=prof.precisions,
            peak_tflops=prof.peak_for(precision),
            memory_gb=prof.memory_gb,
            tdp_w=prof.tdp_w,
            spot=bool(row["spot"]),
            price_per_node_hour=_sig(row["price_node_hour"]),
            currency=cur,
        ),
        checkpoint=CheckpointSection(interval_steps=interval_steps, keep_last=2),
        budget=BudgetSection(
            max_cost=_sig(money.planned_ceiling(spec.constraints.budget, row["cost_p90"])),
            currency=cur,
            max_hours=spec.constraints.deadline_hours,
            budget_total=spec.constraints.budget,
            planned_cost=_sig(row["cost"]),
            planned_cost_p90=_sig(row["cost_p90"]),
            ceiling_factor=money.CEILING_FACTOR_OVER_P90 if row["cost_p90"] > 0 else 0.0,
        ),
        estimate=EstimateSection(
            source="probe" if measured else "model",
            tokens_per_second=_sig(row["tokens_per_s"]),
            step_time_s=_sig(row["step_time_s"]),
            peak_memory_gb=_sig(row["memory_gb"]),
            mfu=_sig(row["mfu"]),
            hours=_sig(row["hours"]),
            cost=_sig(row["cost"]),
            cost_per_million_tokens=_sig(row["cost_per_million_tokens"]),
            energy_kwh=_sig(row["energy_kwh"]),
            step_time_interval_s=[_sig(x) for x in row.get("step_time_interval_s", [])],
            step_time_spread=_sig(row.get("step_time_spread", 0.0)),
            tokens_per_second_p10=_sig(row["tokens_per_s_p10"]),
            tokens_per_second_p90=_sig(row["tokens_per_s_p90"]),
            hours_p10=_sig(row["hours_p10"]),
            hours_p90=_sig(row["hours_p90"]),
            cost_p10=_sig(row["cost_p10"]),
            cost_p90=_sig(row["cost_p90"]),
            interval=row.get("interval_source") or _interval_source(prof, precision, row),
            measured=measured or [],
        ),
        provenance=ProvenanceSection(
            created_by=f"planner {__version__}",
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            spec=spec.path,
            spec_sha256=spec.sha256,
            prices_source=offer.source,
            prices_as_of=offer.as_of,
            probes=probes,
            notes=[
                price_note,
                *spec.model_changes,
                *[x for x in [vocab_padding(spec.model_section().vocab_size, row["tp"])[1]] if x],
                *_memory_notes(spec, row),
                *(notes or []),
            ],
        ),
    )


def _risk_notes(row: CandidateRow, cur: str) -> list[str]:
    """The price's age and, on spot, the preemptions in the cost and the on-demand cost."""
    f = row["offer_choice"].price
    age = "undated" if f.age_days is None else f"{f.age_days} days old at planning"
    out = [
        f"price as of {row['offer_choice'].offer.as_of or '(no date)'} ({age}"
        + ("; stale" if f.stale else "")
        + ")"
    ]
    if row["spot"]:
        out.append(
            f"spot: {row['preemptions']:.2g} expected preemptions at {f.risk.rate:g} per "
            f"node-hour (80% range {f.risk.low:g}-{f.risk.high:g}; {f.risk.source}), "
            f"included in the cost; the same plan on-demand: "
            f"{row['cost_on_demand']:,.0f} {cur} (modelled)"
        )
    if row["spot"] and f.outlier:
        out.append(f.outlier_note)
    out.append(disk_line(row, cur))  # the task's disk, in price_per_node_hour and the cost
    return out


def decision_notes(decision: Decision, describe) -> list[str]:
    """Short, human notes on the alternatives, kept in the plan's provenance."""
    from planner.screen.decide import runner_up

    notes = [f"binding constraint: {decision.binding}"]
    other = runner_up(decision)
    if other is not None:
        notes.append(f"runner-up: {describe(other)}")
    notes.append(f"pareto front (cost vs hours, modelled): {len(decision.pareto)} plans")
    return notes


def write_spec_plan(plan: Plan, out: Path, spec: Spec) -> None:
    """Write the chosen plan; a rule of the plan schema that the spec's values break is the
    spec's error (its file and key), not the output file's."""
    from gptplan.errors import PlanError
    from gptplan.plan import write_plan
    from planner.spec import SpecError

    try:
        write_plan(
            plan,
            out,
            header=f"# Written by planner {__version__} from {spec.path}. Numbers in "
            "[estimate] are modelled unless listed in estimate.measured.\n",
        )
    except PlanError as err:
        raise SpecError(
            f"{err.detail} (in the plan this spec gives)", file=spec.path, key=err.key
        ) from None
