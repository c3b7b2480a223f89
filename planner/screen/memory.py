"""A chosen row's memory in words: its modelled breakdown by term, the layouts that would use
less, its share of the card and the band of the memory model's error ("may fit")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gptplan.memory import (
    GIB,
    TERMS,
    layout_memory_bytes,
)
from gptplan.plan import (
    RECOMPUTE_MODES,
    SHARDING_STAGES,
    tensor_parallel_divides,
)
from planner.market.hardware import Profile
from planner.screen import costmodel as cm
from planner.screen.evaluate import memory_args
from planner.screen.table import CandidateRow


def memory_breakdown(m, prof: Profile, row: Mapping[str, Any], gpus_per_node: int) -> dict:
    """One layout's modelled peak per device, term by term (gptplan.memory.memory_terms), in
    GB, and the single changes that free the most (each re-evaluated with the same terms):
    {"terms": {name: GB}, "total_gb", "changes": [(words, GB freed)] most first}. `row`
    holds the layout columns (a candidate table row)."""
    shape = cm.ModelShape.from_section(m)
    args = memory_args(prof)
    names = (
        "seq micro acc tp pp vpp stage_code shard_degree recompute_code sp flash "
        "precision_code dp rc_layers nodes amp_o1"
    ).split()
    base = {k: np.array([row.get(k, 0)]) for k in names}

    def total(g):
        return float(layout_memory_bytes(shape, g, **args)[0]) / cm.GB

    terms = layout_memory_bytes(shape, base, terms=True, **args)
    now = total(base)
    changes = []
    for words, change in _memory_alternatives(m, row, gpus_per_node):
        g = dict(base) | {k: np.array([v]) for k, v in change.items()}
        changes.append((words, now - total(g)))
    changes.sort(key=lambda c: -c[1])
    return {
        "terms": {k: float(v[0]) / cm.GB for k, v in terms.items()},
        "total_gb": now,
        "changes": [c for c in changes if c[1] > 0],
    }


def _memory_alternatives(m, row: Mapping[str, Any], gpus_per_node: int) -> list[tuple[str, dict]]:
    """memory_breakdown's single changes to a layout row: (words, changed columns)."""
    world = int(row["nodes"]) * gpus_per_node
    batch = int(row["dp"]) * int(row["shard_degree"])
    alts: list[tuple[str, dict]] = []
    stage, code, tp, pp = (int(row[k]) for k in ("stage_code", "recompute_code", "tp", "pp"))
    if batch > 1 and stage < 3 and (pp == 1 or stage < 1):
        alts.append(
            (
                f"sharding {SHARDING_STAGES[stage + 1]} over {batch} ranks",
                {"stage_code": stage + 1, "shard_degree": batch, "dp": 1},
            )
        )
    if code < 3 or int(row.get("rc_layers", 0)):
        alts.append(
            (
                f"recompute {RECOMPUTE_MODES[3]} on every layer",
                {"recompute_code": 3, "rc_layers": 0},
            )
        )
    if tp > 1 and not int(row["sp"]):
        alts.append(("sequence parallel", {"sp": 1}))
    if int(row["micro"]) > 1:
        alts.append(
            (
                f"micro-batch {int(row['micro']) // 2} x accumulation {int(row['acc']) * 2}",
                {"micro": int(row["micro"]) // 2, "acc": int(row["acc"]) * 2},
            )
        )
    if 2 * tp <= gpus_per_node and bool(tensor_parallel_divides(m, 2 * tp)) and batch % 2 == 0:
        alts.append(
            (
                f"tensor parallel {2 * tp}",
                {
                    "tp": 2 * tp,
                    "dp": max(1, int(row["dp"]) // 2) if stage == 0 else int(row["dp"]),
                    "shard_degree": int(row["shard_degree"]) // 2 if stage else 1,
                },
            )
        )
    if (
        2 * pp <= m.num_hidden_layers
        and world % (tp * pp * 2) == 0
        and batch % 2 == 0
        and stage < 2
    ):
        alts.append(
            (
                f"pipeline parallel {2 * pp}",
                {
                    "pp": 2 * pp,
                    "dp": max(1, int(row["dp"]) // 2) if stage == 0 else int(row["dp"]),
                    "shard_degree": int(row["shard_degree"]) // 2 if stage else 1,
                    "acc": max(int(row["acc"]), 2 * pp),
                },
            )
        )
    return alts


def memory_share(row: Mapping[str, Any], prof: Profile) -> tuple[float, float, float]:
    """A layout row's modelled peak per device as a share of the card's physical memory,
    with its band (gptplan.memory.memory_band: each term's worst credible error):
    (point, low, high)."""
    card = prof.memory_gb * GIB if prof.memory_gb else float("nan")
    return tuple(float(row[k]) * 1e9 / card for k in MEMORY_GB_KEYS)  # type: ignore[return-value]


MEMORY_GB_KEYS = ("memory_gb", "memory_low_gb", "memory_high_gb")


def deciding_term(row: Mapping[str, Any]) -> str:
    """The memory term whose error moves the band's top the most (gptplan.memory.TERMS)."""
    return TERMS[int(row["memory_decider"])].replace("_", " ")


def may_fit_note(row: CandidateRow, prof: Profile, memory_headroom: float) -> str:
    """The flag a user sees on a row kept inside the memory model's band."""
    share, lo, hi = memory_share(row, prof)
    return (
        f"may fit (modelled {float(row['memory_gb']) * cm.GB / 2**30:.1f} GiB = {share:.0%} "
        f"of the {prof.memory_gb:g} GiB card, band {lo:.0%}-{hi:.0%} from each term's worst "
        f"credible error, decided by the {deciding_term(row)} term; usable "
        f"{memory_headroom:.0%}): probe it before a long run"
    )
