"""The analytic cost model: every formula the planner uses, each with its source.

All functions take numpy arrays (or scalars) and broadcast, so the whole candidate space is
evaluated at once. Units are explicit in the names: bytes, seconds, hours, FLOP/s.

Sources (see ../shared/REFERENCES.md section 1):
- [N21]  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
         Clusters": parameter count (eq. 2), FLOPs per iteration with/without recompute (eq. 3),
         pipeline bubble (p-1)/m.
- [P22]  Chowdhery et al. 2022, PaLM, appendix B: model FLOPs per token 6N + 12·L·h·s and MFU.
- [K22], [Z20]: memory per device (activations, model states) lives in runner.memory, shared
         with the runner's local rehearsal, and is re-exported here.
- compute_efficiency, ring_allreduce_seconds and recompute_extra_flops_per_token live in
         runner.steptime (the runner models its
         local rehearsal with them) and are re-exported here.
- [YD]   Young 1974 / Daly 2006: optimal checkpoint interval sqrt(2·delta/lambda).
The model FLOPs and parameter count are shared with the runner (runner.model), so MFU means the
same thing in a plan and in a run report.
"""

from __future__ import annotations

import numpy as np

from runner.memory import (GB, ModelShape, activation_bytes_per_layer,  # noqa: F401
                           memory_per_device_bytes, model_state_bytes_per_param)
from runner.model import training_flops_per_token
from runner.plan import ModelSection
from runner.steptime import (compute_efficiency, recompute_extra_flops_per_token,  # noqa: F401
                             ring_allreduce_seconds)

RECOMPUTE_MODES = ("none", "core_attn", "full_attn", "full")
SHARDING_STAGES = ("", "stage1", "stage2", "stage3")


# ---- FLOPs -------------------------------------------------------------------------------------

def model_flops_per_token(m: ModelSection, seq_len):
    """[P22] 6N + 12·L·h·s (vectorised over seq_len); see runner.model for the exact N."""
    seq_len = np.asarray(seq_len)
    base = training_flops_per_token(m, 0)
    return base + 12.0 * m.num_hidden_layers * m.hidden_size * seq_len


# ---- time --------------------------------------------------------------------------------------

def pipeline_bubble_factor(pp, accumulation):
    """[N21] 1F1B: time scales by (m + p - 1)/m for m micro-batches and p stages."""
    m = np.asarray(accumulation, dtype=float)
    p = np.asarray(pp, dtype=float)
    return (m + p - 1.0) / m


# ---- spot and checkpoints ------------------------------------------------------------------

def young_daly_interval_hours(checkpoint_hours, failures_per_hour):
    """[YD] tau = sqrt(2·delta/lambda); infinite when nothing fails."""
    lam = np.asarray(failures_per_hour, dtype=float)
    with np.errstate(divide="ignore"):
        return np.where(lam > 0, np.sqrt(2.0 * checkpoint_hours / np.maximum(lam, 1e-30)),
                        np.inf)


def useful_fraction(checkpoint_hours, interval_hours, failures_per_hour, restart_hours):
    """[YD] 1 - delta/tau - lambda·(tau/2 + R): the share of paid time that trains.

    Clipped at 1% so a hopeless configuration stays finite (it will not be chosen)."""
    tau = np.asarray(interval_hours, dtype=float)
    lam = np.asarray(failures_per_hour, dtype=float)
    finite = np.isfinite(tau)
    safe_tau = np.where(finite, tau, 1.0)
    lost = np.where(finite, checkpoint_hours / safe_tau + lam * (safe_tau / 2 + restart_hours),
                    0.0)
    return np.clip(1.0 - lost, 0.01, 1.0)
