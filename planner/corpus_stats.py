"""Corpus statistics: what the data costs in tokens, measured on the local files or sample.

Bytes, characters, documents, a length histogram and skipped lines come from reading the local
files; tokens per character is measured by really tokenizing a sample with the job's own
tokenizer; totals for a declared full corpus are extrapolated by bytes per character (and say
so). Cached by corpus content hash + tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from runner.corpus import read_corpus
from runner.data import job_tokenizer
from runner.tomlconf import write_text_atomic

STATS_VERSION = 1


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
    tokens_per_character: float        # measured on the sample
    tokens_per_document_median: float  # measured on the sample
    declared_bytes: float              # 0 = the local files are the whole corpus
    bytes_per_character: float         # measured on the local files
    total_characters: float            # measured, or extrapolated from declared bytes
    total_tokens: float                # extrapolated from the sample
    extrapolated: bool
    padding_waste: dict                # seq_len -> share of positions that are padding
    truncation_loss: dict              # seq_len -> share of tokens cut off by truncation

    def epochs_for(self, target_tokens: float) -> float:
        return target_tokens / self.total_tokens if self.total_tokens else float("inf")


def _padding_tables(lengths: np.ndarray, seq_lens: list[int]) -> tuple[dict, dict]:
    waste, lost = {}, {}
    for s in seq_lens:
        used = np.minimum(lengths, s)
        waste[str(s)] = float(1.0 - used.sum() / (s * len(lengths)))
        lost[str(s)] = float(1.0 - used.sum() / lengths.sum())
    return waste, lost


def corpus_statistics(*, corpus: list[str], tokenizer: str, vocab_size: int, cache_dir: str,
                      sample_documents: int, declared_bytes: float, seq_lens: list[int],
                      log=print) -> CorpusStatistics:
    local = read_corpus(corpus)
    tok, _ = job_tokenizer(tokenizer=tokenizer, vocab_size=vocab_size, cache_dir=cache_dir,
                           corpus=local)
    key = f"{local.stats.sha256[:16]}-{tok.fingerprint}-{sample_documents}-" \
          f"{'_'.join(map(str, sorted(seq_lens)))}-v{STATS_VERSION}"
    cache_file = Path(cache_dir) / "stats" / f"{key}.json"
    if cache_file.exists():
        return _finish(json.loads(cache_file.read_text()), declared_bytes)
    docs = local.documents
    step = max(1, len(docs) // sample_documents)
    sample = docs[::step][:sample_documents]  # spread over the whole corpus, deterministic
    log(f"measuring tokens/char on {len(sample)} documents with {tok.name}")
    lengths = np.array([len(tok.encode(d)) + 1 for d in sample])  # + <eod>
    chars = sum(len(d) for d in sample)
    waste, lost = _padding_tables(lengths, seq_lens)
    st = local.stats
    data = {
        "local_files": st.files, "local_bytes": st.bytes, "local_characters": st.characters,
        "local_documents": st.documents, "invalid_utf8_lines": st.invalid_utf8_lines,
        "empty_lines": st.empty_lines, "duplicate_documents": st.duplicate_documents,
        "length_histogram": st.length_histogram, "tokenizer": tok.name,
        "tokenizer_vocab": tok.vocab_size, "sample_documents": len(sample),
        "tokens_per_character": float((lengths - 1).sum() / chars),
        "tokens_per_document_median": float(np.median(lengths)),
        "bytes_per_character": sum(len(d.encode("utf-8")) + 1 for d in docs) /
        sum(len(d) + 1 for d in docs),
        "padding_waste": waste, "truncation_loss": lost,
    }
    write_text_atomic(cache_file, json.dumps(data, ensure_ascii=False))
    return _finish(data, declared_bytes)


def _finish(data: dict, declared_bytes: float) -> CorpusStatistics:
    extrapolated = declared_bytes > 0
    # Extrapolate by UTF-8 bytes per character of the kept documents (one newline each).
    chars = declared_bytes / data["bytes_per_character"] if extrapolated else \
        data["local_characters"]
    tokens = chars * data["tokens_per_character"]
    return CorpusStatistics(**data, declared_bytes=declared_bytes, total_characters=chars,
                            total_tokens=tokens, extrapolated=extrapolated)


def as_dict(stats: CorpusStatistics) -> dict:
    return asdict(stats)
