"""Atomic checkpoints: written into `step_XXXXXXXX.tmp`, renamed to `step_XXXXXXXX` when whole.

Layout of one checkpoint folder:
  model.<shard>.pdparams       model state of one tensor/pipeline shard (paddle.save: a pickle)
  optimizer.<shard>.pdopt      optimizer state (AdamW moments, beta powers) of that shard
  scaler.pdstate               fp16 loss-scaler state (fp16 only)
  state.json                   step, consumed samples, accounting; written last
A folder without the `.tmp` suffix and with state.json is complete; anything else is ignored and
removed. Only data-parallel rank 0 of each shard writes. Dropout is re-seeded from (seed, step,
rank) every step, so no RNG state needs saving for a bit-exact resume.

Checkpoints are pickles: load only checkpoints you wrote yourself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{8})$")


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
        if match and (child / "state.json").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def read_state(path: Path) -> dict:
    return json.loads((Path(path) / "state.json").read_text())


def remove_incomplete(root: Path) -> None:
    root = Path(root)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.endswith(".tmp") and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


def begin(root: Path, step: int) -> Path:
    """Create the temporary folder for `step` (called by global rank 0 before the barrier)."""
    tmp = Path(root) / f"step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_shard(tmp: Path, shard: ShardId, *, model_state: dict, optimizer_state: dict,
                scaler_state: dict | None, write_model: bool, write_optimizer: bool) -> None:
    import paddle

    if write_model:
        paddle.save(model_state, str(tmp / f"model.{shard.model_tag}.pdparams"))
    if write_optimizer:
        paddle.save(optimizer_state, str(tmp / f"optimizer.{shard.optimizer_tag}.pdopt"))
    if scaler_state is not None and shard == ShardId():
        paddle.save(scaler_state, str(tmp / "scaler.pdstate"))


def commit(tmp: Path, state: dict, *, keep_last: int) -> Path:
    """Write state.json, fsync, rename the folder into place, drop the oldest ones."""
    state_file = tmp / "state.json"
    with open(state_file, "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    final = tmp.with_name(tmp.name[: -len(".tmp")])
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for _, old in complete_checkpoints(final.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_shard(path: Path, shard: ShardId) -> tuple[dict, dict, dict | None]:
    import paddle

    model = paddle.load(str(path / f"model.{shard.model_tag}.pdparams"))
    optimizer = paddle.load(str(path / f"optimizer.{shard.optimizer_tag}.pdopt"))
    scaler_file = path / "scaler.pdstate"
    scaler = paddle.load(str(scaler_file)) if scaler_file.exists() else None
    return model, optimizer, scaler
