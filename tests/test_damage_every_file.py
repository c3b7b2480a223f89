"""Every file kind the runner writes, damaged (issue 29): the command that reads it ends in one
line or recovers, never a traceback, and no checkpoint is lost (a damaged one is moved into
`damaged/`, never deleted).

The kinds are enumerated from a finished shared run (tests/conftest.py `finished_run`), not
sampled: every file of its run directory and of the cache, with step numbers, attempt numbers
and cache keys folded into one kind each. Each kind is damaged in a copy (50 seeded random
bytes written over its middle: the damage a size check cannot see; cut and deleted files are
tests/test_runner_faults.py's property), then the command that reads it runs in this process
(no training: `runner export` for checkpoints, the tokenizer copy and the effective plan; a
finished run's `runner execute` for the rest; `runner execute --dry-run` for the cache). The
cache kinds are damaged in a copy of a small cache of the same kinds (400 documents), so that
rebuilding a tokenizer or a tokenized corpus takes a second, not the shared corpus's minutes.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import tomli_w
from conftest import BASE_PLAN, merge, run_main

pytestmark = pytest.mark.e2e

# what reads each kind (no training in this process): the export reads the checkpoints, the
# run's tokenizer copy and its effective plan; a finished run's `runner execute` the rest
EXPORT_READS = ("checkpoints/", "tokenizer/", "plan.toml")


def kind_of(relative: str) -> str:
    """A file's kind: its path with step/attempt numbers, cache keys and times folded."""
    kind = re.sub(r"step_\d{8}", "step_N", relative)
    kind = re.sub(r"attempt_\d+", "attempt_N", kind)
    kind = re.sub(r"(data|tokenizers)/[0-9a-f][0-9a-zA-Z-]+", r"\1/KEY", kind)
    return re.sub(r"\.\d{6,}\.", ".N.", kind)  # visualdl/vdlrecords.<time>.log


def kinds(root: Path) -> dict[str, Path]:
    """kind -> one file of that kind under `root` (the newest checkpoint's, where several)."""
    out: dict[str, Path] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        out[kind_of(str(path.relative_to(root)))] = path  # sorted: the newest step wins
    return out


def garble(path: Path, seed: int) -> None:
    raw = bytearray(path.read_bytes())
    junk = random.Random(seed).randbytes(50)
    at = max(0, len(raw) // 2 - 25)
    raw[at : at + 50] = junk
    path.write_bytes(bytes(raw))


def run_runner(*argv: str) -> tuple[int, str, str]:
    from runner.cli import main

    return run_main(main, argv)


def one_line_or_recovery(what: str, rc: int, out: str, err: str) -> None:
    assert "Traceback" not in err and "Traceback" not in out, (what, err[-3000:])
    lines = [x for x in err.splitlines() if x.strip() and "Warning" not in x and "warn(" not in x]
    assert rc == 0 or (rc in (1, 2) and len(lines) == 1 and lines[0].startswith("error:")), (
        what,
        rc,
        out[-2000:],
        err[-3000:],
    )


def checkpoints_of(run: Path) -> set[str]:
    """Step folders in checkpoints/ and in checkpoints/damaged/ (moved aside, kept)."""
    root = run / "checkpoints"
    here = {p.name for p in root.glob("step_*")} if root.is_dir() else set()
    aside = {p.name.split(".")[0] for p in (root / "damaged").glob("step_*")}
    return here | aside


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    """A cache of the test plan on 400 documents, prepared once: (plan data, cache)."""
    from runner.prepare import prepare_data

    root = tmp_path_factory.mktemp("small-cache")
    data = merge(
        BASE_PLAN,
        {
            "job": {
                "max_documents": 400,
                "cache_dir": str(root / "cache"),
                "output_dir": str(root / "run"),
            },
            "model": {"vocab_size": 2000},
        },
    )
    from gptplan.plan import plan_from_dict

    prepare_data(plan_from_dict(data), workers=1, log=lambda *_: None, progress=False)
    return data, root / "cache"


def test_every_run_file_kind_damaged_is_one_line_or_recovery(finished_run, shared_cache, tmp_path):
    run, _ = finished_run("gpt")
    plan_file = run.parent / "plan.toml"
    found = kinds(run)
    assert {"checkpoints/step_N/state.json", "tokenizer/special_tokens_map.json"} <= set(found)
    for index, (kind, original) in enumerate(sorted(found.items())):
        if kind == "runner.lock":
            continue  # never read: flock on the open file, its text is for people
        copy = tmp_path / f"run{index}"
        shutil.copytree(run, copy)
        before = checkpoints_of(copy)
        garble(copy / original.relative_to(run), seed=index)
        if kind.startswith(EXPORT_READS):
            rc, out, err = run_runner("export", str(copy))
            one_line_or_recovery(f"{kind}: export", rc, out, err)
            if rc != 0:
                assert kind == "plan.toml", (kind, err)  # the run's effective plan: one line
        else:  # a finished run's execute: nothing is trained
            rc, out, err = run_runner("execute", str(plan_file), "--output-dir", str(copy))
            one_line_or_recovery(f"{kind}: execute", rc, out, err)
            assert rc == 0, (kind, err[-2000:])
        assert checkpoints_of(copy) == before, kind  # no checkpoint lost
        shutil.rmtree(copy)


def test_every_cache_file_kind_damaged_is_rebuilt(
    shared_cache, finished_run, small_cache, tmp_path, monkeypatch
):
    from runner import prepare

    monkeypatch.setattr(prepare, "default_workers", lambda: 1)  # no worker start-up
    finished_run("gpt")  # the shared cache is filled
    data, cache = small_cache
    shared = kinds(shared_cache)
    # what the small cache's own preparation does not write (a launch's start-up record, the
    # measured preparation rate of a pooled run, the planner's corpus statistics) comes from
    # the shared cache, so every kind is damaged here
    for kind in set(shared) - set(kinds(cache)):
        target = cache / shared[kind].relative_to(shared_cache)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shared[kind], target)
    small = kinds(cache)
    assert set(small) == set(shared) and shared, (sorted(shared), sorted(small))
    for index, (kind, original) in enumerate(sorted(small.items())):
        copy = tmp_path / f"cache{index}"
        shutil.copytree(cache, copy)
        garble(copy / original.relative_to(cache), seed=index)
        plan = tmp_path / f"plan{index}.toml"
        plan.write_text(tomli_w.dumps(merge(data, {"job": {"cache_dir": str(copy)}})))
        rc, out, err = run_runner("execute", str(plan), "--dry-run")
        one_line_or_recovery(kind, rc, out, err)
        assert rc == 0, (kind, err[-2000:])  # derived data: always rebuilt
        shutil.rmtree(copy)


def test_garbled_tokenizer_copy_is_repaired_and_the_export_happens(finished_run, tmp_path):
    """The issue's case: 50 random bytes in the run's tokenizer/special_tokens_map.json, the
    export after training not done; every rerun crashed with a UnicodeDecodeError traceback.
    Now the copy is checked against its checksums, saved again from the cache (one line) and
    the export happens."""
    run, _ = finished_run("gpt")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    garble(copy / "tokenizer" / "special_tokens_map.json", seed=29)
    shutil.rmtree(copy / "export")
    rc, out, err = run_runner("execute", str(run.parent / "plan.toml"), "--output-dir", str(copy))
    one_line_or_recovery("special_tokens_map.json", rc, out, err)
    assert rc == 0, err[-3000:]
    assert "special_tokens_map.json does not match its checksum" in out
    assert "saved again from the tokenizer cache" in out and "retried" in out
    assert (copy / "export" / "paddlenlp" / "special_tokens_map.json").is_file()
    assert list((copy / "damaged").glob("tokenizer.*"))  # the damaged copy is kept


# ---- the user data directory (issue 39) --------------------------------------------------------

DAMAGES = ("garbled", "folder")


def damage(path: Path, how: str, seed: int) -> None:
    """`garbled`: 50 random bytes over its middle (not UTF-8 any more); `folder`: a folder
    (holding a file) in its place."""
    if how == "garbled":
        garble(path, seed)
        return
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("x")


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    """A user data directory as `planner optimize` leaves it (corpus statistics, the tokenizer
    it trained), with the runner's records the planner reads too (the measured preparation
    rate, start-up times): (data dir, work dir)."""
    from conftest import REPO, run_cli

    root = tmp_path_factory.mktemp("user-data")
    data, work = root / "data", root / "work"
    work.mkdir()
    spec = (REPO / "planner" / "specs" / "cpu_demo.toml").read_text()
    (work / "spec.toml").write_text(
        spec.replace("sample_documents = 2000", "sample_documents = 600")
    )
    proc = run_cli(
        "planner", "optimize", "--spec", "spec.toml", "--out", "p.toml",
        cwd=work, env={"GPTPLAN_DATA_DIR": str(data)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = {"bytes_per_second_per_core": 2.0e6, "bytes": 2e6, "workers": 1, "cpus": 1}
    (data / "cache" / "prep_throughput.json").write_text(
        json.dumps({"sentencepiece": record | {"measured_at": "2026-01-01T00:00:00Z"}})
    )
    (data / "cache" / "startup_seconds.json").write_text(
        json.dumps({"cpu:1x1:gpt:1": {"slowest_s": 5.0, "measured_at": "2026-01-01T00:00:00Z"}})
    )
    return data, work


def user_kind_of(relative: str) -> str:
    return re.sub(r"(stats|tokenizers)/[0-9a-zA-Z-]+", r"\1/KEY", relative)


def test_every_user_data_file_kind_damaged_is_one_line_or_recovery(
    user_data, tmp_path, monkeypatch
):
    """Every file kind of the user data directory, garbled or a folder in its place: the
    planner (which reads them all) recovers (measures again, one line says what was moved
    aside) or says one line; never a traceback."""
    from planner.commands.main import main

    data, work = user_data
    found: dict[str, Path] = {}
    for path in sorted(p for p in data.rglob("*") if p.is_file()):
        found[user_kind_of(str(path.relative_to(data)))] = path
    assert {"cache/stats/KEY.json", "cache/prep_throughput.json"} <= set(found), sorted(found)
    monkeypatch.chdir(work)
    for index, (kind, original) in enumerate(sorted(found.items())):
        for how in DAMAGES:
            copy = tmp_path / f"data{index}-{how}"
            shutil.copytree(data, copy)
            damage(copy / original.relative_to(data), how, seed=index)
            monkeypatch.setenv("GPTPLAN_DATA_DIR", str(copy))
            rc, out, err = run_main(main, ["optimize", "--spec", "spec.toml", "--out", "q.toml"])
            one_line_or_recovery(f"{kind} ({how})", rc, out, err)
            assert rc == 0, (kind, how, err[-2000:])
            shutil.rmtree(copy)
