"""`planner prices import FILE.csv --as-of DATE`: read a SkyPilot-style catalog into price rows.

Catalog columns: InstanceType, AcceleratorName, AcceleratorCount, vCPUs, MemoryGiB, GpuInfo,
Price, SpotPrice, Region, AvailabilityZone. One price row per (instance type, region): the
lowest on-demand and the lowest spot price over that region's zones, so the on-demand and spot
price of a row come from one region. Rows without a known accelerator are skipped (and
counted). The catalog has no network figures: each row takes them from the instance facts
(hardware_profiles/instances/facts.toml, planner.instances); an instance without facts is imported
with a warning and planned single-node. SkyPilot's CSVs carry no date, so --as-of is
required. A row replaces an older row of the same key (cloud, instance, region) in the same
price list; the replaced one is kept under history/ (`planner prices history INSTANCE`).
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import math
import os
from pathlib import Path

import tomli_w

from gptplan.tomlconf import name_problem, read_toml, table_array, write_text_atomic
from planner.hardware import (
    PROFILE_DIR,
    ProfileError,
    current_prices,
    imported_prices_dir,
)
from planner.instances import facts_for
from planner.pricebook import price_date

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
        except csv.Error as exc:  # a field over the csv module's limit, a stray NUL, ...
            raise ProfileError(
                f"line {reader.line_num + 1}: not a readable CSV row ({exc}); a SkyPilot catalog "
                "is plain comma-separated text",
                file=str(path),
            ) from None
    merged: dict[tuple[str, str], dict] = {}
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
        instance = row["InstanceType"].strip()
        region = (row.get("Region") or "").strip()
        entry = merged.setdefault(
            (instance, region),
            {"profile": profile, "count": count, "on_demand": [], "spot": [], "zones": 0},
        )
        if on_demand is not None:
            entry["on_demand"].append(on_demand)
        if spot is not None:
            entry["spot"].append(spot)
        entry["zones"] += 1
    offers = []
    for (instance, region), entry in merged.items():
        facts = facts_for(provider, instance)
        profile = facts.profile if facts else entry["profile"]
        zones = f"lowest over {entry['zones']} catalog row(s) of region {region or '(none)'}"
        offers.append(
            {
                "profile": profile,
                "provider": provider,
                "instance": instance,
                "gpus_per_node": entry["count"],
                "inter_node_gbits_per_s": facts.inter_node_gbits_per_s if facts else 0.0,
                "network_source": facts.network_source
                if facts
                else f"no instance facts for {provider}/{instance} in "
                "hardware_profiles/instances/facts.toml: planned single-node",
                "on_demand_per_hour": min(entry["on_demand"], default=0.0),
                "spot_per_hour": min(entry["spot"], default=0.0),
                "currency": "USD",
                "source": f"imported from {path.name} ({zones}; on-demand and spot of this region)",
                "as_of": as_of,
                "region": region,
            }
        )
    return offers, skipped


def import_warnings(offers: list[dict]) -> list[str]:
    """Instances imported without facts (planned single-node) or whose GPU count differs."""
    warnings, seen = [], set()
    for o in offers:
        key = (o["provider"], o["instance"])
        if key in seen:
            continue
        seen.add(key)
        facts = facts_for(*key)
        if facts is None:
            warnings.append(
                f"{key[0]}/{key[1]}: no instance facts (hardware_profiles/instances/facts.toml), "
                "so no inter-node bandwidth: planned single-node"
            )
        elif facts.gpus != o["gpus_per_node"]:
            warnings.append(
                f"{key[0]}/{key[1]}: the catalog says {o['gpus_per_node']} accelerators, the "
                f"instance facts {facts.gpus}; the catalog's count is used"
            )
    return warnings


@contextlib.contextmanager
def import_lock(folder: Path):
    """One `planner prices import` at a time per price folder (an flock on the folder,
    released by the kernel however the holder ends); the temporary files a killed import left
    (`.NAME.toml.*.tmp`, write_text_atomic's) are removed once the lock is held: no other
    import can be writing them then."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)  # the folder itself: no file of its own
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for leftover in (*folder.glob(".*.tmp"), *folder.glob("history/.*.tmp")):
            leftover.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)


def import_catalog(
    path: Path,
    *,
    name: str | None = None,
    provider: str | None = None,
    as_of: str | None = None,
    directory: Path | None = None,
) -> tuple[Path, int, list[str], list[str]]:
    """Import a catalog into the price list `name`; returns (file written, rows, skipped
    lines, warnings). Rows of the list with the same key and an older date go to history."""
    from planner.hardware import Offer, _load_offer

    path = Path(path)
    if not as_of or price_date(as_of) is None:
        raise ProfileError(
            f"{as_of!r} is not a date; SkyPilot catalogs carry none, so give the day the "
            "catalog was fetched: --as-of YYYY-MM-DD (or YYYY-MM)"
            if as_of
            else "is required: SkyPilot catalogs carry no date, so give the day the catalog "
            "was fetched, e.g. --as-of 2026-12-01",
            key="--as-of",
        )
    name = path.stem if name is None else name
    problem = name_problem(name)
    if problem:
        raise ProfileError(problem, key="--name")
    # SkyPilot's own layout is catalogs/<version>/<cloud>/vms.csv: the folder names the cloud
    default = path.parent.name if path.stem == "vms" and path.parent.name else path.stem
    provider = provider or default.split("_")[0].split("-")[0].lower()
    if name == "vms":
        name = provider
    offers, skipped = parse_catalog(path, provider=provider, as_of=as_of)
    if not offers:
        raise ProfileError(
            f"no usable row ({len(skipped)} skipped"
            + (f"; first: {skipped[0]}" if skipped else "")
            + ")",
            file=str(path),
        )
    with import_lock(imported_prices_dir(directory)):
        out = imported_prices_dir(directory) / f"{name}.toml"
        history_file = imported_prices_dir(directory) / "history" / f"{name}.toml"
        old = (
            table_array(read_toml(out, ProfileError), "offers", file=str(out), error=ProfileError)
            if out.exists()
            else []
        )
        # one current row per key: the newer of the old and the new row (the new one on a tie)
        rows = [_load_offer(t, file=str(out), index=i) for i, t in enumerate(old)]
        new_rows = [Offer(**o) for o in offers]
        current, _ = current_prices(rows + new_rows)
        keep = {id(o) for o in current}
        tables = [t for t, o in zip(old + offers, rows + new_rows, strict=True) if id(o) in keep]
        gone = [t for t, o in zip(old + offers, rows + new_rows, strict=True) if id(o) not in keep]
        header = (
            f"# Written by 'planner prices import' ({path.name}, prices as of {as_of}). "
            "One row per\n"
            "# (cloud, instance, region); older rows of a key are in history/. Network "
            "figures from\n"
            "# hardware_profiles/instances/facts.toml; inter_node_gbits_per_s = 0 means no "
            "facts: the\n"
            "# instance is planned single-node.\n"
        )
        if gone:
            past = (
                table_array(
                    read_toml(history_file, ProfileError),
                    "offers",
                    file=str(history_file),
                    error=ProfileError,
                )
                if history_file.exists()
                else []
            )
            write_text_atomic(
                history_file,
                "# Price rows replaced by newer imports of the same key (planner prices history).\n"
                + tomli_w.dumps({"offers": past + gone}),
            )
        write_text_atomic(out, header + tomli_w.dumps({"offers": tables}))
        return out, len(offers), skipped, import_warnings(offers)


def price_history(instance: str, directory: Path | None = None) -> list[dict]:
    """Every price row of an instance ('p4de.24xlarge' or 'aws/p4de.24xlarge'), newest first:
    the current ones, those a newer row replaced, and those kept under history/."""
    from planner.hardware import _load_offer, all_price_rows

    _, rows = all_price_rows(PROFILE_DIR if directory is None else directory)
    current, replaced = current_prices(rows)
    past = []
    folder = imported_prices_dir(directory) / "history"
    for f in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
        offers = table_array(read_toml(f, ProfileError), "offers", file=str(f), error=ProfileError)
        for i, t in enumerate(offers):
            past.append(_load_offer(t, file=str(f), index=i))
    by_newer = {id(old): new for old, new in replaced}
    out = []
    for o in current + [old for old, _ in replaced] + past:
        if instance not in (o.instance, o.key):
            continue
        newer = by_newer.get(id(o))
        out.append(
            {
                "status": "current"
                if newer is None and o not in past
                else f"replaced by {newer.as_of} {newer.region or ''}".rstrip()
                if newer is not None
                else "replaced (history)",
                "offer": o.key,
                "region": o.region or "(not recorded)",
                "as of": o.as_of or "undated",
                "on-demand/h": o.on_demand_per_hour,
                "spot/h": o.spot_per_hour,
                "currency": o.currency,
                "source": o.source,
            }
        )
    out.sort(
        key=lambda r: (
            r["status"] != "current",
            -(price_date(str(r["as of"])) or dt.date.min).toordinal(),
        )
    )
    return out
