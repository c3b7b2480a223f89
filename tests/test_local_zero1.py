"""`runner execute --local` keeps a plan's ZeRO-1 as ZeRO-1 over the local processes (issue 25):
Paddle's DygraphShardingOptimizer (fleet.distributed_optimizer with sharding_degree) runs on CPU
with gloo, so the bank-FAQ plan's own strategy (stage1 x 8 on A100s) rehearses here as stage1 x
2, and its losses equal a data-parallel run of the same batch."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import REPO, run_cli, small_model_pins

from gptplan.plan import load_plan

BANK = REPO / "plans" / "bank_faq.toml"


def test_localize_keeps_zero1_as_zero1_over_the_local_processes(monkeypatch):
    from runner import rehearsal
    from runner.device import support as device_support

    monkeypatch.setattr(rehearsal, "local_device_count", lambda device: 2)
    plan = load_plan(BANK)
    assert (plan.parallel.sharding, plan.parallel.sharding_parallel_degree) == ("stage1", 8)
    local, changes = rehearsal.localize(plan, device_support.PLAIN_CPU)
    p = local.parallel
    assert (p.sharding, p.sharding_parallel_degree, p.data_parallel_degree) == ("stage1", 2, 1)
    assert p.nproc_per_node == 2 and "parallel.sharding_parallel_degree: 8 -> 2" in changes
    # stage2/3 need the rehearsal device (tests/test_rehearsal_layout.py): on plain CPU, dp
    staged = dataclasses.replace(
        plan, parallel=dataclasses.replace(plan.parallel, sharding="stage2")
    )
    p2 = rehearsal.localize(staged, device_support.PLAIN_CPU)[0].parallel
    assert (p2.sharding, p2.sharding_parallel_degree, p2.data_parallel_degree) == ("", 1, 2)


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines]


@pytest.mark.e2e
def test_bank_faq_local_runs_zero1_over_two_processes_with_the_data_parallel_losses(
    tmp_path, shared_cache
):
    """Before: --local turned stage1 x 8 into data parallel x 2 (the plan's strategy never ran
    here). Now it runs stage1 x 2; the same batch through data parallel gives the same losses
    (ZeRO-1 shards only the optimizer states: the update is the same arithmetic)."""
    small = [
        "--set",
        f"job.cache_dir={json.dumps(str(shared_cache))}",
        "--set",
        "job.target_tokens=0",
        # the plan's layout and schedule with a model and data the size of every other
        # end-to-end test's (the suite's shared tokenizer and data; neither the layout nor the
        # export's key names depend on the size): GPT-Base's 110M took most of this test's time
        *(a for pin in small_model_pins() for a in ("--set", pin)),
        "--set",
        "training.per_device_train_batch_size=1",
        "--set",
        "training.seq_len=32",
        "--set",
        "training.gradient_accumulation_steps=1",
        "--set",
        "training.logging_steps=1",
        # one precision for both runs (on the rehearsal device AMP runs with data parallel but
        # not with sharding stage 1: docs/device.md)
        "--set",
        'training.precision="fp32"',
        "--set",
        'training.fp16_opt_level="O1"',
        "--set",
        "training.use_flash_attention=false",
        "--max-steps",
        "2",
    ]
    zero1 = run_cli(
        "runner", "execute", str(BANK), "--local", *small, "--output-dir", "z1", cwd=tmp_path
    )
    assert zero1.returncode == 0, zero1.stdout[-2000:] + zero1.stderr[-2000:]
    assert "parallel.sharding_parallel_degree: 8 -> 2" in zero1.stdout
    plan = load_plan(tmp_path / "z1" / "plan.toml")
    assert (plan.parallel.sharding, plan.parallel.sharding_parallel_degree) == ("stage1", 2)
    dp = run_cli(
        "runner",
        "execute",
        str(BANK),
        "--local",
        *small,
        "--set",
        'parallel.sharding=""',
        "--set",
        "parallel.sharding_parallel_degree=1",
        "--set",
        "parallel.data_parallel_degree=8",
        "--output-dir",
        "dp",
        cwd=tmp_path,
    )
    assert dp.returncode == 0, dp.stdout[-2000:] + dp.stderr[-2000:]
    assert load_plan(tmp_path / "dp" / "plan.toml").parallel.sharding == ""
    a, b = _losses(tmp_path / "z1"), _losses(tmp_path / "dp")
    assert len(a) == len(b) == 2
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert a[1] != a[0]  # the second loss follows one optimizer update
    assert "export done, verified" in zero1.stdout
    assert "Skip loading" not in zero1.stdout + zero1.stderr
    _export_is_the_trained_model(tmp_path / "z1")


def _export_is_the_trained_model(run_dir):
    """Issue 34: the ZeRO-1 run's export held the initial weights (the checkpoint's keys
    carried fleet's `_layers.` prefix and were skipped). Its weights are the checkpoint's,
    under the bare model's names, and its logits on a fixed batch are the trained model's."""
    import numpy as np
    import paddle
    from paddlenlp.transformers import AutoModelForCausalLM
    from safetensors.numpy import load_file

    from runner import checkpoint as ckpt
    from runner.export import fixed_batch, load_trained_model, logits_of

    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    saved = load_file(str(latest / "model.tp00_pp00.safetensors"))
    assert saved and not any(k.startswith("_layers.") for k in saved)
    exported = load_file(str(run_dir / "export" / "paddlenlp" / "model.safetensors"))
    shared = set(saved) & set(exported)
    assert len(shared) == len(saved)
    equal = [k for k in shared if np.array_equal(saved[k], exported[k])]
    assert len(equal) == len(shared)
    biases = [k for k in shared if k.endswith("bias")]
    assert biases and any(np.abs(exported[k]).max() > 0 for k in biases)  # trained, not init
    plan = load_plan(run_dir / "plan.toml")
    paddle.set_device("cpu")
    export = AutoModelForCausalLM.from_pretrained(str(run_dir / "export" / "paddlenlp"))
    export.eval()
    batch = fixed_batch(plan.model.vocab_size, plan.training.seq_len)
    trained = load_trained_model(plan, latest)
    np.testing.assert_allclose(
        logits_of(export, batch), logits_of(trained, batch), rtol=1e-5, atol=1e-5
    )
