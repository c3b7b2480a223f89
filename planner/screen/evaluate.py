"""Evaluate the candidate space with the cost model, vectorised: per layout the step time
(gptplan.steptime), memory (gptplan.memory) and throughput, priced per capacity
(planner.screen.pricing), joined into one `CandidateTable` over every allowed offer."""

from __future__ import annotations

import functools

import numpy as np

from gptplan import families
from gptplan import precision as precision_table
from gptplan.memory import (
    GIB,
    MEMORY_RATIO_P90,
    device_memory_args,
    layout_memory_bytes,
    memory_band,
    memory_fit,
)
from gptplan.plan import (
    RECOMPUTE_MODES,
    tensor_parallel_divides,
)
from gptplan.steptime import Device, Rates, step_time_parts
from gptplan.tokenizer import padded_vocab
from planner.market.hardware import Offer, Profile
from planner.market.offers import OfferChoice
from planner.screen import costmodel as cm
from planner.screen.pricing import price_rows
from planner.screen.space import layout_grid, with_accumulations, with_sharding_degrees, with_vocab
from planner.screen.table import DIAGNOSTIC_COLUMNS, CandidateTable, Columns
from planner.spec import Spec


def evaluate_offer(
    spec: Spec, choice: OfferChoice, index: int, target: float
) -> dict[str, np.ndarray]:
    """All valid candidates on one offer, evaluated. Cheap integer rules filter first."""
    return _joined(_offer_parts(spec, choice, index, target))


def _joined(parts: list[dict]) -> dict[str, np.ndarray]:
    if not parts:
        return {}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _offer_parts(spec: Spec, choice: OfferChoice, index: int, target: float) -> list[dict]:
    """evaluate_offer's rows as parts (on-demand, spot) that share the columns they have in
    common: evaluate_space joins each column once, into the whole table."""
    from gptplan.plan import tensor_parallel_fits_node

    m = spec.model_section()
    prof, offer = choice.profile, choice.offer
    c, s = spec.constraints, spec.search
    gpn = offer.gpus_per_node
    precisions = [precision_table.code(p) for p in c.precisions if p in prof.precisions]
    tps = [1] if prof.plain_cpu else s.tensor_parallel
    # each tensor-parallel degree with the vocabulary it needs (padded_vocab: unchanged where
    # tp divides it), so every row is priced with the model its plan would write
    by_vocab: dict[int, list[int]] = {}
    for t in tps:
        if tensor_parallel_fits_node(t, gpn):
            by_vocab.setdefault(padded_vocab(m.vocab_size, t), []).append(t)
    out = []
    for vocab, group in by_vocab.items():
        padded = spec if vocab == m.vocab_size else with_vocab(spec, vocab)
        pm = padded.model_section()
        group = [t for t in group if tensor_parallel_divides(pm, t)]
        if group:
            out += _offer_layout_parts(padded, choice, index, target, precisions, group)
    return out


def _offer_layout_parts(
    spec: Spec, choice: OfferChoice, index: int, target: float, precisions, tps
) -> list[dict]:
    prof, offer = choice.profile, choice.offer
    s = spec.search
    gpn = offer.gpus_per_node
    g = layout_grid(spec, prof, offer, precisions, tps)
    if g is None:
        return []
    g, batch_ranks = with_accumulations(spec, gpn, g)
    if not len(batch_ranks):
        return []
    g, batch_ranks = with_sharding_degrees(s, gpn, g, batch_ranks)
    if not len(batch_ranks):
        return []
    return _evaluated_parts(spec, choice, index, target, g)


def _evaluated_parts(
    spec: Spec, choice: OfferChoice, index: int, target: float, g: dict
) -> list[dict]:
    """The layouts `g` of one offer with flash attention and partial recompute, evaluated and
    priced (on-demand and spot parts)."""
    m = spec.model_section()
    prof, offer = choice.profile, choice.offer
    c, s = spec.constraints, spec.search
    batch_ranks = g["dp"] * g["shard_degree"]
    g["flash"] = np.full(len(batch_ranks), 0)
    if s.flash_attention and prof.flash_attention and m.hidden_size // m.num_attention_heads <= 256:
        g["flash"] = precision_table.of_codes("flash_attention", g["precision_code"]).astype(int)
    g = partial_recompute_rows(m, prof, g, c.memory_headroom, s.recompute_layers)
    out = evaluate_layouts(m, prof, offer, g, memory_headroom=c.memory_headroom)
    out["offer"] = np.full(len(out["nodes"]), index)
    steps = np.ceil(target / out["tokens_per_step"])
    out["steps"] = steps
    out["train_hours"] = steps * out["step_time_s"] / 3600
    return price_rows(spec, choice, cm.ModelShape.from_section(m), out)


def partial_recompute_rows(m, prof: Profile, g: dict, headroom: float, pinned) -> dict:
    """Partial recompute as a search dimension (column rc_layers: layers recomputed per
    pipeline stage, 0 = all). Only for a family with per-layer recompute (gptplan.families:
    FamilySpec.partial_recompute_why_not says why not), and not at the granularities its
    pipeline class refuses (Llama: 'full', LlamaForCausalLMPipe asserts no_recompute_layers is
    empty). `pinned` (search.recompute_layers, per stage): exactly those values. Otherwise
    every row that recomputes also gets, as an added row, the fewest layers per stage k at
    which it surely fits (memory is linear in k: closed form, vectorised), when 0 < k <
    ceil(L/p): it runs faster than recomputing every layer, at the same memory rule."""
    n = len(g["tp"])
    g["rc_layers"] = np.zeros(n, dtype=int)
    code, pp = g["recompute_code"], g["pp"]
    family = families.get(m.family)
    refused = [RECOMPUTE_MODES.index(r) for r in family.partial_recompute_pipeline_refuses]
    ok = (code > 0) & ~((pp > 1) & np.isin(code, refused))
    ok &= not family.partial_recompute_why_not
    stage_layers = np.ceil(m.num_hidden_layers / pp).astype(int)
    if pinned:
        parts = []
        for k in pinned:
            sel = np.flatnonzero((k == 0) | (ok & (k < stage_layers)))
            part = {key: v[sel] for key, v in g.items()}
            part["rc_layers"] = np.where(part["recompute_code"] > 0, k, 0)
            parts.append(part)
        return {key: np.concatenate([p[key] for p in parts]) for key in g}
    idx = np.flatnonzero(ok)
    if not len(idx):
        return g
    shape = cm.ModelShape.from_section(m)
    sub = {key: v[idx] for key, v in g.items()}
    args = memory_args(prof)
    every = layout_memory_bytes(shape, sub, **args)
    plain = layout_memory_bytes(shape, {**sub, "recompute_code": np.zeros(len(idx), int)}, **args)
    S = stage_layers[idx]
    per_layer = (plain - every) / S  # bytes one more recomputed layer saves
    target = prof.memory_gb * GIB * headroom / MEMORY_RATIO_P90
    saves = per_layer > 0
    k = np.where(saves, np.ceil((plain - target) / np.where(saves, per_layer, 1.0)), 0.0)
    k = np.clip(k, 0, S).astype(int)
    add = saves & (k >= 1) & (k < S)
    extra = {key: v[idx[add]] for key, v in g.items()}
    extra["rc_layers"] = k[add]
    return {key: np.concatenate([g[key], extra[key]]) for key in g}


def evaluate_layouts(
    m,
    prof: Profile,
    offer: Offer,
    g: dict,
    *,
    efficiency=None,
    overlap=None,
    memory_headroom: float = 0.9,
) -> dict[str, np.ndarray]:
    """The cost model on explicit layouts (one row per entry of the columns in `g`: nodes,
    precision_code, seq, micro, acc, tp, pp, vpp, stage_code, shard_degree, dp,
    recompute_code, sp, flash). Returns per-row memory, step time and its parts, tokens/s and
    MFU. Step time is gptplan.steptime.step_time_parts, the one composition the fit and the
    runner use too. `efficiency` overrides the profile's fitted constants per precision;
    `overlap` the share of gradient sync hidden behind compute.

    Memory (gptplan.memory.memory_band / memory_fit): a row whose band's high end (each
    term at its worst credible error) is within the usable limit (memory_gb x
    memory_headroom) surely fits; past it but with its optimistic end within the card's
    physical memory it is kept as `may_fit` (chosen only past MAY_FIT_SAVING, `decide`);
    only where even the optimistic end exceeds the card is it cut.
    """
    shape = cm.ModelShape.from_section(m)
    gpn = offer.gpus_per_node
    g = {k: np.asarray(v) for k, v in g.items()}
    world = g["nodes"] * gpn
    batch_ranks = g["dp"] * g["shard_degree"]
    tokens_per_step = g["micro"] * g["acc"] * g["seq"] * batch_ranks
    eff = prof.efficiency  # framework constants (memory overhead, comm overlap)

    def by_precision(attr: str) -> np.ndarray:
        return precision_table.TABLE.column(
            lambda r: getattr(
                efficiency if efficiency is not None else prof.efficiency_for(r.name), attr
            )
        )[g["precision_code"]]

    g.setdefault("rc_layers", np.zeros(len(g["tp"]), dtype=int))
    fit = _memory_columns(shape, g, prof, memory_headroom)

    peak = precision_table.TABLE.column(lambda r: prof.peak_for(r.name))[g["precision_code"]] * 1e12
    dev = _device(prof, offer, peak)
    rates = Rates(
        by_precision("max"),
        by_precision("kernel_overhead_us") * 1e-6,
        eff.comm_overlap if overlap is None else overlap,
        by_precision("attention_relative"),
        by_precision("half_tokens"),
        by_precision("half_hidden"),
        by_precision("rolloff_tokens"),
    )
    parts = step_time_parts(shape, g, dev, rates)
    speed = _speed(m, prof, g["seq"], parts["step_time_s"], tokens_per_step, world, peak)
    return _layout_columns(m, g, gpn, tokens_per_step, fit, parts, speed)


def _memory_columns(shape, g: dict, prof: Profile, memory_headroom: float) -> dict:
    """Modelled memory per row (GB) with its band (gptplan.memory.memory_band), the widest
    term and the verdict (memory_fit); `memory_point_fits`: the point itself within the
    usable memory (a "may fit" row past it is never chosen while another fits)."""
    terms = layout_memory_bytes(shape, g, terms=True, **memory_args(prof))
    low, mem, high, decider = memory_band(terms)
    usable = prof.memory_gb * GIB * memory_headroom
    sure, may_fit = memory_fit(low, high, prof.memory_gb * GIB, memory_headroom)
    return {
        "memory_gb": mem / cm.GB,
        "fits": sure | may_fit,
        "may_fit": may_fit,
        "memory_low_gb": low / cm.GB,
        "memory_high_gb": high / cm.GB,
        "memory_decider": decider,
        "memory_point_fits": mem <= usable,
    }


def _speed(m, prof: Profile, seq, step_time, tokens_per_step, world, peak) -> dict:
    """Step time, tokens/s and MFU per row: the model's median, never clamped (only the
    interval's top is held to planner.screen.coverage.mfu_cap, `CandidateTable.intervals`)."""
    f_model = cm.model_flops_per_token(m, seq)
    tokens_per_s = tokens_per_step / step_time
    mfu = f_model * tokens_per_s / (world * peak)
    return {"step_time_s": step_time, "tokens_per_s": tokens_per_s, "mfu": mfu}


def memory_args(prof: Profile) -> dict:
    """The profile's terms of gptplan.memory.layout_memory_bytes beyond the layout: the cited
    GPU-side terms on a GPU, the profile's measured ones elsewhere
    (gptplan.memory.device_memory_args)."""
    eff = prof.efficiency
    return device_memory_args(prof.device, eff.memory_overhead_gb, eff.fragmentation)


def _device(prof: Profile, offer: Offer, peak: np.ndarray) -> Device:
    """What the step-time composition needs of the offer's devices, at `peak` FLOP/s per row."""
    inter = offer.inter_node_gbits_per_s / 8 * 1e9 if offer.inter_node_gbits_per_s else 1.0
    return Device(
        peak,
        prof.sm_count,
        prof.memory_bandwidth_gbytes_per_s * 1e9,
        prof.intra_node_gbytes_per_s * 1e9,
        inter,
        offer.gpus_per_node,
    )


def _layout_columns(
    m, g: dict, gpn: int, tokens_per_step: np.ndarray, fit: dict, parts: dict, speed: dict
) -> dict[str, np.ndarray]:
    """evaluate_layouts' columns, in the table's order."""
    n = len(speed["step_time_s"])
    world = g["nodes"] * gpn
    layout = "nodes precision_code seq micro acc tp pp vpp dp shard_degree stage_code"
    out = {"nodes": g["nodes"], "gpus_per_node": np.full(n, gpn), "world": world}
    out |= {k: g[k] for k in layout.split()[1:] + ["recompute_code", "sp", "flash"]}
    out |= {"tokens_per_step": tokens_per_step, "memory_gb": fit["memory_gb"]}
    out |= {"rc_layers": g["rc_layers"], "fits": fit["fits"], "may_fit": fit["may_fit"]}
    keys = ("memory_low_gb", "memory_high_gb", "memory_decider", "memory_point_fits")
    out |= {k: fit[k] for k in keys}
    out |= {"efficiency": parts["efficiency"], "hidden_per_tp": m.hidden_size / g["tp"]}
    out["step_time_s"] = speed["step_time_s"]
    out |= {k: parts[k] for k in ("compute_s", "comm_s", "dp_sync_s", "tp_s", "pp_s", "opt_s")}
    out |= {"bubble": parts["bubble"], "tokens_per_s": speed["tokens_per_s"]}
    out["tokens_per_s_per_device"] = speed["tokens_per_s"] / world
    out["mfu"] = speed["mfu"]
    return out


def _cost_per_million_tokens(columns: Columns, target: float) -> np.ndarray:
    return columns["cost"] / target * 1e6


def evaluate_space(spec: Spec, offers: list[OfferChoice], target: float) -> CandidateTable:
    # every offer's parts (on-demand, spot), each column joined into the whole table when
    # first read (Columns): concatenating a million rows is memory-bound; diagnostics of
    # single evaluations (planner explain, the published-run fit) stay out of the big table
    tables = [
        {k: v for k, v in part.items() if k not in DIAGNOSTIC_COLUMNS}
        for i, choice in enumerate(offers)
        for part in _offer_parts(spec, choice, i, target)
    ]
    params = float(cm.ModelShape.from_section(spec.model_section()).params_total)
    family = spec.model_section().family
    if not tables:
        return CandidateTable(
            offers,
            {},
            spec.spot.startup_minutes / 60,
            params,
            spec.spot.restart_minutes / 60,
            family,
        )
    per_million = functools.partial(_cost_per_million_tokens, target=target)
    columns = Columns(tables, {"cost_per_million_tokens": per_million})
    return CandidateTable(
        offers,
        columns,
        spec.spot.startup_minutes / 60,
        params,
        spec.spot.restart_minutes / 60,
        family,
    )
