"""Real probe runs of candidate configurations on the local devices, classified and cached.

A probe is the runner's own training step (runner.probe) in a subprocess with its own process
group and a hard timeout; 2+ processes go through paddle.distributed.launch. The result is
classified from the probe's structured JSON and the exit status (never by grepping logs):
ok, oom, crash, timeout, killed. Results are cached by (configuration, hardware fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from runner.plan import Plan, write_plan
from runner.probe import probe_command


def hardware_fingerprint() -> str:
    """CPU model, core count, memory, Paddle version and visible GPUs: what a probe measures."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
    except (ValueError, OSError):
        mem = 0
    import paddle

    gpus = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
    text = f"{cpu}|{os.cpu_count()}|{mem}GiB|paddle {paddle.__version__}|gpus {gpus}"
    return hashlib.sha256(text.encode()).hexdigest()[:12] + " " + text


def config_key(plan: Plan) -> str:
    """What a probe's measurement depends on: model, shapes, precision, layout, device."""
    t, p, m = plan.training, plan.parallel, plan.model
    parts = [m.vocab_size, m.hidden_size, m.num_hidden_layers, m.num_attention_heads,
             m.intermediate_size, t.seq_len, t.per_device_train_batch_size,
             t.gradient_accumulation_steps, t.precision, t.fp16_opt_level, p.nnodes,
             p.nproc_per_node, p.data_parallel_degree, p.tensor_parallel_degree,
             p.pipeline_parallel_degree, p.sharding, p.sharding_parallel_degree, p.recompute,
             p.sequence_parallel, plan.hardware.device]
    return "|".join(str(x) for x in parts)


@dataclass(frozen=True)
class ProbeResult:
    key: str
    status: str                 # ok | oom | crash | timeout | killed
    step_time_s: float = 0.0
    step_time_spread: float = 0.0
    tokens_per_second: float = 0.0
    peak_memory_gb: float = 0.0
    wall_s: float = 0.0
    detail: str = ""
    fingerprint: str = ""
    measured_steps: int = 0

    def pooled_with(self, other: "ProbeResult") -> "ProbeResult":
        """Both measurements of one configuration, weighted by their measured steps."""
        import dataclasses

        n1, n2 = max(1, self.measured_steps), max(1, other.measured_steps)
        step = (self.step_time_s * n1 + other.step_time_s * n2) / (n1 + n2)
        return dataclasses.replace(
            self, step_time_s=step, tokens_per_second=self.tokens_per_second *
            self.step_time_s / step, measured_steps=n1 + n2, wall_s=self.wall_s + other.wall_s,
            peak_memory_gb=max(self.peak_memory_gb, other.peak_memory_gb))

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ProbeBackend(Protocol):
    fingerprint: str

    def run(self, plan: Plan, *, steps: int | None = None) -> ProbeResult: ...


class LocalProbe:
    """Runs probes on this machine; one subprocess group per probe, ended by its group id."""

    def __init__(self, work_dir: Path, *, steps: int = 5, warmup: int = 2,
                 timeout_s: float = 180.0, memory_limit_gb: float = 0.0, fault: str = "",
                 fingerprint: str | None = None):
        self.work_dir = Path(work_dir)
        self.steps, self.warmup, self.timeout_s = steps, warmup, timeout_s
        self.memory_limit_gb, self.fault = memory_limit_gb, fault
        self.fingerprint = fingerprint or hardware_fingerprint()

    def run(self, plan: Plan, *, steps: int | None = None) -> ProbeResult:
        """Probe `plan` for `steps` measured steps (default: this backend's)."""
        key = config_key(plan)
        name = hashlib.sha256(key.encode()).hexdigest()[:12]
        folder = self.work_dir / "probes" / f"{name}-{int(time.time() * 1000)}"
        folder.mkdir(parents=True, exist_ok=True)
        plan_path, out = folder / "plan.toml", folder / "result.json"
        write_plan(plan, plan_path)
        command = probe_command(plan, plan_path=plan_path, out=out, log_dir=folder / "logs",
                                steps=steps or self.steps, warmup=self.warmup,
                                memory_limit_gb=self.memory_limit_gb, fault=self.fault)
        started = time.time()
        with open(folder / "probe.log", "wb") as log:
            proc = subprocess.Popen(command.argv, env=dict(os.environ) | command.env,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=self.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the probe's own group, nothing else
                except ProcessLookupError:
                    pass
                proc.wait()
        wall = time.time() - started
        data = json.loads(out.read_text()) if out.exists() else None
        if timed_out:
            return ProbeResult(key, "timeout", wall_s=wall, fingerprint=self.fingerprint,
                               detail=f"no result within {self.timeout_s:g} s; "
                                      f"log: {folder / 'probe.log'}")
        if data is None:
            tail = " | ".join((folder / "probe.log").read_text(errors="replace")
                              .strip().splitlines()[-3:])
            status = "oom" if rc in (-signal.SIGKILL, 137) else "killed" if rc and rc < 0 \
                else "crash"
            return ProbeResult(key, status, wall_s=wall, fingerprint=self.fingerprint,
                               detail=f"exit {rc}, no result; last lines: {tail[-400:]}")
        if data["status"] != "ok":
            return ProbeResult(key, data["status"], wall_s=wall, fingerprint=self.fingerprint,
                               detail=data.get("error", "") + " | " +
                               " | ".join(data.get("traceback_tail", [])[-2:]))
        return ProbeResult(key, "ok", step_time_s=data["step_time_s"],
                           step_time_spread=data["step_time_spread"],
                           tokens_per_second=data["tokens_per_second"],
                           peak_memory_gb=data["peak_memory_gb"], wall_s=wall,
                           fingerprint=self.fingerprint,
                           measured_steps=len(data["step_times_s"]) - data["warmup_steps"])


class ProbeCache:
    """Probe results by (hardware fingerprint, configuration), one JSON line each."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.results: dict[tuple[str, str], ProbeResult] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    r = ProbeResult(**json.loads(line))
                    self.results[(r.fingerprint, r.key)] = r

    def get(self, fingerprint: str, key: str) -> ProbeResult | None:
        return self.results.get((fingerprint, key))

    def put(self, result: ProbeResult) -> None:
        if result.status in ("timeout", "killed"):
            return  # transient: worth probing again another time
        self.results[(result.fingerprint, result.key)] = result
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:  # one line: append is atomic
            handle.write(json.dumps(asdict(result)) + "\n")
