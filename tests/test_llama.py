"""The Llama family (PaddleNLP 2.8.1 LlamaForCausalLM): named sizes against the published
parameter counts, validation lines, the model the runner builds (GQA, kernels, tensor and
sequence parallel, recompute), a training step in one process, and the planner's model facts.
The 1- and 2-process runs, kill and resume, export and generation are family-parametrized in
test_train_e2e.py and test_export.py."""

from __future__ import annotations

import json
import warnings

import pytest
from conftest import BASE_PLAN, LLAMA, REPO, merge, run_cli

from gptplan.errors import PlanError
from gptplan.memory import ModelShape, activation_coefficients
from gptplan.modelfacts import (
    MODEL_SIZES,
    PUBLISHED_PARAMETERS,
    kv_heads,
    parameter_count,
    size_fields,
)
from gptplan.plan import ModelSection, ParallelSection, plan_from_dict

LLAMA_PLAN = merge(BASE_PLAN, LLAMA)
GPU = {"hardware": {"device": "gpu", "precisions": ["fp32", "fp16", "bf16"]}}


def section(name: str) -> ModelSection:
    return ModelSection(name=name, **size_fields(name))


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_named_sizes_match_published_parameter_counts(name):
    assert parameter_count(section(name)) == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.005)


def test_every_llama_size_is_a_valid_plan_model():
    names = [n for n, s in MODEL_SIZES.items() if s.family == "llama"]
    assert {
        "llama-tiny",
        "llama-125m",
        "llama-350m",
        "llama-1b",
        "llama-7b",
        "llama-13b",
        "llama-70b",
        "llama3-8b",
        "llama3-70b",
    } <= set(names)
    for name in names:
        model = section(name)
        plan = plan_from_dict(merge(BASE_PLAN, {"model": {k: v for k, v in vars(model).items()}}))
        assert plan.model.family == "llama" and kv_heads(plan.model) >= 1
    assert "num_key_value_heads" not in size_fields("gpt-tiny")  # GPT sizes stay GPT-only


BAD_PLANS = [
    (
        "kv-not-dividing-heads",
        {"model": {"num_key_value_heads": 3}},
        "model.num_key_value_heads",
        "does not divide num_attention_heads = 4; allowed: 0",
    ),
    (
        "kv-above-heads",
        {"model": {"num_key_value_heads": 8}},
        "model.num_key_value_heads",
        "allowed: 0 (= all heads), 1, 2, 4",
    ),
    (
        "tied-head",
        {"model": {"tie_word_embeddings": True}},
        "model.tie_word_embeddings",
        "never ties",
    ),
    (
        "tp-not-dividing-kv",
        merge(
            GPU,
            {
                "model": {"num_key_value_heads": 2},
                "parallel": {"nproc_per_node": 4, "tensor_parallel_degree": 4},
            },
        ),
        "parallel.tensor_parallel_degree",
        "does not divide the 2 key/value heads",
    ),
]


@pytest.mark.parametrize(
    "overrides,key,words", [b[1:] for b in BAD_PLANS], ids=[b[0] for b in BAD_PLANS]
)
def test_bad_llama_plan_is_one_line_naming_the_key(overrides, key, words):
    with pytest.raises(PlanError) as info:
        plan_from_dict(merge(LLAMA_PLAN, overrides), file="plan.toml")
    message = str(info.value)
    assert message.startswith(f"plan.toml: {key}:") and words in message, message
    assert "\n" not in message


def test_gpt_refuses_llama_only_fields():
    with pytest.raises(PlanError) as info:
        plan_from_dict(merge(BASE_PLAN, {"model": {"rope_theta": 500000.0}}), file="p.toml")
    assert str(info.value).startswith("p.toml: model.rope_theta: is a Llama and QWen field")


def test_tp_dividing_the_kv_heads_is_accepted():
    plan = plan_from_dict(
        merge(
            LLAMA_PLAN, merge(GPU, {"parallel": {"nproc_per_node": 2, "tensor_parallel_degree": 2}})
        )
    )
    assert plan.parallel.tensor_parallel_degree == 2


def test_cli_refuses_bad_llama_plan_with_one_line_and_status_2(tmp_path):
    import tomli_w

    path = tmp_path / "plan.toml"
    path.write_text(tomli_w.dumps(merge(LLAMA_PLAN, {"model": {"num_key_value_heads": 3}})))
    proc = run_cli("runner", "execute", str(path), "--dry-run", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.num_key_value_heads" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_spec_validates_the_llama_fields():
    import tomli

    from planner.spec import SpecError, spec_from_dict

    spec = tomli.loads((REPO / "planner" / "specs" / "llama_zh.toml").read_text())
    model = spec_from_dict(spec, file="s.toml").model_section()
    assert (model.family, model.name, model.hidden_dropout_prob) == ("llama", "llama-125m", 0)
    with pytest.raises(SpecError) as info:
        spec_from_dict(merge(spec, {"model": {"num_key_value_heads": 5}}), file="s.toml")
    assert str(info.value).startswith("s.toml: model.num_key_value_heads:")
    with pytest.raises(SpecError) as info:
        spec_from_dict(merge(spec, {"model": {"family": "mamba"}}), file="s.toml")
    assert "allowed: 'gpt', 'llama'" in str(info.value)


def test_activation_memory_follows_the_family():
    gpt = ModelShape.from_section(section("gpt-tiny"))
    assert (gpt.act_replicated, gpt.act_split, gpt.act_scores) == (10, 24, 5)  # [K22]
    llama = section("llama-7b")
    rep, split, scores, kept_rep, kept_split = activation_coefficients(llama)
    mlp = 8 * 11008 / 4096  # gate, up, SiLU(gate), product: 2·f/h each
    # the softmax: 2 units (4 bytes in fp32, measured on the rehearsal device); in 16-bit
    # training the family's softmax_fp32 adds its fp32 output and the 16-bit cast (6 bytes)
    assert (rep, split, scores) == (8, 8 + mlp, 2) and kept_split == 2 + mlp
    shape = ModelShape.from_section(llama)
    assert shape.softmax_fp32 == 1.0 and shape.unfused_split == 5.0


# ---- the model the runner builds -------------------------------------------------------------


def test_runner_builds_llama_with_gqa_and_exact_parameter_count():
    from runner.model import build_model

    model = section("llama-tiny")
    net = build_model(model, ParallelSection(), seq_len=32)
    assert type(net).__name__ == "LlamaForCausalLM"
    assert sum(int(p.numel()) for p in net.parameters()) == parameter_count(model)
    attn = net.llama.layers[0].self_attn
    head_dim = model.hidden_size // model.num_attention_heads
    assert net.config.num_key_value_heads == 2
    assert list(attn.k_proj.weight.shape) == [128, 2 * head_dim]  # 2 of 4 heads
    assert list(attn.q_proj.weight.shape) == [128, 128]


def test_llama_config_for_tensor_sequence_parallel_and_recompute():
    from runner.model import build_config

    model = section("llama-1b")
    parallel = ParallelSection(
        nproc_per_node=4, tensor_parallel_degree=4, sequence_parallel=True, recompute="full_attn"
    )
    config = build_config(model, parallel, seq_len=2048)
    assert (config.tensor_parallel_degree, config.num_key_value_heads) == (4, 4)
    assert config.sequence_parallel and config.use_recompute
    assert config.recompute_granularity == "full_attn"
    assert (config.rms_norm_eps, config.rope_theta) == (1e-5, 10000.0)
    assert not config.tie_word_embeddings and config.ignore_index == -100
    plain = build_config(model, ParallelSection(), seq_len=2048)
    assert not plain.use_recompute and not plain.sequence_parallel


def test_kernels_on_this_cpu_fall_back_to_the_standard_ones():
    from runner.model import build_model, kernel_choice

    model = section("llama-tiny")
    assert kernel_choice(model, use_flash_attention=True, precision="bf16") == {
        "flash_attention": False,
        "fused_rms_norm": False,
        "fused_rope": False,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net = build_model(
            model, ParallelSection(), seq_len=32, use_flash_attention=True, precision="bf16"
        )
    assert any("cannot run it" in str(w.message) for w in caught)
    assert not net.config.use_flash_attention and not net.config.use_fused_rms_norm


def test_one_training_step_through_the_runner_lowers_the_loss():
    import paddle

    from runner.train import build_training_state

    plan = plan_from_dict(merge(LLAMA_PLAN, {"parallel": {"recompute": "full"}}))
    paddle.set_device("cpu")
    model, optimizer, _ = build_training_state(plan)
    paddle.seed(0)
    ids = paddle.randint(0, 200, [4, 33])  # a small id range: learnable in a few steps
    losses = []
    for _ in range(4):
        loss, logits = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        losses.append(float(loss))
    assert list(logits.shape) == [4, 32, 4000]
    assert losses[-1] < losses[0] - 0.05, losses


def test_fleet_strategy_for_llama_tp_pp_layout_is_gpts():
    from runner.parallel import strategy_settings

    layout = merge(
        GPU,
        {
            "model": {"num_hidden_layers": 4, "num_key_value_heads": 2},
            "parallel": {
                "nnodes": 2,
                "nproc_per_node": 8,
                "data_parallel_degree": 4,
                "tensor_parallel_degree": 2,
                "pipeline_parallel_degree": 2,
                "sequence_parallel": True,
                "recompute": "full",
            },
            "training": {"gradient_accumulation_steps": 4},
        },
    )
    llama = strategy_settings(plan_from_dict(merge(LLAMA_PLAN, layout)))
    gpt_layout = merge(layout, {"model": {"num_key_value_heads": 0}})
    gpt = strategy_settings(plan_from_dict(merge(BASE_PLAN, gpt_layout)))
    assert llama == gpt
    assert llama["hybrid_configs"]["mp_degree"] == 2 and llama["hybrid_configs"]["pp_degree"] == 2


# ---- the planner ----------------------------------------------------------------------------


def test_planner_search_keeps_tp_within_the_kv_heads():
    import tomli

    from planner.pipeline import optimize
    from planner.spec import spec_from_dict

    data = tomli.loads((REPO / "planner" / "specs" / "llama_zh.toml").read_text())
    data = merge(
        data,
        {
            "model": {"size": "llama-1b", "num_key_value_heads": 2},
            "constraints": {"profiles": ["a100-80gb"], "seq_lens": [2048]},
            "search": {"tensor_parallel": [1, 2, 4, 8]},
        },
    )
    result = optimize(spec_from_dict(data, file="s.toml"))
    assert len(result.table) and set(result.table["tp"]) <= {1, 2}


def test_estimate_json_names_the_family_parameters_and_flops(tmp_path):
    """The plan's own model is estimated, also an unnamed one whose spec is gone (it used to
    fall back to the embedded bank-FAQ spec's GPT)."""
    text = (REPO / "plans" / "llama_zh.toml").read_text()
    for old, new in (
        ('spec = "planner/specs/llama_zh.toml"', 'spec = "gone.toml"'),
        ('name = "llama-125m"', 'name = "my-llama"'),
        ("num_key_value_heads = 0", "num_key_value_heads = 4"),
    ):
        assert old in text
        text = text.replace(old, new)
    plan = tmp_path / "llama_zh.toml"
    plan.write_text(text)
    proc = run_cli("planner", "estimate", "--plan", str(plan), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    model = ModelSection(**{**size_fields("llama-125m"), "num_key_value_heads": 4})
    assert data["model_family"] == "llama"
    assert data["model_parameters"] == parameter_count(model) == 134_105_856 - 12 * 2 * 768 * 512
    from gptplan.modelfacts import training_flops_per_token

    assert data["model_flops_per_token"] == pytest.approx(
        training_flops_per_token(model, data["model_flops_per_token_seq_len"])
    )
