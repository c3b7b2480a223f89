"""Prepare the corpus once (tokenize, store token ids), then serve deterministic batches.

On-disk format (one folder per corpus + tokenizer, written to a temp folder then renamed):
  tokens.bin   raw token ids, little-endian uint16 (vocab < 65535) or int32, documents
               concatenated, each followed by <eod>;
  docs.npy     int64 offsets of each document's first token, plus the total length at the end;
  meta.json    {"format": "gptplan-tokens", "version": 2, dtype, num_tokens, num_documents,
               eod_id, pad_id, vocab_size, tokenizer, corpus statistics, preparation
               throughput}.
Reading memory-maps tokens.bin; the seq_len-dependent sample index is computed at load time.

Preparation streams: the main process reads the corpus and hands chunks of about
`CHUNK_CHARS` characters to tokenizer worker processes (at most `INFLIGHT_PER_WORKER` chunks per
worker in flight), and appends the ids they return to tokens.bin and the document ends to a
side file; nothing is kept per token or per document in memory, so peak memory does not depend
on the corpus size (bench/data_prep.py measures it). A cache entry is found by the corpus
files' (path, size, mtime) and the tokenizer's identity, without re-reading the text; the
content hash is computed once, while preparing, and stored in meta.json.

Packing (`training.packing = true`): sample i is tokens[i*s : i*s + s + 1] across document
boundaries, split into input and shifted labels; no token is padding. Unpacked: sample i is
document i truncated to s+1 tokens and padded; padded label positions are -100 (ignored) and
counted separately, unlike `paddle.numel(input_ids)` which counts padding as training tokens.

Order: a permutation of the samples per epoch from (seed, epoch) alone. Optimizer step k takes
global samples [k*G, (k+1)*G); micro-step j of batch rank r takes the b samples starting at
k*G + (j*R + r)*b. So every rank can compute any step's data, and a resumed run continues at
the exact next sample.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptplan.corpus import (CorpusStats, default_dedupe, iter_documents,
                           resolve_sources, source_key, split_long,
                           total_bytes)
from gptplan.errors import DataError
from gptplan.plan import Plan
from gptplan.tokenizer import (FastEncoder, JobTokenizer, check_vocab, default_workers,
                              ensure_tokenizer, load_tokenizer, model_file_of,
                              read_manifest)

FORMAT = "gptplan-tokens"
VERSION = 2
IGNORE_INDEX = -100
CHUNK_CHARS = 64_000        # characters per unit of work handed to a worker
INFLIGHT_PER_WORKER = 4     # chunks queued or being tokenized per worker (bounds memory)
THROUGHPUT_FILE = "prep_throughput.json"


# ---- preparation ---------------------------------------------------------------------------

@dataclass
class PreparedData:
    path: Path
    meta: dict

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])


_worker_encoder = None


def _init_worker(spec: str, model_dir: str | None) -> None:
    """Load the encoder; a failure is kept and raised by the first task (a pool whose
    initializer raises would restart its workers forever)."""
    global _worker_encoder
    import signal

    from gptplan.tokenizer import _worker_quiet

    # A caller that blocks SIGTERM/SIGINT (the runner does during start-up) passes the block on
    # through spawn; unblock so that Pool.terminate() can always end the workers.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))
    _worker_quiet()
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


def _encode_items(job: tuple[list[tuple[str, bool, bool]], int]):
    """Tokenize one chunk: (flat ids with <eod> after each finished document, end offsets of
    the finished documents within flat, documents that tokenized to nothing)."""
    items, eod = job
    enc = _worker_encoder
    if isinstance(enc, Exception) or enc is None:
        raise DataError(f"the tokenizer worker could not load the tokenizer: {enc!r}",
                        key="job.tokenizer")
    ids = enc.encode_batch([text for text, _, _ in items])
    parts, ends, empty, pos = [], [], 0, 0
    eod_arr = np.asarray([eod], dtype=enc.dtype)
    for (_, starts, finishes), arr in zip(items, ids):
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


def _chunks(documents, eod: int):
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


def _tokenizer_info(tokenizer: str, directory: Path | None) -> dict:
    """eod/pad ids, vocabulary size and identity, without importing Paddle for trained ones."""
    if directory is None:
        tok = load_tokenizer(tokenizer)
        return {"eod_id": tok.eod_id, "pad_id": tok.pad_id, "vocab_size": tok.vocab_size,
                "identity": tok.fingerprint, "name": tok.name, "scheme": ""}
    m = read_manifest(directory)
    enc = FastEncoder(directory)
    if m["scheme"] == "cpm":
        eod, pad = enc.sp.piece_to_id("<eod>"), enc.sp.pad_id()
    else:
        eod = enc.bpe.token_to_id("<|endoftext|>")
        pad = eod
    return {"eod_id": int(eod), "pad_id": int(pad), "vocab_size": enc.vocab_size,
            "identity": m["identity"], "name": f"{m['scheme']}:{directory.name}",
            "scheme": m["scheme"], "script_mix": m.get("script_mix")}


def prepare_data(plan: Plan, *, workers: int | None = None, log=print,
                 progress: bool = True) -> PreparedData:
    """Read, tokenize and store the corpus once, streaming; later calls reuse the cache."""
    job = plan.job
    paths = resolve_sources(job.corpus)
    dedupe = default_dedupe(job.corpus)
    corpus_key = source_key(paths, max_documents=job.max_documents, dedupe=dedupe)
    workers = workers or default_workers()
    directory = ensure_tokenizer(tokenizer=job.tokenizer, vocab_size=plan.model.vocab_size,
                                 cache_dir=job.cache_dir, patterns=job.corpus,
                                 max_documents=job.max_documents, workers=workers, log=log)
    info = _tokenizer_info(job.tokenizer, directory)
    check_vocab(info["vocab_size"], plan.model.vocab_size)
    key = hashlib.sha256(f"{corpus_key}|{info['identity']}|{FORMAT}{VERSION}"
                         .encode()).hexdigest()[:20]
    out = Path(job.cache_dir) / "data" / key
    if (out / "meta.json").exists():
        log(f"reusing prepared data {out} (corpus files unchanged: same paths, sizes and "
            f"modification times; tokenizer {info['identity']})")
        return PreparedData(out, json.loads((out / "meta.json").read_text()))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".", suffix=".tmp", dir=out.parent))
    try:
        meta = _stream_prepare(paths, tmp, job=job, dedupe=dedupe, info=info,
                               model_dir=directory, workers=workers, log=log,
                               progress=progress)
        if out.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _record_throughput(Path(job.cache_dir), meta)
    return PreparedData(out, meta)


def _stream_prepare(paths, tmp: Path, *, job, dedupe: bool, info: dict, model_dir,
                    workers: int, log, progress: bool) -> dict:
    from tqdm import tqdm

    stats = CorpusStats()
    size = total_bytes(paths)
    log(f"preparing data: {len(paths)} file(s), {size / 1e6:,.1f} MB, {workers} tokenizer "
        f"worker(s), tokenizer {info['name']}")
    dtype = np.uint16 if info["vocab_size"] < 65535 else np.int32
    t0 = time.perf_counter()
    cpu0 = _cpu_seconds()
    # bytes read and tokenized (the two are pipelined), MB/s, ETA; documents as a postfix.
    # Not a terminal (a log file): a line every 30 s instead of a live bar.
    # No bar in the first 5 s: a quick failure stays one error line.
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="reading + tokenizing", delay=5.0,
               mininterval=2.0 if sys.stderr.isatty() else 30.0, disable=not progress,
               leave=False)
    docs_iter = iter_documents(paths, stats, dedupe=dedupe, max_documents=job.max_documents,
                               progress=bar.update)
    chunks = _chunks(docs_iter, info["eod_id"])
    num_tokens = num_docs = empty = 0
    with open(tmp / "tokens.bin", "wb") as tokens_out, \
            open(tmp / "ends.i64", "wb") as ends_out:
        def write(result):
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
            _init_worker(job.tokenizer, str(model_dir) if model_dir else None)
            for chunk in chunks:
                write(_encode_items(chunk))
        else:
            _run_pool(chunks, write, workers=workers, spec=job.tokenizer, model_dir=model_dir)
    bar.close()
    seconds = time.perf_counter() - t0
    cpu = _cpu_seconds() - cpu0  # this process + its reaped workers: load-independent
    if num_docs == 0:
        raise DataError(f"every document tokenized to nothing ({stats.summary()})",
                        key="job.corpus")
    # docs.npy: 0, then the end of every document (= the start of the next)
    ends = np.memmap(tmp / "ends.i64", dtype=np.int64, mode="r", shape=(num_docs,))
    offsets = np.lib.format.open_memmap(tmp / "docs.npy", mode="w+", dtype=np.int64,
                                        shape=(num_docs + 1,))
    offsets[0] = 0
    block = 1 << 20
    for i in range(0, num_docs, block):
        offsets[1 + i:1 + i + block] = ends[i:i + block]
    offsets.flush()
    del offsets, ends
    (tmp / "ends.i64").unlink()
    corpus_stats = stats.__dict__ | {"empty_after_tokenizing": empty}
    meta = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name,
            "num_tokens": num_tokens, "num_documents": num_docs,
            "eod_id": info["eod_id"], "pad_id": info["pad_id"],
            "vocab_size": info["vocab_size"], "tokenizer": info["name"],
            "tokenizer_identity": info["identity"], "tokenizer_scheme": info["scheme"],
            "tokenizer_model": str(model_file_of(model_dir)) if model_dir else "",
            "tokens_per_character": (num_tokens - num_docs) / max(1, stats.characters),
            "corpus": corpus_stats,
            "preparation": {"seconds": round(seconds, 3), "bytes": stats.bytes,
                            "workers": workers, "cpus": os.cpu_count() or 1,
                            "bytes_per_second": stats.bytes / max(seconds, 1e-9),
                            "cpu_seconds": round(cpu, 3),
                            "bytes_per_cpu_second": stats.bytes / max(cpu, 1e-9)}}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
    log(f"prepared {num_tokens:,} tokens from {stats.summary()} in {seconds:.1f} s "
        f"({stats.bytes / 1e6 / max(seconds, 1e-9):.2f} MB/s measured)")
    return meta


def _run_pool(chunks, write, *, workers: int, spec: str, model_dir) -> None:
    """imap over a bounded generator: at most INFLIGHT_PER_WORKER chunks per worker are read
    ahead, so a fast reader never fills memory with text waiting for the tokenizers."""
    slots = threading.Semaphore(INFLIGHT_PER_WORKER * workers)
    stop = threading.Event()

    def bounded():
        for chunk in chunks:
            slots.acquire()
            if stop.is_set():
                return
            yield chunk

    ctx = mp.get_context("spawn")  # fork after a paddle import is unsafe
    pool = ctx.Pool(workers, initializer=_init_worker,
                    initargs=(spec, str(model_dir) if model_dir else None))
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
    path = cache_dir / THROUGHPUT_FILE
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        data = {}
    data[meta["tokenizer_scheme"] or "other"] = {
        # per CPU-second of the whole process tree: what one core does, whatever the load
        "bytes_per_second_per_core": prep["bytes_per_cpu_second"],
        "bytes": prep["bytes"], "workers": prep["workers"], "cpus": prep["cpus"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_text_atomic(path, json.dumps(data, indent=1))


def truncation_loss(data: PreparedData, seq_len: int) -> float:
    """Share of the tokens a non-packed run never sees: each document is cut to seq_len + 1."""
    offsets = np.load(data.path / "docs.npy", mmap_mode="r")
    lengths = np.diff(offsets)
    total = int(lengths.sum())
    return float(1.0 - np.minimum(lengths, seq_len + 1).sum() / total) if total else 0.0


def open_prepared(path: str | Path) -> PreparedData:
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except FileNotFoundError:
        raise DataError(f"{path} holds no prepared data (meta.json missing); run "
                        "'runner execute' without --data-dir to prepare it") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{path}: data format {meta.get('format')} v{meta.get('version')} is "
                        f"not {FORMAT} v{VERSION}; delete it to re-prepare")
    return PreparedData(path, meta)


# ---- batches -------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    input_ids: np.ndarray  # [b, s] int64
    labels: np.ndarray     # [b, s] int64, IGNORE_INDEX where padded
    real_tokens: int       # label positions that are real text
    padded_tokens: int     # label positions that are padding


class TokenDataset:
    """Samples of seq_len+1 tokens from prepared data, packed or padded per document."""

    def __init__(self, data: PreparedData, *, seq_len: int, packing: bool):
        self.seq_len = seq_len
        self.packing = packing
        meta = data.meta
        self.tokens = np.memmap(data.path / "tokens.bin", dtype=meta["dtype"], mode="r")
        self.doc_offsets = np.load(data.path / "docs.npy")
        self.pad_id = int(meta["pad_id"])
        if packing:
            self.num_samples = (len(self.tokens) - 1) // seq_len
        else:
            self.num_samples = len(self.doc_offsets) - 1
        if self.num_samples < 1:
            raise DataError(f"the corpus has {len(self.tokens)} tokens, fewer than one sample "
                            f"of seq_len + 1 = {seq_len + 1}; lower training.seq_len or add "
                            "text", key="training.seq_len")

    def sample_real_tokens(self, index: int) -> int:
        if self.packing:
            return self.seq_len
        length = int(self.doc_offsets[index + 1] - self.doc_offsets[index])
        return min(length, self.seq_len + 1) - 1

    def sample(self, index: int) -> tuple[np.ndarray, int]:
        """(seq_len+1 token ids, number of real label positions)."""
        s = self.seq_len
        if self.packing:
            window = np.asarray(self.tokens[index * s:index * s + s + 1], dtype=np.int64)
            return window, s
        start, end = int(self.doc_offsets[index]), int(self.doc_offsets[index + 1])
        doc = np.asarray(self.tokens[start:min(end, start + s + 1)], dtype=np.int64)
        window = np.full(s + 1, self.pad_id, dtype=np.int64)
        window[:len(doc)] = doc
        return window, len(doc) - 1


class DeterministicSampler:
    """Maps (step, micro-step, batch rank) to sample indices from (seed, epoch) alone."""

    def __init__(self, num_samples: int, *, seed: int, micro_batch: int, accumulation: int,
                 batch_ranks: int):
        self.num_samples = num_samples
        self.seed = seed
        self.micro_batch = micro_batch
        self.accumulation = accumulation
        self.batch_ranks = batch_ranks
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.batch_ranks

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, start: int, count: int) -> list[int]:
        out = []
        for g in range(start, start + count):
            epoch, pos = divmod(g, self.num_samples)
            out.append(int(self._permutation(epoch)[pos]))
        return out

    def micro_batch_indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = step * self.global_batch + (micro * self.batch_ranks + rank) * self.micro_batch
        return self.global_indices(start, self.micro_batch)

    def step_indices(self, step: int) -> list[int]:
        return self.global_indices(step * self.global_batch, self.global_batch)

    def epoch_at(self, step: int) -> float:
        return step * self.global_batch / self.num_samples


class BatchSource:
    """What the training loop asks for: a micro-batch, and the global token counts of a step."""

    def __init__(self, dataset: TokenDataset, sampler: DeterministicSampler, *, rank: int):
        self.dataset = dataset
        self.sampler = sampler
        self.rank = rank

    def micro_batch(self, step: int, micro: int) -> MicroBatch:
        windows, real = [], 0
        for index in self.sampler.micro_batch_indices(step, micro, self.rank):
            window, n = self.dataset.sample(index)
            windows.append(window)
            real += n
        batch = np.stack(windows)
        inputs, labels = batch[:, :-1].copy(), batch[:, 1:].copy()
        if not self.dataset.packing:
            positions = np.arange(self.dataset.seq_len)[None, :]
            lengths = np.array([self.dataset.sample_real_tokens(i) for i in
                                self.sampler.micro_batch_indices(step, micro, self.rank)])
            labels[positions >= lengths[:, None]] = IGNORE_INDEX
        total = labels.size
        return MicroBatch(inputs, labels, real, total - real)

    def step_token_counts(self, step: int) -> tuple[int, int]:
        """(real, padded) label tokens of the whole global batch of `step`, on every rank."""
        if self.dataset.packing:
            return self.sampler.global_batch * self.dataset.seq_len, 0
        real = sum(self.dataset.sample_real_tokens(i) for i in self.sampler.step_indices(step))
        total = self.sampler.global_batch * self.dataset.seq_len
        return real, total - real
