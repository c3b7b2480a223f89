"""Autotuning: probe failure classification (real probes), the Optuna study's behaviour with a
scripted backend (resume, no repeated probe, safe OOM pruning, two planners on one SQLite
study), and calibration."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import BASE_PLAN, merge

from gptplan import userdata
from gptplan.plan import plan_from_dict
from planner.autotune import TuneSettings, implied_oom, tune
from planner.calibration import fit
from planner.hardware import load_profiles
from planner.probes import LocalProbe, ProbeCache, ProbeResult, config_key
from planner.search import allowed_offers, decide, evaluate_space
from planner.spec import load_spec

CPU_SPEC = Path(__file__).resolve().parents[1] / "planner" / "specs" / "cpu_demo.toml"

# ---- real probes -----------------------------------------------------------------------------


@pytest.fixture
def tiny_plan(tmp_path):
    return plan_from_dict(merge(BASE_PLAN, {"job": {"output_dir": str(tmp_path / "run")}}))


def test_probe_ok_measures(tiny_plan, tmp_path):
    result = LocalProbe(tmp_path, steps=3, warmup=1, fingerprint="fp").run(tiny_plan)
    assert result.status == "ok", result.detail
    assert result.step_time_s > 0 and result.tokens_per_second > 0
    assert result.peak_memory_gb > 0.1


def test_probe_oom_is_classified(tiny_plan, tmp_path):
    big = plan_from_dict(merge(BASE_PLAN, {"training": {"per_device_train_batch_size": 512}}))
    result = LocalProbe(tmp_path, steps=2, warmup=1, memory_limit_gb=0.7, fingerprint="fp").run(big)
    assert result.status == "oom", result.detail
    assert "MemoryError" in result.detail or "ResourceExhausted" in result.detail


def test_probe_crash_is_classified(tiny_plan, tmp_path):
    result = LocalProbe(tmp_path, steps=2, warmup=1, fault="crash", fingerprint="fp").run(tiny_plan)
    assert result.status == "crash" and "injected crash" in result.detail


def test_probe_hang_times_out_and_leaves_nothing_running(tiny_plan, tmp_path):
    result = LocalProbe(
        tmp_path, steps=2, warmup=1, fault="hang", timeout_s=10, fingerprint="fp"
    ).run(tiny_plan)
    assert result.status == "timeout"
    assert 10 <= result.wall_s < 20


def test_served_worker_measures_like_a_fresh_process_and_survives_failures(tiny_plan, tmp_path):
    fresh = LocalProbe(
        tmp_path / "fresh", steps=3, warmup=1, fingerprint="fp", persistent=False
    ).run(tiny_plan)
    probe = LocalProbe(tmp_path / "served", steps=3, warmup=1, fingerprint="fp")
    try:
        first, second = probe.run(tiny_plan), probe.run(tiny_plan)
        assert first.status == second.status == "ok", first.detail + second.detail
        # one worker served both, and the second paid no start-up
        assert len(list((tmp_path / "served" / "workers").iterdir())) == 1
        assert second.wall_s < first.wall_s
        # the peak is reset per probe: the same as a fresh process, not the worker's lifetime
        assert abs(second.peak_memory_gb - fresh.peak_memory_gb) < 0.1 * fresh.peak_memory_gb
        probe.fault = "crash"
        crashed = probe.run(tiny_plan)
        assert crashed.status == "crash" and "injected crash" in crashed.detail
        probe.fault = ""
        assert probe.run(tiny_plan).ok  # a fresh worker took over
        assert len(list((tmp_path / "served" / "workers").iterdir())) == 2
    finally:
        probe.close()


def test_served_worker_ends_with_its_planner(tiny_plan, tmp_path):
    """A planner killed with SIGKILL (no clean-up runs) leaves no probe worker behind."""
    import subprocess
    import sys
    import time

    script = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import BASE_PLAN
from gptplan.plan import plan_from_dict
from planner.probes import LocalProbe
probe = LocalProbe({str(tmp_path)!r}, steps=1, warmup=1, fingerprint="fp")
assert probe.run(plan_from_dict(BASE_PLAN)).ok
print(next(iter(probe._workers.values())).proc.pid, flush=True)
os.kill(os.getpid(), 9)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    worker_pid = int(done.stdout.split()[0])
    for _ in range(100):
        try:
            os.kill(worker_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(worker_pid, 9)  # its own group: clean up before failing
        pytest.fail("the probe worker outlived its planner")


# ---- the study, with a scripted backend ------------------------------------------------------


class ScriptedProbe:
    """Measures 'step time = modelled x 1.3'; OOM above micro 24 in fp32 with no recompute."""

    fingerprint = "scripted"

    def __init__(self, log: list | None = None):
        self.calls = log if log is not None else []

    def run(self, plan, *, steps=None):
        key = config_key(plan)
        self.calls.append(key)
        t = plan.training
        if (
            t.per_device_train_batch_size > 24
            and plan.parallel.recompute == "none"
            and t.precision == "fp32"
        ):
            return ProbeResult(key, "oom", fingerprint=self.fingerprint, wall_s=1.0)
        step = plan.estimate.step_time_s * 1.3
        return ProbeResult(
            key,
            "ok",
            step_time_s=step,
            tokens_per_second=plan.tokens_per_step / step,
            peak_memory_gb=plan.estimate.peak_memory_gb,
            fingerprint=self.fingerprint,
            wall_s=1.0,
            measured_steps=steps or 5,
        )


def cpu_space():
    spec = load_spec(str(CPU_SPEC))
    offers = allowed_offers(spec, load_profiles())
    target = spec.job.target_tokens
    table = evaluate_space(spec, offers, target)
    decision = decide(spec, table, target)
    rows = np.flatnonzero(table["fits"])
    return spec, table, decision, rows, target


def run_tune(tmp_path, probes, log, seed=0, storage=""):
    spec, table, _, rows, target = cpu_space()
    settings = TuneSettings(probes=probes, trials=300, seed=seed, storage=storage)
    cache = ProbeCache(tmp_path / f"cache-{seed}.jsonl")
    return tune(
        spec,
        table,
        rows,
        target=target,
        work_dir=tmp_path,
        settings=settings,
        backend=ScriptedProbe(log),
        cache=cache,
    ), table


def test_study_probes_within_budget_and_resumes_without_repeats(tmp_path):
    calls: list = []
    first, table = run_tune(tmp_path, 4, calls)
    assert len(calls) == 4  # 4 probes < 2 x confirm + 1: all explore
    second, _ = run_tune(tmp_path, 4, calls)  # same storage: resumes
    assert len(calls) == 8
    assert len(set(calls)) == 8  # no configuration probed twice
    assert len(second.probed) >= len(first.probed)
    assert second.best_row is not None
    # the best measured configuration is the cheapest measured one
    costs = {
        i: table["cost"][i] * r.step_time_s / table["step_time_s"][i]
        for i, r in second.probed.items()
    }
    assert second.best_row == min(costs, key=costs.get) or abs(
        costs[second.best_row] - min(costs.values())
    ) < 1e-3 * min(costs.values())


class FittingProbe(ScriptedProbe):
    """Like ScriptedProbe, without out-of-memory failures."""

    def run(self, plan, *, steps=None):
        key = config_key(plan)
        self.calls.append(key)
        step = plan.estimate.step_time_s * 1.3
        return ProbeResult(
            key,
            "ok",
            step_time_s=step,
            tokens_per_second=plan.tokens_per_step / step,
            peak_memory_gb=plan.estimate.peak_memory_gb,
            fingerprint=self.fingerprint,
            wall_s=1.0,
            measured_steps=steps or 5,
        )


def test_finalists_are_raced_and_pooled(tmp_path):
    spec, table, _, rows, target = cpu_space()
    calls: list = []
    settings = TuneSettings(probes=7, trials=300, seed=0)
    outcome = tune(
        spec,
        table,
        rows,
        target=target,
        work_dir=tmp_path,
        settings=settings,
        backend=FittingProbe(calls),
        cache=ProbeCache(tmp_path / "c.jsonl"),
    )
    assert len(calls) == 7  # 5 exploring + 2 racing
    assert len(set(calls)) == 5  # the race re-measures two explored configurations
    assert calls[5] != calls[6]  # in turn: A, B
    assert outcome.race is not None and outcome.race.probes == 2
    pooled = [r for r in outcome.probed.values() if r.measured_steps > 5]
    assert len(pooled) == 2 and all(r.measured_steps == 5 + 15 for r in pooled)


class SkewedProbe(ScriptedProbe):
    """Two processes run much slower than the prior says, one process faster (the prior is
    least sure how the machine's layouts compare): the calibration must learn it."""

    def run(self, plan, *, steps=None):
        key = config_key(plan)
        self.calls.append(key)
        step = plan.estimate.step_time_s * (3.0 if plan.parallel.nproc_per_node == 2 else 0.8)
        return ProbeResult(
            key,
            "ok",
            step_time_s=step,
            tokens_per_second=plan.tokens_per_step / step,
            peak_memory_gb=plan.estimate.peak_memory_gb,
            fingerprint=self.fingerprint,
            wall_s=1.0,
            measured_steps=steps or 5,
        )


def test_after_the_seeds_the_recalibrated_model_picks_the_next_probe(tmp_path):
    from planner.autotune import calibrated_costs, seed_rows
    from planner.planwriter import candidate_plan

    spec, table, _, rows, target = cpu_space()
    calls: list = []
    settings = TuneSettings(probes=4, trials=300, seed=0, enqueue=3)
    outcome = tune(
        spec,
        table,
        rows,
        target=target,
        work_dir=tmp_path,
        settings=settings,
        backend=SkewedProbe(calls),
        cache=ProbeCache(tmp_path / "c.jsonl"),
    )
    key_to_row = {
        config_key(candidate_plan(spec, table.row(int(i)), target=target)): int(i) for i in rows
    }
    seeds = [key_to_row[k] for k in calls[:3]]
    assert seeds == seed_rows(table, rows, 3)
    probed = {i: outcome.probed[i] for i in seeds}
    untried = np.array([i for i in rows if int(i) not in seeds])
    expected = int(untried[np.argmin(calibrated_costs(table, untried, probed))])
    assert key_to_row[calls[3]] == expected
    # and the calibration did change the ranking: the prior alone would pick another
    assert expected != int(untried[np.argmin(table["cost"][untried])])


def test_oom_implication_is_monotone():
    spec, table, _, rows, _ = cpu_space()
    dims = ["seq", "acc", "precision_code", "offer", "tp", "pp", "stage_code", "sp", "nodes"]
    for base in [i for i in rows if table["micro"][i] == 16 and table["recompute_code"][i] == 0]:
        same = [i for i in rows if all(table[x][i] == table[x][base] for x in dims)]
        bigger = [i for i in same if table["micro"][i] > 16 and table["recompute_code"][i] == 0]
        smaller = [i for i in same if table["micro"][i] < 16]
        more_recompute = [
            i for i in same if table["micro"][i] == 16 and table["recompute_code"][i] > 0
        ]
        if bigger and smaller and more_recompute:
            break
    else:
        pytest.fail("the cpu_demo space has no micro-16 candidate with neighbours")
    assert all(implied_oom(table, i, [base]) for i in bigger)
    assert not any(implied_oom(table, i, [base]) for i in smaller)
    assert not any(implied_oom(table, i, [base]) for i in more_recompute)  # may fit


def _worker(path: str, seed: int, queue) -> None:
    try:
        outcome, _ = run_tune(
            Path(path), 3, [], seed=seed, storage=f"sqlite:///{Path(path) / 'shared.db'}"
        )
        queue.put(("ok", len(outcome.probed)))
    except Exception as exc:  # report to the parent
        queue.put(("error", repr(exc)))


def test_two_planners_share_one_sqlite_study(tmp_path):
    import optuna

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), seed, queue)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    results = [queue.get(timeout=10) for _ in procs]
    assert all(status == "ok" for status, _ in results), results
    studies = optuna.get_all_study_summaries(storage=f"sqlite:///{tmp_path / 'shared.db'}")
    assert len(studies) == 1
    study = optuna.load_study(
        study_name=studies[0].study_name, storage=f"sqlite:///{tmp_path / 'shared.db'}"
    )
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == len(study.trials)  # nothing left half-done or corrupt


def test_calibration_recovers_a_uniform_slowdown():
    """If every probe is 30% slower than modelled, the fitted curve predicts that."""
    spec, table, _, rows, _ = cpu_space()
    profile = table.offers[0].profile
    chosen = [i for i in rows if table["precision_code"][i] == 0][:: max(1, len(rows) // 12)]
    probed = {
        int(i): ProbeResult("k", "ok", step_time_s=float(table["step_time_s"][i]) * 1.3)
        for i in chosen
    }
    calib = fit(table, probed, profile, fingerprint="fp")
    assert calib is not None and "fp32" in calib.by_precision
    assert calib.fit_error < 0.10
    assert calib.by_precision["fp32"].max < profile.efficiency_for("fp32").max


def test_calibration_learns_that_large_micro_batches_run_slower():
    """A CPU whose efficiency falls once a micro-batch outgrows the caches: the prior (rising
    curve only) ranks the largest micro-batch first; the calibrated curve must not."""
    import dataclasses

    from planner.calibration import predicted_step

    spec, table, _, rows, _ = cpu_space()
    profile = table.offers[0].profile
    fp32 = [int(i) for i in rows if table["precision_code"][i] == 0]
    truth = dataclasses.replace(profile.efficiency_for("fp32"), rolloff_tokens=1000.0)
    probed = {
        i: ProbeResult("k", "ok", step_time_s=predicted_step(table, i, truth)) for i in fp32[::3]
    }
    assert len({int(table["micro"][i] * table["seq"][i]) for i in probed}) >= 3
    calib = fit(table, probed, profile, fingerprint="fp")
    fitted = calib.by_precision["fp32"]
    assert 500 < fitted.rolloff_tokens < 2000 and calib.fit_error < 0.02
    held_out = [i for i in fp32 if i not in probed]
    worst = max(
        abs(predicted_step(table, i, fitted) / predicted_step(table, i, truth) - 1)
        for i in held_out
    )
    assert worst < 0.03
    # and a machine without the fall keeps none
    flat = {
        i: ProbeResult("k", "ok", step_time_s=float(table["step_time_s"][i])) for i in fp32[::3]
    }
    assert (
        fit(table, flat, profile, fingerprint="fp").by_precision["fp32"].rolloff_tokens == 0
        or fit(table, flat, profile, fingerprint="fp").by_precision["fp32"].rolloff_tokens > 1e5
    )


def test_seeds_span_work_sizes():
    from planner.autotune import seed_rows

    spec, table, _, rows, _ = cpu_space()
    seeds = seed_rows(table, rows, 4)
    assert seeds[0] == int(rows[np.argmin(table["cost"][rows])])
    # every layout (offer) of the machine is seeded: 1 and 2 CPU processes
    assert {int(table["offer"][i]) for i in seeds} == {int(o) for o in table["offer"][rows]}
    for o in {int(table["offer"][i]) for i in seeds}:  # within a layout, work sizes 2x apart
        work = [float(table["micro"][i] * table["seq"][i]) for i in seeds if table["offer"][i] == o]
        assert all(abs(np.log2(a / b)) >= 1 for k, a in enumerate(work) for b in work[k + 1 :])
    best_per_offer = [table["cost"][i] for i in seeds[:2]]
    assert best_per_offer == sorted(best_per_offer)


def test_optimize_with_probes_end_to_end(tmp_path):
    """The README's autotuning loop on this CPU: real probes, calibration, a probe-based plan,
    a resumable study and its history. The shipped CPU spec with a smaller search (micro 4-8,
    seq 64): the same loop, probes of a fraction of a second per step instead of ~2 s."""
    import json

    import tomli
    import tomli_w
    from conftest import run_cli

    from gptplan.plan import load_plan

    small = merge(
        tomli.loads(CPU_SPEC.read_text()),
        {
            "constraints": {"seq_lens": [64], "global_batch_tokens_min": 256},
            "search": {
                "micro_batch_sizes": [4, 8],
                "recompute": ["none"],
                "accumulation_steps": [1, 2],
            },
        },
    )
    spec = tmp_path / "cpu_demo.toml"
    spec.write_text(tomli_w.dumps(small))
    env = {"GPTPLAN_CALIBRATION_DIR": str(tmp_path / "calib")}
    args = ("planner", "optimize", "--spec", str(spec), "--probes", "3", "--seed", "1")
    proc = run_cli(*args, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "probe 1" in proc.stdout and "step ms measured" in proc.stdout
    plan = load_plan(tmp_path / "plans" / "cpu_demo.toml")
    assert plan.estimate.source == "probe" and "step_time_s" in plan.estimate.measured
    assert plan.provenance.probes >= 1
    assert (tmp_path / "calib" / "cpu.toml").exists()
    again = run_cli(
        *args[:-4], "--probes", "1", "--seed", "1", cwd=tmp_path, env=env
    )  # resumes: the 3 known configurations are not probed again
    assert again.returncode == 0
    assert "configuration(s) measured" in again.stdout
    hist = run_cli(
        "planner", "history", "--spec", str(spec), "--plot", "h.png", cwd=tmp_path, env=env
    )
    assert hist.returncode == 0, hist.stderr[-2000:]
    assert "measured step s" in hist.stdout and (tmp_path / "h.png").exists()
    cache = [
        json.loads(line)
        for line in (userdata.cache_dir() / "probes.jsonl").read_text().splitlines()
    ]
    keys = [c["key"] for c in cache]
    assert len(keys) == len(set(keys))  # nothing probed twice across the two runs


def test_multi_objective_study_runs(tmp_path):
    spec, table, _, rows, target = cpu_space()
    calls: list = []
    settings = TuneSettings(probes=5, trials=200, seed=3, multi_objective=True)
    outcome = tune(
        spec,
        table,
        rows,
        target=target,
        work_dir=tmp_path,
        settings=settings,
        backend=ScriptedProbe(calls),
        cache=ProbeCache(tmp_path / "c.jsonl"),
    )
    # 3 exploring probes (+2 confirmations when two configurations fit); never a repeat
    assert 3 <= len(calls) <= 5 and len(set(calls)) == 3
    import optuna

    study = optuna.load_study(study_name=outcome.study_name, storage=outcome.storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done and all(len(t.values) == 2 for t in done)  # (cost, hours)
