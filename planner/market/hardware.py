"""Hardware profiles and priced offers, read from hardware_profiles/*.toml (data, not code).

A profile is one accelerator: specs, peak TFLOPS per precision, efficiency calibration and its
`[[offers]]`. Extra price lists live in hardware_profiles/offers/*.toml (shipped) and in the user
data directory's offers/*.toml (`planner prices import`; gptplan.userdata), each offer naming
its `profile`. Calibrations written by `planner calibrate` live in the user data directory's
calibration/<profile>.toml (or $GPTPLAN_CALIBRATION_DIR) and override [efficiency]. The
shipped folder is read-only package data: nothing is ever written into it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gptplan import userdata

# The device part of a profile (specs, peaks, efficiency, calibration) is read by the core's
# one strict reader (gptplan.profile), shared with the runner's local rehearsal.
from gptplan.profile import (  # noqa: F401
    LARGE_MODEL_PARAMS,
    LOCAL_CALIBRATION_ENV,
    PEAK_KEYS,
    PROFILE_DIR,
    DeviceProfile,
    Efficiency,
    ProfileError,
    apply_calibration,
    calibration_dir,
    calibration_tables,
    read_profile_file,
)
from gptplan.tomlconf import from_table, read_toml, setting, table_array


@dataclass(frozen=True)
class Offer:
    provider: str = setting("", "Cloud provider or 'owned'.")
    instance: str = setting("", "Instance type or machine description.")
    kind: Literal["cloud", "on_prem"] = setting(
        "cloud", "Rented cloud capacity or owned hardware costed by electricity."
    )
    gpus_per_node: int = setting(1, "Devices per node.", min=1)
    inter_node_gbits_per_s: float = setting(0.0, "Network bandwidth between nodes, Gbit/s.", min=0)
    on_demand_per_hour: float = setting(
        0.0,
        "On-demand price per node-hour (0 = not sold on-demand, e.g. a catalog row with a "
        "spot price only: never a free node).",
        min=0,
    )
    spot_per_hour: float = setting(0.0, "Spot price per node-hour (0 = no spot).", min=0)
    spot_per_hour_low: float = setting(
        0.0,
        "Lowest spot price seen, per node-hour (0 = not stated: a default spread applies).",
        min=0,
    )
    spot_per_hour_high: float = setting(0.0, "Highest spot price seen, per node-hour.", min=0)
    spot_interruptions_per_node_hour: float = setting(
        0.0,
        "Expected spot interruptions per node-hour (0 = the provider's in "
        "hardware_profiles/spot/interruptions.toml).",
        min=0,
    )
    spot_interruptions_low: float = setting(0.0, "p10 of that rate (0 = a third of it).", min=0)
    spot_interruptions_high: float = setting(0.0, "p90 of that rate (0 = three times it).", min=0)
    spot_interruption_source: str = setting("", "Where the interruption rate comes from.")
    storage_gbytes_per_s: float = setting(
        0.0,
        "Checkpoint write bandwidth per node to the "
        "offer's storage, GB/s, where the provider "
        "states one (0 = not stated: the spec's "
        "spot.checkpoint_gbytes_per_s applies).",
        min=0,
    )
    network_source: str = setting("", "Where inter_node_gbits_per_s comes from.")
    electricity_per_kwh: float = setting(0.0, "on_prem: electricity price per kWh.", min=0)
    pue: float = setting(1.0, "on_prem: power usage effectiveness.", min=1)
    host_power_w: float = setting(0.0, "on_prem: host power per node beyond the devices.", min=0)
    gpu_power_w: float = setting(
        0.0, "on_prem: power per device under training load, W (0 = the profile's TDP).", min=0
    )
    amortization_per_gpu_hour: float = setting(
        0.0, "on_prem: hardware cost per device-hour.", min=0
    )
    max_nodes: int = setting(
        0, "Most nodes of this offer that exist (owned machines: their count; 0 = no cap).", min=0
    )
    example: bool = setting(
        False,
        "A shipped illustration of owned machines (nobody declared them): planned only when "
        "named in constraints.offers.",
    )
    declared: bool = setting(
        False, "Declared in the spec's [[owned]] (set by the planner, not in price files)."
    )
    price_flag: str = setting(
        "",
        "Why this row's spot price looks like a placeholder (set by 'planner prices import'; "
        "such a price is kept out of the headline like an outlier).",
    )
    currency: str = setting("USD", "Currency of the prices.")
    source: str = setting("", "Where the price comes from.")
    as_of: str = setting("", "Date of the price.")
    region: str = setting("", "Cloud region of on_demand_per_hour ('' = not recorded).")
    spot_region: str = setting("", "Cloud region of spot_per_hour ('' = same as region).")
    profile: str = setting("", "Profile name (only in hardware_profiles/offers/*.toml).")

    @property
    def key(self) -> str:
        return f"{self.provider}/{self.instance}"

    def node_power_kw(self, tdp_w: float) -> float:
        """Power one node draws from the grid, kW: owned machines their devices (gpu_power_w,
        else the profile's TDP) plus the host, times PUE; a rented node its devices at TDP
        (what the cloud bill does not show). The energy line and the owned price use it."""
        per_gpu = self.gpu_power_w or tdp_w
        if self.kind == "on_prem":
            return (self.gpus_per_node * per_gpu + self.host_power_w) / 1000 * self.pue
        return self.gpus_per_node * per_gpu / 1000

    def energy_basis(self, tdp_w: float) -> str:
        """What the modelled energy counts, for its label."""
        per_gpu = self.gpu_power_w or tdp_w
        if self.kind == "on_prem":
            return (
                f"{self.gpus_per_node} x {per_gpu:g} W devices + {self.host_power_w:g} W host "
                f"per node, x PUE {self.pue:g}: what the cost counts"
            )
        return f"devices at {per_gpu:g} W TDP, an upper bound; host and cooling not counted"

    def node_price_per_hour(self, *, spot: bool, tdp_w: float) -> float:
        """Price of one node-hour in self.currency; on_prem = energy x PUE + amortisation."""
        if self.kind == "on_prem":
            return (
                self.node_power_kw(tdp_w) * self.electricity_per_kwh
                + self.amortization_per_gpu_hour * self.gpus_per_node
            )
        return self.spot_per_hour if spot else self.on_demand_per_hour

    @property
    def has_spot(self) -> bool:
        return self.kind == "cloud" and self.spot_per_hour > 0

    @property
    def has_on_demand(self) -> bool:
        """Owned machines always; a rented offer only with an on-demand price > 0 (a catalog
        row with a spot price only is spot-only, never a free on-demand node)."""
        return self.kind == "on_prem" or self.on_demand_per_hour > 0

    @property
    def owned(self) -> bool:
        return self.kind == "on_prem"


@dataclass(frozen=True)
class Profile(DeviceProfile):
    """A device (gptplan.profile.DeviceProfile: specs, peaks, efficiency, peak_for and
    efficiency_for) and its priced offers."""

    offers: tuple[Offer, ...] = ()


def priced_offer_problem(offer: Offer) -> str:
    """Why an offer cannot be planned on ('' = it can): a rented offer needs a price > 0
    for at least one capacity; 0 (or less) is never a price, so no plan rests on a free node."""
    if offer.kind == "cloud" and not (offer.on_demand_per_hour > 0 or offer.spot_per_hour > 0):
        return (
            "a rented offer needs on_demand_per_hour > 0 or spot_per_hour > 0 (0 means "
            "'not sold that way', never 'free')"
        )
    return ""


def _load_offer(table: dict, *, file: str, index: int) -> Offer:
    offer = from_table(Offer, table, file=file, section=f"offers[{index}]", error=ProfileError)
    problem = priced_offer_problem(offer)
    if problem:
        raise ProfileError(problem, file=file, key=f"offers[{index}]")
    return offer


def load_profile(path: Path) -> Profile:
    """A profile file, strictly: the device through the core's reader, then its offers."""
    device, offer_tables = read_profile_file(path)
    offers = tuple(_load_offer(o, file=str(path), index=i) for i, o in enumerate(offer_tables))
    fields = {f.name: getattr(device, f.name) for f in dataclasses.fields(device)}
    return Profile(**fields, offers=offers)


def imported_prices_dir(directory: Path | None = None) -> Path:
    """Where imported prices go (`planner prices import`) and are read from: the user data
    directory's offers/ (never the package's hardware_profiles/), or <directory>/offers when a
    profiles folder is named; one TOML file per price list, replaced rows under history/."""
    return Path(directory) / "offers" if directory is not None else userdata.offers_dir()


def price_files(directory: Path = PROFILE_DIR) -> list[Path]:
    """Price lists read after the profiles' own [[offers]]: the shipped offers/ folder, then
    the user's imported ones (imported_prices_dir)."""
    folders = [Path(directory) / "offers", imported_prices_dir()]
    files: list[Path] = []
    for folder in dict.fromkeys(folders):
        files += [f for f in sorted(folder.glob("*.toml")) if f not in files]
    return files


_DATE = re.compile(r"^(\d{4})(?:-(\d{2}))?(?:-(\d{2}))?$")


def price_date(as_of: str) -> dt.date | None:
    """'2025-06-15', '2025-06' (the 15th) or '2025' (1 July); anything else is undated."""
    m = _DATE.match((as_of or "").strip())
    if not m:
        return None
    year, month, day = m.group(1), m.group(2), m.group(3)
    try:
        return dt.date(int(year), int(month or 7), int(day or (15 if month else 1)))
    except ValueError:
        return None


def _price_order(offer: Offer) -> dt.date:
    return price_date(offer.as_of) or dt.date.min  # undated: older than any dated price


def current_prices(offers: list[Offer]) -> tuple[list[Offer], list[tuple[Offer, Offer]]]:
    """One current price per key (cloud, instance, region): a row replaced by a newer row of
    its key drops out (returned as (old, newer) pairs for `planner prices history`). A row
    that recorded no region is replaced by a newer row of any region. Of two rows of one key
    and date, the one read later (an import over the shipped list) is current."""
    groups: dict[tuple, list[tuple[dt.date, int, Offer]]] = {}
    for i, o in enumerate(offers):
        groups.setdefault((o.kind, o.provider, o.instance), []).append((_price_order(o), i, o))
    current, replaced = [], []
    for (kind, _, _), rows in groups.items():
        for when, i, old in rows:
            newer = [
                (w, j, o)
                for w, j, o in rows
                if kind == "cloud"
                and j != i
                and (o.region == old.region or not old.region)
                and (w, j) > (when, i)
            ]
            if newer:
                replaced.append((old, max(newer, key=lambda x: (x[0], x[1]))[2]))
            else:
                current.append((i, old))
    return [o for _, o in sorted(current, key=lambda x: x[0])], replaced


def read_price_file(price_file: Path, profiles: dict) -> list[Offer]:
    data = read_toml(price_file, ProfileError)
    out = []
    for i, table in enumerate(
        table_array(data, "offers", file=str(price_file), error=ProfileError)
    ):
        offer = _load_offer(table, file=str(price_file), index=i)
        if offer.profile not in profiles:
            raise ProfileError(
                f"{offer.profile!r} is not a profile; allowed: {', '.join(profiles)}",
                file=str(price_file),
                key=f"offers[{i}].profile",
            )
        out.append(offer)
    return out


def one_profile_per_offer(profiles: dict[str, Profile], directory: Path) -> None:
    """An offer's provider/instance names one machine type, so one profile's [[offers]] hold
    it: a price is current per (provider, instance, region) across every profile
    (current_prices), and the same instance under a second profile silently replaced the
    first's (a local offer named like cpu.toml's dropped it from the CPU space)."""
    owner: dict[str, str] = {}
    for name, prof in profiles.items():
        for i, offer in enumerate(prof.offers):
            first = owner.setdefault(offer.key, name)
            if first != name:
                raise ProfileError(
                    f"offer {offer.key!r} is also one of {first}.toml's; an instance is one "
                    "machine type, in one profile (rename the instance)",
                    file=str(directory / f"{name}.toml"),
                    key=f"offers[{i}].instance",
                )


def all_price_rows(directory: Path = PROFILE_DIR) -> tuple[dict[str, Profile], list[Offer]]:
    """The profiles as shipped and every price row in reading order (shipped, then lists)."""
    profiles = {p.stem: load_profile(p) for p in sorted(Path(directory).glob("*.toml"))}
    if not profiles:
        raise ProfileError(
            "holds no hardware profile (*.toml); reinstall the package", file=str(directory)
        )
    one_profile_per_offer(profiles, Path(directory))
    rows = [dataclasses.replace(o, profile=name) for name, p in profiles.items() for o in p.offers]
    for price_file in price_files(directory):
        rows += read_price_file(price_file, profiles)
    return profiles, rows


def load_profiles(directory: Path = PROFILE_DIR) -> dict[str, Profile]:
    """All profiles, with extra offer files and local calibrations merged in; of several
    prices of one key (cloud, instance, region) only the newest (current_prices)."""
    profiles, rows = all_price_rows(directory)
    current, _ = current_prices(rows)
    for name, prof in profiles.items():
        profiles[name] = dataclasses.replace(
            prof, offers=tuple(o for o in current if o.profile == name)
        )
    for calib in sorted(calibration_dir().glob("*.toml")):
        if calib.stem in profiles:
            profiles[calib.stem] = apply_calibration(profiles[calib.stem], calib)
    return profiles
