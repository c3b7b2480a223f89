"""The job's tokenizer: trained offline on a bounded sample of the corpus, or a given one.

`job.tokenizer = "sentencepiece"` trains one, choosing the scheme from the sample's script mix
(and saying which):

- **cpm** (mostly CJK text): CPM's scheme, loaded with PaddleNLP's `GPTChineseTokenizer`: jieba
  segments the text, space and newline become the pieces U+2582 and U+2583, the words are joined
  with spaces and encoded by a unigram sentencepiece model. Trained here with identity
  normalisation (full-width characters stay full-width), byte fallback (a rare character
  becomes its UTF-8 bytes, never `<unk>`) and "▁▂" (word separator + space) as one
  user-defined piece, so a space costs one piece instead of two ("▁", "▂"). Every text
  decodes back exactly.
- **bpe** (mostly Latin or other scripts): a GPT-2-style byte-level BPE (trained with the
  `tokenizers` package, loaded with PaddleNLP's `GPTTokenizer`): exact round trip by
  construction, and jieba's word splitting does not cost English a piece per space.

Training reads at most `SAMPLE_CHARS` characters (a random sample; see
`gptplan.corpus.sample_documents`), runs jieba on that sample in parallel, and gives
sentencepiece at most `MAX_SENTENCES` sentences, so its time and memory do not grow with the
corpus. A trained tokenizer is identified by what defines it (pieces, scores, normalisation;
vocabulary and merges), not by incidental file bytes.

Encoding for data preparation (`FastEncoder`) uses jieba + sentencepiece or `tokenizers`
directly, without importing Paddle, and gives the same ids as the PaddleNLP classes (tested).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from gptplan import cachedirs, progress
from gptplan.corpus import Corpus, default_dedupe, resolve_sources, sample_documents, source_key
from gptplan.errors import DataError
from gptplan.progress import Log

Advance = Callable[[int], object]  # reports work done (characters): a progress bar's update

TOKENIZER_VERSION = 2
SAMPLE_CHARS = 12_000_000  # characters of corpus read to train a tokenizer
MAX_SENTENCES = 2_000_000  # sentencepiece's input_sentence_size
TRAIN_PIECE_CHARS = 4_000  # documents are cut into pieces this long for training
CJK_SHARE_FOR_CPM = 0.3  # share of letters that are CJK above which the CPM scheme is used
# begin and end of document; space and newline each as one piece together with the word
# separator before them ("▁▂" instead of "▁" + "▂"), and alone as a fallback
SPECIAL_PIECES = ["<bod>", "<eod>", "\u2581\u2582", "\u2581\u2583", "\u2582", "\u2583"]
EOT = "<|endoftext|>"
_TRANSLATE = str.maketrans(" \n", "\u2582\u2583")


def _quiet_jieba() -> ModuleType:
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def cpm_segment(text: str) -> str:
    """The text GPTChineseTokenizer hands to sentencepiece (same rule as its `_tokenize`:
    `jieba.cut`, through gptplan.segment's C kernels when jieba_fast is installed)."""
    from gptplan import segment

    return " ".join(word.translate(_TRANSLATE) for word in segment.cut(text))


def _segment_many(texts: list[str]) -> list[str]:
    return [cpm_segment(t) for t in texts]


# ---- script mix ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScriptMix:
    letters: int
    cjk_share: float
    latin_share: float
    other_share: float

    @property
    def scheme(self) -> str:
        return "cpm" if self.cjk_share >= CJK_SHARE_FOR_CPM else "bpe"

    def describe(self) -> str:
        why = (
            f"CJK >= {CJK_SHARE_FOR_CPM:.0%} of letters: CPM-style jieba + sentencepiece "
            "unigram, byte fallback"
            if self.scheme == "cpm"
            else f"CJK < {CJK_SHARE_FOR_CPM:.0%} of letters: GPT-2-style byte-level BPE"
        )
        return (
            f"script mix of the sample: {self.cjk_share:.0%} CJK, {self.latin_share:.0%} "
            f"Latin, {self.other_share:.0%} other letters -> {why}"
        )


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return (
        0x4E00 <= o <= 0x9FFF
        or 0x3400 <= o <= 0x4DBF
        or 0x20000 <= o <= 0x2FA1F
        or 0x3040 <= o <= 0x30FF
        or 0xAC00 <= o <= 0xD7AF
        or 0xF900 <= o <= 0xFAFF
    )


def script_mix(documents: list[str], *, max_chars: int = 2_000_000) -> ScriptMix:
    cjk = latin = other = 0
    seen = 0
    for doc in documents:
        for ch in doc:
            if _is_cjk(ch):
                cjk += 1
            elif ch.isalpha():
                if ch.isascii() or unicodedata.name(ch, "").startswith("LATIN"):
                    latin += 1
                else:
                    other += 1
        seen += len(doc)
        if seen >= max_chars:
            break
    letters = max(1, cjk + latin + other)
    return ScriptMix(cjk + latin + other, cjk / letters, latin / letters, other / letters)


# ---- training --------------------------------------------------------------------------------


def _training_pieces(documents: list[str]) -> list[str]:
    from gptplan.corpus import split_long

    return [p for d in documents for p in split_long(d, TRAIN_PIECE_CHARS)]


def _segment_parallel(pieces: list[str], workers: int, progress: Advance) -> list[str]:
    chunk = 2000
    chunks = [pieces[i : i + chunk] for i in range(0, len(pieces), chunk)]
    out: list[str] = []
    if workers <= 1 or len(chunks) <= 2:
        for c in chunks:
            out.extend(_segment_many(c))
            progress(sum(len(t) for t in c))
        return out
    with mp.get_context("spawn").Pool(workers, initializer=_pool_worker_init) as pool:
        for c, seg in zip(chunks, pool.imap(_segment_many, chunks)):
            out.extend(seg)
            progress(sum(len(t) for t in c))
    return out


def _pool_worker_init() -> None:
    """A pool worker ends on SIGTERM whatever signal mask its starter had (the runner blocks
    SIGTERM/SIGINT while it starts; spawn passes the mask on through exec): without this,
    Pool.terminate() cannot end it and the pool's join waits for good."""
    from gptplan.lifeline import default_signal_state

    default_signal_state()
    _worker_quiet()


def _worker_quiet() -> None:
    """Tokenizer workers print nothing to the console (no Paddle, setuptools or jieba noise)."""
    import warnings

    warnings.filterwarnings("ignore")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    _quiet_jieba()


def _character_coverage(texts: list[str], vocab_size: int) -> float:
    """0.995, or less when the sample's frequent characters would not leave room for words:
    with byte fallback, a character outside the coverage is spelt as its UTF-8 bytes."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for t in texts:
        counts.update(t)
    room = max(50, (vocab_size - 256 - len(SPECIAL_PIECES) - 3) * 2 // 3)
    freqs = sorted(counts.values(), reverse=True)
    total = sum(freqs) or 1
    if len(freqs) <= room:
        return 0.995
    return max(0.98, min(0.995, sum(freqs[:room]) / total * 0.999))  # sentencepiece: >= 0.98


# The last segmented training sample, kept while `keep_segmentation()` is active: tokenizers of
# several vocabulary sizes on one sample (planner.corpus.corpus_stats's vocabulary fit) segment it
# once.
_SEGMENTED: dict = {"active": 0, "key": None, "text": None}


@contextlib.contextmanager
def keep_segmentation() -> Iterator[None]:
    """Within this block, training on the same sample again reuses its jieba segmentation
    (the same words, so the same tokenizer as segmenting again); released at the end."""
    _SEGMENTED["active"] += 1
    try:
        yield
    finally:
        _SEGMENTED["active"] -= 1
        if not _SEGMENTED["active"]:
            _SEGMENTED["key"] = _SEGMENTED["text"] = None


def _segmented(pieces: list[str], workers: int, progress: Advance) -> list[str]:
    if not _SEGMENTED["active"]:
        return _segment_parallel(pieces, workers, progress)
    digest = hashlib.sha256()
    for p in pieces:
        digest.update(p.encode("utf-8", "surrogatepass") + b"\0")
    key = digest.hexdigest()
    if _SEGMENTED["key"] != key:
        _SEGMENTED["key"], _SEGMENTED["text"] = key, _segment_parallel(pieces, workers, progress)
    return _SEGMENTED["text"]


# The child that trains a sentencepiece model: its options as JSON on stdin.
SPM_CHILD = (
    "import json, sys, sentencepiece as spm; spm.SentencePieceTrainer.train(**json.load(sys.stdin))"
)


def train_in_child(**options: object) -> None:
    """sentencepiece's trainer (one long native call, minutes on a long-lined corpus, that no
    Python signal handler can interrupt) in a child process in a group of its own, dying with
    this one: a SIGTERM or SIGINT to this process runs its handler at once (the wait here is
    interruptible) and the child's group is SIGKILLed on the way out. RuntimeError (its last
    line) when the trainer refuses the input."""
    import signal
    import subprocess
    import sys

    from gptplan.lifeline import die_with_parent

    proc = subprocess.Popen(
        [sys.executable, "-c", SPM_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGKILL),
    )
    try:
        _, err = proc.communicate(json.dumps(options))
    finally:
        if proc.returncode is None:  # interrupted: nothing of the child's group stays
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if proc.returncode != 0:
        lines = [line for line in (err or "").splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise RuntimeError(last.removeprefix("RuntimeError: ").strip())


def _train_cpm(
    pieces: list[str], vocab_size: int, tmp: Path, workers: int, progress: Advance, log: Log
) -> None:
    coverage = _character_coverage(pieces, vocab_size)
    segmented = _segmented(pieces, workers, progress)
    text_file = tmp / "train.txt"
    with open(text_file, "w", encoding="utf-8") as handle:
        for s in segmented:
            handle.write(s + "\n")
    log(f"training a {vocab_size}-piece sentencepiece model on {len(pieces):,} sentences ...")
    try:
        train_in_child(
            input=str(text_file),
            model_prefix=str(tmp / "raw"),
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=coverage,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            unk_id=0,
            pad_id=1,
            bos_id=-1,
            eos_id=-1,
            pad_piece="<pad>",
            user_defined_symbols=SPECIAL_PIECES,
            input_sentence_size=MAX_SENTENCES,
            shuffle_input_sentence=True,
            num_threads=max(1, min(4, os.cpu_count() or 1)),
            max_sentence_length=1 << 16,
            minloglevel=2,
            hard_vocab_limit=False,
        )  # a small sample may not fill the vocab
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1]
        raise DataError(
            f"sentencepiece could not train a {vocab_size}-piece model on the "
            f"{len(pieces):,}-sentence sample: {reason}; allowed: a "
            "model.vocab_size the sample supports (at least 300 + the "
            "distinct characters)",
            key="model.vocab_size",
        ) from None
    text_file.unlink()
    # The model file embeds its training paths: store it without them, so the same training
    # gives the same bytes.
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString((tmp / "raw.model").read_bytes())
    proto.trainer_spec.ClearField("input")
    proto.trainer_spec.ClearField("model_prefix")
    proto.trainer_spec.ClearField("num_threads")
    (tmp / "sentencepiece.model").write_bytes(proto.SerializeToString())
    (tmp / "raw.model").unlink()
    (tmp / "raw.vocab").unlink(missing_ok=True)


def _train_bpe(pieces: list[str], vocab_size: int, tmp: Path, progress: Advance, log: Log) -> None:
    from tokenizers import ByteLevelBPETokenizer

    log(f"training a {vocab_size}-token byte-level BPE on {len(pieces):,} documents ...")
    tok = ByteLevelBPETokenizer(add_prefix_space=False)

    def feed() -> Iterator[str]:
        for p in pieces:
            progress(len(p))
            yield p

    tok.train_from_iterator(
        feed(),
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        show_progress=False,
        length=len(pieces),
    )
    tok.save_model(str(tmp))


def train_tokenizer(
    documents: list[str],
    *,
    vocab_size: int,
    out_dir: Path,
    workers: int = 1,
    scheme: str = "auto",
    log: Log = print,
) -> Path:
    """Train on a sample of documents; return the tokenizer directory (a cache entry).

    Written into a temporary folder, then renamed: a cache entry is complete or absent.
    """
    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").exists():
        return out_dir
    mix = script_mix(documents)
    scheme = mix.scheme if scheme == "auto" else scheme
    log(mix.describe() if scheme == mix.scheme else f"scheme {scheme} (asked)")
    t0 = time.perf_counter()
    with cachedirs.writing(out_dir.parent, out_dir.name) as tmp:
        pieces = _training_pieces(documents)
        chars = sum(len(p) for p in pieces)
        # a bar on a terminal only: never a stray line in a pipe or captured output
        with progress.bar(total=chars, unit="char", desc="tokenizer training sample") as bar:
            if scheme == "cpm":
                _train_cpm(pieces, vocab_size, tmp, workers, bar.update, log)
            else:
                _train_bpe(pieces, vocab_size, tmp, bar.update, log)
        manifest = {
            "format": "gptplan-tokenizer",
            "version": TOKENIZER_VERSION,
            "scheme": scheme,
            "script_mix": asdict(mix),
            "sample_documents": len(documents),
            "sample_characters": chars,
            "train_seconds": round(time.perf_counter() - t0, 2),
        }
        manifest["identity"] = tokenizer_identity(tmp, scheme)
        (tmp / "tokenizer.json").write_text(json.dumps(manifest, indent=1))
        cachedirs.publish(tmp, out_dir)  # another process may have finished first
    return out_dir


def tokenizer_identity(directory: Path, scheme: str) -> str:
    """Hash of what defines the tokenizer: pieces, scores, types and normalisation (cpm), or
    vocabulary and merges (bpe). Two identical trainings give the same identity."""
    digest = hashlib.sha256(f"{scheme};v{TOKENIZER_VERSION}".encode())
    directory = Path(directory)
    if scheme == "cpm":
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()  # type: ignore[attr-defined]
        proto.ParseFromString((directory / "sentencepiece.model").read_bytes())
        for piece in proto.pieces:
            digest.update(piece.SerializeToString())
        digest.update(proto.normalizer_spec.SerializeToString())
        digest.update(proto.denormalizer_spec.SerializeToString())
        t = proto.trainer_spec
        digest.update(
            f"{t.byte_fallback};{t.treat_whitespace_as_suffix};{t.unk_id};"
            f"{t.pad_id};{t.bos_id};{t.eos_id}".encode()
        )
    else:
        vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
        digest.update(
            json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
        )
        merges = (directory / "merges.txt").read_text(encoding="utf-8").splitlines()
        digest.update("\n".join(m for m in merges if not m.startswith("#")).encode())
    return digest.hexdigest()[:16]


def read_manifest(directory: Path) -> dict:
    return json.loads((Path(directory) / "tokenizer.json").read_text())


def tokenizer_problem(directory: Path) -> str | None:
    """None if a trained tokenizer's files still define the tokenizer its manifest names
    (the identity is recomputed from the files), else what is wrong (one phrase)."""
    try:
        manifest = read_manifest(directory)
        scheme, identity = manifest["scheme"], manifest["identity"]
    except (OSError, ValueError, KeyError, TypeError):
        return "tokenizer.json is missing or unreadable"
    if scheme not in ("cpm", "bpe"):
        return f"tokenizer.json names scheme {scheme!r}"
    try:
        found = tokenizer_identity(directory, scheme)
    except Exception as exc:  # noqa: BLE001 - protobuf/JSON/OS errors of damaged files
        what = "sentencepiece.model" if scheme == "cpm" else "vocab.json or merges.txt"
        return f"{what} does not load ({type(exc).__name__})"
    if found != identity:
        return f"its files define tokenizer {found}, the manifest says {identity}"
    return None


# ---- fast encoding (no Paddle) ---------------------------------------------------------------


class FastEncoder:
    """Batch encoding for data preparation; the same ids as the PaddleNLP class."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        self.scheme = read_manifest(directory)["scheme"]
        if self.scheme == "cpm":
            import sentencepiece as spm

            self.sp = spm.SentencePieceProcessor(model_file=str(directory / "sentencepiece.model"))
            self.vocab_size = self.sp.get_piece_size()
        else:
            from tokenizers import ByteLevelBPETokenizer

            self.bpe = ByteLevelBPETokenizer(
                str(directory / "vocab.json"), str(directory / "merges.txt"), add_prefix_space=False
            )
            self.vocab_size = self.bpe.get_vocab_size()
        self.dtype = np.uint16 if self.vocab_size < 65535 else np.int32

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self.scheme == "cpm":
            segs = [cpm_segment(t) for t in texts]
            ids = self.sp.encode(segs, num_threads=1)
        else:
            ids = [e.ids for e in self.bpe.encode_batch(texts)]
        return [np.asarray(i, dtype=self.dtype) for i in ids]


# ---- the PaddleNLP tokenizer -----------------------------------------------------------------


class JobTokenizer:
    """Thin handle on a PaddleNLP tokenizer with the ids the data pipeline needs."""

    def __init__(
        self,
        hf_tokenizer: Any,  # a PaddleNLP PretrainedTokenizer (paddlenlp is untyped)
        *,
        name: str,
        fingerprint: str,
        scheme: str = "",
    ) -> None:
        self.tokenizer = hf_tokenizer
        self.name = name
        self.fingerprint = fingerprint
        self.scheme = scheme
        self.eod_id = self._special_id("eos_token", "<eod>")
        pad = getattr(hf_tokenizer, "pad_token_id", None)
        sp = getattr(hf_tokenizer, "sp", None)
        if pad is None and sp is not None and sp.pad_id() >= 0:
            pad = sp.pad_id()
        self.pad_id = self.eod_id if pad is None else int(pad)
        self.vocab_size = len(hf_tokenizer)

    def _special_id(self, attr: str, piece: str) -> int:
        token = getattr(self.tokenizer, attr, None) or piece
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if token_id is None or (
            token_id == unk and token != getattr(self.tokenizer, "unk_token", None)
        ):
            raise DataError(
                f"tokenizer {self.name!r} has no {piece!r} piece; it would become <unk>",
                key="job.tokenizer",
            )
        return int(token_id)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text))

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.convert_ids_to_string([int(i) for i in ids])


def _import_paddlenlp_quietly() -> ModuleType:
    """PaddleNLP (through Paddle) warns about ccache and setuptools on import: not for users."""
    import contextlib
    import io
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        from gptplan import paddlenlp_light

        return paddlenlp_light.load()


def load_tokenizer(spec: str, *, model_file: Path | None = None) -> JobTokenizer:
    """Load by spec: a trained tokenizer (its directory or model file), a local directory, or a
    PaddleNLP name."""
    if spec == "sentencepiece":
        if model_file is None:
            raise ValueError("sentencepiece tokenizer needs the trained model file")
        directory = Path(model_file) if Path(model_file).is_dir() else Path(model_file).parent
        transformers = _import_paddlenlp_quietly()
        manifest = (
            read_manifest(directory)
            if (directory / "tokenizer.json").exists()
            else {"scheme": "cpm"}
        )
        if manifest["scheme"] == "bpe":
            tok = transformers.GPTTokenizer(
                vocab_file=str(directory / "vocab.json"),
                merges_file=str(directory / "merges.txt"),
                eos_token=EOT,
                pad_token=EOT,
                unk_token=EOT,
            )
        else:
            _quiet_jieba()
            tok = transformers.GPTChineseTokenizer(
                model_file=str(directory / "sentencepiece.model")
            )
        identity = manifest.get("identity") or tokenizer_identity(directory, "cpm")
        return JobTokenizer(
            tok,
            name=f"{manifest['scheme']}:{directory.name}",
            fingerprint=identity,
            scheme=manifest["scheme"],
        )
    transformers = _import_paddlenlp_quietly()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(spec)
    except Exception as exc:  # PaddleNLP raises many types for a name it cannot resolve
        raise DataError(
            f"cannot load tokenizer {spec!r} ({type(exc).__name__}); allowed: "
            "'sentencepiece', a local tokenizer directory, or a PaddleNLP name "
            "available offline",
            key="job.tokenizer",
        ) from None
    if Path(spec).is_dir():
        digest = hashlib.sha256()
        for f in sorted(Path(spec).iterdir()):
            if f.is_file():
                digest.update(f.read_bytes())
        fingerprint = digest.hexdigest()[:16]
    else:
        fingerprint = hashlib.sha256(spec.encode()).hexdigest()[:16]
    return JobTokenizer(tok, name=spec, fingerprint=fingerprint)


# ---- the job's tokenizer, trained once per corpus and cached (runner and planner) --------


def _tokenizer_dir(
    *,
    tokenizer: str,
    vocab_size: int,
    cache_dir: str | Path,
    paths: list[Path],
    corpus_key: str,
    max_documents: int,
    dedupe: bool,
    documents: list[str] | None,
    workers: int,
    log: Log,
) -> Path | None:
    if tokenizer != "sentencepiece":
        return None
    out = Path(cache_dir) / "tokenizers" / f"{corpus_key[:16]}-v{vocab_size}-t{TOKENIZER_VERSION}"
    cachedirs.remove_stale(out.parent, log=log)
    if out.exists() or out.is_symlink():
        problem = tokenizer_problem(out) if out.is_dir() else "it is not a folder"
        if problem is None:
            m = read_manifest(out)
            log(
                f"reusing tokenizer {out} ({m['scheme']}, identity {m['identity']}; corpus "
                "files unchanged: same paths, sizes and modification times)"
            )
            return out
        # derived from the corpus: training again gives the same tokenizer (same identity)
        log(f"tokenizer {out} is damaged ({problem}); removed it, training again")
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        else:
            out.unlink()
    t0 = time.perf_counter()
    if documents is None:
        documents = sample_documents(
            paths, max_chars=SAMPLE_CHARS, dedupe=dedupe, max_documents=max_documents
        )
    else:
        import random

        documents = list(documents)
        random.Random(0).shuffle(documents)
        keep, chars = [], 0
        for d in documents:
            if chars >= SAMPLE_CHARS:
                break
            keep.append(d[: SAMPLE_CHARS - chars])
            chars += len(keep[-1])
        documents = keep
    log(
        f"training the tokenizer on a sample of {len(documents):,} documents "
        f"({sum(map(len, documents)):,} characters)"
    )
    train_tokenizer(documents, vocab_size=vocab_size, out_dir=out, workers=workers, log=log)
    log(f"tokenizer trained in {time.perf_counter() - t0:.1f} s -> {out}")
    return out


def model_file_of(directory: Path | None) -> Path | None:
    if directory is None:
        return None
    scheme = read_manifest(directory)["scheme"]
    return directory / ("sentencepiece.model" if scheme == "cpm" else "vocab.json")


def ensure_tokenizer(
    *,
    tokenizer: str,
    vocab_size: int,
    cache_dir: str | Path,
    corpus: Corpus | None = None,
    patterns: list[str] | None = None,
    max_documents: int = 0,
    workers: int | None = None,
    log: Log = progress.quiet,
) -> Path | None:
    """The trained tokenizer's directory (None for a PaddleNLP tokenizer by name/dir)."""
    workers = workers or default_workers()
    if corpus is not None:
        return _tokenizer_dir(
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            cache_dir=cache_dir,
            paths=[Path(s) for s in corpus.sources],
            corpus_key=corpus.key,
            max_documents=max_documents,
            dedupe=False,
            documents=corpus.documents,
            workers=workers,
            log=log,
        )
    paths = resolve_sources(patterns or [])
    dedupe = default_dedupe(patterns or [])
    key = source_key(paths, max_documents=max_documents, dedupe=dedupe)
    return _tokenizer_dir(
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        cache_dir=cache_dir,
        paths=paths,
        corpus_key=key,
        max_documents=max_documents,
        dedupe=dedupe,
        documents=None,
        workers=workers,
        log=log,
    )


def padded_vocab(pieces: int, tensor_parallel: int = 1) -> int:
    """The model's vocab_size for `pieces` under a tensor-parallel degree: unchanged where tp
    divides it (a published vocabulary keeps its shape, so its checkpoints still load), else
    rounded up to the next multiple of tp, the only padding Paddle needs (its
    VocabParallelEmbedding and the parallel LM head split the rows evenly over the tp
    ranks). The padding rows never occur in the data; the runner masks them out of the loss
    and of sampling."""
    multiple = max(1, int(tensor_parallel))
    return -(-int(pieces) // multiple) * multiple


def check_vocab(have: int, allowed: int) -> None:
    if have > allowed:
        raise DataError(
            f"{allowed} is smaller than the tokenizer's vocabulary ({have}); allowed: >= {have}",
            key="model.vocab_size",
        )


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))
