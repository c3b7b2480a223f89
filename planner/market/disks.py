"""The task's disk in the cost: the boot disk the SkyPilot task asks every node for, at its
cloud's block-storage price (hardware_profiles/storage/disks.toml, each row with its product,
region, date and source URL). Sized by planner.market.skyfacts (the same reckoning as the
task's disk_size); the search (planner.screen.pricing) adds its cost to the node's price."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gptplan.tomlconf import read_toml
from planner.market.hardware import PROFILE_DIR, Offer, ProfileError

if TYPE_CHECKING:  # annotations only: nothing of offers or the spec is needed at run time
    from planner.market.offers import OfferChoice
    from planner.spec import Spec

# ---- the task's disk ---------------------------------------------------------------------------
# The SkyPilot task (planner.writing.skypilot.disk_plan) asks every node for a boot disk; its
# block-storage price per GB-month per cloud lives in hardware_profiles/storage/disks.toml
# (each with its product, region, date and source URL). Cost per node-hour = GB x
# per_gb_month / hours_per_month, added to the candidate's price in the search.
DISK_FILE = Path("storage") / "disks.toml"


@dataclass(frozen=True)
class DiskPrice:
    """Block-storage price of one cloud's default disk tier (hardware_profiles/storage)."""

    per_gb_month: float = 0.0
    currency: str = "USD"
    product: str = ""
    region: str = ""
    as_of: str = ""
    source: str = ""
    hours_per_month: float = 730.0
    assumed: bool = False  # the file's [default] row: no price recorded for this cloud


@lru_cache(maxsize=4)
def disk_table(directory: Path = PROFILE_DIR) -> dict:
    """The parsed disk price file ({} when the folder has none: disks then cost nothing)."""
    path = Path(directory) / DISK_FILE
    if not path.exists():
        return {}
    return read_toml(path, ProfileError)


def _disk_row(row: object, *, file: str, key: str, hours: float, assumed: bool) -> DiskPrice:
    """One [providers.<cloud>] / [default] table as a DiskPrice; a bad value is one error
    naming the file and the key."""
    if not isinstance(row, dict):
        raise ProfileError("must be a table", file=file, key=key)
    try:
        per_gb = float(row["per_gb_month"])
    except (KeyError, TypeError, ValueError):
        raise ProfileError(
            "needs per_gb_month as a number (price per GB-month)", file=file, key=key
        ) from None
    if not math.isfinite(per_gb) or per_gb < 0:
        raise ProfileError(
            f"per_gb_month must be a finite number >= 0 (got {per_gb})", file=file, key=key
        )
    return DiskPrice(
        per_gb_month=per_gb,
        currency=str(row.get("currency", "USD")),
        product=str(row.get("product", "")),
        region=str(row.get("region", "")),
        as_of=str(row.get("as_of", "")),
        source=str(row.get("source", "")),
        hours_per_month=hours,
        assumed=assumed,
    )


def disk_price(offer: Offer, *, directory: Path = PROFILE_DIR) -> DiskPrice:
    """The price of the boot disk the task asks for on `offer`'s cloud: its provider's row,
    else the file's [default] (an assumption, said on the disk line). Owned and local
    machines: 0 (their disks are theirs; an [[owned]] amortisation counts them)."""
    if offer.kind != "cloud" or offer.owned or offer.provider == "local":
        return DiskPrice(product="the machine's own disk", source="owned: not billed")
    data = disk_table(Path(directory))
    if not data:
        return DiskPrice(product="not priced", source=f"no {DISK_FILE.as_posix()}")
    file = str(Path(directory) / DISK_FILE)
    try:
        hours = float(data.get("hours_per_month", 730.0))
    except (TypeError, ValueError):
        hours = float("nan")
    if not (math.isfinite(hours) and hours > 0):
        raise ProfileError("hours_per_month must be a number > 0", file=file, key="hours_per_month")
    providers = data.get("providers", {})
    if not isinstance(providers, dict):
        raise ProfileError("must be tables [providers.<cloud>]", file=file, key="providers")
    if offer.provider in providers:
        return _disk_row(
            providers[offer.provider],
            file=file,
            key=f"providers.{offer.provider}",
            hours=hours,
            assumed=False,
        )
    if "default" in data:
        return _disk_row(data["default"], file=file, key="default", hours=hours, assumed=True)
    return DiskPrice(product="not priced", source=f"no row for {offer.provider}")


def disk_cost_per_node_hour(gb: np.ndarray, price: DiskPrice, rate: float) -> np.ndarray:
    """What one node's disk of `gb` GB costs per hour, in the budget currency (`rate` =
    budget currency per price.currency): GB x per_gb_month / hours_per_month x rate."""
    return np.asarray(gb, dtype=float) * price.per_gb_month / price.hours_per_month * rate


def candidate_disk(
    spec: Spec, choice: OfferChoice, params: float, rows: dict
) -> tuple[np.ndarray, np.ndarray]:
    """(disk GB per node, disk cost per node-hour in the budget currency) of every candidate
    row of one offer: the size the task will ask for (planner.market.skyfacts.candidate_disk_gb,
    the same reckoning as its disk_size) at the cloud's block-storage price. The search adds
    the cost to the node's price, so it counts in the choice, the plan's price_per_node_hour
    (which the runner's budget guard bills) and its cost."""
    from gptplan import precision as precision_table
    from planner.market.skyfacts import candidate_disk_gb

    master = precision_table.of_codes("master_weights", rows["precision_code"]) & (
        spec.training.fp16_opt_level == "O2"
    )
    gb = candidate_disk_gb(
        corpus_tokens=spec.planned_corpus_tokens,
        corpus_bytes=spec.planned_corpus_bytes or spec.job.corpus_bytes,
        trained_tokens=rows["steps"] * rows["tokens_per_step"],
        vocab_size=spec.model_section().vocab_size,
        params=params,
        master_weights=master,
    )
    price = disk_price(choice.offer)
    rate = spec.rate(price.currency) if price.per_gb_month else 0.0
    return gb, disk_cost_per_node_hour(gb, price, rate)


def disk_line(row: Mapping[str, Any], currency: str) -> str:
    """The chosen plan's disk line: size, price and its source, cost (modelled)."""
    price = disk_price(row["offer_choice"].offer)
    nodes, gb = int(row["nodes"]), float(row["disk_gb"])
    cost = float(row["disk_cost"])
    money = f"{cost:,.0f}" if cost >= 100 else f"{cost:.2g}"
    if not price.per_gb_month:
        return (
            f"disk: {nodes} x {gb:,.0f} GB (the task's disk_size, modelled): 0 {currency} "
            f"({price.product}; {price.source})"
        )
    where = f", {price.region}" if price.region else ""
    assumed = "ASSUMED: " if price.assumed else ""
    return (
        f"disk: {nodes} x {gb:,.0f} GB (the task's disk_size, modelled) x {assumed}"
        f"{price.per_gb_month:g} {price.currency}/GB-month ({price.product}{where}; as of "
        f"{price.as_of or 'undated'}; {price.source}) x {float(row['hours']):,.0f} h / "
        f"{price.hours_per_month:g} h a month = {money} {currency} (modelled), included in "
        "the cost and in the price per node-hour"
    )


def disk_record(row: Mapping[str, Any], currency: str) -> dict:
    """The disk keys of a candidate's --json record (unit-bearing)."""
    price = disk_price(row["offer_choice"].offer)
    cur = currency.lower()
    return {
        "disk_gb_per_node": float(row["disk_gb"]),
        f"disk_price_{price.currency.lower()}_per_gb_month": price.per_gb_month,
        "disk_price_source": price.source,
        "disk_price_as_of": price.as_of,
        "disk_price_assumed": price.assumed,
        f"modelled_disk_cost_{cur}": float(row["disk_cost"]),
    }
