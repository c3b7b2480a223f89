"""Data preparation in the plan: hours (and money) to tokenize the full corpus before training.

hours = corpus bytes / (measured bytes per second per core x the node's CPU count). The
throughput per core is measured: by the last preparation on this machine
(`<cache_dir>/prep_throughput.json`, written by runner.prepare) or else by bench/data_prep.py
(hardware_profiles/cpus/node_cpus.toml, with its date). CPU counts per node come from the same
data file (providers' instance pages); the local machine's is read from the OS. Every node
prepares its copy in parallel, so the cluster is billed for those hours if data is prepared on
the rented nodes; scaling with cores is assumed linear (modelled).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gptplan import money
from gptplan.money import SECONDS_PER_HOUR
from gptplan.tomlconf import read_toml
from planner.market.hardware import PROFILE_DIR

NODE_FILE = PROFILE_DIR / "cpus" / "node_cpus.toml"
THROUGHPUT_FILE = "prep_throughput.json"


@dataclass(frozen=True)
class DataPrepEstimate:
    corpus_bytes: float
    bytes_per_second_per_core: float
    throughput_source: str  # where the per-core throughput was measured
    node_cpus: int  # 0 = unknown
    node_cpus_source: str
    hours: float | None  # modelled from the measured throughput; None = CPUs unknown
    cost: float | None  # hours x nodes x node price, in the plan's currency
    currency: str

    def describe(self) -> str:
        if self.hours is None:
            return (
                f"data preparation: {self.corpus_bytes / 1e9:,.3g} GB at "
                f"{self.bytes_per_second_per_core / 1e6:.2f} MB/s per core "
                f"({self.throughput_source}); the node's CPU count is unknown "
                f"({self.node_cpus_source}), so "
                f"{self.corpus_bytes / self.bytes_per_second_per_core / SECONDS_PER_HOUR:,.1f} "
                "core-hours"
            )
        cost = (
            f", {self.cost:,.2f} {self.currency} if prepared on the rented nodes"
            if self.cost is not None
            else ""
        )
        return (
            f"data preparation before training: {self.hours:,.2f} h{cost} (modelled: "
            f"{self.corpus_bytes / 1e9:,.3g} GB / ({self.bytes_per_second_per_core / 1e6:.2f}"
            f" MB/s per core, {self.throughput_source} x {self.node_cpus} CPUs, "
            f"{self.node_cpus_source}))"
        )


def _measured_rate(cache_dir: str, scheme: str) -> tuple[float, str]:
    from gptplan.userdata import read_json_record

    path = Path(cache_dir) / THROUGHPUT_FILE
    data = read_json_record(path, what="measured data-preparation rate") or {}
    entry = data.get(scheme) or (next(iter(data.values())) if data else None)
    if isinstance(entry, dict):
        rate, when = entry.get("bytes_per_second_per_core"), entry.get("measured_at", "")
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and isinstance(when, str):
            if 0 < rate < 1e15:
                return float(rate), f"measured on this machine {when[:10]}"
    table = read_toml(NODE_FILE)["data_preparation"]
    return float(
        table["bytes_per_second_per_core"]
    ), f"measured by bench/data_prep.py, {table['as_of']}"


def node_cpus(provider: str, instance: str) -> tuple[int, str]:
    if provider == "local":
        return os.cpu_count() or 1, "this machine"
    for node in read_toml(NODE_FILE).get("nodes", []):
        if node["provider"] == provider and node["instance"] == instance:
            return int(node["vcpus"]), f"{node['source']}, {node['as_of']}"
    return 0, f"no CPU count for {provider}/{instance} in {NODE_FILE.name}"


def estimate(
    *,
    corpus_bytes: float,
    scheme: str,
    cache_dir: str,
    provider: str,
    instance: str,
    nodes: int,
    price_node_hour: float | None,
    currency: str,
) -> DataPrepEstimate:
    rate, rate_source = _measured_rate(cache_dir, scheme)
    cpus, cpus_source = node_cpus(provider, instance)
    seconds = corpus_bytes / (rate * cpus) if cpus else None
    hours = seconds / SECONDS_PER_HOUR if seconds is not None else None
    cost = None
    if seconds is not None and price_node_hour:
        cost = money.cost(price_per_node_hour=price_node_hour, nodes=nodes, seconds=seconds)
    return DataPrepEstimate(
        corpus_bytes, rate, rate_source, cpus, cpus_source, hours, cost, currency
    )


def for_row(stats, row: Mapping[str, Any], *, cache_dir: str, currency: str) -> DataPrepEstimate:
    """The estimate for a planner candidate row (the chosen plan: planner.screen.table's
    CandidateRow)."""
    offer = row["offer_choice"].offer
    size = stats.declared_bytes or stats.local_bytes
    return estimate(
        corpus_bytes=size,
        scheme=stats.tokenizer_scheme,
        cache_dir=cache_dir,
        provider=offer.provider,
        instance=offer.instance,
        nodes=int(row["nodes"]),
        price_node_hour=float(row["price_node_hour"]),
        currency=currency,
    )


def as_dict(est: DataPrepEstimate) -> dict:
    d = asdict(est)
    d["hours_source"] = "modelled from measured throughput"
    return d


def truncation_line(stats) -> str:
    lost = ", ".join(f"seq {k}: {v:.1%}" for k, v in stats.truncation_loss.items())
    return (
        f"truncation a non-packed pipeline would lose: {lost} of the tokens (documents "
        "longer than seq_len; measured on the sample; the plan packs, losing none)"
    )


def stats_lines(stats, target: float) -> list[str]:
    """What the statistics mean for the plan, before the search: truncation and epochs."""
    from planner.corpus.corpus_stats import epochs_warning

    warning = epochs_warning(stats, target)
    if getattr(stats, "compute_only", False):  # nothing was read: no truncation to report
        return [warning] if warning else []
    return [truncation_line(stats)] + ([warning] if warning else [])


def report(
    stats, target: float, row: Mapping[str, Any] | None, *, cache_dir: str, currency: str
) -> dict:
    """Warnings and data-preparation numbers for optimize: plan notes and JSON."""
    from planner.corpus.corpus_stats import epochs_warning

    warning = epochs_warning(stats, target)
    # compute-only (no corpus named): no data to prepare until one is
    prep = (
        for_row(stats, row, cache_dir=cache_dir, currency=currency)
        if row is not None and not getattr(stats, "compute_only", False)
        else None
    )
    return {
        "notes": [x for x in (prep.describe() if prep else None, warning) if x],
        "json": {
            "warnings": [warning] if warning else [],
            "epochs": stats.epochs_for(target) if stats.total_tokens else None,
            "fresh_equivalent_tokens": _fresh(stats, target),
            "data_preparation": as_dict(prep) if prep else None,
        },
    }


def _fresh(stats, target: float) -> float | None:
    from planner.corpus.corpus_stats import fresh_equivalent_tokens

    epochs = stats.epochs_for(target)
    return fresh_equivalent_tokens(stats.total_tokens, epochs) if epochs != float("inf") else None
