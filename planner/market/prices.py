"""`planner prices import FILE.csv --as-of DATE`: read a SkyPilot-style catalog into price rows.

Catalog columns: InstanceType, AcceleratorName, AcceleratorCount, vCPUs, MemoryGiB, GpuInfo,
Price, SpotPrice, Region, AvailabilityZone. One price row per (instance type, region): the
lowest on-demand and the lowest spot price over that region's zones, so the on-demand and spot
price of a row come from one region. Rows without a known accelerator are skipped (and
counted). The catalog has no network figures: each row takes them from the instance facts
(hardware_profiles/instances/facts.toml, planner.market.instances); an instance without facts is
imported with a warning and planned single-node. SkyPilot's CSVs carry no date, so --as-of is
required. A row replaces an older row of the same key (cloud, instance, region) in the same
price list; the replaced one is kept under history/ (`planner prices history INSTANCE`).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime as dt
import functools
import math
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import tomli_w

from gptplan.diskspace import guard_disk_writes
from gptplan.tomlconf import name_problem, read_toml, table_array, write_text_atomic
from planner.market.hardware import (
    PROFILE_DIR,
    Offer,
    ProfileError,
    current_prices,
    imported_prices_dir,
)
from planner.market.instances import facts_for
from planner.market.pricebook import price_date

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
# An accelerator sold in a PCIe form factor is another device (lower clocks, power and memory
# bandwidth, no NVSwitch): an instance whose name says so maps to that profile. SXM is the
# default of the names above.
PCIE_PROFILES = {"h100-80gb": "h100-pcie"}
REQUIRED = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "SpotPrice")
# A per-row date column, where a catalog has one (SkyPilot's have none): the row's own date.
DATE_COLUMNS = ("Date", "AsOf", "as_of", "date", "LastUpdated")
# Placeholder patterns of SkyPilot's catalogs (seen in AWS v7: p5 ca-central-1 spot 113.068 =
# on-demand 113.068; p4d ap-southeast-2 spot 4.2604 = 10% of 42.60438): a spot price equal to
# on-demand, or at an exact round fraction of it, is computed, not quoted by a market.
ROUND_FRACTIONS = (0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9)
EXACT = 5e-5  # relative tolerance of "exactly" (the catalogs print 4-6 decimals)
# A region's spot discount far from the same instance's other regions (at least
# REGION_MIN_OTHERS of them) is flagged too: no discount (spot >= NO_DISCOUNT x on-demand) where
# the others sell at most OTHERS_DISCOUNTED of on-demand, or a ratio below REGION_LOW x theirs.
NO_DISCOUNT, OTHERS_DISCOUNTED = 0.95, 0.6
REGION_LOW, REGION_MIN_OTHERS = 0.25, 2
# A price move at import above this share is printed with old and new price and date.
MOVE_THRESHOLD = 0.10


def _price(text: str) -> float | None:
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def placeholder_reason(on_demand: float | None, spot: float | None) -> str:
    """Why a (zone's) spot price looks computed rather than quoted ('' = it does not)."""
    if not on_demand or not spot:
        return ""
    ratio = spot / on_demand
    if abs(ratio - 1) <= EXACT:
        return (
            f"spot {spot:g} equals on-demand {on_demand:g}: the catalog's filler where no "
            "spot price is published"
        )
    for f in ROUND_FRACTIONS:
        if abs(ratio - f) <= EXACT * f:
            return (
                f"spot {spot:g} is exactly {f:.0%} of on-demand {on_demand:g}: a computed "
                "figure, not a market price"
            )
    return ""


def _profile_for(name: str, instance: str) -> str | None:
    profile = ACCELERATORS.get(name)
    if profile and "pcie" in instance.lower():
        return PCIE_PROFILES.get(profile, profile)
    return profile


def _count(text) -> int | None:
    try:
        count = float(text)
    except (TypeError, ValueError, OverflowError):
        return None
    if not (math.isfinite(count) and count >= 1 and count == int(count)):
        return None
    return int(count)


def parse_catalog(path: Path, *, provider: str, as_of: str) -> tuple[list[dict], list[str]]:
    """Price rows of a catalog and the skipped rows summarised by reason (one line each).

    GCP's layout (host rows without accelerator, GPU rows without instance type) is combined:
    a host row whose instance facts name its GPUs gets the price of those GPUs in the same
    region added (on-demand to on-demand, spot to spot)."""
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
            date_column = next((c for c in DATE_COLUMNS if c in (reader.fieldnames or [])), "")
            rows = list(reader)
        except UnicodeDecodeError:
            raise ProfileError("not UTF-8 text", file=str(path)) from None
        except csv.Error as exc:  # a field over the csv module's limit, a stray NUL, ...
            raise ProfileError(
                f"line {reader.line_num + 1}: not a readable CSV row ({exc}); a SkyPilot catalog "
                "is plain comma-separated text",
                file=str(path),
            ) from None
    skipped: dict[str, list[int]] = {}

    def skip(reason: str, number: int) -> None:
        skipped.setdefault(reason, []).append(number)

    # GCP: GPUs priced apart from their host, per (accelerator, count, region)
    gpu_rows: dict[tuple[str, int, str], dict[str, list[float]]] = {}
    hosts = []
    merged: dict[tuple[str, str], dict] = {}
    for number, row in enumerate(rows, start=2):
        instance = (row.get("InstanceType") or "").strip()
        name = (row.get("AcceleratorName") or "").strip()
        region = (row.get("Region") or "").strip()
        row_date = (row.get(date_column) or "").strip() if date_column else ""
        if date_column and price_date(row_date) is None:
            skip(f"{date_column} is not a date YYYY-MM-DD", number)
            continue
        bad = [
            c for c in ("Price", "SpotPrice") if (row[c] or "").strip() and _price(row[c]) is None
        ]
        if bad:
            skip(f"{' and '.join(bad)} not a finite price > 0", number)
            continue
        on_demand, spot = _price(row["Price"]), _price(row["SpotPrice"])
        if on_demand is None and spot is None:
            skip("without any price (neither Price nor SpotPrice)", number)
            continue
        if not instance and name:  # a GCP GPU row
            count = _count(row["AcceleratorCount"])
            if count is not None:
                prices = gpu_rows.setdefault((name, count, region), {"od": [], "spot": []})
                prices["od"] += [on_demand] if on_demand else []
                prices["spot"] += [spot] if spot else []
            continue
        if not name:
            facts = facts_for(provider, instance)
            if facts is None:
                skip(
                    "without an accelerator (CPU-only, or a GCP host whose GPUs "
                    "hardware_profiles/instances/facts.toml does not name)",
                    number,
                )
                continue
            hosts.append((number, instance, region, row_date, on_demand, spot, facts))
            continue
        profile = _profile_for(name, instance)
        if profile is None:
            skip(f"accelerator {name!r} has no profile", number)
            continue
        count = _count(row["AcceleratorCount"])
        if count is None:
            skip("AcceleratorCount is not a whole number >= 1", number)
            continue
        _add_zone(merged, instance, region, profile, count, on_demand, spot, row_date, number)
    names_of: dict[str, list[str]] = {}
    for name, profile in ACCELERATORS.items():
        names_of.setdefault(profile, []).append(name)
    for number, instance, region, row_date, on_demand, spot, facts in hosts:
        gpus = next(
            (
                gpu_rows[(n, facts.gpus, region)]
                for n in names_of.get(facts.profile, [])
                if (n, facts.gpus, region) in gpu_rows
            ),
            None,
        )
        if gpus is None:
            skip(
                "host row without its GPUs' row in the same region (GCP prices them apart)",
                number,
            )
            continue
        gpu_od, gpu_spot = min(gpus["od"], default=None), min(gpus["spot"], default=None)
        total_od = on_demand + gpu_od if on_demand and gpu_od else None
        total_spot = spot + gpu_spot if spot and gpu_spot else None
        _add_zone(
            merged,
            instance,
            region,
            facts.profile,
            facts.gpus,
            total_od,
            total_spot,
            row_date,
            number,
            combined=True,
        )
    offers = []
    for (instance, region), entry in merged.items():
        if not entry["on_demand"] and not entry["spot"]:
            continue  # every zone skipped (said once per reason)
        facts = facts_for(provider, instance)
        profile = entry["profile"] if entry["profile"] in PCIE_PROFILES.values() else None
        profile = profile or (facts.profile if facts else entry["profile"])
        zones = f"lowest over {entry['zones']} catalog row(s) of region {region or '(none)'}"
        if entry["combined"]:
            zones += "; host and GPU rows added (GCP prices them apart)"
        # a zone's placeholder spot price is used only when no zone of the region has another
        real = [p for p, why in entry["spot"] if not why]
        spot_price = min(real or [p for p, _ in entry["spot"]], default=0.0)
        flag = "" if real or not entry["spot"] else entry["spot"][0][1]
        on_demand_price = min(entry["on_demand"], default=0.0)
        source = f"imported from {path.name} ({zones}; on-demand and spot of this region)"
        if not on_demand_price:
            source += "; no on-demand price in the catalog (capacity blocks or not sold): spot only"
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
                "on_demand_per_hour": on_demand_price,
                "spot_per_hour": spot_price,
                "currency": "USD",
                "source": source,
                "as_of": max(entry["dates"], key=lambda d: price_date(d) or dt.date.min)
                if entry["dates"]
                else as_of,
                "region": region,
                "price_flag": flag,
            }
        )
    _flag_far_regions(offers)
    summary = [
        f"{len(numbers)} row(s) {reason} (line {numbers[0]}"
        + (f" and {len(numbers) - 1} more)" if len(numbers) > 1 else ")")
        for reason, numbers in skipped.items()
    ]
    return offers, summary


def _add_zone(
    merged, instance, region, profile, count, on_demand, spot, row_date, number, *, combined=False
) -> None:
    entry = merged.setdefault(
        (instance, region),
        {
            "profile": profile,
            "count": count,
            "on_demand": [],
            "spot": [],
            "zones": 0,
            "dates": [],
            "combined": combined,
        },
    )
    if on_demand is not None:
        entry["on_demand"].append(on_demand)
    if spot is not None:
        entry["spot"].append((spot, placeholder_reason(on_demand, spot)))
    if row_date:
        entry["dates"].append(row_date)
    entry["zones"] += 1


def _flag_far_regions(offers: list[dict]) -> None:
    """Flag a region's spot price far from the same instance's other regions, by its discount
    (spot / on-demand, so that regional list prices do not count): no discount (at least
    NO_DISCOUNT of on-demand) where the others' median discount leaves at most
    OTHERS_DISCOUNTED (at least REGION_MIN_OTHERS other regions), or below REGION_LOW times
    the others' median (more than REGION_MIN_OTHERS of them; rows without discount are not
    counted among the others) (spot markets differ a lot between regions: only these
    extremes are flagged)."""
    by_instance: dict[str, list[dict]] = {}
    for o in offers:
        if o["spot_per_hour"] > 0 and o["on_demand_per_hour"] > 0 and not o["price_flag"]:
            by_instance.setdefault(o["instance"], []).append(o)
    flags = []
    for rows in by_instance.values():
        for o in rows:
            others = [
                r["spot_per_hour"] / r["on_demand_per_hour"]
                for r in rows
                if r is not o and r["spot_per_hour"] < NO_DISCOUNT * r["on_demand_per_hour"]
            ]
            if len(others) < REGION_MIN_OTHERS:
                continue
            median = statistics.median(others)
            ratio = o["spot_per_hour"] / o["on_demand_per_hour"]
            if ratio >= NO_DISCOUNT and median <= OTHERS_DISCOUNTED:
                why = "no discount"
            elif ratio < REGION_LOW * median and len(others) > REGION_MIN_OTHERS:
                why = f"below {REGION_LOW:.0%} of their median"
            else:
                continue
            flags.append(
                (
                    o,
                    f"spot {o['spot_per_hour']:g} in {o['region'] or '(no region)'} is "
                    f"{ratio:.0%} of its on-demand price, the instance's {len(others)} other "
                    f"regions' median {median:.0%} ({why})",
                )
            )
    for o, why in flags:
        o["price_flag"] = why


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

    with guard_disk_writes(folder, setting="the data directory (--data-dir)"):
        folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)  # the folder itself: no file of its own
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for leftover in (*folder.glob(".*.tmp"), *folder.glob("history/.*.tmp")):
            leftover.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)


def repository_date(path: Path) -> str:
    """The commit date (YYYY-MM-DD) of a catalog file in a git checkout (e.g. a clone of
    skypilot-org/skypilot-catalog) when the file is unmodified there; '' otherwise."""
    git = shutil.which("git")
    if git is None:
        return ""
    path = Path(path).resolve()
    try:
        run = functools.partial(
            subprocess.run, cwd=path.parent, capture_output=True, text=True, timeout=10
        )
        dirty = run([git, "status", "--porcelain", "--", path.name])
        if dirty.returncode != 0 or dirty.stdout.strip():
            return ""
        log = run([git, "log", "-1", "--format=%cs", "--", path.name])
    except (OSError, subprocess.SubprocessError):
        return ""
    date = log.stdout.strip() if log.returncode == 0 else ""
    return date if price_date(date) is not None else ""


def _catalog_date(path: Path, as_of: str | None) -> tuple[str, str]:
    """(date of the catalog's rows, how it was found). --as-of is the catalog's own date (its
    commit date), never later than the repository says and never in the future."""
    if not as_of or price_date(as_of) is None:
        raise ProfileError(
            f"{as_of!r} is not a date; SkyPilot catalogs carry none, so give the catalog's "
            "own date (the commit date of the vms.csv you fetched): --as-of YYYY-MM-DD"
            if as_of
            else "is required: SkyPilot catalogs carry no date, so give the catalog's own date "
            "(the commit date of the vms.csv, e.g. from 'git log -1 --format=%cs vms.csv' in "
            "a clone of skypilot-org/skypilot-catalog): --as-of 2026-12-01",
            key="--as-of",
        )
    when = price_date(as_of)
    assert when is not None
    if when > dt.date.today() + dt.timedelta(days=1):
        raise ProfileError(
            f"{as_of} is in the future: give the catalog's own date (its commit date)",
            key="--as-of",
        )
    committed = repository_date(path)
    if committed and when > (price_date(committed) or when):
        return committed, (
            f"--as-of {as_of} is later than the file's commit date {committed} in its git "
            f"repository: rows dated {committed} (an older snapshot does not look newer)"
        )
    return as_of, ""


def _replaces(new: Offer, old: Offer) -> bool:
    """Whether `new` takes `old`'s place as the current price
    (planner.market.hardware.current_prices' rule: same cloud and instance, same region or the old
    row recorded none, not older)."""
    return (
        old.kind == new.kind == "cloud"
        and (old.provider, old.instance) == (new.provider, new.instance)
        and (old.region == new.region or not old.region)
        and (price_date(new.as_of) or dt.date.min) >= (price_date(old.as_of) or dt.date.min)
    )


def change_lines(before: list[Offer], new_rows: list[Offer]) -> list[str]:
    """What an import changes among the current prices: rows added, replaced, unchanged, kept
    because newer, and every price move above MOVE_THRESHOLD with old and new price and date."""
    added = replaced = same = kept = 0
    moves = []
    for n in new_rows:
        rivals = [
            o
            for o in before
            if (o.provider, o.instance) == (n.provider, n.instance)
            and o.kind == "cloud"
            and (o.region == n.region or not o.region)
        ]
        if not rivals:
            added += 1
            continue
        for o in rivals:
            if not _replaces(n, o):
                kept += 1
                continue
            if (o.on_demand_per_hour, o.spot_per_hour) == (n.on_demand_per_hour, n.spot_per_hour):
                same += 1
                continue
            replaced += 1
            for label, a, b in (
                ("on-demand", o.on_demand_per_hour, n.on_demand_per_hour),
                ("spot", o.spot_per_hour, n.spot_per_hour),
            ):
                if a > 0 and b > 0 and abs(b / a - 1) > MOVE_THRESHOLD:
                    moves.append(
                        f"  {n.key} {n.region or ''} {label}: {a:g} ({o.as_of or 'undated'}, "
                        f"{o.region or 'no region'}) -> {b:g} ({n.as_of}) {b / a - 1:+.0%} "
                        f"{n.currency}/node-hour"
                    )
                elif a > 0 and not b:
                    moves.append(
                        f"  {n.key} {n.region or ''} {label}: {a:g} ({o.as_of or 'undated'}) "
                        f"-> none in the catalog ({n.as_of})"
                    )
    lines = [
        f"changes: {added} row(s) added, {replaced} replaced, {same} unchanged, {kept} kept "
        "(the current row is dated later)"
    ]
    if moves:
        lines.append(
            f"price moves above {MOVE_THRESHOLD:.0%} (old price and date -> new; if this "
            "catalog is older than the old row, re-import with its own date as --as-of):"
        )
        lines += moves
    return lines


def import_catalog(
    path: Path,
    *,
    name: str | None = None,
    provider: str | None = None,
    as_of: str | None = None,
    directory: Path | None = None,
    changes: list[str] | None = None,
) -> tuple[Path, int, list[str], list[str]]:
    """Import a catalog into the price list `name`; returns (file written, rows, skipped
    lines, warnings); `changes` (if given) receives what the import changes. Rows of the list
    with the same key and an older date go to history; an identical row re-imported is
    unchanged, not history. Both files are written after everything is read and checked."""
    from planner.market.hardware import _load_offer, all_price_rows

    path = Path(path)
    as_of, date_note = _catalog_date(path, as_of)
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
            f"no usable row ({sum(int(s.split()[0]) for s in skipped)} skipped"
            + (f"; {'; '.join(skipped[:3])}" if skipped else "")
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
        # the current prices before the import: shipped rows and every price list (a folder given
        # for the imports alone, without profiles, is compared with the shipped profiles' rows)
        folder = Path(directory) if directory is not None else None
        has_profiles = folder is not None and any(folder.glob("*.toml"))
        _, everything = all_price_rows(
            folder if folder is not None and has_profiles else PROFILE_DIR
        )
        if directory is not None and not has_profiles:
            everything += [_load_offer(t, file=str(out), index=i) for i, t in enumerate(old)]
        before, _ = current_prices(everything)
        # one current row per key: the newer of the old and the new row (the new one on a tie);
        # an old row equal to its new one is simply the same row (not history)
        rows = [_load_offer(t, file=str(out), index=i) for i, t in enumerate(old)]
        new_rows = [_load_offer(o, file=str(path), index=i) for i, o in enumerate(offers)]
        fresh = {dataclasses.astuple(o) for o in new_rows}
        pairs = [
            (t, o) for t, o in zip(old, rows, strict=True) if dataclasses.astuple(o) not in fresh
        ] + list(zip(offers, new_rows, strict=True))
        current, _ = current_prices([o for _, o in pairs])
        keep = {id(o) for o in current}
        tables = [t for t, o in pairs if id(o) in keep]
        gone = [t for t, o in pairs if id(o) not in keep]
        header = (
            f"# Written by 'planner prices import' ({path.name}, prices as of {as_of}). "
            "One row per\n"
            "# (cloud, instance, region); older rows of a key are in history/. Network "
            "figures from\n"
            "# hardware_profiles/instances/facts.toml; inter_node_gbits_per_s = 0 means no "
            "facts: the\n"
            "# instance is planned single-node.\n"
        )
        history_text = ""
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
            history_text = (
                "# Price rows replaced by newer imports of the same key (planner prices history).\n"
                + tomli_w.dumps({"offers": past + gone})
            )
        text = header + tomli_w.dumps({"offers": tables})
        if history_text:
            write_text_atomic(history_file, history_text)
        write_text_atomic(out, text)
        if changes is not None:
            changes += [date_note] if date_note else []
            changes += change_lines(before, new_rows)
        return out, len(offers), skipped, import_warnings(offers) + _row_notes(offers)


def _row_notes(offers: list[dict]) -> list[str]:
    """Rows a user should know about: spot-only rows (never free) and placeholder spot prices."""
    notes = []
    spot_only = [o for o in offers if not o["on_demand_per_hour"]]
    if spot_only:
        keys = sorted({f"{o['provider']}/{o['instance']}" for o in spot_only})
        notes.append(
            f"{len(spot_only)} row(s) have no on-demand price in the catalog ({', '.join(keys)}; "
            "capacity blocks or not sold on-demand): imported spot-only, never planned on-demand"
        )
    for o in offers:
        if o["price_flag"]:
            notes.append(
                f"{o['provider']}/{o['instance']} {o['region']}: placeholder spot price "
                f"flagged ({o['price_flag']}); kept out of the headline like an outlier"
            )
    return notes


def price_history(instance: str, directory: Path | None = None) -> list[dict]:
    """Every price row of an instance ('p4de.24xlarge' or 'aws/p4de.24xlarge'), newest first:
    the current ones, those a newer row replaced, and those kept under history/."""
    from planner.market.hardware import _load_offer, all_price_rows

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
                if newer is None and not any(o is p for p in past)
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
