"""The analytic cost model: every formula the planner uses, each with its source.

All functions take numpy arrays (or scalars) and broadcast, so the whole candidate space is
evaluated at once. Units are explicit in the names: bytes, seconds, hours, FLOP/s.

Sources (see ../shared/REFERENCES.md section 1):
- [N21]  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
         Clusters": parameter count (eq. 2), FLOPs per iteration with/without recompute (eq. 3),
         pipeline bubble (p-1)/m.
- [P22]  Chowdhery et al. 2022, PaLM, appendix B: model FLOPs per token 6N + 12·L·h·s and MFU.
- [K22], [Z20]: memory per device (activations, model states) lives in gptplan.memory, shared
         with the runner's local rehearsal; its names are imported here for the planner.
- Step time (GEMM shapes, attention, memory-bound work, alpha-beta collectives, bubble,
         recompute) is ONE composition, gptplan.steptime.step_time_parts, used directly by
         planner.screen and the runner; it is not re-exported here.
- [YD]   Young 1974 / Daly 2006: optimal checkpoint interval sqrt(2·delta/lambda).
The model FLOPs and parameter count are shared with the runner (runner.model), so MFU means the
same thing in a plan and in a run report.
"""

from __future__ import annotations

import numpy as np

from gptplan.memory import (  # noqa: F401
    GB,
    ModelShape,
    activation_bytes_per_layer,
    memory_per_device_bytes,
    model_state_bytes_per_param,
)
from gptplan.modelfacts import training_flops_per_token
from gptplan.plan import ModelSection

# ---- FLOPs -------------------------------------------------------------------------------------


def model_flops_per_token(m: ModelSection, seq_len):
    """[P22] 6N + 12·L·h·s (vectorised over seq_len); see runner.model for the exact N."""
    seq_len = np.asarray(seq_len)
    base = training_flops_per_token(m, 0)
    return base + 12.0 * m.num_hidden_layers * m.hidden_size * seq_len


# ---- uncertainty -------------------------------------------------------------------------------


def interval_from_throughput(*, tokens_per_s, hours, fixed_hours, cost, p10_ratio, p90_ratio):
    """The 80% interval (p10..p90) on modelled throughput, hours and cost.

    p10_ratio/p90_ratio are the 10th/90th percentiles of measured/modelled tokens/s from the
    fit's leave-one-source-out residuals (hardware profile [efficiency]). Time that scales with
    throughput (training, checkpoints, lost work) scales by 1/ratio; fixed time (start-up)
    does not; cost follows hours. The fast end of throughput is the short, cheap end:
    hours_p10 comes from throughput_p90.
    """
    tps = np.asarray(tokens_per_s, dtype=float)
    h = np.asarray(hours, dtype=float)
    fixed = np.asarray(fixed_hours, dtype=float)
    lo, hi = np.asarray(p10_ratio, dtype=float), np.asarray(p90_ratio, dtype=float)
    variable = np.maximum(h - fixed, 0.0)
    per_hour = np.asarray(cost, dtype=float) / np.maximum(h, 1e-12)
    hours_p10 = variable / hi + fixed
    hours_p90 = variable / lo + fixed
    return {
        "tokens_per_s_p10": tps * lo,
        "tokens_per_s_p90": tps * hi,
        "hours_p10": hours_p10,
        "hours_p90": hours_p90,
        "cost_p10": per_hour * hours_p10,
        "cost_p90": per_hour * hours_p90,
    }


# ---- spot and checkpoints ------------------------------------------------------------------


def checkpoint_write_hours(*, state_bytes, nodes, node_gbytes_per_s, storage_cap_gbytes_per_s=0.0):
    """Time to write one checkpoint: every node writes its own shards in parallel, so each
    writes state_bytes/nodes at its own bandwidth, capped by what the offer's storage states
    per node (0 = no stated cap)."""
    bw = (
        node_gbytes_per_s
        if not storage_cap_gbytes_per_s
        else min(node_gbytes_per_s, storage_cap_gbytes_per_s)
    )
    return (
        np.asarray(state_bytes, dtype=float)
        / np.maximum(np.asarray(nodes, dtype=float), 1.0)
        / (bw * 1e9)
        / 3600
    )


def young_daly_interval_hours(checkpoint_hours, failures_per_hour):
    """[YD] tau = sqrt(2·delta/lambda); infinite when nothing fails."""
    lam = np.asarray(failures_per_hour, dtype=float)
    with np.errstate(divide="ignore"):
        return np.where(lam > 0, np.sqrt(2.0 * checkpoint_hours / np.maximum(lam, 1e-30)), np.inf)


def useful_fraction(checkpoint_hours, interval_hours, failures_per_hour, restart_hours):
    """[YD] 1 - delta/tau - lambda·(tau/2 + R): the share of paid time that trains.

    Clipped at 1% so a hopeless configuration stays finite (it will not be chosen)."""
    tau = np.asarray(interval_hours, dtype=float)
    lam = np.asarray(failures_per_hour, dtype=float)
    finite = np.isfinite(tau)
    safe_tau = np.where(finite, tau, 1.0)
    lost = np.where(finite, checkpoint_hours / safe_tau + lam * (safe_tau / 2 + restart_hours), 0.0)
    return np.clip(1.0 - lost, 0.01, 1.0)
