"""What a price is worth: its age, whether it is an outlier, and the spot risk that comes with it.

Data, not code: interruption rates per provider live in hardware_profiles/spot/interruptions.toml
(each with its source); an offer may override them. Nothing here changes a price: the search
uses these facts to flag stale prices, keep outlier spot prices out of the headline, put
expected preemptions into the cost and widen its interval (planner.screen, planner.market.spotrisk).
The facts of each offer a spec allows, outliers among them included, are put together in
planner.market.offers (price_facts), next to OfferChoice.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gptplan.tomlconf import read_toml
from planner.market.hardware import PROFILE_DIR, Offer, ProfileError, price_date  # noqa: F401

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
