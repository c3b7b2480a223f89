"""Autotuning: an Optuna study over the locally runnable candidates, driven by real probes.

- One study per (spec hash, hardware fingerprint), in persistent storage: SQLite in the run
  directory by default, any RDB URL, or an Optuna journal file (several machines, one study).
  Re-running resumes; a configuration already probed (in this study or the probe cache) is
  never probed again.
- The analytic model's best candidates at distinct work sizes (tokens per micro-batch, 2x
  apart) are enqueued first, so the first calibration sees the efficiency curve's shape. Then
  the sampler, TPE (or NSGA-II for the cost/time front), and the model take turns: every
  other probe is the candidate the model, re-calibrated on all probes so far, ranks cheapest
  among those not yet tried.
  Infeasible trials (predicted or measured OOM, over budget) are reported as trial
  constraints (`Trial.set_constraint`), so they inform the sampler instead of scoring zero.
- Safe monotonic pruning only: OOM at micro-batch m implies OOM above m with the rest equal,
  and OOM with some recompute implies OOM with less. Priors such as "bigger is faster" are
  never used to skip a probe.
- Short probes are noisy (10-15% on a shared CPU), so the last `confirm` probes re-measure the
  best finalists with 3x longer probes and the pick uses the pooled measurement.
- Measured step times calibrate the profile's efficiency curve (planner.calibration).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from planner.planwriter import candidate_plan
from planner.probes import LocalProbe, ProbeCache, ProbeResult, config_key
from planner.search import PRECISIONS, CandidateTable
from planner.spec import Spec

DIMENSIONS = ("seq", "micro", "acc", "precision_code", "offer", "recompute_code", "tp", "pp",
              "stage_code", "sp", "nodes")
CONSTRAINT_ATTR = "constraint"


@dataclass
class TuneSettings:
    probes: int = 8                 # real probe runs at most
    probe_time_s: float = 600.0     # total probe wall time at most
    trials: int = 200               # trials in all (model-only ones included)
    seed: int = 0
    storage: str = ""               # '' = sqlite file in the work dir; URL; or *.journal path
    multi_objective: bool = False   # NSGA-II on (cost, hours)
    enqueue: int = 3                # analytic best candidates tried first
    confirm: int = 2                # of the probes, kept to re-measure the best finalists
    guided: bool = True             # after the seeds, every other probe: calibrated model's pick
    steps: int = 5
    warmup: int = 2
    timeout_s: float = 180.0


@dataclass
class TuneOutcome:
    study_name: str
    storage: str
    probed: dict[int, ProbeResult] = field(default_factory=dict)   # row -> result
    reused: int = 0
    probes_run: int = 0             # real probe subprocesses started by this call
    probe_wall_s: float = 0.0
    best_row: int | None = None


HEARTBEAT_S = 10       # a running trial's planner records a heartbeat this often (Optuna)
STALE_AFTER_S = 60     # a RUNNING trial without a heartbeat for this long has lost its planner


def _rdb_storage(url: str, attempts: int = 8):
    """RDBStorage, retried: planners starting together race to create the schema.

    With heartbeats: a trial whose planner was killed stays RUNNING in the storage until
    `fail_stale_trials` (called when a study is opened) marks it FAIL."""
    import random

    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs,
                                                  heartbeat_interval=HEARTBEAT_S,
                                                  grace_period=STALE_AFTER_S)
        except (IntegrityError, OperationalError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 + random.random() * (attempt + 1))
    raise AssertionError("unreachable")


def open_study(name: str, storage, *, sampler=None, directions=("minimize",)):
    """Create or resume the study; trials a killed planner left RUNNING (no heartbeat for
    STALE_AFTER_S) are marked FAIL, so they neither block nor count as results."""
    import optuna

    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                directions=list(directions), load_if_exists=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return study


def storage_for(settings: TuneSettings, work_dir: Path):
    if not settings.storage:
        work_dir.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{work_dir / 'study.db'}"
        return _rdb_storage(url), url
    if "://" in settings.storage:
        return _rdb_storage(settings.storage), settings.storage
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(settings.storage)), settings.storage


def study_name(spec: Spec, fingerprint: str) -> str:
    return f"{spec.job.name}-{spec.sha256[:10]}-{fingerprint.split()[0]}"


def _key_of_row(table: CandidateTable, i: int) -> tuple:
    return tuple(int(table[d][i]) for d in DIMENSIONS)


def _choices(table: CandidateTable, rows: np.ndarray) -> dict[str, list[int]]:
    return {d: sorted({int(v) for v in table[d][rows]}) for d in DIMENSIONS}


def implied_oom(table: CandidateTable, i: int, ooms: list[int]) -> bool:
    """Safe rule: OOM at (micro m, recompute r) implies OOM at micro >= m, recompute <= r."""
    for j in ooms:
        same = all(table[d][i] == table[d][j] for d in DIMENSIONS
                   if d not in ("micro", "recompute_code"))
        if same and table["micro"][i] >= table["micro"][j] and \
                table["recompute_code"][i] <= table["recompute_code"][j]:
            return True
    return False


def cost_at_step(table: CandidateTable, i: int, step_s: float) -> tuple[float, float]:
    """(cost, hours) of row i if a step took `step_s` instead of the modelled step time."""
    scale = step_s / table["step_time_s"][i]
    startup = table["hours"][i] - table["train_hours"][i] / table["useful_fraction"][i]
    hours = table["train_hours"][i] * scale / table["useful_fraction"][i] + startup
    return table["price_node_hour"][i] * table["nodes"][i] * hours, hours


def measured_cost(table: CandidateTable, i: int, result: ProbeResult) -> tuple[float, float]:
    """(cost, hours) with the measured step time in place of the modelled one."""
    return cost_at_step(table, i, result.step_time_s)


def calibrated_costs(table: CandidateTable, rows: np.ndarray,
                     probed: dict[int, ProbeResult]) -> np.ndarray:
    """Modelled cost of `rows` after fitting each profile's efficiency to the probes so far
    (rows of a precision no probe has measured keep the prior)."""
    from planner.calibration import fit, predicted_step

    def profile_of(i):
        return table.offers[int(table["offer"][i])].profile

    costs = table["cost"][rows].astype(float)
    for name, profile in {profile_of(i).name: profile_of(i) for i in rows}.items():
        mine = {i: r for i, r in probed.items() if profile_of(i).name == name}
        fitted = fit(table, mine, profile, fingerprint="study") if mine else None
        for k, i in enumerate(rows):
            eff = fitted.by_precision.get(PRECISIONS[table["precision_code"][i]]) \
                if fitted and profile_of(i).name == name else None
            if eff is not None:
                costs[k] = cost_at_step(table, int(i), predicted_step(table, int(i), eff))[0]
    return costs


def seed_rows(table: CandidateTable, rows: np.ndarray, n: int) -> list[int]:
    """The model's cheapest candidates, each at least 2x apart in tokens per micro-batch from
    the others: the probes then span the efficiency curve, so the first calibration can see
    its shape (the priors' weakest part), not one point of it three times."""
    order = [int(i) for i in rows[np.argsort(table["cost"][rows], kind="stable")]]
    work = {i: float(table["micro"][i] * table["seq"][i]) for i in order}
    chosen: list[int] = []
    for i in order:
        if len(chosen) == n:
            break
        if all(abs(np.log2(work[i] / work[j])) >= 1 for j in chosen):
            chosen.append(i)
    chosen += [i for i in order if i not in chosen][:n - len(chosen)]  # too few work sizes
    return chosen


def _waiting(study) -> bool:
    import optuna

    return bool(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))


def _enqueue_calibrated_best(study, table: CandidateTable, rows: np.ndarray,
                             probed: dict[int, ProbeResult], done: dict, ooms: list[int],
                             choices: dict) -> tuple | None:
    """Enqueue the cheapest candidate not yet tried, by the model calibrated on the probes so
    far: after every measurement the model re-ranks what is left. Returns its key."""
    fresh = np.array([i for i in rows if table["fits"][i] and
                      _key_of_row(table, int(i)) not in done and
                      not implied_oom(table, int(i), ooms)], dtype=int)
    if not fresh.size:
        return None
    best = int(fresh[np.argmin(calibrated_costs(table, fresh, probed))])
    study.enqueue_trial({d: int(table[d][best]) for d in DIMENSIONS if len(choices[d]) > 1},
                        skip_if_exists=True)
    return _key_of_row(table, best)


def tune(spec: Spec, table: CandidateTable, local_rows: np.ndarray, *, target: float,
         work_dir: Path, settings: TuneSettings, backend: LocalProbe | None = None,
         cache: ProbeCache | None = None, progress=None) -> TuneOutcome:
    """Run (or resume) the study; returns what was probed. `local_rows` index `table`."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    owned = backend is None
    backend = backend or LocalProbe(work_dir, steps=settings.steps, warmup=settings.warmup,
                                    timeout_s=settings.timeout_s)
    try:
        return _tune(spec, table, local_rows, target=target, work_dir=work_dir,
                     settings=settings, backend=backend, cache=cache, progress=progress)
    finally:
        if owned:
            backend.close()


def _tune(spec: Spec, table: CandidateTable, local_rows: np.ndarray, *, target: float,
          work_dir: Path, settings: TuneSettings, backend: LocalProbe,
          cache: ProbeCache | None, progress) -> TuneOutcome:
    import optuna

    cache = cache or ProbeCache(Path(spec.job.cache_dir) / "probes.jsonl")
    fingerprint = backend.fingerprint
    storage, url = storage_for(settings, work_dir)
    name = study_name(spec, fingerprint)

    # Constraints go through Trial.set_constraint (Optuna 5): feasible when <= 0; the samplers
    # read them, so infeasible trials steer the search instead of scoring zero.
    if settings.multi_objective:
        sampler = optuna.samplers.NSGAIISampler(seed=settings.seed)
        directions = ["minimize", "minimize"]
    else:
        sampler = optuna.samplers.TPESampler(seed=settings.seed,
                                             n_startup_trials=max(2, settings.enqueue))
        directions = ["minimize"]
    study = open_study(name, storage, sampler=sampler, directions=directions)
    rows_by_key = {_key_of_row(table, int(i)): int(i) for i in local_rows}
    choices = _choices(table, local_rows)
    outcome = TuneOutcome(name, url)

    # What this study already knows (resume): never probe a configuration twice.
    done: dict[tuple, dict] = {}
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if t.state == optuna.trial.TrialState.COMPLETE and "row_key" in a and \
                a.get("status") != "repeat":
            done[tuple(a["row_key"])] = {"values": list(t.values), "status": a.get("status"),
                                         "violation": a.get(CONSTRAINT_ATTR, [0.0])[0],
                                         "number": t.number, "probe": a.get("probe")}
    ooms = [rows_by_key[k] for k, d in done.items()
            if d["status"] == "oom" and k in rows_by_key]
    for key, d in done.items():
        if key in rows_by_key and d["status"] == "ok":
            outcome.probed[rows_by_key[key]] = ProbeResult(**d["probe"])

    if not done:  # seed with the model's best at distinct work sizes, cheapest first
        for i in seed_rows(table, local_rows, settings.enqueue):
            study.enqueue_trial({d: int(table[d][i]) for d in DIMENSIONS if
                                 len(choices[d]) > 1}, skip_if_exists=True)

    budget, deadline = spec.constraints.budget, spec.constraints.deadline_hours
    probes_run = 0
    start_trials = len(study.trials)
    worst = float(np.max(table["cost"][local_rows])) * 10
    confirm = settings.confirm if settings.probes >= 2 * settings.confirm + 1 else 0
    explore = settings.probes - confirm
    guided_turn, guided_key = False, None
    while len(study.trials) - start_trials < settings.trials:
        if probes_run >= explore or outcome.probe_wall_s >= settings.probe_time_s:
            break
        if sum(k in rows_by_key for k in done) >= len(rows_by_key):
            break  # every local configuration has been tried
        if settings.guided and guided_turn and not _waiting(study):
            guided_key = _enqueue_calibrated_best(study, table, local_rows, outcome.probed,
                                                  done, ooms, choices)
            guided_turn = False
        trial = study.ask()
        beat = heartbeat(study, trial)
        params = {d: (trial.suggest_categorical(d, choices[d]) if len(choices[d]) > 1
                      else choices[d][0]) for d in DIMENSIONS}
        key = tuple(int(params[d]) for d in DIMENSIONS)
        row = rows_by_key.get(key)

        def finish(values, violation, status, **attrs):
            beat.set()  # stop this trial's heartbeat
            try:
                trial.set_user_attr(CONSTRAINT_ATTR, [violation])
                trial.set_constraint("memory_budget_deadline", violation)
                trial.set_user_attr("status", status)
                trial.set_user_attr("row_key", list(key))
                for k, v in attrs.items():
                    trial.set_user_attr(k, v)
                study.tell(trial, values if settings.multi_objective else values[0])
            except optuna.exceptions.UpdateFinishedTrialError:
                # Another planner sharing the study took the same (enqueued) trial and
                # finished it first; our measurement stays in the probe cache.
                pass
            if status != "repeat":
                done.setdefault(key, {"values": values, "status": status,
                                      "violation": violation, "number": trial.number,
                                      "probe": attrs.get("probe")})

        if row is None:  # not a valid layout under Paddle's rules / the batch range
            finish([worst, worst], 1.0, "invalid")
            continue
        modelled = {"modelled_step_s": float(table["step_time_s"][row]),
                    "modelled_memory_gb": float(table["memory_gb"][row]),
                    "modelled_cost": float(table["cost"][row])}
        if key in done:  # the sampler proposed a configuration we already know: no probe
            prev = done[key]
            values = prev["values"] + [prev["values"][-1]] * (2 - len(prev["values"]))
            finish(values, prev["violation"], "repeat", repeat_of=prev["number"],
                   repeat_status=prev["status"], **modelled)
            continue
        if not table["fits"][row]:
            finish([worst, worst], 1.0, "predicted oom", **modelled)
            continue
        if implied_oom(table, row, ooms):
            finish([worst, worst], 1.0, "oom (implied)", **modelled)
            continue
        guided_turn = key != guided_key  # after the sampler's probe, the model picks next
        plan = candidate_plan(spec, table.row(row), target=target)
        result = cache.get(fingerprint, config_key(plan))
        cached = result is not None
        if not cached:
            result = backend.run(plan)
            probes_run += 1
            outcome.probe_wall_s += result.wall_s
            cache.put(result)
        else:
            outcome.reused += 1
        if progress is not None:
            progress(result, table, row, cached)
        attrs = modelled | {"probe": result.__dict__}
        if not result.ok:
            if result.status == "oom":
                ooms.append(row)
            finish([worst, worst], 1.0, result.status, **attrs)
            continue
        outcome.probed[row] = result
        cost, hours = measured_cost(table, row, result)
        violation = max(0.0, (cost - budget) / budget if budget else 0.0,
                        (hours - deadline) / deadline if deadline else 0.0)
        finish([cost, hours], violation, "ok", measured_cost=cost, measured_hours=hours,
               **attrs)
    finalists = sorted((measured_cost(table, i, r)[0], i) for i, r in outcome.probed.items()
                       if r.measured_steps <= settings.steps)[:confirm]
    if len(finalists) > 1:  # re-measuring a lone finalist cannot change the pick
        for _, i in finalists:
            if outcome.probe_wall_s >= settings.probe_time_s:
                break
            again = backend.run(candidate_plan(spec, table.row(i), target=target),
                                steps=3 * settings.steps)
            probes_run += 1
            outcome.probe_wall_s += again.wall_s
            if again.ok:
                outcome.probed[i] = outcome.probed[i].pooled_with(again)
                if progress is not None:
                    progress(outcome.probed[i], table, i, False)
    outcome.probes_run = probes_run
    ok = [(measured_cost(table, i, r)[0], i) for i, r in outcome.probed.items()
          if _within(spec, *measured_cost(table, i, r))]
    outcome.best_row = min(ok)[1] if ok else None
    return outcome


def heartbeat(study, trial):
    """Optuna's heartbeat thread for an ask/tell trial (`study.optimize` starts the same one
    itself): while it beats, the trial is alive; a killed planner's trial goes stale."""
    import threading

    from optuna.storages._heartbeat import is_heartbeat_enabled

    stop = threading.Event()
    storage = study._storage
    if not is_heartbeat_enabled(storage):
        return stop

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial._trial_id)
            if stop.wait(timeout=HEARTBEAT_S):
                return

    threading.Thread(target=beat, daemon=True, name="trial-heartbeat").start()
    return stop  # .set() ends the beat


def _within(spec: Spec, cost: float, hours: float) -> bool:
    c = spec.constraints
    return (not c.budget or cost <= c.budget) and (not c.deadline_hours or
                                                   hours <= c.deadline_hours)


def history_rows(storage, name: str) -> list[dict]:
    """The study's trials for `planner history`."""
    import optuna

    study = optuna.load_study(study_name=name, storage=storage)
    rows = []
    for t in study.trials:
        a = t.user_attrs
        probe = a.get("probe") or {}
        measured = probe.get("step_time_s") or 0.0
        modelled = a.get("modelled_step_s") or 0.0
        rows.append({
            "trial": t.number, "status": a.get("status", t.state.name.lower()),
            "config": {k: v for k, v in t.params.items()},
            "modelled step s": round(modelled, 4) if modelled else None,
            "measured step s": round(measured, 4) if measured else None,
            "error %": round(100 * (modelled - measured) / measured, 1)
            if measured and modelled else None,
            "measured cost": a.get("measured_cost"),
        })
    return rows

