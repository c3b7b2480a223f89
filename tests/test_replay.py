"""Search quality on the shipped probe recording (deterministic replay, no timing), the replay
backend, racing finalists, and the recording format."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from planner.tuning.autotune import TuneSettings, measured_cost, tune
from planner.tuning.probes import ProbeCache, ProbeResult
from planner.tuning.replay import Recording, RecordingError, recording_key, replay_space

REPO = Path(__file__).resolve().parents[1]
RECORDING = REPO / "bench" / "recordings" / "cpu_space_v2.json.gz"
SEEDS = range(20)
# Bounds for at most 8 probes, checked on the whole recorded space (112 configurations,
# recorded on a quiet machine: the pass means of one configuration differ by 5.6% (median),
# single steps by 1.3%). A search that does not search (test_a_bad_search_fails_the_bound) is
# far above them. The p90 bound was 3% while TuneSettings' defaults were tuned on this
# recording alone; since issue 30 they are tuned on all five recordings (this one of them), and
# its p90 at 8 probes is one near-tie configuration 5.9% dearer than the best (bench/README.md
# section 6: 0.0% / 5.9% held out, Optuna TPE 5.1% / 12.1%, random 7.1% / 16.5%).
MEDIAN_BOUND, P90_BOUND = 0.01, 0.06
SMALL = {"acc": 2}  # the accumulation-2 part of the recording: 42 configurations


@pytest.fixture(scope="module")
def full_space():
    """The whole shipped recording."""
    recording = Recording.load(RECORDING)
    return replay_space(recording, REPO / recording.space["spec"])


@pytest.fixture(scope="module")
def small_space():
    """A part of the shipped recording (SMALL)."""
    recording = Recording.load(RECORDING)
    return replay_space(
        recording,
        REPO / recording.space["spec"],
        keep=lambda d: all(d[k] == v for k, v in SMALL.items()),
    )


def planner_pick(space, seed, **overrides):
    settings = TuneSettings(
        **(
            dict(
                probes=8,
                trials=600,
                seed=seed,
                storage=":memory:",
                probe_time_s=1e9,
                steps=3,
                warmup=1,
            )
            | overrides
        )
    )
    outcome = tune(
        space.spec,
        space.table,
        space.rows,
        target=space.target,
        work_dir=Path("."),
        settings=settings,
        backend=space.backend(seed),
        cache=ProbeCache(None),
    )
    return outcome


def regrets(space, search) -> list[float]:
    return sorted(space.regret(search(space, seed)) for seed in SEEDS)


def median_and_p90(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), float(np.quantile(values, 0.9))


def random_pick(space, seed):
    """Random search at 8 probes: distinct configurations, the best measured."""
    backend = space.backend(seed)
    rows = np.random.default_rng(seed).permutation(space.rows)[:8]
    results = {int(i): backend.run(space.plans[int(i)]) for i in rows}
    return min(results, key=lambda i: measured_cost(space.table, i, results[i])[0])


def test_planner_regret_on_the_recorded_space_meets_the_targets(full_space):
    """The shipped defaults at 8 probes: within the bounds, and below random search's median
    and p90 regret on the same seeds (issue 30's comparison)."""
    assert len(full_space.rows) >= 100
    median, p90 = median_and_p90(
        regrets(full_space, lambda s, seed: planner_pick(s, seed).best_row)
    )
    assert median <= MEDIAN_BOUND and p90 <= P90_BOUND, (
        f"regret median {median:.1%} (<= {MEDIAN_BOUND:.0%}), p90 {p90:.1%} (<= {P90_BOUND:.0%})"
    )
    random_median, random_p90 = median_and_p90(regrets(full_space, random_pick))
    assert median < random_median and p90 < random_p90, (random_median, random_p90)


def test_a_bad_search_fails_the_bound(full_space):
    """The check has teeth: a search that probes the model's most expensive candidates and
    keeps the best of them (a model read upside down) is far above the bound."""

    def bad(space, seed):
        backend = space.backend(seed)
        worst = space.rows[np.argsort(-space.table["cost"][space.rows])][:8]
        results = {int(i): backend.run(space.plans[int(i)]) for i in worst}
        return min(results, key=lambda i: measured_cost(space.table, i, results[i])[0])

    median, p90 = median_and_p90(regrets(full_space, bad))
    assert median > MEDIAN_BOUND and p90 > P90_BOUND


def test_replay_is_deterministic_and_charges_recorded_wall_cost(small_space):
    row = int(small_space.rows[0])
    plan = small_space.plans[row]
    a, b = small_space.backend(3), small_space.backend(3)
    first = [a.run(plan) for _ in range(3)]
    assert [r.step_times_s for r in first] == [b.run(plan).step_times_s for _ in range(3)]
    assert (
        small_space.backend(4).run(plan).step_times_s != first[0].step_times_s
        or small_space.backend(5).run(plan).step_times_s != first[0].step_times_s
    )
    config = small_space.recording.configs[first[0].key]
    recorded = set(config.steps)
    assert all(len(r.step_times_s) == 3 and set(r.step_times_s) <= recorded for r in first)
    # wall = start-up of the layout's worker (first probe only) + overhead + warm-up + steps
    assert first[0].wall_s > first[1].wall_s - 1e-9 or config.overhead_s() == 0
    assert all(r.wall_s >= sum(r.step_times_s) for r in first)
    assert a.wall_s == pytest.approx(sum(r.wall_s for r in first))
    longer = a.run(plan, steps=20)  # more steps than one recorded probe: probes are chained
    assert longer.measured_steps == 20


def test_the_live_and_the_replay_backend_are_one_protocol(small_space, tmp_path):
    """Issue 38: tune() takes a ProbeBackend; the live probe and the replay implement it (the
    same run signature and a fingerprint), so a benchmark's replay is the planner's code path."""
    import inspect

    from planner.tuning.autotune import tune as tune_fn
    from planner.tuning.probes import LocalProbe, ProbeBackend

    live = LocalProbe(tmp_path, fingerprint="fp")
    try:
        backends = [live, small_space.backend(0)]
        assert all(isinstance(b, ProbeBackend) for b in backends)
        wanted = inspect.signature(ProbeBackend.run)
        assert all(inspect.signature(type(b).run) == wanted for b in backends)
    finally:
        live.close()
    assert "ProbeBackend" in str(inspect.signature(tune_fn).parameters["backend"].annotation)
    assert not isinstance(object(), ProbeBackend)  # the check can fail


def test_recording_format_is_checked(tmp_path):
    bad = tmp_path / "r.json.gz"
    bad.write_bytes(gzip.compress(json.dumps({"format": "other"}).encode()))
    with pytest.raises(RecordingError, match="format"):
        Recording.load(bad)
    data = json.loads(gzip.decompress(RECORDING.read_bytes()))
    data["version"] = 99
    bad.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(RecordingError, match="version"):
        Recording.load(bad)
    assert len(Recording.load(RECORDING).configs) >= 100  # the shipped recording's promise


class TwoSpeeds:
    """Finalist A is 10% cheaper per step than B, with 5% noise: a race must separate them."""

    fingerprint = "scripted"

    def __init__(self, rows_by_key, fast):
        self.rows_by_key, self.fast, self.calls = rows_by_key, fast, []
        self.rng = np.random.default_rng(0)

    def run(self, plan, *, steps=None):
        from planner.tuning.probes import config_key

        key = config_key(plan)
        self.calls.append(key)
        base = plan.estimate.step_time_s * (0.9 if key == self.fast else 1.0)
        n = steps or 3
        times = tuple(base * (1 + 0.05 * self.rng.standard_normal(n)))
        return ProbeResult(
            key,
            "ok",
            step_time_s=float(np.median(times)),
            mean_step_time_s=float(np.mean(times)),
            step_times_s=times,
            tokens_per_second=plan.tokens_per_step / float(np.median(times)),
            peak_memory_gb=0.5,
            wall_s=sum(times),
            fingerprint="scripted",
            measured_steps=n,
        )


def test_finalists_are_raced_alternately_until_separated(small_space, tmp_path):
    from planner.tuning.probes import config_key
    from planner.writing.planwriter import candidate_plan

    space = small_space
    keys = {
        int(i): config_key(candidate_plan(space.spec, space.table.row(int(i)), target=space.target))
        for i in space.rows
    }
    fast = keys[int(space.rows[np.argmin(space.table["cost"][space.rows])])]  # seeded first
    backend = TwoSpeeds(keys, fast)
    settings = TuneSettings(
        probes=12,
        trials=600,
        seed=0,
        storage=":memory:",
        race=5,
        finalists=2,
        steps=3,
        warmup=1,
        confidence=0.9,
        race_steps=9,  # repeats 3x as long as a probe (the default: as long)
        spread_ratio=6.0,  # probes taken to drift more than their steps say: repeats needed
    )
    outcome = tune(
        space.spec,
        space.table,
        space.rows,
        target=space.target,
        work_dir=tmp_path,
        settings=settings,
        backend=backend,
        cache=ProbeCache(None),
    )
    race = outcome.race
    assert race is not None and race.rounds >= 1
    calls = backend.calls
    # the race phase: repeats of measured configurations, then (once separated) exploration
    phase = calls[12 - 5 :]
    raced = [c for k, c in enumerate(phase) if c in calls[: 12 - 5 + k]]
    assert len(raced) == race.rounds
    # the pick and its least separated contender in turn (never the same one twice running)
    assert all(a != b for a, b in zip(raced, raced[1:]))
    assert outcome.best_row == race.finalists[0] and keys[outcome.best_row] == fast
    # 10% apart with 5% noise: separated before the racing budget is spent, by about 10%;
    # the probes left explore
    assert race.separated and race.probability >= 0.9 and race.rounds < 5
    assert race.level == pytest.approx(0.8)  # two-sided 80% = one-sided 90%
    assert 0 < race.interval[0] < race.difference < race.interval[1]
    assert len(calls) == 12 and race.probes == 5


def synthetic_space(seed: int = 0, *, drift: float = 0.10, jitter: float = 0.03):
    """The SMALL part of the shipped recording's space with made-up measurements: every
    configuration's step time is known (the model's step x a factor), each of its 8 recorded
    probes drifts from it by lognormal `drift` and each step by `jitter`; one configuration is
    made the best by a clear margin (known best)."""
    from planner.tuning.replay import RecordedConfig

    recording = Recording.load(RECORDING)
    base = replay_space(
        recording,
        REPO / recording.space["spec"],
        keep=lambda d: all(d[k] == v for k, v in SMALL.items()),
    )
    rng = np.random.default_rng(seed)
    configs = {}
    truth_step, per_step = {}, {}
    for i in base.rows:
        key = config_key_of(base, int(i))
        truth_step[key] = float(np.mean(recording.configs[key].steps)) * rng.uniform(0.9, 1.3)
        per_step[key] = base.truth[int(i)] / base.recording.configs[key].true_step_s
    cost = {k: truth_step[k] * per_step[k] for k in truth_step}
    best, runner_up = sorted(cost, key=cost.get)[:2]
    truth_step[best] = 0.8 * cost[runner_up] / per_step[best]  # the known best, by 20%
    for key, step in truth_step.items():
        real = recording.configs[key]
        probes = []
        for n in range(8):
            level = step * float(np.exp(drift * rng.standard_normal()))
            steps = level * np.exp(jitter * rng.standard_normal(4))
            probes.append(
                {
                    "pass": n,
                    "status": "ok",
                    "wall_s": float(steps.sum() * 1.3 + 0.5),
                    "new_worker": n == 0,
                    "warmup_s": [float(level * 1.2)],
                    "steps_s": [float(x) for x in steps],
                    "peak_memory_gb": 0.5,
                    "loadavg_1m": 1.0,
                }
            )
        configs[key] = RecordedConfig(key, real.describe, real.dims, real.layout, probes)
    fake = Recording(
        recording.machine, "synthetic", "synthetic", recording.probe, recording.space, configs
    )
    return replay_space(fake, REPO / recording.space["spec"]), truth_step


def config_key_of(space, i: int) -> str:
    from planner.tuning.replay import recording_key
    from planner.writing.planwriter import candidate_plan

    return recording_key(candidate_plan(space.spec, space.table.row(i), target=space.target))


def test_noise_aware_pick_keeps_its_stated_confidence():
    """On a synthetic noisy space with a known best (10% drift between probes, 3% between
    steps), the pick is stated with a probability and an interval of its lead over the
    runner-up. Over 24 seeds: the pick is never truly worse than the runner-up by more than
    the interval allows more often than its level says (one-sided, (1 - level) / 2, with a
    binomial allowance), and a pick stated as separated is truly cheaper than the runner-up
    at least `confidence` of the time; the known best is found in most seeds."""
    space, _ = synthetic_space()
    best = min(space.truth, key=space.truth.get)
    below, separated, wrong_separated, found = 0, 0, 0, 0
    seeds = range(24)
    level = None
    for seed in seeds:
        outcome = planner_pick(space, seed, probes=12, race=5, confidence=0.9, spread_ratio=20)
        race = outcome.race
        assert race is not None and outcome.best_row == race.finalists[0]
        pick, other = race.finalists[0], race.finalists[1]
        true_difference = space.truth[other] / space.truth[pick] - 1
        level = race.level
        below += true_difference < race.interval[0]
        if race.separated:
            separated += 1
            wrong_separated += true_difference < 0
        found += pick == best
    n = len(seeds)
    allowed = (1 - level) / 2
    assert below <= n * allowed + 2 * np.sqrt(n * allowed * (1 - allowed)) + 1, below
    assert separated >= n // 2
    assert wrong_separated <= separated * 0.1 + 2 * np.sqrt(separated * 0.1 * 0.9) + 1
    assert found >= 0.8 * n, found


def test_a_probe_taken_under_a_load_spike_is_flagged(tmp_path, monkeypatch):
    """The live probe records the 1-minute load average around it (the higher of before and
    after) and flags the probe when more tasks ran than the machine has cores; the replay
    serves the recorded load with the same flag; a flagged probe counts as noisier."""
    import planner.tuning.probes as probes
    from planner.tuning.noise import NoiseModel, reading

    result = {
        "status": "ok",
        "step_time_s": 0.2,
        "step_time_spread": 0.5,
        "tokens_per_second": 5000.0,
        "peak_memory_gb": 0.5,
        "mean_step_time_s": 0.25,
        "step_times_s": [0.5, 0.2, 0.2, 0.35, 0.2],  # warm-up, then a spike among 4 steps
        "warmup_steps": 1,
    }
    out = tmp_path / "result.json"
    out.write_text(json.dumps(result))
    probe = probes.LocalProbe(tmp_path, fingerprint="test")
    monkeypatch.setattr(probes.os, "cpu_count", lambda: 2)
    spiked = probe._classify("k", out, 0, False, 1.0, out, load=7.5)
    quiet = probe._classify("k", out, 0, False, 1.0, out, load=1.2)
    assert spiked.under_load and spiked.loadavg_1m == 7.5
    assert not quiet.under_load
    assert spiked.step_time_s == 0.2  # the median of the steady-state steps, spike and all
    # replayed: the recorded load travels with the recorded steps
    recording = Recording.load(RECORDING)
    key = next(iter(recording.configs))
    config = recording.configs[key]
    config.probes = [dict(p, loadavg_1m=9.0) for p in config.probes[:1]]
    recording.machine = dict(recording.machine, cpus=2)
    space = replay_space(recording, REPO / recording.space["spec"])
    row = next(i for i, plan in space.plans.items() if recording_key(plan) == key)
    replayed = space.backend(0).run(space.plans[row])
    assert replayed.under_load and replayed.loadavg_1m == 9.0
    other = next(i for i in space.plans if i != row)
    assert not space.backend(0).run(space.plans[other]).under_load
    noise = NoiseModel(repeat_sd=0.1, load_inflation=3.0)
    steps = spiked.step_times_s
    assert reading(0.0, steps, under_load=True, noise=noise)[1] == pytest.approx(
        3 * reading(0.0, steps, under_load=False, noise=noise)[1]
    )


def test_the_pick_is_reported_with_its_lead_and_confidence(small_space):
    """`planner optimize --probes N` (make demo's autotune) states the pick's cost, its lead
    over the runner-up with an interval and the probability behind it."""
    from planner.reporting.report import race_note
    from planner.tuning.autotune import Race

    a, b = (int(i) for i in small_space.rows[:2])
    race = Race((a, b), 3, 4, True, 0.04, (0.01, 0.07), 0.03, 0.97, 0.8, 0.00702)
    note = race_note(small_space.table, race, "USD")
    assert note.startswith("best at 0.00702 USD/Mtok (pooled estimate of its probes), ")
    assert "ahead of the runner-up" in note and "by 4% +- 3% (80% interval" in note
    assert "cheaper with probability 0.97, separated from it at 90%" in note
    # with the plan's measured figure (what the "chosen" line shows): that number, labelled
    measured = race_note(small_space.table, race, "USD", (0.009241, 12))
    assert measured.startswith("best at 0.009241 USD/Mtok (measured: mean of its 12 probe steps)")
    assert "0.00702" not in measured  # one number for the pick's cost
