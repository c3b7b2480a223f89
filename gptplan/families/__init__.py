"""The model-family registry: one FamilySpec per family (gpt.py, llama.py, qwen.py), asked by
the plan schema, the model facts, the memory and step-time model, the planner's search and
the runner's builder and exporter. No other module branches on a family's name.

A family outside this package (a test's toy family, a user's plug-in) registers itself with
`register(spec)`, or is named in the environment variable GPTPLAN_EXTRA_FAMILIES as
`module:attribute` (comma-separated), the attribute a FamilySpec; the registry imports them
the first time a family is looked up, so subprocesses (`runner execute`, `planner estimate`)
see them too.
"""

from __future__ import annotations

import importlib
import os

from gptplan.families import gpt, llama, qwen
from gptplan.families.base import (
    OPTIONAL_FIELDS,
    SHAPE_FIELDS,
    FamilySpec,
    JitPatch,
    ModelLike,
    ModelSize,
    ParallelLike,
)

__all__ = [
    "DEFAULT_FAMILY",
    "EXTRA_FAMILIES_ENV",
    "OPTIONAL_FIELDS",
    "SHAPE_FIELDS",
    "FamilySpec",
    "JitPatch",
    "ModelLike",
    "ModelSize",
    "ParallelLike",
    "all_sizes",
    "by_model_type",
    "get",
    "model_problem",
    "names",
    "register",
    "specs",
]

# The family of a [model] table, a spec or a published run that names none (the schema's
# default since schema 1: plans written before families existed are GPT plans).
DEFAULT_FAMILY = "gpt"
EXTRA_FAMILIES_ENV = "GPTPLAN_EXTRA_FAMILIES"

_REGISTRY: dict[str, FamilySpec] = {s.name: s for s in (gpt.SPEC, llama.SPEC, qwen.SPEC)}
_LOADED_EXTRA: set[str] = set()


def register(spec: FamilySpec) -> None:
    """Add a family (its named sizes must not clash with another family's)."""
    for other in _REGISTRY.values():
        if other.name != spec.name and set(other.sizes) & set(spec.sizes):
            raise ValueError(f"family {spec.name!r} reuses named sizes of {other.name!r}")
    unknown = set(spec.fields) - set(OPTIONAL_FIELDS)
    if unknown:
        raise ValueError(f"family {spec.name!r}: unknown fields {sorted(unknown)}")
    _REGISTRY[spec.name] = spec


def _load_extra() -> None:
    """Import the families named in GPTPLAN_EXTRA_FAMILIES (once each)."""
    for entry in os.environ.get(EXTRA_FAMILIES_ENV, "").split(","):
        entry = entry.strip()
        if not entry or entry in _LOADED_EXTRA:
            continue
        _LOADED_EXTRA.add(entry)
        module, _, attribute = entry.partition(":")
        spec = getattr(importlib.import_module(module), attribute or "SPEC")
        if not isinstance(spec, FamilySpec):
            raise TypeError(f"{EXTRA_FAMILIES_ENV}: {entry} is not a FamilySpec")
        register(spec)


def names(*, extra: bool = True) -> tuple[str, ...]:
    """The registered families, built-in ones first (`extra=False`: without importing the
    GPTPLAN_EXTRA_FAMILIES modules, for module-level tables a plug-in may itself import)."""
    if extra:
        _load_extra()
    return tuple(_REGISTRY)


def specs(*, extra: bool = True) -> tuple[FamilySpec, ...]:
    """The registered FamilySpecs (`extra`: see `names`)."""
    if extra:
        _load_extra()
    return tuple(_REGISTRY.values())


def get(name: str) -> FamilySpec:
    """The family `name` (KeyError for an unknown one: the plan and spec readers check names
    first, so users see one line naming the allowed families)."""
    _load_extra()
    return _REGISTRY[name]


def by_model_type(model_type: str) -> FamilySpec | None:
    """The family whose PaddleNLP config has `model_type` (an exported model's config.json)."""
    _load_extra()
    return next((s for s in _REGISTRY.values() if s.model_type == model_type), None)


def all_sizes(*, extra: bool = True) -> dict[str, ModelSize]:
    """Every family's named sizes (`extra`: see `names`)."""
    if extra:
        _load_extra()
    return {name: size for s in _REGISTRY.values() for name, size in s.sizes.items()}


def field_owners(name: str) -> list[FamilySpec]:
    return [s for s in _REGISTRY.values() if name in s.fields]


def model_problem(model: ModelLike, tensor_parallel_degree: int = 1) -> tuple[str, str]:
    """(key, message) for a model its family's PaddleNLP 2.8.1 class cannot build, or ('', '')
    when it can. Keys are relative to the [model] table, except 'tensor_parallel'. The family
    must be registered (the caller checks the name)."""
    spec = get(model.family)
    for name, default in OPTIONAL_FIELDS.items():
        if name not in spec.fields and getattr(model, name) != default:
            owners = field_owners(name)
            return name, (
                f"is a {' and '.join(s.title for s in owners)} field; family {spec.name!r} "
                f"does not use it (remove it or set family = {owners[0].name!r})"
            )
    return spec.problem(model, tensor_parallel_degree)
