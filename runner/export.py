"""Models people can use: PaddleNLP's own format (`save_pretrained`), and paddle.jit.save.

A run keeps its tokenizer in `<run_dir>/tokenizer/` (saved when the run starts, so the run dir
alone is enough to export or sample later, even after the data cache is gone). At the end of a
run, and with `runner export RUN_DIR`, the trained weights and that tokenizer are written to
`<run_dir>/export/paddlenlp/` with `save_pretrained`; they load with
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`. `--export` adds the
static-graph `paddle.jit.save` export for inference (`<run_dir>/export/model.*`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptplan import families, userdata
from gptplan.errors import UserError
from gptplan.plan import Plan
from gptplan.progress import Log
from runner import checkpoint as ckpt
from runner.console import quiet_paddlenlp
from runner.model import build_model

if TYPE_CHECKING:
    import numpy as np
    import paddle

TOKENIZER_DIR = "tokenizer"
PRETRAINED_DIR = Path("export") / "paddlenlp"


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder into place (the old one, if any, goes only after that)."""
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_run_tokenizer(plan: Plan, meta: dict, run_dir: Path, *, log: Log = print) -> Path:
    """Save the job's tokenizer (PaddleNLP format) into the run dir, once; a copy that no
    longer matches its checksums, or that is of another tokenizer than the data's, is moved
    into damaged/ and saved again (one line)."""
    out = Path(run_dir) / TOKENIZER_DIR
    if (out / "tokenizer_config.json").exists():
        problem = run_tokenizer_problem(out)
        if problem is None:
            recorded = _read_copy_manifest(out).get("source_identity")
            if recorded == meta.get("tokenizer_identity") or recorded is None:
                return out
            problem = (
                f"it is tokenizer {recorded}, the data is now tokenized by "
                f"{meta.get('tokenizer_identity')}"
            )
            _move_copy_aside(out, problem, log=log, state="out of date")
        else:
            _move_copy_aside(out, problem, log=log)
    model_file = meta.get("tokenizer_model") or None
    return _write_run_tokenizer(
        plan,
        out,
        model_file=Path(model_file) if model_file else None,
        source_identity=meta.get("tokenizer_identity"),
    )


COPY_MANIFEST = "gptplan_tokenizer.json"  # in the run's tokenizer copy: checksums, source


def _file_hash(path: Path) -> str:
    import xxhash

    return xxhash.xxh3_64(path.read_bytes()).hexdigest()


def _read_copy_manifest(folder: Path) -> dict:
    import json

    try:
        data = json.loads((folder / COPY_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_tokenizer_problem(folder: Path) -> str | None:
    """None if the run's tokenizer copy matches the checksums written with it, else what is
    wrong (one phrase). A copy from before checksums were written is taken as it is."""
    folder = Path(folder)
    if not (folder / COPY_MANIFEST).exists():
        return None if (folder / "tokenizer_config.json").is_file() else "it is incomplete"
    files = _read_copy_manifest(folder).get("files")
    if not isinstance(files, dict) or not files:
        return f"{COPY_MANIFEST} is unreadable"
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if _file_hash(path) != digest:
            return f"{name} does not match its checksum"
    return None


def _move_copy_aside(out: Path, problem: str, *, log: Log, state: str = "damaged") -> None:
    from runner.billing import move_damaged

    run_dir = out.parent
    target = move_damaged(out, run_dir)
    log(f"{out} is {state} ({problem}); moved to {target}, saved again from the tokenizer cache")


def _source_model(plan: Plan, manifest: dict) -> tuple[Path | None, str | None]:
    """The tokenizer the run's copy was saved from: the cache's model file recorded with the
    copy if it still holds that tokenizer, else the cache entry of the plan's job.* (trained
    again if the cache is gone: the same corpus gives the same tokenizer)."""
    from gptplan.tokenizer import ensure_tokenizer, model_file_of, tokenizer_problem

    recorded = manifest.get("source_model")
    if recorded and Path(recorded).exists():
        if tokenizer_problem(Path(recorded).parent) is None:
            return Path(recorded), manifest.get("source_identity")
    if plan.job.tokenizer != "sentencepiece":
        return None, None
    directory = ensure_tokenizer(
        tokenizer=plan.job.tokenizer,
        vocab_size=plan.job.tokenizer_vocab_size or plan.model.vocab_size,
        cache_dir=userdata.cache_dir(plan.job.cache_dir),
        patterns=plan.job.corpus,
        max_documents=plan.job.max_documents,
    )
    if directory is None:
        return None, None
    from gptplan.tokenizer import read_manifest

    return model_file_of(directory), read_manifest(directory).get("identity")


def _write_run_tokenizer(
    plan: Plan, out: Path, *, model_file: Path | None, source_identity: str | None
) -> Path:
    import json

    from gptplan.diskspace import guard_disk_writes
    from gptplan.tokenizer import load_tokenizer

    quiet_paddlenlp()
    tok = load_tokenizer(plan.job.tokenizer, model_file=model_file).tokenizer
    sp = getattr(tok, "sp", None)
    if "pad_token" not in tok.special_tokens_map and sp is not None and sp.pad_id() >= 0:
        tok.pad_token = sp.id_to_piece(sp.pad_id())  # so that a reloaded tokenizer pads
    with guard_disk_writes(out.parent, needed_bytes=1 << 20):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=out.parent))
        try:
            tok.save_pretrained(str(tmp))
            files = {p.name: _file_hash(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = {
                "files": files,
                "source_identity": source_identity,
                "source_model": str(model_file) if model_file else None,
                "tokenizer": plan.job.tokenizer,
            }
            (tmp / COPY_MANIFEST).write_text(json.dumps(manifest, indent=1))
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def repair_run_tokenizer(plan: Plan, run_dir: Path, problem: str, *, log: Log = print) -> Path:
    """Move a damaged tokenizer copy aside and save it again from the cache (one line)."""
    out = Path(run_dir) / TOKENIZER_DIR
    manifest = _read_copy_manifest(out)
    if out.exists() or out.is_symlink():
        _move_copy_aside(out, problem, log=log)
    model_file, identity = _source_model(plan, manifest)
    return _write_run_tokenizer(plan, out, model_file=model_file, source_identity=identity)


def resolve_checkpoint(
    run_dir: Path, checkpoint: str | None = None, *, log: Log = print, trust_pickled: bool = False
) -> Path:
    """The newest complete checkpoint that matches its manifest (a damaged newer one is
    skipped with one line; the run's next `runner execute` moves it aside), or the one named
    by step number or folder (refused, one line, if it is damaged). One of the earlier
    pickled format is refused, or converted with `trust_pickled`."""
    path = _resolve_checkpoint(run_dir, checkpoint, log=log)
    if ckpt.is_pickled(path):
        if not trust_pickled:
            raise ckpt.pickled_refusal(path)
        path = ckpt.convert_pickled(path, log=log)
    return path


def _resolve_checkpoint(run_dir: Path, checkpoint: str | None, *, log: Log) -> Path:
    root = Path(run_dir) / "checkpoints"
    found = ckpt.complete_checkpoints(root)
    if not found:
        raise UserError(f"no complete checkpoint in {root}", key="RUN_DIR")
    if checkpoint is None:
        for _, path in reversed(found):
            problem = ckpt.verify(path)
            if problem is None:
                return path
            log(f"checkpoint {path} is damaged ({problem}); using the previous complete one")
        raise UserError(
            f"no checkpoint in {root} matches its manifest (each is damaged); rerun "
            "`runner execute` on the plan to train again",
            key="RUN_DIR",
        )
    for step, path in found:
        if checkpoint in (str(step), path.name, str(path)):
            problem = ckpt.verify(path)
            if problem:
                raise UserError(
                    f"{path} is damaged ({problem}); name another checkpoint (allowed: "
                    f"{', '.join(str(s) for s, _ in found)})",
                    key="--checkpoint",
                )
            return path
    raise UserError(
        f"{checkpoint!r} is not a complete checkpoint of this run; allowed: "
        f"{', '.join(str(step) for step, _ in found)} (step numbers)",
        key="--checkpoint",
    )


def _shard_grid(plan: Plan, checkpoint: Path) -> dict[tuple[int, int], str]:
    """{(pipeline rank, tensor rank): model file} of `checkpoint`, every one the plan's layout
    writes (a missing one is a CheckpointError naming it)."""
    import re

    state = ckpt.read_state(checkpoint)
    files = state.get("model_files") or []
    grid = {}
    for name in files:
        match = re.fullmatch(r"model\.tp(\d+)_pp(\d+)\.safetensors", str(name))
        if match:
            grid[(int(match.group(2)), int(match.group(1)))] = str(name)
    tp, pp = plan.parallel.tensor_parallel_degree, plan.parallel.pipeline_parallel_degree
    wanted = {(s, t) for s in range(pp) for t in range(tp)}
    if set(grid) != wanted:
        raise ckpt.CheckpointError(
            f"checkpoint {checkpoint} holds model files for {len(grid)} shards, the plan's "
            f"layout (tp {tp} x pp {pp}) writes {len(wanted)}: missing "
            + (", ".join(f"pp{s:02d} tp{t:02d}" for s, t in sorted(wanted - set(grid))) or "none")
            + f"; unexpected {len(set(grid) - wanted)}"
        )
    return grid


def merge_tensor_parallel(plan: Plan, shards: list[dict]) -> dict:
    """One state dict from the tensor-parallel ranks' ones (in rank order), merged along each
    weight's split axis by the family's own PaddleNLP mappings
    (`_get_tensor_parallel_mappings(config, is_split=False)`); unsplit tensors from rank 0."""
    import dataclasses as dc

    import numpy as np
    import paddle

    from runner.model import _import, build_config

    if len(shards) == 1:
        return shards[0]
    spec = families.get(plan.model.family)
    single = dc.replace(plan.parallel, pipeline_parallel_degree=1)
    config = build_config(plan.model, single, seq_len=plan.training.seq_len)
    config.tensor_parallel_degree, config.tensor_parallel_rank = len(shards), 0
    cls = _import(spec.causal_lm_class)
    actions = cls._get_tensor_parallel_mappings(config, is_split=False)
    names = cls._resolve_prefix_keys(actions.keys(), shards[0].keys(), ignore_error=True)
    for short, full in names.items():
        actions[full] = actions.pop(short)
    merged = {}
    for key, value in shards[0].items():
        if key in actions:
            parts = [np.asarray(s[key].astype("float32").numpy()) for s in shards]
            merged[key] = paddle.to_tensor(actions[key](parts))
        else:
            merged[key] = value
    return merged


def merged_model_state(plan: Plan, checkpoint: Path) -> dict:
    """The checkpoint's model as one state dict (canonical names, fp32): tensor-parallel
    shards merged along their split axes, pipeline stages concatenated."""
    grid = _shard_grid(plan, checkpoint)
    merged: dict = {}
    for stage in range(plan.parallel.pipeline_parallel_degree):
        shards: list[dict] = []
        tied: dict[str, str] = {}
        for rank in range(plan.parallel.tensor_parallel_degree):
            state = ckpt.load_tensors(checkpoint / grid[(stage, rank)], kind="model")
            tied = state.pop(ckpt.TIED_KEY, None) or {}  # the same on every rank of a stage
            shards.append({k: v.astype("float32") for k, v in state.items()})
        # tied names (GPT's lm_head is its word embedding) follow the merged tensor: PaddleNLP's
        # mappings split or merge only the tensor's own name
        stage_state = ckpt.retie({**merge_tensor_parallel(plan, shards), ckpt.TIED_KEY: tied})
        for key, value in stage_state.items():
            merged.setdefault(key, value)  # a weight shared by two stages: the first's
    return merged


def with_tied_names(net: Any, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every name `net` ties to another (one tensor under several names: GPT's
    lm_head is its word embedding) filled from a name of the same tensor that `state` holds.
    A pipeline stage saves a shared weight under one name only (the last stage's copy of the
    word embedding is the embedding's name), so a merged pipeline checkpoint lacks the
    alias. Names `state` lacks that nothing ties stay missing (an error on loading)."""
    groups: dict[str, list[str]] = {}
    for name, tensor in net.state_dict().items():
        groups.setdefault(getattr(tensor, "name", None) or name, []).append(name)
    out = dict(state)
    for names in groups.values():
        held = [n for n in names if n in out]
        for name in names:
            if name not in out and held:
                out[name] = out[held[0]]
    return out


# a PaddleNLP PretrainedModel (untyped: save_pretrained, config), built as a paddle.nn.Layer
def load_trained_model(plan: Plan, checkpoint: Path) -> Any:
    """The family's PaddleNLP causal LM (one process, fp32, eval mode) with the weights of
    `checkpoint`, merged from every shard its layout wrote; any name or shape that does not
    match the model is an error (runner.checkpoint.load_model_state)."""
    import paddle

    quiet_paddlenlp()
    paddle.set_device("cpu")
    single = dataclasses.replace(
        plan.parallel,
        recompute="none",
        sequence_parallel=False,
        tensor_parallel_degree=1,
        pipeline_parallel_degree=1,
        data_parallel_degree=1,
        sharding="",
        sharding_parallel_degree=1,
        nnodes=1,
        nproc_per_node=1,
    )
    net = build_model(plan.model, single, seq_len=plan.training.seq_len)
    state = with_tied_names(net, merged_model_state(plan, checkpoint))
    ckpt.load_model_state(net, state, source=str(checkpoint))
    net.eval()
    return net


# ---- verification: an export computes what the checkpoint does -------------------------------

EXPORT_RECORD = "gptplan_export.json"  # in export/paddlenlp: written last, after the check
JIT_RECORD = "gptplan_jit.json"  # beside export/model.*, written last (paddle.jit.load reads
# every model*.json in the folder as a program: the record must not be one)
LOGIT_TOLERANCE = 1e-4  # max |logit difference| (fp32) an export may show on the fixed batch


def fixed_batch(vocab_size: int, seq_len: int) -> np.ndarray:
    """The batch every export is checked on: 2 sequences of min(seq_len, 16) token ids drawn
    with seed 0 from the first min(vocab_size, 1000) ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, min(vocab_size, 1000), size=(2, min(seq_len, 16)), dtype=np.int64)


def logits_of(net: paddle.nn.Layer, batch: np.ndarray) -> np.ndarray:
    import paddle

    with paddle.no_grad():
        out = net(paddle.to_tensor(batch, dtype="int64"))
    out = out[0] if isinstance(out, (tuple, list)) else out
    if hasattr(out, "logits"):
        out = out.logits
    return out.astype("float32").numpy()


def compare_logits(want: np.ndarray, got: np.ndarray, *, what: str) -> float:
    """The max |logit difference|; above LOGIT_TOLERANCE (or another shape) an error."""
    import numpy as np

    if want.shape != got.shape:
        raise ckpt.CheckpointError(
            f"{what} gives logits of shape {list(got.shape)}, the checkpoint {list(want.shape)}"
        )
    # where the checkpoint's own logits are not finite (a diverging run's last good checkpoint
    # can overflow on the fixed batch), the export must give the same value there; elsewhere
    # the largest absolute difference counts
    finite = np.isfinite(want) & np.isfinite(got)
    same_nonfinite = (~finite) & ((want == got) | (np.isnan(want) & np.isnan(got)))
    if not np.all(finite | same_nonfinite):
        diff = float("inf")
    else:
        diff = float(np.max(np.abs(want[finite] - got[finite]), initial=0.0))
    if not diff <= LOGIT_TOLERANCE:
        raise ckpt.CheckpointError(
            f"{what} does not reproduce the checkpoint: max |logit difference| {diff:.3g} on "
            f"the fixed batch (allowed {LOGIT_TOLERANCE:g}); the export is not kept"
        )
    return diff


def _write_record(path: Path, record: dict) -> None:
    import json

    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _read_record(path: Path) -> dict:
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _files_match(folder: Path, files: object) -> bool:
    if not isinstance(files, dict) or not files:
        return False
    for name, digest in files.items():
        path = Path(folder) / str(name)
        if "/" in str(name) or not path.is_file() or _file_hash(path) != digest:
            return False
    return True


def verified_export(folder: Path, checkpoint: str | None = None) -> dict | None:
    """The verification record of a PaddleNLP-format export if the export is whole (every
    file matches the checksums written after its logits were checked, weights in
    safetensors, no pickle) and, when given, of checkpoint `checkpoint`; else None."""
    folder = Path(folder)
    record = _read_record(folder / EXPORT_RECORD)
    files = record.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return None
    if not _files_match(folder, files):
        return None
    if any(folder.glob("*.pdparams")):
        return None
    if checkpoint is not None and record.get("checkpoint") != checkpoint:
        return None
    return record


def verified_jit(run_dir: Path, checkpoint: str | None = None) -> dict | None:
    """Like `verified_export`, for the paddle.jit.save export (`export/model.*`)."""
    folder = Path(run_dir) / "export"
    record = _read_record(folder / JIT_RECORD)
    if not _files_match(folder, record.get("files")):
        return None
    if checkpoint is not None and record.get("checkpoint") != checkpoint:
        return None
    return record


def export_summary(folder: Path, *, jit_run_dir: Path | None = None) -> str:
    """One phrase for the user: what the export was checked against and how well it matched."""
    records = [("PaddleNLP format", _read_record(Path(folder) / EXPORT_RECORD))]
    if jit_run_dir is not None:
        records.append(("jit", _read_record(Path(jit_run_dir) / "export" / JIT_RECORD)))
    parts = [
        f"{what} max |logit difference| {r.get('max_abs_logit_diff', float('nan')):.2g}"
        for what, r in records
    ]
    first = records[0][1]
    shape = "x".join(str(n) for n in first.get("batch_shape", []))
    return (
        f"reloaded and compared with {first.get('checkpoint')} on a fixed {shape} batch of "
        f"token ids: {', '.join(parts)} (measured; allowed {LOGIT_TOLERANCE:g})"
    )


def remove_partial_exports(run_dir: Path) -> None:
    """What a killed export left: `export/.paddlenlp.*`, `export/.jit.*`, `*.old` folders."""
    folder = Path(run_dir) / "export"
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.name.startswith((".paddlenlp.", ".jit.")) or child.name.endswith(".old"):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def load_run_tokenizer(
    run_dir: Path, plan: Plan | None = None, *, log: Log = print
) -> Any:  # a PaddleNLP tokenizer (untyped)
    """The run's tokenizer copy, verified against its checksums first; a damaged or missing
    copy is saved again from the tokenizer cache (or trained again from the plan's corpus)
    with one line, so an export never fails on it."""
    from gptplan import paddlenlp_light
    from gptplan.tokenizer import _quiet_jieba

    AutoTokenizer = paddlenlp_light.load().AutoTokenizer

    quiet_paddlenlp()
    _quiet_jieba()
    run_dir = Path(run_dir)
    path = run_dir / TOKENIZER_DIR
    if plan is None and (run_dir / "plan.toml").is_file():
        from gptplan.plan import load_plan

        plan = load_plan(run_dir / "plan.toml")
    problem = (
        run_tokenizer_problem(path)
        if (path / "tokenizer_config.json").exists()
        else "it is missing"
    )
    if problem is None:
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # noqa: BLE001 - any file of the copy may be garbled
            problem = f"it does not load: {type(exc).__name__}"
    if plan is None:
        raise UserError(
            f"{path}: {problem}, and {run_dir / 'plan.toml'} is missing to save it again; "
            "run `runner execute` on the plan again",
            key="RUN_DIR",
        )
    repair_run_tokenizer(plan, run_dir, problem, log=log)
    return AutoTokenizer.from_pretrained(str(path))


def set_special_ids(net: Any, tokenizer: Any) -> None:  # PaddleNLP model and tokenizer (untyped)
    """Generation stops at the tokenizer's end-of-document piece."""
    for attr in ("eos", "pad", "bos"):
        token_id = getattr(tokenizer, f"{attr}_token_id", None)
        if token_id is not None:
            setattr(net.config, f"{attr}_token_id", int(token_id))
            if getattr(net, "generation_config", None) is not None:
                setattr(net.generation_config, f"{attr}_token_id", int(token_id))


def export_pretrained(
    plan: Plan,
    run_dir: Path,
    *,
    checkpoint: str | None = None,
    out_dir: Path | None = None,
    trust_pickled: bool = False,
) -> Path:
    """Write model + tokenizer with `save_pretrained` (PaddleNLP format, weights as
    safetensors), reload it with AutoModelForCausalLM and compare its logits with the
    checkpoint's on the fixed batch; only a matching export is moved into place, with its
    record (EXPORT_RECORD: checkpoint, checksums, the difference). Returns the folder."""
    from gptplan import paddlenlp_light

    AutoModelForCausalLM = paddlenlp_light.load().AutoModelForCausalLM
    run_dir = Path(run_dir)
    path = resolve_checkpoint(run_dir, checkpoint, trust_pickled=trust_pickled)
    tokenizer = load_run_tokenizer(run_dir, plan)
    net = load_trained_model(plan, path)
    set_special_ids(net, tokenizer)
    batch = fixed_batch(plan.model.vocab_size, plan.training.seq_len)
    want = logits_of(net, batch)
    out = Path(out_dir) if out_dir else run_dir / PRETRAINED_DIR
    out.parent.mkdir(parents=True, exist_ok=True)
    if out_dir is None:
        remove_partial_exports(run_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        net.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "gptplan_checkpoint.txt").write_text(f"{path.name}\n")
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), use_safetensors=True)
        reloaded.eval()
        diff = compare_logits(want, logits_of(reloaded, batch), what=f"the export of {path}")
        files = {p.name: _file_hash(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        _write_record(
            tmp / EXPORT_RECORD,
            {
                "checkpoint": path.name,
                "files": files,
                "max_abs_logit_diff": diff,
                "batch_shape": list(batch.shape),
                "tolerance": LOGIT_TOLERANCE,
            },
        )
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _jit_save(plan: Plan, net: paddle.nn.Layer, prefix: Path) -> None:
    """paddle.jit.save with the family's traceable stand-ins in place while it traces
    (gptplan.families: FamilySpec.jit_patches), put back afterwards."""
    from contextlib import ExitStack

    import paddle
    from paddle.static import InputSpec

    from gptplan import paddlenlp_light

    spec = [InputSpec([None, None], "int64", name="input_ids")]
    with ExitStack() as undo:
        for patch in families.get(plan.model.family).jit_patches:
            module, _, path = patch.target.partition(":")
            *parents, attribute = path.split(".")
            owner = paddlenlp_light.import_module(module)
            for parent in parents:
                owner = getattr(owner, parent)
            original = getattr(owner, attribute)
            setattr(owner, attribute, patch.replacement)
            undo.callback(setattr, owner, attribute, original)
        paddle.jit.save(net, str(prefix), input_spec=spec)


def export_model(
    plan: Plan, run_dir: Path, *, checkpoint: str | None = None, trust_pickled: bool = False
) -> Path:
    """paddle.jit.save of the newest checkpoint (static graph + params) for inference; input
    `input_ids` [batch, seq] int64 (any sizes), output the logits. Saved into a temporary
    folder, reloaded with paddle.jit.load and compared by logits with the checkpoint; only
    then moved to `export/model.*`, its record (JIT_RECORD) written last."""
    import paddle

    run_dir = Path(run_dir)
    path = resolve_checkpoint(run_dir, checkpoint, trust_pickled=trust_pickled)
    net = load_trained_model(plan, path)
    batch = fixed_batch(plan.model.vocab_size, plan.training.seq_len)
    want = logits_of(net, batch)
    folder = run_dir / "export"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".jit.", dir=folder))
    try:
        _jit_save(plan, net, tmp / "model")
        loaded = paddle.jit.load(str(tmp / "model"))
        diff = compare_logits(want, logits_of(loaded, batch), what=f"the jit export of {path}")
        (folder / JIT_RECORD).unlink(missing_ok=True)  # the old one no longer describes them
        for old in folder.glob("model.*"):
            if old.is_file():
                old.unlink()
        files = {}
        for part in sorted(tmp.iterdir()):
            files[part.name] = _file_hash(part)
            os.replace(part, folder / part.name)
        _write_record(
            folder / JIT_RECORD,
            {
                "checkpoint": path.name,
                "files": files,
                "max_abs_logit_diff": diff,
                "batch_shape": list(batch.shape),
                "tolerance": LOGIT_TOLERANCE,
            },
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder / "model"


def generate(
    run_dir: Path,
    *,
    prompt: str,
    checkpoint: str | None = None,
    max_new_tokens: int = 32,
    min_new_tokens: int = 0,
    top_k: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    trust_pickled: bool = False,
) -> dict:
    """Sample a continuation of `prompt` with PaddleNLP's generation API.

    From `export/paddlenlp` (the end-of-run export) when it is verified (its record matches
    its files: runner.export.verified_export) and no checkpoint is named; else the model is
    built from the named (or newest) checkpoint and the run's tokenizer, and `source` says
    why the export was not used.
    """
    from gptplan.plan import load_plan

    run_dir = Path(run_dir)
    pretrained = run_dir / PRETRAINED_DIR
    record = verified_export(pretrained) if checkpoint is None else None
    path = (
        None if record else resolve_checkpoint(run_dir, checkpoint, trust_pickled=trust_pickled)
    )  # bad input first
    import paddle

    from gptplan import paddlenlp_light

    AutoModelForCausalLM = paddlenlp_light.load().AutoModelForCausalLM
    quiet_paddlenlp()
    if record:
        paddle.set_device("cpu")
        net = AutoModelForCausalLM.from_pretrained(str(pretrained), use_safetensors=True)
        net.eval()
        tokenizer = load_run_tokenizer(run_dir)
        source = f"{pretrained} ({record.get('checkpoint')}, verified)"
    else:
        plan_file = run_dir / "plan.toml"
        if not plan_file.exists():
            raise UserError(f"{plan_file} is missing: not a run directory", key="RUN_DIR")
        tokenizer = load_run_tokenizer(run_dir)
        assert path is not None  # resolved above whenever the export is not used
        net = load_trained_model(load_plan(plan_file), path)
        source = str(path)
        if checkpoint is None and pretrained.exists():
            source += f" ({pretrained} is not a verified export: not used)"
    set_special_ids(net, tokenizer)
    real, total = len(tokenizer), int(net.config.vocab_size)
    if real > total:
        raise UserError(
            f"{run_dir} is inconsistent: its tokenizer has {real:,} pieces, its model "
            f"{total:,} (model.vocab_size); the tokenizer and the checkpoint are from "
            "different runs",
            key="RUN_DIR",
        )
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise UserError("the prompt tokenizes to nothing; give some text", key="--prompt")
    paddle.seed(seed)
    extra = {}
    if real < total:  # the padding rows of the vocabulary are never sampled
        from runner.model import sample_tokenizer_ids_only

        sample_tokenizer_ids_only(net, real)
    family = families.by_model_type(getattr(net.config, "model_type", ""))
    if family is not None and family.generate_bool_mask:
        # the family's generate wants a 2-D boolean mask of the prompt (gptplan.families)
        extra["attention_mask"] = paddle.ones([1, len(ids)], dtype="bool")
    with paddle.no_grad():
        out, _ = net.generate(
            input_ids=paddle.to_tensor([ids], dtype="int64"),
            **extra,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min(min_new_tokens, max_new_tokens),
            decode_strategy="sampling",
            top_k=top_k,
            temperature=temperature,
        )
    new_ids = [int(i) for i in out.numpy()[0].tolist()]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos in new_ids:
        new_ids = new_ids[: new_ids.index(eos)]
    try:
        if hasattr(tokenizer, "convert_ids_to_string"):  # CPM style: undoes the space pieces
            text = tokenizer.convert_ids_to_string(new_ids)
        else:
            text = tokenizer.decode(new_ids, skip_special_tokens=True)
    except (IndexError, ValueError, KeyError) as exc:  # an id the tokenizer does not have
        raise UserError(
            f"{run_dir}: the tokenizer cannot decode the sampled ids "
            f"({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}); "
            "its tokenizer and model do not belong together",
            key="RUN_DIR",
        ) from None
    return {
        "prompt": prompt,
        "continuation": text,
        "source": source,
        "prompt_tokens": len(ids),
        "new_tokens": len(new_ids),
        "decode_strategy": "sampling",
        "top_k": top_k,
        "temperature": temperature,
        "seed": seed,
    }
