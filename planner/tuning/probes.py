"""Real probe runs of candidate configurations on the local devices, classified and cached.

A probe is the runner's own training step (runner.probe) in a subprocess with its own process
group and a hard timeout, served by a persistent worker per parallel layout (one Paddle import
for many configurations) unless a fresh process is needed; 2+ processes go through
paddle.distributed.launch. The result is classified from the probe's structured JSON and the
exit status (never by grepping logs):
ok, oom, crash, timeout, killed. Results are cached by (configuration, hardware fingerprint).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from gptplan.errors import UserError
from gptplan.layout import Layout
from gptplan.lifeline import die_with_parent
from gptplan.plan import Plan, write_plan
from gptplan.tomlconf import write_text_atomic
from runner.probe import layout_key, probe_command, request_path, serve_command


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


# A probe shares the machine when the 1-minute load average (runnable tasks, the probe's own
# processes included) exceeds the cores by more than this: at least one task waited for a core
# during the probe, so its steps are slower than an idle machine's (and noisier).
LOAD_TOLERANCE = 0.5


def machine_load() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


def under_load(loadavg_1m: float, cpus: int | None = None) -> bool:
    """Whether a probe measured at this 1-minute load average shared the CPUs with other work:
    more runnable tasks than cores (plus LOAD_TOLERANCE). The probe's median step is robust to
    a short spike; a flagged probe's measurement is still weighted as noisier
    (planner.tuning.noise)."""
    cpus = cpus or os.cpu_count() or 1
    return loadavg_1m > cpus + LOAD_TOLERANCE


def config_key(plan: Plan) -> str:
    """What a probe's measurement depends on: the plan's layout (every field of
    gptplan.layout.Layout), its model (family, shape, KV heads, tied embeddings) and device."""
    return Layout.from_plan(plan).probe_key(plan.model, plan.hardware.device)


@dataclass(frozen=True)
class ProbeResult:
    key: str
    status: str  # ok | oom | crash | timeout | killed
    step_time_s: float = 0.0
    step_time_spread: float = 0.0
    tokens_per_second: float = 0.0
    peak_memory_gb: float = 0.0
    wall_s: float = 0.0
    detail: str = ""
    fingerprint: str = ""
    measured_steps: int = 0
    mean_step_time_s: float = 0.0  # what a run pays for; step_time_s (median) ranks robustly
    step_times_s: tuple = ()  # every measured step (warm-up excluded), in order
    warmup_times_s: tuple = ()  # the discarded warm-up steps
    loadavg_1m: float = 0.0  # the machine's 1-minute load average, the higher of before/after
    under_load: bool = False  # taken while other work competed for the cores (under_load())

    def pooled_with(self, other: ProbeResult) -> ProbeResult:
        """Both measurements of one configuration, weighted by their measured steps."""
        import dataclasses

        n1, n2 = max(1, self.measured_steps), max(1, other.measured_steps)
        step = (self.step_time_s * n1 + other.step_time_s * n2) / (n1 + n2)
        mean = (self.mean_step_time_s * n1 + other.mean_step_time_s * n2) / (n1 + n2)
        return dataclasses.replace(
            self,
            step_time_s=step,
            mean_step_time_s=mean,
            tokens_per_second=self.tokens_per_second * self.step_time_s / step,
            measured_steps=n1 + n2,
            wall_s=self.wall_s + other.wall_s,
            peak_memory_gb=max(self.peak_memory_gb, other.peak_memory_gb),
            step_times_s=tuple(self.step_times_s) + tuple(other.step_times_s),
            warmup_times_s=tuple(self.warmup_times_s) + tuple(other.warmup_times_s),
            loadavg_1m=max(self.loadavg_1m, other.loadavg_1m),
            under_load=self.under_load or other.under_load,
        )

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class _Worker:
    """A served probe worker (runner.probe --queue-dir) for one parallel layout."""

    proc: subprocess.Popen
    queue_dir: Path
    log: Path
    next_request: int = 0


def _spawn(command, log_handle) -> subprocess.Popen:
    """A probe or worker process in its own process group (ended only through that group),
    dying with this planner, its output into `log_handle`."""
    return subprocess.Popen(
        command.argv,
        env=dict(os.environ) | command.env,
        stdout=log_handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )


def _end_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the probe's own group, nothing else
    except ProcessLookupError:
        pass
    proc.wait()


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-3:])[-400:]


@runtime_checkable
class ProbeBackend(Protocol):
    """What the autotuning asks of a probe backend (planner.tuning.autotune.tune): measure a
    plan's step time, and say which machine the measurements belong to (results are cached and
    studies named by it). The live backend, `LocalProbe`, runs the plan on this machine; the
    replay backend, planner.tuning.replay.ReplayProbe, serves recorded measurements."""

    fingerprint: str

    def run(self, plan: Plan, *, steps: int | None = None) -> ProbeResult:
        """Probe `plan` for `steps` measured steps (default: the backend's own)."""
        ...


class LocalProbe:
    """Runs probes on this machine, each process group ended by its group id (never by name).

    By default probes are served by a persistent worker per parallel layout (one Paddle import,
    one fleet initialisation, many configurations); after a failed probe the worker is ended and
    the next probe starts a fresh one. `persistent=False`, or a memory limit (which needs a
    fresh address space), runs every probe in its own new processes.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        steps: int = 5,
        warmup: int = 2,
        timeout_s: float = 180.0,
        memory_limit_gb: float = 0.0,
        fault: str = "",
        fingerprint: str | None = None,
        persistent: bool = True,
    ):
        self.work_dir = Path(work_dir)
        self.steps, self.warmup, self.timeout_s = steps, warmup, timeout_s
        self.memory_limit_gb, self.fault = memory_limit_gb, fault
        self.persistent = persistent and memory_limit_gb <= 0
        self.fingerprint = fingerprint or hardware_fingerprint()
        self._workers: dict[tuple, _Worker] = {}
        atexit.register(self.close)

    def run(self, plan: Plan, *, steps: int | None = None) -> ProbeResult:
        """Probe `plan` for `steps` measured steps (default: this backend's)."""
        key = config_key(plan)
        name = hashlib.sha256(key.encode()).hexdigest()[:12]
        folder = self.work_dir / "probes" / f"{name}-{int(time.time() * 1000)}"
        folder.mkdir(parents=True, exist_ok=True)
        plan_path, out = folder / "plan.toml", folder / "result.json"
        write_plan(plan, plan_path)
        steps = steps or self.steps
        load = machine_load()
        if self.persistent:
            rc, timed_out, wall, log = self._run_served(plan, plan_path, out, steps)
        else:
            rc, timed_out, wall, log = self._run_fresh(plan, plan_path, out, folder, steps)
        return self._classify(key, out, rc, timed_out, wall, log, load=max(load, machine_load()))

    def _run_fresh(self, plan, plan_path, out, folder, steps):
        command = probe_command(
            plan,
            plan_path=plan_path,
            out=out,
            log_dir=folder / "logs",
            steps=steps,
            warmup=self.warmup,
            memory_limit_gb=self.memory_limit_gb,
            fault=self.fault,
        )
        started = time.time()
        log = folder / "probe.log"
        with open(log, "wb") as handle:
            proc = _spawn(command, handle)
            try:
                rc, timed_out = proc.wait(timeout=self.timeout_s), False
            except subprocess.TimeoutExpired:
                rc, timed_out = None, True
            finally:
                _end_group(proc)
        return rc, timed_out, time.time() - started, log

    def has_worker(self, plan: Plan) -> bool:
        """Whether a live worker serves this plan's layout (its start-up is already paid)."""
        worker = self._workers.get(layout_key(plan))
        return worker is not None and worker.proc.poll() is None

    def _worker_for(self, plan: Plan) -> _Worker:
        layout = layout_key(plan)
        worker = self._workers.get(layout)
        if worker is not None and worker.proc.poll() is None:
            return worker
        tag = hashlib.sha256(repr(layout).encode()).hexdigest()[:8]
        folder = self.work_dir / "workers" / f"{tag}-{int(time.time() * 1000)}"
        queue = folder / "queue"
        queue.mkdir(parents=True, exist_ok=True)
        command = serve_command(
            plan, queue_dir=queue, log_dir=folder / "logs", parent_pid=os.getpid()
        )
        log = folder / "worker.log"
        with open(log, "wb") as handle:
            proc = _spawn(command, handle)
        self._workers[layout] = worker = _Worker(proc, queue, log)
        return worker

    def _run_served(self, plan, plan_path, out, steps):
        """One request to the layout's worker; its start-up counts in the first probe's wall."""
        started = time.time()
        worker = self._worker_for(plan)
        request = {
            "plan": str(plan_path),
            "out": str(out),
            "steps": steps,
            "warmup": self.warmup,
            "fault": self.fault,
        }
        write_text_atomic(request_path(worker.queue_dir, worker.next_request), json.dumps(request))
        worker.next_request += 1
        rc, timed_out = None, False
        while not out.exists():
            rc = worker.proc.poll()
            if rc is not None:
                break
            if time.time() - started > self.timeout_s:
                timed_out = True
                break
            time.sleep(0.01)
        wall = time.time() - started
        failed = timed_out or rc is not None or json.loads(out.read_text())["status"] != "ok"
        if failed:  # a worker that failed a probe is not trusted with the next one
            _end_group(worker.proc)
            rc = worker.proc.returncode if rc is None and not timed_out else rc
            self._workers.pop(layout_key(plan), None)
        return rc, timed_out, wall, worker.log

    def close(self, *, wait: bool = True) -> int:
        """End every worker's process group (with `wait`, first ask each to stop and give it
        10 s); returns how many were still running."""
        running = 0
        for worker in self._workers.values():
            if worker.proc.poll() is None:
                running += 1
                if wait:
                    try:
                        write_text_atomic(
                            request_path(worker.queue_dir, worker.next_request),
                            json.dumps({"stop": True}),
                        )
                        worker.proc.wait(timeout=10)
                    except (OSError, subprocess.TimeoutExpired):
                        pass
            _end_group(worker.proc)
        self._workers.clear()
        return running

    def _classify(
        self, key: str, out: Path, rc, timed_out: bool, wall: float, log: Path, load: float = 0.0
    ) -> ProbeResult:
        data = json.loads(out.read_text()) if out.exists() else None
        if timed_out:
            return ProbeResult(
                key,
                "timeout",
                wall_s=wall,
                fingerprint=self.fingerprint,
                detail=f"no result within {self.timeout_s:g} s; log: {log}",
            )
        if data is None:
            status = (
                "oom" if rc in (-signal.SIGKILL, 137) else "killed" if rc and rc < 0 else "crash"
            )
            return ProbeResult(
                key,
                status,
                wall_s=wall,
                fingerprint=self.fingerprint,
                detail=f"exit {rc}, no result; last lines: {_log_tail(log)}",
            )
        if data["status"] != "ok":
            return ProbeResult(
                key,
                data["status"],
                wall_s=wall,
                fingerprint=self.fingerprint,
                detail=data.get("error", "")
                + " | "
                + " | ".join(data.get("traceback_tail", [])[-2:]),
            )
        return ProbeResult(
            key,
            "ok",
            step_time_s=data["step_time_s"],
            step_time_spread=data["step_time_spread"],
            tokens_per_second=data["tokens_per_second"],
            peak_memory_gb=data["peak_memory_gb"],
            wall_s=wall,
            fingerprint=self.fingerprint,
            measured_steps=len(data["step_times_s"]) - data["warmup_steps"],
            mean_step_time_s=data["mean_step_time_s"],
            step_times_s=tuple(data["step_times_s"][data["warmup_steps"] :]),
            warmup_times_s=tuple(data["step_times_s"][: data["warmup_steps"]]),
            loadavg_1m=round(load, 2),
            under_load=under_load(load),
        )


class ProbeCache:
    """Probe results by (hardware fingerprint, configuration), one JSON line each.

    Checked when loaded: a damaged line (torn by a kill mid-write, garbled) is skipped and
    reported in `notes`, and the file is rewritten without it, so later appends start on a
    line of their own."""

    def __init__(self, path: Path | None):
        """`path` None: in memory only (replay benchmarks)."""
        self.path = Path(path) if path is not None else None
        self.results: dict[tuple[str, str], ProbeResult] = {}
        self.notes: list[str] = []
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def _load(self, path: Path) -> None:
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError as exc:
            raise UserError(
                f"cannot read the probe cache: {exc.strerror}; move it away to start a new one",
                file=str(path),
            ) from None
        good, bad = [], []
        for number, line in enumerate(text.splitlines(), 1):
            result = _parse_result(line) if line.strip() else None
            if result is None:
                bad += [number] if line.strip() else []
                continue
            self.results[(result.fingerprint, result.key)] = result
            good.append(line)
        if not bad and (not text or text.endswith("\n")):
            return
        try:
            write_text_atomic(path, "".join(line + "\n" for line in good))
            fixed = "rewrote it without them"
        except OSError as exc:
            fixed = f"could not rewrite it ({exc.strerror})"
        if bad:
            self.notes.append(
                f"probe cache {self.path}: skipped {len(bad)} damaged line(s) "
                f"(line {', '.join(map(str, bad[:5]))}); {fixed}"
            )

    def get(self, fingerprint: str, key: str) -> ProbeResult | None:
        return self.results.get((fingerprint, key))

    def put(self, result: ProbeResult) -> None:
        if result.status in ("timeout", "killed"):
            return  # transient: worth probing again another time
        self.results[(result.fingerprint, result.key)] = result
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+b") as handle:  # one line: append is atomic
            torn = False
            if handle.seek(0, os.SEEK_END) > 0:  # a torn last line: start a line of our own
                handle.seek(-1, os.SEEK_END)
                torn = handle.read(1) != b"\n"
            line = ("\n" if torn else "") + json.dumps(asdict(result)) + "\n"
            handle.write(line.encode())


def _parse_result(line: str) -> ProbeResult | None:
    """One cache line as a ProbeResult; None when it is not one (torn, garbled)."""
    try:
        data = json.loads(line)
        result = ProbeResult(**data) if isinstance(data, dict) else None
    except (ValueError, TypeError):
        return None
    if result is None or not all(
        isinstance(x, str) for x in (result.key, result.status, result.fingerprint)
    ):
        return None
    numbers = (result.step_time_s, result.mean_step_time_s, result.wall_s)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
        return None
    return result
