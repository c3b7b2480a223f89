"""The hardware profiles and their offers as `planner profiles` lists them: one row per offer
(an instance priced in several regions: its cheapest on-demand region), price per GPU-hour
first as `sky show-gpus` shows it; wide rows add the specs, prices per node-hour, regions and
sources."""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from planner.market.hardware import Offer, Profile
from planner.market.offers import region_choices
from planner.market.pricebook import price_age_days
from planner.reporting.costreport import money


def profile_rows(profiles: dict[str, Profile], wide: bool = False) -> list[dict[str, object]]:
    """One row per offer of every profile (a profile without offers: one row saying so)."""
    rows: list[dict[str, object]] = []
    for prof in profiles.values():
        name = prof.name + ("" if prof.verified else " *")
        peaks = "/".join(
            f"{prof.peak_tflops.get(p, 0):g}" for p in ("fp32", "tf32", "fp16", "bf16")
        )
        groups: dict[str, list] = {}
        for offer in prof.offers:
            groups.setdefault(offer.key, []).append(offer)
        if not groups:
            rows.append({"profile": name, "GB": f"{prof.memory_gb:g}", "offer": "(no price)"})
        for offers in groups.values():
            rows.append(offer_row(prof, name, peaks, offers, wide))
    return rows


def offer_row(prof: Profile, name: str, peaks: str, offers: list[Offer], wide: bool) -> dict:
    """The row of one offer (its price rows in every region)."""
    choices = region_choices(offers)
    offer, _, where = choices[0]  # on-demand from its cheapest region ...
    spot_offer = next(o for o, only, _ in choices if only in ("", "spot"))  # ... spot too
    where = "; ".join(w for _, _, w in choices if w)
    gpus = offer.gpus_per_node
    age = price_age_days(offer.as_of)
    if offer.kind == "on_prem":
        od = offer.node_price_per_hour(spot=False, tdp_w=prof.tdp_w) / gpus
        spot = ""
    else:
        od = offer.on_demand_per_hour / gpus
        spot = money(spot_offer.spot_per_hour / gpus) if spot_offer.spot_per_hour else "-"
        if spot_offer.price_flag:
            spot += " (placeholder)"
    row = {
        "profile": name,
        "GB": f"{prof.memory_gb:g}",
        "bf16 TF": f"{prof.peak_tflops['bf16']:g}" if "bf16" in prof.peak_tflops else "-",
        "offer": offer.key,
        "GPUs": gpus,
        "Gbit/s": f"{offer.inter_node_gbits_per_s:g}" if offer.inter_node_gbits_per_s else "1 node",
        "/GPU-h": (money(od) if od > 0 else "spot only")
        + (" (power)" if offer.kind == "on_prem" else ""),
        "spot/GPU-h": spot,
        "cur": offer.currency,
        "age": f"{age} d" if age is not None else "undated",
    }
    if wide:
        row |= {
            "device": prof.device,
            "TFLOPS fp32/tf32/fp16/bf16": peaks,
            "TDP W": f"{prof.tdp_w:g}",
            "eff. max": f"{prof.efficiency.max:g}",
            "per node-hour": f"{offer.on_demand_per_hour:g} / {offer.spot_per_hour:g} spot"
            if offer.kind != "on_prem"
            else "",
            "as of": offer.as_of or "undated",
            "region": where or offer.region or "",
            "regions priced": len(offers),
            "network": offer.network_source,
            "price source": offer.source,
        }
    return row


def render_profiles(rows: list[dict[str, object]], wide: bool = False) -> str:
    """The rows as a table (a grid when wide), and what its columns mean."""
    import tabulate as tabulate_module

    padding, tabulate_module.MIN_PADDING = tabulate_module.MIN_PADDING, 0  # headers not padded
    try:
        table = tabulate(
            rows,
            headers="keys",
            tablefmt="grid" if wide else "simple",
            # a long profile name (local-rehearsal-device) wraps at its hyphens, so that the
            # narrow table stays within 120 columns
            maxcolwidths=40 if wide else [16] + [32] * (len({k for r in rows for k in r}) - 1),
            disable_numparse=True,
        )
    finally:
        tabulate_module.MIN_PADDING = padding
    legend = textwrap.fill(
        "Prices per GPU-hour (on-demand, spot) of each offer's cheapest region; Gbit/s = "
        "inter-node bandwidth (1 node = not stated: planned single-node); * = unverified "
        "profile (a lead, not a fact). --wide: specs, regions and sources; 'planner "
        "prices history INSTANCE': every price row.",
        width=120,
    )
    return f"{table}\n{legend}"
