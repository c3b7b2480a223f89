"""Probe recordings and a replay probe backend: search quality measured without machine noise.

A recording (written by `bench/plan_quality.py --record`) holds, for every configuration of a
space, several probes measured at different times (interleaved passes): every warm-up and
measured step time, peak memory, the probe's wall time and whether it started a worker, plus
the machine and the date. `ReplayProbe` serves `run(plan, steps=...)` like `LocalProbe` does,
so the planner's code path is unchanged: a probe's step times are drawn from the configuration's
recorded steps with a generator seeded by (seed, configuration, how many times it was probed),
and the probe is charged its recorded wall cost (worker start-up once per layout, per-probe
overhead, the warm-up and the drawn steps). The truth of a configuration is the mean over all
its recorded measured steps.

File format: gzip-compressed JSON, `{"format": FORMAT, "version": VERSION, ...}`; see
`Recording.to_dict`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gptplan.plan import Plan
from planner.tuning.probes import ProbeResult, under_load
from runner.probe import layout_key

FORMAT = "gptplan-probe-recording"
VERSION = 1


class RecordingError(ValueError):
    """A recording that is not one, or of another version."""


def recording_key(plan) -> str:
    """The key a recording (format version 1) indexes its configurations by: the probe
    cache's key as it was when the shipped recordings were made (model shape, seq_len,
    micro-batch, accumulation, precision, AMP level, the worker's layout, recompute,
    sequence parallel, device). The recorded CPU spaces never vary what it leaves out
    (virtual pipeline, partial recompute, flash attention, family, KV heads, tied
    embeddings), so within a recording it names each configuration once; the probe cache
    itself keys by planner.tuning.probes.config_key, which holds every field of the layout."""
    t, p, m = plan.training, plan.parallel, plan.model
    device, *layout = layout_key(plan)
    parts = [
        m.vocab_size,
        m.hidden_size,
        m.num_hidden_layers,
        m.num_attention_heads,
        m.intermediate_size,
        t.seq_len,
        t.per_device_train_batch_size,
        t.gradient_accumulation_steps,
        t.precision,
        t.fp16_opt_level,
        *layout,
        p.recompute,
        p.sequence_parallel,
        device,
    ]
    return "|".join(str(x) for x in parts)


@dataclass
class RecordedConfig:
    """All recorded probes of one configuration."""

    key: str  # recording_key of its plan
    describe: str  # e.g. "2p fp32 s64 m16x2 none"
    dims: dict  # processes, precision, seq, micro, acc, recompute
    layout: list  # runner.probe.layout_key of its plan (worker sharing)
    probes: list[dict] = field(default_factory=list)
    # each: {"pass", "status", "wall_s", "new_worker", "warmup_s": [...], "steps_s": [...],
    #        "peak_memory_gb", "loadavg_1m" (after it), "loadavg_1m_before", "at_s"}

    @property
    def ok(self) -> bool:
        return bool(self.probes) and all(p["status"] == "ok" for p in self.probes)

    @property
    def steps(self) -> list[float]:
        return [s for p in self.probes if p["status"] == "ok" for s in p["steps_s"]]

    @property
    def true_step_s(self) -> float:
        """Truth: the mean over every recorded measured step (what a run pays for)."""
        return statistics.fmean(self.steps)

    @property
    def peak_memory_gb(self) -> float:
        return max(p.get("peak_memory_gb", 0.0) for p in self.probes)

    def overhead_s(self) -> float:
        """Median probe overhead outside the timed steps, probes that started no worker."""
        rest = [
            p["wall_s"] - sum(p["warmup_s"]) - sum(p["steps_s"])
            for p in self.probes
            if p["status"] == "ok" and not p.get("new_worker")
        ]
        return max(0.0, statistics.median(rest)) if rest else 0.0


@dataclass
class Recording:
    machine: dict
    created: str
    finished: str
    probe: dict  # {"warmup", "steps", "passes", "orders"}
    space: dict  # {"spec", "overrides"}
    configs: dict[str, RecordedConfig]
    worker_startup_s: dict[str, float] = field(default_factory=dict)  # layout -> median s

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "finished": self.finished,
            "machine": self.machine,
            "probe": self.probe,
            "space": self.space,
            "worker_startup_s": self.worker_startup_s,
            "configs": [
                {
                    "key": c.key,
                    "describe": c.describe,
                    "dims": c.dims,
                    "layout": c.layout,
                    "probes": c.probes,
                }
                for c in self.configs.values()
            ],
        }

    def save(self, path: Path) -> None:
        """Atomically, gzip-compressed (mtime 0: the same content gives the same bytes)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        data = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(data)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Recording:
        path = Path(path)
        try:
            raw = path.read_bytes()
            data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
        except (OSError, ValueError, EOFError) as exc:
            raise RecordingError(f"{path}: not a readable probe recording ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise RecordingError(f"{path}: format: expected {FORMAT!r}")
        if data.get("version") != VERSION:
            raise RecordingError(
                f"{path}: version: {data.get('version')!r}, this planner reads version {VERSION}"
            )
        configs = {
            c["key"]: RecordedConfig(c["key"], c["describe"], c["dims"], c["layout"], c["probes"])
            for c in data["configs"]
        }
        return cls(
            data["machine"],
            data["created"],
            data["finished"],
            data["probe"],
            data["space"],
            configs,
            data.get("worker_startup_s", {}),
        )

    def startup_for(self, layout) -> float:
        return float(self.worker_startup_s.get(json.dumps(list(layout)), 0.0))


def worker_startups(configs: dict[str, RecordedConfig]) -> dict[str, float]:
    """Median worker start-up per layout: wall of a worker's first probe minus the same
    configuration's usual probe wall."""
    found: dict[str, list[float]] = {}
    for c in configs.values():
        usual = [p["wall_s"] for p in c.probes if p["status"] == "ok" and not p["new_worker"]]
        for p in c.probes:
            if p["new_worker"] and p["status"] == "ok" and usual:
                found.setdefault(json.dumps(list(c.layout)), []).append(
                    max(0.0, p["wall_s"] - statistics.median(usual))
                )
    return {k: statistics.median(v) for k, v in found.items()}


class ReplayProbe:
    """A probe backend serving recorded measurements (see the module docstring).

    `steps`/`warmup` default to the live probe's; a probe of a configuration the recording does
    not hold, or one recorded as failed, returns that status ("crash" with a detail when
    unknown). Deterministic for a given seed and sequence of calls.
    """

    def __init__(
        self,
        recording: Recording,
        *,
        seed: int = 0,
        steps: int = 3,
        warmup: int = 1,
        fingerprint: str = "",
    ):
        self.recording, self.seed = recording, seed
        self.steps, self.warmup = steps, warmup
        self.fingerprint = fingerprint or "replay " + recording.machine.get("fingerprint", "")
        self._started: set = set()
        self._calls: dict[str, int] = {}
        self.wall_s = 0.0  # everything charged so far
        self.probes = 0

    def _rng(self, key: str) -> np.random.Generator:
        n = self._calls.get(key, 0)
        self._calls[key] = n + 1
        digest = hashlib.sha256(f"{self.seed}|{key}|{n}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little"))

    def has_worker(self, plan: Plan) -> bool:
        return layout_key(plan) in self._started

    def run(self, plan: Plan, *, steps: int | None = None) -> ProbeResult:
        key = recording_key(plan)
        steps = steps or self.steps
        config = self.recording.configs.get(key)
        layout = layout_key(plan)
        startup = 0.0 if layout in self._started else self.recording.startup_for(layout)
        self.probes += 1
        if config is None:
            return ProbeResult(
                key,
                "crash",
                fingerprint=self.fingerprint,
                detail="configuration not in the recording",
            )
        failed = [p for p in config.probes if p["status"] != "ok"]
        if failed:  # a failure the recording saw: the same failure, its recorded wall cost
            wall = failed[0]["wall_s"]
            self.wall_s += wall
            self._started.discard(layout)  # a failed probe ends its worker
            return ProbeResult(
                key,
                failed[0]["status"],
                wall_s=wall,
                fingerprint=self.fingerprint,
                detail="recorded failure",
            )
        self._started.add(layout)
        rng = self._rng(key)
        # a probe is a contiguous run of one recorded probe: steps drawn as a window from one
        # recorded probe keep its phase of machine drift; longer requests chain probes
        chosen: list[float] = []
        warm: list[float] = []
        load = 0.0
        while len(chosen) < steps:
            rec = config.probes[int(rng.integers(len(config.probes)))]
            load = max(load, rec.get("loadavg_1m", 0.0), rec.get("loadavg_1m_before", 0.0))
            if not warm:
                warm = list(rec["warmup_s"][: self.warmup]) or [rec["steps_s"][0]]
                while len(warm) < self.warmup:
                    warm.append(warm[-1])
            start = int(rng.integers(len(rec["steps_s"])))
            run = rec["steps_s"][start:] + rec["steps_s"][:start]
            chosen += run[: steps - len(chosen)]
        measured = np.array(chosen)
        median = float(np.median(measured))
        wall = startup + config.overhead_s() + sum(warm) + float(measured.sum())
        self.wall_s += wall
        tokens = plan.tokens_per_step
        return ProbeResult(
            key,
            "ok",
            step_time_s=median,
            step_time_spread=float((measured.max() - measured.min()) / median),
            tokens_per_second=tokens / median,
            peak_memory_gb=config.peak_memory_gb,
            wall_s=wall,
            fingerprint=self.fingerprint,
            measured_steps=len(chosen),
            mean_step_time_s=float(measured.mean()),
            step_times_s=tuple(chosen),
            warmup_times_s=tuple(warm),
            loadavg_1m=load,
            under_load=under_load(load, self.recording.machine.get("cpus")),
        )

    def close(self) -> None:
        self._started.clear()


@dataclass
class ReplaySpace:
    """A recording matched to the candidate table of the space it was recorded from."""

    spec: object
    table: object
    target: float
    rows: np.ndarray  # recorded, ok, runnable rows of the table
    plans: dict  # row -> plan
    truth: dict  # row -> true cost per million tokens (measured)
    best: float
    recording: Recording

    def regret(self, row) -> float:
        """True cost of the pick / the best true cost - 1 (nan for no pick)."""
        return (
            self.truth[row] / self.best - 1
            if row is not None and row in self.truth
            else float("nan")
        )

    def backend(self, seed: int, *, steps: int = 3, warmup: int = 1) -> ReplayProbe:
        return ReplayProbe(self.recording, seed=seed, steps=steps, warmup=warmup)


def replay_space(recording: Recording, spec_path: Path, *, profiles=None, keep=None) -> ReplaySpace:
    """Evaluate the recording's space (its spec file + overrides) and match every candidate to
    its recorded configuration by probe key; `keep(dims) -> bool` restricts the space."""
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen.evaluate import evaluate_space
    from planner.spec import load_spec
    from planner.writing.planwriter import candidate_plan

    spec = load_spec(str(spec_path), overrides=recording.space.get("overrides", {}))
    table = evaluate_space(
        spec, allowed_offers(spec, profiles or load_profiles()), spec.job.target_tokens
    )
    target = spec.job.target_tokens
    plans, truth = {}, {}
    for i in np.flatnonzero(table["fits"]):
        plan = candidate_plan(spec, table.row(int(i)), target=target)
        config = recording.configs.get(recording_key(plan))
        if config is None or not config.ok or (keep and not keep(config.dims)):
            continue
        plans[int(i)] = plan
        step = config.true_step_s
        truth[int(i)] = float(
            table["price_node_hour"][i]
            * table["nodes"][i]
            * step
            / 3600
            / table["tokens_per_step"][i]
            * 1e6
        )
    if not truth:
        raise RecordingError("no candidate of the space matches the recording")
    rows = np.array(sorted(plans), dtype=int)
    return ReplaySpace(spec, table, target, rows, plans, truth, min(truth.values()), recording)
