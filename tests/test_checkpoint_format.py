"""Checkpoints and exports that cannot run code and always hold the model that trained (issues
34 and 39): safetensors + JSON, canonical names whatever wrapper trained the model, a state dict
that does not match the model is an error naming the keys, the earlier pickled format only
behind --trust-pickled-checkpoint, a checkpoint without weights refused, tensor-parallel shards
merged by PaddleNLP's own mappings, an interrupted export redone by the next run."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BASE_PLAN, LLAMA, merge, run_cli

from runner import checkpoint as ckpt


def _plan(overrides: dict | None = None):
    from gptplan.plan import plan_from_dict

    return plan_from_dict(merge(BASE_PLAN, overrides or {}))


def _model(plan):
    import paddle

    from runner.model import build_model

    paddle.seed(3)
    return build_model(plan.model, plan.parallel, seq_len=plan.training.seq_len)


def _write_checkpoint(root: Path, step: int, models: dict[str, dict], optimizer=None) -> Path:
    """A format-2 checkpoint with the given model files ({file name: state})."""
    tmp = ckpt.begin(root, step)
    for name, state in models.items():
        ckpt.save_tensors(tmp / name, ckpt.untie(state), kind="model")
    if optimizer is not None:
        ckpt.save_tensors(tmp / "optimizer.tp00_pp00_sd00.safetensors", optimizer, kind="optimizer")
    return ckpt.commit(tmp, {"step": step}, keep_last=5)


class _Wrapper:
    """Stands in for fleet's wrappers: the trained model in `_layers`, its state dict under
    `_layers.` names (what ShardingParallel's state_dict gives)."""

    def __init__(self, layers):
        self._layers = layers

    def state_dict(self):
        return {f"_layers.{k}": v for k, v in self._layers.state_dict().items()}


def test_checkpoint_keys_are_canonical_and_unmatched_keys_are_an_error(tmp_path):
    """Issue 34: a ZeRO-1 checkpoint's keys carried `_layers.` and the export loaded none of
    them (set_state_dict skipped each with a warning): an untrained model. Keys are now the
    bare model's, and a state dict that does not match is an error naming the keys."""
    from runner.export import fixed_batch, load_trained_model, logits_of

    plan = _plan()
    net = _model(plan)
    wrapped = _Wrapper(net)
    state = ckpt.model_state(wrapped)
    assert set(state) == set(net.state_dict()) and not any(k.startswith("_") for k in state)
    good = _write_checkpoint(tmp_path / "c", 4, {"model.tp00_pp00.safetensors": state})
    batch = fixed_batch(plan.model.vocab_size, plan.training.seq_len)
    net.eval()
    np.testing.assert_array_equal(
        logits_of(load_trained_model(plan, good), batch), logits_of(net, batch)
    )
    # what the runner wrote before: the wrapper's names
    bad = _write_checkpoint(
        tmp_path / "c", 8, {"model.tp00_pp00.safetensors": wrapped.state_dict()}
    )
    with pytest.raises(ckpt.CheckpointError) as err:
        load_trained_model(plan, bad)
    message = str(err.value)
    assert "37 missing (gpt." in message and "37 unexpected (_layers.gpt." in message
    fresh = _model(plan)
    partial = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(ckpt.CheckpointError, match=r"missing \(gpt\.decoder\.layers\.1\."):
        ckpt.load_model_state(fresh, partial, source="x")
    reshaped = dict(state)
    reshaped["gpt.embeddings.position_embeddings.weight"] = state[
        "gpt.embeddings.position_embeddings.weight"
    ][:3]
    with pytest.raises(ckpt.CheckpointError, match="of another shape"):
        ckpt.load_model_state(fresh, reshaped, source="x")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tensor_parallel_shards_are_merged_along_their_split_axes(tmp_path, family):
    """Export from a tp 2 checkpoint: the shards (split by PaddleNLP's own mappings, as a
    tensor-parallel model holds them) merged back give the one-process model's logits."""
    import paddle

    from gptplan import families
    from runner.export import fixed_batch, load_trained_model, logits_of
    from runner.model import _import, build_config

    over = LLAMA if family == "llama" else {}
    plan = _plan(over)
    net = _model(plan)
    net.eval()
    tp2 = {"parallel": {"nproc_per_node": 2, "tensor_parallel_degree": 2}}
    tp_plan = _plan(merge(merge(over, tp2), {"hardware": {"device": "gpu"}}))
    config = build_config(tp_plan.model, tp_plan.parallel, seq_len=32)
    cls = _import(families.get(plan.model.family).causal_lm_class)
    full = {k: v.numpy() for k, v in net.state_dict().items()}
    shards = {}
    for rank in range(2):
        config.tensor_parallel_degree, config.tensor_parallel_rank = 2, rank
        actions = cls._get_tensor_parallel_mappings(config, is_split=True)
        names = cls._resolve_prefix_keys(actions.keys(), full.keys(), ignore_error=True)
        for short, name in names.items():
            actions[name] = actions.pop(short)
        part = {k: paddle.to_tensor(actions[k](v) if k in actions else v) for k, v in full.items()}
        shards[f"model.tp{rank:02d}_pp00.safetensors"] = part
    assert (
        shards["model.tp01_pp00.safetensors"][
            "gpt.embeddings.word_embeddings.weight"
            if family == "gpt"
            else "llama.embed_tokens.weight"
        ].shape[0]
        == plan.model.vocab_size // 2
    )
    folder = _write_checkpoint(tmp_path, 4, shards)
    batch = fixed_batch(plan.model.vocab_size, plan.training.seq_len)
    merged = load_trained_model(tp_plan, folder)
    np.testing.assert_allclose(
        logits_of(merged, batch), logits_of(net, batch), rtol=1e-6, atol=1e-6
    )
    # a layout's shard missing is an error naming it
    (folder / "model.tp01_pp00.safetensors").unlink()
    state = json.loads((folder / "state.json").read_text())
    state["model_files"] = ["model.tp00_pp00.safetensors"]
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(ckpt.CheckpointError, match="missing pp00 tp01"):
        load_trained_model(tp_plan, folder)


def test_a_checkpoint_without_weights_is_refused(tmp_path):
    """Issue 39: a checkpoint holding no model weights was resumed from a fresh model and the
    run ended "finished". Now it is damaged: moved aside, the previous one used."""
    plan = _plan()
    state = ckpt.model_state(_model(plan))
    root = tmp_path / "checkpoints"
    older = _write_checkpoint(root, 4, {"model.tp00_pp00.safetensors": state})
    newest = _write_checkpoint(root, 8, {"model.tp00_pp00.safetensors": state})
    (newest / "model.tp00_pp00.safetensors").unlink()
    data = json.loads((newest / "state.json").read_text())
    data.pop("model_files")
    (newest / "state.json").write_text(json.dumps(data))
    ckpt.write_manifest(newest)
    assert ckpt.verify(newest) == "it holds no model weights (state.json lists no model file)"
    empty = _write_checkpoint(root, 12, {"model.tp00_pp00.safetensors": state})
    ckpt.save_tensors(empty / "model.tp00_pp00.safetensors", {}, kind="model")
    ckpt.write_manifest(empty)
    assert "holds no tensors" in ckpt.verify(empty)
    lines: list[str] = []
    assert ckpt.resume_point(root, log=lines.append) == older
    assert len(lines) == 2 and all("no model weights" in line for line in lines)
    with pytest.raises(ckpt.CheckpointError, match="no rank wrote model weights"):
        ckpt.commit(ckpt.begin(root, 16), {"step": 16}, keep_last=5)


def _old_format_checkpoint(root: Path, step: int, model_state, *, payload=None) -> Path:
    """A checkpoint as the runner wrote it before (paddle.save pickles), manifest recomputed
    with runner.checkpoint.write_manifest (the issue's recipe); `payload` in place of the
    weights when given."""
    import paddle

    folder = ckpt.step_dir(root, step)
    folder.mkdir(parents=True)
    target = folder / "model.tp00_pp00.pdparams"
    if payload is None:
        paddle.save(ckpt.untie(model_state), str(target))
    else:
        target.write_bytes(payload)
    paddle.save({}, str(folder / "optimizer.tp00_pp00_sd00.pdopt"))
    (folder / "state.json").write_text(json.dumps({"step": step}))
    ckpt.write_manifest(folder)
    return folder


class _Payload:
    """Unpickling this creates a file: proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_checkpoint_is_converted_only_behind_the_flag(tmp_path):
    plan = _plan()
    net = _model(plan)
    root = tmp_path / "checkpoints"
    marker = tmp_path / "ran"
    _old_format_checkpoint(root, 4, ckpt.model_state(net))
    crafted = _old_format_checkpoint(root, 8, {}, payload=pickle.dumps(_Payload(marker)))
    with pytest.raises(ckpt.CheckpointError, match="--trust-pickled-checkpoint"):
        ckpt.resume_point(root)
    assert not marker.exists()
    shutil.rmtree(crafted)  # the user's own old checkpoint: converted once, with the flag
    lines: list[str] = []
    converted = ckpt.resume_point(root, log=lines.append, trust_pickled=True)
    assert converted == ckpt.step_dir(root, 4) and "converted to safetensors" in lines[0]
    assert not list(converted.glob("*.pdparams")) and (root / "pickled" / "step_00000004").is_dir()
    assert ckpt.verify(converted) is None and not ckpt.is_pickled(converted)
    model, _, _ = ckpt.load_shard(converted, ckpt.ShardId())
    fresh = _model(_plan({"job": {"seed": 1}}))
    ckpt.load_model_state(fresh, model, source=str(converted))
    for key, value in net.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[key].numpy(), value.numpy())
    assert ckpt.resume_point(root) == converted  # no flag needed any more


@pytest.mark.e2e
def test_a_crafted_pickle_in_a_run_folder_a_plan_names_is_never_unpickled(finished_run, tmp_path):
    """Issue 39: with job.output_dir at a copy of a run whose newest checkpoint's weights are a
    crafted pickle (manifest recomputed), `runner execute` ran the payload. execute, export and
    generate now refuse it in one line, naming the flag; nothing is unpickled."""
    run, _ = finished_run("gpt")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    marker = tmp_path / "payload-ran"
    newest = ckpt.latest_checkpoint(copy / "checkpoints")
    for part in newest.glob("*.safetensors"):
        part.unlink()
    (newest / "model.tp00_pp00.pdparams").write_bytes(pickle.dumps(_Payload(marker)))
    state = json.loads((newest / "state.json").read_text())
    for key in ("format", "model_files"):
        state.pop(key, None)
    (newest / "state.json").write_text(json.dumps(state))
    ckpt.write_manifest(newest)
    plan = tmp_path / "plan.toml"
    data = (run.parent / "plan.toml").read_text()
    plan.write_text(data)
    for argv in (
        ["execute", str(plan), "--output-dir", str(copy)],
        ["export", str(copy)],
        ["generate", str(copy), "--prompt", "x", "--checkpoint", str(state["step"])],
    ):
        proc = run_cli("runner", *argv, cwd=tmp_path)
        assert proc.returncode == 2, (argv, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "--trust-pickled-checkpoint" in proc.stderr and "Traceback" not in proc.stderr
        assert not marker.exists(), argv


@pytest.mark.e2e
def test_a_killed_export_is_completed_by_the_rerun(finished_run, tmp_path):
    """Issue 39: `runner execute PLAN --export` killed once "model + tokenizer in PaddleNLP
    format" was printed: every rerun said "already finished" and wrote no export/model.*; a
    half-written model.json broke paddle.jit.load; export/.paddlenlp.* stayed. The rerun now
    redoes what is not whole and verified, removes the leftovers and says "export done"."""
    run, _ = finished_run("gpt")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "export")
    plan = tmp_path / "plan.toml"
    plan.write_text((run.parent / "plan.toml").read_text())
    argv = [sys.executable, "-m", "runner", "execute", str(plan), "--output-dir", str(copy)]
    proc = subprocess.Popen(
        [*argv, "--export"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("model + tokenizer in PaddleNLP format"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # what a kill mid jit save leaves: a torn model.json, no record; a temporary export
    (copy / "export" / "model.json").write_text('{"program": ')
    (copy / "export" / ".paddlenlp.x1y2").mkdir()
    (copy / "export" / ".paddlenlp.x1y2" / "model.safetensors").write_bytes(b"\0" * 64)
    rerun = subprocess.run([*argv, "--export"], cwd=tmp_path, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "already finished" in rerun.stdout
    assert "exported for inference (paddle.jit.save)" in rerun.stdout
    assert "model + tokenizer in PaddleNLP format" not in rerun.stdout  # that one was whole
    assert "export done, verified" in rerun.stdout
    assert not [p.name for p in (copy / "export").iterdir() if p.name.startswith(".")]
    import paddle

    from gptplan.plan import load_plan
    from runner.export import fixed_batch, load_trained_model, logits_of

    loaded = paddle.jit.load(str(copy / "export" / "model"))
    trained = load_trained_model(load_plan(plan), ckpt.latest_checkpoint(copy / "checkpoints"))
    batch = fixed_batch(4000, 32)
    np.testing.assert_allclose(logits_of(loaded, batch), logits_of(trained, batch), atol=1e-5)
    again = subprocess.run([*argv, "--export"], cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0 and "export done" not in again.stdout  # nothing left to do


def test_logit_check_counts_the_checkpoints_own_non_finite_logits_as_reproduced():
    """A diverging run's last good checkpoint can overflow on the fixed batch: an export that
    gives the same inf/nan there reproduces it (the export after a diverged run failed with
    'max |logit difference| nan'); a finite logit where the checkpoint had none does not."""
    import numpy as np

    from runner.checkpoint import CheckpointError
    from runner.export import compare_logits

    want = np.array([[1.0, np.nan, np.inf, -np.inf]], dtype="float32")
    assert compare_logits(want, want.copy(), what="export") == 0.0
    assert compare_logits(want, want + np.float32(5e-5), what="export") <= 1e-4
    for got in ([[1.0, 0.0, np.inf, -np.inf]], [[1.0, np.nan, -np.inf, -np.inf]]):
        with pytest.raises(CheckpointError, match="does not reproduce"):
            compare_logits(want, np.array(got, dtype="float32"), what="export")
    with pytest.raises(CheckpointError, match="does not reproduce"):
        compare_logits(want, want + np.float32(1e-3), what="export")
