"""The offers a spec allows, one price per capacity: `OfferChoice` (a hardware profile's offer in
one region, its exchange rate and price facts; `node_price` is what one node costs an hour in the
spec's currency), the regions chosen per capacity, owned machines declared in the spec, and
what the pinned launcher can attach."""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from planner.market.hardware import Offer, Profile
from planner.market.pricebook import (
    OUTLIER_BELOW_MEDIAN,
    OUTLIER_MIN_OTHER_PROVIDERS,
    SPOT_PRICE_SPREAD,
    STALE_AFTER_DAYS,
    PriceFacts,
    age_spreads,
    price_age_days,
    price_date,
    spot_risk,
)
from planner.market.skyfacts import EFA_SKYPILOT, PINNED_SKYPILOT
from planner.spec import Spec


@dataclass(frozen=True)
class OfferChoice:
    profile: Profile
    offer: Offer
    rate: float  # spec currency per offer currency
    facts: PriceFacts | None = None  # age, outlier flag, spot risk (planner.market.pricebook)
    capacity: str = ""  # "spot" / "on_demand": this region is priced for that capacity only
    where: str = ""  # which region(s) the prices come from, when the instance has several

    @property
    def label(self) -> str:
        return f"{self.profile.name} @ {self.offer.key}" + (
            f" ({self.where})" if self.where else ""
        )

    def native_node_price(self, spot: bool) -> float:
        """One node for an hour in the offer's own currency (an owned node: its power and
        upkeep, Offer.node_price_per_hour)."""
        return self.offer.node_price_per_hour(spot=spot, tdp_w=self.profile.tdp_w)

    def node_price(self, spot: bool) -> float:
        """One node for an hour in the spec's currency: the offer's price at the spec's rate."""
        return self.native_node_price(spot) * self.rate

    @property
    def price(self) -> PriceFacts:
        return self.facts if self.facts is not None else price_facts([self])[0]


def allowed_offers(spec: Spec, profiles: dict[str, Profile]) -> list[OfferChoice]:
    """The offers the spec allows, one price per capacity: of an instance priced in several
    regions, on-demand and spot come from one region each (the cheapest region for that
    capacity; both from one region when it is the cheapest for both), or with
    constraints.any_region from the cheapest region of each. This machine's own offers
    (provider 'local') only when the spec names its profile or offer."""
    c = spec.constraints
    groups: dict[tuple[str, str], list[Offer]] = {}
    for name, prof in profiles.items():
        if c.profiles and name not in c.profiles:
            continue
        for offer in (*prof.offers, *owned_offers(spec, profiles).get(name, ())):
            if c.offers and offer.key not in c.offers:
                continue
            # shipped owned machines are examples: planned only when named; owned machines
            # of a user-data price list with constraints.owned_hardware; the spec's [[owned]]
            # always (they are what the team declared)
            if offer.owned and offer.example and offer.key not in c.offers:
                continue
            if (
                offer.owned
                and not offer.declared
                and not (c.owned_hardware or offer.key in c.offers)
            ):
                continue
            if offer.provider == "local" and not (name in c.profiles or offer.key in c.offers):
                continue
            groups.setdefault((name, offer.key), []).append(launchable(offer, c))
    choices = []
    for (name, _), offers in groups.items():
        prof = profiles[name]
        for offer, capacity, where in region_choices(offers, any_region=c.any_region):
            if (capacity == "spot" and not c.spot) or (capacity == "on_demand" and not c.on_demand):
                continue
            choices.append(
                OfferChoice(prof, offer, spec.rate(offer.currency), capacity=capacity, where=where)
            )
    facts = price_facts(
        choices,
        stale_after_days=c.max_price_age_days,
        preemption_override=spec.spot.preemptions_per_node_hour,
    )
    return [dataclasses.replace(ch, facts=f) for ch, f in zip(choices, facts, strict=True)]


def launchable(offer: Offer, c) -> Offer:
    """The offer as the launch path gets it. The pinned SkyPilot 0.9.2 attaches no EFA to EC2
    VMs; 0.10.3 is the first that does (planner.market.skyfacts, PINNED_SKYPILOT /
    EFA_SKYPILOT, with the sources). By default (constraints.launcher_attaches_efa = false) an
    AWS instance whose network is EFA has no inter-node figure it would get, and is planned
    single-node; with true it is costed on EFA, its task sets resources.network_tier: best and
    says what the launch needs (planner.market.skyfacts.efa_requirement)."""
    if (
        offer.provider == "aws"
        and "EFA" in offer.network_source
        and offer.inter_node_gbits_per_s > 0
        and not c.launcher_attaches_efa
    ):
        return dataclasses.replace(
            offer,
            inter_node_gbits_per_s=0.0,
            network_source=f"{offer.network_source}; but SkyPilot {PINNED_SKYPILOT} (the pinned "
            f"launcher) attaches no EFA: planned single-node (constraints.launcher_attaches_efa "
            f"= true to cost it on EFA, launched with SkyPilot >= {EFA_SKYPILOT})",
        )
    return offer


def owned_offers(spec: Spec, profiles: dict[str, Profile]) -> dict[str, list[Offer]]:
    """The spec's [[owned]] machines as offers, by profile; an unknown profile is the spec's
    error (its file and key)."""
    from planner.spec import SpecError

    out: dict[str, list[Offer]] = {}
    for i, o in enumerate(spec.owned):
        if o.profile not in profiles:
            raise SpecError(
                f"{o.profile!r} is not a hardware profile; allowed: {', '.join(profiles)}",
                file=spec.path,
                key=f"owned[{i}].profile",
            )
        fields = {k: v for k, v in o.offer_fields().items() if k != "profile"}
        out.setdefault(o.profile, []).append(Offer(**fields, declared=True))
    return out


def region_choices(
    offers: list[Offer], *, any_region: bool = False
) -> list[tuple[Offer, str, str]]:
    """(offer, capacity it is priced for ('' = both), which region) for the current price rows
    of one instance. One row: itself. Several regions: the cheapest on-demand region and the
    cheapest spot region, each with its own region's other price (one row when they are the
    same region); with any_region, one offer with the cheapest of each, regions named."""
    if len(offers) <= 1 or offers[0].kind != "cloud":
        return [(o, "", "") for o in offers]
    n = len({o.region for o in offers})
    od = min(
        (o for o in offers if o.on_demand_per_hour > 0),
        key=lambda o: (o.on_demand_per_hour, o.region),
        default=None,
    )
    # a region whose spot price looks like a placeholder (Offer.price_flag) is the spot
    # region only when no other region sells spot; then it is flagged like an outlier
    spot_rows = [o for o in offers if o.spot_per_hour > 0]
    sp = min(
        [o for o in spot_rows if not o.price_flag] or spot_rows,
        key=lambda o: (o.spot_per_hour, o.region),
        default=None,
    )
    if any_region and od is not None and sp is not None and od is not sp:
        older = min((od, sp), key=lambda o: price_date(o.as_of) or dt.date.min)
        merged = dataclasses.replace(
            od,
            spot_per_hour=sp.spot_per_hour,
            spot_region=sp.region,
            price_flag=sp.price_flag,
            as_of=older.as_of,
            source=f"on-demand: {od.source}; spot: {sp.source}",
        )
        return [(merged, "", f"on-demand {od.region}, spot {sp.region}")]
    if od is None or sp is None or od is sp:
        best = od or sp
        assert best is not None
        return [(best, "", f"{best.region}, cheapest of {n}")]
    return [
        (od, "on_demand", f"on-demand {od.region}, cheapest of {n}"),
        (sp, "spot", f"spot {sp.region}, cheapest of {n}"),
    ]


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
        # a placeholder spot price (planner.market.prices flags it on import) is kept out of the
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
