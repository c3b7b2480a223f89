"""Models people can use: a finished run leaves its model and tokenizer in PaddleNLP's format
(reloaded here with AutoModelForCausalLM / AutoTokenizer), `runner export` writes any
checkpoint, `runner generate` samples from the export or a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli

pytestmark = pytest.mark.e2e


def finish_run(family: str, finished_run):
    """The finished 12-step run of `family` shared by the session (checkpoints 8 and 12)."""
    run, proc = finished_run(family)
    assert "PaddleNLP format" in proc.stdout
    return run


@pytest.fixture(scope="module", params=["gpt", "llama"])
def family_run(request, finished_run):
    return finish_run(request.param, finished_run)


@pytest.fixture(scope="module")
def gpt_run(finished_run):
    return finish_run("gpt", finished_run)


@pytest.mark.parametrize("shared", ["gpt", "llama", "qwen-dp2"])
def test_end_of_run_export_reloads_with_paddlenlp_auto_classes(shared, finished_run):
    """Every family's end-of-run export (QWen's from its 2-process run) reloads with the Auto
    classes and computes what the last checkpoint does, and so does its jit export."""
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer

    from gptplan.plan import load_plan
    from runner.export import load_trained_model, resolve_checkpoint

    family_run = finish_run(shared, finished_run)
    export = family_run / "export" / "paddlenlp"
    assert (export / "gptplan_checkpoint.txt").read_text().strip() == "step_00000012"
    model = AutoModelForCausalLM.from_pretrained(str(export))
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    model.eval()
    ids = tokenizer("这个手机很好用")["input_ids"]
    assert ids and tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_string(ids).replace(" ", "") == "这个手机很好用"
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<eod>")
    plan = load_plan(family_run / "plan.toml")
    assert (
        type(model).__name__
        == {"gpt": "GPTForCausalLM", "llama": "LlamaForCausalLM", "qwen": "QWenForCausalLM"}[
            plan.model.family
        ]
    )
    # the same weights as the run's last checkpoint
    reference = load_trained_model(plan, resolve_checkpoint(family_run))
    x = paddle.to_tensor([ids], dtype="int64")
    with paddle.no_grad():
        got, want = model(x), reference(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = want[0] if isinstance(want, (tuple, list)) else want
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    jit = paddle.jit.load(str(family_run / "export" / "model"))(x)
    jit = jit[0] if isinstance(jit, (tuple, list)) else jit
    np.testing.assert_allclose(jit.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_export_and_generate_from_a_checkpoint(family_run, tmp_path):
    from runner.export import generate

    out = tmp_path / "step8"
    proc = run_cli("runner", "export", str(family_run), "--checkpoint", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
    assert not list(out.glob("*.pdparams"))  # nothing a reader would have to unpickle
    assert (out / "gptplan_checkpoint.txt").read_text().strip() == "step_00000008"
    sample = generate(family_run, prompt="这个手机", checkpoint="8", max_new_tokens=8, seed=1)
    assert sample["source"].endswith("step_00000008") and 0 < sample["new_tokens"] <= 8
    assert sample["continuation"]
    again = generate(family_run, prompt="这个手机", checkpoint="8", max_new_tokens=8, seed=1)
    assert again["continuation"] == sample["continuation"]  # seeded sampling repeats
    final = generate(family_run, prompt="这个手机", max_new_tokens=8, min_new_tokens=8)
    assert "export" in final["source"] and final["new_tokens"] == 8  # no early <eod>


def test_generate_samples_half_its_length_by_default_from_the_verified_export(gpt_run):
    """`runner generate` without --min-new-tokens returned one token (a tiny model's <eod>
    came first); it now samples at least half of --max-new-tokens, from the export only
    because its record matches its files."""
    import json

    proc = run_cli("runner", "generate", str(gpt_run), "--prompt", "这个手机", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sample = json.loads(proc.stdout)
    assert sample["new_tokens"] >= 16 and sample["source"].endswith("verified)")


def test_bad_export_and_generate_input_is_one_line(gpt_run, tmp_path):
    proc = run_cli("runner", "export", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("runner", "generate", str(gpt_run), "--prompt", "x", "--checkpoint", "5")
    assert proc.returncode == 2 and "allowed: 8, 12" in proc.stderr
    proc = run_cli("runner", "generate", str(gpt_run), "--prompt", "x", "--top-k", "0")
    assert proc.returncode == 2 and "--top-k" in proc.stderr
