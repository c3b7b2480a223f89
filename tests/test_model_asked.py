"""The model priced is the model asked for (issue 36): the vocabulary kept, compute-only specs,
the statistics cache key, precision chosen by risk as well as cost, `estimate --plan` that
reproduces the plan, the binding constraint and --currency."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gptplan.modelfacts import parameter_count
from gptplan.plan import load_plan
from planner.commands.main import main as planner_main
from tests.conftest import call_main

REPO = Path(__file__).resolve().parents[1]

# Llama-3-8B's published shape (REFERENCES.md section 8): 8,030,261,248 parameters
LLAMA3_8B = """
[job]
name = "llama3_8b"
target_tokens = 15e12

[model]
family = "llama"
vocab_size = 128256
hidden_size = 4096
num_hidden_layers = 32
num_attention_heads = 32
num_key_value_heads = 8
intermediate_size = 14336
max_position_embeddings = 8192

[constraints]
seq_lens = [4096]
profiles = ["a100-80gb", "h100-80gb"]
"""
LLAMA3_8B_PARAMETERS = 8_030_261_248


def _spec(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _optimize_json(tmp_path: Path, spec: Path, *extra: str) -> dict:
    out = tmp_path / "plans" / "out.toml"
    rc, stdout, err = call_main(
        planner_main, ["optimize", "--spec", str(spec), "--json", "--out", str(out), *extra]
    )
    assert rc == 0, err[-5:]
    return json.loads(stdout)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """`planner optimize --json` of the corpus-less Llama-3-8B spec, once: (json, plan)."""
    work = tmp_path_factory.mktemp("llama3")
    data = _optimize_json(work, _spec(work, LLAMA3_8B))
    return data, load_plan(work / "plans" / "out.toml")


def test_a_corpus_less_published_shape_is_priced_as_asked(llama3):
    """No corpus: no tokenizer is trained on a stand-in corpus; the asked 128,256 pieces are
    kept (today: 12,288, the demo corpus's tokenizer, and 7.08e9 parameters)."""
    data, plan = llama3
    tp = plan.parallel.tensor_parallel_degree
    assert plan.model.vocab_size >= 128256 and plan.model.vocab_size - 128256 < tp
    padding = (plan.model.vocab_size - 128256) * 4096 * 2
    assert LLAMA3_8B_PARAMETERS <= data["model_parameters"] <= LLAMA3_8B_PARAMETERS + padding
    assert parameter_count(plan.model) == data["model_parameters"]
    # 128,256 divides every tp the search offers: the published shape is kept exactly
    assert plan.model.vocab_size == 128256 and data["model_changes"] == []


def test_compute_only_reads_no_corpus_and_warns_of_no_epochs(llama3):
    data, plan = llama3
    corpus = data["corpus"]
    assert corpus["compute_only"] and corpus["local_documents"] == 0
    assert corpus["sample_documents"] == 0 and corpus["total_tokens_source"] == "unknown"
    assert data["warnings"] == [] and data["epochs"] is None
    assert plan.job.corpus == [] and plan.job.corpus_tokens == 0


def test_the_runner_refuses_a_compute_only_plan_until_a_corpus_is_named(llama3, tmp_path):
    from runner.cli import main as runner_main

    _, plan = llama3
    from gptplan.plan import write_plan

    path = tmp_path / "compute_only.toml"
    write_plan(plan, path)
    rc, out, err = call_main(runner_main, ["execute", str(path), "--dry-run"])
    assert rc == 2 and len(err) == 1, err
    assert "job.corpus" in err[0] and "compute-only" in err[0]
    assert not (tmp_path / "runs").exists()


def test_compute_only_console_says_so_and_gives_declared_epochs(tmp_path):
    spec = LLAMA3_8B.replace(
        "target_tokens = 15e12",
        "target_tokens = 15e12\ncorpus_bytes = 60e12\ntokens_per_char = 0.25",
    )
    argv = ["optimize", "--spec", str(_spec(tmp_path, spec)), "--out", str(tmp_path / "p.toml")]
    rc, out, err = call_main(planner_main, argv)
    assert rc == 0, err[-5:]
    assert "compute-only planning: no corpus named" in out
    # 60e12 bytes / 1 byte per character x 0.25 tokens per character = 15T tokens: 1 epoch
    assert "corpus 15T tokens (declared" in out and "= 1.00 epochs" in out
    assert "tokens/char" not in out.split("compute-only")[0]


def test_a_compute_only_spec_needs_its_tokens(tmp_path):
    spec = LLAMA3_8B.replace("target_tokens = 15e12", "epochs = 2")
    rc, out, err = call_main(planner_main, ["estimate", "--spec", str(_spec(tmp_path, spec))])
    assert rc == 2 and len(err) == 1 and "job.target_tokens" in err[0], err


def test_a_padded_vocabulary_is_padded_for_the_chosen_tp_only(tmp_path):
    """GPT-2's 50,257 pieces: kept where the plan's tp is 1, padded to the next multiple of
    the chosen tp otherwise (the search prices that tp with the padded model), and the change
    is one line in --json and the plan; `estimate --plan` reproduces the padded plan."""
    from gptplan.tokenizer import padded_vocab

    assert padded_vocab(128256, 8) == 128256 and padded_vocab(151936, 8) == 151936
    assert padded_vocab(50257, 1) == 50257 and padded_vocab(50257, 2) == 50258
    spec = LLAMA3_8B.replace("vocab_size = 128256", "vocab_size = 50257")
    spec += "\n[search]\ntensor_parallel = [2]\n"
    data = _optimize_json(tmp_path, _spec(tmp_path, spec))
    plan = load_plan(tmp_path / "plans" / "out.toml")
    assert plan.parallel.tensor_parallel_degree == 2 and plan.model.vocab_size == 50258
    assert parameter_count(plan.model) == data["model_parameters"]
    (line,) = data["model_changes"]
    assert line.startswith("model.vocab_size 50,257 -> 50,258: padded to a multiple of the plan")
    assert line in plan.provenance.notes and line in data["notes"]
    rc, out, err = call_main(
        planner_main, ["estimate", "--plan", str(tmp_path / "plans" / "out.toml"), "--json"]
    )
    assert rc == 0, err[-5:]
    again = json.loads(out)
    assert again["plan_estimate"]["peak_memory_gb"] == plan.estimate.peak_memory_gb
    assert again["plan_estimate"]["cost"] == plan.estimate.cost


def test_a_sample_that_cannot_train_the_asked_size_keeps_it():
    """The run trains its tokenizer on a declared larger corpus: tokens per character is
    extrapolated and the model keeps the asked vocabulary; the run's tokenizer trained on
    the named corpus itself, short of the asked size: the change is one line."""
    from types import SimpleNamespace

    from planner.pipeline import set_planned_vocab
    from planner.spec import load_spec

    def stats(source, have):
        return SimpleNamespace(
            tokenizer_target_vocab=have,
            tokens_per_character_source=source,
            compute_only=False,
            tokenizer_scheme="cpm",
            tokenizer="cpm:x",
        )

    spec = load_spec(None)  # bank FAQ: gpt-base-110m asks 30,000 pieces
    set_planned_vocab(spec, stats("extrapolated", 30000))
    assert spec.model_section().vocab_size == 30000 and spec.model_changes == []
    set_planned_vocab(spec, stats("declared", 30000))
    assert spec.model_section().vocab_size == 30000 and spec.model_changes == []
    set_planned_vocab(spec, stats("measured", 11940))
    assert spec.model_section().vocab_size == 11940
    assert spec.model_changes == [
        "model.vocab_size 30,000 -> 11,940: the run trains its cpm tokenizer on the named "
        "corpus, which supports 11,940 of the 30,000 asked pieces"
    ]


def test_statistics_cache_key_holds_the_vocabulary(tmp_path):
    """A declared tokens_per_char with 32,000 and then 128,256 pieces in one data directory:
    each priced with its own vocabulary (today both with the first)."""
    from planner.corpus.corpus_stats import corpus_statistics

    corpus = tmp_path / "c.txt"
    corpus.write_text("一个很小的语料。\n第二个文档。\n" * 20, encoding="utf-8")
    common = dict(
        corpus=[str(corpus)],
        tokenizer="sentencepiece",
        cache_dir=str(tmp_path / "cache"),
        sample_documents=10,
        declared_bytes=0.0,
        seq_lens=[64],
        tokens_per_char=0.7,
        log=lambda *a: None,
    )
    first = corpus_statistics(vocab_size=32000, **common)
    second = corpus_statistics(vocab_size=128256, **common)
    assert first.tokenizer_target_vocab == 32000
    assert second.tokenizer_target_vocab == 128256


def test_a_llama_7b_on_a100_chooses_bf16(tmp_path):
    """At equal modelled cost the tie went to fp16 with loss scaling; from 1B parameters
    bf16 is preferred (gptplan.precision, BLOOM/OPT/Gopher)."""
    spec = """
[job]
name = "llama7b"
target_tokens = 1e12

[model]
size = "llama-7b"

[constraints]
seq_lens = [4096]
profiles = ["a100-80gb"]
"""
    data = _optimize_json(tmp_path, _spec(tmp_path, spec))
    assert data["chosen"]["precision"] == "bf16"
    plan = load_plan(tmp_path / "plans" / "out.toml")
    assert plan.training.precision == "bf16"


def test_fp16_is_named_with_its_loss_scaling(tmp_path):
    """A small model keeps fp16 at equal cost; the chosen line says what it implies."""
    rc, out, err = call_main(
        planner_main, ["estimate", "--plan", str(REPO / "plans" / "bank_faq.toml")]
    )
    assert rc == 0, err[-5:]
    chosen = next(line for line in out.splitlines() if line.startswith("chosen: "))
    assert "fp16 with loss scaling" in chosen


def test_estimate_of_the_shipped_plan_is_the_plan(tmp_path):
    """`estimate --plan plans/bank_faq.toml` evaluates exactly the plan's model and layout:
    its parameters and memory are the plan's (today: vocabulary 30,080 against 30,720)."""
    plan = load_plan(REPO / "plans" / "bank_faq.toml")
    rc, out, err = call_main(
        planner_main, ["estimate", "--plan", str(REPO / "plans" / "bank_faq.toml"), "--json"]
    )
    assert rc == 0, err[-5:]
    data = json.loads(out)
    assert data["model_parameters"] == parameter_count(plan.model)
    assert data["plan_estimate"]["peak_memory_gb"] == plan.estimate.peak_memory_gb
    assert data["plan_estimate"]["cost"] == plan.estimate.cost
    assert data["model_changes"] == []


def test_currency_converts_the_budget_or_refuses():
    """--currency EUR on the embedded spec (12,000 CNY): never 12,000 EUR."""
    from planner.spec import load_spec

    rc, out, err = call_main(planner_main, ["optimize", "--currency", "EUR", "--json"])
    assert rc == 2 and len(err) == 1 and "rate for EUR" in err[0], err
    spec = load_spec(None, overrides={"constraints.currency": "EUR", "rates.EUR": 8.0})
    assert spec.constraints.currency == "EUR"
    assert spec.constraints.budget == pytest.approx(1500.0)
    assert spec.budget_conversion.startswith("budget 12,000.00 CNY = 1,500.00 EUR at 8 CNY")
    # a budget given in the new currency is taken as given
    spec = load_spec(None, overrides={"constraints.currency": "EUR", "constraints.budget": 900})
    assert spec.constraints.budget == 900 and not spec.budget_conversion


def test_binding_constraint_is_what_bound_the_next_cheaper_candidate():
    """Device memory only when the next cheaper candidate did not fit."""
    import numpy as np

    from planner.screen.decide import _binding_constraint
    from planner.spec import load_spec

    class Table:
        params_total = 1e8
        offers = []

        def __init__(self, **cols):
            self.cols = {k: np.asarray(v) for k, v in cols.items()}

        def __getitem__(self, k):
            return self.cols[k]

        def __len__(self):
            return len(self.cols["cost"])

    spec = load_spec(None, overrides={"constraints.deadline_hours": 10.0})
    spec.constraints.allow_outlier_prices = True
    # row 0 cheapest but out of memory; row 1 next cheaper, misses the deadline; row 2 chosen
    t = Table(
        cost=[1.0, 2.0, 3.0],
        fits=[False, True, True],
        may_fit=[0, 0, 0],
        hours=[1.0, 20.0, 5.0],
        precision_code=[0, 0, 0],
        memory_gb=[99.0, 1.0, 1.0],
        offer=[0, 0, 0],
    )
    assert _binding_constraint(spec, t, 2) == "the deadline (10 h)"
