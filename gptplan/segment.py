"""Chinese word segmentation as PaddleNLP's GPTChineseTokenizer does it (`jieba.cut`), with
jieba's pure functions memoised.

Data preparation spends almost all of its CPU in jieba (about 94% of the tokenizing CPU on
Chinese text), and the ids must stay those of GPTChineseTokenizer, so another segmenter is not
an option. jieba 0.42.1's own code runs (its `cut`, block splitting, buffering, route search,
HMM for unknown words, dictionary); short blocks (<= 32 characters between punctuation) and the
HMM's runs of unknown characters are memoised in bounded LRU caches: both are pure functions of
their text, and short phrases repeat (People's Daily 1998-01: 1.8x less segmentation CPU than
jieba; `python bench/data_prep.py` measures the whole preparation).

Not used: `jieba_fast`'s C route search. On an exact tie between two routes it keeps the
shorter word where jieba keeps the longer ("个个个": jieba 个个/个, jieba_fast 个/个个), and
ties cannot be told apart from its output (it returns the route, not the scores); its separate
`_get_DAG` + `_calc` (which could be given the longer word first) build Python objects per
position and were slower than jieba's Python. Its C Viterbi scores characters missing from the
HMM tables differently ("龘鱻": one word, jieba two).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

_tokenizer = None

CACHED_BLOCK_CHARS = 32  # short blocks (between punctuation) repeat often: memoised
CACHE_ENTRIES = 1 << 16  # per cache; bounded memory (a few MB)


def _make_tokenizer() -> Any:  # a jieba.Tokenizer (jieba is untyped)
    import jieba
    from jieba import finalseg

    jieba.setLogLevel(logging.WARNING)

    @functools.lru_cache(maxsize=CACHE_ENTRIES)
    def hmm_words(buf: str) -> tuple[str, ...]:
        return tuple(finalseg.cut(buf))  # a pure function of its text: exact to memoise

    class MemoTokenizer(jieba.Tokenizer):
        """jieba.Tokenizer whose accurate mode with HMM (what `cut` uses by default) memoises
        short blocks and HMM runs (pure functions of their text); everything else is jieba's."""

        def _Tokenizer__cut_DAG(self, sentence: str) -> Sequence[str]:  # jieba's __cut_DAG
            if len(sentence) <= CACHED_BLOCK_CHARS:
                return self.block_words(sentence)
            return self.route_words(sentence)

        def route_words(self, sentence: str) -> list[str]:
            """jieba's __cut_DAG, its HMM runs memoised."""
            self.check_initialized()
            dag = self.get_DAG(sentence)
            route: dict[int, tuple[float, int]] = {}
            self.calc(sentence, dag, route)
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
                y = route[x][1] + 1
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

    tokenizer = MemoTokenizer()  # jieba's default dictionary (and its cache file)
    tokenizer.initialize()
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
