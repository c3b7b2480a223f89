"""Planner: spec loading (table-driven bad specs), currency rules, infeasibility, price import,
and the CLI end to end on the embedded bank-FAQ spec."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import tomli
from conftest import REPO, merge, run_cli

from gptplan.plan import load_plan
from planner.market.hardware import load_profiles
from planner.market.offers import allowed_offers
from planner.market.prices import import_catalog
from planner.screen.decide import decide
from planner.screen.evaluate import evaluate_space
from planner.spec import EMBEDDED_SPEC, SpecError, spec_from_dict

BANK = tomli.loads(EMBEDDED_SPEC.read_text())

BAD_SPECS = [
    ("unknown-section", {"constrains": {}}, "constrains", "did you mean 'constraints'"),
    ("unknown-key", {"constraints": {"budjet": 5}}, "constraints.budjet", "unknown"),
    ("budget-string", {"constraints": {"budget": "12k"}}, "constraints.budget", "a number"),
    ("negative-budget", {"constraints": {"budget": -1}}, "constraints.budget", ">= 0"),
    ("bad-currency", {"constraints": {"currency": "yuan"}}, "constraints.currency", "ISO"),
    ("unknown-size", {"model": {"size": "gpt-huge"}}, "model.size", "allowed"),
    ("no-target", {"job": {"target_tokens": 0, "epochs": 0}}, "job.target_tokens", "epochs"),
    (
        "seq-too-long",
        {"constraints": {"seq_lens": [4096]}},
        "constraints.seq_lens",
        "max_position_embeddings",
    ),
    ("empty-seq", {"constraints": {"seq_lens": []}}, "constraints.seq_lens", "at least one"),
    (
        "bad-precision",
        {"constraints": {"precisions": ["int8"]}},
        "constraints.precisions",
        "allowed",
    ),
    (
        "batch-range-inverted",
        {"constraints": {"global_batch_tokens_min": 10, "global_batch_tokens_max": 5}},
        "constraints.global_batch_tokens_max",
        "below",
    ),
    (
        "bad-micro",
        {"search": {"micro_batch_sizes": [0, 2]}},
        "search.micro_batch_sizes",
        "positive",
    ),
    ("bad-stage", {"search": {"sharding": ["stage4"]}}, "search.sharding", "allowed"),
    ("bad-recompute", {"search": {"recompute": ["selective"]}}, "search.recompute", "allowed"),
    (
        "nothing-rentable",
        {"constraints": {"spot": False, "on_demand": False}},
        "constraints.spot",
        "nothing",
    ),
    ("bad-rate", {"rates": {"USD": -7}}, "rates.USD", "positive"),
    ("bad-rate-code", {"rates": {"dollar": 7}}, "rates.dollar", "ISO code"),
    (
        "headroom-range",
        {"constraints": {"memory_headroom": 1.5}},
        "constraints.memory_headroom",
        "<= 1.0",
    ),
    (
        "heads-vs-hidden",
        {"model": {"num_attention_heads": 7}},
        "model.num_attention_heads",
        "does not divide",
    ),
    ("list-type", {"constraints": {"seq_lens": 1024}}, "constraints.seq_lens", "a list"),
]


@pytest.mark.parametrize(
    "overrides,key,word", [b[1:] for b in BAD_SPECS], ids=[b[0] for b in BAD_SPECS]
)
def test_bad_spec_is_rejected(overrides, key, word):
    with pytest.raises(SpecError) as info:
        spec_from_dict(merge(BANK, overrides), file="spec.toml")
    message = str(info.value)
    assert message.startswith(f"spec.toml: {key}:"), message
    assert word in message, message


def small_spec(**overrides):
    """The bank-FAQ spec restricted to two cloud offers (fast to evaluate)."""
    return spec_from_dict(
        merge(BANK, merge({"constraints": {"profiles": ["a100-80gb", "t4"]}}, overrides)),
        file="spec.toml",
    )


def plan_for(spec):
    offers = allowed_offers(spec, load_profiles())
    table = evaluate_space(spec, offers, spec.job.target_tokens)
    return decide(spec, table, spec.job.target_tokens), table


def test_currency_needs_an_explicit_rate():
    no_rate = copy.deepcopy(BANK)
    del no_rate["rates"]
    spec = spec_from_dict(merge(no_rate, {"constraints": {"profiles": ["t4"]}}), file="s.toml")
    with pytest.raises(SpecError, match=r"rates\.USD.*CNY per USD"):
        allowed_offers(spec, load_profiles())


def test_costs_scale_exactly_with_the_rate():
    low, _ = plan_for(small_spec(rates={"USD": 1.0}, constraints={"budget": 0}))
    high, _ = plan_for(small_spec(rates={"USD": 7.0}, constraints={"budget": 0}))
    assert high.table["cost"] == pytest.approx(7.0 * low.table["cost"])


def test_chosen_is_cheapest_feasible_and_on_the_pareto_front():
    decision, table = plan_for(small_spec())
    assert decision.chosen is not None
    feasible = decision.feasible
    assert table["cost"][decision.chosen] == table["cost"][feasible].min()
    assert table["fits"][decision.chosen]
    assert (
        decision.chosen in set(decision.pareto.tolist())
        or table["cost"][decision.pareto[0]] == table["cost"][decision.chosen]
    )
    # the front is sorted by cost and strictly faster along it
    hours = table["hours"][decision.pareto]
    assert np.all(np.diff(hours) < 0)


def test_budget_too_small_says_what_it_buys_and_what_is_needed():
    decision, table = plan_for(small_spec(constraints={"budget": 10.0}))
    assert decision.chosen is None
    text = " ".join(decision.problems)
    assert "cannot reach" in text and "minimum budget for the target" in text
    cheapest = table["cost"][table["fits"]].min()
    assert f"{cheapest:,.0f} CNY" in text


def test_deadline_too_short_gives_fastest_plan():
    decision, _ = plan_for(small_spec(constraints={"deadline_hours": 0.5, "budget": 0}))
    assert decision.chosen is None
    assert "fastest plan takes" in " ".join(decision.problems)


def test_model_too_big_for_any_device():
    decision, _ = plan_for(
        small_spec(
            model={"size": "gpt-13b"},
            constraints={
                "profiles": ["t4"],
                "max_nodes": 1,
                "seq_lens": [1024],
                "global_batch_tokens_min": 0,
                "global_batch_tokens_max": 0,
            },
        )
    )
    assert decision.chosen is None
    assert "nothing fits in device memory" in decision.problems[0]


def test_memory_rules_hold_in_the_chosen_plan():
    decision, table = plan_for(small_spec())
    row = table.row(decision.chosen)
    prof = row["offer_choice"].profile
    assert row["memory_gb"] <= prof.memory_gb * 0.9
    assert row["world"] == row["dp"] * row["tp"] * row["pp"] * row["shard_degree"]
    assert 131072 <= row["tokens_per_step"] <= 524288


CSV = (
    "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,"
    "AvailabilityZone\n"
    """p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,x,40.97,7.1,us-east-1,us-east-1a
p4de.24xlarge,A100-80GB,8.0,96.0,1152.0,x,41.50,6.2,us-west-2,us-west-2b
g4dn.xlarge,T4,1.0,4.0,16.0,x,0.526,,us-east-1,us-east-1a
m5.large,,,2.0,8.0,,0.096,0.04,us-east-1,us-east-1a
weird.1x,TPU-v9,1.0,4.0,16.0,x,9.0,1.0,us-east-1,us-east-1a
"""
)


def test_prices_import(tmp_path):
    csv_file = tmp_path / "aws_catalog.csv"
    csv_file.write_text(CSV)
    profiles_dir = tmp_path / "profiles"
    out, count, skipped, _ = import_catalog(csv_file, as_of="2025-06-01", directory=profiles_dir)
    assert count == 3 and len(skipped) == 2  # one row per instance and region
    offers = {(o["instance"], o["region"]): o for o in tomli.loads(out.read_text())["offers"]}
    p4de = offers["p4de.24xlarge", "us-west-2"]
    assert (p4de["profile"], p4de["provider"], p4de["gpus_per_node"]) == ("a100-80gb", "aws", 8)
    assert p4de["on_demand_per_hour"] == 41.50 and p4de["spot_per_hour"] == 6.2  # one region
    assert offers["g4dn.xlarge", "us-east-1"]["spot_per_hour"] == 0.0  # no spot price given
    bad = tmp_path / "bad.csv"
    bad.write_text("InstanceType,Price\nx,1\n")
    with pytest.raises(Exception, match="missing column"):
        import_catalog(bad, as_of="2025-06-01", directory=profiles_dir)


@pytest.fixture(scope="module")
def optimized(bank_optimized):
    """`planner optimize --budget 12000` from a fresh directory: the README's first command
    (conftest's, shared with test_cost_truth.py)."""
    return bank_optimized


def test_optimize_bank_faq_end_to_end(optimized):
    work, proc = optimized
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())  # console lines wrap at 120 columns
    # the sample trains fewer pieces than the planned 30,000: extrapolated, with its range
    assert "tokens per character" in out and "(extrapolated, 80% range" in out
    assert "modelled" in out and "Best plan per offer" in out
    # 50B tokens on ~10 GB of text repeat it about 18 times: warned, in fresh-data terms
    assert "Muennighoff" in out and "fresh tokens" in out
    assert "data preparation" in out and "MB/s per core" in out
    plan = load_plan(work / "plans" / "bank_faq.toml")
    assert plan.estimate.source == "model" and plan.estimate.cost <= 12000
    assert plan.budget.currency == plan.hardware.currency == "CNY"
    assert plan.training.max_steps * plan.tokens_per_step >= 50e9
    assert plan.provenance.spec == "embedded:bank_faq"
    assert (work / "pareto.png").stat().st_size > 10_000
    text = (work / "plans" / "bank_faq.toml").read_text()
    assert str(REPO) not in text  # no machine paths in plans


def test_no_console_line_of_optimize_is_wider_than_120_columns(optimized):
    _, proc = optimized
    wide = [line for line in proc.stdout.splitlines() if len(line) > 120]
    assert not wide, wide[:3]


def test_plan_vocab_is_the_asked_size(optimized):
    work, _ = optimized
    plan = load_plan(work / "plans" / "bank_faq.toml")
    assert plan.job.tokenizer_vocab_size == 30000  # what the runner trains the tokenizer to
    assert plan.model.vocab_size == 30000  # the chosen tp divides it: no padding
    assert plan.job.tokens_per_char_source == "extrapolated"
    assert plan.job.tokens_per_char_p10 < plan.job.tokens_per_char < plan.job.tokens_per_char_p90


def test_estimate_of_the_written_plan_agrees(optimized):
    work, _ = optimized
    proc = run_cli("planner", "estimate", "--plan", "plans/bank_faq.toml", "--json", cwd=work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    # it says what it evaluated: the plan's one configuration, not "the whole space"
    assert data["evaluated"].startswith("evaluated 1 configuration(s): the plan's own")
    assert "whole space" not in data["binding"]
    plan = load_plan(work / "plans" / "bank_faq.toml")
    assert data["chosen"]["modelled_cost_cny"] == pytest.approx(plan.estimate.cost, rel=1e-3, abs=1)


def test_explain_accepts_the_plan_and_dry_run_refuses_its_sample_corpus(optimized):
    work, _ = optimized
    proc = run_cli("planner", "explain", "plans/bank_faq.toml", cwd=work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "AMP memory" in proc.stdout and "7 days" in proc.stdout
    assert "Muennighoff" in proc.stdout
    claims = json.loads(
        run_cli("planner", "explain", "plans/bank_faq.toml", "--json", cwd=work).stdout
    )["claims"]
    for claim in claims:  # every verdict carries the rule it was judged by
        assert claim["tolerance"], claim
    spot = next(c for c in claims if c["claim"] == "spot price")
    ratio = float(spot["model"].split("%")[0]) / 100
    assert (spot["verdict"] == "holds") == (0.2 <= ratio <= 0.4), spot
    # the plan records the declared 10 GB corpus; job.corpus is still the 1 MB sample
    plan = load_plan(work / "plans" / "bank_faq.toml")
    assert plan.job.corpus_bytes == 10e9 and plan.job.corpus_tokens_source == "extrapolated"
    assert plan.job.planned_epochs == pytest.approx(
        plan.training.max_steps * plan.tokens_per_step / plan.job.corpus_tokens, rel=1e-4
    )
    dry = run_cli("runner", "execute", "plans/bank_faq.toml", "--dry-run", cwd=work)
    assert dry.returncode == 2, dry.stderr[-2000:]
    assert "dry run OK" not in dry.stdout and "runner.paddle_launch" in dry.stdout
    assert "dry run FAILED" in dry.stderr and "job.corpus" in dry.stderr


def test_optimize_impossible_budget_exits_1_without_plan(tmp_path):
    proc = run_cli("planner", "optimize", "--budget", "1", "--hardware", "t4", cwd=tmp_path)
    assert proc.returncode == 1
    assert "NO PLAN" in proc.stdout and "minimum budget" in proc.stdout
    assert not (tmp_path / "plans").exists()


def test_optimize_bad_spec_file_exit_2(tmp_path):
    (tmp_path / "planner.toml").write_text("[job]\nname = 'x'\n[constraints]\nbudjet = 3\n")
    proc = run_cli("planner", "optimize", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: planner.toml: constraints.budjet: unknown key "
        "(did you mean 'budget'?); allowed: " + proc.stderr.split("allowed: ")[1].strip()
    )
    assert "Traceback" not in proc.stderr


def test_spec_lookup_order(tmp_path):
    from planner.spec import load_spec

    assert load_spec(cwd=tmp_path).path == "embedded:bank_faq"
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[tool.planner.job]\nname = "from_pyproject"\n'
        'target_tokens = 1e9\n[tool.planner.model]\nsize = "gpt-tiny"\n'
        "[tool.planner.constraints]\nseq_lens = [128]\n"
    )
    spec = load_spec(cwd=tmp_path)
    assert spec.job.name == "from_pyproject" and spec.path.endswith("[tool.planner]")
    (tmp_path / "planner.toml").write_text(
        '[job]\nname = "from_file"\ntarget_tokens = 1e9\n'
        '[model]\nsize = "gpt-tiny"\n'
        "[constraints]\nseq_lens = [128]\n"
    )
    assert load_spec(cwd=tmp_path).job.name == "from_file"
    overridden = load_spec(cwd=tmp_path, overrides={"constraints.budget": 5.0})
    assert overridden.constraints.budget == 5.0


def test_optimize_json_has_snake_case_unit_keys_and_raw_numbers(bank_optimized_json):
    import re

    proc = bank_optimized_json  # --json --out j.toml after `optimized`, in its folder
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    records = data["candidates"] + data["per_offer"] + data["pareto"] + [data["chosen"]]
    for record in records:
        for key, value in record.items():
            assert re.fullmatch(r"[a-z0-9_]+", key), key
            if key.startswith(("modelled_", "measured_", "calibrated_")) and value is not None:
                assert isinstance(value, (int, float)), (key, value)
    chosen = data["chosen"]
    assert chosen["chosen"] is True and chosen["modelled_cost_cny"] > 100  # raw, not rounded
    assert chosen["modelled_cost_cny"] != round(chosen["modelled_cost_cny"], 4)
    # near-identical rows (fp16/bf16 x ZeRO stages at the same cost and time) are folded
    assert data["candidates_folded_as_identical_under_the_model"] > 0
    folded = [r for r in data["candidates"] if r.get("identical_under_the_model")]
    assert folded and all(r["seq_len"] for r in folded)


def test_candidate_table_shows_one_row_per_distinct_decision(optimized):
    _, proc = optimized
    out = proc.stdout
    table = out[out.index("Top ") : out.index("chosen:")]
    rows = [line.split() for line in table.splitlines() if "@" in line]
    assert rows and "fp16/bf16" in table  # precisions the model cannot tell apart share a row
    shown = [tuple(r[-8:-4]) for r in rows]  # offer, capacity, nodes, precision, layout
    decisions = [tuple(r[1 if r[0] == "*" else 0 :][:5]) for r in rows]
    assert len(set(decisions)) == len(decisions) and shown


def test_statistics_come_before_the_search_and_one_chosen_line(optimized):
    _, proc = optimized
    out = proc.stdout
    assert out.index("tokens per character") < out.index("Top ")
    assert out.count("chosen:") == 1


def test_cpu_offers_no_bf16_candidate():
    from planner.spec import load_spec

    spec = load_spec(
        None,
        overrides={"constraints.profiles": ["cpu"], "constraints.precisions": ["fp32", "bf16"]},
    )
    offers = allowed_offers(spec, load_profiles())
    assert offers and all(o.profile.precisions == ["fp32"] for o in offers)


def test_fast_ranking_and_accumulations_equal_the_plain_ones():
    """The search's speed-ups change no result: the cached cost order ranks every mask like a
    fresh two-key sort (ties in cost are common: spot and on-demand rows), the 1-D unique of
    accumulation pairs equals np.unique over the stacked pairs, and evaluate_offer (parts
    joined) equals evaluate_space's rows of that offer."""
    from planner.screen.decide import ranked
    from planner.screen.evaluate import evaluate_offer
    from planner.screen.space import _accumulations

    spec = small_spec()
    offers = allowed_offers(spec, load_profiles())[:3]
    table = evaluate_space(spec, offers, 1e9)
    rng = np.random.default_rng(0)
    for mask in (table["fits"], rng.random(len(table)) < 0.3, np.ones(len(table), bool)):
        idx = np.flatnonzero(mask)
        plain = idx[np.lexsort((table["hours"][idx], table["cost"][idx]))]
        assert np.array_equal(ranked(table, mask), plain)
    lo = rng.integers(1, 6, 500)
    hi = lo + rng.integers(-1, 40, 500)
    pp = rng.choice([1, 2, 4], 500)
    rows, acc = _accumulations(lo, hi, pp)
    ok = hi >= lo
    mult = (hi // np.maximum(pp, 1)) * pp
    cands = [lo, hi, np.where((pp > 1) & (mult >= lo), mult, lo)]
    r = np.concatenate([np.flatnonzero(ok)] * 3)
    v = np.concatenate([c[ok] for c in cands])
    pairs = np.unique(np.stack([r, v]), axis=1)
    assert np.array_equal(rows, pairs[0]) and np.array_equal(acc, pairs[1])
    one = evaluate_offer(spec, offers[1], 1, 1e9)
    mine = table["offer"] == 1
    for k in ("cost", "hours", "micro", "acc", "spot", "memory_gb"):
        assert np.array_equal(one[k], table[k][mine])
