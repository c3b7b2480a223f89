"""Where a bank-FAQ rehearsal step's time goes (bench/README.md section 9): one training
micro-step of the plan's model (GPT 110M, micro-batch 2 x seq 512, one process) on the
rehearsal device or on plain CPU, timed by phase (forward, backward, optimizer; measured, after
one warm-up step), then one more under Paddle's profiler (per-op totals, printed).

Usage, from the repository root:
  env $(python -c "from runner import device; print(' '.join(f'{k}={v}' for k, v in \
device.env({}).items()))") FLAGS_selected_gptplan_cpus=0 python bench/device_step_profile.py device
  python bench/device_step_profile.py cpu
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

MICRO, SEQ = 2, 512


def main(where: str) -> None:
    import numpy as np
    import paddle
    from paddle import profiler

    from gptplan.plan import load_plan
    from runner.model import build_model

    if where == "device":
        from runner import device

        if not device.activate_if_on_device():
            raise SystemExit(f"not on the rehearsal device ({paddle.get_device()})")
    else:
        paddle.set_device("cpu")
    plan = load_plan(Path(__file__).resolve().parent.parent / "plans" / "bank_faq.toml")
    paddle.seed(1)
    model = build_model(plan.model, plan.parallel, seq_len=SEQ)
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    rng = np.random.default_rng(0)

    def step() -> tuple[float, float, float]:
        ids = paddle.to_tensor(rng.integers(3, 1000, size=(MICRO, SEQ + 1)).astype("int64"))
        t0 = time.perf_counter()
        loss: Any = model(ids[:, :-1], labels=ids[:, 1:])[0]
        float(loss)  # synchronises
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.clear_grad()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    step()  # warm-up
    times = [step() for _ in range(2)]
    phases = ("forward_s", "backward_s", "optimizer_s")
    out = {"where": where, **{k: [round(t[i], 2) for t in times] for i, k in enumerate(phases)}}
    print(json.dumps(out))
    targets = [profiler.ProfilerTarget.CPU]
    if where == "device":
        targets.append(profiler.ProfilerTarget.CUSTOM_DEVICE)
    # no trace files (Paddle writes ./profiler_log/ by default): the printed summary only
    prof = profiler.Profiler(targets=targets, on_trace_ready=lambda _prof: None)
    prof.start()
    step()
    prof.stop()
    prof.summary(sorted_by=profiler.SortedKeys.CPUTotal, op_detail=False, time_unit="s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "device")
