"""Bad input gets one line naming the file/key/flag, exit 2, no traceback, nothing written
(issue 10's listed cases; the property test covers random mutations)."""

from __future__ import annotations

import math

import pytest
import tomli_w
from conftest import BASE_PLAN, call_main, merge

call = call_main


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"budget": {"max_cost": math.inf}}, "budget.max_cost"),
        ({"budget": {"max_hours": math.inf}}, "budget.max_hours"),
        ({"hardware": {"price_per_node_hour": math.inf}}, "hardware.price_per_node_hour"),
        ({"training": {"learning_rate": math.inf}}, "training.learning_rate"),
        ({"model": {"num_hidden_layers": 10**18}}, "model.num_hidden_layers"),
        ({"model": {"max_position_embeddings": 10**18}}, "model.max_position_embeddings"),
        (
            {
                "model": {
                    "hidden_size": 65536,
                    "num_attention_heads": 64,
                    "intermediate_size": 262144,
                    "num_hidden_layers": 9000,
                }
            },
            "model",
        ),
        ({"job": {"cache_dir": "a\x00b"}}, "job.cache_dir"),
        ({"name": "has space"}, "name"),
        ({"name": "../x"}, "name"),
        ({"hardware": {"currency": "dollars"}}, "hardware.currency"),
        # checked after loading (runner.preflight), still named with the plan's file
        ({"parallel": {"master": "has space"}}, "parallel.master"),
    ],
)
def test_bad_plan_values_are_one_line_exit_2(tmp_path, shared_cache, overrides, key):
    from runner.cli import main

    data = merge(
        BASE_PLAN, {"job": {"cache_dir": str(shared_cache), "output_dir": str(tmp_path / "run")}}
    )
    plan = tmp_path / "plan.toml"
    plan.write_text(tomli_w.dumps(merge(data, overrides)))
    rc, _, lines = call(main, ["execute", str(plan), "--dry-run"])
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {plan}: {key}"), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.toml"]


def test_output_dir_that_is_a_file_is_refused_in_dry_run_too(tmp_path, shared_cache):
    from runner.cli import main

    (tmp_path / "afile").write_text("x")
    plan = tmp_path / "plan.toml"
    plan.write_text(
        tomli_w.dumps(
            merge(
                BASE_PLAN,
                {
                    "job": {
                        "cache_dir": str(shared_cache),
                        "output_dir": str(tmp_path / "afile" / "run"),
                    }
                },
            )
        )
    )
    rc, _, lines = call(main, ["execute", str(plan), "--dry-run"])
    assert rc == 2 and "job.output_dir" in lines[0] and "existing file" in lines[0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["execute", "plans/cpu_tiny_dp2.toml", "--max-steps", "abc"], "--max-steps"),
        (["execute", "plans/cpu_tiny_dp2.toml", "--node-rank", "5"], "--node-rank"),
    ],
)
def test_runner_flags_one_line(argv, needle):
    from runner.cli import main

    rc, _, lines = call(main, argv)
    assert rc == 2 and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["estimate", "--budget", "abc"], "--budget"),
        (["estimate", "--budget", "-1"], "--budget"),
        (["estimate", "--budget", "inf"], "--budget"),
        (["estimate", "--hardware", ","], "--hardware"),
        (["optimize", "--out", "."], "--out"),
    ],
)
def test_planner_flags_one_line(argv, needle):
    from planner.commands.main import main

    rc, _, lines = call(main, argv)
    assert (
        rc == 2
        and len(lines) == 1
        and lines[0].startswith(f"error: {needle}")
        or needle in lines[0]
    ), lines


def test_duplicate_key_is_named(tmp_path):
    from runner.cli import main

    plan = tmp_path / "plan.toml"
    plan.write_text('schema = 1\nname = "a"\n[training]\nseq_len = 8\nseq_len = 16\n')
    rc, _, lines = call(main, ["execute", str(plan), "--dry-run"])
    assert rc == 2 and "'seq_len' is given twice" in lines[0]


CSV_HEAD = "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region\n"


def test_price_import_validates_rows_and_names(tmp_path):
    from planner.market.hardware import ProfileError
    from planner.market.prices import import_catalog

    csv = tmp_path / "aws.csv"
    csv.write_text(
        CSV_HEAD + "p4d,A100,8,32.7,-1,us\n"  # negative spot: row skipped
        "g5,A10G,0,1.0,0.5,us\n"  # zero accelerators
        "p5,H100,8,nan,inf,us\n"  # NaN / inf
        "p3,V100,4,12.2,3.7,us\n"
    )  # the one good row
    out, count, skipped, _ = import_catalog(csv, as_of="2026-12-01", directory=tmp_path)
    assert count == 1 and len(skipped) == 3
    assert "nan" not in out.read_text() and "inf" not in out.read_text()
    for name in ("../../x", "", "a b"):
        with pytest.raises(ProfileError, match="not a valid name"):
            import_catalog(csv, name=name, as_of="2026-12-01", directory=tmp_path)
    with pytest.raises(ProfileError, match="is a directory"):
        import_catalog(tmp_path, as_of="2026-12-01", directory=tmp_path)
    assert sorted(p.name for p in (tmp_path / "offers").iterdir()) == ["aws.toml"]


def test_planner_corpus_errors_name_the_spec_and_tiny_corpus_is_refused(tmp_path):
    from planner.commands.main import main

    (tmp_path / "tiny.txt").write_text("abcd\n")
    for corpus, needle in (
        ("missing*.txt", "matches no file"),
        ("tiny.txt", "fewer than one training sample"),
    ):
        spec = tmp_path / "spec.toml"
        spec.write_text(
            tomli_w.dumps(
                {
                    "job": {
                        "name": "tiny",
                        "corpus": [str(tmp_path / corpus)],
                        "epochs": 1.0,
                        "cache_dir": str(tmp_path / "cache"),
                    },
                    "model": {"size": "gpt-tiny"},
                    "constraints": {"profiles": ["cpu"], "seq_lens": [64]},
                }
            )
        )
        rc, _, lines = call(main, ["estimate", "--spec", str(spec)])
        assert rc == 2 and len(lines) == 1, lines
        assert "spec.toml: job.corpus" in lines[0] and needle in lines[0], lines[0]


def test_in_process_runner_gives_back_the_callers_signal_mask(tmp_path):
    """runner.cli.main blocks SIGTERM/SIGINT during start-up; an in-process caller must get its
    mask and handlers back, or a worker pool it starts later inherits the block and
    Pool.terminate() waits forever (seen: the test suite hung in test_data's fixture)."""
    import signal

    from runner import cli

    bad = tmp_path / "bad.toml"
    bad.write_text("schema = 1\nnot_a_section = 1\n")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handler = signal.getsignal(signal.SIGTERM)
    assert cli.main(["execute", str(bad), "--dry-run"]) == 2
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    assert signal.getsignal(signal.SIGTERM) is handler


def test_planner_refuses_a_plan_the_runner_would_refuse(tmp_path, monkeypatch):
    """One validation (issue 39): the plan the planner writes is read back through the code
    that loads it in `runner execute` (every key's type and range); a spec whose values break
    it is refused, exit 2, one line, nothing written."""
    from conftest import REPO

    from planner.commands.main import main

    spec = (REPO / "planner" / "specs" / "cpu_demo.toml").read_text()
    spec = spec.replace('size = "gpt-tiny"', 'size = "gpt-tiny"\nintermediate_size = 3', 1)
    (tmp_path / "tiny_ffn.toml").write_text(spec)
    monkeypatch.chdir(tmp_path)
    rc, out, err = call_main(main, ["optimize", "--spec", "tiny_ffn.toml", "--out", "p.toml"])
    assert rc == 2, (out[-2000:], err)
    assert len(err) == 1 and err[0].startswith("error: tiny_ffn.toml: model.intermediate_size:")
    assert ">= 8" in err[0] and "Traceback" not in out
    assert not (tmp_path / "p.toml").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "tiny_ffn.toml"] == [], "half-written"


def test_schema_true_is_not_schema_1():
    """`schema = true` is no schema version (a bool is an int in Python; issue 39)."""
    from gptplan.errors import PlanError
    from gptplan.plan import plan_from_dict

    with pytest.raises(PlanError, match="True is not a supported schema version"):
        plan_from_dict(merge(BASE_PLAN, {"schema": True}))
    plan_from_dict(merge(BASE_PLAN, {"schema": 1}))
