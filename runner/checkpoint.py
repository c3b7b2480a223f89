"""Atomic checkpoints: written into `step_XXXXXXXX.tmp`, renamed to `step_XXXXXXXX` when whole.

Layout of one checkpoint folder (format 2; docs/checkpoints.md):
  model.<shard>.safetensors      model state of one tensor/pipeline shard, under the bare
                                 model's structured names (`gpt.decoder.layers.0...`) whatever
                                 wrapper trained it (fleet, sharding, pipeline, tensor parallel)
  optimizer.<shard>.safetensors  optimizer state (AdamW moments, beta powers, master weights) of
                                 that shard; its non-tensor entries (the LR scheduler's) in the
                                 file's JSON header
  scaler.json                    fp16 loss-scaler state (fp16 only)
  state.json                     step, consumed samples, accounting, loss, the divergence
                                 guard's state (runner.divergence), `format` and `model_files`
  manifest.json                  size and xxhash (XXH3-64) of every file above; written last
A folder without the `.tmp` suffix and with manifest.json is complete; anything else is
ignored and removed. On resume the newest complete checkpoint is verified against its manifest
and must hold model weights (`model_files`); a damaged one is moved aside (`damaged/`, never
deleted) and the previous one is used. A weight shared by two names (GPT's lm_head is tied to
the word embedding) is saved once and re-attached on load (`tied` in the file's header). Only
data-parallel rank 0 of each shard writes; a model file is written by sharding rank 0 alone
(sharding stage 3 gathers its sliced parameters first), each sharding rank writes its own
optimizer file (stage 3: the states of its parameter slices, `slice@<name>`). Dropout is
re-seeded from (seed, step, rank) every step, so no RNG state needs saving for a bit-exact
resume.

Nothing here can run code: safetensors and JSON only. Checkpoints of the earlier format
(`paddle.save` pickles: model.*.pdparams, optimizer.*.pdopt, scaler.pdstate) are refused; with
`--trust-pickled-checkpoint` they are unpickled once, by the runner, into this format (the
pickles are kept in `checkpoints/pickled/`). Loading a model state whose names or shapes do
not match the model is an error naming them (`load_model_state`), never a skipped key.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from gptplan.diskspace import guard_disk_writes
from gptplan.errors import UserError
from gptplan.progress import Log

if TYPE_CHECKING:
    import numpy as np
    import paddle
    from paddle._typing import PlaceLike

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
TIED_KEY = "__tied__"  # in a loaded model state: {alias name: name of the tensor it shares}
FORMAT = 2  # 1: paddle.save pickles (read only by convert_pickled); 2: safetensors + JSON
HEADER_KEY = "gptplan"  # the safetensors header entry holding the JSON structure
SCALER_FILE = "scaler.json"
PICKLED_SUFFIXES = (".pdparams", ".pdopt", ".pdstate")


class CheckpointError(UserError):
    """A checkpoint that cannot be used as it is (another format, another model, no
    weights): one line naming it and the way on."""


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
    return weights_problem(folder, state, files)


def weights_problem(folder: Path, state: dict, files: dict) -> str | None:
    """None if the checkpoint holds model weights (every model file state.json lists is in
    the manifest and holds tensors), else what is wrong."""
    if is_pickled(folder):
        return None  # resume_point and resolve_checkpoint refuse it (or convert it)
    models = state.get("model_files")
    if not isinstance(models, list) or not models:
        return "it holds no model weights (state.json lists no model file)"
    for name in models:
        if not isinstance(name, str) or name not in files or "/" in name:
            return f"it holds no model weights ({name!r} is not in manifest.json)"
        if not _tensor_names(Path(folder) / name):
            return f"it holds no model weights ({name} holds no tensors)"
    return None


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (nothing else is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError, ValueError):
        return []


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


def resume_point(root: Path, *, log: Log = print, trust_pickled: bool = False) -> Path | None:
    """The newest checkpoint that verifies; damaged newer ones are moved aside with one line
    each (`log`). One of the earlier pickled format is refused (CheckpointError), or with
    `trust_pickled` (--trust-pickled-checkpoint) converted. Called by the runner before it
    launches the ranks, so no rank ever reads a pickle."""
    for _, folder in reversed(complete_checkpoints(root)):
        if is_pickled(folder) and verify(folder) is None:
            if not trust_pickled:
                raise pickled_refusal(folder)
            folder = convert_pickled(folder, log=log)
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
    """Write this rank's part (safetensors and JSON; `model_state` under canonical names:
    `model_state(model)`)."""
    with guard_disk_writes(tmp):
        if write_model:
            save_tensors(tmp / model_file(shard), untie(model_state), kind="model")
        if write_optimizer:
            save_tensors(tmp / optimizer_file(shard), optimizer_state, kind="optimizer")
        if scaler_state is not None and shard == ShardId():
            write_json_file(tmp / SCALER_FILE, _tree(scaler_state, {}, ""))


def commit(tmp: Path, state: dict, *, keep_last: int) -> Path:
    """Write state.json and the manifest, fsync, rename the folder into place, drop the
    oldest ones."""
    state_file = tmp / "state.json"
    models = sorted(p.name for p in tmp.glob("model.*.safetensors"))
    if not models:
        raise CheckpointError(f"{tmp}: no rank wrote model weights; the checkpoint is not kept")
    state = {**state, "format": FORMAT, "model_files": models}
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
    """This rank's model state (canonical names, tied weights re-attached), optimizer state
    and scaler state; safetensors and JSON only (a checkpoint of the pickled format is
    converted by the runner before any rank starts: `resume_point`)."""
    path = Path(path)
    model = retie(load_tensors(path / model_file(shard), kind="model"))
    optimizer = load_tensors(path / optimizer_file(shard), kind="optimizer")
    scaler_path = path / SCALER_FILE
    scaler = _untree(read_json_file(scaler_path), {}) if scaler_path.is_file() else None
    return model, optimizer, scaler


# ---- the format: safetensors for tensors, JSON for the rest ----------------------------------


def model_file(shard: ShardId) -> str:
    return f"model.{shard.model_tag}.safetensors"


def optimizer_file(shard: ShardId) -> str:
    return f"optimizer.{shard.optimizer_tag}.safetensors"


def canonical_model(model: paddle.nn.Layer) -> paddle.nn.Layer:
    """The bare model inside the wrappers that trained it: fleet's DataParallel,
    ShardingParallel, TensorParallel and PipelineParallel keep it in `_layers`, sharding
    stage 2/3 (GroupShardedStage2/3) in `_layer`. Its state dict has the structured names of
    the PaddleNLP model (a pipeline model's own state_dict maps its stage names back to them)."""
    seen = 0
    while seen < 8:
        inner = getattr(model, "_layers", None)
        if inner is None or not hasattr(inner, "state_dict"):
            inner = getattr(model, "_layer", None)
        if inner is None or not hasattr(inner, "state_dict"):
            return model
        model, seen = inner, seen + 1
    return model


def model_state(model: paddle.nn.Layer) -> dict:
    """The model's state dict under canonical names (`canonical_model`)."""
    return dict(canonical_model(model).state_dict())


def _listing(names: Iterable[str], limit: int = 4) -> str:
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


def load_model_state(model: paddle.nn.Layer, state: dict, *, source: str) -> None:
    """Load `state` (canonical names) into `model` (or the bare model inside its wrappers);
    names the model does not have, names it has that `state` lacks and shapes that differ are
    one CheckpointError naming them: never a key skipped with a warning."""
    bare = canonical_model(model)
    expected = bare.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k} {list(state[k].shape)} (model: {list(expected[k].shape)})"
        for k in expected
        if k in state and list(state[k].shape) != list(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing ({_listing(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected ({_listing(unexpected)})")
    if shapes:
        problems.append(f"{len(shapes)} of another shape ({_listing(shapes, 2)})")
    if problems:
        raise CheckpointError(
            f"checkpoint {source} does not match the model: of {len(expected)} tensors, "
            + "; ".join(problems)
            + "; it was written by another model or layout (nothing was loaded)"
        )
    ordered = {}
    for key, param in expected.items():
        value = state[key]
        if value.dtype != param.dtype:
            value = value.astype(param.dtype)
        ordered[key] = value
    bare.set_state_dict(ordered)


def _is_tensor(value: object) -> TypeGuard[paddle.Tensor]:
    import paddle

    return isinstance(value, paddle.Tensor)


def _tree(value: object, tensors: dict[str, paddle.Tensor | np.ndarray], path: str) -> object:
    """A JSON-able copy of `value` with tensors and arrays moved into `tensors` (under their
    path) and replaced by {"__tensor__": name} / {"__ndarray__": name}."""
    import numpy as np

    if _is_tensor(value):
        tensors[path] = value
        return {"__tensor__": path}
    if isinstance(value, np.ndarray):
        tensors[path] = value
        return {"__ndarray__": path}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"checkpoint state key {key!r} at {path!r} is not a string")
            out[key] = _tree(item, tensors, f"{path}/{key}" if path else key)
        return out
    if isinstance(value, (list, tuple)):
        return [_tree(item, tensors, f"{path}/{i}") for i, item in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint state at {path!r} is a {type(value).__name__}")


def _untree(
    value: object, tensors: dict[str, paddle.Tensor]
) -> Any:  # JSON, as json.loads gives it
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if set(value) == {"__ndarray__"}:
            return tensors[value["__ndarray__"]].numpy()
        return {k: _untree(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_untree(v, tensors) for v in value]
    return value


def save_tensors(path: Path, state: dict, *, kind: str) -> None:
    """`state` (a dict of tensors, numbers, strings, nested dicts) as one safetensors file:
    the tensors by their path (`a/b`), the rest as JSON in the header."""
    import numpy as np
    import paddle
    from safetensors.paddle import save_file

    state = dict(state)
    tied = state.pop(TIED_KEY, None) or {}
    tensors: dict = {}
    tree = _tree(state, tensors, "")
    flat = {
        name: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v.contiguous()
        for name, v in tensors.items()
    }
    header = {"format": FORMAT, "kind": kind, "tree": tree, "tied": tied}
    save_file(flat, str(path), metadata={HEADER_KEY: json.dumps(header)})


# safetensors dtypes numpy cannot hold (read through safetensors' Paddle reader instead)
NUMPY_LESS = frozenset({"BF16", "F8_E4M3", "F8_E5M2"})


def _current_place() -> PlaceLike:
    import paddle

    return paddle.framework._current_expected_place()


def load_tensors(path: Path, *, kind: str) -> dict:
    """What `save_tensors` wrote (the model's tied names in TIED_KEY); a file that is not one
    is a CheckpointError naming it."""
    import paddle
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing: no {kind} state of this shard")
    try:
        # Read as numpy and hand to paddle.to_tensor (on the current place): safetensors' own
        # Paddle reader goes through view_dtype, which has no kernel on the rehearsal device.
        # numpy has no bfloat16, so those tensors come through the Paddle reader on the CPU.
        with safe_open(str(path), framework="np") as handle:
            header = json.loads((handle.metadata() or {}).get(HEADER_KEY, "null"))
            names = list(handle.keys())
            wide = [n for n in names if handle.get_slice(n).get_dtype() not in NUMPY_LESS]
            tensors = {name: paddle.to_tensor(handle.get_tensor(name)) for name in wide}
        narrow = [n for n in names if n not in tensors]
        if narrow:
            with (
                paddle.device.device_guard("cpu"),
                safe_open(str(path), framework="paddle") as handle,
            ):
                cpu = {name: handle.get_tensor(name) for name in narrow}
            tensors.update(
                {name: paddle.to_tensor(t, place=_current_place()) for name, t in cpu.items()}
            )
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint file {path} is not readable safetensors ({exc})"
        ) from None
    if not isinstance(header, dict) or header.get("kind") != kind:
        raise CheckpointError(f"checkpoint file {path} is not a {kind} state written by the runner")
    try:
        state = _untree(header.get("tree") or {}, tensors)
    except KeyError as exc:
        raise CheckpointError(
            f"checkpoint file {path}: its header names tensor {exc} it does not hold"
        ) from None
    if kind == "model" and not tensors:
        raise CheckpointError(f"checkpoint file {path} holds no model weights")
    if header.get("tied"):
        state[TIED_KEY] = dict(header["tied"])
    return state


def write_json_file(path: Path, data: object) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def read_json_file(path: Path) -> Any:  # JSON, as json.loads gives it
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise CheckpointError(f"checkpoint file {path} is not readable JSON") from None


# ---- the earlier, pickled format -------------------------------------------------------------


def is_pickled(folder: Path) -> bool:
    """A checkpoint of the earlier format (paddle.save pickles), which only
    `convert_pickled` (behind --trust-pickled-checkpoint) reads."""
    folder = Path(folder)
    state = checkpoint_state(folder) or {}
    if state.get("format") == FORMAT:
        return False
    return any(folder.glob(f"*{suffix}") for suffix in PICKLED_SUFFIXES)


def pickled_refusal(folder: Path) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {folder} is in the earlier pickled format (model.*.pdparams); loading a "
        "pickle runs any code the file holds, so it is not read. If this run directory is "
        "your own, rerun with --trust-pickled-checkpoint to convert it once into safetensors "
        "(the pickles are kept in checkpoints/pickled/); else start over with --fresh",
        key="--trust-pickled-checkpoint",
    )


def convert_pickled(folder: Path, *, log: Log = print) -> Path:
    """Unpickle a checkpoint of the earlier format (paddle.load: this RUNS CODE a crafted file
    holds; only behind --trust-pickled-checkpoint) and write it as format 2 in its place; the
    pickled folder is moved to `<root>/pickled/`. Returns the converted folder."""
    import paddle

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".convert.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for src in sorted(folder.iterdir()):
            if src.suffix == ".pdparams" and src.name.startswith("model."):
                state = paddle.load(str(src))
                save_tensors(tmp / f"{src.stem}.safetensors", state, kind="model")
            elif src.suffix == ".pdopt" and src.name.startswith("optimizer."):
                state = paddle.load(str(src))
                save_tensors(tmp / f"{src.stem}.safetensors", state, kind="optimizer")
            elif src.name == "scaler.pdstate":
                write_json_file(tmp / SCALER_FILE, _tree(paddle.load(str(src)), {}, ""))
        state = read_state(folder)
        state.pop("format", None)
        commit_dir = tmp.with_name(folder.name + ".tmp")
        shutil.rmtree(commit_dir, ignore_errors=True)
        os.replace(tmp, commit_dir)
        kept = folder.parent / "pickled" / folder.name
        kept.parent.mkdir(exist_ok=True)
        if kept.exists():
            shutil.rmtree(kept)
        os.replace(folder, kept)
        final = commit(commit_dir, state, keep_last=1 << 30)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(
        f"--trust-pickled-checkpoint: {folder.name} converted to safetensors (the pickled "
        f"files are kept in {kept})"
    )
    return final
