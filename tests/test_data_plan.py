"""What the data means for the plan: cached corpus statistics, declared tokens/char, the epochs
warning (Muennighoff et al. 2023), data preparation hours, MFU without a known peak."""

from __future__ import annotations

import math

import pytest

from gptplan.sample_corpora import peoples_daily_1998, write_corpus
from planner.corpus import corpus_stats as cs
from planner.corpus import dataprep


def _stats(tmp_path, **kw):
    corpus = write_corpus(peoples_daily_1998(), tmp_path / "zh.txt", limit=400)
    args = dict(
        corpus=[str(corpus)],
        tokenizer="sentencepiece",
        vocab_size=3000,
        cache_dir=str(tmp_path / "cache"),
        sample_documents=100,
        declared_bytes=0.0,
        seq_lens=[64, 1024],
        log=lambda *_: None,
    )
    return corpus, args | kw


def test_statistics_are_cached_by_file_identity_and_declared_tpc_skips_tokenizing(
    tmp_path, monkeypatch
):
    corpus, args = _stats(tmp_path, tokens_per_char=0.8)
    # declared tokens/char: no tokenizer is trained or loaded
    monkeypatch.setattr(
        "gptplan.tokenizer.ensure_tokenizer",
        lambda **_: pytest.fail("trained a tokenizer despite tokens_per_char"),
    )
    first = cs.corpus_statistics(**args)
    assert first.tokens_per_character == 0.8
    assert first.tokens_per_character_source == first.total_tokens_source == "declared"
    # warm: the corpus is not read again (keyed on path, size, mtime) and it says so
    monkeypatch.setattr(cs, "_sample", lambda *a, **k: pytest.fail("re-read the corpus"))
    said = []
    again = cs.corpus_statistics(**(args | {"log": said.append}))
    assert again == first and any("reused" in s for s in said)
    # a changed file is a different corpus
    with open(corpus, "a", encoding="utf-8") as handle:
        handle.write("新的一行\n")
    with pytest.raises(pytest.fail.Exception):
        cs.corpus_statistics(**args)


@pytest.mark.parametrize("damage", ["garbled", "truncated", "other fields"])
def test_damaged_statistics_cache_is_measured_again_with_one_line(tmp_path, damage):
    from pathlib import Path

    _, args = _stats(tmp_path, tokens_per_char=0.8)
    first = cs.corpus_statistics(**args)
    (cached,) = (Path(args["cache_dir"]) / "stats").iterdir()
    text = cached.read_text()
    cached.write_text(
        {
            "garbled": text[:20] + "\x00%%" + text[25:],
            "truncated": text[: len(text) // 2],
            "other fields": '{"tokens_per_character": 0.8}',
        }[damage]
    )
    said = []
    again = cs.corpus_statistics(**(args | {"log": said.append}))
    assert again == first
    assert [s for s in said if "damaged" in s] == [
        s for s in said if s.startswith(f"corpus statistics cache {cached} is damaged")
    ]
    assert len([s for s in said if "damaged" in s]) == 1
    assert cs.corpus_statistics(**args) == first  # rewritten: reused next time


def test_measured_statistics_say_what_was_measured_and_what_extrapolated(tmp_path):
    _, args = _stats(tmp_path)
    stats = cs.corpus_statistics(**args)
    assert stats.tokens_per_character_source == "measured"
    assert stats.sample_documents == 100 < stats.local_documents
    assert stats.total_tokens_source == "extrapolated"  # sample tokens/char x characters
    assert stats.tokenizer_scheme == "cpm" and 0.3 < stats.tokens_per_character < 1.5
    assert stats.truncation_loss["64"] > stats.truncation_loss["1024"] >= 0
    whole = cs.corpus_statistics(**(args | {"sample_documents": 10_000}))
    assert whole.total_tokens_source == "measured"
    assert "truncation" in dataprep.truncation_line(whole)


def test_fresh_equivalent_tokens_follow_muennighoff():
    u = 1e9
    assert cs.fresh_equivalent_tokens(u, 1) == u
    assert cs.fresh_equivalent_tokens(u, 0.5) == 0.5 * u
    four = cs.fresh_equivalent_tokens(u, 4)
    assert four == pytest.approx(u * (1 + 15.4 * (1 - math.exp(-3 / 15.4))))
    assert 0.9 * 4 * u < four < 4 * u  # ~4 epochs: nearly as good as fresh data
    assert cs.fresh_equivalent_tokens(u, 40) < 0.5 * 40 * u  # far beyond: worth much less
    assert cs.fresh_equivalent_tokens(u, 1e6) < 16.5 * u  # bounded by 1 + R*


def _fake_stats(total_tokens: float, **kw):
    base = dict(
        local_files=1,
        local_bytes=1000,
        local_characters=1000,
        local_documents=10,
        invalid_utf8_lines=0,
        empty_lines=0,
        duplicate_documents=0,
        length_histogram={},
        tokenizer="t",
        tokenizer_vocab=10,
        sample_documents=10,
        tokens_per_character=1.0,
        tokens_per_document_median=1.0,
        declared_bytes=0.0,
        bytes_per_character=1.0,
        total_characters=1000.0,
        total_tokens=total_tokens,
        extrapolated=False,
        padding_waste={},
        truncation_loss={},
    )
    return cs.CorpusStatistics(**(base | kw))


def test_epochs_warning_only_beyond_about_four_epochs():
    stats = _fake_stats(2.8e9)
    assert cs.epochs_warning(stats, 10e9) is None
    text = cs.epochs_warning(stats, 50e9)
    assert "17.9 times" in text and "Muennighoff" in text and "fresh tokens" in text


def test_data_preparation_hours_from_measured_throughput(tmp_path):
    (tmp_path / "prep_throughput.json").write_text(
        '{"cpm": {"bytes_per_second_per_core": 2e6, "measured_at": "2026-12-03T08:00:00Z"}}'
    )
    est = dataprep.estimate(
        corpus_bytes=10e9,
        scheme="cpm",
        cache_dir=str(tmp_path),
        provider="aws",
        instance="p4de.24xlarge",
        nodes=2,
        price_node_hour=100.0,
        currency="CNY",
    )
    assert est.node_cpus == 96
    assert est.hours == pytest.approx(10e9 / (2e6 * 96) / 3600)
    assert est.cost == pytest.approx(est.hours * 2 * 100.0)
    assert "measured on this machine" in est.describe() and "modelled" in est.describe()
    unknown = dataprep.estimate(
        corpus_bytes=10e9,
        scheme="cpm",
        cache_dir=str(tmp_path),
        provider="owned",
        instance="rack",
        nodes=1,
        price_node_hour=1.0,
        currency="CNY",
    )
    assert unknown.hours is None and "core-hours" in unknown.describe()
    # without a local measurement, the benchmark's (dated) number is used
    shipped = dataprep.estimate(
        corpus_bytes=1e9,
        scheme="cpm",
        cache_dir=str(tmp_path / "x"),
        provider="local",
        instance="this machine",
        nodes=1,
        price_node_hour=None,
        currency="USD",
    )
    assert "bench/data_prep.py" in shipped.throughput_source and shipped.cost is None


def test_training_line_says_peak_unknown_instead_of_zero_mfu():
    from types import SimpleNamespace

    from conftest import BASE_PLAN, merge

    from gptplan.plan import plan_from_dict
    from runner.train import log_line

    rec = SimpleNamespace(
        step=0,
        loss=1.0,
        learning_rate=1e-3,
        step_time_s=0.1,
        tokens_per_second=100.0,
        mfu=0.0,
        peak_memory_gb=0.1,
        cost=0.0,
        projected_cost=0.0,
    )
    unknown = plan_from_dict(merge(BASE_PLAN, {"hardware": {"peak_tflops": 0.0}}))
    assert "MFU peak unknown" in log_line(unknown, rec) and "0.00%" not in log_line(unknown, rec)
    known = plan_from_dict(BASE_PLAN)
    assert "MFU 0.00%" in log_line(known, rec)


def test_data_preparation_is_priced_by_gptplan_money(tmp_path, monkeypatch):
    """Issue 28: money = price x nodes x time is written once (gptplan.money.cost)."""
    from gptplan import money

    calls = []
    monkeypatch.setattr(money, "cost", lambda **kw: calls.append(kw) or 123.0)
    est = dataprep.estimate(
        corpus_bytes=7.2e9,
        scheme="cpm",
        cache_dir=str(tmp_path),
        provider="aws",
        instance="p4de.24xlarge",
        nodes=3,
        price_node_hour=10.0,
        currency="USD",
    )
    assert est.cost == 123.0
    assert calls == [
        {"price_per_node_hour": 10.0, "nodes": 3, "seconds": pytest.approx(est.hours * 3600)}
    ]
