"""gptplan.segment gives exactly jieba's words (what GPTChineseTokenizer feeds sentencepiece),
its pure functions memoised."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptplan import sample_corpora, segment


def jieba_words(text: str) -> list[str]:
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))


def test_same_words_as_jieba_on_peoples_daily():
    docs = list(sample_corpora.peoples_daily_1998())
    assert len(docs) > 19_000
    differing = [d for d in docs if list(segment.cut(d)) != jieba_words(d)]
    assert differing == []


# Where jieba 0.42.1 and the jieba 0.39 inside jieba_fast differed ("-" joins blocks in 0.42),
# full-width punctuation, digits and percentages, runs of unknown characters (HMM), spaces.
EDGES = [
    "e-mail 是 co-op 的 3.5% 和 x-ray-2 机器学习-深度学习",
    "中华人民共和国－成立了 C++ 与 C# -- 123-456",
    "  \t多个  空格\r\n换行 ",
    "",
    "-",
    "龘龘龘龘鱻鱻",
    "今天天气不错，挺风和日丽的。",
    # exact ties between two routes: jieba keeps the longer word first (个个/个), jieba_fast's
    # C search (used until 2026-12-05) the shorter (个/个个); hypothesis found it
    "个个个",
    "人人人",
    "天天天天天",
]


@pytest.mark.parametrize("text", EDGES)
def test_same_words_as_jieba_on_edge_cases(text):
    assert list(segment.cut(text)) == jieba_words(text)


ALPHABET = st.sampled_from(
    list(
        "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就"
        "分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经"
        "龘鱻靐齉爩犇骉羴"
    )
    + list("abcXYZ019-_.%+#& \t\n，。！？、：；“”（）")
)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=80))
def test_same_words_as_jieba_on_any_text(text):
    assert list(segment.cut(text)) == jieba_words(text)
