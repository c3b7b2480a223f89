"""The plan TOML (schema 1): the only contract between planner and runner.

- `gptplan.plan.schema`: one dataclass per TOML table (every key typed, defaulted and
  documented where it is declared), the vocabularies (precisions, recompute modes, sharding
  stages) and the quantities derived from a plan (global batch, tokens per step, fingerprint).
- `gptplan.plan.layout`: the parallel layout's rules, written once for a plan and for the
  planner's candidate table (the layout type itself is gptplan.layout.Layout).
- `gptplan.plan.checks`: the cross-field rules `validate` applies, in the order it reports them.
- `gptplan.plan.io`: `load_plan` (strict: unknown keys, types, choices, ranges, then the rules)
  and `write_plan` (checked with the loading code, then written atomically).

Every name is re-exported here: import from `gptplan.plan`. The package imports nothing from
the rest of the project except the model families, the precision table, the error types, the
TOML helpers and (inside functions) gptplan.layout and gptplan.modelfacts.
"""

from gptplan.plan.checks import (
    INTERVALS,
    OK,
    PLAN_CHECKS,
    REHEARSAL_PROFILE,
    UNPRICED_PROVIDERS,
    Problem,
    family_problem,
    interval_problem,
    plain_cpu,
    recompute_layers_problem,
    validate,
)
from gptplan.plan.io import load_plan, plan_from_dict, write_plan
from gptplan.plan.layout import (
    LAYOUT_RULES,
    RULES_BY_NAME,
    LayoutRule,
    layout_columns,
    no_recompute_layers,
    sequence_parallel_fits,
    tensor_parallel_divides,
    tensor_parallel_fits_node,
    virtual_pipeline_fits,
)
from gptplan.plan.schema import (
    MAX_HOURS,
    MAX_LEARNING_RATE,
    MAX_MONEY,
    MAX_PROBES,
    PLANNED_CORPUS_FIELDS,
    PRECISIONS,
    RECOMPUTE_MODES,
    SCHEMA_VERSION,
    SECTIONS,
    SEED_MAX,
    SHARDING_STAGES,
    BudgetSection,
    CheckpointSection,
    Device,
    EstimateSection,
    Family,
    HardwareSection,
    JobSection,
    ModelSection,
    ParallelSection,
    Plan,
    Precision,
    ProvenanceSection,
    Recompute,
    Sharding,
    TrainingSection,
    allowed,
    divisors,
)

__all__ = [
    "INTERVALS",
    "LAYOUT_RULES",
    "MAX_HOURS",
    "MAX_LEARNING_RATE",
    "MAX_MONEY",
    "MAX_PROBES",
    "OK",
    "PLANNED_CORPUS_FIELDS",
    "PLAN_CHECKS",
    "plain_cpu",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "REHEARSAL_PROFILE",
    "RULES_BY_NAME",
    "SCHEMA_VERSION",
    "SECTIONS",
    "SEED_MAX",
    "SHARDING_STAGES",
    "UNPRICED_PROVIDERS",
    "BudgetSection",
    "CheckpointSection",
    "Device",
    "EstimateSection",
    "Family",
    "HardwareSection",
    "JobSection",
    "LayoutRule",
    "ModelSection",
    "ParallelSection",
    "Plan",
    "Precision",
    "Problem",
    "ProvenanceSection",
    "Recompute",
    "Sharding",
    "TrainingSection",
    "allowed",
    "divisors",
    "family_problem",
    "interval_problem",
    "layout_columns",
    "load_plan",
    "no_recompute_layers",
    "plan_from_dict",
    "recompute_layers_problem",
    "sequence_parallel_fits",
    "tensor_parallel_divides",
    "tensor_parallel_fits_node",
    "validate",
    "virtual_pipeline_fits",
    "write_plan",
]
