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
- Short probes are noisy (10-40% on a shared CPU), so the last probes race the finalists
  (`race`): they are probed in turn (A, B, A, B, ... in the same workers, so drift hits both)
  until their confidence intervals separate or the racing budget is spent, as irace's racing
  does; the pick uses the pooled measurements, and the outcome says whether it is
  statistically distinguishable from the runner-up and by how much.
- Measured step times calibrate the profile's efficiency curve (planner.calibration).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from gptplan.plan import SEED_MAX
from gptplan.tomlconf import from_table, setting
from planner.planwriter import candidate_plan
from planner.probes import LocalProbe, ProbeCache, ProbeResult, config_key
from planner.search import PRECISIONS, CandidateTable
from planner.spec import Spec

DIMENSIONS = ("seq", "micro", "acc", "precision_code", "offer", "recompute_code", "tp", "pp",
              "stage_code", "sp", "nodes")
CONSTRAINT_ATTR = "constraint"


@dataclass
class TuneSettings:
    """How to autotune; ranges checked like the plan's (`tune_settings_from`)."""
    probes: int = setting(8, "Real probe runs at most.", min=0)
    probe_time_s: float = setting(600.0, "Total probe wall time at most, s.", min=0)
    trials: int = setting(200, "Trials in all (model-only ones included).", min=1)
    seed: int = setting(0, "Sampler seed (32 bits).", min=0, max=SEED_MAX)
    storage: str = setting("", "'' = SQLite file in the work dir; an RDB URL; or a *.journal "
                               "path.")
    multi_objective: bool = setting(False, "NSGA-II on (cost, hours).")
    enqueue: int = setting(3, "Analytic best candidates tried first.", min=0)
    race: int = setting(-1, "Of the probes, kept to race the finalists (0 = none; -1 = a "
                            "third of them, at least 2).", min=-1)
    finalists: int = setting(0, "Configurations entering the race (0 = 2, or 3 when at least "
                                "4 probes race).", min=0)
    race_steps: int = setting(0, "Measured steps per racing probe (0 = 3 x steps).", min=0)
    rank_by: Literal["mean", "median"] = setting("mean", "Finalists by the mean or median "
                                                         "measured step.")
    guided: bool = setting(True, "After the seeds, every other probe is the calibrated "
                                 "model's pick.")
    steps: int = setting(5, "Measured steps per probe.", min=1)
    warmup: int = setting(2, "Warm-up steps per probe (not measured).", min=0)
    timeout_s: float = setting(180.0, "Seconds per probe.", min=0, min_exclusive=True)


def tune_settings_from(table: dict) -> TuneSettings:
    """TuneSettings from plain values (the CLI's flags), checked: a bad one is a UserError
    naming `tune.<field>`."""
    return from_table(TuneSettings, table, file="", section="tune")


@dataclass
class TuneOutcome:
    study_name: str
    storage: str
    probed: dict[int, ProbeResult] = field(default_factory=dict)   # row -> result
    reused: int = 0
    probes_run: int = 0             # real probe subprocesses started by this call
    probe_wall_s: float = 0.0
    best_row: int | None = None
    race: "Race | None" = None


@dataclass(frozen=True)
class Race:
    """How the finalists' race ended: who, how many rounds, and whether the pick is
    statistically distinguishable (95%, Welch) from the runner-up, by how much."""
    finalists: tuple                # rows, best first (after the race)
    rounds: int
    probes: int
    separated: bool
    difference: float               # runner-up's mean cost per token / the pick's - 1
    interval: tuple                 # 95% interval of that difference
    p_value: float

    def to_dict(self) -> dict:
        return {"finalists": [int(i) for i in self.finalists], "rounds": self.rounds,
                "probes": self.probes, "distinguishable": self.separated,
                "runner_up_more_expensive_by": self.difference,
                "difference_interval_95": list(self.interval), "p_value": self.p_value}


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
    if settings.storage == ":memory:":  # replay benchmarks: thousands of short studies
        import optuna

        return optuna.storages.InMemoryStorage(), ":memory:"
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


def measured_cost(table: CandidateTable, i: int, result: ProbeResult,
                  rank_by: str = "median") -> tuple[float, float]:
    """(cost, hours) with the measured step time in place of the modelled one: the median
    step (robust) or the mean (what a run pays for)."""
    step = result.mean_step_time_s if rank_by == "mean" and result.mean_step_time_s else \
        result.step_time_s
    return cost_at_step(table, i, step)


def _cost_samples(table: CandidateTable, i: int, result: ProbeResult) -> np.ndarray:
    """Per-step cost samples of row i (cost of the whole job at each measured step time)."""
    steps = np.asarray(result.step_times_s or [result.step_time_s], dtype=float)
    scale = measured_cost(table, i, result, "mean")[0] / max(result.mean_step_time_s or
                                                              result.step_time_s, 1e-12)
    return steps * scale


def compare(table: CandidateTable, a: int, ra: ProbeResult, b: int, rb: ProbeResult
            ) -> tuple[float, tuple[float, float], float]:
    """(b's mean cost / a's - 1, its 95% interval, Welch p-value) from the step samples."""
    from scipy import stats

    x, y = _cost_samples(table, a, ra), _cost_samples(table, b, rb)
    mx, my = float(x.mean()), float(y.mean())
    if len(x) < 2 or len(y) < 2:
        return my / mx - 1, (-np.inf, np.inf), 1.0
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = float(np.sqrt(vx + vy))
    if se == 0:
        return my / mx - 1, (my / mx - 1, my / mx - 1), 0.0 if mx != my else 1.0
    dof = (vx + vy) ** 2 / ((vx ** 2 / (len(x) - 1) if len(x) > 1 else 0) +
                            (vy ** 2 / (len(y) - 1) if len(y) > 1 else 0))
    t = float(stats.t.ppf(0.975, dof))
    p = float(2 * stats.t.sf(abs(my - mx) / se, dof))
    return my / mx - 1, ((my - mx - t * se) / mx, (my - mx + t * se) / mx), p


def calibrated_costs(table: CandidateTable, rows: np.ndarray,
                     probed: dict[int, ProbeResult]) -> np.ndarray:
    """Modelled cost of `rows` after fitting the efficiency to the probes so far, per offer
    where that offer has probes (one offer is one layout of the machine, e.g. 1 or 2 CPU
    processes, which use the cores differently), else per profile; rows of a precision no
    probe has measured keep the prior."""
    from planner.calibration import fit, predicted_step

    costs = table["cost"][rows].astype(float)
    fits: dict = {}

    def fitted_for(key, mine, profile):
        if key not in fits:
            fits[key] = fit(table, mine, profile, fingerprint="study") if mine else None
        return fits[key]

    for k, i in enumerate(rows):
        i = int(i)
        offer = int(table["offer"][i])
        profile = table.offers[offer].profile
        precision = PRECISIONS[table["precision_code"][i]]
        same_offer = {j: r for j, r in probed.items() if int(table["offer"][j]) == offer}
        same_profile = {j: r for j, r in probed.items()
                        if table.offers[int(table["offer"][j])].profile.name == profile.name}
        for key, mine in ((("offer", offer), same_offer),
                          (("profile", profile.name), same_profile)):
            fitted = fitted_for(key, mine, profile)
            eff = fitted.by_precision.get(precision) if fitted else None
            if eff is not None:
                costs[k] = cost_at_step(table, i, predicted_step(table, i, eff))[0]
                break
    return costs


def seed_rows(table: CandidateTable, rows: np.ndarray, n: int) -> list[int]:
    """The model's cheapest candidate of every offer (one offer is one layout of the machine:
    the prior is least sure how layouts compare, e.g. 1 CPU process with all cores vs 2 with
    one each), cheapest offer first; then more of the cheapest, each at least 2x apart in
    tokens per micro-batch from the seeds of its offer, so the first calibration sees the
    efficiency curve's shape, not one point of it three times."""
    order = [int(i) for i in rows[np.argsort(table["cost"][rows], kind="stable")]]
    work = {i: float(table["micro"][i] * table["seq"][i]) for i in order}
    offer = {i: int(table["offer"][i]) for i in order}
    chosen: list[int] = []
    for i in order:  # the best of each offer
        if len(chosen) < n and all(offer[j] != offer[i] for j in chosen):
            chosen.append(i)
    for i in order:
        if len(chosen) >= n:
            break
        if i not in chosen and all(abs(np.log2(work[i] / work[j])) >= 1 for j in chosen
                                   if offer[j] == offer[i]):
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
    race = settings.race if settings.race >= 0 else max(2, settings.probes // 3)
    race = race if settings.probes >= 2 * race + 1 else 0
    explore = settings.probes - race
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
    outcome.race, raced = _race(spec, table, target, settings, backend, outcome, race,
                                progress)
    outcome.probes_run = probes_run + raced
    if outcome.race is not None:  # the race's winner: measured most, on the same terms
        outcome.best_row = outcome.race.finalists[0]
    else:
        ok = [(measured_cost(table, i, r, settings.rank_by)[0], i)
              for i, r in outcome.probed.items() if _within(spec, *measured_cost(table, i, r))]
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


def _race(spec: Spec, table: CandidateTable, target: float, settings: TuneSettings, backend,
          outcome: TuneOutcome, budget: int, progress) -> tuple[Race | None, int]:
    """Race the best measured configurations: each round probes every survivor once, in turn
    (A, B, A, B, ...), pools the steps, and drops a survivor that is worse than the leader
    with p < 0.05 (Welch); stops when one is left or `budget` probes (or the probe time) are
    spent. Returns the race (None when fewer than two finalists) and the probes it ran."""
    def cost(i):
        return measured_cost(table, i, outcome.probed[i], settings.rank_by)[0]

    within = [i for i, r in outcome.probed.items() if _within(spec, *measured_cost(table, i, r))]
    finalists = sorted(within, key=cost)[:settings.finalists or (3 if budget >= 4 else 2)]
    if len(finalists) < 2 or budget <= 0:
        return None, 0
    steps = settings.race_steps or 3 * settings.steps
    alive, used, rounds = list(finalists), 0, 0
    while used < budget and len(alive) > 1 and outcome.probe_wall_s < settings.probe_time_s:
        for i in list(alive):
            if used >= budget:
                break
            again = backend.run(candidate_plan(spec, table.row(i), target=target), steps=steps)
            used += 1
            outcome.probe_wall_s += again.wall_s
            if not again.ok:  # failed now: out of the race, its earlier result stays
                alive.remove(i)
                continue
            outcome.probed[i] = outcome.probed[i].pooled_with(again)
            if progress is not None:
                progress(outcome.probed[i], table, i, False)
        rounds += 1
        if len(alive) < 2:
            break
        leader = min(alive, key=cost)
        alive = [leader] + [j for j in alive if j != leader and
                            compare(table, leader, outcome.probed[leader], j,
                                    outcome.probed[j])[2] >= 0.05]
    ranked_ = sorted(finalists, key=cost)
    pick, other = ranked_[0], ranked_[1]
    difference, interval, p = compare(table, pick, outcome.probed[pick], other,
                                      outcome.probed[other])
    return Race(tuple(ranked_), rounds, used, p < 0.05, difference, interval, p), used


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

