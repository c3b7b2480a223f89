"""`planner explain PLAN`: why this plan, what the runner-up costs, and which claims of the
bank-FAQ reference case (../shared/REFERENCES.md section 7) hold according to the model.

Every comparison re-evaluates the cost model with one setting changed, so each verdict is a
modelled ratio with the configuration it was computed on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from planner import costmodel as cm
from planner.hardware import load_profiles
from planner.search import OfferChoice, evaluate_offer
from planner.spec import load_spec
from gptplan.plan import Plan, load_plan

ARTICLE_TARGET_TOKENS = 50e9


def _one(spec, choice: OfferChoice, target: float, **pins) -> dict | None:
    """Evaluate a single configuration (pinned search lists) on one offer; None if invalid."""
    s = dataclasses.replace(spec.search, **{k: v for k, v in pins.items()
                                            if hasattr(spec.search, k)})
    c = dataclasses.replace(spec.constraints, **{k: v for k, v in pins.items()
                                                 if hasattr(spec.constraints, k)})
    sp = dataclasses.replace(spec, search=s, constraints=c)
    rows = evaluate_offer(sp, choice, 0, target)
    if not rows or not len(rows["nodes"]):
        return None
    i = int(np.argmin(rows["cost"]))
    return {k: v[i].item() for k, v in rows.items()}


def _pins_from_plan(plan: Plan) -> dict:
    p, t = plan.parallel, plan.training
    return dict(seq_lens=[t.seq_len], precisions=[t.precision],
                micro_batch_sizes=[t.per_device_train_batch_size],
                accumulation_steps=[t.gradient_accumulation_steps],
                tensor_parallel=[p.tensor_parallel_degree],
                pipeline_parallel=[p.pipeline_parallel_degree],
                virtual_pp=[p.virtual_pp_degree], sharding=[p.sharding],
                sharding_degrees=[p.sharding_parallel_degree] if p.sharding else [],
                flash_attention=t.use_flash_attention,
                recompute=[p.recompute], sequence_parallel=[p.sequence_parallel],
                node_counts=[p.nnodes], max_nodes=p.nnodes, spot=plan.hardware.spot,
                on_demand=not plan.hardware.spot, global_batch_tokens_min=0,
                global_batch_tokens_max=0)


def uncertainty_terms(row: dict, profile, precision: str, params_total: float = 0.0) -> dict:
    """Which term of the modelled step time dominates, and so the interval.

    The interval comes from the leave-one-out residuals of the efficiency fit (published runs);
    a step dominated by compute inherits that spread directly, one dominated by communication
    rests on link bandwidths the published runs barely constrain (say so)."""
    terms = {"compute (fitted efficiency)": row["compute_s"] * row["bubble"],
             "tensor-parallel all-reduces": row["tp_s"] * row["bubble"],
             "pipeline point-to-point": row["pp_s"],
             "gradient sync (not hidden)": row["comm_s"] - row["tp_s"] - row["pp_s"],
             "optimizer step": row["opt_s"]}
    total = sum(terms.values())
    shares = {k: v / total for k, v in terms.items()}
    dominant = max(shares, key=shares.get)
    eff = profile.efficiency_for(precision)
    lo, hi = eff.interval_ratios(params_total)
    basis = (f"{eff.interval_basis or 'leave-one-out residuals'} of the published runs on "
             f"this GPU generation (x{lo:g}..x{hi:g} on tokens/s)"
             if eff.fit_rows else "no published runs for this hardware: the wide default "
             f"spread x{lo:g}..x{hi:g} of an uncalibrated prior")
    return {"dominant_term": dominant, "dominant_share": shares[dominant],
            "shares": shares, "interval_basis": basis}


def _find_offer(spec, profiles, profile: str, offer_key: str | None = None) -> OfferChoice | None:
    prof = profiles.get(profile)
    if prof is None:
        return None
    for offer in prof.offers:
        if offer_key is None or offer.key == offer_key:
            return OfferChoice(prof, offer, spec.rate(offer.currency))
    return None


def explain_plan(plan_path, *, spec_path: str | None = None) -> dict:
    plan = load_plan(plan_path)
    recorded = plan.provenance.spec
    if spec_path is None and recorded and recorded != "embedded:bank_faq":
        spec_path = recorded
    spec = load_spec(spec_path)
    profiles = load_profiles()
    cur = spec.constraints.currency
    target = float(plan.job.target_tokens or plan.tokens_per_step * plan.training.max_steps)
    choice = _find_offer(spec, profiles, plan.hardware.profile, plan.hardware.offer)
    out: dict = {"plan": str(plan_path), "currency": cur, "notes": plan.provenance.notes,
                 "estimate": dataclasses.asdict(plan.estimate), "claims": []}
    if choice is None:
        out["claims"].append({"claim": "-", "article": "-", "model": "the plan's offer is not "
                              "in the current profiles; cannot re-evaluate", "verdict": "?"})
        return out
    pins = _pins_from_plan(plan)
    here = _one(spec, choice, target, **pins)
    claims = out["claims"]
    if here:
        out["uncertainty"] = uncertainty_terms(
            here, choice.profile, plan.training.precision,
            float(cm.ModelShape.from_section(plan.model).params_total))

    def claim(name, article, model, verdict):
        claims.append({"claim": name, "article": article, "model": model, "verdict": verdict})

    # AMP: memory and speed, same configuration in fp32
    if here and plan.training.precision != "fp32":
        fp32 = _one(spec, choice, target, **(pins | {"precisions": ["fp32"]}))
        # like for like: flash attention needs 16 bit, so AMP's own saving is measured with
        # the standard attention kernel on both sides
        same_kernel = _one(spec, choice, target, **(pins | {"flash_attention": False}))
        if fp32 and same_kernel:
            mem_saving = 1 - same_kernel["memory_gb"] / fp32["memory_gb"]
            speedup = fp32["step_time_s"] / here["step_time_s"] - 1
            flash_note = (f"; with the flash attention 16 bit enables, {here['memory_gb']:.1f}"
                          " GB" if here.get("flash") else "")
            claim("AMP memory", "about 40% less memory",
                  f"{mem_saving:.0%} less per device ({fp32['memory_gb']:.1f} -> "
                  f"{same_kernel['memory_gb']:.1f} GB, same attention kernel) on "
                  f"{choice.profile.name}{flash_note}",
                  "holds" if 0.25 <= mem_saving <= 0.55 else "differs")
            claim("AMP speed", "30% or more faster",
                  f"{speedup:.0%} faster on {choice.profile.name} (tensor-core peak "
                  f"{choice.profile.peak_for(plan.training.precision):g} vs "
                  f"{choice.profile.peak_for('fp32'):g} TFLOPS used for fp32)",
                  "holds" if speedup >= 0.3 else "does not hold")
    # Recompute: activation memory saved by full recompute
    if here:
        shape = cm.ModelShape.from_section(plan.model)
        args = dict(seq_len=plan.training.seq_len,
                    micro_batch=plan.training.per_device_train_batch_size,
                    tp=plan.parallel.tensor_parallel_degree,
                    seq_parallel=plan.parallel.sequence_parallel,
                    act_bytes=2.0 if plan.training.precision != "fp32" else 4.0)
        none = float(cm.activation_bytes_per_layer(shape, recompute_code=0, **args))
        full = float(cm.activation_bytes_per_layer(shape, recompute_code=3, **args))
        saving = 1 - full / none
        claim("recompute", "saves up to 60% of activation memory",
              f"full recompute keeps {full / none:.0%} of activations ({saving:.0%} saved) at "
              f"seq {plan.training.seq_len}; it costs about 1/3 more compute",
              "holds (the model says more)" if saving >= 0.6 else "holds" if saving >= 0.4
              else "differs")
    # Spot vs on-demand
    if choice.offer.has_spot and here:
        other = _one(spec, choice, target, **(pins | {"spot": not plan.hardware.spot,
                                                   "on_demand": plan.hardware.spot}))
        if other:
            spot_row, od_row = (here, other) if plan.hardware.spot else (other, here)
            ratio = spot_row["cost"] / od_row["cost"]
            claim("spot price", "spot costs about 30% of on-demand",
                  f"{ratio:.0%} of on-demand on {choice.offer.key} including preemption losses "
                  f"(useful fraction {spot_row['useful_fraction']:.1%})",
                  "holds" if ratio <= 0.4 else "does not hold for this offer")
    # Tokenizer efficiency
    from planner.corpus_stats import corpus_statistics

    stats = corpus_statistics(corpus=spec.job.corpus, tokenizer=spec.job.tokenizer,
                              vocab_size=spec.model_section().vocab_size,
                              cache_dir=spec.job.cache_dir,
                              sample_documents=spec.job.sample_documents,
                              declared_bytes=spec.job.corpus_bytes,
                              seq_lens=spec.constraints.seq_lens, log=lambda *a: None)
    how = (f"declared in the spec" if stats.tokens_per_character_source == "declared" else
           f"measured with our {stats.tokenizer_scheme or stats.tokenizer} tokenizer "
           f"({stats.tokenizer_vocab:,} pieces) on {stats.sample_documents:,} sample documents")
    claim("tokens per character", "1.4 (CPM tokenizer) vs 1.7 (generic BPE)",
          f"{stats.tokens_per_character:.2f} {how}",
          "differs: a word-level CPM vocabulary gives fewer than 1 token per character"
          if stats.tokens_per_character < 1.2 else "similar")
    from planner.corpus_stats import epochs_warning

    warning = epochs_warning(stats, target)
    if warning:
        out["warnings"] = [warning]
    # Steps
    steps_article = ARTICLE_TARGET_TOKENS / (256 * 1024)
    claim("190k steps", "about 190k steps at 256 x 1024 tokens per step",
          f"{steps_article:,.0f} steps for 50B tokens; 64 x 1024 would need "
          f"{ARTICLE_TARGET_TOKENS / 65536:,.0f}", "holds")
    # The article's own configuration on P4s: time, energy, money
    p4 = _find_offer(spec, profiles, "p4")
    if p4 is not None:
        article = _one(spec, p4, ARTICLE_TARGET_TOKENS, seq_lens=[1024], precisions=["fp32"],
                       micro_batch_sizes=[16], accumulation_steps=[2], tensor_parallel=[1],
                       pipeline_parallel=[1], sharding=["stage1"], recompute=["none"],
                       sequence_parallel=[False], node_counts=[1], max_nodes=1,
                       global_batch_tokens_min=0, global_batch_tokens_max=0,
                       owned_hardware=True)
        if article:
            claim("7 days", "about 7 days on 8 cards",
                  f"{article['hours'] / 24:,.1f} days on 8 x P4 (fp32: P4 has no fast fp16, "
                  f"so the article's fp16 cannot have sped it up), MFU {article['mfu']:.0%}",
                  "does not hold" if article["hours"] > 24 * 9 else "holds")
            kwh = article["energy_kwh"]
            claim("100 kWh / 70 yuan", "about 100 kWh, under 70 yuan of electricity",
                  f"{kwh:,.0f} kWh for 8 P4s at TDP over that time (x PUE "
                  f"{p4.offer.pue:g}); 16 A100s for 7 days would draw "
                  f"{16 * 400 * 168 / 1000:,.0f} kWh", "does not hold" if kwh > 150 else "holds")
    claim("12,000 yuan", "about 12,000 yuan on cloud P4 instances",
          f"this plan: {plan.estimate.cost:,.0f} {cur} ({plan.estimate.source}); no quoted P4 "
          "cloud price exists in our price lists, so the P4 figure cannot be checked",
          "the planned hardware is far cheaper" if plan.estimate.cost < 6000 else "similar")
    return out


def render_explanation(result: dict) -> str:
    from tabulate import tabulate

    lines = [f"Why {result['plan']}:"]
    lines += [f"  - {n}" for n in result["notes"]]
    est = result["estimate"]
    lines.append(f"  estimate ({est['source']}): {est['cost']:,.0f} {result['currency']}, "
                 f"{est['hours']:,.1f} h, {est['tokens_per_second']:,.0f} tokens/s, "
                 f"{est['peak_memory_gb']:.1f} GB/device, MFU {est['mfu']:.1%}")
    if est.get("cost_p90"):
        lines.append(f"  80% interval (p10-p90): {est['cost_p10']:,.0f}-{est['cost_p90']:,.0f} "
                     f"{result['currency']}, {est['hours_p10']:,.1f}-{est['hours_p90']:,.1f} h, "
                     f"{est['tokens_per_second_p10']:,.0f}-{est['tokens_per_second_p90']:,.0f} "
                     "tokens/s")
    unc = result.get("uncertainty")
    if unc:
        lines.append(f"  uncertainty: {unc['dominant_term']} is {unc['dominant_share']:.0%} of "
                     f"the modelled step, so it dominates; interval from "
                     f"{unc['interval_basis']}")
    lines += [f"  {w}" for w in result.get("warnings", [])]
    lines.append("")
    lines.append("Reference-case claims vs the model (all modelled unless marked measured)")
    lines.append(tabulate(result["claims"], headers="keys", tablefmt="github"))
    return "\n".join(lines)
