"""The divergence guard: a run whose loss has blown up stops instead of training to the end.

After every optimizer step the loss (the mean over ranks, the same number on every rank) is
checked. It has diverged when it is not a finite number (NaN, inf), or when it stays above
`FACTOR` x its running minimum for `PATIENCE` consecutive steps (the running minimum counts
only steps that were not above it). The loop then stops without writing a checkpoint of the
diverged model; the runner prints one line (the step, the loss, the last good checkpoint) and
exits 1, having billed the steps it trained.

Every checkpoint records the guard's state (`loss_running_min`, `diverging_since`: the first
step of a rise still in progress, or null), so a resume continues the same watch, and the
rotation of `checkpoint.keep_last` never removes the newest checkpoint taken before a rise
began nor the one with the lowest loss (runner.checkpoint.commit). A rerun whose newest
checkpoint was taken during a rise is refused (exit 1) with the same advice.
`runner execute --ignore-divergence` trains on regardless (the guard then only reports).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from gptplan.errors import UserError
from runner.checkpoint import checkpoint_state, complete_checkpoints, is_good

FACTOR = 2.0  # a loss above this multiple of its running minimum is rising ...
PATIENCE = 3  # ... and has diverged after this many consecutive such steps
IGNORE_ENV = "GPTPLAN_IGNORE_DIVERGENCE"  # set by --ignore-divergence for launched ranks
STOP_DIVERGED = "loss diverged"


class DivergedError(UserError):
    """The run's newest checkpoint is from a diverged loss: exit 1 (the input was valid)."""

    exit_status = 1


def ignoring() -> bool:
    return os.environ.get(IGNORE_ENV) == "1"


@dataclass
class DivergenceGuard:
    running_min: float = math.inf
    diverging_since: int | None = None  # first (1-based) step of the current rise
    streak: int = 0

    @classmethod
    def from_state(cls, state: dict | None) -> DivergenceGuard:
        """The guard as a checkpoint left it (a fresh one for runs from before the guard)."""
        if not state:
            return cls()
        low = state.get("loss_running_min")
        since = state.get("diverging_since")
        streak = state.get("diverging_steps")
        return cls(
            running_min=float(low) if isinstance(low, (int, float)) else math.inf,
            diverging_since=since if isinstance(since, int) else None,
            streak=streak if isinstance(streak, int) else 0,
        )

    def observe(self, step: int, loss: float) -> str | None:
        """Record the loss after `step` completed steps; the reason when it has diverged."""
        if not math.isfinite(loss):
            self.streak += 1
            self.diverging_since = self.diverging_since or step
            return f"loss {loss} at step {step} is not a finite number"
        if loss > FACTOR * self.running_min:
            self.streak += 1
            self.diverging_since = self.diverging_since or step
            if self.streak >= PATIENCE:
                return (
                    f"loss {loss:.4g} at step {step} has stayed above {FACTOR:g} x its running "
                    f"minimum {self.running_min:.4g} for {self.streak} steps (since step "
                    f"{self.diverging_since})"
                )
            return None
        self.streak, self.diverging_since = 0, None
        self.running_min = min(self.running_min, loss)
        return None

    def state(self) -> dict:
        """What a checkpoint records (state.json)."""
        return {
            "loss_running_min": self.running_min if math.isfinite(self.running_min) else None,
            "diverging_since": self.diverging_since,
            "diverging_steps": self.streak,
        }


def last_good(root: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint taken before a rise began, and its state."""
    for _, folder in reversed(complete_checkpoints(root)):
        state = checkpoint_state(folder)
        if state is not None and is_good(state):
            return folder, state
    return None


def advice(run_dir: Path) -> str:
    """Where a diverged run can go on from."""
    good = last_good(Path(run_dir) / "checkpoints")
    where = (
        f"the last good checkpoint is {good[0]} (step {good[1].get('step')}, loss "
        f"{_fmt(good[1].get('loss'))})"
        if good
        else "no checkpoint from before the divergence exists"
    )
    return (
        f"{where}; lower training.learning_rate (or set training.max_grad_norm) and rerun "
        "with --fresh, or rerun with --ignore-divergence to train on"
    )


def _fmt(loss: object) -> str:

    return f"{loss:.4g}" if isinstance(loss, (int, float)) else "unknown"


def stopped_line(result: dict, run_dir: Path, billed_s: float) -> str:
    """The one line of a run the guard stopped."""
    div = result.get("divergence") or {}
    return (
        f"error: training diverged: {div.get('reason', 'the loss diverged')}; stopped after "
        f"step {result.get('completed_steps')} of {result.get('max_steps')} (billed "
        f"{billed_s:.1f} s, measured), no checkpoint of the diverged model written; "
        f"{advice(run_dir)}"
    )


def check_resume(state: dict | None, latest: Path | None, run_dir: Path, *, ignore: bool) -> None:
    """Refuse to resume from a checkpoint taken while the loss was rising (exit 1)."""
    if ignore or state is None or latest is None or is_good(state):
        return
    raise DivergedError(
        f"the newest checkpoint {latest} was taken while the loss was diverging (since step "
        f"{state.get('diverging_since')}, loss {_fmt(state.get('loss'))} at step "
        f"{state.get('step')}); {advice(run_dir)}"
    )
