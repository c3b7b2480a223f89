"""Serve deterministic batches from a prepared corpus (runner.datacache holds the format).

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

from dataclasses import dataclass

import numpy as np

from gptplan.errors import DataError
from runner.datacache import PreparedData

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    input_ids: np.ndarray  # [b, s] int64
    labels: np.ndarray  # [b, s] int64, IGNORE_INDEX where padded
    real_tokens: int  # label positions that are real text
    padded_tokens: int  # label positions that are padding


class TokenDataset:
    """Samples of seq_len+1 tokens from prepared data, packed or padded per document."""

    def __init__(self, data: PreparedData, *, seq_len: int, packing: bool):
        self.seq_len = seq_len
        self.packing = packing
        meta = data.meta
        self.tokens = np.memmap(data.path / "tokens.bin", dtype=meta["dtype"], mode="r")
        self.doc_offsets = np.load(data.path / "docs.npy", allow_pickle=False)
        self.pad_id = int(meta["pad_id"])
        if packing:
            self.num_samples = (len(self.tokens) - 1) // seq_len
        else:
            self.num_samples = len(self.doc_offsets) - 1
        if self.num_samples < 1:
            raise DataError(
                f"the corpus has {len(self.tokens)} tokens, fewer than one sample "
                f"of seq_len + 1 = {seq_len + 1}; lower training.seq_len or add "
                "text",
                key="training.seq_len",
            )

    def sample_real_tokens(self, index: int) -> int:
        if self.packing:
            return self.seq_len
        length = int(self.doc_offsets[index + 1] - self.doc_offsets[index])
        return min(length, self.seq_len + 1) - 1

    def sample(self, index: int) -> tuple[np.ndarray, int]:
        """(seq_len+1 token ids, number of real label positions)."""
        s = self.seq_len
        if self.packing:
            window = np.asarray(self.tokens[index * s : index * s + s + 1], dtype=np.int64)
            return window, s
        start, end = int(self.doc_offsets[index]), int(self.doc_offsets[index + 1])
        doc = np.asarray(self.tokens[start : min(end, start + s + 1)], dtype=np.int64)
        window = np.full(s + 1, self.pad_id, dtype=np.int64)
        window[: len(doc)] = doc
        return window, len(doc) - 1


class DeterministicSampler:
    """Maps (step, micro-step, batch rank) to sample indices from (seed, epoch) alone."""

    def __init__(
        self, num_samples: int, *, seed: int, micro_batch: int, accumulation: int, batch_ranks: int
    ):
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
        if self._perm is None or epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, start: int, count: int) -> list[int]:
        out = []
        for g in range(start, start + count):
            epoch, pos = divmod(g, self.num_samples)
            out.append(int(self._permutation(epoch)[pos]))
        return out

    def micro_batch_indices(self, step: int, micro_step: int, rank: int) -> list[int]:
        start = step * self.global_batch + (micro_step * self.batch_ranks + rank) * self.micro_batch
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

    def micro_batch(self, step: int, micro_step: int) -> MicroBatch:
        windows, real = [], 0
        for index in self.sampler.micro_batch_indices(step, micro_step, self.rank):
            window, n = self.dataset.sample(index)
            windows.append(window)
            real += n
        batch = np.stack(windows)
        inputs, labels = batch[:, :-1].copy(), batch[:, 1:].copy()
        if not self.dataset.packing:
            positions = np.arange(self.dataset.seq_len)[None, :]
            lengths = np.array(
                [
                    self.dataset.sample_real_tokens(i)
                    for i in self.sampler.micro_batch_indices(step, micro_step, self.rank)
                ]
            )
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
