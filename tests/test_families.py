"""The model-family registry (gptplan/families): a family declared here alone, in the test, is
planned, rehearsed and exported without touching any other module; the registry is the only
place that names a family."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from conftest import BASE_PLAN, REPO, merge, run_cli

from gptplan import families
from gptplan.errors import PlanError
from gptplan.families import ModelSize, llama
from gptplan.modelfacts import parameter_count
from gptplan.plan import plan_from_dict

# A toy family: Llama's PaddleNLP classes under another name, with a named size of its own
# and no per-layer recompute. Subprocesses find it through GPTPLAN_EXTRA_FAMILIES.
TOY = dataclasses.replace(
    llama.SPEC,
    name="toy",
    title="Toy",
    summary="a renamed Llama (tests/test_families.py)",
    sizes={"toy-tiny": ModelSize(4000, 64, 2, 4, 176, 64, "toy", 2)},
    published_parameters={},
    partial_recompute_why_not="the toy family offers no per-layer recompute",
)
TOY_ENV = {families.EXTRA_FAMILIES_ENV: "test_families:TOY", "PYTHONPATH": str(REPO / "tests")}
TOY_PLAN = {
    "model": {
        "name": "toy-tiny",
        "family": "toy",
        "num_key_value_heads": 2,
        "intermediate_size": 176,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    },
    "training": {"learning_rate": 3e-3},
}

# The same plan on a priced cloud offer (`planner estimate --plan` prices a plan's offer)
ON_A100 = {
    "parallel": {"nproc_per_node": 8, "data_parallel_degree": 8},
    "hardware": {
        "profile": "a100-80gb",
        "offer": "azure/Standard_ND96amsr_A100_v4",
        "device": "gpu",
        "precisions": ["fp32", "fp16", "bf16"],
    },
    "training": {"precision": "bf16"},
}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(families._REGISTRY, "toy", TOY)
    return TOY


def test_an_unregistered_family_is_one_line_naming_the_registered_ones():
    with pytest.raises(PlanError) as info:
        plan_from_dict(merge(BASE_PLAN, TOY_PLAN), file="p.toml")
    message = str(info.value)
    assert message.startswith("p.toml: model.family: 'toy' is not a model family; allowed: ")
    assert "'gpt', 'llama', 'qwen'" in message and "\n" not in message


def test_a_registered_family_gets_the_shared_rules(toy):
    plan = plan_from_dict(merge(BASE_PLAN, TOY_PLAN))
    assert parameter_count(plan.model) == parameter_count(
        dataclasses.replace(plan.model, family="llama")
    )
    partial = {"parallel": {"recompute": "full", "recompute_layers": 1}}
    with pytest.raises(PlanError) as info:  # the family's own rule, through the registry
        plan_from_dict(merge(BASE_PLAN, merge(TOY_PLAN, partial)), file="p.toml")
    assert str(info.value).startswith("p.toml: parallel.recompute_layers: 1: the toy family")


def test_toy_family_plans_rehearses_and_exports(toy, write_plan, tmp_path):
    """planner estimate, runner execute --local --max-steps 2 and runner export of a family
    that only this test declares (the subprocesses import it via GPTPLAN_EXTRA_FAMILIES)."""
    plan = write_plan(TOY_PLAN)
    on_gpus = write_plan(merge(TOY_PLAN, ON_A100), name="gpu.toml")
    est = run_cli("planner", "estimate", "--plan", str(on_gpus), "--json", env=TOY_ENV)
    assert est.returncode == 0, est.stderr[-2000:]
    data = json.loads(est.stdout)
    assert data["model_family"] == "toy"
    model = plan_from_dict(merge(BASE_PLAN, TOY_PLAN)).model  # the plan's model, exactly
    assert data["model_parameters"] == parameter_count(model)
    run = run_cli(
        "runner", "execute", str(plan), "--local", "--max-steps", "2", cwd=tmp_path, env=TOY_ENV
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    run_dir = next(p for p in tmp_path.iterdir() if p.name.startswith("run.local"))
    from paddlenlp.transformers import AutoModelForCausalLM

    from gptplan.plan import load_plan
    from runner.export import export_pretrained

    out = export_pretrained(load_plan(run_dir / "plan.toml"), run_dir, out_dir=tmp_path / "x")

    model = AutoModelForCausalLM.from_pretrained(str(out))  # Llama's classes, by model_type
    assert type(model).__name__ == "LlamaForCausalLM"


# A family named as a value in data, not a branch: the published runs' held-out regime.
NAMED_AS_DATA = {
    ("planner/screen/published.py", '"llama family": lambda r: r.record.get("family") == "llama",')
}


def test_no_module_outside_the_registry_branches_on_a_family_name():
    """`family ==` / a family's name as a literal only in gptplan/families (issue 28)."""
    found = set()
    for folder in ("gptplan", "runner", "planner"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if "families" in path.parts:
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                if re.search(r'family [!=]=|"(gpt|llama|qwen)"', line):
                    found.add((str(path.relative_to(REPO)), line.strip()))
    assert found == NAMED_AS_DATA
