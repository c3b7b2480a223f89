"""What a price is worth: its age, whether it is an outlier, and the spot risk that comes with it.

Data, not code: interruption rates per provider live in hardware_profiles/spot/interruptions.toml
(each with its source); an offer may override them. Nothing here changes a price: the search
uses these facts to flag stale prices, keep outlier spot prices out of the headline, put
expected preemptions into the cost and widen its interval (planner.search, planner.spotrisk).
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gptplan.tomlconf import read_toml
from planner.hardware import PROFILE_DIR, Offer, ProfileError, price_date  # noqa: F401

if TYPE_CHECKING:  # annotations only: planner.search imports this module
    from planner.search import OfferChoice
    from planner.spec import Spec

STALE_AFTER_DAYS = 180  # prices older than this are flagged (spec can change it)
OUTLIER_BELOW_MEDIAN = 0.5  # a spot price below half the same GPU's other spot prices ...
OUTLIER_MIN_OTHER_PROVIDERS = 2  # ... of at least this many other providers (outlier_notes)
# Spread of prices over a plan's life when the offer states none (assumption, shown as such):
# spot prices move with demand; a stale on-demand list price may since have been cut (AWS cut
# P4/P5 on-demand prices by up to 45% in mid-2025).
SPOT_PRICE_SPREAD = (0.7, 1.3)
STALE_ON_DEMAND_SPREAD = (0.55, 1.0)  # the widest an on-demand list price's interval gets
# The interval widens with the price's age instead of only a label: AWS cut P4/P5 on-demand
# list prices by up to 45% in June 2025, about 23 months after P5's launch (July 2023), i.e.
# about 2% per month of age; an on-demand price's low end falls AGE_WIDENING per month (to
# STALE_ON_DEMAND_SPREAD's 0.55 at most) and a spot price's interval widens by as much on each
# side (to SPOT_WIDEST). An undated price counts as UNDATED_MONTHS old (the widest).
AGE_WIDENING = 0.02  # per month of age
UNDATED_MONTHS = 24.0
SPOT_WIDEST = (0.3, 2.0)
DAYS_PER_MONTH = 30.44


def age_spreads(age_days: int | None, spot: tuple[float, float]) -> tuple[tuple, tuple]:
    """(spot spread, on-demand spread) of a price this many days old (None: undated), from
    the spot spread it states (or SPOT_PRICE_SPREAD): the rule above."""
    months = UNDATED_MONTHS if age_days is None else age_days / DAYS_PER_MONTH
    widen = AGE_WIDENING * months
    on_demand = (max(STALE_ON_DEMAND_SPREAD[0], 1.0 - widen), 1.0)
    spot_spread = (max(SPOT_WIDEST[0], spot[0] - widen), min(SPOT_WIDEST[1], spot[1] + widen))
    return spot_spread, on_demand


@dataclass(frozen=True)
class SpotRisk:
    """Interruptions per node-hour (central, p10, p90), with where the numbers come from."""

    rate: float = 0.0
    low: float = 0.0
    high: float = 0.0
    unavailable_probability: float = 0.0
    source: str = ""


@dataclass(frozen=True)
class PriceFacts:
    as_of: str = ""
    age_days: int | None = None  # None: the price is undated
    stale: bool = False
    outlier: bool = False
    outlier_note: str = ""
    risk: SpotRisk = SpotRisk()
    spot_spread: tuple[float, float] = SPOT_PRICE_SPREAD  # low/high ratio to the price
    on_demand_spread: tuple[float, float] = (1.0, 1.0)


def price_age_days(as_of: str, today: dt.date | None = None) -> int | None:
    when = price_date(as_of)
    if when is None:
        return None
    return max(0, ((today or dt.date.today()) - when).days)


@lru_cache(maxsize=4)
def interruption_table(directory: Path = PROFILE_DIR) -> dict:
    path = Path(directory) / "spot" / "interruptions.toml"
    if not path.exists():
        return {}
    return read_toml(path, ProfileError)


def _risk_from(table: dict, *, file: str, key: str) -> SpotRisk:
    try:
        rate = float(table["preemptions_per_node_hour"])
        low, high = float(table.get("low", rate)), float(table.get("high", rate))
        unavailable = float(table.get("unavailable_probability", 0.0))
    except (KeyError, TypeError, ValueError):
        raise ProfileError(
            "needs preemptions_per_node_hour, low, high as numbers", file=file, key=key
        ) from None
    finite = all(math.isfinite(x) for x in (rate, low, high))
    if not finite or not (0 <= low <= rate <= high) or not 0 <= unavailable <= 1:
        raise ProfileError(
            f"needs finite 0 <= low <= preemptions_per_node_hour <= high and "
            f"unavailable_probability in 0..1 (got {low}, {rate}, {high}, "
            f"{unavailable})",
            file=file,
            key=key,
        )
    return SpotRisk(rate, low, high, unavailable, str(table.get("source", "")))


def spot_risk(offer: Offer, *, override: float = 0.0, directory: Path = PROFILE_DIR) -> SpotRisk:
    """The interruption rate of an offer's spot capacity: the spec's own assumption if given
    (> 0; its 80% range a factor 3 either side), else the offer's, else its provider's, else
    the stated default."""
    if offer.kind != "cloud" or offer.spot_per_hour <= 0:
        return SpotRisk(source="no spot capacity")
    if override > 0:
        return SpotRisk(
            override,
            override / 3,
            override * 3,
            0.5,
            "spec spot.preemptions_per_node_hour (user assumption; 80% range "
            "a factor 3 either side)",
        )
    if offer.spot_interruptions_per_node_hour > 0:
        rate = offer.spot_interruptions_per_node_hour
        return SpotRisk(
            rate,
            offer.spot_interruptions_low or rate / 3,
            offer.spot_interruptions_high or rate * 3,
            0.5,
            offer.spot_interruption_source or "stated in the offer",
        )
    data = interruption_table(Path(directory))
    file = str(Path(directory) / "spot" / "interruptions.toml")
    providers = data.get("providers", {})
    if not isinstance(providers, dict):
        raise ProfileError("must be tables [providers.<cloud>]", file=file, key="providers")
    table = providers.get(offer.provider)
    if table is not None:
        return _risk_from(table, file=file, key=f"providers.{offer.provider}")
    if "default" in data:
        return _risk_from(data["default"], file=file, key="default")
    return SpotRisk(0.03, 0.003, 0.15, 0.5, "built-in default (no spot/interruptions.toml)")


def _per_gpu_spot(choice: OfferChoice) -> float:
    return choice.offer.spot_per_hour * choice.rate / choice.offer.gpus_per_node


def _spot_ratio(choice: OfferChoice) -> float:
    return choice.offer.spot_per_hour / choice.offer.on_demand_per_hour


def outlier_notes(choices: Sequence[OfferChoice]) -> dict[int, str]:
    """Offers whose spot price is an outlier, with the explanation. The rule compares a spot
    price with its own on-demand price and with the same GPU's offers from other providers
    (each provider counted once, by its lowest spot price per GPU-hour, so many regions or
    rows of one provider weigh as one). It flags only when at least
    OUTLIER_MIN_OTHER_PROVIDERS other providers sell that GPU as spot and on-demand, and both
    hold: the spot price per GPU-hour (budget currency) is below OUTLIER_BELOW_MEDIAN x their
    median, and its discount is out of their range: its spot/on-demand ratio is below
    OUTLIER_BELOW_MEDIAN x their median ratio. A cheap provider (low on-demand too) is not an
    outlier; a new row of one provider can flip another offer only by becoming one of those
    other providers."""
    notes = {}
    for i, c in enumerate(choices):
        if not c.offer.has_spot or c.offer.on_demand_per_hour <= 0:
            continue
        best: dict[str, OfferChoice] = {}
        for o in choices:
            if (
                o.offer.provider == c.offer.provider
                or o.profile.name != c.profile.name
                or not o.offer.has_spot
                or o.offer.on_demand_per_hour <= 0
            ):
                continue
            prev = best.get(o.offer.provider)
            if prev is None or _per_gpu_spot(o) < _per_gpu_spot(prev):
                best[o.offer.provider] = o
        if len(best) < OUTLIER_MIN_OTHER_PROVIDERS:
            continue
        others = list(best.values())
        mine, ratio = _per_gpu_spot(c), _spot_ratio(c)
        median = statistics.median(_per_gpu_spot(o) for o in others)
        median_ratio = statistics.median(_spot_ratio(o) for o in others)
        if mine < OUTLIER_BELOW_MEDIAN * median and ratio < OUTLIER_BELOW_MEDIAN * median_ratio:
            names = ", ".join(
                f"{o.offer.provider} {_per_gpu_spot(o):.3g} ({_spot_ratio(o):.0%})" for o in others
            )
            notes[i] = (
                f"outlier spot price: {c.offer.key} {mine:.3g} per GPU-hour is {mine / median:.0%} "
                f"of the median of {len(others)} other providers' {c.profile.name} spot offers "
                f"and {ratio:.0%} of its own on-demand price against their median "
                f"{median_ratio:.0%} ({names}; budget currency, spot/on-demand); rule: both "
                f"below {OUTLIER_BELOW_MEDIAN:.0%} of the others' median with at least "
                f"{OUTLIER_MIN_OTHER_PROVIDERS} other providers; such capacity is often "
                "unavailable or momentary"
            )
    return notes


def price_facts(
    choices,
    *,
    today: dt.date | None = None,
    stale_after_days: int = STALE_AFTER_DAYS,
    preemption_override: float = 0.0,
) -> list[PriceFacts]:
    """One PriceFacts per offer choice (same order)."""
    notes = outlier_notes(choices)
    out = []
    for i, c in enumerate(choices):
        age = price_age_days(c.offer.as_of, today)
        stale = age is None or age > stale_after_days
        # a placeholder spot price (planner.prices flags it on import) is kept out of the
        # headline like an outlier, unless this choice prices the row's on-demand only
        flagged = bool(c.offer.price_flag and c.offer.has_spot and c.capacity != "on_demand")
        spot = (
            (
                c.offer.spot_per_hour_low / c.offer.spot_per_hour,
                c.offer.spot_per_hour_high / c.offer.spot_per_hour,
            )
            if c.offer.spot_per_hour_low and c.offer.spot_per_hour_high and c.offer.spot_per_hour
            else SPOT_PRICE_SPREAD
        )
        rented = c.offer.kind == "cloud"
        spot, on_demand = age_spreads(age, spot) if rented else (spot, (1.0, 1.0))
        out.append(
            PriceFacts(
                as_of=c.offer.as_of,
                age_days=age,
                stale=stale and c.offer.kind == "cloud",
                outlier=i in notes or flagged,
                outlier_note=notes.get(i, "")
                or (f"placeholder spot price: {c.offer.price_flag}" if flagged else ""),
                risk=spot_risk(c.offer, override=preemption_override),
                spot_spread=spot,
                on_demand_spread=on_demand,
            )
        )
    return out


# ---- the task's disk ---------------------------------------------------------------------------
# The SkyPilot task (planner.skypilot.disk_plan) asks every node for a boot disk; its
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
    row of one offer: the size the task will ask for (planner.skyfacts.candidate_disk_gb,
    the same reckoning as its disk_size) at the cloud's block-storage price. The search adds
    the cost to the node's price, so it counts in the choice, the plan's price_per_node_hour
    (which the runner's budget guard bills) and its cost."""
    from gptplan import precision as precision_table
    from planner.skyfacts import candidate_disk_gb

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


def disk_line(row: dict, currency: str) -> str:
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


def disk_record(row: dict, currency: str) -> dict:
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
