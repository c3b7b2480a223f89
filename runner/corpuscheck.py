"""Before anything is launched: is the corpus found the corpus the plan was made for?

A plan records the corpus as planned (gptplan.plan.JobSection: corpus_tokens, planned_epochs,
measured on `corpus_sample`). A spec may declare a 10 GB corpus and measure it on a 1 MB
sample; a plan that still points at the sample would loop it thousands of times on rented
machines. `corpus_check` compares the tokens prepared from `job.corpus` with the plan's record:
a full run that would repeat the corpus more than `TOLERANCE` times as often as planned is
refused (exit 2, one line saying how to point job.corpus at the real data); a rehearsal
(--local, --max-steps) goes on with a warning; a dry run reports it as its failure.

A plan without the record (written by hand, or before these fields existed) says nothing of
what was planned, so it is never refused: beyond `UNRECORDED_MAX_EPOCHS` (about where repeated
data stops being worth anything, Muennighoff et al. 2023, R* = 15.4 repetitions) every kind of
run gets the warning line and goes on; stating `job.planned_epochs` silences it.
"""

from __future__ import annotations

from pathlib import Path

from gptplan.errors import DataError
from gptplan.plan import Plan
from gptplan.progress import Log

TOLERANCE = 2.0  # found epochs may exceed the planned ones by this factor
UNRECORDED_MAX_EPOCHS = 16.0


def _tokens(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:,.3g}{unit}"
    return f"{n:,.0f}"


def _times(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def corpus_check(plan: Plan, found_tokens: int) -> str | None:
    """None when `plan` trains about as many epochs on `found_tokens` as planned, else the
    problem in one line (planned vs found tokens and epochs, and what to do)."""
    job = plan.job
    trained = plan.training.max_steps * plan.tokens_per_step
    found_epochs = trained / max(1, found_tokens)
    planned = job.planned_epochs or (trained / job.corpus_tokens if job.corpus_tokens else 0.0)
    allowed = planned * TOLERANCE if planned else UNRECORDED_MAX_EPOCHS
    if found_epochs <= allowed:
        return None
    corpus = ", ".join(job.corpus)
    if planned:
        declared = f", {job.corpus_bytes / 1e9:,.3g} GB" if job.corpus_bytes else ""
        sample = f" from {', '.join(job.corpus_sample)}" if job.corpus_sample else ""
        expected = (
            f"the plan expects a corpus of {_tokens(job.corpus_tokens)} tokens"
            f"{declared} ({job.corpus_tokens_source or 'recorded'}{sample}) and "
            f"{_times(planned)} epochs"
        )
    else:
        expected = (
            f"the plan records no planned corpus (job.planned_epochs), and more than "
            f"{UNRECORDED_MAX_EPOCHS:g} epochs add almost nothing (Muennighoff 2023)"
        )
    return (
        f"{corpus} holds {found_tokens:,} tokens (measured), so {plan.training.max_steps:,} "
        f"steps x {plan.tokens_per_step:,} tokens would repeat it {_times(found_epochs)} "
        f"times; {expected}. Point job.corpus at the full corpus (edit the plan, or --set "
        "'job.corpus=[\"/data/corpus/*.txt\"]'; on SkyPilot: planner launch-file "
        "--corpus-bucket), or rehearse with --local or --max-steps"
    )


def check_before_launch(
    plan: Plan,
    found_tokens: int,
    *,
    plan_file: Path,
    rehearsal: bool,
    dry_run: bool,
    log: Log = print,
) -> str | None:
    """Apply `corpus_check`: raise (a full run), warn (a rehearsal), or return the problem for
    the dry run to report as its failure; None when the corpus is the planned one."""
    problem = corpus_check(plan, found_tokens)
    if problem is None:
        return None
    if not (plan.job.planned_epochs or plan.job.corpus_tokens):
        log(f"warning: job.corpus: {problem}. Going on: the plan records no planned corpus")
        return None
    if rehearsal:
        log(f"warning: job.corpus: {problem}. Going on: this is a rehearsal")
        return None
    if dry_run:
        return problem
    raise DataError(problem, file=str(plan_file), key="job.corpus")
