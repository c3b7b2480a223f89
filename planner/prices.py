"""`planner prices import FILE.csv`: read a SkyPilot-style catalog into an offer list.

Catalog columns: InstanceType, AcceleratorName, AcceleratorCount, vCPUs, MemoryGiB, GpuInfo,
Price, SpotPrice, Region, AvailabilityZone. Rows of one instance type across regions/zones are
merged: the lowest on-demand and the lowest spot price, with the region count in the source.
Rows without a known accelerator are skipped (and counted). Inter-node bandwidth is not in the
catalog, so imported offers are single-node until you fill in inter_node_gbits_per_s.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
from pathlib import Path

import tomli_w

from gptplan import userdata
from gptplan.tomlconf import name_problem, write_text_atomic
from planner.hardware import ProfileError

# SkyPilot accelerator names -> our profile names
ACCELERATORS = {
    "V100": "v100-16gb",
    "V100-32GB": "v100-32gb",
    "T4": "t4",
    "P4": "p4",
    "A10G": "a10g",
    "A10": "a10g",
    "A100": "a100-40gb",
    "A100-80GB": "a100-80gb",
    "L4": "l4",
    "L40S": "l40s",
    "H100": "h100-80gb",
    "H200": "h200-141gb",
}
REQUIRED = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "SpotPrice")


def _price(text: str) -> float | None:
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def parse_catalog(path: Path, *, provider: str, as_of: str) -> tuple[list[dict], list[str]]:
    try:
        handle = open(path, newline="", encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError("file not found", file=str(path)) from None
    except IsADirectoryError:
        raise ProfileError(
            "is a directory, expected a SkyPilot catalog CSV file", file=str(path)
        ) from None
    with handle:
        try:
            reader = csv.DictReader(handle)
            missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
            if missing:
                raise ProfileError(
                    f"missing column(s) {', '.join(missing)}; a SkyPilot catalog "
                    f"has {', '.join(REQUIRED)}, ...",
                    file=str(path),
                )
            rows = list(reader)
        except UnicodeDecodeError:
            raise ProfileError("not UTF-8 text", file=str(path)) from None
    merged: dict[str, dict] = {}
    skipped = []
    for number, row in enumerate(rows, start=2):
        name = (row.get("AcceleratorName") or "").strip()
        profile = ACCELERATORS.get(name)
        if profile is None:
            skipped.append(f"line {number}: accelerator {name or '(none)'!r} has no profile")
            continue
        try:
            count = float(row["AcceleratorCount"])
            if not (math.isfinite(count) and count >= 1 and count == int(count)):
                raise ValueError
            count = int(count)
        except (TypeError, ValueError, OverflowError):
            skipped.append(
                f"line {number}: AcceleratorCount {row['AcceleratorCount']!r} is "
                "not a whole number >= 1"
            )
            continue
        bad = [
            c for c in ("Price", "SpotPrice") if (row[c] or "").strip() and _price(row[c]) is None
        ]
        if bad:
            skipped.append(f"line {number}: {', '.join(bad)} not a finite price > 0")
            continue
        on_demand, spot = _price(row["Price"]), _price(row["SpotPrice"])
        if on_demand is None and spot is None:
            skipped.append(f"line {number}: no price")
            continue
        key = row["InstanceType"].strip()
        entry = merged.setdefault(
            key,
            {
                "profile": profile,
                "instance": key,
                "count": count,
                "on_demand": [],
                "spot": [],
                "regions": set(),
            },
        )
        region = (row.get("Region") or "").strip()
        if on_demand is not None:
            entry["on_demand"].append((on_demand, region))
        if spot is not None:
            entry["spot"].append((spot, region))
        entry["regions"].add(region)
    offers = []
    for entry in merged.values():
        # the lowest price and the region it was seen in (SkyPilot launches there)
        on_demand, region = min(entry["on_demand"]) if entry["on_demand"] else (0.0, "")
        spot, spot_region = min(entry["spot"]) if entry["spot"] else (0.0, "")
        offers.append(
            {
                "profile": entry["profile"],
                "provider": provider,
                "instance": entry["instance"],
                "gpus_per_node": entry["count"],
                "inter_node_gbits_per_s": 0.0,
                "on_demand_per_hour": on_demand,
                "spot_per_hour": spot,
                "currency": "USD",
                "source": f"imported from {path.name}: lowest price over {len(entry['regions'])} "
                "region(s)",
                "as_of": as_of,
                "region": region,
                "spot_region": spot_region,
            }
        )
    return offers, skipped


def imported_prices_dir(directory: Path | None = None) -> Path:
    """Where imported price lists go: the user data directory's offers/ (never the package's
    hardware_profiles/), or <directory>/offers."""
    return Path(directory) / "offers" if directory else userdata.offers_dir()


def import_catalog(
    path: Path,
    *,
    name: str | None = None,
    provider: str | None = None,
    as_of: str | None = None,
    directory: Path | None = None,
) -> tuple[Path, int, list[str]]:
    path = Path(path)
    name = path.stem if name is None else name
    if name_problem(name):
        raise ProfileError(name_problem(name), key="--name")
    # SkyPilot's own layout is catalogs/<version>/<cloud>/vms.csv: the folder names the cloud
    default = path.parent.name if path.stem == "vms" and path.parent.name else path.stem
    provider = provider or default.split("_")[0].split("-")[0].lower()
    if name == "vms":
        name = provider
    as_of = as_of or dt.date.today().isoformat()
    offers, skipped = parse_catalog(path, provider=provider, as_of=as_of)
    if not offers:
        raise ProfileError(
            f"no usable row ({len(skipped)} skipped"
            + (f"; first: {skipped[0]}" if skipped else "")
            + ")",
            file=str(path),
        )
    out = imported_prices_dir(directory) / f"{name}.toml"
    header = (
        f"# Imported by 'planner prices import' from {path.name} on {as_of}.\n"
        "# inter_node_gbits_per_s = 0 means unknown: such offers are planned single-node.\n"
    )
    write_text_atomic(out, header + tomli_w.dumps({"offers": offers}))
    return out, len(offers), skipped
