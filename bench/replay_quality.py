"""Search quality without machine noise: every tuning method replayed on recorded spaces.

A recording (`bench/recordings/*.json.gz`, written by `python bench/plan_quality.py --record
[--record-space NAME]`) holds every configuration of a CPU space probed in several interleaved
passes, with the load average per probe.

Leave one recording out: the planner's search choices (model-seeded probes, alternation with
the model, how many probes race, how long a racing probe is, the confidence asked for, the
number of contenders, the model prior's weight) are tuned on the other recordings and scored on
the held-out one (`--recording FILE`); the probe noise model
(planner.tuning.noise.spread_ratio_from) is learned from the other recordings too. Tuning: every
candidate choice (the defaults and one change at a time, CHOICES) is replayed on every recording
(`--tune-seeds` seeds, 4/8/16 probes; score = mean over the budgets of median + p90 regret); for
each choice the value with the lowest mean score over the other recordings (each relative to the
defaults' score) is kept. The scores are cached in
bench/results/loro_scores.json (recomputed when a recording or the candidates change).

Each method runs against `planner.tuning.replay.ReplayProbe`
(the same interface as the live probe: a probe draws its steps from the configuration's
recorded ones, deterministically per seed, and is charged the recorded wall cost), over many
seeds, at several probe budgets:

  planner        our autotuner: model-seeded, guided TPE, finalists raced (planner.tuning.autotune)
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
probe wall seconds per method and budget) and writes bench/results/replay_quality[_NAME].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import os
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
RECORDINGS = REPO / "bench" / "recordings"
SCORES = RESULTS / "loro_scores.json"
SHORT = {"steps": 3, "warmup": 1}  # a live probe's steps (bench/plan_quality.py)

# The planner's search choices tuned by leave-one-recording-out: defaults, and the values
# tried for each (one change at a time from the defaults).
CHOICES = {
    "prior_sd": (0.0, [0.15, 0.3]),  # the model prior's weight (0 = none)
    "enqueue": (3, [2, 4]),  # model-seeded probes first
    "guided": (True, [False]),  # every other probe the calibrated model's pick
    "race_fraction": (1 / 3, [0.25, 0.5]),  # of the probes, kept for repeats of finalists
    "race_steps_x": (3, [1]),  # a repeat's steps, x a probe's
    "confidence": (0.9, [0.8, 0.95]),  # repeat until the pick is this sure
    "finalists": (0, [2]),  # contenders + the pick (0 = 3 when 4+ probes race, else 2)
}
TUNE_BUDGETS = [4, 8, 16]


def candidates() -> list[dict]:
    base = {k: v[0] for k, v in CHOICES.items()}
    out = [base]
    for k, (_, alternatives) in CHOICES.items():
        out += [base | {k: v} for v in alternatives]
    return out


def planner_overrides(choice: dict, budget: int, spread_ratio: float | None = None) -> dict:
    """TuneSettings for one set of choices at a probe budget (the repeats counted as the
    shipped TuneSettings.race = -1 counts them, planner.tuning.autotune.race_probes)."""
    from planner.tuning.autotune import race_probes

    race = race_probes(budget, choice["race_fraction"])
    out = {
        "prior_sd": choice["prior_sd"],
        "enqueue": choice["enqueue"],
        "guided": choice["guided"],
        "race": race,
        "race_steps": choice["race_steps_x"] * SHORT["steps"],
        "confidence": choice["confidence"],
        "finalists": choice["finalists"],
    }
    if spread_ratio is not None:
        out["spread_ratio"] = spread_ratio
    return out


def shipped_choice() -> dict:
    """The choices TuneSettings' defaults make, in CHOICES' terms."""
    from planner.tuning.autotune import RACE_SHARE, TuneSettings

    d = TuneSettings()
    return {
        "prior_sd": d.prior_sd,
        "enqueue": d.enqueue,
        "guided": d.guided,
        "race_fraction": RACE_SHARE if d.race < 0 else None,
        "race_steps_x": d.race_steps // d.steps if d.race_steps else 1,
        "confidence": d.confidence,
        "finalists": d.finalists,
    }


def shipped(jobs: int, tune_seeds: int) -> int:
    """`--shipped`: the choices and noise ratio tuned on every recording, against TuneSettings'
    defaults (what `planner optimize --probes` ships)."""
    from planner.tuning.autotune import TuneSettings
    from planner.tuning.noise import spread_ratio_from
    from planner.tuning.replay import Recording

    paths = recordings()
    choice = choose(tuning_scores(paths, seeds=tune_seeds, jobs=jobs))
    ratio = spread_ratio_from([Recording.load(p) for p in paths])
    ships, ships_ratio = shipped_choice(), TuneSettings().spread_ratio
    rows = [[k, str(v), str(ships[k]), "yes" if ships[k] == v else "NO"] for k, v in choice.items()]
    same_ratio = abs(ratio - ships_ratio) <= 0.05
    rows.append(["spread_ratio", f"{ratio:.2f}", ships_ratio, "yes" if same_ratio else "NO"])
    print(f"tuned on all {len(paths)} recordings: {', '.join(p.name for p in paths)}")
    print(tabulate(rows, headers=["choice", "tuned", "shipped default", "same"]))
    return 0 if all(r[-1] == "yes" for r in rows) else 1


def load_space(path: Path, *, keep=None):
    """The recording matched to its space's candidate table, with the shipped profiles (no
    local calibration: the model column is the model alone)."""
    from planner.tuning.replay import Recording, replay_space

    recording = Recording.load(path)
    return replay_space(
        recording, REPO / recording.space["spec"], profiles=shipped_profiles(), keep=keep
    )


def _backend(space, seed: int):
    return space.backend(seed, **SHORT)


def run_planner(space, seed: int, budget: int, **overrides) -> dict:
    from planner.tuning.autotune import TuneSettings, tune
    from planner.tuning.probes import ProbeCache

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
    from planner.tuning.autotune import measured_cost

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


def evaluate(
    space,
    *,
    seeds: int,
    budgets: list[int],
    methods=None,
    log=print,
    choice=None,
    spread_ratio=None,
) -> dict:
    """Every method x budget x seed; regret and probe wall cost summaries. The planner runs
    with `choice` (tuned on other recordings; None: TuneSettings' defaults)."""
    out = {}
    for name in methods or METHODS:
        for budget in budgets:
            started = time.perf_counter()
            if name == "planner" and choice is not None:
                extra = planner_overrides(choice, budget, spread_ratio)
                runs = [run_planner(space, seed, budget, **extra) for seed in range(seeds)]
            else:
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


def recordings(folder: Path = RECORDINGS) -> list[Path]:
    return sorted(folder.glob("*.json.gz"))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _score_one(task: tuple) -> tuple:
    """Score of one candidate on one recording (a worker process's task)."""
    path, index, seeds = task
    from gptplan import quiet_third_party_warnings

    quiet_third_party_warnings()
    space = _space_cached(path)
    choice = candidates()[index]
    total = []
    for budget in TUNE_BUDGETS:
        extra = planner_overrides(choice, budget)
        regrets = [
            space.regret(run_planner(space, s, budget, **extra)["pick"]) for s in range(seeds)
        ]
        total.append(float(np.median(regrets)) + float(np.quantile(regrets, 0.9)))
    return path, index, float(np.mean(total))


_SPACES: dict = {}


def _space_cached(path: str):
    if path not in _SPACES:
        _SPACES[path] = load_space(Path(path))
    return _SPACES[path]


def tuning_scores(paths: list[Path], *, seeds: int, jobs: int, log=print) -> dict:
    """{recording name: [score per candidate]} (lower is better), cached in SCORES by each
    recording's content, the candidates and the seeds."""
    key = hashlib.sha256(json.dumps([candidates(), TUNE_BUDGETS, seeds]).encode()).hexdigest()
    cache = json.loads(SCORES.read_text()) if SCORES.exists() else {}
    if cache.get("key") != key:
        cache = {"key": key, "seeds": seeds, "budgets": TUNE_BUDGETS, "recordings": {}}
    known = cache["recordings"]
    todo = [p for p in paths if known.get(p.name, {}).get("sha") != _digest(p)]
    if todo:
        log(
            f"tuning: {len(candidates())} candidate choices x {len(todo)} recording(s) x "
            f"{seeds} seeds x {TUNE_BUDGETS} probes ({jobs} process(es))"
        )
        tasks = [(str(p), i, seeds) for p in todo for i in range(len(candidates()))]
        scores: dict = {str(p): [0.0] * len(candidates()) for p in todo}
        if jobs > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(jobs) as pool:
                for path, i, score in pool.map(_score_one, tasks):
                    scores[path][i] = score
        else:
            for path, i, score in map(_score_one, tasks):
                scores[path][i] = score
        for p in todo:
            known[p.name] = {"sha": _digest(p), "scores": scores[str(p)]}
        RESULTS.mkdir(parents=True, exist_ok=True)
        latest = json.loads(SCORES.read_text()) if SCORES.exists() else {}
        if latest.get("key") == key:  # another run's scores meanwhile: keep them too
            cache["recordings"] = latest["recordings"] | known
        cache["candidates"] = candidates()
        SCORES.write_text(json.dumps(cache, indent=1))
    return {p.name: known[p.name]["scores"] for p in paths}


def choose(scores: dict) -> dict:
    """Per choice, the value with the lowest mean score over `scores`' recordings, each
    recording's scores relative to the defaults' (so that the noisiest recording does not
    decide alone); the defaults where there is none."""
    cands = candidates()
    mean = (
        np.mean([np.array(scores[n]) / max(scores[n][0], 1e-9) for n in scores], axis=0)
        if scores
        else None
    )
    choice = dict(cands[0])
    if mean is None:
        return choice
    for k in CHOICES:
        options = [
            i for i, c in enumerate(cands) if all(c[j] == cands[0][j] for j in CHOICES if j != k)
        ]
        best = min(options, key=lambda i: (mean[i], i))
        choice[k] = cands[best][k]
    return choice


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
    parser.add_argument(
        "--recording", type=Path, default=RECORDING, help="the held-out recording (scored)"
    )
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    parser.add_argument("--quick", action="store_true", help="10 seeds")
    parser.add_argument(
        "--tune-seeds", type=int, default=10, help="seeds per candidate choice when tuning"
    )
    parser.add_argument(
        "--jobs", type=int, default=min(4, os.cpu_count() or 1), help="tuning processes"
    )
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="the planner with TuneSettings' defaults (no leave-one-out tuning)",
    )
    parser.add_argument(
        "--shipped",
        action="store_true",
        help="print the choices tuned on every recording beside TuneSettings' defaults",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.shipped:
        return shipped(args.jobs, args.tune_seeds)
    from gptplan import quiet_third_party_warnings
    from planner.tuning.noise import spread_ratio_from
    from planner.tuning.replay import Recording, RecordingError

    quiet_third_party_warnings()
    seeds = 10 if args.quick else args.seeds
    started = time.time()
    try:
        space = load_space(args.recording)
    except RecordingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    held = args.recording.resolve()
    others = [p for p in recordings() if p.resolve() != held]
    choice, spread_ratio, tuned_on = None, None, []
    if not args.defaults and others:
        choice = choose(tuning_scores(others, seeds=args.tune_seeds, jobs=args.jobs))
        spread_ratio = spread_ratio_from([Recording.load(p) for p in others])
        tuned_on = [p.name for p in others]
        print(
            f"tuned on {', '.join(tuned_on)} (held out: {args.recording.name}): "
            + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in choice.items()
            )
            + f"; probe noise: between/within-probe variance {spread_ratio:.1f}"
        )
    rec = space.recording
    best = min(space.truth, key=space.truth.get)
    loads = [p.get("loadavg_1m", 0.0) for c in rec.configs.values() for p in c.probes]
    print(
        f"recording {args.recording.name}: {len(space.rows)} configurations, "
        f"{rec.probe['passes']} passes x (1+{rec.probe['steps']}) steps, recorded "
        f"{rec.created} on {rec.machine.get('fingerprint', '?')}, load average "
        f"{np.median(loads):.1f} (median, {min(loads):.1f}-{max(loads):.1f}) on "
        f"{rec.machine.get('cpus', '?')} cores; best (truth) "
        f"{describe(space.table, best)} at {space.best:.5f} USD/Mtok (measured)"
    )
    results = evaluate(
        space,
        seeds=seeds,
        budgets=args.budgets,
        methods=args.methods,
        choice=choice,
        spread_ratio=spread_ratio,
    )
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
    stem = args.recording.name.split(".")[0]
    out = args.out or RESULTS / (
        f"replay_quality_{stem}_quick.json" if args.quick else f"replay_quality_{stem}.json"
    )
    out.write_text(
        json.dumps(
            {
                "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "command": "python bench/replay_quality.py --recording "
                + str(
                    args.recording.resolve().relative_to(REPO)
                    if args.recording.resolve().is_relative_to(REPO)
                    else args.recording.name
                )
                + (" --quick" if args.quick else ""),
                "recording": args.recording.name,
                "recorded": rec.created,
                "machine": rec.machine,
                "configurations": len(space.rows),
                "seeds": seeds,
                "probe": SHORT,
                "truth": "mean of all recorded measured steps",
                "tuned_on": tuned_on,
                "choice": choice,
                "spread_ratio": spread_ratio,
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
