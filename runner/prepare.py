"""Prepare the corpus once, offline: tokenize it and store the token ids (runner.datacache).

Preparation streams: the main process reads the corpus and hands chunks of about
`CHUNK_CHARS` characters to tokenizer worker processes (at most `INFLIGHT_PER_WORKER` chunks per
worker in flight), and appends the ids they return to tokens.bin and the document ends to a
side file; nothing is kept per token or per document in memory, so peak memory does not depend
on the corpus size (bench/data_prep.py measures it). A cache entry is found by the corpus
files' (path, size, mtime) and the tokenizer's identity, without re-reading the text; the
content hash is computed once, while preparing, and stored in meta.json.

A cache entry is used only after it matches its manifest (sizes and per-chunk hashes); a
damaged one is removed and prepared again, and temporary folders left by a killed preparation
are removed first (gptplan.cachedirs), each with one line saying so.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NotRequired, TypedDict

import numpy as np

from gptplan import cachedirs, userdata
from gptplan.corpus import (
    CorpusStats,
    default_dedupe,
    iter_documents,
    resolve_sources,
    source_key,
    split_long,
    total_bytes,
)
from gptplan.diskspace import guard_disk_writes
from gptplan.errors import DataError
from gptplan.plan import JobSection, Plan
from gptplan.progress import Log
from gptplan.progress import bar as progress_bar
from gptplan.tokenizer import (
    FastEncoder,
    JobTokenizer,
    check_vocab,
    default_workers,
    ensure_tokenizer,
    load_tokenizer,
    model_file_of,
    read_manifest,
)
from runner.datacache import FORMAT, VERSION, PreparedData, verify, write_manifest

CHUNK_CHARS = 64_000  # characters per unit of work handed to a worker
INFLIGHT_PER_WORKER = 4  # chunks queued or being tokenized per worker (bounds memory)
THROUGHPUT_FILE = "prep_throughput.json"


# this worker's encoder, or why it failed to load (raised by the first task)
_worker_encoder: FastEncoder | _SlowEncoder | Exception | None = None


def _init_worker(spec: str, model_dir: str | None) -> None:
    """A pool worker: the default signal mask and actions (a caller that blocks SIGTERM/SIGINT,
    as the runner does while it starts, passes the block on through spawn; Pool.terminate()
    must always end the workers), a quiet console, then its encoder."""
    from gptplan.lifeline import default_signal_state
    from gptplan.tokenizer import _worker_quiet

    default_signal_state()
    _worker_quiet()
    _load_encoder(spec, model_dir)


def _load_encoder(spec: str, model_dir: str | None) -> None:
    """Load the encoder; a failure is kept and raised by the first task (a pool whose
    initializer raises would restart its workers forever)."""
    global _worker_encoder
    try:
        if model_dir:
            _worker_encoder = FastEncoder(Path(model_dir))
        else:
            _worker_encoder = _SlowEncoder(load_tokenizer(spec))
    except Exception as exc:  # noqa: BLE001 - re-raised in the parent through the first task
        _worker_encoder = exc


class _SlowEncoder:
    """A PaddleNLP tokenizer given by name or directory, one text at a time."""

    def __init__(self, tok: JobTokenizer):
        self.tok = tok
        self.dtype = np.uint16 if tok.vocab_size < 65535 else np.int32

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(self.tok.encode(t), dtype=self.dtype) for t in texts]


# A chunk for a tokenizer worker: (text, starts a document, finishes it) pieces, and <eod>'s id
Chunk = tuple[list[tuple[str, bool, bool]], int]
# What a worker gives back: flat token ids, document end offsets in them, empty documents
Encoded = tuple[np.ndarray, np.ndarray, int]


class TokenizerInfo(TypedDict):
    """What the data cache records of the job's tokenizer (meta.json's tokenizer fields)."""

    eod_id: int
    pad_id: int
    vocab_size: int
    identity: str  # content fingerprint: part of the cache key
    name: str
    scheme: str  # 'cpm' or 'bpe' for a trained tokenizer, '' for a PaddleNLP one
    script_mix: NotRequired[dict | None]  # a trained one's sample (its manifest's)


def _encode_items(job: Chunk) -> Encoded:
    """Tokenize one chunk: (flat ids with <eod> after each finished document, end offsets of
    the finished documents within flat, documents that tokenized to nothing)."""
    items, eod = job
    enc = _worker_encoder
    if isinstance(enc, Exception) or enc is None:
        raise DataError(
            f"the tokenizer worker could not load the tokenizer: {enc!r}", key="job.tokenizer"
        )
    ids = enc.encode_batch([text for text, _, _ in items])
    parts, ends, empty, pos = [], [], 0, 0
    eod_arr = np.asarray([eod], dtype=enc.dtype)
    for (_, starts, finishes), arr in zip(items, ids, strict=True):
        if starts and finishes and arr.size == 0:
            empty += 1
            continue
        parts.append(arr)
        pos += arr.size
        if finishes:
            parts.append(eod_arr)
            pos += 1
            ends.append(pos)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=enc.dtype)
    return flat, np.asarray(ends, dtype=np.int64), empty


def _chunks(documents: Iterable[str], eod: int) -> Iterator[Chunk]:
    """Group documents into chunks of about CHUNK_CHARS; cut longer documents into pieces."""
    items, chars = [], 0
    for doc in documents:
        pieces = split_long(doc, CHUNK_CHARS)
        for i, piece in enumerate(pieces):
            items.append((piece, i == 0, i == len(pieces) - 1))
            chars += len(piece)
            if chars >= CHUNK_CHARS:
                yield items, eod
                items, chars = [], 0
    if items:
        yield items, eod


def _tokenizer_info(tokenizer: str, directory: Path | None) -> TokenizerInfo:
    """eod/pad ids, vocabulary size and identity, without importing Paddle for trained ones."""
    if directory is None:
        tok = load_tokenizer(tokenizer)
        return {
            "eod_id": tok.eod_id,
            "pad_id": tok.pad_id,
            "vocab_size": tok.vocab_size,
            "identity": tok.fingerprint,
            "name": tok.name,
            "scheme": "",
        }
    m = read_manifest(directory)
    enc = FastEncoder(directory)
    if m["scheme"] == "cpm":
        eod, pad = enc.sp.piece_to_id("<eod>"), enc.sp.pad_id()
    else:
        eod = enc.bpe.token_to_id("<|endoftext|>")
        pad = eod
    return {
        "eod_id": int(eod),
        "pad_id": int(pad),
        "vocab_size": enc.vocab_size,
        "identity": m["identity"],
        "name": f"{m['scheme']}:{directory.name}",
        "scheme": m["scheme"],
        "script_mix": m.get("script_mix"),
    }


# What a user points elsewhere when the cache's device is full (not job.output_dir)
CACHE_SETTING = "job.cache_dir (or --data-dir)"


def prepare_data(
    plan: Plan, *, workers: int | None = None, log: Log = print, progress: bool = True
) -> PreparedData:
    """Read, tokenize and store the corpus once, streaming; later calls reuse the cache."""
    job = plan.job
    paths = resolve_sources(job.corpus)
    dedupe = default_dedupe(job.corpus)
    corpus_key = source_key(paths, max_documents=job.max_documents, dedupe=dedupe)
    workers = workers or default_workers()
    with guard_disk_writes(userdata.cache_dir(job.cache_dir) / "tokenizers", setting=CACHE_SETTING):
        directory = ensure_tokenizer(
            tokenizer=job.tokenizer,
            vocab_size=job.tokenizer_vocab_size or plan.model.vocab_size,
            cache_dir=userdata.cache_dir(job.cache_dir),
            patterns=job.corpus,
            max_documents=job.max_documents,
            workers=workers,
            log=log,
        )
    info = _tokenizer_info(job.tokenizer, directory)
    check_vocab(info["vocab_size"], plan.model.vocab_size)
    key = hashlib.sha256(f"{corpus_key}|{info['identity']}|{FORMAT}{VERSION}".encode()).hexdigest()[
        :20
    ]
    out = userdata.cache_dir(job.cache_dir) / "data" / key
    cachedirs.remove_stale(out.parent, log=log)
    found = _verified(out, log=log)
    if found is not None:
        log(
            f"reusing prepared data {out} (corpus files unchanged: same paths, sizes and "
            f"modification times; tokenizer {info['identity']}; every chunk matches its hash)"
        )
        return found
    # ENOSPC anywhere in preparing (tokens.bin, docs.npy, the manifest) is one line naming
    # the folder and the bytes the entry needs (modelled: job.corpus_tokens when the planner
    # measured them, else at most one token id per corpus byte)
    with (
        guard_disk_writes(
            out.parent, needed_bytes=entry_bytes(plan, paths, info), setting=CACHE_SETTING
        ),
        cachedirs.writing(out.parent, key) as tmp,
    ):
        meta = _stream_prepare(
            paths,
            tmp,
            job=job,
            dedupe=dedupe,
            info=info,
            model_dir=directory,
            workers=workers,
            log=log,
            progress=progress,
        )
        write_manifest(tmp)
        cachedirs.publish(tmp, out)
    _record_throughput(userdata.cache_dir(job.cache_dir), meta)
    return PreparedData(out, meta)


def entry_bytes(plan: Plan, paths: list[Path], info: TokenizerInfo) -> int:
    """Bytes a cache entry needs (modelled): token ids of the corpus plus slack for docs.npy
    and meta.json; from the planner's job.corpus_tokens, else one token per corpus byte (an
    upper bound: no tokenizer makes more tokens than bytes)."""
    itemsize = 2 if info["vocab_size"] < 65535 else 4
    size = total_bytes(paths)
    tokens = min(plan.job.corpus_tokens, size) if plan.job.corpus_tokens > 0 else size
    return int(tokens * itemsize + size // 8 + (1 << 20))


def _verified(out: Path, *, log: Log) -> PreparedData | None:
    """The cache entry at `out` if it matches its manifest; a damaged one is removed (it is
    derived data: preparing it again gives the same bytes), with one line saying why."""
    if not out.exists() and not out.is_symlink():
        return None
    problem = verify(out) if out.is_dir() else "it is not a folder"
    if problem is None:
        return PreparedData(out, json.loads((out / "meta.json").read_text()))
    log(f"prepared data {out} is damaged ({problem}); removed it, preparing again")
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    else:
        out.unlink()
    return None


def _stream_prepare(
    paths: list[Path],
    tmp: Path,
    *,
    job: JobSection,
    dedupe: bool,
    info: TokenizerInfo,
    model_dir: Path | None,
    workers: int,
    log: Log,
    progress: bool,
) -> dict:
    stats = CorpusStats()
    size = total_bytes(paths)
    log(
        f"preparing data: {len(paths)} file(s), {size / 1e6:,.1f} MB, {workers} tokenizer "
        f"worker(s), tokenizer {info['name']}"
    )
    dtype = np.uint16 if info["vocab_size"] < 65535 else np.int32
    t0 = time.perf_counter()
    cpu0 = _cpu_seconds()
    # bytes read and tokenized (the two are pipelined), MB/s, ETA; documents as a postfix: a
    # bar on a terminal; elsewhere (a log file) a log line every 30 s, never on stderr, so a
    # quick failure stays one error line whatever the machine's load (gptplan.progress).
    bar = progress_bar(total=size, unit="B", desc="reading + tokenizing", log=log, enabled=progress)
    docs_iter = iter_documents(
        paths, stats, dedupe=dedupe, max_documents=job.max_documents, progress=bar.update
    )
    chunks = _chunks(docs_iter, info["eod_id"])
    num_tokens = num_docs = empty = 0
    with open(tmp / "tokens.bin", "wb") as tokens_out, open(tmp / "ends.i64", "wb") as ends_out:

        def write(result: Encoded) -> None:
            nonlocal num_tokens, num_docs, empty
            flat, ends, n_empty = result
            if flat.dtype != dtype:
                flat = flat.astype(dtype)
            tokens_out.write(flat.tobytes())
            (ends + num_tokens).tofile(ends_out)
            num_tokens += int(flat.size)
            num_docs += int(ends.size)
            empty += n_empty
            bar.set_postfix_str(f"{stats.documents:,} docs", refresh=False)

        if workers <= 1:
            _load_encoder(job.tokenizer, str(model_dir) if model_dir else None)
            for chunk in chunks:
                write(_encode_items(chunk))
        else:
            _run_pool(chunks, write, workers=workers, spec=job.tokenizer, model_dir=model_dir)
    bar.close()
    seconds = time.perf_counter() - t0
    cpu = _cpu_seconds() - cpu0  # this process + its reaped workers: load-independent
    if num_docs == 0:
        raise DataError(
            f"every document tokenized to nothing ({stats.summary()})", key="job.corpus"
        )
    _write_offsets(tmp, num_docs)
    meta = _meta(
        stats,
        info,
        model_dir,
        dtype=dtype,
        num_tokens=num_tokens,
        num_docs=num_docs,
        empty=empty,
        seconds=seconds,
        cpu=cpu,
        workers=workers,
    )
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
    log(
        f"prepared {num_tokens:,} tokens from {stats.summary()} in {seconds:.1f} s "
        f"({stats.bytes / 1e6 / max(seconds, 1e-9):.2f} MB/s measured)"
    )
    return meta


def _meta(
    stats: CorpusStats,
    info: TokenizerInfo,
    model_dir: Path | None,
    *,
    dtype: type[np.integer],
    num_tokens: int,
    num_docs: int,
    empty: int,
    seconds: float,
    cpu: float,
    workers: int,
) -> dict:
    """meta.json: format, counts, tokenizer, corpus statistics, measured throughput."""
    corpus_stats = stats.__dict__ | {"empty_after_tokenizing": empty}
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": np.dtype(dtype).name,
        "num_tokens": num_tokens,
        "num_documents": num_docs,
        "eod_id": info["eod_id"],
        "pad_id": info["pad_id"],
        "vocab_size": info["vocab_size"],
        "tokenizer": info["name"],
        "tokenizer_identity": info["identity"],
        "tokenizer_scheme": info["scheme"],
        "tokenizer_model": str(model_file_of(model_dir)) if model_dir else "",
        "tokens_per_character": (num_tokens - num_docs) / max(1, stats.characters),
        "corpus": corpus_stats,
        "preparation": {
            "seconds": round(seconds, 3),
            "bytes": stats.bytes,
            "workers": workers,
            "cpus": os.cpu_count() or 1,
            "bytes_per_second": stats.bytes / max(seconds, 1e-9),
            "cpu_seconds": round(cpu, 3),
            "bytes_per_cpu_second": stats.bytes / max(cpu, 1e-9),
        },
    }


def _write_offsets(tmp: Path, num_docs: int) -> None:
    """docs.npy from the side file of document ends: 0, then the end of every document (= the
    start of the next), copied in blocks (never all in memory)."""
    ends = np.memmap(tmp / "ends.i64", dtype=np.int64, mode="r", shape=(num_docs,))
    offsets = np.lib.format.open_memmap(
        tmp / "docs.npy", mode="w+", dtype=np.int64, shape=(num_docs + 1,)
    )
    offsets[0] = 0
    block = 1 << 20
    for i in range(0, num_docs, block):
        offsets[1 + i : 1 + i + block] = ends[i : i + block]
    offsets.flush()
    del offsets, ends
    (tmp / "ends.i64").unlink()


def _run_pool(
    chunks: Iterable[Chunk],
    write: Callable[[Encoded], None],
    *,
    workers: int,
    spec: str,
    model_dir: Path | None,
) -> None:
    """imap over a bounded generator: at most INFLIGHT_PER_WORKER chunks per worker are read
    ahead, so a fast reader never fills memory with text waiting for the tokenizers."""
    slots = threading.Semaphore(INFLIGHT_PER_WORKER * workers)
    stop = threading.Event()

    def bounded() -> Iterator[Chunk]:

        for chunk in chunks:
            slots.acquire()
            if stop.is_set():
                return
            yield chunk

    ctx = mp.get_context("spawn")  # fork after a paddle import is unsafe
    pool = ctx.Pool(
        workers, initializer=_init_worker, initargs=(spec, str(model_dir) if model_dir else None)
    )
    try:
        for result in pool.imap(_encode_items, bounded()):
            slots.release()
            write(result)
        pool.close()
    except BaseException:
        stop.set()
        for _ in range(INFLIGHT_PER_WORKER * workers + 1):
            slots.release()
        pool.terminate()
        raise
    finally:
        pool.join()


def _cpu_seconds() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _record_throughput(cache_dir: Path, meta: dict) -> None:
    """Keep the last measured preparation throughput per tokenizer scheme (the planner uses it
    to put data preparation into the plan)."""
    from gptplan.tomlconf import write_text_atomic

    prep = meta["preparation"]
    if prep["bytes"] < 1e6:  # too small to say anything about throughput
        return
    from gptplan.userdata import read_json_record

    path = cache_dir / THROUGHPUT_FILE
    data = read_json_record(path, what="measured data-preparation rate") or {}
    data[meta["tokenizer_scheme"] or "other"] = {
        # per CPU-second of the whole process tree: what one core does, whatever the load
        "bytes_per_second_per_core": prep["bytes_per_cpu_second"],
        "bytes": prep["bytes"],
        "workers": prep["workers"],
        "cpus": prep["cpus"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_text_atomic(path, json.dumps(data, indent=1))


def truncation_loss(data: PreparedData, seq_len: int) -> float:
    """Share of the tokens a non-packed run never sees: each document is cut to seq_len + 1."""
    offsets = np.load(data.path / "docs.npy", mmap_mode="r", allow_pickle=False)
    lengths = np.diff(offsets)
    total = int(lengths.sum())
    return float(1.0 - np.minimum(lengths, seq_len + 1).sum() / total) if total else 0.0
