"""The prepared corpus on disk: its format, its manifest, and the check before it is used.

One folder per corpus + tokenizer (`<cache_dir>/data/<key>`), written into a temporary folder
(gptplan.cachedirs) and renamed when complete:
  tokens.bin     raw token ids, little-endian uint16 (vocab < 65535) or int32, documents
                 concatenated, each followed by <eod>;
  docs.npy       int64 offsets of each document's first token, plus the total length at the end;
  meta.json      {"format": "gptplan-tokens", "version": 3, dtype, num_tokens, num_documents,
                 eod_id, pad_id, vocab_size, tokenizer, corpus statistics, preparation
                 throughput};
  manifest.json  the size of every file above and an XXH3-64 hash per `CHUNK_BYTES` chunk of
                 it, written (and fsynced) last.
Reading memory-maps tokens.bin; the seq_len-dependent sample index is computed at load time.

`verify` reads every byte once (XXH3 hashes at memory speed; the disk is the limit) and names
the first thing that differs: a cut or grown file, a missing one, a chunk whose hash changed,
an unreadable manifest or meta.json. The runner calls it before every training (a damaged entry
is removed and prepared again, with one line saying so), so nothing trains on damaged data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from gptplan.errors import DataError

FORMAT = "gptplan-tokens"
VERSION = 3  # 3: manifest.json with per-chunk hashes
MANIFEST = "manifest.json"
CHUNK_BYTES = 64 << 20  # bytes per hashed chunk (a damaged region is named to 64 MiB)
FILES = ("tokens.bin", "docs.npy", "meta.json")


@dataclass
class PreparedData:
    path: Path
    meta: dict

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])


def _chunk_hashes(path: Path) -> tuple[int, list[str]]:
    """(size, XXH3-64 of every CHUNK_BYTES chunk) of a file, read once."""
    import xxhash

    hashes: list[str] = []
    size = 0
    with open(path, "rb") as handle:
        while True:
            digest, got = xxhash.xxh3_64(), 0
            while got < CHUNK_BYTES:
                block = handle.read(min(CHUNK_BYTES - got, 8 << 20))
                if not block:
                    break
                digest.update(block)
                got += len(block)
            if got == 0 and hashes:
                break
            hashes.append(digest.hexdigest())
            size += got
            if got < CHUNK_BYTES:
                break
    return size, hashes


def write_manifest(folder: Path) -> None:
    """Sizes and per-chunk hashes of the entry's files, written and fsynced last."""
    folder = Path(folder)
    files = {}
    for name in FILES:
        size, hashes = _chunk_hashes(folder / name)
        files[name] = {"bytes": size, "xxh3_64": hashes}
    manifest = {"format": FORMAT, "version": VERSION, "chunk_bytes": CHUNK_BYTES, "files": files}
    with open(folder / MANIFEST, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _file_problem(path: Path, expected: dict) -> str | None:
    name = path.name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{name} has {size:,} bytes, the manifest says {expected['bytes']:,}"
    _, hashes = _chunk_hashes(path)
    for i, (got, want) in enumerate(zip(hashes, expected["xxh3_64"], strict=False)):
        if got != want:
            return (
                f"{name} bytes {i * CHUNK_BYTES:,}..{min(size, (i + 1) * CHUNK_BYTES):,} "
                "differ from the manifest's hash"
            )
    if len(hashes) != len(expected["xxh3_64"]):
        return f"{name} has another number of chunks than the manifest lists"
    return None


def verify(folder: Path) -> str | None:
    """None if the entry matches its manifest, else what is wrong (one phrase)."""
    folder = Path(folder)
    manifest = _read_json(folder / MANIFEST) or {}
    files = manifest.get("files")
    if not (
        isinstance(files, dict)
        and manifest.get("chunk_bytes") == CHUNK_BYTES
        and all(
            isinstance(files.get(n), dict)
            and isinstance(files[n].get("bytes"), int)
            and isinstance(files[n].get("xxh3_64"), list)
            for n in FILES
        )
    ):
        return f"{MANIFEST} is missing or unreadable"
    for name in FILES:
        problem = _file_problem(folder / name, files[name])
        if problem:
            return problem
    meta = _read_json(folder / "meta.json")
    if meta is None or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return "meta.json is not readable as this format"
    return None


def content_key(folder: Path) -> int:
    """What the tokens are (counts and the manifest's hashes of tokens.bin and docs.npy), as a
    63-bit integer ranks can compare; equal on two nodes that prepared the same data, whatever
    their paths or preparation times."""
    import hashlib

    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    blob = json.dumps(
        [
            [meta.get(k) for k in ("num_tokens", "num_documents", "vocab_size", "eod_id", "dtype")],
            files["tokens.bin"],
            files["docs.npy"],
        ],
        sort_keys=True,
    )
    return int(hashlib.sha256(blob.encode()).hexdigest()[:15], 16)


def data_identity(folder: Path) -> dict:
    """What a checkpoint records of the data it was trained on: the content key (the
    manifest's chunk hashes of tokens.bin and docs.npy, `content_key`), the counts, the
    tokenizer's identity and the corpus's own content hash, so a resume can say what changed."""
    folder = Path(folder)
    meta = _read_json(folder / "meta.json") or {}
    corpus = meta.get("corpus")
    if not isinstance(corpus, dict):
        corpus = {}
    return {
        "content_key": f"{content_key(folder):016x}",
        "num_tokens": meta.get("num_tokens"),
        "num_documents": meta.get("num_documents"),
        "tokenizer_identity": meta.get("tokenizer_identity"),
        "corpus_sha256": corpus.get("sha256"),
        "corpus_bytes": corpus.get("bytes"),
        "entry": folder.name,
    }


def data_change(old: dict | None, new: dict) -> str | None:
    """None if `new` is the data `old` describes, else what changed (one phrase)."""
    if not isinstance(old, dict) or not old.get("content_key"):
        return None  # a checkpoint from before data identities were recorded
    if old.get("content_key") == new.get("content_key"):
        return None
    parts = []
    for key, label in (
        ("corpus_bytes", "corpus bytes"),
        ("corpus_sha256", "corpus content hash"),
        ("tokenizer_identity", "tokenizer"),
        ("num_documents", "documents"),
        ("num_tokens", "tokens"),
    ):
        a, b = old.get(key), new.get(key)
        if a != b:
            both_int = isinstance(a, int) and isinstance(b, int)
            parts.append(f"{label} {a:,} -> {b:,}" if both_int else f"{label} {a!r} -> {b!r}")
    parts.append(f"content key {old.get('content_key')} -> {new.get('content_key')}")
    return ", ".join(parts)


def check_resume_data(
    state: dict | None, latest: Path | None, folder: Path, *, accept: bool, plan_file: str
) -> str | None:
    """The data is part of the trajectory: a resume on other prepared data than its checkpoint
    was trained on is refused (exit 2) unless `accept` (--accept-new-data); then the line to
    print is returned."""
    if state is None or latest is None:
        return None
    change = data_change(state.get("data"), data_identity(folder))
    if change is None:
        return None
    if accept:
        return (
            f"--accept-new-data: resuming from {latest.name} on other data than it was trained "
            f"on ({change})"
        )
    raise DataError(
        f"the prepared corpus changed since {latest} was written ({change}); a resume would "
        "mix two corpora: rerun with --fresh to start over (the old run is kept, renamed) or "
        "with --accept-new-data to train on from that checkpoint with the new data",
        file=plan_file,
        key="job.corpus",
    )


def open_prepared(path: str | Path) -> PreparedData:
    """The prepared data in `path` (the runner verified it before launching the ranks)."""
    path = Path(path)
    meta = _read_json(path / "meta.json")
    if meta is None:
        raise DataError(
            f"{path} holds no readable prepared data (meta.json missing or "
            "damaged); run 'runner execute' again to prepare it"
        )
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(
            f"{path}: data format {meta.get('format')} v{meta.get('version')} is "
            f"not {FORMAT} v{VERSION}; run 'runner execute' again to prepare it"
        )
    return PreparedData(path, meta)
