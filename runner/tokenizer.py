"""The job's tokenizer: a CPM-style sentencepiece model trained offline, or a given one.

CPM's tokenizer (PaddleNLP `GPTChineseTokenizer`) runs jieba on the text, maps space and newline
to the pieces U+2582 and U+2583, joins the words with spaces and encodes with sentencepiece. We
train the sentencepiece model on exactly that pre-segmented text, with `<bod>`, `<eod>`, `<pad>`
and the newline/space pieces as user-defined symbols: a missing special piece would otherwise
silently become `<unk>`. Trained models are cached by corpus hash and vocabulary size.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from runner.errors import DataError

SPECIAL_PIECES = ["<bod>", "<eod>", "\u2583", "\u2582"]  # begin, end of document, newline, space
_TRANSLATE = str.maketrans(" \n", "\u2582\u2583")


def _quiet_jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def cpm_segment(text: str) -> str:
    """The text GPTChineseTokenizer hands to sentencepiece (same rule as its `_tokenize`)."""
    jieba = _quiet_jieba()
    return " ".join(word.translate(_TRANSLATE) for word in jieba.cut(text, cut_all=False))


def train_sentencepiece(documents: list[str], *, vocab_size: int, out_dir: Path,
                        seed_text_limit: int = 2_000_000) -> Path:
    """Train a unigram sentencepiece model on jieba-segmented documents; return its path.

    Written into a temporary folder, then renamed: a cache entry is complete or absent.
    """
    import sentencepiece as spm

    out_dir = Path(out_dir)
    model_path = out_dir / "sentencepiece.model"
    if model_path.exists():
        return model_path
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", suffix=".tmp", dir=out_dir.parent))
    try:
        text_file = tmp / "train.txt"
        with open(text_file, "w", encoding="utf-8") as handle:
            for doc in documents:
                handle.write(cpm_segment(doc) + "\n")
        try:
            spm.SentencePieceTrainer.train(
                input=str(text_file), model_prefix=str(tmp / "sentencepiece"),
                vocab_size=vocab_size, model_type="unigram", character_coverage=0.9995,
                unk_id=0, pad_id=1, bos_id=-1, eos_id=-1, pad_piece="<pad>",
                user_defined_symbols=SPECIAL_PIECES, input_sentence_size=seed_text_limit,
                shuffle_input_sentence=True, num_threads=max(1, min(4, os.cpu_count() or 1)),
                max_sentence_length=1 << 16, minloglevel=2,
                hard_vocab_limit=False)  # a small local sample may not support the full vocab
        except RuntimeError as exc:
            reason = str(exc).strip().splitlines()[-1]
            raise DataError(f"cannot train a {vocab_size}-piece sentencepiece model on this "
                            f"corpus: {reason}; choose another model.vocab_size (Chinese "
                            "text needs a piece for every frequent character)",
                            key="model.vocab_size") from None
        text_file.unlink()
        if out_dir.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model_path


class JobTokenizer:
    """Thin handle on a PaddleNLP tokenizer with the ids the data pipeline needs."""

    def __init__(self, hf_tokenizer, *, name: str, fingerprint: str):
        self.tokenizer = hf_tokenizer
        self.name = name
        self.fingerprint = fingerprint
        self.eod_id = self._special_id("eos_token", "<eod>")
        pad = getattr(hf_tokenizer, "pad_token_id", None)
        sp = getattr(hf_tokenizer, "sp", None)
        if pad is None and sp is not None and sp.pad_id() >= 0:
            pad = sp.pad_id()
        self.pad_id = self.eod_id if pad is None else int(pad)
        self.vocab_size = len(hf_tokenizer)

    def _special_id(self, attr: str, piece: str) -> int:
        token = getattr(self.tokenizer, attr, None) or piece
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if token_id is None or (token_id == unk and token != getattr(self.tokenizer,
                                                                      "unk_token", None)):
            raise DataError(f"tokenizer {self.name!r} has no {piece!r} piece; it would become "
                            "<unk>", key="job.tokenizer")
        return int(token_id)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text))


def _file_sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_tokenizer(spec: str, *, model_file: Path | None = None) -> JobTokenizer:
    """Load by spec: a trained sentencepiece model file, a local directory, or a PaddleNLP name."""
    if spec == "sentencepiece":
        if model_file is None:
            raise ValueError("sentencepiece tokenizer needs the trained model file")
        from paddlenlp.transformers import GPTChineseTokenizer

        _quiet_jieba()
        tok = GPTChineseTokenizer(model_file=str(model_file))
        return JobTokenizer(tok, name=f"sentencepiece:{model_file.parent.name}",
                            fingerprint=_file_sha(model_file))
    from paddlenlp.transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec)
    except Exception as exc:  # PaddleNLP raises many types for a name it cannot resolve
        raise DataError(f"cannot load tokenizer {spec!r} ({type(exc).__name__}); allowed: "
                        "'sentencepiece', a local tokenizer directory, or a PaddleNLP name "
                        "available offline", key="job.tokenizer") from None
    if Path(spec).is_dir():
        digest = hashlib.sha256()
        for f in sorted(Path(spec).iterdir()):
            if f.is_file():
                digest.update(f.read_bytes())
        fingerprint = digest.hexdigest()[:16]
    else:
        fingerprint = hashlib.sha256(spec.encode()).hexdigest()[:16]
    return JobTokenizer(tok, name=spec, fingerprint=fingerprint)
