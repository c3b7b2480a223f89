"""Rendering only: tables (tabulate) and JSON records from a Decision. No computation here
beyond picking rows and formatting; every number is labelled modelled or measured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tabulate import tabulate

from gptplan import precision as precision_table
from planner.corpus.corpus_stats import CorpusStatistics
from planner.reporting.costreport import hours_text
from planner.screen import coverage
from planner.screen.decide import ranked
from planner.screen.table import CandidateRow, CandidateTable


def fmt_tokens(x: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.0f}"


def _h(hours: float) -> str:
    """Hours in a sentence: '8.31', '1,760' (never '1.76e+03')."""
    return f"{hours:,.3g}" if hours < 1000 else f"{hours:,.0f}"


def money(x: float) -> str:
    """Amounts: thousands separators when large, 4 significant digits when small."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.4g}"


def layout(row: CandidateRow) -> str:
    """The layout of a candidate row in a few words (gptplan.layout.Layout.label)."""
    from gptplan.layout import Layout

    return Layout.from_row(row).label()


def recompute_words(row: CandidateRow) -> str:
    """The recompute choice: granularity, and k of L layers when partial (rc_layers per
    stage x pp of the model's layers)."""
    k = int(row.get("rc_layers", 0))
    if not k or row["recompute"] == "none":
        return row["recompute"]
    return f"{row['recompute']} on {k * int(row['pp'])} layers ({k} per stage)"


def describe(table: CandidateTable, i: int, currency: str) -> str:
    r = table.row(i)
    return (
        f"{r['offer_choice'].label} {'spot' if r['spot'] else 'on-demand'}, "
        f"{r['nodes']} node(s) x {r['gpus_per_node']}, {r['precision']}, seq {r['seq']}, "
        f"micro {r['micro']} x acc {r['acc']}, {layout(r)}, recompute {recompute_words(r)}: "
        f"{money(r['cost'])} {currency} (p10-p90 {money(r['cost_p10'])}-"
        f"{money(r['cost_p90'])}), {_h(r['hours'])} h (p10-p90 {_h(r['hours_p10'])}-"
        f"{_h(r['hours_p90'])}) (modelled)"
    )


def short_config(table: CandidateTable, i: int) -> str:
    """A configuration in a few words (no numbers)."""
    r = table.row(int(i))
    return (
        f"{r['offer_choice'].offer.instance}, {r['nodes']}x{r['gpus_per_node']}, "
        f"{precision_table.label(r['precision'])}, seq {r['seq']}, micro {r['micro']} x acc "
        f"{r['acc']}, {layout(r)}, recompute {recompute_words(r)}"
    )


# Columns that can differ between candidates the model cannot tell apart (same numbers).
_VARIANT_DIMS = (
    ("precision", "precision"),
    ("sharding", "sharding stage"),
    ("recompute", "recompute"),
    ("sp", "sequence parallel"),
    ("dp", "dp"),
)


def collapse(table: CandidateTable, rows, keep=()) -> list[tuple[int, list[int]]]:
    """Group rows of one offer, node count and batch shape whose modelled cost and time agree
    to the 3 significant digits shown: they differ only where the model sees no difference
    that matters (fp16 vs bf16 at equal peaks; ZeRO stage 1 vs 2 when memory is not binding).
    Returns (representative, folded rows) in the order of `rows`; a row in `keep` (the chosen
    one, probed ones) is never folded into another."""
    keep = {int(k) for k in keep}
    groups: dict[tuple, tuple[int, list[int]]] = {}
    order = []
    for i in rows:
        i = int(i)
        sig = (
            int(table["offer"][i]),
            bool(table["spot"][i]),
            int(table["nodes"][i]),
            int(table["seq"][i]),
            int(table["micro"][i]),
            int(table["acc"][i]),
            int(table["tp"][i]),
            int(table["pp"][i]),
            float(f"{table['cost'][i]:.3g}"),
            float(f"{table['hours'][i]:.3g}"),
        )
        if sig in groups and i not in keep:
            groups[sig][1].append(i)
            continue
        entry: tuple[int, list[int]] = (i, [])
        order.append(entry)
        groups.setdefault(sig, entry)
    return order


def variant_note(table: CandidateTable, rep: int, others: list[int]) -> str:
    """Which dimensions the collapsed rows differ in, e.g. 'sharding stage stage1/stage2'."""
    if not others:
        return ""
    rows: list[Mapping[str, object]] = [table.row(int(i)) for i in [rep, *others]]
    parts = []
    for key, name in _VARIANT_DIMS:
        values = list(dict.fromkeys(str(r[key]) for r in rows))
        if len(values) > 1:
            parts.append(f"{name} {'/'.join(values)}")
    return f"+{len(others)} ({', '.join(parts) or 'identical'})"


def candidate_record(
    table: CandidateTable,
    i: int,
    currency: str,
    *,
    chosen: int | None,
    measured=None,
    calibrated_cost: float | None = None,
    variants: Sequence[int] = (),
) -> dict:
    """One candidate as raw numbers under snake_case keys that carry their unit; modelled,
    calibrated and measured numbers under separate keys. Formatting is the renderer's."""
    r = table.row(int(i))
    cur = currency.lower()
    kind = r["offer_choice"].offer.kind
    out = {
        "chosen": int(i) == chosen,
        "offer": r["offer_choice"].label,
        "capacity": "spot" if r["spot"] else ("owned" if kind == "on_prem" else "on_demand"),
        "nodes": r["nodes"],
        "devices_per_node": r["gpus_per_node"],
        "precision": r["precision"],
        "seq_len": r["seq"],
        "micro_batch_size": r["micro"],
        "gradient_accumulation_steps": r["acc"],
        "data_parallel_degree": r["dp"],
        "tensor_parallel_degree": r["tp"],
        "pipeline_parallel_degree": r["pp"],
        "sharding": r["sharding"],
        "sharding_degree": r["shard_degree"],
        "sequence_parallel": bool(r["sp"]),
        "recompute": r["recompute"],
        "modelled_memory_gb_per_device": r["memory_gb"],
        "modelled_step_time_s": r["step_time_s"],
        "modelled_tokens_per_second": r["tokens_per_s"],
        "modelled_mfu": r["mfu"],
        "modelled_hours": r["hours"],
        f"modelled_cost_{cur}": r["cost"],
        f"modelled_{cur}_per_million_tokens": r["cost_per_million_tokens"],
        # the 80% interval of the modelled numbers (calibration residuals, planner.screen.costmodel)
        "modelled_tokens_per_second_p10": r["tokens_per_s_p10"],
        "modelled_tokens_per_second_p90": r["tokens_per_s_p90"],
        "modelled_hours_p10": r["hours_p10"],
        "modelled_hours_p90": r["hours_p90"],
        f"modelled_cost_{cur}_p10": r["cost_p10"],
        f"modelled_cost_{cur}_p90": r["cost_p90"],
        "interval_basis": coverage.basis_words(
            r["offer_choice"].profile.efficiency_for(r["precision"]),
            r.get("interval_outside_runs", []),
        ),
        "interval_outside_published_runs": list(r.get("interval_outside_runs", [])),
        "may_fit": bool(r.get("may_fit", False)),
        "recompute_layers": int(r.get("rc_layers", 0)) * int(r["pp"]),
        "throughput_p90_capped_at_mfu": (
            getattr(coverage.mfu_cap(r["offer_choice"].profile), "mfu", None)
            if r.get("throughput_capped")
            else None
        ),
    }
    from planner.screen.memory import deciding_term, memory_share

    share, lo, hi = memory_share(r, r["offer_choice"].profile)
    out |= {
        "modelled_memory_share_of_card": share,
        "modelled_memory_share_of_card_low": lo,
        "modelled_memory_share_of_card_high": hi,
        "memory_band_widest_term": deciding_term(r),
    }
    from planner.reporting.costreport import price_record

    out |= price_record(table, int(i), currency)
    if calibrated_cost is not None:
        out[f"calibrated_cost_{cur}"] = calibrated_cost
    if measured is not None:
        out["measured_status"] = measured.status
        if measured.ok:
            from planner.tuning.autotune import measured_cost

            cost, hours = measured_cost(table, int(i), measured, "mean")
            out |= {
                "measured_step_time_s": measured.mean_step_time_s or measured.step_time_s,
                "measured_median_step_time_s": measured.step_time_s,
                "measured_steps": measured.measured_steps,
                "measured_peak_memory_gb": measured.peak_memory_gb,
                "measured_hours": hours,
                f"measured_cost_{cur}": cost,
            }
    if variants:
        out["identical_under_the_model"] = [
            {
                k: v
                for k, v in candidate_record(table, j, currency, chosen=chosen).items()
                if k in ("precision", "sharding", "recompute", "sequence_parallel", "capacity")
            }
            for j in variants
        ]
    return out


def candidate_records(table: CandidateTable, rows, currency: str, chosen: int | None) -> list:
    return [candidate_record(table, int(i), currency, chosen=chosen) for i in rows]


def result_rows(result, top: int) -> tuple[list[tuple[int, list[int]]], int]:
    """The final table's rows: feasible and probed candidates ranked by their best estimate
    (measured > calibrated > modelled), near-identical rows collapsed; and how many were
    folded."""
    table = result.table
    decision = result.decision
    rows = set(int(i) for i in ranked(table, decision.feasible)[: max(top * 8, 200)])
    if not rows:
        rows = set(int(i) for i in ranked(table, table["fits"])[:top])
    probed = set(result.tuning.outcome.probed) if result.tuning else set()
    rows |= probed
    if result.chosen is not None:
        rows.add(int(result.chosen))
    order = sorted(rows, key=lambda i: (result.estimate(i)[0], i))
    groups = collapse(
        table, order, keep=probed | ({int(result.chosen)} if result.chosen is not None else set())
    )
    shown = groups[:top]
    if result.chosen is not None and all(rep != result.chosen for rep, _ in shown):
        shown.append(next(g for g in groups if g[0] == result.chosen))
    return shown, sum(len(o) for _, o in shown)


def render_probed(result, top: int) -> str:
    """`planner optimize --probes N` without --wide: the candidates ranked by their best
    estimate in <= 120 columns (the configuration in one cell, the modelled, calibrated and
    measured cost side by side); --wide and --json keep every column."""
    table, cur = result.table, result.currency
    shown, folded = result_rows(result, top)
    body = []
    for rep, _ in shown:
        r = table.row(rep)
        m = result.measured(rep)
        cal = result.calibrated_cost(rep)
        ok = m is not None and m.ok
        body.append(
            [
                "*" if rep == result.chosen else "",
                f"{r['nodes']}x{r['gpus_per_node']} {r['precision']} s{r['seq']} "
                f"m{r['micro']}x{r['acc']} {layout(r)} {recompute_words(r)}",
                f"{r['memory_gb']:.1f}",
                money(r["cost"]),
                money(cal) if cal is not None else "-",
                f"{(m.mean_step_time_s or m.step_time_s) * 1000:,.0f}" if ok else "-",
                f"{m.measured_steps}" if ok else (m.status if m is not None else "-"),
                money(result.estimate(rep)[0]) if ok else "-",
            ]
        )
    head = [
        "",
        "configuration",
        "mem GB",
        f"{cur} model",
        f"{cur} calib.",
        "step ms",
        "steps",
        f"{cur} measured",
    ]
    n_feasible = int(result.decision.feasible.sum())
    title = (
        f"Top {len(body)} candidates by best estimate: measured (mean step of the probes) "
        f"where probed, else the model calibrated on the probes; configuration = nodes x "
        f"devices, precision, seq, micro x accumulation, layout, recompute; * = chosen; "
        f"{n_feasible:,} feasible of {len(table):,} evaluated"
        + (f"; {folded} identical under the model folded" if folded else "")
        + "; --wide or --json for every column"
    )
    from planner.reporting.costreport import fit_lines

    return (
        fit_lines(title)
        + "\n"
        + tabulate(body, headers=head, tablefmt="simple", disable_numparse=True)
    )


def render_candidates(result, top: int) -> str:
    """One table: modelled columns, and after probing the calibrated and measured ones."""
    table, cur = result.table, result.currency
    shown, folded = result_rows(result, top)
    tuned = result.tuning is not None
    body = []
    for rep, others in shown:
        r = table.row(rep)
        line = [
            "*" if rep == result.chosen else "",
            r["offer_choice"].label,
            "spot"
            if r["spot"]
            else ("owned" if r["offer_choice"].offer.kind == "on_prem" else "on-demand"),
            f"{r['nodes']}x{r['gpus_per_node']}",
            r["precision"],
            r["seq"],
            f"{r['micro']}x{r['acc']}",
            layout(r),
            r["recompute"],
            f"{r['memory_gb']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.1%}",
            hours_text(r["hours"]),
            f"{hours_text(r['hours_p10'])}-{hours_text(r['hours_p90'])}",
            money(r["cost"]),
            f"{money(r['cost_p10'])}-{money(r['cost_p90'])}",
        ]
        if tuned:
            m = result.measured(rep)
            cal = result.calibrated_cost(rep)
            line += [money(cal) if cal is not None else "-"]
            if m is not None and m.ok:
                cost = result.estimate(rep)[0]
                line += [
                    f"{(m.mean_step_time_s or m.step_time_s) * 1000:,.0f}",
                    f"{m.measured_steps}",
                    money(cost),
                ]
            else:
                line += [m.status if m is not None else "-", "-", "-"]
        line.append(variant_note(table, rep, others))
        body.append(line)
    head = [
        "",
        "offer",
        "mode",
        "nodes x dev",
        "prec",
        "seq",
        "micro x acc",
        "layout",
        "recompute",
        "mem GB",
        "tokens/s",
        "MFU",
        "hours",
        "hours p10-p90",
        f"cost {cur}",
        f"cost p10-p90 {cur}",
    ]
    if tuned:
        head += [
            f"cost {cur} calibrated",
            "step ms measured (mean)",
            "steps",
            f"cost {cur} measured",
        ]
    head.append("folded rows (same cost and time)")
    n_feasible = int(result.decision.feasible.sum())
    if tuned:
        title = (
            f"Top {len(body)} candidates by best estimate (measured where probed, else "
            f"the model calibrated on the probes; columns before 'calibrated' are the "
            f"shipped model's; * = chosen; {n_feasible:,} feasible of "
            f"{len(table):,} evaluated)"
        )
    else:
        title = (
            f"Top {len(body)} candidates by cost (all numbers modelled, p10-p90 = 80% "
            f"interval from the calibration residuals; * = chosen; {n_feasible:,} "
            f"feasible of {len(table):,} evaluated)"
        )
    if folded:
        title += (
            f"\n{folded} more candidate(s) folded into the rows above: they differ only "
            "where the model's cost and time agree to the digits shown ('folded rows')"
        )
    return title + "\n" + tabulate(body, headers=head, tablefmt="github", disable_numparse=True)


def render_compute_only(stats: CorpusStatistics, target: float) -> str:
    """The corpus lines of a compute-only spec: what was declared, nothing measured."""
    line = (
        f"compute-only planning: no corpus named (job.corpus), so none is read and no "
        f"tokenizer trained; target {fmt_tokens(target)} tokens (declared)"
    )
    if stats.total_tokens:
        bpc = f"{stats.bytes_per_character:g} bytes per character (job.bytes_per_char)"
        line += (
            f"; corpus {fmt_tokens(stats.total_tokens)} tokens (declared: "
            f"{stats.declared_bytes:,.0f} bytes / {bpc} x {stats.tokens_per_character:g} "
            f"tokens per character) = {stats.epochs_for(target):.2f} epochs"
        )
    return line + "; name the corpus in job.corpus before `runner execute`"


def render_stats(stats: CorpusStatistics, target: float) -> str:
    if stats.compute_only:
        return render_compute_only(stats, target)
    lines = [
        f"corpus: {stats.local_documents:,} documents, {stats.local_characters:,} characters "
        f"in {stats.local_files} local file(s) (measured; skipped {stats.invalid_utf8_lines} "
        f"invalid UTF-8 lines, {stats.empty_lines} empty, {stats.duplicate_documents} "
        "duplicates)",
        f"tokens per character: {stats.tokens_per_character:.3f} "
        + (
            f"(measured on {stats.sample_documents:,} documents with {stats.tokenizer}, "
            f"{stats.tokenizer_vocab:,} pieces)"
            if stats.tokens_per_character_source == "measured"
            else f"(extrapolated, 80% range {stats.tokens_per_character_p10:.3f}-"
            f"{stats.tokens_per_character_p90:.3f}; the sample trains "
            f"{stats.tokenizer_vocab:,} of the {stats.tokenizer_target_vocab:,} planned "
            f"pieces ({stats.tokenizer}); {stats.vocab_fit.get('description', '')})"
            if stats.tokens_per_character_source == "extrapolated"
            else "(declared in the spec)"
        ),
    ]
    how = {
        "measured": "measured: every local document tokenized",
        "declared": "declared tokens/char x characters",
    }.get(
        stats.total_tokens_source,
        "extrapolated: sample tokens/char x "
        + ("characters of the declared size" if stats.extrapolated else "characters"),
    )
    spread = ""
    if stats.tokens_per_character_source == "extrapolated" and stats.tokens_per_character:
        r_lo = stats.tokens_per_character_p10 / stats.tokens_per_character
        r_hi = stats.tokens_per_character_p90 / stats.tokens_per_character
        spread = (
            f" (80% range {fmt_tokens(stats.total_tokens * r_lo)}-"
            f"{fmt_tokens(stats.total_tokens * r_hi)}, "
            f"{stats.epochs_for(target) / r_hi:.2f}-{stats.epochs_for(target) / r_lo:.2f} "
            "epochs, from the tokens/char fit)"
        )
    lines.append(
        f"corpus tokens: {fmt_tokens(stats.total_tokens)} ({how}); target "
        f"{fmt_tokens(target)} tokens = {stats.epochs_for(target):.2f} epochs{spread}"
    )
    waste = ", ".join(f"seq {k}: {v:.0%}" for k, v in stats.padding_waste.items())
    lines.append(
        f"padding a non-packed pipeline would waste: {waste} (measured on the "
        "sample; the plan packs, wasting none)"
    )
    return "\n".join(lines)


def render_calibration(tuning) -> str:
    """One line: the efficiency fitted to this machine's probes and where it was written."""

    cal = tuning.calibration
    text = (
        f"calibrated {cal.profile}: "
        + ", ".join(
            f"{p} max {e.max:.3f} half_tokens {e.half_tokens:,.0f} rolloff_tokens "
            f"{e.rolloff_tokens:,.0f}"
            for p, e in cal.by_precision.items()
        )
        + f"; step-time fit error median {cal.fit_error:.1%}, worst {cal.worst_error:.1%} "
        f"on {cal.points} probes"
    )
    if tuning.calibration_path is not None:
        text += f"; written to {tuning.calibration_path} (the user data directory)"
    return text


def model_facts(result) -> dict:
    """The model the result is for: family, exact parameter count and model FLOPs per token
    (6N + 12·L·h·s, gptplan.modelfacts) at the chosen seq_len (else the longest allowed)."""
    from gptplan.modelfacts import parameter_count, training_flops_per_token

    # the plan's model (its vocabulary padded for the chosen tp), else the spec's
    model = result.plan.model if result.plan is not None else result.spec.model_section()
    seq = (
        result.plan.training.seq_len
        if result.plan is not None
        else max(result.spec.constraints.seq_lens)
    )
    return {
        "model_name": model.name,
        "model_family": model.family,
        "model_parameters": parameter_count(model),
        "model_flops_per_token": training_flops_per_token(model, seq),
        "model_flops_per_token_seq_len": seq,
    }


def render_model(result) -> str:
    f = model_facts(result)
    return (
        f"model: {f['model_name']} ({f['model_family']}), {f['model_parameters']:,} "
        f"parameters, {f['model_flops_per_token'] / 1e9:.4g} GFLOPs per trained token at "
        f"seq_len {f['model_flops_per_token_seq_len']} (exact count and model FLOPs, "
        "no recompute)"
    )


def render_choice(result) -> str:
    """The one "chosen" line: read back from the plan that is written, so they cannot differ."""
    decision = result.decision
    if result.chosen is None or result.plan is None:
        return "NO PLAN: " + "; ".join(decision.problems)
    est = result.plan.estimate
    cur = result.currency
    source = "measured by probes" if est.source == "probe" else "modelled"
    from planner.screen.risk import row_risk

    risk = row_risk(result.spec, result.table, int(result.chosen))
    chosen_offer = result.table.offers[int(result.table["offer"][int(result.chosen)])]
    energy_basis = chosen_offer.offer.energy_basis(chosen_offer.profile.tdp_w)
    c = result.spec.constraints
    bet = risk.bet_line(budget=c.budget, currency=cur)
    lines = [
        f"chosen: {short_config(result.table, result.chosen)}: {money(est.cost)} {cur}, "
        f"{est.hours:,.3g} h ({source})",
        "        risk: "
        + risk.headline(budget=c.budget, deadline_hours=c.deadline_hours, currency=cur),
        *([f"        {bet}"] if bet else []),
        f"        {est.tokens_per_second:,.0f} tokens/s, {est.peak_memory_gb:.2f} "
        f"GB/device, MFU {est.mfu:.1%}, {est.cost_per_million_tokens:.4g} {cur}/Mtok "
        f"({source}), {est.energy_kwh:,.3g} kWh (modelled; {energy_basis})",
    ]
    lines.append(memory_line(result))
    lines += [x for x in [efa_line(result)] if x]
    from planner.reporting.costreport import budget_line, price_lines, sensitivity, sensitivity_line

    lines += price_lines(result)
    if est.cost_p90 > 0:
        basis = est.interval.split(": ", 1)[-1].split(" (hardware_profiles")[0]
        if "; p90 capped at " in est.interval:
            basis += "; p90 " + est.interval.split("; p90 ", 1)[1].split("; hours and cost")[0]
        lines.append(
            f"        80% interval (p10-p90; throughput, price and preemptions; "
            f"throughput from {basis}): "
            f"{est.tokens_per_second_p10:,.0f}-{est.tokens_per_second_p90:,.0f} "
            f"tokens/s, {est.hours_p10:,.3g}-{est.hours_p90:,.3g} h, "
            f"{money(est.cost_p10)}-{money(est.cost_p90)} {cur}"
        )
    if est.step_time_interval_s:
        lo, hi = est.step_time_interval_s
        lines.append(
            f"        step time {est.step_time_s * 1000:,.0f} ms, 95% interval of "
            f"the mean {lo * 1000:,.0f}-{hi * 1000:,.0f} ms, single steps spread "
            f"{est.step_time_spread:.0%} (10-90%) (measured)"
        )
    race = result.tuning.outcome.race if result.tuning else None
    if race is not None and result.chosen_source == "probe":
        steps = result.tuning.outcome.probed[result.chosen].measured_steps
        note = race_note(result.table, race, cur, (est.cost_per_million_tokens, steps))
        lines.append("        " + note)
    if result.chosen_source == "model":
        lines.append(
            sensitivity_line(
                sensitivity(
                    result.table,
                    result.chosen,
                    result.spec.job.target_tokens > 0,
                    result.stats,
                ),
                cur,
            )
        )
        lines += [x for x in [budget_line(decision, result.spec)] if x]
        lines.append(f"        binding constraint: {decision.binding}")
    else:
        lines.append(f"        the model alone chose {short_config(result.table, decision.chosen)}")
    return "\n".join(lines)


def efa_line(result) -> str:
    """A multi-node AWS plan costed on EFA needs a launcher that attaches EFA (planner.market
    .offers.launchable): said on the chosen plan, with the way to cost it on what 0.9.2 gives."""
    from planner.market.skyfacts import efa_requirement

    table, i = result.table, int(result.chosen)
    offer = table.offers[int(table["offer"][i])].offer
    if not (
        offer.provider == "aws"
        and "EFA" in offer.network_source
        and int(table["nodes"][i]) > 1
        and offer.inter_node_gbits_per_s > 0
    ):
        return ""
    return (
        f"        launch: costed on EFA ({offer.inter_node_gbits_per_s:g} Gbit/s) between its "
        f"{int(table['nodes'][i])} nodes (constraints.launcher_attaches_efa = true): the launch "
        f"{efa_requirement(offer.instance)}"
    )


def memory_line(result) -> str:
    """Memory per device as a share of the card, with its interval and the feasibility verdict
    (planner.screen.decide.choose_fitting): a "may fit" choice names the surely-fitting alternative
    and its cost."""
    from gptplan.memory import MAY_FIT_SAVING
    from planner.screen.memory import deciding_term, memory_share

    table, i, cur = result.table, int(result.chosen), result.currency
    prof = table.offers[int(table["offer"][i])].profile
    row = {k: table[k][i] for k in ("memory_gb", "memory_low_gb", "memory_high_gb")}
    row["memory_decider"] = table["memory_decider"][i]
    share, lo, hi = memory_share(row, prof)
    head = (
        f"        memory {share:.0%} of the {prof.memory_gb:g} GiB card per device (modelled; "
        f"band {lo:.0%}-{hi:.0%} from each term's worst credible error, widest: "
        f"{deciding_term(row)}; docs/memory.md)"
    )
    if not bool(table["may_fit"][i]):
        return head + ": fits"
    alt = result.decision.sure_alternative
    if alt is None or int(alt) == i:
        return head + ": MAY NOT FIT (no layout surely fits; probe it before a long run)"
    saving = 1.0 - float(table["cost"][i]) / float(table["cost"][alt])
    return (
        head + f": MAY NOT FIT, chosen because it saves {saving:.1%} (more than "
        f"{MAY_FIT_SAVING:.0%}) over the surely-fitting {short_config(table, int(alt))} at "
        f"{money(float(table['cost'][alt]))} {cur} (modelled); probe it before a long run"
    )


def render_memory(result) -> str:
    """`planner estimate --memory`: the chosen layout's modelled peak per device term by term,
    as GB and as a share of the card, and the single changes that free the most."""
    from planner.screen.memory import memory_breakdown

    table = result.table
    i = result.chosen if result.chosen is not None else result.decision.smallest_memory_row
    if i is None:
        return "memory: no layout to break down"
    row = table.row(int(i))
    prof = row["offer_choice"].profile
    b = memory_breakdown(result.spec.model_section(), prof, row, int(row["gpus_per_node"]))
    card = prof.memory_gb * 2**30 / 1e9
    lines = [
        f"memory per device of {short_config(table, int(i))} (modelled, GB; the card holds "
        f"{card:.1f} GB = {prof.memory_gb:g} GiB):"
    ]
    for name, gb in b["terms"].items():
        lines.append(f"  {name:<12} {gb:9.2f} GB  {gb / card:6.1%} of the card")
    lines.append(
        f"  {'total':<12} {b['total_gb']:9.2f} GB  {b['total_gb'] / card:6.1%} of the card"
    )
    lines.append(
        "  terms: gptplan.memory.memory_terms (each cites the PaddleNLP 2.8.1 / Paddle code or "
        "paper it follows)"
    )
    if b["changes"]:
        lines.append("frees the most (one change at a time, modelled):")
        lines += [f"  {words}: -{gb:.2f} GB" for words, gb in b["changes"][:4]]
    return "\n".join(lines)


def race_note(table, race, currency: str = "", measured: tuple | None = None) -> str:
    """One sentence on the pick against the runner-up (planner.tuning.autotune's noise-aware race):
    its cost per million tokens, its lead with an interval, and how sure that is.

    `measured` = (cost per million tokens, probe steps): the pick's cost as the plan and its
    "chosen" line state it (the mean of its probes' steps), so both say one number; without
    it the race's pooled estimate (every probe and the model's prior), labelled as such."""
    pick, other = race.finalists[0], race.finalists[1]
    lo, hi = race.interval
    half = (hi - lo) / 2
    verdict = "separated from" if race.separated else "NOT separated from"
    unit = f"{currency}/Mtok".lstrip("/") if currency else "/Mtok"
    if measured is not None:
        cost = (
            f"best at {measured[0]:.4g} {unit} (measured: mean of its {measured[1]} probe steps), "
        )
    elif race.cost_per_mtok:
        cost = f"best at {race.cost_per_mtok:.4g} {unit} (pooled estimate of its probes), "
    else:
        cost = ""
    return (
        f"{cost}{short_config(table, pick)} ahead of the runner-up "
        f"{short_config(table, other)} by {race.difference:.0%} +- {half:.0%} "
        f"({race.level:.0%} interval {lo:+.1%} .. {hi:+.1%}; cheaper with probability "
        f"{race.probability:.2f}, {verdict} it at {(1 + race.level) / 2:.0%}; the lead from "
        f"every probe pooled with the model's prior (planner.tuning.noise); "
        f"{race.rounds} repeat probe(s) of finalists)"
    )
