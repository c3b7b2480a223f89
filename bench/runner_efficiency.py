"""Runner efficiency on this machine (benchmark 3 of bench/README.md).

Runs the shipped CPU plan (plans/cpu_tiny_dp2.toml) through the real `runner execute` CLI in
several variants, in one session so the ratios share the machine's state:

  1 process vs 2 processes (data parallel, gloo)       -> measured tokens/s
  packing vs per-document padding (the source article)  -> useful tokens/s, useful share
  the runner's step vs a bare forward/backward/step loop on the same batch -> overhead
  MFU against this machine's measured matmul peak

Prints a table and writes bench/results/runner_efficiency.json. Not a test: numbers vary
with the machine; `--quick` runs fewer steps (under 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli
import tomli_w
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "plans" / "cpu_tiny_dp2.toml"
RESULTS = REPO / "bench" / "results"

BARE_LOOP = r"""
import json, sys, time
import numpy as np
import paddle
from paddle.utils import unique_name
from runner.model import build_model
from gptplan.plan import load_plan
plan = load_plan(sys.argv[1]); steps = int(sys.argv[2])
paddle.set_device("cpu"); paddle.seed(1)
t = plan.training
with unique_name.guard():
    model = build_model(plan.model, plan.parallel, seq_len=t.seq_len)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
rng = np.random.default_rng(0)
def batch():
    ids = rng.integers(0, plan.model.vocab_size, (t.per_device_train_batch_size, t.seq_len + 1))
    return paddle.to_tensor(ids[:, :-1]), paddle.to_tensor(ids[:, 1:])
times = []
for step in range(steps + 3):
    start = time.perf_counter()
    for _ in range(t.gradient_accumulation_steps):
        x, y = batch()
        loss, _ = model(x, labels=y)
        (loss / t.gradient_accumulation_steps).backward()
    opt.step(); opt.clear_grad(); float(loss)
    times.append(time.perf_counter() - start)
print(json.dumps({"step_times": times[3:]}))
"""

# Matmul peak of this machine, measured in the same run as the training variants: Paddle
# (threads from FLAGS_paddle_num_threads, which Paddle applies over OMP_NUM_THREADS; its
# default is 1) and numpy (OpenBLAS, all cores) side by side, best of 3 at 2048x2048 fp32.
PEAK = r"""
import json, time
import numpy as np
import paddle
paddle.set_device("cpu")
n = 2048
a = paddle.randn([n, n]); b = paddle.randn([n, n])
x = np.random.rand(n, n).astype("float32"); y = np.random.rand(n, n).astype("float32")
for _ in range(2): paddle.matmul(a, b).numpy(); x @ y
best, best_np = 0.0, 0.0
for _ in range(3):
    start = time.perf_counter(); c = paddle.matmul(a, b); c.numpy()
    best = max(best, 2 * n**3 / (time.perf_counter() - start))
    start = time.perf_counter(); x @ y
    best_np = max(best_np, 2 * n**3 / (time.perf_counter() - start))
print(json.dumps({"peak_tflops": best / 1e12, "numpy_tflops": best_np / 1e12}))
"""


def python_json(code: str, *args: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ) | (env or {}),
        cwd=REPO,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_variant(name: str, overrides: dict, steps: int, work: Path) -> dict:
    data = tomli.loads(PLAN.read_text())
    for section, values in overrides.items():
        data[section].update(values)
    data["name"] = name
    data["job"]["output_dir"] = str(work / name)
    data["job"]["target_tokens"] = 0
    data["training"]["max_steps"] = steps
    data["training"]["warmup_steps"] = min(data["training"]["warmup_steps"], steps)
    data["budget"]["max_cost"] = 0.0
    plan = work / f"{name}.toml"
    plan.write_text(tomli_w.dumps(data))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "execute", str(plan)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    result = json.loads((work / name / "result.json").read_text())
    m = result["measured"]
    return {
        "variant": name,
        "plan": str(plan),
        "processes": data["parallel"]["nproc_per_node"],
        "packing": data["training"]["packing"],
        "steps": steps,
        "wall_s": time.time() - started,
        "step_time_s": m["step_time_s"],
        "useful_tokens_per_s": m["tokens_per_second"],
        "useful_fraction": m["useful_token_fraction"],
        "numel_tokens_per_s": (
            m["tokens_per_second"] / m["useful_token_fraction"]
            if m["useful_token_fraction"]
            else 0.0
        ),
        "mfu_vs_profile_peak": m["mfu"],
        "peak_memory_gb": m["peak_memory_gb"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (< 5 min)")
    args = parser.parse_args()
    steps = 40 if args.quick else 150
    one_proc = {"parallel": {"nproc_per_node": 1, "data_parallel_degree": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        long = {"model": {"max_position_embeddings": 256}}
        rows = [
            run_variant("dp2_packed", {}, steps, work),
            run_variant("dp1_packed", one_proc, steps, work),
            run_variant("dp1_padded", one_proc | {"training": {"packing": False}}, steps, work),
            # longer windows: the article pads each sentence to max_length
            run_variant(
                "dp1_packed_s256",
                one_proc | long | {"training": {"seq_len": 256, "per_device_train_batch_size": 2}},
                steps,
                work,
            ),
            run_variant(
                "dp1_padded_s256",
                one_proc
                | long
                | {
                    "training": {"seq_len": 256, "per_device_train_batch_size": 2, "packing": False}
                },
                steps,
                work,
            ),
        ]
        bare = python_json(BARE_LOOP, rows[1]["plan"], str(max(20, steps // 2)))
    cores = str(os.cpu_count() or 1)
    measured = python_json(PEAK, env={"FLAGS_paddle_num_threads": cores, "OMP_NUM_THREADS": cores})
    peak, numpy_peak = measured["peak_tflops"], measured["numpy_tflops"]
    peak_1t = python_json(PEAK, env={"FLAGS_paddle_num_threads": "1", "OMP_NUM_THREADS": "1"})[
        "peak_tflops"
    ]
    bare_step = sorted(bare["step_times"])[len(bare["step_times"]) // 2]
    packed, padded = rows[1], rows[2]
    from gptplan.modelfacts import training_flops_per_token
    from gptplan.plan import load_plan

    plan = load_plan(PLAN)
    flops = training_flops_per_token(plan.model, plan.training.seq_len)
    summary = {
        "dp2_over_dp1_tokens_per_s": rows[0]["useful_tokens_per_s"] / packed["useful_tokens_per_s"],
        "packed_over_padded_useful_tokens_per_s": packed["useful_tokens_per_s"]
        / padded["useful_tokens_per_s"],
        "padded_useful_fraction": padded["useful_fraction"],
        "packed_over_padded_useful_tokens_per_s_seq256": rows[3]["useful_tokens_per_s"]
        / rows[4]["useful_tokens_per_s"],
        "padded_useful_fraction_seq256": rows[4]["useful_fraction"],
        "runner_overhead_vs_bare_loop": packed["step_time_s"] / bare_step - 1,
        "bare_loop_step_time_s": bare_step,
        "matmul_peak_tflops_all_threads": peak,
        "matmul_peak_tflops_one_thread": peak_1t,
        "numpy_matmul_tflops_all_threads": numpy_peak,
        "mfu_dp1_vs_measured_peak": flops * packed["useful_tokens_per_s"] / (peak * 1e12),
        "mfu_dp2_vs_measured_peak": flops * rows[0]["useful_tokens_per_s"] / (2 * peak_1t * 1e12),
    }
    table = [
        [
            r["variant"],
            r["processes"],
            r["packing"],
            f"{r['step_time_s'] * 1000:.0f}",
            f"{r['useful_tokens_per_s']:,.0f}",
            f"{r['numel_tokens_per_s']:,.0f}",
            f"{r['useful_fraction']:.1%}",
            f"{r['peak_memory_gb']:.2f}",
        ]
        for r in rows
    ]
    print(
        tabulate(
            table,
            headers=[
                "variant",
                "procs",
                "packing",
                "step ms",
                "useful tok/s",
                "numel tok/s",
                "useful share",
                "peak RSS GB",
            ],
            tablefmt="github",
        )
    )
    print(
        tabulate(
            [[k, f"{v:.4g}"] for k, v in summary.items()],
            tablefmt="github",
            headers=["summary (all measured)", "value"],
        )
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("runner_efficiency_quick.json" if args.quick else "runner_efficiency.json")
    out.write_text(
        json.dumps(
            {
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "quick": args.quick,
                "rows": rows,
                "summary": summary,
                "command": "python bench/runner_efficiency.py" + (" --quick" if args.quick else ""),
            },
            indent=1,
        )
    )
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
