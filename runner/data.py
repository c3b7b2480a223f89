"""Prepare the corpus once (tokenize, store token ids), then serve deterministic batches.

On-disk format (one folder per corpus hash + tokenizer, written to a temp folder then renamed):
  tokens.bin   raw token ids, little-endian uint16 (vocab < 65535) or int32, documents
               concatenated, each followed by <eod>;
  docs.npy     int64 offsets of each document's first token, plus the total length at the end;
  meta.json    {"format": "gptplan-tokens", "version": 1, dtype, num_tokens, num_documents,
               eod_id, pad_id, vocab_size, tokenizer, corpus statistics}.
Reading memory-maps tokens.bin; the seq_len-dependent sample index is computed at load time.

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
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.corpus import Corpus, read_corpus
from runner.errors import DataError
from runner.plan import Plan
from runner.tokenizer import JobTokenizer, load_tokenizer, train_sentencepiece

FORMAT = "gptplan-tokens"
VERSION = 1
IGNORE_INDEX = -100


# ---- preparation ---------------------------------------------------------------------------

@dataclass
class PreparedData:
    path: Path
    meta: dict

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])


_worker_tokenizer: JobTokenizer | None = None


def _init_worker(spec: str, model_file: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(spec, model_file=Path(model_file) if model_file else None)


def _encode_chunk(docs: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None
    return [_worker_tokenizer.encode(d) for d in docs]


def tokenize_documents(documents: list[str], spec: str, model_file: Path | None,
                       *, workers: int) -> list[list[int]]:
    """Tokenize in worker processes; output order equals input order."""
    chunk = 256
    chunks = [documents[i:i + chunk] for i in range(0, len(documents), chunk)]
    if workers <= 1 or len(chunks) == 1:
        _init_worker(spec, str(model_file) if model_file else None)
        return [ids for c in chunks for ids in _encode_chunk(c)]
    ctx = mp.get_context("spawn")  # fork after paddle import is unsafe
    with ctx.Pool(workers, initializer=_init_worker,
                  initargs=(spec, str(model_file) if model_file else None)) as pool:
        return [ids for part in pool.imap(_encode_chunk, chunks) for ids in part]


def job_tokenizer(*, tokenizer: str, vocab_size: int, cache_dir: str | Path,
                  corpus: Corpus) -> tuple[JobTokenizer, Path | None]:
    """The job's tokenizer; trains (or reuses) the sentencepiece model when asked to.

    Shared by the runner (data preparation) and the planner (corpus statistics), so both
    measure with the same tokenizer from the same cache.
    """
    model_file = None
    if tokenizer == "sentencepiece":
        key = f"{corpus.stats.sha256[:16]}-v{vocab_size}"
        model_file = train_sentencepiece(corpus.documents, vocab_size=vocab_size,
                                         out_dir=Path(cache_dir) / "tokenizers" / key)
    tok = load_tokenizer(tokenizer, model_file=model_file)
    if tok.vocab_size > vocab_size:
        raise DataError(f"{vocab_size} is smaller than the tokenizer's vocabulary "
                        f"({tok.vocab_size}); allowed: >= {tok.vocab_size}",
                        key="model.vocab_size")
    return tok, model_file


def prepare_data(plan: Plan, *, workers: int | None = None, log=print) -> PreparedData:
    """Read, tokenize and store the corpus once; later calls reuse the cache."""
    corpus = read_corpus(plan.job.corpus, max_documents=plan.job.max_documents)
    tok, model_file = job_tokenizer(tokenizer=plan.job.tokenizer,
                                    vocab_size=plan.model.vocab_size,
                                    cache_dir=plan.job.cache_dir, corpus=corpus)
    key = hashlib.sha256(f"{corpus.stats.sha256}|{tok.fingerprint}|{FORMAT}{VERSION}"
                         .encode()).hexdigest()[:20]
    out = Path(plan.job.cache_dir) / "data" / key
    if (out / "meta.json").exists():
        return PreparedData(out, json.loads((out / "meta.json").read_text()))
    log(f"preparing data: {corpus.stats.summary()}")
    workers = workers or max(1, min(os.cpu_count() or 1, 8))
    encoded = tokenize_documents(corpus.documents, plan.job.tokenizer, model_file,
                                 workers=workers)
    dtype = np.uint16 if tok.vocab_size < 65535 else np.int32
    lengths = np.array([len(ids) + 1 for ids in encoded], dtype=np.int64)
    keep = lengths > 1  # a document that tokenizes to nothing is dropped and counted
    offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths[keep])
    flat = np.empty(int(offsets[-1]), dtype=dtype)
    pos = 0
    for ids, k in zip(encoded, keep):
        if k:
            flat[pos:pos + len(ids)] = ids
            flat[pos + len(ids)] = tok.eod_id
            pos += len(ids) + 1
    stats = corpus.stats.__dict__ | {"empty_after_tokenizing": int((~keep).sum())}
    meta = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name,
            "num_tokens": int(flat.size), "num_documents": int(keep.sum()),
            "eod_id": tok.eod_id, "pad_id": tok.pad_id, "vocab_size": tok.vocab_size,
            "tokenizer": tok.name, "tokenizer_model": str(model_file) if model_file else "",
            "tokens_per_character": float(flat.size - keep.sum()) / max(1, corpus.stats
                                                                        .characters),
            "corpus": stats}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".", suffix=".tmp", dir=out.parent))
    try:
        flat.tofile(tmp / "tokens.bin")
        np.save(tmp / "docs.npy", offsets)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        if out.exists():
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PreparedData(out, meta)


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
