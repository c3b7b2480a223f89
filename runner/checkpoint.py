"""Atomic checkpoints: written into `step_XXXXXXXX.tmp`, renamed to `step_XXXXXXXX` when whole.

Layout of one checkpoint folder:
  model.<shard>.pdparams       model state of one tensor/pipeline shard (paddle.save: a pickle)
  optimizer.<shard>.pdopt      optimizer state (AdamW moments, beta powers) of that shard
  scaler.pdstate               fp16 loss-scaler state (fp16 only)
  state.json                   step, consumed samples, accounting, loss and the divergence
                               guard's state (runner.divergence)
  manifest.json                size and xxhash (XXH3-64) of every file above; written last
A folder without the `.tmp` suffix and with manifest.json is complete; anything else is
ignored and removed. On resume the newest complete checkpoint is verified against its manifest;
a damaged one is moved aside (`damaged/`, never deleted) and the previous one is used.
A weight shared by two names (GPT's lm_head is tied to the word embedding) is saved once and
re-attached on load (`__tied__` in the model file). Only data-parallel rank 0 of each shard
writes. Dropout is re-seeded from (seed, step, rank) every step, so no RNG state needs saving
for a bit-exact resume.

Checkpoints are pickles: load only checkpoints you wrote yourself.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from gptplan.diskspace import guard_disk_writes

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
TIED_KEY = "__tied__"  # in a saved model state: {alias name: name of the tensor it shares}


@dataclass(frozen=True)
class ShardId:
    tensor_rank: int = 0
    pipeline_rank: int = 0
    sharding_rank: int = 0

    @property
    def model_tag(self) -> str:
        return f"tp{self.tensor_rank:02d}_pp{self.pipeline_rank:02d}"

    @property
    def optimizer_tag(self) -> str:
        return f"{self.model_tag}_sd{self.sharding_rank:02d}"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def read_state(path: Path) -> dict:
    return json.loads((Path(path) / "state.json").read_text())


def _hash_file(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Sizes and checksums of every file in `folder`, written (and fsynced) last."""
    folder = Path(folder)
    files = {
        p.name: {"bytes": p.stat().st_size, "xxh3_64": _hash_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    with guard_disk_writes(folder, needed_bytes=4096):
        with open(folder / MANIFEST, "w", encoding="utf-8") as handle:
            json.dump({"files": files}, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())


def verify(folder: Path) -> str | None:
    """None if the checkpoint matches its manifest, else what is wrong (one phrase)."""
    folder = Path(folder)
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        if not isinstance(files, dict) or "state.json" not in files:
            return "manifest.json lists no state.json"
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest.json is missing or unreadable"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {expected.get('bytes')}"
        if _hash_file(path) != expected.get("xxh3_64"):
            return f"{name} does not match its checksum"
    try:
        state = read_state(folder)
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return "state.json has no step"
    except (OSError, ValueError):
        return "state.json is unreadable"
    return None


def move_aside(folder: Path) -> Path:
    """Move a damaged checkpoint into `<root>/damaged/` (kept for inspection, never deleted)."""
    folder = Path(folder)
    target = folder.parent / "damaged" / f"{folder.name}.{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while target.exists():
        n += 1
        target = target.with_name(f"{target.name}.{n}")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder, target)
    return target


def resume_point(root: Path, *, log=print) -> Path | None:
    """The newest checkpoint that verifies; damaged newer ones are moved aside with one line
    each (`log`). Called by the runner before it launches the ranks."""
    for _, folder in reversed(complete_checkpoints(root)):
        problem = verify(folder)
        if problem is None:
            return folder
        moved = move_aside(folder)
        log(
            f"checkpoint {folder.name} is damaged ({problem}); moved to {moved}, "
            "resuming from the previous complete one"
        )
    return None


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


def remove_incomplete(root: Path) -> None:
    root = Path(root)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.endswith(".tmp"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)


def begin(root: Path, step: int) -> Path:
    """Create the temporary folder for `step` (called by global rank 0 before the barrier)."""
    tmp = Path(root) / f"step_{step:08d}.tmp"
    remove_incomplete(root)
    with guard_disk_writes(root, needed_bytes=4096):
        tmp.mkdir(parents=True)
    return tmp


def untie(state: dict) -> dict:
    """Save a tensor shared by several names once: later names become aliases in TIED_KEY."""
    out, tied = {}, {}
    seen: dict[str | int, str] = {}  # a tensor's identity -> the first name it was saved under
    for name, tensor in state.items():
        ident = getattr(tensor, "name", None) or id(tensor)  # a Parameter's unique name
        if ident in seen:
            tied[name] = seen[ident]
            continue
        seen[ident] = name
        out[name] = tensor
    if tied:
        out[TIED_KEY] = tied
    return out


def retie(state: dict) -> dict:
    tied = state.pop(TIED_KEY, None) or {}
    for alias, name in tied.items():
        state[alias] = state[name]
    return state


def write_shard(
    tmp: Path,
    shard: ShardId,
    *,
    model_state: dict,
    optimizer_state: dict,
    scaler_state: dict | None,
    write_model: bool,
    write_optimizer: bool,
) -> None:
    import paddle

    with guard_disk_writes(tmp):
        if write_model:
            paddle.save(untie(model_state), str(tmp / f"model.{shard.model_tag}.pdparams"))
        if write_optimizer:
            paddle.save(optimizer_state, str(tmp / f"optimizer.{shard.optimizer_tag}.pdopt"))
        if scaler_state is not None and shard == ShardId():
            paddle.save(scaler_state, str(tmp / "scaler.pdstate"))


def commit(tmp: Path, state: dict, *, keep_last: int) -> Path:
    """Write state.json and the manifest, fsync, rename the folder into place, drop the
    oldest ones."""
    state_file = tmp / "state.json"
    with guard_disk_writes(tmp, needed_bytes=4096):
        with open(state_file, "w", encoding="utf-8") as handle:
            json.dump(state, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        write_manifest(tmp)
        final = tmp.with_name(tmp.name[: -len(".tmp")])
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    rotate(final.parent, keep_last=keep_last)
    return final


def rotate(root: Path, *, keep_last: int) -> None:
    """Drop checkpoints older than the newest `keep_last`, except the newest one taken before
    the loss began to rise and the one with the lowest loss (`protected`): checkpoints
    of a diverging run never rotate the last good model out."""
    found = complete_checkpoints(root)
    keep = protected(found)
    for _, old in found[:-keep_last]:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def is_good(state: dict) -> bool:
    """A checkpoint taken while the loss was not rising (and of a finite loss)."""
    loss = state.get("loss")
    finite = not isinstance(loss, (int, float)) or math.isfinite(loss)
    return finite and state.get("diverging_since") is None


def checkpoint_state(folder: Path) -> dict | None:
    """A checkpoint's state.json (step, loss, the divergence guard's state); None when it
    cannot be read."""
    try:
        state = json.loads((Path(folder) / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def protected(found: list[tuple[int, Path]]) -> set[Path]:
    """Checkpoints the keep_last rotation must keep besides the newest N: the newest good one
    (before a rise) and the one with the lowest finite loss."""
    keep: set[Path] = set()
    best: tuple[float, Path] | None = None
    newest_good = None
    for _, folder in found:
        state = checkpoint_state(folder)
        if state is None:
            continue
        if is_good(state):
            newest_good = folder
        loss = state.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            if best is None or loss <= best[0]:
                best = (float(loss), folder)
    if newest_good is not None:
        keep.add(newest_good)
    if best is not None:
        keep.add(best[1])
    return keep


def load_shard(path: Path, shard: ShardId) -> tuple[dict, dict, dict | None]:
    import paddle

    model = retie(paddle.load(str(path / f"model.{shard.model_tag}.pdparams")))
    optimizer = paddle.load(str(path / f"optimizer.{shard.optimizer_tag}.pdopt"))
    scaler_file = path / "scaler.pdstate"
    scaler = paddle.load(str(scaler_file)) if scaler_file.exists() else None
    return model, optimizer, scaler
