"""`planner explain PLAN`: why this plan, what the runner-up costs, and which claims of the
bank-FAQ reference case (../shared/REFERENCES.md section 7) hold according to the model.

Every comparison re-evaluates the cost model with one setting changed, so each verdict is a
modelled ratio with the configuration it was computed on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from gptplan import families, precision
from gptplan.plan import Plan, load_plan
from gptplan.tomlconf import read_toml
from planner.market.hardware import load_profiles
from planner.market.offers import OfferChoice
from planner.screen import costmodel as cm
from planner.screen import coverage
from planner.screen.evaluate import evaluate_offer
from planner.spec import SpecError, load_spec


def _one(spec, choice: OfferChoice, target: float, **pins) -> dict | None:
    """Evaluate a single configuration (pinned search lists) on one offer; None if invalid."""
    s = dataclasses.replace(
        spec.search, **{k: v for k, v in pins.items() if hasattr(spec.search, k)}
    )
    c = dataclasses.replace(
        spec.constraints, **{k: v for k, v in pins.items() if hasattr(spec.constraints, k)}
    )
    sp = dataclasses.replace(spec, search=s, constraints=c)
    rows = evaluate_offer(sp, choice, 0, target)
    if not rows or not len(rows["nodes"]):
        return None
    i = int(np.argmin(rows["cost"]))
    return {k: v[i].item() for k, v in rows.items()}


def _pins_from_plan(plan: Plan) -> dict:
    """The plan's layout as search/constraint pins (gptplan.layout: the one translation),
    its capacity kind, and no global-batch range (the layout fixes the batch)."""
    from gptplan.layout import Layout

    pins = {
        key.split(".", 1)[1]: value
        for key, value in Layout.from_plan(plan).spec_pins().items()
        if not key.startswith("training.")
    }
    return pins | dict(
        spot=plan.hardware.spot,
        on_demand=not plan.hardware.spot,
        global_batch_tokens_min=0,
        global_batch_tokens_max=0,
    )


def uncertainty_terms(
    row: dict,
    profile,
    precision: str,
    params_total: float = 0.0,
    family: str = families.DEFAULT_FAMILY,
) -> dict:
    """Which term of the modelled step time dominates, and so the interval.

    The interval comes from the leave-one-out residuals of the efficiency fit (published runs);
    a step dominated by compute inherits that spread directly, one dominated by communication
    rests on link bandwidths the published runs barely constrain (say so)."""
    terms = {
        "compute (fitted efficiency)": row["compute_s"] * row["bubble"],
        "tensor-parallel all-reduces": row["tp_s"] * row["bubble"],
        "pipeline point-to-point": row["pp_s"],
        "gradient sync (not hidden)": row["comm_s"] - row["tp_s"] - row["pp_s"],
        "optimizer step": row["opt_s"],
    }
    total = sum(terms.values())
    shares = {k: v / total for k, v in terms.items()}
    dominant = max(shares, key=lambda k: shares[k])
    eff = profile.efficiency_for(precision)
    lo, hi = eff.interval_ratios(params_total)
    outside = coverage.row_reasons(profile, precision, params_total, family, row)
    n = min(len(outside), coverage.MAX_OUTSIDE_AXES)
    lo, hi = (float(x) for x in coverage.widen(lo, hi, n, eff.extrapolation_log_error))
    cap = coverage.mfu_cap(profile)
    capped = ""
    if cap is not None and row.get("mfu", 0) > 0 and hi > cap.mfu / row["mfu"]:
        hi = cap.mfu / row["mfu"]  # the physical cap, as the search applies it
        lo = min(lo, hi)
        capped = f"; p90 {cap.words()}"
    basis = (
        f"{coverage.basis_words(eff, outside)}{capped}, of the published runs on "
        f"this GPU generation (x{lo:.3g}..x{hi:.3g} on tokens/s)"
        if eff.fit_rows
        else "no published runs for this hardware: the wide default "
        f"spread x{lo:g}..x{hi:g} of an uncalibrated prior"
    )
    return {
        "dominant_term": dominant,
        "dominant_share": shares[dominant],
        "shares": shares,
        "interval_basis": basis,
    }


CLAIMS_FILE = Path(__file__).parents[1] / "specs" / "bank_faq_claims.toml"
BANK_FAQ_SPEC = "embedded:bank_faq"


def _find_offer(
    spec, profiles, profile: str, offer_key: str | None = None, spot: bool | None = None
) -> OfferChoice | None:
    """The offer as the spec would price it (of an instance priced in several regions, the
    region the planner priced this capacity in: planner.market.offers.region_choices); None when
    absent or when the spec has no rate for its currency (explain never guesses a rate)."""
    from planner.market.offers import region_choices

    prof = profiles.get(profile)
    if prof is None:
        return None
    key = offer_key or next((o.key for o in prof.offers), None)
    mine = [o for o in prof.offers if o.key == key]
    capacity = {True: "spot", False: "on_demand", None: ""}[spot]
    for offer, only, where in region_choices(mine, any_region=spec.constraints.any_region):
        if only in ("", capacity) or not capacity:
            try:
                return OfferChoice(
                    prof, offer, spec.rate(offer.currency), capacity=only, where=where
                )
            except SpecError:
                return None
    return None


def _spec_for(plan: Plan, spec_path: str | None):
    recorded = plan.provenance.spec
    if spec_path is None and recorded and recorded != BANK_FAQ_SPEC and Path(recorded).exists():
        spec_path = recorded
    spec = load_spec(spec_path)
    if spec.constraints.currency != plan.budget.currency:  # explain in the plan's currency
        spec = load_spec(spec_path, overrides={"constraints.currency": plan.budget.currency})
    spec.planned_vocab_size = plan.model.vocab_size  # the model as planned (tokenizer padded)
    return spec


def explain_plan(plan_path, *, spec_path: str | None = None, claims: bool | None = None) -> dict:
    """Why this plan (estimate, interval, dominant uncertainty, warnings) and, for plans from
    the bank-FAQ spec or with claims=True, which of the article's claims the model supports."""
    plan = load_plan(plan_path)
    spec = _spec_for(plan, spec_path)
    profiles = load_profiles()
    target = float(plan.job.target_tokens or plan.tokens_per_step * plan.training.max_steps)
    out: dict = {
        "plan": str(plan_path),
        "currency": plan.budget.currency,
        "notes": plan.provenance.notes,
        "estimate": dataclasses.asdict(plan.estimate),
        "claims": [],
    }
    choice = _find_offer(
        spec, profiles, plan.hardware.profile, plan.hardware.offer, plan.hardware.spot
    )
    if choice is None:
        out["warnings"] = [
            "the plan's offer is not in the current profiles (or its currency "
            "has no rate in the spec): cannot re-evaluate"
        ]
        return out
    pins = _pins_from_plan(plan)
    here = _one(spec, choice, target, **pins)
    if here:
        out["uncertainty"] = uncertainty_terms(
            here,
            choice.profile,
            plan.training.precision,
            float(cm.ModelShape.from_section(plan.model).params_total),
            plan.model.family,
        )
        from planner.screen.memory import memory_breakdown

        out["memory"] = memory_breakdown(
            plan.model, choice.profile, here, choice.offer.gpus_per_node
        ) | {"card_gib": choice.profile.memory_gb}
    stats = _corpus_stats(spec)
    from planner.corpus.corpus_stats import epochs_warning

    warning = epochs_warning(stats, target)
    if warning:
        out["warnings"] = [warning]
    if claims if claims is not None else plan.provenance.spec == BANK_FAQ_SPEC:
        out["claims"] = article_claims(spec, plan, choice, here, pins, target, stats, profiles)
    return out


def _corpus_stats(spec):
    from planner.corpus.corpus_stats import spec_corpus_statistics

    return spec_corpus_statistics(spec)


def _claim(name, article, model, verdict, tolerance="") -> dict:
    """One claim: the article's words, the model's number (recomputed here), the verdict and
    the rule that gave it (`tolerance`, printed beside the verdict)."""
    return {
        "claim": name,
        "article": article,
        "model": model,
        "verdict": verdict,
        "tolerance": tolerance,
    }


def article_claims(spec, plan, choice, here, pins, target, stats, profiles) -> list[dict]:
    """The bank-FAQ article's claims (numbers in specs/bank_faq_claims.toml) vs the model."""
    data = read_toml(CLAIMS_FILE, SpecError)
    out = []
    if here:
        out += _amp_claims(data["amp"], spec, plan, choice, here, pins, target)
        out.append(_recompute_claim(data["recompute"], plan))
        out += _spot_claim(data["spot"], spec, plan, choice, here, pins, target)
    out.append(_tokenizer_claim(data["tokenizer"], stats))
    seqs, tokens = data["steps_batch"]
    total = data["target_tokens"]
    steps = total / (seqs * tokens)
    claimed, tol = data["steps_claim"], data["steps_tolerance"]
    out.append(
        _claim(
            "190k steps",
            f"about 190k steps at {seqs} x {tokens} tokens per step",
            f"{steps:,.0f} steps for {total:.3g} tokens; 64 x 1024 "
            f"would need {total / data['small_batch_tokens']:,.0f}",
            "holds" if abs(steps / claimed - 1) <= tol else "differs",
            f"holds within {tol:.0%} of {claimed:,.0f}",
        )
    )
    out += _article_run_claims(data, spec, profiles)
    b = data["budget"]
    cost = plan.estimate.cost
    out.append(
        _claim(
            "12,000 yuan",
            b["claim"],
            f"this plan: {cost:,.0f} {plan.budget.currency} ({plan.estimate.source}); "
            "no quoted P4 cloud price exists in our price lists, so the P4 figure "
            "cannot be checked",
            "the planned hardware is far cheaper"
            if plan.budget.currency == b["currency"] and cost < b["far_cheaper_below"]
            else "not comparable"
            if plan.budget.currency != b["currency"]
            else "similar",
            f"far cheaper below {b['far_cheaper_below']:,.0f} {b['currency']}",
        )
    )
    return out


def _amp_claims(d, spec, plan, choice, here, pins, target) -> list[dict]:
    if not precision.row(plan.training.precision).mixed:
        return []
    fp32 = _one(spec, choice, target, **(pins | {"precisions": ["fp32"]}))
    # like for like: flash attention needs 16 bit, so AMP's own saving is measured with the
    # standard attention kernel on both sides
    same_kernel = _one(spec, choice, target, **(pins | {"flash_attention": False}))
    if not (fp32 and same_kernel):
        return []
    saving = 1 - same_kernel["memory_gb"] / fp32["memory_gb"]
    speedup = fp32["step_time_s"] / here["step_time_s"] - 1
    flash = (
        f"; with the flash attention 16 bit enables, {here['memory_gb']:.1f} GB"
        if here.get("flash")
        else ""
    )
    name, prof = choice.profile.name, choice.profile
    lo, hi = d["memory_holds"]
    return [
        _claim(
            "AMP memory",
            d["memory_claim"],
            f"{saving:.0%} less per device ({fp32['memory_gb']:.1f} -> "
            f"{same_kernel['memory_gb']:.1f} GB, same attention kernel) on {name}{flash}",
            "holds" if lo <= saving <= hi else "differs",
            f"holds for a saving of {lo:.0%}-{hi:.0%}",
        ),
        _claim(
            "AMP speed",
            d["speed_claim"],
            f"{speedup:.0%} faster on {name} (tensor-core peak "
            f"{prof.peak_for(plan.training.precision):g} vs {prof.peak_for('fp32'):g} "
            "TFLOPS used for fp32)",
            "holds" if speedup >= d["speed_holds"] else "does not hold",
            f"holds at >= {d['speed_holds']:.0%} faster",
        ),
    ]


def _recompute_claim(d, plan) -> dict:
    shape = cm.ModelShape.from_section(plan.model)
    args = dict(
        seq_len=plan.training.seq_len,
        micro_batch=plan.training.per_device_train_batch_size,
        tp=plan.parallel.tensor_parallel_degree,
        seq_parallel=plan.parallel.sequence_parallel,
        act_bytes=precision.row(plan.training.precision).bytes_per_element,
    )
    none = float(cm.activation_bytes_per_layer(shape, recompute_code=0, **args))
    full = float(cm.activation_bytes_per_layer(shape, recompute_code=3, **args))
    saving = 1 - full / none
    return _claim(
        "recompute",
        d["claim"],
        f"full recompute keeps {full / none:.0%} of activations ({saving:.0%} saved) "
        f"at seq {plan.training.seq_len}; it costs about 1/3 more compute",
        "holds (the model says more)"
        if saving >= d["holds_more"]
        else "holds"
        if saving >= d["holds"]
        else "differs",
        f"holds at >= {d['holds']:.0%} saved (more: >= {d['holds_more']:.0%})",
    )


def _spot_claim(d, spec, plan, choice, here, pins, target) -> list[dict]:
    if not choice.offer.has_spot:
        return []
    other = _one(
        spec,
        choice,
        target,
        **(pins | {"spot": not plan.hardware.spot, "on_demand": plan.hardware.spot}),
    )
    if not other:
        return []
    spot_row, od_row = (here, other) if plan.hardware.spot else (other, here)
    ratio = spot_row["cost"] / od_row["cost"]
    lo, hi = d["holds"]
    return [
        _claim(
            "spot price",
            d["claim"],
            f"{ratio:.0%} of on-demand on {choice.offer.key} including expected "
            f"preemptions ({spot_row['preemptions']:.2g}; useful fraction "
            f"{spot_row['useful_fraction']:.1%})",
            "holds"
            if lo <= ratio <= hi
            else "differs: cheaper than claimed"
            if ratio < lo
            else "does not hold for this offer",
            f"holds for a ratio of {lo:.0%}-{hi:.0%}",
        )
    ]


def _tokenizer_claim(d, stats) -> dict:
    how = (
        "declared in the spec"
        if stats.tokens_per_character_source == "declared"
        else f"extrapolated to the planned {stats.tokenizer_target_vocab:,} pieces (80% "
        f"range {stats.tokens_per_character_p10:.2f}-{stats.tokens_per_character_p90:.2f}) "
        f"from our {stats.tokenizer_scheme} tokenizers of "
        f"{', '.join(f'{v:,}' for v in stats.vocab_fit.get('sizes', []))} pieces, which the "
        f"{stats.sample_documents:,} sample documents support"
        if stats.tokens_per_character_source == "extrapolated"
        else f"measured with our {stats.tokenizer_scheme or stats.tokenizer} tokenizer "
        f"({stats.tokenizer_vocab:,} pieces) on {stats.sample_documents:,} sample documents"
    )
    return _claim(
        "tokens per character",
        d["claim"],
        f"{stats.tokens_per_character:.2f} {how}",
        "differs: a word-level CPM vocabulary gives fewer than 1 token per character"
        if stats.tokens_per_character < d["similar_above"]
        else "similar",
        f"similar at >= {d['similar_above']:g} tokens per character",
    )


def _article_run_claims(data, spec, profiles) -> list[dict]:
    """The article's own configuration on P4s: time, energy."""
    run = data["article_run"]
    p4 = _find_offer(spec, profiles, run["profile"])
    if p4 is None:
        return []
    article = _one(spec, p4, data["target_tokens"], **data["config"])
    if not article:
        return []
    kwh = article["energy_kwh"]
    scale = run["compare_gpus"] * run["compare_tdp_w"] * run["compare_hours"] / 1000
    return [
        _claim(
            "7 days",
            run["days_claim"],
            f"{article['hours'] / 24:,.1f} days on 8 x P4 (fp32: P4 has no fast fp16, so "
            f"the article's fp16 cannot have sped it up), MFU {article['mfu']:.0%}",
            "does not hold" if article["hours"] > 24 * run["days_hold_below"] else "holds",
            f"holds below {run['days_hold_below']:g} days",
        ),
        _claim(
            "100 kWh / 70 yuan",
            run["energy_claim"],
            f"{kwh:,.0f} kWh for 8 P4s over that time ({p4.offer.energy_basis(p4.profile.tdp_w)}); "
            f"{run['compare_gpus']} A100s for 7 days would draw {scale:,.0f} kWh",
            "does not hold" if kwh > run["kwh_hold_below"] else "holds",
            f"holds at <= {run['kwh_hold_below']:g} kWh",
        ),
    ]


def render_explanation(result: dict) -> str:
    from tabulate import tabulate

    lines = [f"Why {result['plan']}:"]
    lines += [f"  - {n}" for n in result["notes"]]
    est = result["estimate"]
    lines.append(
        f"  estimate ({est['source']}): {est['cost']:,.0f} {result['currency']}, "
        f"{est['hours']:,.1f} h, {est['tokens_per_second']:,.0f} tokens/s, "
        f"{est['peak_memory_gb']:.1f} GB/device, MFU {est['mfu']:.1%}"
    )
    if est.get("cost_p90"):
        lines.append(
            f"  80% interval (p10-p90): {est['cost_p10']:,.0f}-{est['cost_p90']:,.0f} "
            f"{result['currency']}, {est['hours_p10']:,.1f}-{est['hours_p90']:,.1f} h, "
            f"{est['tokens_per_second_p10']:,.0f}-{est['tokens_per_second_p90']:,.0f} "
            "tokens/s"
        )
    unc = result.get("uncertainty")
    if unc:
        lines.append(
            f"  uncertainty: {unc['dominant_term']} is {unc['dominant_share']:.0%} of "
            f"the modelled step, so it dominates; interval from "
            f"{unc['interval_basis']}"
        )
    mem = result.get("memory")
    if mem:
        card = mem["card_gib"] * 2**30 / 1e9
        terms = ", ".join(f"{k} {v:.2f}" for k, v in mem["terms"].items())
        lines.append(
            f"  memory per device (modelled, GB; {mem['total_gb'] / card:.0%} of the "
            f"{mem['card_gib']:g} GiB card): {terms}; total {mem['total_gb']:.2f}"
        )
        if mem["changes"]:
            words, gb = mem["changes"][0]
            lines.append(f"  frees the most: {words} (-{gb:.2f} GB, modelled)")
    lines += [f"  {w}" for w in result.get("warnings", [])]
    from planner.reporting.costreport import fit_lines

    lines = [fit_lines(line) for line in lines]
    if result["claims"]:
        lines.append("")
        lines.append("Bank-FAQ article's claims vs the model (all modelled unless marked measured)")
        # cells wrapped so that the table keeps to 120 columns
        lines.append(
            tabulate(
                result["claims"],
                headers="keys",
                tablefmt="simple",
                maxcolwidths=[12, 22, 40, 20, 16],
            )
        )
    return "\n".join(lines)
