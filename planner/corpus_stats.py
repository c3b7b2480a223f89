"""Corpus statistics: what the data costs in tokens, measured on the local files or sample.

Bytes, characters, documents, a length histogram and skipped lines come from reading the local
files; tokens per character is measured by really tokenizing a sample with the job's own
tokenizer, or taken from the spec (`job.tokens_per_char`, then nothing is tokenized); totals
for a declared full corpus are extrapolated by bytes per character (and say so).

Cached by the corpus files' (path, size, modification time) and the tokenizer settings: a warm
call reads no corpus text and loads no tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gptplan.corpus import default_dedupe, read_corpus, resolve_sources, source_key
from gptplan.tomlconf import write_text_atomic

STATS_VERSION = 3
# Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (NeurIPS 2023), eq. 5:
# repeated data is worth U * (1 + R* (1 - exp(-R / R*))) fresh tokens for R = epochs - 1
# repetitions of U unique tokens, with the fitted R* = 15.4; up to about 4 epochs is nearly as
# good as fresh data, beyond that the value of more repetitions falls off sharply.
REPEAT_DECAY_EPOCHS = 15.4
EPOCHS_WARN = 4.0


@dataclass(frozen=True)
class CorpusStatistics:
    local_files: int
    local_bytes: int
    local_characters: int
    local_documents: int
    invalid_utf8_lines: int
    empty_lines: int
    duplicate_documents: int
    length_histogram: dict
    tokenizer: str
    tokenizer_vocab: int
    sample_documents: int
    tokens_per_character: float  # measured on the sample, or declared
    tokens_per_document_median: float  # measured on the sample (estimated if declared)
    declared_bytes: float  # 0 = the local files are the whole corpus
    bytes_per_character: float  # measured on the local files
    total_characters: float  # measured, or extrapolated from declared bytes
    total_tokens: float  # tokens/char x characters
    extrapolated: bool
    padding_waste: dict  # seq_len -> share of positions that are padding
    truncation_loss: dict  # seq_len -> share of tokens cut off by truncation
    tokens_per_character_source: str = "measured"  # "measured" or "declared"
    total_tokens_source: str = "extrapolated"  # "measured", "extrapolated", "declared"
    tokenizer_scheme: str = ""

    def epochs_for(self, target_tokens: float) -> float:
        return target_tokens / self.total_tokens if self.total_tokens else float("inf")


def fresh_equivalent_tokens(unique_tokens: float, epochs: float) -> float:
    """What `epochs` passes over `unique_tokens` are worth in fresh tokens (Muennighoff 2023)."""
    if epochs <= 1:
        return unique_tokens * epochs
    r = epochs - 1
    return unique_tokens * (1 + REPEAT_DECAY_EPOCHS * (1 - math.exp(-r / REPEAT_DECAY_EPOCHS)))


def epochs_warning(stats: CorpusStatistics, target_tokens: float) -> str | None:
    """A warning when the target repeats the corpus more than about 4 times, else None."""
    epochs = stats.epochs_for(target_tokens)
    if not math.isfinite(epochs) or epochs <= EPOCHS_WARN:
        return None
    fresh = fresh_equivalent_tokens(stats.total_tokens, epochs)
    return (
        f"warning: {_tokens(target_tokens)} target tokens repeat the corpus "
        f"({_tokens(stats.total_tokens)} tokens, {stats.total_tokens_source}) {epochs:,.1f} "
        f"times. Up to about {EPOCHS_WARN:.0f} epochs is nearly as good as fresh data; "
        f"after that repeated tokens are worth sharply less (Muennighoff et al. 2023): "
        f"these are worth about {_tokens(fresh)} fresh tokens "
        f"({fresh / target_tokens:.0%} of the target; modelled). More text, or a smaller "
        "target, spends the budget better."
    )


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _padding_tables(lengths: np.ndarray, seq_lens: list[int]) -> tuple[dict, dict]:
    waste, lost = {}, {}
    for s in seq_lens:
        used = np.minimum(lengths, s)
        waste[str(s)] = float(1.0 - used.sum() / (s * len(lengths)))
        lost[str(s)] = float(1.0 - used.sum() / lengths.sum())
    return waste, lost


def _cache_key(
    corpus: list[str],
    *,
    tokenizer: str,
    vocab_size: int,
    sample_documents: int,
    seq_lens: list[int],
    tokens_per_char: float,
) -> str:
    from gptplan.tokenizer import TOKENIZER_VERSION

    paths = resolve_sources(corpus)
    skey = source_key(paths, dedupe=default_dedupe(corpus))
    tok = (
        f"declared {tokens_per_char!r}"
        if tokens_per_char
        else f"{tokenizer}|{vocab_size}|t{TOKENIZER_VERSION}"
    )
    raw = f"{skey}|{tok}|{sample_documents}|{sorted(seq_lens)}|v{STATS_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def corpus_statistics(
    *,
    corpus: list[str],
    tokenizer: str,
    vocab_size: int,
    cache_dir: str,
    sample_documents: int,
    declared_bytes: float,
    seq_lens: list[int],
    tokens_per_char: float = 0.0,
    log=print,
) -> CorpusStatistics:
    key = _cache_key(
        corpus,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        sample_documents=sample_documents,
        seq_lens=seq_lens,
        tokens_per_char=tokens_per_char,
    )
    cache_file = Path(cache_dir) / "stats" / f"{key}.json"
    cached = _cached(cache_file, declared_bytes, log=log)
    if cached is not None:
        return cached
    local = read_corpus(corpus)
    docs = local.documents
    step = max(1, len(docs) // sample_documents)
    sample = docs[::step][:sample_documents]  # spread over the whole corpus, deterministic
    chars = sum(len(d) for d in sample)
    if tokens_per_char:
        # declared: nothing is tokenized; document lengths in tokens are estimated from it
        lengths = np.array([max(1, round(len(d) * tokens_per_char)) + 1 for d in sample])
        name, vocab, scheme, tpc = "declared in the spec", vocab_size, "", tokens_per_char
    else:
        name, vocab, scheme, lengths = _measure(
            sample,
            corpus=corpus,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            cache_dir=cache_dir,
            log=log,
        )
        tpc = float((lengths - 1).sum() / chars)
    waste, lost = _padding_tables(lengths, seq_lens)
    st = local.stats
    whole = len(sample) >= len(docs)
    data = {
        "local_files": st.files,
        "local_bytes": st.bytes,
        "local_characters": st.characters,
        "local_documents": st.documents,
        "invalid_utf8_lines": st.invalid_utf8_lines,
        "empty_lines": st.empty_lines,
        "duplicate_documents": st.duplicate_documents,
        "length_histogram": st.length_histogram,
        "tokenizer": name,
        "tokenizer_vocab": vocab,
        "sample_documents": len(sample),
        "tokens_per_character": tpc,
        "tokens_per_document_median": float(np.median(lengths)),
        "bytes_per_character": sum(len(d.encode("utf-8")) + 1 for d in docs)
        / sum(len(d) + 1 for d in docs),
        "padding_waste": waste,
        "truncation_loss": lost,
        "tokens_per_character_source": "declared" if tokens_per_char else "measured",
        "total_tokens_source": "declared"
        if tokens_per_char
        else ("measured" if whole else "extrapolated"),
        "tokenizer_scheme": scheme,
    }
    write_text_atomic(cache_file, json.dumps(data, ensure_ascii=False))
    return _finish(data, declared_bytes)


def _cached(cache_file: Path, declared_bytes: float, *, log) -> CorpusStatistics | None:
    """The cached statistics, or None (absent; a damaged file is measured again, one line)."""
    if not cache_file.exists():
        return None
    try:
        stats = _finish(json.loads(cache_file.read_text(encoding="utf-8")), declared_bytes)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log(
            f"corpus statistics cache {cache_file} is damaged ({type(exc).__name__}); "
            "measuring again"
        )
        return None
    log(
        f"corpus statistics reused from {cache_file} (corpus files unchanged: same paths, "
        "sizes and modification times)"
    )
    return stats


def _measure(sample: list[str], *, corpus, tokenizer, vocab_size, cache_dir, log):
    from gptplan.tokenizer import (
        FastEncoder,
        check_vocab,
        ensure_tokenizer,
        load_tokenizer,
        read_manifest,
    )

    directory = ensure_tokenizer(
        tokenizer=tokenizer, vocab_size=vocab_size, cache_dir=cache_dir, patterns=corpus, log=log
    )
    if directory is not None:
        enc = FastEncoder(directory)
        check_vocab(enc.vocab_size, vocab_size)
        scheme = read_manifest(directory)["scheme"]
        name = f"{scheme}:{directory.name}"
        log(f"measuring tokens/char on {len(sample)} documents with {name}")
        lengths = np.array([a.size + 1 for a in enc.encode_batch(sample)])  # + <eod>
        return name, enc.vocab_size, scheme, lengths
    tok = load_tokenizer(tokenizer)
    check_vocab(tok.vocab_size, vocab_size)
    log(f"measuring tokens/char on {len(sample)} documents with {tok.name}")
    lengths = np.array([len(tok.encode(d)) + 1 for d in sample])
    return tok.name, tok.vocab_size, "", lengths


def _finish(data: dict, declared_bytes: float) -> CorpusStatistics:
    extrapolated = declared_bytes > 0
    # Extrapolate by UTF-8 bytes per character of the kept documents (one newline each).
    chars = (
        declared_bytes / data["bytes_per_character"] if extrapolated else data["local_characters"]
    )
    tokens = chars * data["tokens_per_character"]
    data = dict(data)
    if extrapolated and data.get("total_tokens_source") == "measured":
        data["total_tokens_source"] = "extrapolated"
    return CorpusStatistics(
        **data,
        declared_bytes=declared_bytes,
        total_characters=chars,
        total_tokens=tokens,
        extrapolated=extrapolated,
    )


def as_dict(stats: CorpusStatistics) -> dict:
    return asdict(stats)
