"""The parallel layout: one type for what the search varies, the plan fixes and the runner runs.

A `Layout` is built from a plan (`from_plan`), from a row of the planner's candidate table
(`from_row`) or from the pins of a spec (`spec_pins` is its inverse), and gives back the
plan's fields (`plan_fields`), the search's columns (`search_columns`), the spec pins that
select exactly it, the probe-cache key (`probe_key`, with the model it runs) and the display
label. Each field has one name here; the translations to the names PaddleNLP gives it in the
plan (`per_device_train_batch_size`, `tensor_parallel_degree`...) and to the search's short
column names (`micro`, `tp`...) live in FIELDS below and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gptplan import precision as precision_table
from gptplan.families import ModelLike
from gptplan.plan.schema import RECOMPUTE_MODES, SHARDING_STAGES, Plan

# What a served probe worker fixes at start-up: device, nodes, devices per node, dp, tp, pp,
# sharding stage and degree, and with pipeline parallel its micro-batch and accumulation
# (Layout.worker_key)
WorkerKey = tuple[str | int, ...]


@dataclass(frozen=True)
class Layout:
    nodes: int = 1
    devices_per_node: int = 1
    dp: int = 1  # data-parallel degree
    tp: int = 1  # tensor-parallel degree
    pp: int = 1  # pipeline-parallel degree
    vpp: int = 1  # virtual pipeline degree (model chunks per stage; > 1 = interleaved)
    sharding: str = ""  # "" | "stage1" | "stage2" | "stage3"
    sharding_degree: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # granularity: gptplan.plan.RECOMPUTE_MODES
    recompute_layers: int = 0  # layers of the model that recompute (0 = all of them)
    micro_batch: int = 1  # sequences per device per micro-step
    accumulation: int = 1  # micro-steps per optimizer step
    seq_len: int = 1024
    precision: str = "fp32"
    fp16_opt_level: str = "O1"
    flash_attention: bool = False

    # ---- built from ... ---------------------------------------------------------------------

    @classmethod
    def from_plan(cls, plan: Plan) -> Layout:
        values = {}
        for f, (section, key, _column) in FIELDS.items():
            if section:
                values[f] = getattr(getattr(plan, section), key)
        return cls(**values)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], *, fp16_opt_level: str = "O2") -> Layout:
        """A row of the planner's candidate table (planner.screen: CandidateTable.row)."""
        precision = str(row["precision"])
        pp = int(row.get("pp", 1))
        return cls(
            nodes=int(row["nodes"]),
            devices_per_node=int(row["gpus_per_node"]),
            dp=int(row["dp"]),
            tp=int(row["tp"]),
            pp=pp,
            vpp=int(row.get("vpp", 1)),
            sharding=str(row["sharding"]),
            sharding_degree=int(row["shard_degree"]),
            sequence_parallel=bool(row["sp"]),
            recompute=str(row["recompute"]),
            recompute_layers=int(row.get("rc_layers", 0)) * pp,  # the column is per stage
            micro_batch=int(row["micro"]),
            accumulation=int(row["acc"]),
            seq_len=int(row["seq"]),
            precision=precision,
            fp16_opt_level=fp16_opt_level if precision_table.row(precision).mixed else "O1",
            flash_attention=bool(row.get("flash", 0)),
        )

    # ---- gives ------------------------------------------------------------------------------

    def plan_fields(self) -> dict[str, dict[str, Any]]:
        """{"training": {...}, "parallel": {...}}: the plan's keys (PaddleNLP's names)."""
        out: dict[str, dict[str, Any]] = {"training": {}, "parallel": {}}
        for f, (section, key, _column) in FIELDS.items():
            out[section][key] = getattr(self, f)
        return out

    def search_columns(self) -> dict[str, Any]:
        """The candidate table's columns of this layout (codes where the table keeps codes)."""
        out: dict[str, Any] = {}
        for f, (_section, _key, column) in FIELDS.items():
            if column:
                out[column] = getattr(self, f)
        out["stage_code"] = SHARDING_STAGES.index(self.sharding)
        out["recompute_code"] = RECOMPUTE_MODES.index(self.recompute)
        out["precision_code"] = precision_table.code(self.precision)
        out["rc_layers"] = self.recompute_layers // max(1, self.pp)
        out["sp"] = int(self.sequence_parallel)
        out["flash"] = int(self.flash_attention)
        return out

    def spec_pins(self) -> dict[str, Any]:
        """The spec overrides ({"search.tensor_parallel": [2], ...}) whose search space is this
        layout alone (with the offer, node count and global batch pinned by the caller)."""
        return {
            "constraints.seq_lens": [self.seq_len],
            "constraints.precisions": [self.precision],
            "constraints.max_nodes": self.nodes,
            "search.node_counts": [self.nodes],
            "search.micro_batch_sizes": [self.micro_batch],
            "search.accumulation_steps": [self.accumulation],
            "search.tensor_parallel": [self.tp],
            "search.pipeline_parallel": [self.pp],
            "search.virtual_pp": [self.vpp],
            "search.sharding": [self.sharding],
            "search.sharding_degrees": [self.sharding_degree] if self.sharding else [],
            "search.recompute": [self.recompute],
            "search.recompute_layers": [self.recompute_layers // max(1, self.pp)],
            "search.sequence_parallel": [self.sequence_parallel],
            "search.flash_attention": self.flash_attention,
            "training.fp16_opt_level": self.fp16_opt_level,
        }

    def worker_key(self, device: str) -> WorkerKey:
        """What a served probe worker fixes at start-up (fleet is initialised once): the
        device and the process layout; with pipeline parallel also the micro-batch and the
        accumulation, which fleet's pipeline_configs fix for every model it wraps after
        (a pp 2 worker started for micro 4 x acc 4 refused micro 8: "batch_size needs to be
        divisible by micro_batch_size")."""
        key: WorkerKey = (
            device,
            self.nodes,
            self.devices_per_node,
            self.dp,
            self.tp,
            self.pp,
            self.sharding,
            self.sharding_degree,
        )
        if self.pp > 1:
            key += (self.micro_batch, self.accumulation)
        return key

    def probe_key(self, model: ModelLike, device: str) -> str:
        """What a probe's measurement depends on: every layout field, the device and the
        model it trains (family, shape, KV heads, tied embeddings). Changing any one changes
        the key (tests/test_layout.py)."""
        parts = [*model_key(model), device, *dataclasses.astuple(self)]
        return "|".join(str(x) for x in parts)

    def label(self) -> str:
        """The layout in a few words: 'dp2 tp2+sp pp4v2 stage1x2 flash'."""
        parts = [f"dp{self.dp}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"v{self.vpp}" if self.vpp > 1 else ""))
        if self.sharding:
            parts.append(f"{self.sharding}x{self.sharding_degree}")
        if self.flash_attention:
            parts.append("flash")
        return " ".join(parts)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.accumulation * self.seq_len * self.dp * self.sharding_degree


# field -> (plan section, plan key, candidate column with the same value or '' where the
# table keeps a code, see search_columns): the one table of names
FIELDS: dict[str, tuple[str, str, str]] = {
    "nodes": ("parallel", "nnodes", "nodes"),
    "devices_per_node": ("parallel", "nproc_per_node", "gpus_per_node"),
    "dp": ("parallel", "data_parallel_degree", "dp"),
    "tp": ("parallel", "tensor_parallel_degree", "tp"),
    "pp": ("parallel", "pipeline_parallel_degree", "pp"),
    "vpp": ("parallel", "virtual_pp_degree", "vpp"),
    "sharding": ("parallel", "sharding", "sharding"),
    "sharding_degree": ("parallel", "sharding_parallel_degree", "shard_degree"),
    "sequence_parallel": ("parallel", "sequence_parallel", ""),
    "recompute": ("parallel", "recompute", "recompute"),
    "recompute_layers": ("parallel", "recompute_layers", ""),
    "micro_batch": ("training", "per_device_train_batch_size", "micro"),
    "accumulation": ("training", "gradient_accumulation_steps", "acc"),
    "seq_len": ("training", "seq_len", "seq"),
    "precision": ("training", "precision", "precision"),
    "fp16_opt_level": ("training", "fp16_opt_level", ""),
    "flash_attention": ("training", "use_flash_attention", ""),
}
assert set(FIELDS) == {f.name for f in dataclasses.fields(Layout)}


def model_key(model: ModelLike) -> tuple[str, int, int, int, int, int, int, bool]:
    """The model facts a measured step depends on (a plan's [model] section)."""
    from gptplan.modelfacts import kv_heads

    return (
        model.family,
        model.vocab_size,
        model.hidden_size,
        model.num_hidden_layers,
        model.num_attention_heads,
        kv_heads(model),
        model.intermediate_size,
        bool(getattr(model, "tie_word_embeddings", False)),
    )
