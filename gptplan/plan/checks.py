"""The plan's cross-field rules, in the order `validate` reports them (PLAN_CHECKS): the
first rule a plan breaks is its error, one line saying which key to fix and how.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gptplan import families
from gptplan import precision as precisions
from gptplan.errors import PlanError
from gptplan.plan.layout import RULES_BY_NAME, layout_columns
from gptplan.plan.schema import (
    EstimateSection,
    ModelSection,
    ParallelSection,
    Plan,
    allowed,
    divisors,
)

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
            f"model.hidden_size = {m.hidden_size}; allowed: {divisors(m.hidden_size)}"
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
# processes (runner.device.support); it runs every layout kind, so _cpu_check allows them.
REHEARSAL_PROFILE = "local-rehearsal-device"


def plain_cpu(device: str, profile: str) -> bool:
    """Paddle's CPU build as it is: data parallel and sharding stage 1 only. A CPU on the
    rehearsal device's profile runs every layout kind (the plan check, the planner's space)."""
    return device == "cpu" and profile != REHEARSAL_PROFILE


def _cpu_check(plan: Plan) -> Problem:
    p = plan.parallel
    model_parallel = p.tensor_parallel_degree > 1 or p.pipeline_parallel_degree > 1
    if plain_cpu(plan.hardware.device, plan.hardware.profile) and (
        model_parallel or p.sharding in ("stage2", "stage3")
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
