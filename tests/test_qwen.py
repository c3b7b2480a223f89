"""QWen (Qwen 1) through PaddleNLP 2.8.1's QWenForCausalLM (gptplan/families/qwen.py): exact
parameter counts pinned to the published ones, the model the runner builds, the rules a QWen
plan follows and the example spec. Its training, kill -9 and resume, export and reload run in
the end-to-end files (test_train_e2e.py, test_export.py: the shared 'qwen-dp2' run)."""

from __future__ import annotations

import pytest
from conftest import BASE_PLAN, QWEN, REPO, merge

from gptplan.errors import PlanError
from gptplan.memory import ModelShape, activation_coefficients
from gptplan.modelfacts import PUBLISHED_PARAMETERS, parameter_count, size_fields
from gptplan.plan import ModelSection, plan_from_dict

QWEN_PLAN = merge(BASE_PLAN, QWEN)


def section(name: str) -> ModelSection:
    return ModelSection(name=name, **size_fields(name))


@pytest.mark.parametrize("name", ["qwen-7b", "qwen-14b"])
def test_qwen_sizes_match_the_published_parameter_counts(name):
    assert parameter_count(section(name)) == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.005)


def test_qwen_7b_count_is_the_exact_sum_of_its_tensors():
    """Qwen-7B's config.json shape: 32 layers of c_attn 4096x12288 + 12288 bias, c_proj
    4096x4096, w1/w2/c_proj 4096x11008 each, two RMSNorms; ln_f; wte and lm_head 151936x4096."""
    h, branch, V = 4096, 11008, 151936
    layer = h * 3 * h + 3 * h + h * h + 3 * h * branch + 2 * h
    assert parameter_count(section("qwen-7b")) == 32 * layer + h + 2 * V * h == 7_721_324_544


def test_runner_builds_qwen_with_its_config_names_and_the_exact_count():
    from runner.model import build_config, build_model

    plan = plan_from_dict(QWEN_PLAN)
    config = build_config(plan.model, plan.parallel, seq_len=32)
    assert type(config).__name__ == "QWenConfig"
    assert (config.kv_channels, config.intermediate_size) == (16, 352)
    assert (config.layer_norm_epsilon, config.rotary_emb_base) == (1e-6, 10000.0)
    assert not config.tie_word_embeddings and config.no_bias
    net = build_model(plan.model, plan.parallel, seq_len=32)
    assert type(net).__name__ == "QWenForCausalLM"
    assert list(net.qwen.h[0].mlp.w1.weight.shape) == [64, 176]  # one branch: 352 / 2
    assert sum(int(p.numel()) for p in net.parameters()) == parameter_count(plan.model)


def test_qwen_memory_and_gemms_use_the_branch_width():
    qwen = section("qwen-7b")
    shape = ModelShape.from_section(qwen)
    assert (shape.ffn, shape.gated, shape.kv_heads) == (11008, True, 32)
    llama_like = ModelSection(**{**size_fields("llama-7b"), "intermediate_size": 11008})
    assert activation_coefficients(qwen) == activation_coefficients(llama_like)


@pytest.mark.parametrize(
    "overrides,key,words",
    [
        ({"parallel": {"recompute": "full_attn"}}, "parallel.recompute", "allowed for family"),
        (
            {"parallel": {"recompute": "full", "recompute_layers": 1}},
            "parallel.recompute_layers",
            "QWen has no per-layer recompute",
        ),
        ({"model": {"tie_word_embeddings": True}}, "model.tie_word_embeddings", "never ties"),
        ({"model": {"num_key_value_heads": 2}}, "model.num_key_value_heads", "Llama field"),
        ({"model": {"intermediate_size": 351}}, "model.intermediate_size", "is odd"),
    ],
    ids=["full_attn", "partial-recompute", "tied-head", "gqa", "odd-ffn"],
)
def test_bad_qwen_plan_is_one_line_naming_the_key(overrides, key, words):
    with pytest.raises(PlanError) as info:
        plan_from_dict(merge(QWEN_PLAN, overrides), file="plan.toml")
    message = str(info.value)
    assert message.startswith(f"plan.toml: {key}:") and words in message, message
    assert "\n" not in message


def test_qwen_recompute_choices_the_search_offers():
    """Partial recompute is never offered for QWen (no no_recompute_layers in 2.8.1)."""
    import numpy as np
    from conftest import LLAMA

    from planner.screen.evaluate import partial_recompute_rows

    def rows(plan: dict) -> list[int]:
        g = {"tp": np.array([1, 1]), "pp": np.array([1, 1]), "recompute_code": np.array([1, 3])}
        m = plan_from_dict(plan).model
        return list(partial_recompute_rows(m, None, g, 0.9, [1])["rc_layers"])

    assert rows(merge(BASE_PLAN, LLAMA)) == [1, 1]  # Llama: one recomputed layer offered
    assert rows(QWEN_PLAN) == []


def test_the_example_qwen_spec_loads_as_a_qwen_model_without_dropout():
    from planner.spec import load_spec

    spec = load_spec(str(REPO / "planner" / "specs" / "qwen_zh.toml"))
    m = spec.model_section()
    assert (m.family, m.name, m.hidden_size, m.intermediate_size) == (
        "qwen",
        "qwen-1.8b",
        2048,
        11008,
    )
    assert m.hidden_dropout_prob == m.attention_probs_dropout_prob == 0.0


@pytest.mark.e2e
def test_qwen_probe_trains_one_process(write_plan, tmp_path):
    """The planner's probe (runner.probe: real steps on synthetic data, one CPU process)."""
    import json

    from conftest import run_cli

    out = tmp_path / "probe.json"
    plan = write_plan(QWEN)
    proc = run_cli(
        "runner.probe", "--plan", str(plan), "--out", str(out), "--steps", "2", "--warmup", "1"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and len(result["step_times_s"]) == 3
    assert result["tokens_per_step"] == 4 * 2 * 32 and result["peak_memory_gb"] > 0


@pytest.mark.e2e
def test_qwen_plan_is_estimated_with_its_exact_count(write_plan):
    """`planner estimate --plan` of a QWen plan on an A100 offer: the family and exact count
    reach the planner's output (the plan's own vocabulary, exactly)."""
    import json

    from conftest import run_cli
    from test_families import ON_A100

    plan = write_plan(merge(QWEN, ON_A100))
    proc = run_cli("planner", "estimate", "--plan", str(plan), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    model = plan_from_dict(merge(QWEN_PLAN, ON_A100)).model
    assert data["model_family"] == "qwen"
    assert data["model_parameters"] == parameter_count(model)
