"""Segmentation CPU: gptplan.segment (jieba, memoised) vs jieba.cut, on People's Daily 1998-01.

Both give the same words (tests/test_segment.py); this prints the CPU seconds of each over the
same documents, alternating three times in one process, and their spread (the machine is
shared: compare only numbers from one run).

    python bench/segment_speed.py [--documents 3000]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=3000)
    args = parser.parse_args()
    import jieba

    from gptplan import sample_corpora, segment

    jieba.setLogLevel(logging.WARNING)
    docs = list(itertools.islice(sample_corpora.peoples_daily_1998(), args.documents))
    jieba.initialize()
    ways = {
        "jieba.cut": lambda d: jieba.cut(d, cut_all=False),
        "gptplan.segment.cut": segment.cut,
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(3):
        for name, cut in ways.items():
            segment._tokenizer = None  # cold memo caches each run, dictionary loaded untimed
            list(segment.cut("预热"))
            start = time.process_time()
            for doc in docs:
                for _word in cut(doc):
                    pass
            seconds[name].append(time.process_time() - start)
    chars = sum(map(len, docs))
    print(f"{len(docs)} documents, {chars:,} characters; CPU seconds (measured), 3 runs each")
    for name, runs in seconds.items():
        print(
            f"  {name:22s} median {statistics.median(runs):.2f} s",
            f" runs {[round(r, 2) for r in runs]}",
            sep="",
        )
    ratio = statistics.median(seconds["jieba.cut"]) / statistics.median(
        seconds["gptplan.segment.cut"]
    )
    print(f"  jieba / segment: {ratio:.2f}x (memo caches cold at the start of every run)")


if __name__ == "__main__":
    main()
