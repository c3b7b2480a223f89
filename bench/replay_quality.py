"""Search quality without machine noise: every tuning method replayed on the shipped recording.

The recording (`bench/recordings/cpu_space_v2.json.gz`, written by
`python bench/plan_quality.py --record`) holds every configuration of the CPU benchmark space
probed in several interleaved passes. Each method runs against `planner.replay.ReplayProbe`
(the same interface as the live probe: a probe draws its steps from the configuration's
recorded ones, deterministically per seed, and is charged the recorded wall cost), over many
seeds, at several probe budgets:

  planner        our autotuner: model-seeded, guided TPE, finalists raced (planner.autotune)
  optuna_tpe     Optuna's TPE alone (no model seeds, no guidance, no race), best measured
  random         distinct configurations uniformly at random, best measured
  auto_tuner     Paddle auto_tuner's grid walk (larger micro-batch first, no recompute first)
                 with its pruning (OOM at micro m prunes larger m; a fitting configuration
                 without recompute prunes the same with recompute), best measured tokens/s
  model          the analytic model alone (shipped prior, no probes)
  article        the source article's configuration scaled to this machine (micro 16 x
                 accumulation 2, all devices, the longest seq_len, no recompute)
  grid_1pass     (reference) one short probe of every configuration, best measured

Truth = the mean over every recorded measured step of a configuration; regret = true cost
of the pick / the best true cost - 1. Prints one table (median / p90 / worst regret and
probe wall seconds per method and budget) and writes bench/results/replay_quality.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from plan_quality import RECORDING, auto_tuner_walk, describe, shipped_profiles  # noqa: E402

RESULTS = REPO / "bench" / "results"
SHORT = {"steps": 3, "warmup": 1}  # a live probe's steps (bench/plan_quality.py)


def load_space(path: Path, *, keep=None):
    """The recording matched to its space's candidate table, with the shipped profiles (no
    local calibration: the model column is the model alone)."""
    from planner.replay import Recording, replay_space

    recording = Recording.load(path)
    return replay_space(
        recording, REPO / recording.space["spec"], profiles=shipped_profiles(), keep=keep
    )


def _backend(space, seed: int):
    return space.backend(seed, **SHORT)


def run_planner(space, seed: int, budget: int, **overrides) -> dict:
    from planner.autotune import TuneSettings, tune
    from planner.probes import ProbeCache

    backend = _backend(space, seed)
    settings = TuneSettings(
        probes=budget, trials=600, seed=seed, storage=":memory:", probe_time_s=1e9, **SHORT
    )
    settings = dataclasses.replace(settings, **overrides)
    spec = dataclasses.replace(space.spec, job=dataclasses.replace(space.spec.job, cache_dir=""))
    outcome = tune(
        spec,
        space.table,
        space.rows,
        target=space.target,
        work_dir=Path("."),
        settings=settings,
        backend=backend,
        cache=ProbeCache(None),
    )
    race = outcome.race.to_dict() if outcome.race else None
    return {
        "pick": outcome.best_row,
        "probes": backend.probes,
        "wall_s": backend.wall_s,
        "race": race,
    }


def run_tpe(space, seed: int, budget: int) -> dict:
    return run_planner(space, seed, budget, enqueue=0, guided=False, race=0, rank_by="median")


def _best_measured(space, results: dict):
    from planner.autotune import measured_cost

    ok = {i: measured_cost(space.table, i, r)[0] for i, r in results.items() if r.ok}
    return min(ok, key=ok.get) if ok else None


def run_random(space, seed: int, budget: int) -> dict:
    backend = _backend(space, seed)
    rng = np.random.default_rng(seed)
    rows = rng.permutation(space.rows)[:budget]
    results = {int(i): backend.run(space.plans[int(i)]) for i in rows}
    return {
        "pick": _best_measured(space, results),
        "probes": backend.probes,
        "wall_s": backend.wall_s,
    }


def run_walk(space, seed: int, budget: int) -> dict:
    backend = _backend(space, seed)
    best, _, tried = auto_tuner_walk(
        space.spec, space.table, space.rows, space.target, backend, budget
    )
    return {"pick": best, "probes": tried, "wall_s": backend.wall_s}


def run_grid(space, seed: int, budget: int) -> dict:
    backend = _backend(space, seed)
    results = {int(i): backend.run(space.plans[int(i)]) for i in space.rows}
    return {
        "pick": _best_measured(space, results),
        "probes": backend.probes,
        "wall_s": backend.wall_s,
    }


def model_pick(space) -> int:
    return int(space.rows[np.argmin(space.table["cost"][space.rows])])


def article_pick(space) -> int | None:
    t, rows = space.table, space.rows
    picks = [
        int(i)
        for i in rows
        if t["micro"][i] == 16
        and t["acc"][i] == 2
        and t["gpus_per_node"][i] == t["gpus_per_node"][rows].max()
        and t["seq"][i] == t["seq"][rows].max()
        and t["recompute_code"][i] == 0
    ]
    return picks[0] if picks else None


METHODS = {
    "planner": run_planner,
    "optuna_tpe": run_tpe,
    "random": run_random,
    "auto_tuner": run_walk,
}


def summarise(values: list[float]) -> dict:
    v = np.array(values, dtype=float)
    return {
        "median": float(np.median(v)),
        "p90": float(np.quantile(v, 0.9)),
        "worst": float(v.max()),
        "mean": float(v.mean()),
    }


def evaluate(space, *, seeds: int, budgets: list[int], methods=None, log=print) -> dict:
    """Every method x budget x seed; regret and probe wall cost summaries."""
    out = {}
    for name in methods or METHODS:
        for budget in budgets:
            started = time.perf_counter()
            runs = [METHODS[name](space, seed, budget) for seed in range(seeds)]
            regrets = [space.regret(r["pick"]) for r in runs]
            entry = {
                "method": name,
                "budget": budget,
                "regret": summarise(regrets),
                "probe_wall_s": summarise([r["wall_s"] for r in runs]),
                "probes": summarise([r["probes"] for r in runs]),
                "picks": [
                    describe(space.table, r["pick"]) if r["pick"] is not None else None
                    for r in runs
                ],
                "regrets": regrets,
                "seconds": time.perf_counter() - started,
            }
            races = [r["race"] for r in runs if r.get("race")]
            if races:
                entry["race"] = {
                    "raced": len(races),
                    "distinguishable": sum(r["distinguishable"] for r in races),
                    "difference_median": statistics.median(
                        r["runner_up_more_expensive_by"] for r in races
                    ),
                }
            out[f"{name}@{budget}"] = entry
            log(
                f"{name} at {budget} probes: regret median {entry['regret']['median']:.1%}, "
                f"p90 {entry['regret']['p90']:.1%}, worst {entry['regret']['worst']:.1%}, "
                f"probe wall {entry['probe_wall_s']['median']:.0f} s "
                f"({entry['seconds']:.1f} s for {seeds} seeds)"
            )
    for name, pick in (("model", model_pick(space)), ("article", article_pick(space))):
        r = space.regret(pick)
        out[name] = {
            "method": name,
            "budget": 0,
            "regret": summarise([r]),
            "probe_wall_s": summarise([0.0]),
            "probes": summarise([0]),
            "picks": [describe(space.table, pick) if pick is not None else None],
        }
    return out


def render(results: dict) -> str:
    rows = []
    for e in results.values():
        rows.append(
            [
                e["method"],
                e["budget"] or "-",
                f"{e['regret']['median']:.1%}",
                f"{e['regret']['p90']:.1%}",
                f"{e['regret']['worst']:.1%}",
                f"{e['probe_wall_s']['median']:.0f}",
                f"{e['race']['distinguishable']}/{e['race']['raced']}" if "race" in e else "-",
            ]
        )
    return tabulate(
        rows,
        headers=[
            "method",
            "probes",
            "regret median",
            "regret p90",
            "regret worst",
            "probe wall s (median, replayed)",
            "race: pick distinguishable",
        ],
        tablefmt="github",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recording", type=Path, default=RECORDING)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    parser.add_argument("--quick", action="store_true", help="10 seeds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from gptplan import quiet_third_party_warnings

    quiet_third_party_warnings()
    seeds = 10 if args.quick else args.seeds
    started = time.time()
    space = load_space(args.recording)
    rec = space.recording
    best = min(space.truth, key=space.truth.get)
    print(
        f"recording {args.recording.name}: {len(space.rows)} configurations, "
        f"{rec.probe['passes']} passes x (1+{rec.probe['steps']}) steps, recorded "
        f"{rec.created} on {rec.machine.get('fingerprint', '?')}; best (truth) "
        f"{describe(space.table, best)} at {space.best:.5f} USD/Mtok (measured)"
    )
    results = evaluate(space, seeds=seeds, budgets=args.budgets, methods=args.methods)
    grid = [run_grid(space, seed, 0) for seed in range(seeds)]
    results["grid_1pass"] = {
        "method": "grid_1pass",
        "budget": len(space.rows),
        "regret": summarise([space.regret(g["pick"]) for g in grid]),
        "probe_wall_s": summarise([g["wall_s"] for g in grid]),
        "probes": summarise([g["probes"] for g in grid]),
        "picks": [describe(space.table, g["pick"]) for g in grid],
    }
    print(render(results))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / (
        "replay_quality_quick.json" if args.quick else "replay_quality.json"
    )
    out.write_text(
        json.dumps(
            {
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "command": "python bench/replay_quality.py" + (" --quick" if args.quick else ""),
                "recording": args.recording.name,
                "recorded": rec.created,
                "machine": rec.machine,
                "configurations": len(space.rows),
                "seeds": seeds,
                "probe": SHORT,
                "truth": "mean of all recorded measured steps",
                "best": describe(space.table, best),
                "best_usd_per_mtok": space.best,
                "bench_wall_s": time.time() - started,
                "results": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
