"""Instance facts apart from prices, keyed by (cloud, instance): hardware_profiles/instances/.

A catalog price row (SkyPilot's vms.csv) names an instance type and its accelerators but not
the network between instances, the link inside one, or its local disk. Those come from this
file, each with its source and date; `planner prices import` copies them into every imported
row, and an instance with no facts here is imported with a warning and planned single-node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gptplan.tomlconf import from_table, read_toml, setting, table_array
from planner.market.hardware import PROFILE_DIR, ProfileError

FACTS_FILE = "instances/facts.toml"


@dataclass(frozen=True)
class InstanceFacts:
    cloud: str = setting("", "Cloud provider as SkyPilot names it (aws, azure, gcp, lambda, ...).")
    instance: str = setting("", "Instance type.")
    profile: str = setting("", "Hardware profile of its accelerator.")
    gpus: int = setting(1, "Accelerators per instance.", min=1)
    inter_node_gbits_per_s: float = setting(
        0.0, "Network bandwidth for GPU traffic between instances, Gbit/s (0 = not stated).", min=0
    )
    network: str = setting("", "What carries it (EFA, InfiniBand, GPUDirect-TCPX, ...).")
    intra_node_link: str = setting("", "NVSwitch / NVLink / PCIe.")
    local_disk_gb: float = setting(0.0, "Instance-local SSD, GB (0 = none bundled).", min=0)
    source: str = setting("", "Where the figures come from.")
    as_of: str = setting("", "Date of the source as quoted.")

    @property
    def network_source(self) -> str:
        return f"{self.network}; {self.source} (as of {self.as_of or 'undated'})"


@lru_cache(maxsize=4)
def instance_facts(directory: Path = PROFILE_DIR) -> dict[tuple[str, str], InstanceFacts]:
    """(cloud, instance) -> facts; {} when the file is absent."""
    path = Path(directory) / FACTS_FILE
    if not path.exists():
        return {}
    data = read_toml(path, ProfileError)
    out: dict[tuple[str, str], InstanceFacts] = {}
    for i, table in enumerate(table_array(data, "instances", file=str(path), error=ProfileError)):
        facts = from_table(
            InstanceFacts, table, file=str(path), section=f"instances[{i}]", error=ProfileError
        )
        key = (facts.cloud, facts.instance)
        if key in out:
            raise ProfileError(
                f"{facts.cloud}/{facts.instance} is listed twice",
                file=str(path),
                key=f"instances[{i}]",
            )
        out[key] = facts
    return out


def facts_for(cloud: str, instance: str, directory: Path = PROFILE_DIR) -> InstanceFacts | None:
    return instance_facts(Path(directory)).get((cloud, instance))
