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
- Short probes are noisy (10-40% on a shared CPU), so the pick is noise-aware
  (planner.tuning.noise): every probe is a reading of its configuration's log cost per token with
  its own variance (its steps' spread, a repeat floor learned from recordings, more under load),
  combined with the calibrated model's prior. The last probes (`race`) repeat, with longer
  probes, whichever of the pick and its closest contender is least certain (so in turn when
  they are equally certain: A, B, A, B, ... in the same workers, drift hits both) until the
  pick is cheaper than every contender with probability `confidence`; probes left over after
  that explore. The outcome states the pick's cost and its lead over the runner-up with an
  interval ("ahead of the runner-up by 4% +- 3%").
- Measured step times calibrate the profile's efficiency curve (planner.tuning.calibration).
- Faults (planner.tuning.study, planner.tuning.stopping): the study and the probe cache are checked
  when opened (a damaged SQLite study is moved aside and refilled from the probe cache); each
  running trial records its planner, so a killed planner's trial is failed on the next open;
  SIGTERM/SIGINT fail the running trial and end the probes. Optuna's public API only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from gptplan import money, userdata
from gptplan import precision as precision_table
from gptplan.plan import SEED_MAX
from gptplan.progress import quiet
from gptplan.tomlconf import from_table, setting
from planner.screen.table import CandidateTable
from planner.spec import Spec
from planner.tuning.probes import (
    LocalProbe,
    ProbeBackend,
    ProbeCache,
    ProbeResult,
    config_key,
)
from planner.tuning.stopping import Stopped, held
from planner.tuning.study import claim, open_storage, open_study, repair_sqlite, study_url
from planner.writing.planwriter import candidate_plan

if TYPE_CHECKING:
    import optuna

DIMENSIONS = (
    "seq",
    "micro",
    "acc",
    "precision_code",
    "offer",
    "recompute_code",
    "tp",
    "pp",
    "stage_code",
    "sp",
    "nodes",
)
CONSTRAINT_ATTR = "constraint"


# The search's choices below (enqueue, race via RACE_SHARE, race_steps, confidence, prior_sd)
# and spread_ratio are what leave-one-recording-out tuning chooses on all five recordings in
# bench/recordings (`python bench/replay_quality.py --shipped` prints them); each recording's
# held-out score in bench/README.md section 6 uses the values tuned on the other four.
RACE_SHARE = 0.25  # of the probes, kept for repeats of finalists (TuneSettings.race = -1)


def race_probes(probes: int, share: float = RACE_SHARE) -> int:
    """Probes kept for repeats of finalists: `share` of them (rounded, at least 1), leaving at
    least one more than twice that to explore (0 when there are fewer than 3 probes)."""
    return min(max(1, round(share * probes)), max(0, (probes - 1) // 2))


@dataclass
class TuneSettings:
    """How to autotune; ranges checked like the plan's (`tune_settings_from`)."""

    probes: int = setting(8, "Real probe runs at most.", min=0)
    probe_time_s: float = setting(600.0, "Total probe wall time at most, s.", min=0)
    trials: int = setting(200, "Trials in all (model-only ones included).", min=1)
    seed: int = setting(0, "Sampler seed (32 bits).", min=0, max=SEED_MAX)
    storage: str = setting("", "'' = SQLite file in the work dir; an RDB URL; or a *.journal path.")
    multi_objective: bool = setting(False, "NSGA-II on (cost, hours).")
    enqueue: int = setting(4, "Analytic best candidates tried first.", min=0)
    race: int = setting(
        -1,
        "Of the probes, kept to repeat finalists (0 = none; -1 = a quarter of them, at least 1).",
        min=-1,
    )
    finalists: int = setting(
        0, "Configurations entering the race (0 = 2, or 3 when at least 4 probes race).", min=0
    )
    race_steps: int = setting(0, "Measured steps per repeat of a finalist (0 = steps).", min=0)
    confidence: float = setting(
        0.8,
        "Race until the pick is cheaper than the runner-up with this probability.",
        min=0.5,
        max=0.999,
    )
    repeat_sd: float = setting(0.01, "Floor of a probe's sd of log(median step).", min=0.0001)
    spread_ratio: float = setting(
        19.8, "Between-probe / within-probe variance of the median step.", min=1.0
    )
    load_inflation: float = setting(
        2.0, "Variance multiplier for a probe taken under load.", min=1.0
    )
    prior_sd: float = setting(
        0.15, "Weight of the calibrated model: sd of its log cost error (0 = no prior).", min=0
    )
    rank_by: Literal["mean", "median"] = setting(
        "mean", "Finalists by the mean or median measured step."
    )
    guided: bool = setting(
        True, "After the seeds, every other probe is the calibrated model's pick."
    )
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
    probed: dict[int, ProbeResult] = field(default_factory=dict)  # row -> result (pooled)
    readings: dict[int, list] = field(default_factory=dict)  # row -> every probe, unpooled
    reused: int = 0
    probes_run: int = 0  # real probe subprocesses started by this call
    probe_wall_s: float = 0.0
    best_row: int | None = None
    race: Race | None = None
    notes: list[str] = field(default_factory=list)  # what was repaired at open, one line each


@dataclass(frozen=True)
class Race:
    """How the finalists' race ended: who, how many repeats, and how sure the pick is against
    the runner-up (planner.tuning.noise): the probability that it is the cheaper one and the
    runner-up's extra cost with its interval at the stated level."""

    finalists: tuple  # rows, best first (after the race)
    rounds: int  # repeats of finalists
    probes: int  # probes the race phase ran (repeats and exploration)
    separated: bool  # probability >= the confidence asked for
    difference: float  # runner-up's cost per token / the pick's - 1 (posterior means)
    interval: tuple  # interval of that difference at `level`
    p_value: float  # 1 - probability
    probability: float = 0.0  # P(pick cheaper than the runner-up)
    level: float = 0.8  # the interval's level, two-sided (2 x confidence - 1)
    cost_per_mtok: float = 0.0  # the pick's cost per million training tokens (posterior)

    def to_dict(self) -> dict:
        return {
            "finalists": [int(i) for i in self.finalists],
            "rounds": self.rounds,
            "probes": self.probes,
            "distinguishable": self.separated,
            "runner_up_more_expensive_by": self.difference,
            "difference_interval": list(self.interval),
            "interval_level": self.level,
            "probability_pick_cheaper": self.probability,
            "p_value": self.p_value,
            "cost_per_mtok": self.cost_per_mtok,
        }


def study_name(spec: Spec, fingerprint: str) -> str:
    return f"{spec.job.name}-{spec.sha256[:10]}-{fingerprint.split()[0]}"


def _key_of_row(table: CandidateTable, i: int) -> tuple:
    return tuple(int(table[d][i]) for d in DIMENSIONS)


def _choices(table: CandidateTable, rows: np.ndarray) -> dict[str, list[int]]:
    return {d: sorted({int(v) for v in table[d][rows]}) for d in DIMENSIONS}


def implied_oom(table: CandidateTable, i: int, ooms: list[int]) -> bool:
    """Safe rule: OOM at (micro m, recompute r) implies OOM at micro >= m, recompute <= r."""
    for j in ooms:
        same = all(
            table[d][i] == table[d][j] for d in DIMENSIONS if d not in ("micro", "recompute_code")
        )
        # partial recompute (rc_layers) is another memory choice: only like for like
        if "rc_layers" in table.columns:
            same = same and table["rc_layers"][i] == table["rc_layers"][j]
        if (
            same
            and table["micro"][i] >= table["micro"][j]
            and table["recompute_code"][i] <= table["recompute_code"][j]
        ):
            return True
    return False


def cost_at_step(table: CandidateTable, i: int, step_s: float) -> tuple[float, float]:
    """(cost, hours) of row i if a step took `step_s` instead of the modelled step time."""
    scale = step_s / table["step_time_s"][i]
    startup = table["hours"][i] - table["train_hours"][i] / table["useful_fraction"][i]
    hours = table["train_hours"][i] * scale / table["useful_fraction"][i] + startup
    return _cost(table, i, hours * money.SECONDS_PER_HOUR), hours


def _cost(table: CandidateTable, i: int, seconds) -> float:
    """Row i's price for `seconds` of its nodes (gptplan.money.cost)."""
    return money.cost(
        price_per_node_hour=table["price_node_hour"][i], nodes=table["nodes"][i], seconds=seconds
    )


def measured_cost(
    table: CandidateTable, i: int, result: ProbeResult, rank_by: str = "median"
) -> tuple[float, float]:
    """(cost, hours) with the measured step time in place of the modelled one: the median
    step (robust) or the mean (what a run pays for)."""
    step = (
        result.mean_step_time_s
        if rank_by == "mean" and result.mean_step_time_s
        else result.step_time_s
    )
    return cost_at_step(table, i, step)


def calibrated_costs(
    table: CandidateTable, rows: np.ndarray, probed: dict[int, ProbeResult]
) -> np.ndarray:
    """Modelled cost of `rows` after fitting the efficiency to the probes so far, per offer
    where that offer has probes (one offer is one layout of the machine, e.g. 1 or 2 CPU
    processes, which use the cores differently), else per profile; rows of a precision no
    probe has measured keep the prior."""
    from planner.tuning.calibration import fit, predicted_step

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
        precision = precision_table.name_of(table["precision_code"][i])
        same_offer = {j: r for j, r in probed.items() if int(table["offer"][j]) == offer}
        same_profile = {
            j: r
            for j, r in probed.items()
            if table.offers[int(table["offer"][j])].profile.name == profile.name
        }
        for key, mine in (
            (("offer", offer), same_offer),
            (("profile", profile.name), same_profile),
        ):
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
        if i not in chosen and all(
            abs(np.log2(work[i] / work[j])) >= 1 for j in chosen if offer[j] == offer[i]
        ):
            chosen.append(i)
    chosen += [i for i in order if i not in chosen][: n - len(chosen)]  # too few work sizes
    return chosen


def _waiting(study) -> bool:
    import optuna

    return bool(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))


def _enqueue_calibrated_best(
    study,
    table: CandidateTable,
    rows: np.ndarray,
    probed: dict[int, ProbeResult],
    done: dict,
    ooms: list[int],
    choices: dict,
) -> tuple | None:
    """Enqueue the cheapest candidate not yet tried, by the model calibrated on the probes so
    far: after every measurement the model re-ranks what is left. Returns its key."""
    fresh = np.array(
        [
            i
            for i in rows
            if table["fits"][i]
            and _key_of_row(table, int(i)) not in done
            and not implied_oom(table, int(i), ooms)
        ],
        dtype=int,
    )
    if not fresh.size:
        return None
    best = int(fresh[np.argmin(calibrated_costs(table, fresh, probed))])
    study.enqueue_trial(
        {d: int(table[d][best]) for d in DIMENSIONS if len(choices[d]) > 1}, skip_if_exists=True
    )
    return _key_of_row(table, best)


def tune(
    spec: Spec,
    table: CandidateTable,
    local_rows: np.ndarray,
    *,
    target: float,
    work_dir: Path,
    settings: TuneSettings,
    backend: ProbeBackend | None = None,
    cache: ProbeCache | None = None,
    progress=None,
    log=None,
) -> TuneOutcome:
    """Run (or resume) the study; returns what was probed. `local_rows` index `table`.
    A `Stopped` (SIGTERM/SIGINT) fails the running trial and ends the probes on its way out."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # without a backend given, the live one on this machine, which tune ends on its way out
    live = None
    if backend is None:
        live = LocalProbe(
            work_dir, steps=settings.steps, warmup=settings.warmup, timeout_s=settings.timeout_s
        )
        backend = live
    try:
        session = _open_session(
            spec,
            table,
            local_rows,
            target=target,
            work_dir=work_dir,
            settings=settings,
            backend=backend,
            cache=cache,
            progress=progress,
            log=log or quiet,
        )
        return _tune(session)
    except Stopped as stop:
        if live is not None:
            stop.probes_ended += live.close(wait=False)
        raise
    finally:
        if live is not None:
            live.close()


@dataclass
class _Session:
    """One tuning run: its inputs, the study and what is known so far."""

    spec: Spec
    table: CandidateTable
    local_rows: np.ndarray
    target: float
    settings: TuneSettings
    backend: ProbeBackend
    cache: ProbeCache
    progress: Callable | None
    study: optuna.Study
    outcome: TuneOutcome
    claim_trials: bool  # record who runs each trial (not for in-memory studies)
    rows_by_key: dict = field(default_factory=dict)
    choices: dict = field(default_factory=dict)
    worst: float = 0.0
    done: dict = field(default_factory=dict)  # row key -> what its trial found
    ooms: list = field(default_factory=list)
    probes_run: int = 0
    guided_turn: bool = False
    guided_key: tuple | None = None


def _sampler(settings: TuneSettings):
    """(sampler, directions). Constraints go through Trial.set_constraint (Optuna 5):
    feasible when <= 0; the samplers read them, so infeasible trials steer the search."""
    import optuna

    if settings.multi_objective:
        return optuna.samplers.NSGAIISampler(seed=settings.seed), ["minimize", "minimize"]
    return optuna.samplers.TPESampler(
        seed=settings.seed, n_startup_trials=max(2, settings.enqueue)
    ), ["minimize"]


def _open_session(
    spec: Spec,
    table: CandidateTable,
    local_rows: np.ndarray,
    *,
    target: float,
    work_dir: Path,
    settings: TuneSettings,
    backend: ProbeBackend,
    cache: ProbeCache | None,
    progress,
    log,
) -> _Session:
    """Open (check, repair, resume) the study and the probe cache; say what was repaired."""
    cache = cache or ProbeCache(userdata.cache_dir(spec.job.cache_dir) / "probes.jsonl")
    url = study_url(settings.storage, work_dir)
    repaired = repair_sqlite(url)
    name = study_name(spec, backend.fingerprint)
    sampler, directions = _sampler(settings)
    study, failed = open_study(name, open_storage(url), sampler=sampler, directions=directions)
    s = _Session(
        spec,
        table,
        local_rows,
        target,
        settings,
        backend,
        cache,
        progress,
        study,
        TuneOutcome(name, url),
        claim_trials=url != ":memory:",
        rows_by_key={_key_of_row(table, int(i)): int(i) for i in local_rows},
        choices=_choices(table, local_rows),
        worst=float(np.max(table["cost"][local_rows])) * 10,
    )
    notes = list(cache.notes)
    if failed:
        notes.append(
            f"study {name}: trial(s) {', '.join(map(str, failed))} were left running "
            "by a planner that is gone: marked failed"
        )
    _load_known(s)
    if repaired:
        notes.append(
            f"{repaired}; rebuilt from the probe cache ({_rebuild_from_cache(s)} "
            "configuration(s) known again, none probed)"
        )
    for note in notes:  # before any probe line
        log(note)
    s.outcome.notes += notes
    if not s.done:  # seed with the model's best at distinct work sizes, cheapest first
        for i in seed_rows(table, local_rows, settings.enqueue):
            study.enqueue_trial(_params_of(s, i), skip_if_exists=True)
    return s


def _params_of(s: _Session, i: int) -> dict:
    return {d: int(s.table[d][i]) for d in DIMENSIONS if len(s.choices[d]) > 1}


def _load_known(s: _Session) -> None:
    """What this study already knows (resume): never probe a configuration twice."""
    import optuna

    for t in s.study.get_trials(deepcopy=False):
        a = t.user_attrs
        if (
            t.state == optuna.trial.TrialState.COMPLETE
            and "row_key" in a
            and a.get("status") != "repeat"
        ):
            s.done[tuple(a["row_key"])] = {
                "values": list(t.values),
                "status": a.get("status"),
                "violation": a.get(CONSTRAINT_ATTR, [0.0])[0],
                "number": t.number,
                "probe": a.get("probe"),
            }
    s.ooms = [
        s.rows_by_key[k] for k, d in s.done.items() if d["status"] == "oom" and k in s.rows_by_key
    ]
    for key, d in s.done.items():
        if key in s.rows_by_key and d["status"] == "ok":
            s.outcome.probed[s.rows_by_key[key]] = ProbeResult(**d["probe"])


def _rebuild_from_cache(s: _Session) -> int:
    """A new study in place of a damaged one: every local configuration the probe cache holds
    for this machine becomes a trial again (cache hits, no probe runs)."""
    cached = {key for fingerprint, key in s.cache.results if fingerprint == s.backend.fingerprint}
    rows = [
        int(i)
        for i in s.local_rows
        if cached
        and config_key(candidate_plan(s.spec, s.table.row(int(i)), target=s.target)) in cached
    ]
    progress, s.progress = s.progress, None  # one line says what was rebuilt, not a line each
    try:
        for row in rows:
            s.study.enqueue_trial(_params_of(s, row), skip_if_exists=True)
            _run_trial(s)
    finally:
        s.progress = progress
    return len(rows)


def _tune(s: _Session) -> TuneOutcome:
    """Explore (seeds, sampler and calibrated model in turn), race the finalists, pick."""
    settings = s.settings
    race = settings.race if settings.race >= 0 else race_probes(settings.probes)
    race = race if settings.probes >= 2 * race + 1 else 0
    _explore(s, settings.probes - race)
    s.outcome.race, raced = _race(s, race)
    if s.outcome.race is None:  # fewer than two configurations measured: the rest explore
        _explore(s, settings.probes - raced)
    s.outcome.probes_run = s.probes_run + raced
    if s.outcome.race is not None:  # the race's winner: measured most, on the same terms
        s.outcome.best_row = s.outcome.race.finalists[0]
    else:
        ok = [
            (measured_cost(s.table, i, r, settings.rank_by)[0], i)
            for i, r in s.outcome.probed.items()
            if _within(s.spec, *measured_cost(s.table, i, r))
        ]
        s.outcome.best_row = min(ok)[1] if ok else None
    return s.outcome


def _explore(s: _Session, explore: int) -> None:
    """Trials until `explore` probes, the probe time or the trial count is spent, or every
    local configuration has been tried."""
    start = len(s.study.get_trials(deepcopy=False))
    while len(s.study.get_trials(deepcopy=False)) - start < s.settings.trials:
        if s.probes_run >= explore or s.outcome.probe_wall_s >= s.settings.probe_time_s:
            break
        if sum(k in s.rows_by_key for k in s.done) >= len(s.rows_by_key):
            break  # every local configuration has been tried
        if s.settings.guided and s.guided_turn and not _waiting(s.study):
            s.guided_key = _enqueue_calibrated_best(
                s.study, s.table, s.local_rows, s.outcome.probed, s.done, s.ooms, s.choices
            )
            s.guided_turn = False
        _run_trial(s)


def _run_trial(s: _Session) -> None:
    """Ask, record who runs it, evaluate; a trial that cannot finish (a signal, an error) is
    told FAIL before the exception goes on."""
    import optuna

    trial = None
    try:
        with held():
            trial = s.study.ask()
            if s.claim_trials:
                claim(trial, lease_s=s.settings.timeout_s)
        _evaluate(s, trial)
    except optuna.exceptions.UpdateFinishedTrialError:
        return  # planners sharing a study both took this trial; the other one finished it
    except BaseException as exc:
        if trial is None:
            raise
        with held():
            told = s.study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        if isinstance(exc, Stopped) and told.state == optuna.trial.TrialState.FAIL:
            exc.failed_trials.append(trial.number)
        raise


def _evaluate(s: _Session, trial) -> None:
    """One trial: what the sampler proposed, settled without a probe where that is safe."""
    choices, table = s.choices, s.table
    params = {
        d: (trial.suggest_categorical(d, choices[d]) if len(choices[d]) > 1 else choices[d][0])
        for d in DIMENSIONS
    }
    key = tuple(int(params[d]) for d in DIMENSIONS)
    row, worst = s.rows_by_key.get(key), [s.worst, s.worst]
    if row is None:  # not a valid layout under Paddle's rules / the batch range
        return _finish(s, trial, key, worst, 1.0, "invalid")
    modelled = {
        "modelled_step_s": float(table["step_time_s"][row]),
        "modelled_memory_gb": float(table["memory_gb"][row]),
        "modelled_cost": float(table["cost"][row]),
    }
    if key in s.done:  # the sampler proposed a configuration we already know: no probe
        prev = s.done[key]
        values = prev["values"] + [prev["values"][-1]] * (2 - len(prev["values"]))
        return _finish(
            s,
            trial,
            key,
            values,
            prev["violation"],
            "repeat",
            repeat_of=prev["number"],
            repeat_status=prev["status"],
            **modelled,
        )
    if not table["fits"][row]:
        return _finish(s, trial, key, worst, 1.0, "predicted oom", **modelled)
    if implied_oom(table, row, s.ooms):
        return _finish(s, trial, key, worst, 1.0, "oom (implied)", **modelled)
    s.guided_turn = key != s.guided_key  # after the sampler's probe, the model picks next
    result = _probe(s, row)
    attrs = modelled | {"probe": result.__dict__}
    if not result.ok:
        if result.status == "oom":
            s.ooms.append(row)
        return _finish(s, trial, key, worst, 1.0, result.status, **attrs)
    s.outcome.probed[row] = result
    s.outcome.readings.setdefault(row, []).append(result)
    cost, hours = measured_cost(table, row, result)
    violation = _violation(s.spec, cost, hours)
    return _finish(
        s,
        trial,
        key,
        [cost, hours],
        violation,
        "ok",
        measured_cost=cost,
        measured_hours=hours,
        **attrs,
    )


def _violation(spec: Spec, cost: float, hours: float) -> float:
    """How far a measured cost and time pass the budget and deadline (0 within both)."""
    budget, deadline = spec.constraints.budget, spec.constraints.deadline_hours
    return max(
        0.0,
        (cost - budget) / budget if budget else 0.0,
        (hours - deadline) / deadline if deadline else 0.0,
    )


def _probe(s: _Session, row: int) -> ProbeResult:
    """The probe cache's result for row, or a real probe run (cached)."""
    plan = candidate_plan(s.spec, s.table.row(row), target=s.target)
    known = s.cache.get(s.backend.fingerprint, config_key(plan))
    cached = known is not None
    if known is None:
        result = s.backend.run(plan)
        s.probes_run += 1
        s.outcome.probe_wall_s += result.wall_s
        s.cache.put(result)
    else:
        result = known
        s.outcome.reused += 1
    if s.progress is not None:
        s.progress(result, s.table, row, cached)
    return result


def _finish(
    s: _Session, trial, key: tuple, values: list, violation: float, status: str, **attrs
) -> None:
    """Tell the trial's values, constraint and what it found; remember the configuration."""
    import optuna

    with held():
        try:
            trial.set_user_attr(CONSTRAINT_ATTR, [violation])
            trial.set_constraint("memory_budget_deadline", violation)
            trial.set_user_attr("status", status)
            trial.set_user_attr("row_key", list(key))
            for k, v in attrs.items():
                trial.set_user_attr(k, v)
            s.study.tell(trial, values if s.settings.multi_objective else values[0])
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another planner sharing the study took the same (enqueued) trial and finished
            # it first; our measurement stays in the probe cache.
            pass
    if status != "repeat":
        s.done.setdefault(
            key,
            {
                "values": values,
                "status": status,
                "violation": violation,
                "number": trial.number,
                "probe": attrs.get("probe"),
            },
        )


def cost_per_mtok_at(table: CandidateTable, i: int, step_s: float) -> float:
    """Training cost per million tokens of row i at a step time (price x nodes x step /
    tokens per step): what the pick is compared on, start-up and checkpoints aside."""
    return float(_cost(table, i, step_s) / table["tokens_per_step"][i] * 1e6)


def noise_model(settings: TuneSettings):
    from planner.tuning.noise import NoiseModel

    return NoiseModel(
        settings.repeat_sd,
        settings.load_inflation,
        settings.spread_ratio,
        settings.prior_sd,
        settings.confidence,
    )


def beliefs(
    table: CandidateTable,
    readings: dict[int, list],
    probed: dict[int, ProbeResult],
    rows: list[int],
    noise,
) -> dict:
    """Posterior log cost per million tokens of `rows` (planner.tuning.noise): every probe a
    reading, the model calibrated on all probes so far as the prior."""
    from planner.tuning.noise import belief, reading, within_variance

    prior: dict[int, float] = {}
    if noise.prior_sd > 0 and rows:
        modelled = calibrated_costs(table, np.array(rows, dtype=int), probed)
        for k, i in enumerate(rows):
            # invert cost_at_step: the calibrated step time behind the modelled job cost
            startup = table["hours"][i] - table["train_hours"][i] / table["useful_fraction"][i]
            seconds = money.seconds_for(
                price_per_node_hour=table["price_node_hour"][i],
                nodes=table["nodes"][i],
                money=modelled[k],
            )
            hours = seconds / money.SECONDS_PER_HOUR
            scale = (hours - startup) * table["useful_fraction"][i] / table["train_hours"][i]
            step = scale * table["step_time_s"][i]
            prior[i] = float(np.log(max(cost_per_mtok_at(table, i, step), 1e-300)))
    out = {}
    probes = {i: [r for r in readings.get(i) or [probed[i]] if r.ok] for i in rows}
    withins = [
        within_variance(r.step_times_s or [r.step_time_s]) for rs in probes.values() for r in rs
    ]
    pooled = float(np.median(withins)) if withins else 0.0
    for i in rows:
        obs = [
            reading(
                float(np.log(cost_per_mtok_at(table, i, r.step_time_s))),
                r.step_times_s or [r.step_time_s],
                under_load=r.under_load,
                noise=noise,
                pooled=pooled,
            )
            for r in probes[i]
        ]
        out[i] = belief(obs, prior.get(i), noise)
    return out


def _race(s: _Session, budget: int) -> tuple[Race | None, int]:
    """Noise-aware finish (planner.tuning.noise): while the pick is not cheaper than each of its
    closest contenders (`finalists` - 1 of them) with probability `confidence`, repeat the
    less certain of the pick and the weakest-separated contender with a longer probe; once
    separated, the probes left explore (the model and the sampler in turn). Stops when
    `budget` probes or the probe time are spent. Returns the race (None when fewer than two
    configurations were measured) and the repeats it ran."""
    settings, outcome = s.settings, s.outcome
    noise = noise_model(settings)
    steps = settings.race_steps or settings.steps
    contenders = (settings.finalists or (3 if budget >= 4 else 2)) - 1
    level = 2 * noise.confidence - 1  # two-sided: its interval excludes 0 when separated
    repeats = used = 0
    out: set[int] = set()  # failed when repeated

    def standing():
        return _standing(s, out, noise, level)

    b, order, seps = standing()
    if len(order) < 2 or budget <= 0:
        return None, 0
    while used < budget and outcome.probe_wall_s < settings.probe_time_s:
        pick = order[0]
        close = sorted(order[1:], key=lambda j: seps[j].probability)[: max(1, contenders)]
        weakest = close[0]
        if seps[weakest].probability >= noise.confidence:  # separated: explore the rest
            before = s.probes_run
            _explore(s, s.probes_run + 1)
            if s.probes_run == before:
                break  # nothing left to explore
            used += 1
        else:
            _repeat(s, pick if b[pick].var >= b[weakest].var else weakest, steps, out)
            used += 1
            repeats += 1
        b, order, seps = standing()
        if len(order) < 2:
            break
    if len(order) < 2:
        return None, repeats
    sep = seps[order[1]]
    race = Race(
        tuple(order[: max(2, contenders + 1)]),
        repeats,
        used,
        sep.probability >= noise.confidence,
        sep.difference,
        sep.interval,
        1 - sep.probability,
        sep.probability,
        level,
        b[order[0]].cost,
    )
    return race, repeats


def _standing(s: _Session, out: set[int], noise, level: float):
    """The race's standing: beliefs about every measured configuration within the budget and
    deadline (but those that failed when repeated), their order, and the pick's separation
    from each of the others."""
    from planner.tuning.noise import ranked, separation

    outcome, table = s.outcome, s.table
    rows = [
        i
        for i, r in outcome.probed.items()
        if i not in out and _within(s.spec, *measured_cost(table, i, r))
    ]
    b = beliefs(table, outcome.readings, outcome.probed, rows, noise)
    order = ranked(b)
    seps = {j: separation(b[order[0]], b[j], level) for j in order[1:]}
    return b, order, seps


def _repeat(s: _Session, i: int, steps: int, out: set[int]) -> None:
    """Probe configuration `i` again for `steps` steps and pool the reading with its earlier
    ones; one that fails now leaves the race (its earlier result stays in the study)."""
    outcome, table = s.outcome, s.table
    again = s.backend.run(candidate_plan(s.spec, table.row(i), target=s.target), steps=steps)
    outcome.probe_wall_s += again.wall_s
    if again.ok:
        outcome.readings.setdefault(i, [outcome.probed[i]]).append(again)
        outcome.probed[i] = outcome.probed[i].pooled_with(again)
        if s.progress is not None:
            s.progress(outcome.probed[i], table, i, False)
    else:
        out.add(i)


def _within(spec: Spec, cost: float, hours: float) -> bool:
    c = spec.constraints
    return (not c.budget or cost <= c.budget) and (
        not c.deadline_hours or hours <= c.deadline_hours
    )


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
        rows.append(
            {
                "trial": t.number,
                "status": a.get("status", t.state.name.lower()),
                "config": {k: v for k, v in t.params.items()},
                "modelled step s": round(modelled, 4) if modelled else None,
                "measured step s": round(measured, 4) if measured else None,
                "error %": round(100 * (modelled - measured) / measured, 1)
                if measured and modelled
                else None,
                "measured cost": a.get("measured_cost"),
            }
        )
    return rows
