"""The parallel layout is one type (gptplan.layout.Layout): the probe-cache key changes with
every one of its fields and with the model facts a step depends on; plan, search row and spec
pins translate through it and back (issue 36)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gptplan.layout import FIELDS, Layout
from gptplan.plan import load_plan

REPO = Path(__file__).resolve().parents[1]
BANK = REPO / "plans" / "bank_faq.toml"


def _other(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return {
        "": "stage1",
        "stage1": "stage2",
        "none": "full",
        "full": "core_attn",
        "fp16": "bf16",
        "bf16": "fp16",
        "fp32": "fp16",
        "O1": "O2",
        "O2": "O1",
    }[value]


def test_the_probe_key_changes_with_every_layout_field():
    """Two layouts differing in any one field never share a probe measurement (today
    virtual_pp_degree, recompute_layers and use_flash_attention share one)."""
    from planner.tuning.probes import config_key

    plan = load_plan(BANK)
    base = config_key(plan)
    layout = Layout.from_plan(plan)
    for f in dataclasses.fields(Layout):
        changed = dataclasses.replace(layout, **{f.name: _other(getattr(layout, f.name))})
        fields = changed.plan_fields()
        other = dataclasses.replace(
            plan,
            training=dataclasses.replace(plan.training, **fields["training"]),
            parallel=dataclasses.replace(plan.parallel, **fields["parallel"]),
        )
        assert config_key(other) != base, f.name


@pytest.mark.parametrize(
    "field, value",
    [
        ("family", "llama"),
        ("num_key_value_heads", 4),
        ("tie_word_embeddings", True),
        ("vocab_size", 30001),
        ("hidden_size", 1024),
        ("num_hidden_layers", 13),
        ("num_attention_heads", 16),
        ("intermediate_size", 4096),
    ],
)
def test_the_probe_key_changes_with_the_model(field, value):
    """A later study of another family with the same shapes reads none of the first's."""
    from planner.tuning.probes import config_key

    plan = load_plan(BANK)
    other = dataclasses.replace(plan, model=dataclasses.replace(plan.model, **{field: value}))
    assert config_key(other) != config_key(plan)


def test_plan_row_and_pins_translate_through_the_one_type():
    plan = load_plan(BANK)
    layout = Layout.from_plan(plan)
    fields = layout.plan_fields()
    for f, (section, key, _) in FIELDS.items():
        assert fields[section][key] == getattr(getattr(plan, section), key), f
    row = {
        **{c: v for c, v in layout.search_columns().items()},
        "sharding": layout.sharding,
        "recompute": layout.recompute,
        "precision": layout.precision,
    }
    assert Layout.from_row(row, fp16_opt_level=layout.fp16_opt_level) == layout
    assert layout.tokens_per_step == plan.tokens_per_step
    pins = layout.spec_pins()
    assert pins["search.micro_batch_sizes"] == [plan.training.per_device_train_batch_size]
    assert pins["search.virtual_pp"] == [plan.parallel.virtual_pp_degree]
    assert pins["search.flash_attention"] == plan.training.use_flash_attention
    assert layout.label() == "dp1 stage1x8 flash"
