"""Price evaluated layouts: spot and on-demand rows with time (checkpoints, preemptions,
restarts), money and energy, each offer's node price asked of the offer
(`OfferChoice.node_price`)."""

from __future__ import annotations

import numpy as np

from gptplan import money
from gptplan import precision as precision_table
from gptplan.money import checkpoint_bytes
from planner.market import spotrisk
from planner.market.disks import candidate_disk
from planner.market.offers import OfferChoice
from planner.screen import costmodel as cm
from planner.spec import Spec


def _hours(rows: dict, checkpoint_hours, spot_rate: float, sp) -> tuple:
    """(paid hours, checkpoint interval, useful fraction, expected preemptions) at a spot
    interruption rate per node-hour (0 = on-demand: checkpoints at the fixed interval)."""
    n = len(rows["nodes"])
    failures = rows["nodes"] * spot_rate
    interval = (
        cm.young_daly_interval_hours(checkpoint_hours, failures)
        if spot_rate
        else np.full(n, sp.on_demand_checkpoint_hours)
    )
    useful = cm.useful_fraction(checkpoint_hours, interval, failures, sp.restart_minutes / 60)
    running = rows["train_hours"] / useful
    preemptions = spotrisk.expected_preemptions(
        nodes=rows["nodes"], rate_per_node_hour=spot_rate, running_hours=running
    )
    return running + sp.startup_minutes / 60, interval, useful, preemptions


def price_rows(spec: Spec, choice: OfferChoice, shape: cm.ModelShape, rows: dict) -> list[dict]:
    """Duplicate rows for spot and on-demand and add time, money and energy. Spot rows carry
    their expected preemptions (the offer's interruption rate, planner.market.pricebook) and what
    the same plan costs on-demand; with spot.fallback_wait_hours they are priced as spot with
    on-demand fallback (the provider's chance that spot cannot be had)."""
    offer, prof, sp = choice.offer, choice.profile, spec.spot
    modes = []
    if (
        (spec.constraints.on_demand or offer.owned)
        and offer.has_on_demand
        and choice.capacity != "spot"
    ):
        modes.append(False)
    if spec.constraints.spot and offer.has_spot and choice.capacity != "on_demand":
        modes.append(True)
    parts = []
    checkpoint_hours = cm.checkpoint_write_hours(
        state_bytes=checkpoint_bytes(
            shape.params_total,
            master_weights=(
                precision_table.of_codes("master_weights", rows["precision_code"])
                & (spec.training.fp16_opt_level == "O2")
            ),
        ),
        nodes=rows["nodes"],
        node_gbytes_per_s=sp.checkpoint_gbytes_per_s,
        storage_cap_gbytes_per_s=offer.storage_gbytes_per_s,
    )
    od_price = choice.node_price(spot=False)
    od_hours = _hours(rows, checkpoint_hours, 0.0, sp)[0]
    disk_gb, disk_rate = candidate_disk(spec, choice, shape.params_total, rows)
    od_node = od_price + disk_rate  # the same plan on-demand, with the task's disk
    risk = choice.price.risk
    for spot in modes:
        r = dict(rows)
        n = len(r["nodes"])
        hours, interval, useful, preemptions = _hours(
            rows, checkpoint_hours, risk.rate if spot else 0.0, sp
        )
        price = choice.node_price(spot=spot) + disk_rate
        cost = money.cost_of_hours(price_per_node_hour=price, nodes=r["nodes"], hours=hours)
        cost_od = money.cost_of_hours(price_per_node_hour=od_node, nodes=r["nodes"], hours=od_hours)
        if spot and sp.fallback_wait_hours > 0 and od_price > 0:
            p = risk.unavailable_probability  # expected cost; the deadline must hold either way
            cost = (1 - p) * cost + p * cost_od
            hours = np.maximum(hours, od_hours + sp.fallback_wait_hours)
            price = money.price_of(cost=cost, nodes=r["nodes"], hours=hours)
            preemptions = (1 - p) * preemptions
        r["spot"] = np.full(n, spot)
        r["useful_fraction"] = useful
        r["checkpoint_interval_h"] = interval
        r["hours"] = hours
        r["price_node_hour"] = np.broadcast_to(price, (n,)).astype(float)
        r["cost"], r["disk_gb"], r["disk_cost"] = cost, disk_gb, disk_rate * r["nodes"] * hours
        r["cost_on_demand"] = cost_od if od_price > 0 else np.full(n, np.nan)
        r["preemptions"] = preemptions
        # what the cost counts: an owned node's devices, host and PUE (Offer.node_power_kw)
        r["energy_kwh"] = r["nodes"] * offer.node_power_kw(prof.tdp_w) * hours
        parts.append(r)
    return parts
