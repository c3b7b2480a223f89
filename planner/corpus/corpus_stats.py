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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from gptplan.corpus import default_dedupe, resolve_sources, source_key
from gptplan.errors import UserError
from gptplan.tomlconf import write_text_atomic

STATS_VERSION = 5  # 5: the key holds the vocabulary with a declared tokens_per_char too
# When the planned vocabulary is larger than the sample can train (sentencepiece stops at the
# pieces the sample supports), tokens per character is measured with tokenizers of these
# fractions of the supported size and extrapolated to the planned size (see `vocab_fit`).
FIT_FRACTIONS = (0.5, 0.7)
# a tokenizer that reaches at least this share of the asked size counts as reaching it
REACHED_SHARE = 0.98
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
    tokens_per_character_source: str = "measured"  # "measured", "extrapolated", "declared"
    total_tokens_source: str = "extrapolated"  # "measured", "extrapolated", "declared"
    tokenizer_scheme: str = ""
    # pieces the run's tokenizer will have (model.vocab_size is this, padded); 0 = unknown
    tokenizer_target_vocab: int = 0
    # the vocabulary fit when the planned size is larger than the sample supports: sizes and
    # their measured tokens/char, the fit, its 80% range at the planned size ({} = none)
    vocab_fit: dict = field(default_factory=dict)
    tokens_per_character_p10: float = 0.0  # 80% range (= the value when measured/declared)
    tokens_per_character_p90: float = 0.0
    compute_only: bool = False  # no corpus named: nothing was read or tokenized

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
    fit: bool = False,
) -> str:
    from gptplan.tokenizer import TOKENIZER_VERSION

    paths = resolve_sources(corpus)
    skey = source_key(paths, dedupe=default_dedupe(corpus))
    # everything the statistics depend on: the vocabulary is in every key (a declared
    # tokens_per_char keeps the asked vocabulary, which the statistics record)
    tok = (
        f"declared {tokens_per_char!r}|{tokenizer}|{vocab_size}"
        if tokens_per_char
        else f"{tokenizer}|{vocab_size}|t{TOKENIZER_VERSION}"
    )
    if not tokens_per_char and Path(tokenizer).is_dir():  # a given tokenizer folder: its files
        tok += "|" + source_key(sorted(p for p in Path(tokenizer).iterdir() if p.is_file()))
    raw = f"{skey}|{tok}|{sample_documents}|{sorted(seq_lens)}|fit{fit}|v{STATS_VERSION}"
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
        fit=declared_bytes > 0,
    )
    cache_file = Path(cache_dir) / "stats" / f"{key}.json"
    cached = _cached(cache_file, declared_bytes, log=log)
    if cached is not None:
        return cached
    st, count, sample, sizes, bytes_per_char = _sample(corpus, sample_documents)
    chars = sum(sizes)
    if tokens_per_char:
        # declared: nothing is tokenized; document lengths in tokens are estimated from it
        lengths = np.array([max(1, round(n * tokens_per_char)) + 1 for n in sizes])
        name, vocab, scheme, tpc = "declared in the spec", vocab_size, "", tokens_per_char
    else:
        name, vocab, scheme, lengths, fit = _measure(
            sample,
            sizes=sizes,
            corpus=corpus,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            cache_dir=cache_dir,
            fit=declared_bytes > 0,
            log=log,
        )
        tpc = float((lengths - 1).sum() / chars)
    waste, lost = _padding_tables(lengths, seq_lens)
    whole = len(sample) >= count
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
        "bytes_per_character": bytes_per_char,
        "padding_waste": waste,
        "truncation_loss": lost,
        "tokens_per_character_source": "declared" if tokens_per_char else "measured",
        "total_tokens_source": "declared"
        if tokens_per_char
        else ("measured" if whole else "extrapolated"),
        "tokenizer_scheme": scheme,
        "vocab_fit": {} if tokens_per_char else fit,
        # a declared figure keeps the planned vocabulary; a measured one the tokenizer's size
        "tokenizer_target_vocab": vocab_size if tokens_per_char else vocab,
    }
    write_text_atomic(cache_file, json.dumps(data, ensure_ascii=False))
    return _finish(data, declared_bytes)


def _cached(cache_file: Path, declared_bytes: float, *, log) -> CorpusStatistics | None:
    """The cached statistics, or None (absent; a damaged file is measured again, one line)."""
    from gptplan.userdata import read_json_record

    # damaged (a folder, not UTF-8, not JSON): moved aside, one line, measured again
    data = read_json_record(cache_file, what="corpus statistics cache", log=log)
    if data is None:
        return None
    try:
        stats = _finish(data, declared_bytes)
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


# Characters of one document that are tokenized to measure it: a longer one (a corpus with no
# newline is one document) is measured on its first MEASURE_CHARS and its length in tokens
# extrapolated, so the memory and time of measuring stay bounded whatever the line lengths.
MEASURE_CHARS = 100_000


def _sample(corpus: list[str], sample_documents: int):
    """The corpus streamed twice in bounded memory (`iter_document_sizes`: a line longer than
    `LONG_LINE_BYTES`, 8 MiB, is never held whole, only its first MEASURE_CHARS characters):
    its statistics, document count and UTF-8 bytes per character, then the sample (every
    step-th document, spread over the whole corpus, deterministic) as the first MEASURE_CHARS
    characters of each and their full lengths. (stats, documents, sample heads, sample lengths
    in characters, bytes/char)"""
    from gptplan.corpus import CorpusStats, iter_document_sizes

    paths = resolve_sources(corpus)
    dedupe = default_dedupe(corpus)
    stats = CorpusStats()
    count = utf8 = chars = 0
    for doc in iter_document_sizes(paths, stats, dedupe=dedupe, head_chars=0):
        count += 1
        utf8 += doc.utf8_bytes + 1
        chars += doc.characters + 1
    step = max(1, count // sample_documents)
    picked = set(range(0, count, step)[:sample_documents])
    heads, sizes = [], []
    docs = iter_document_sizes(paths, CorpusStats(), dedupe=dedupe, head_chars=MEASURE_CHARS)
    for i, doc in enumerate(docs):
        if i in picked:
            heads.append(doc.head)
            sizes.append(doc.characters)
    return stats, count, heads, sizes, (utf8 / chars if chars else 1.0)


def _lengths(counts: list[int], heads: list[str], sizes: list[int]) -> np.ndarray:
    """Document lengths in tokens (+ <eod>): measured, or for a document longer than its
    measured head extrapolated at the head's tokens per character."""
    return np.array(
        [
            (c if n <= len(h) else max(1, round(c * n / max(1, len(h))))) + 1
            for c, h, n in zip(counts, heads, sizes, strict=True)
        ]
    )


def _measure(sample: list[str], *, sizes, corpus, tokenizer, vocab_size, cache_dir, fit=False, log):
    """(name, pieces, scheme, document lengths in tokens, vocabulary fit or {}).

    A trained tokenizer that stops short of the planned `vocab_size` (the sample supports fewer
    pieces) gets a vocabulary fit when `fit` (the run trains on a larger corpus): tokens per
    character measured with tokenizers of `FIT_FRACTIONS` of the supported size too (each
    trained once and cached like the job's own)."""
    from gptplan.tokenizer import keep_segmentation

    with keep_segmentation():  # the fit's tokenizers segment the sample once
        return _measure_with(
            sample,
            sizes=sizes,
            corpus=corpus,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            cache_dir=cache_dir,
            fit=fit,
            log=log,
        )


def _measure_with(sample: list[str], *, sizes, corpus, tokenizer, vocab_size, cache_dir, fit, log):
    from gptplan.tokenizer import (
        FastEncoder,
        ensure_tokenizer,
        load_tokenizer,
        read_manifest,
    )

    directory = ensure_tokenizer(
        tokenizer=tokenizer, vocab_size=vocab_size, cache_dir=cache_dir, patterns=corpus, log=log
    )
    if directory is not None:
        enc = FastEncoder(directory)
        scheme = read_manifest(directory)["scheme"]
        name = f"{scheme}:{directory.name}"
        log(f"measuring tokens/char on {len(sample)} documents with {name}")
        counts = [a.size for a in enc.encode_batch(sample)]
        lengths = _lengths(counts, sample, sizes)  # + <eod>
        chars = sum(len(d) for d in sample)  # of the measured heads
        found: dict = {}
        if fit and enc.vocab_size < REACHED_SHARE * vocab_size:
            sizes, tpcs = [], []
            for f in FIT_FRACTIONS:
                size = int(round(enc.vocab_size * f / 100.0)) * 100
                try:
                    d = ensure_tokenizer(
                        tokenizer=tokenizer,
                        vocab_size=size,
                        cache_dir=cache_dir,
                        patterns=corpus,
                        log=log,
                    )
                except UserError as exc:  # too small for the sample's characters
                    log(f"no {size}-piece tokenizer for the vocabulary fit: {exc}")
                    continue
                assert d is not None
                e = FastEncoder(d)
                sizes.append(e.vocab_size)
                tpcs.append(float(sum(a.size for a in e.encode_batch(sample)) / chars))
            sizes.append(enc.vocab_size)
            tpcs.append(float(sum(counts) / chars))
            found = {
                "asked": int(vocab_size),
                "supported": int(enc.vocab_size),
                "sizes": sizes,
                "tokens_per_character": tpcs,
                "sample_documents": len(sample),
            }
        return name, enc.vocab_size, scheme, lengths, found
    tok = load_tokenizer(tokenizer)
    log(f"measuring tokens/char on {len(sample)} documents with {tok.name}")
    lengths = _lengths([len(tok.encode(d)) for d in sample], sample, sizes)
    return tok.name, tok.vocab_size, "", lengths, {}


# two-sided 80% t quantiles (0.9) by degrees of freedom
_T90 = {1: 3.078, 2: 1.886, 3: 1.638, 4: 1.533, 5: 1.476, 6: 1.440, 8: 1.397, 10: 1.372}


def _line_fit(x: np.ndarray, y: np.ndarray, x0: float) -> tuple[float, float]:
    """Least-squares line through (x, y) evaluated at x0: (value, 80% prediction half-width;
    t with n - 2 degrees of freedom, 0 for two points)."""
    b, a = np.polyfit(x, y, 1)
    n = len(x)
    if n <= 2:
        return float(a + b * x0), 0.0
    resid = y - (a + b * x)
    s = math.sqrt(float(resid @ resid) / (n - 2))
    sxx = float(((x - x.mean()) ** 2).sum())
    se = s * math.sqrt(1 + 1 / n + (x0 - x.mean()) ** 2 / sxx)
    dof = n - 2
    t = _T90[max(k for k in _T90 if k <= dof)] if dof <= 10 else 1.2816
    return float(a + b * x0), t * se


def vocab_fit(sizes: list[int], tpcs: list[float], target: int) -> tuple[float, float, float, str]:
    """Tokens per character at `target` pieces from measurements at smaller vocabularies:
    (central, p10, p90, description).

    Central: a power law, tokens/char = C x pieces^d (a line in log-log; like the
    measurements, it flattens as the vocabulary grows). The 80% range spans its prediction
    interval and that of a line in ln(pieces) (which falls faster), so it is at least as wide
    as the two fits disagree; with two sizes only, the range is the two fits."""
    x = np.log(np.asarray(sizes, float))
    y = np.asarray(tpcs, float)
    x0 = math.log(target)
    log_value, log_half = _line_fit(x, np.log(y), x0)
    central = math.exp(log_value)
    linear, lin_half = _line_fit(x, y, x0)
    lo = min(math.exp(log_value - log_half), linear - lin_half, linear)
    hi = max(math.exp(log_value + log_half), linear + lin_half, linear)
    d = np.polyfit(x, np.log(y), 1)[0]
    shown = ", ".join(f"{v:,} pieces {t:.3f}" for v, t in zip(sizes, tpcs))
    text = (
        f"extrapolated to {target:,} pieces from {len(x)} tokenizers the sample supports "
        f"({shown}; measured): power law tokens/char ~ pieces^{d:.3f} -> {central:.3f}; 80% "
        f"range {lo:.3f}-{hi:.3f} (prediction intervals of that fit and of a line in "
        f"ln(pieces), {linear:.3f})"
    )
    return central, max(lo, 0.0), hi, text


def _finish(data: dict, declared_bytes: float) -> CorpusStatistics:
    extrapolated = declared_bytes > 0
    # Extrapolate by UTF-8 bytes per character of the kept documents (one newline each).
    chars = (
        declared_bytes / data["bytes_per_character"] if extrapolated else data["local_characters"]
    )
    data = dict(data)
    tpc = data["tokens_per_character"]
    lo = hi = tpc
    fit = data.get("vocab_fit") or {}
    if extrapolated and fit:
        # the run trains its tokenizer on the full corpus, to the planned size
        tpc, lo, hi, text = vocab_fit(fit["sizes"], fit["tokens_per_character"], fit["asked"])
        data["tokens_per_character"] = tpc
        data["tokens_per_character_source"] = "extrapolated"
        data["tokenizer_target_vocab"] = fit["asked"]
        data["vocab_fit"] = dict(fit, description=text, p10=lo, p90=hi)
    data["tokens_per_character_p10"], data["tokens_per_character_p90"] = lo, hi
    tokens = chars * tpc
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


def compute_only_statistics(spec) -> CorpusStatistics:
    """The statistics of a compute-only spec (no job.corpus): nothing is read or tokenized.
    The corpus's size in tokens is known only when the spec declares both corpus_bytes and
    tokens_per_char (characters = bytes / job.bytes_per_char, 1 when not given); otherwise
    it is 0 (unknown) and no epochs are computed."""
    j = spec.job
    bpc = j.bytes_per_char or 1.0
    known = bool(j.corpus_bytes and j.tokens_per_char)
    chars = j.corpus_bytes / bpc if j.corpus_bytes else 0.0
    return CorpusStatistics(
        local_files=0,
        local_bytes=0,
        local_characters=0,
        local_documents=0,
        invalid_utf8_lines=0,
        empty_lines=0,
        duplicate_documents=0,
        length_histogram={},
        tokenizer="none (compute-only: no corpus named)",
        tokenizer_vocab=spec.asked_vocab_size(),
        sample_documents=0,
        tokens_per_character=j.tokens_per_char,
        tokens_per_document_median=0.0,
        declared_bytes=j.corpus_bytes,
        bytes_per_character=bpc,
        total_characters=chars,
        total_tokens=chars * j.tokens_per_char if known else 0.0,
        extrapolated=False,
        padding_waste={},
        truncation_loss={},
        tokens_per_character_source="declared" if j.tokens_per_char else "unknown",
        total_tokens_source="declared" if known else "unknown",
        tokenizer_target_vocab=spec.asked_vocab_size(),
        tokens_per_character_p10=j.tokens_per_char,
        tokens_per_character_p90=j.tokens_per_char,
        compute_only=True,
    )


def spec_corpus_statistics(spec, *, log=lambda *a: None) -> CorpusStatistics:
    """corpus_statistics of a spec's job (corpus, tokenizer, the vocabulary it asks for, the
    cache in the user data directory, a stated tokens_per_char), for the planner and explain
    alike; corpus/tokenizer errors name the spec they came from. A compute-only spec reads
    nothing (compute_only_statistics)."""
    from gptplan import userdata

    if spec.compute_only:
        return compute_only_statistics(spec)

    try:
        return corpus_statistics(
            corpus=spec.job.corpus,
            tokenizer=spec.job.tokenizer,
            vocab_size=spec.asked_vocab_size(),
            cache_dir=str(userdata.cache_dir(spec.job.cache_dir)),
            sample_documents=spec.job.sample_documents,
            declared_bytes=spec.job.corpus_bytes,
            seq_lens=spec.constraints.seq_lens,
            tokens_per_char=spec.job.tokens_per_char,
            log=log,
        )
    except UserError as exc:
        exc.file = exc.file or spec.path
        raise
