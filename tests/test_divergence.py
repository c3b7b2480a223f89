"""The divergence guard (issue 29): a loss that is NaN/inf, or that stays above FACTOR x its
running minimum for PATIENCE steps, stops the run with one line and exit 1; the checkpoint
rotation never drops the last good model; --ignore-divergence trains on."""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_cli

from runner import checkpoint as ckpt
from runner.checkpoint import protected
from runner.divergence import FACTOR, PATIENCE, DivergenceGuard, last_good


def test_guard_stops_after_patience_steps_above_the_factor():
    guard = DivergenceGuard()
    assert guard.observe(1, 9.0) is None
    for step in range(2, 2 + PATIENCE - 1):
        assert guard.observe(step, 64.0) is None
        assert guard.diverging_since == 2
    reason = guard.observe(1 + PATIENCE, 64.0)
    assert reason and f"{FACTOR:g} x its running minimum 9" in reason and "since step 2" in reason


def test_guard_forgives_a_short_spike_and_a_falling_loss():
    guard = DivergenceGuard()
    for step, loss in enumerate([9.0, 7.0, 5.0, 11.0, 4.0, 3.0, 5.9, 2.9], start=1):
        assert guard.observe(step, loss) is None
    assert guard.running_min == 2.9 and guard.diverging_since is None


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_guard_stops_at_once_on_a_non_finite_loss(bad):
    guard = DivergenceGuard()
    guard.observe(1, 9.0)
    assert "not a finite number" in guard.observe(2, bad)


def test_guard_state_survives_a_resume():
    guard = DivergenceGuard()
    for step, loss in enumerate([9.0, 30.0], start=1):
        guard.observe(step, loss)
    again = DivergenceGuard.from_state(json.loads(json.dumps(guard.state())))
    assert again == guard


def runner_in_process(*argv: str) -> tuple[int, list[str]]:
    import contextlib
    import io

    from runner.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    assert "Traceback" not in err.getvalue()
    text = err.getvalue().splitlines()
    lines = [x for x in text if x.strip() and "Warning" not in x and "warn(" not in x]
    return rc, lines


def fake_checkpoint(root, step: int, loss: float, diverging_since=None):
    folder = ckpt.step_dir(root, step)
    folder.mkdir(parents=True)
    state = {"step": step, "loss": loss, "diverging_since": diverging_since}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / ckpt.MANIFEST).write_text("{}")


def test_rotation_keeps_the_last_good_and_the_best_checkpoint(tmp_path):
    """Before the fix keep_last = 2 rotated every checkpoint from before the divergence out."""
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 1, 3.0)  # best by loss
    fake_checkpoint(root, 2, 3.1)  # last good
    for step in (3, 4, 5):
        fake_checkpoint(root, step, 64.0, diverging_since=3)
        ckpt.rotate(root, keep_last=2)
    kept = [s for s, _ in ckpt.complete_checkpoints(root)]
    assert kept == [1, 2, 4, 5]
    assert last_good(root)[0].name == "step_00000002"
    assert protected(ckpt.complete_checkpoints(root)) == {
        ckpt.step_dir(root, 1),
        ckpt.step_dir(root, 2),
    }


def test_rotation_of_a_healthy_run_keeps_only_the_last_n(tmp_path):
    root = tmp_path / "checkpoints"
    for step, loss in enumerate([9.0, 8.0, 7.0, 6.0], start=1):
        fake_checkpoint(root, step, loss)
        ckpt.rotate(root, keep_last=2)
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [3, 4]


DIVERGING = {
    "training": {
        "learning_rate": 1e6,
        "min_learning_rate": 1e5,
        "max_grad_norm": 0.0,
        "max_steps": 10,
        "warmup_steps": 0,
    },
    "checkpoint": {"interval_steps": 1, "keep_last": 2},
}


@pytest.mark.e2e
def test_diverging_plan_stops_keeps_a_good_checkpoint_and_bills_less(write_plan, tmp_path):
    """The issue's plan (learning_rate 1e6, no clipping) trained all its steps (20 there, 10
    here), was billed and exported, and keep_last = 2 rotated every checkpoint from before the
    divergence out."""
    plan = write_plan(DIVERGING)
    proc = run_cli("runner", "execute", str(plan), cwd=tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: training diverged"), proc.stderr
    run = tmp_path / "run"
    result = json.loads((run / "result.json").read_text())
    assert result["stop_reason"] == "loss diverged" and not result["finished"]
    stopped = result["completed_steps"]
    assert stopped < 10
    good = last_good(run / "checkpoints")
    assert good is not None and good[1]["step"] < result["divergence"]["step"]
    assert f"last good checkpoint is {good[0]}" in lines[0]
    assert f"step {stopped} of 10" in lines[0]
    assert not (run / "export").exists()  # a diverged model is not exported
    # billed: one attempt, its steps only (the bill covers fewer steps than the plan's 20)
    from runner.billing import Billing

    billing = Billing(run)
    assert len(billing.attempts) == 1 and billing.total_seconds() > 0
    # a rerun would resume from a checkpoint of the diverged model: refused, same advice
    rc, lines = runner_in_process("execute", str(plan))  # refused before anything trains
    assert rc == 1 and len(lines) == 1 and "while the loss was diverging" in lines[0], lines
    assert "--ignore-divergence" in lines[0] and "--fresh" in lines[0]
    # --ignore-divergence goes on from the newest checkpoint to the end of the plan
    on = run_cli("runner", "execute", str(plan), "--ignore-divergence", cwd=tmp_path)
    assert on.returncode == 0 and "Traceback" not in on.stderr, on.stderr[-3000:]
    assert json.loads((run / "result.json").read_text())["completed_steps"] == 10
