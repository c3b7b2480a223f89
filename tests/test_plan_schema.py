"""The plan schema: strict loading, cross-field rules, atomic round-trip."""

from __future__ import annotations

import dataclasses

import pytest
import tomli_w
from conftest import BASE_PLAN, REPO, merge, run_cli

from gptplan.errors import PlanError
from gptplan.plan import Plan, load_plan, plan_from_dict, write_plan

# (id, overrides applied to BASE_PLAN, dotted key the error must name, a word it must contain)
BAD_PLANS = [
    ("unknown-top-key", {"trainig": {}}, "trainig", "did you mean 'training'"),
    ("unknown-section-key", {"training": {"micro_batch": 4}}, "training.micro_batch", "unknown"),
    ("wrong-schema", {"schema": 2}, "schema", "supported"),
    ("bad-name", {"name": "my plan!"}, "name", "letters"),
    ("string-for-int", {"training": {"seq_len": "64"}}, "training.seq_len", "integer"),
    ("bool-for-int", {"parallel": {"nproc_per_node": True}}, "parallel.nproc_per_node", "integer"),
    ("negative", {"training": {"max_steps": -1}}, "training.max_steps", ">= 1"),
    ("bad-choice", {"training": {"precision": "fp8"}}, "training.precision", "'bf16'"),
    (
        "bad-recompute",
        {"parallel": {"recompute": "selective"}},
        "parallel.recompute",
        "'core_attn'",
    ),
    (
        "heads-not-dividing-hidden",
        {"model": {"num_attention_heads": 5}},
        "model.num_attention_heads",
        "does not divide",
    ),
    (
        "tp-not-dividing-heads",
        {
            "model": {"num_attention_heads": 4},
            "parallel": {"nproc_per_node": 3, "tensor_parallel_degree": 3},
            "hardware": {"device": "gpu"},
        },
        "parallel.tensor_parallel_degree",
        "does not divide",
    ),
    (
        "pp-more-stages-than-layers",
        {
            "model": {"num_hidden_layers": 1},
            "parallel": {"nproc_per_node": 2, "pipeline_parallel_degree": 2},
            "hardware": {"device": "gpu"},
        },
        "parallel.pipeline_parallel_degree",
        "every stage needs a layer",
    ),
    (
        "world-size-mismatch",
        {"parallel": {"nproc_per_node": 2, "data_parallel_degree": 1}},
        "parallel.data_parallel_degree",
        "must equal",
    ),
    (
        "bf16-unsupported",
        {"training": {"precision": "bf16"}, "hardware": {"precisions": ["fp32", "fp16"]}},
        "training.precision",
        "not supported",
    ),
    (
        "sp-without-tp",
        {"parallel": {"sequence_parallel": True}},
        "parallel.sequence_parallel",
        "tensor_parallel_degree > 1",
    ),
    (
        "pp-with-stage2",
        {
            "parallel": {
                "nproc_per_node": 4,
                "pipeline_parallel_degree": 2,
                "sharding": "stage2",
                "sharding_parallel_degree": 2,
            },
            "training": {"gradient_accumulation_steps": 2},
            "hardware": {"device": "gpu"},
        },
        "parallel.sharding",
        "pipeline",
    ),
    (
        "sharding-degree-without-stage",
        {
            "parallel": {"nproc_per_node": 2, "sharding_parallel_degree": 2},
            "hardware": {"device": "gpu"},
        },
        "parallel.sharding_parallel_degree",
        "stage",
    ),
    (
        "tp-on-cpu",
        {"parallel": {"nproc_per_node": 2, "tensor_parallel_degree": 2}},
        "hardware.device",
        "data parallel and sharding stage1 only",
    ),
    (
        "seq-longer-than-positions",
        {"training": {"seq_len": 128}},
        "training.seq_len",
        "max_position_embeddings",
    ),
    (
        "currency-mix",
        {"budget": {"max_cost": 10.0, "currency": "CNY"}},
        "budget.currency",
        "never mix",
    ),
    ("o2-with-fp32", {"training": {"fp16_opt_level": "O2"}}, "training.fp16_opt_level", "O1"),
    (
        "too-few-steps-for-target",
        {"job": {"target_tokens": 10**9}},
        "training.max_steps",
        "max_steps >=",
    ),
    ("alert-out-of-range", {"budget": {"alert_at": 1.5}}, "budget.alert_at", "<= 1"),
    ("section-not-table", {"training": 3}, "training", "table"),
    (
        "warmup-longer-than-run",
        {"training": {"warmup_steps": 100}},
        "training.warmup_steps",
        "max_steps",
    ),
]


@pytest.mark.parametrize(
    "overrides,key,word", [b[1:] for b in BAD_PLANS], ids=[b[0] for b in BAD_PLANS]
)
def test_bad_plan_is_rejected_naming_the_key(overrides, key, word):
    with pytest.raises(PlanError) as info:
        plan_from_dict(merge(BASE_PLAN, overrides), file="bad.toml")
    message = str(info.value)
    assert message.startswith("bad.toml: "), message
    assert f" {key}: " in f" {message}" or f": {key}:" in message, message
    assert word in message, message


def test_base_plan_is_valid():
    plan = plan_from_dict(BASE_PLAN)
    assert plan.global_batch_size == 4 * 2 * 1
    assert plan.tokens_per_step == 8 * 32


def test_round_trip_is_unchanged(tmp_path):
    plan = plan_from_dict(BASE_PLAN)
    path = tmp_path / "p.toml"
    write_plan(plan, path)
    again = load_plan(path)
    assert again == plan
    assert again.to_dict() == plan.to_dict()


def test_write_is_atomic_and_validates(tmp_path):
    """An invalid plan is never written, and an existing file is left untouched."""
    path = tmp_path / "p.toml"
    good = plan_from_dict(BASE_PLAN)
    write_plan(good, path)
    before = path.read_bytes()
    bad = dataclasses.replace(good, training=dataclasses.replace(good.training, seq_len=999))
    with pytest.raises(PlanError):
        write_plan(bad, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.toml"]  # no temp file left behind


def test_fingerprint_ignores_budget_but_not_batch():
    plan = plan_from_dict(BASE_PLAN)
    richer = plan_from_dict(merge(BASE_PLAN, {"budget": {"max_cost": 5.0}}))
    bigger = plan_from_dict(merge(BASE_PLAN, {"training": {"per_device_train_batch_size": 8}}))
    assert plan.fingerprint() == richer.fingerprint()
    assert plan.fingerprint() != bigger.fingerprint()


SHIPPED_PLANS = sorted(
    p for p in (REPO / "plans").glob("*.toml") if not p.name.endswith(".spec.toml")
)


@pytest.mark.parametrize("path", SHIPPED_PLANS, ids=lambda p: p.name)
def test_shipped_plans_load(path):
    assert isinstance(load_plan(path), Plan)


@pytest.mark.parametrize(
    "content,word",
    [
        ("schema = 1\nname = 'x'\n[training\n", "malformed TOML"),
        (b"schema = 1\nname = '\xff\xfe'\n", "UTF-8"),
    ],
    ids=["malformed-toml", "not-utf8"],
)
def test_cli_rejects_bad_file_with_one_line_and_status_2(tmp_path, content, word):
    path = tmp_path / "bad.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    proc = run_cli("runner", "execute", str(path), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(path) in lines[0] and word in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_cli_unknown_key_exit_2(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(tomli_w.dumps(merge(BASE_PLAN, {"parallel": {"tp": 2}})))
    proc = run_cli("runner", "execute", str(path), cwd=tmp_path)
    assert proc.returncode == 2
    assert "parallel.tp: unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr


# One plan per layout rule that breaks that rule first (a GPU node of 8 unless it says): the
# plan's validate and the planner's search read the same rule (gptplan.plan.LAYOUT_RULES).
LAYOUT_BREAKS = {
    "ranks fill the devices": {"nproc_per_node": 6, "tensor_parallel_degree": 4},
    "tp divides the model": {"tensor_parallel_degree": 8},
    "pp at most the layers": {"nproc_per_node": 4, "pipeline_parallel_degree": 4},
    "sequence parallel splits b*s": {
        "nproc_per_node": 2,
        "tensor_parallel_degree": 2,
        "sequence_parallel": True,
    },
    "tp inside a node": {"nnodes": 2, "nproc_per_node": 2, "tensor_parallel_degree": 4},
    "interleave": {"nproc_per_node": 2, "pipeline_parallel_degree": 2, "virtual_pp_degree": 2},
    "pp with sharding stage 1 only": {
        "nproc_per_node": 4,
        "pipeline_parallel_degree": 2,
        "sharding": "stage2",
        "sharding_parallel_degree": 2,
    },
    "sharding over more than one rank": {"nproc_per_node": 1, "sharding": "stage1"},
    "pipeline filled": {"nproc_per_node": 2, "pipeline_parallel_degree": 2},
}


@pytest.mark.parametrize("name", sorted(LAYOUT_BREAKS))
def test_a_layout_rule_rejects_the_same_layout_in_the_plan_and_in_the_search(name):
    np = pytest.importorskip("numpy")
    from gptplan.plan import RULES_BY_NAME, layout_columns
    from planner.screen.space import layout_rules

    parallel = {"nproc_per_node": 8} | LAYOUT_BREAKS[name]
    parallel["data_parallel_degree"] = 1
    training = {"seq_len": 31, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    if name == "pp with sharding stage 1 only":
        training["gradient_accumulation_steps"] = 2
    data = merge(
        BASE_PLAN,
        {"parallel": parallel, "training": training, "hardware": {"device": "gpu"}},
    )
    with pytest.raises(PlanError) as info:
        plan_from_dict(data, file="bad.toml")
    rule = RULES_BY_NAME[name]
    assert str(info.value).startswith(f"bad.toml: {rule.key}: ")
    plan = Plan(name="x")
    plan.model, plan.training, plan.parallel = (
        plan_from_dict(BASE_PLAN).model,
        dataclasses.replace(plan.training, **training),
        dataclasses.replace(plan.parallel, **parallel),
    )
    assert str(info.value).endswith(rule.message(plan))
    c = layout_columns(plan)
    row = {k: np.array([c[k]]) for k in ("tp", "pp", "vpp", "stage_code", "micro", "seq", "sp")}
    row |= {"nodes": np.array([plan.parallel.nnodes]), "acc": np.array([c["acc"]])}
    verdicts = layout_rules(plan.model, plan.parallel.nproc_per_node, row)
    assert not verdicts[name][0], verdicts
    assert set(verdicts) == set(RULES_BY_NAME)
