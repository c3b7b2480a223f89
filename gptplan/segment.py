"""Chinese word segmentation as PaddleNLP's GPTChineseTokenizer does it (`jieba.cut`), with
jieba's hottest loop in C when `jieba_fast` is installed.

Data preparation spends almost all of its CPU in jieba (about 94% of the tokenizing CPU on
Chinese text), and the ids must stay those of GPTChineseTokenizer, so another segmenter is not
an option. `jieba_fast` (MIT, github.com/deepcs233/jieba_fast) ships C versions of jieba's
prefix-DAG + best-route search (`_get_DAG_and_calc`) and of its HMM Viterbi, wrapped in a copy
of jieba 0.39 whose block regex differs from the jieba 0.42.1 PaddleNLP uses ("-" joins blocks
in 0.42). Here jieba 0.42.1's own code runs (its `cut`, block splitting, buffering, HMM for
unknown words, dictionary) and only the route search is swapped, under checks that keep it
equal to jieba's:

- the C search keeps at most 12 dictionary words per start position: used only if no position
  of any text can have 12 (the dictionary's longest prefix chain, computed at start: 7 for
  jieba's dictionary);
- its route scores start from INT_MIN: blocks over 10^6 characters take jieba's path;
- same formula and operation order as jieba's `calc` (log(freq or 1) - log(total) + rest), so
  the scores are the same doubles; on an exact tie between two routes C keeps the shorter word
  and jieba the longer one. No tie occurs in People's Daily 1998-01 (19,486 documents) or in
  the property test's random texts (tests/test_segment.py compares words one by one).
- The C Viterbi is not used: it scores characters missing from the HMM tables differently
  ("龘鱻" -> one word, jieba: two).

Short blocks (<= 32 characters between punctuation) and the HMM's runs of unknown characters
are memoised (bounded LRU caches): both are pure functions of their text, and short phrases
repeat (on the embedded review corpus segmentation took 2.3x less CPU than jieba, on People's
Daily 1.6x; `python bench/data_prep.py` measures the whole preparation).

Without `jieba_fast` (it builds from source: a C compiler is needed) the route search is
jieba's Python one, memoised the same way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

try:  # the C kernels only; jieba_fast's own Python package is not used
    import _jieba_fast_functions_py3 as _kernels
except ImportError:  # pragma: no cover - depends on the installation
    _kernels = None

_tokenizer = None


def accelerated() -> bool:
    """Whether segmentation runs jieba's loops in C (jieba_fast installed)."""
    return _kernels is not None


def _longest_prefix_chain(freq: dict) -> int:
    """The most dictionary words (non-zero frequency) that start at one position of a text:
    the C route search keeps at most DAG_CAP of them, jieba all."""
    longest = 0
    for word, count in freq.items():
        if count and len(word) > longest:  # a chain is at most len(word) long
            chain = sum(1 for i in range(1, len(word) + 1) if freq.get(word[:i]))
            longest = max(longest, chain)
    return longest


DAG_CAP = 12  # jieba_fast's _get_DAG_and_calc keeps 12 words per start position
MAX_C_BLOCK = 10**6  # its route starts from INT_MIN: keep log-probabilities far above it


CACHED_BLOCK_CHARS = 32  # short blocks (between punctuation) repeat often: memoised
CACHE_ENTRIES = 1 << 16  # per cache; bounded memory (a few MB)


def _make_tokenizer() -> Any:  # a jieba.Tokenizer (jieba is untyped)
    import jieba
    from jieba import finalseg

    jieba.setLogLevel(logging.WARNING)

    @functools.lru_cache(maxsize=CACHE_ENTRIES)
    def hmm_words(buf: str) -> tuple[str, ...]:
        return tuple(finalseg.cut(buf))  # a pure function of its text: exact to memoise

    class FastTokenizer(jieba.Tokenizer):
        """jieba.Tokenizer whose accurate mode with HMM (what `cut` uses by default) takes its
        route from C where that is exact, and memoises short blocks and HMM runs (pure
        functions of their text); everything else is jieba's."""

        def _Tokenizer__cut_DAG(self, sentence: str) -> Sequence[str]:  # jieba's __cut_DAG
            if len(sentence) <= CACHED_BLOCK_CHARS:
                return self.block_words(sentence)
            return self.route_words(sentence)

        def route_words(self, sentence: str) -> list[str]:
            self.check_initialized()
            if _kernels is None or len(sentence) > MAX_C_BLOCK or not self.c_route_exact:
                return list(super()._Tokenizer__cut_DAG(sentence))
            route: list = []
            _kernels._get_DAG_and_calc(self.FREQ, sentence, route, float(self.total))
            freq, words = self.FREQ, []

            def flush(buf: str) -> None:  # jieba's rule for a run of single characters
                if len(buf) == 1:
                    words.append(buf)
                elif not freq.get(buf):
                    words.extend(hmm_words(buf))
                else:
                    words.extend(buf)

            x, buf, n = 0, "", len(sentence)
            while x < n:
                y = route[x] + 1
                word = sentence[x:y]
                if y - x == 1:
                    buf += word
                else:
                    if buf:
                        flush(buf)
                        buf = ""
                    words.append(word)
                x = y
            if buf:
                flush(buf)
            return words

    tokenizer = FastTokenizer()  # jieba's default dictionary (and its cache file)
    tokenizer.initialize()
    tokenizer.c_route_exact = _longest_prefix_chain(tokenizer.FREQ) < DAG_CAP
    tokenizer.block_words = functools.lru_cache(maxsize=CACHE_ENTRIES)(
        lambda block: tuple(tokenizer.route_words(block))
    )
    return tokenizer


def cut(text: str) -> Iterator[str]:
    """The words `jieba.cut(text)` gives (accurate mode, HMM on)."""
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = _make_tokenizer()
    return _tokenizer.cut(text, cut_all=False, HMM=True)
