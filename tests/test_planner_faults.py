"""The planner under faults (issue 20): a damaged study or probe cache is checked at open
(moved aside and rebuilt / skipped and reported, never a traceback), and a planner stopped by
SIGKILL, SIGTERM or SIGINT leaves no RUNNING trial after an immediate rerun; SIGTERM/SIGINT
end its probes and print one line, exit 143/130."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from test_autotune import CPU_SPEC, ScriptedProbe, cpu_space

from planner.tuning.autotune import TuneSettings, tune
from planner.tuning.probes import ProbeCache, ProbeResult


def run_tune(work: Path, probes: int, calls: list, cache: Path, events: list | None = None):
    spec, table, _, rows, target = cpu_space()
    settings = TuneSettings(probes=probes, trials=300, seed=0)
    extra = (
        {}
        if events is None
        else {
            "log": lambda line: events.append(("log", line)),
            "progress": lambda result, *_: events.append(("probe", result.key)),
        }
    )
    return tune(
        spec,
        table,
        rows,
        target=target,
        work_dir=work,
        settings=settings,
        backend=ScriptedProbe(calls),
        cache=ProbeCache(cache),
        **extra,
    )


def study_states(url: str) -> list[str]:
    import optuna

    (summary,) = optuna.get_all_study_summaries(storage=url)
    study = optuna.load_study(study_name=summary.study_name, storage=url)
    return [t.state.name for t in study.get_trials()]


# ---- a damaged study or probe cache --------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate", "garble", "folder"])
def test_damaged_study_is_moved_aside_and_rebuilt_from_the_probe_cache(tmp_path, damage):
    calls: list = []
    first = run_tune(tmp_path, 3, calls, tmp_path / "probes.jsonl")
    db = tmp_path / "study.db"
    size = db.stat().st_size
    if damage == "truncate":
        with open(db, "r+b") as handle:
            handle.truncate(size // 2)
    elif damage == "garble":
        data = bytearray(db.read_bytes())
        data[:100] = os.urandom(100)  # the header: "file is not a database"
        db.write_bytes(bytes(data))
    else:
        db.unlink()
        db.mkdir()
    events: list = []
    again = run_tune(tmp_path, 1, calls, tmp_path / "probes.jsonl", events)
    assert len(calls) == 4  # the 3 known configurations came from the cache, not new probes
    # one line first (no line per rebuilt configuration), then the one new probe
    assert [kind for kind, _ in events] == ["log", "probe"], events
    assert "moved aside" in events[0][1]
    assert again.reused >= 3 and set(first.probed) <= set(again.probed)
    moved = [note for note in again.notes if "moved aside" in note]
    assert len(moved) == 1 and "\n" not in moved[0] and "rebuilt from the probe cache" in moved[0]
    assert list(tmp_path.glob("study.db.damaged-*"))
    assert "RUNNING" not in study_states(again.storage)


def test_history_of_a_damaged_study_is_one_line(tmp_path):
    from test_value_ranges import planner

    work = tmp_path / "runs" / "autotune" / "cpu_demo"
    work.mkdir(parents=True)
    (work / "study.db").write_bytes(b"garbage" * 100)
    storage = f"sqlite:///{work / 'study.db'}"
    rc, err = planner("history", "--spec", str(CPU_SPEC), "--storage", storage)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "study.db" in lines[0], err
    assert "Traceback" not in err


def test_torn_probe_line_is_skipped_and_reported_and_later_runs_work(tmp_path):
    path = tmp_path / "probes.jsonl"
    good = ProbeResult("k1", "ok", step_time_s=0.5, fingerprint="fp", measured_steps=3)
    ProbeCache(path).put(good)
    with open(path, "a") as handle:  # a planner killed mid-write: half a line, no newline
        handle.write(json.dumps({"key": "k2", "status": "ok", "step_time_s": 0.2})[:25])
    cache = ProbeCache(path)
    assert cache.get("fp", "k1").step_time_s == good.step_time_s
    assert len(cache.notes) == 1 and "skipped 1 damaged line" in cache.notes[0]
    cache.put(ProbeResult("k3", "ok", step_time_s=0.3, fingerprint="fp", measured_steps=3))
    later = ProbeCache(path)  # the next probe run: both results, nothing damaged any more
    assert later.notes == []
    assert later.get("fp", "k1") is not None and later.get("fp", "k3") is not None


def test_garbled_probe_cache_lines_are_skipped(tmp_path):
    path = tmp_path / "probes.jsonl"
    good = ProbeResult("k1", "ok", step_time_s=0.5, fingerprint="fp")
    path.write_bytes(
        b'\xff\xfe\x00garbage\n[1, 2]\n{"key": 5}\n' + json.dumps(good.__dict__).encode() + b"\n"
    )
    cache = ProbeCache(path)
    assert cache.get("fp", "k1").step_time_s == 0.5
    assert "skipped 3 damaged line" in cache.notes[0]


def test_a_tuning_run_reports_a_torn_probe_cache_and_goes_on(tmp_path):
    calls: list = []
    run_tune(tmp_path, 2, calls, tmp_path / "probes.jsonl")
    with open(tmp_path / "probes.jsonl", "a") as handle:
        handle.write('{"key": "torn')
    logged: list = []
    spec, table, _, rows, target = cpu_space()
    outcome = tune(
        spec,
        table,
        rows,
        target=target,
        work_dir=tmp_path,
        settings=TuneSettings(probes=1, trials=300, seed=0),
        backend=ScriptedProbe(calls),
        cache=ProbeCache(tmp_path / "probes.jsonl"),
        log=logged.append,
    )
    assert any("skipped 1 damaged line" in line for line in logged)
    assert any("skipped 1 damaged line" in note for note in outcome.notes)
    assert len(calls) == 3


# ---- stale trials ---------------------------------------------------------------------------


def test_trial_of_a_dead_planner_on_this_host_is_failed_at_once(tmp_path):
    """SIGKILL leaves no chance to clean up: the next open sees its process is gone."""
    import optuna

    from planner.tuning import study as studies

    url = studies.study_url("", tmp_path)
    study, _ = studies.open_study("s", studies.open_storage(url))
    mine = study.ask()
    studies.claim(mine, lease_s=3600)  # this process: alive, left alone
    theirs = study.ask()
    studies.claim(theirs, lease_s=3600)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owner = dict(theirs.user_attrs[studies.OWNER_ATTR], pid=dead.pid)
    theirs.set_user_attr(studies.OWNER_ATTR, owner)
    resumed, failed = studies.open_study("s", studies.open_storage(url))
    assert failed == [theirs.number]
    states = {t.number: t.state for t in resumed.get_trials()}
    assert states == {
        mine.number: optuna.trial.TrialState.RUNNING,
        theirs.number: optuna.trial.TrialState.FAIL,
    }


def test_no_optuna_warning_while_tuning(tmp_path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_tune(tmp_path, 2, [], tmp_path / "probes.jsonl")
    messages = [
        str(w.message)
        for w in caught
        if "optuna" in (w.filename or "")
        or "Heartbeat" in str(w.message)
        or "experimental" in str(w.message).lower()
    ]
    assert messages == []


# ---- a planner stopped by a signal ---------------------------------------------------------

HANGING_PLANNER = """
import os, subprocess, sys
from pathlib import Path

import planner.tuning.autotune as autotune


class HangingProbe:
    '''A probe that never ends (a process group of its own, as LocalProbe's).'''
    fingerprint = "hanging"

    def __init__(self, work_dir, **_kwargs):
        self.work_dir, self.procs = Path(work_dir), []

    def run(self, plan, *, steps=None):
        proc = subprocess.Popen(["sleep", "600"], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        # written whole (a rename): the test reads it as soon as it exists
        (self.work_dir / "probe.pid.tmp").write_text(str(proc.pid))
        os.replace(self.work_dir / "probe.pid.tmp", self.work_dir / "probe.pid")
        proc.wait()

    def close(self, *, wait=True):
        running = [p for p in self.procs if p.poll() is None]
        for proc in running:
            os.killpg(proc.pid, 9)
            proc.wait()
        self.procs.clear()
        return len(running)


autotune.LocalProbe = HangingProbe
from planner.commands.main import main

sys.exit(main(sys.argv[1:]))
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def planner_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stopped-planner")  # one corpus cache for the three runs


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_stopped_planner_leaves_no_running_trial(planner_dir, signum):
    from planner.tuning import study as studies

    work = planner_dir / "runs" / "autotune" / "cpu_demo"
    (work / "probe.pid").unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HANGING_PLANNER,
            "optimize",
            "--spec",
            str(CPU_SPEC),
            "--probes",
            "3",
        ],
        cwd=planner_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not (work / "probe.pid").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        probe_pid = int((work / "probe.pid").read_text())
        os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    url = f"sqlite:///{work / 'study.db'}"
    if signum == signal.SIGKILL:
        os.killpg(probe_pid, signal.SIGKILL)  # the fake probe has no lifeline; LocalProbe's has
        assert "RUNNING" in study_states(url)  # nothing could clean up...
    else:
        assert proc.returncode == 128 + signum, err[-3000:]
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            f"planner stopped by {signal.Signals(signum).name}"
        ), err[-3000:]
        # a trial number, not a count (issue 29): "running trial #0 marked failed"
        assert re.search(r"running trials? #\d+(, #\d+)* marked failed;", lines[0])
        assert "1 probe worker(s) ended" in lines[0]
        assert "Traceback" not in out + err and "FatalError" not in err
        assert not alive(probe_pid)  # its probe's process group was ended
        assert "RUNNING" not in study_states(url)  # failed before it exited
    import optuna

    (summary,) = optuna.get_all_study_summaries(storage=url)
    studies.open_study(summary.study_name, studies.open_storage(url))  # an immediate rerun
    assert "RUNNING" not in study_states(url)
    assert np.all([s in ("COMPLETE", "FAIL", "WAITING") for s in study_states(url)])


@pytest.mark.parametrize("storage", ["runs/study.journal", "sqlite:///runs/autotune/x/study.db"])
def test_study_storage_in_a_folder_that_does_not_exist_yet(tmp_path, monkeypatch, storage):
    """Issue 29: the README's `planner optimize ... --storage runs/study.journal` in a fresh
    checkout died with a 32-line FileNotFoundError (nothing created runs/)."""
    from planner.tuning import study as studies

    monkeypatch.chdir(tmp_path)
    study, _ = studies.open_study("s", studies.open_storage(storage))
    assert study.study_name == "s"
    assert (tmp_path / "runs").is_dir()
    again, _ = studies.open_study("s", studies.open_storage(storage))  # a rerun opens it
    assert again.study_name == "s"


def test_study_storage_under_a_file_is_one_line(tmp_path, monkeypatch):
    from gptplan.errors import UserError
    from planner.tuning import study as studies

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("a file")
    with pytest.raises(UserError, match="--storage") as info:
        studies.open_storage("runs/study.journal")
    assert "\n" not in str(info.value) and "existing file" in str(info.value)


def test_corpus_statistics_of_a_one_line_corpus_stay_bounded(tmp_path, monkeypatch):
    """Issue 39: a corpus with no newline is one document; the planner tokenized it whole
    (a 200 MB line peaked at 6.75 GB RSS). Now it holds one document at a time and tokenizes
    at most MEASURE_CHARS of any document, extrapolating the rest at the measured rate."""
    from types import SimpleNamespace

    from gptplan import tokenizer as tk
    from planner.corpus import corpus_stats

    asked: list[int] = []

    def encode(text: str) -> list[int]:
        asked.append(len(text))
        return [0] * (len(text) // 2)  # 0.5 tokens per character

    fake = SimpleNamespace(name="fake", vocab_size=4000, encode=encode)
    monkeypatch.setattr(tk, "ensure_tokenizer", lambda **kw: None)
    monkeypatch.setattr(tk, "load_tokenizer", lambda spec: fake)
    line = "ab" * 1_500_000  # 3M characters, no newline
    corpus = tmp_path / "one_line.txt"
    corpus.write_text(line)
    stats = corpus_stats.corpus_statistics(
        corpus=[str(corpus)],
        tokenizer="fake",
        vocab_size=4000,
        cache_dir=str(tmp_path / "cache"),
        sample_documents=100,
        declared_bytes=0,
        seq_lens=[128],
        log=lambda *a: None,
    )
    assert max(asked) <= corpus_stats.MEASURE_CHARS == 100_000  # never the 3M-character line
    assert stats.tokens_per_character == pytest.approx(0.5, rel=1e-3)


def test_corpus_statistics_hold_no_long_line_whole(tmp_path):
    """Issue 39: the statistics pass read every line whole (a 60 MB line peaked at several times
    its size). Now a line over LONG_LINE_BYTES is measured in pieces: the traced peak stays far
    below the file's size, with the same counts a whole read gives."""
    import tracemalloc

    from planner.corpus import corpus_stats

    corpus = tmp_path / "one_line.txt"
    unit = "ab\u4e2d\u3000 c"  # 3-byte characters cut at piece boundaries, inner whitespace
    repeats = 60 * 2**20 // len(unit.encode()) + 1
    corpus.write_text("  " + unit * repeats + " \u3000 ")  # no newline; stripped at both ends
    assert corpus.stat().st_size > 60 * 2**20
    tracemalloc.start()
    try:
        st, count, heads, sizes, bytes_per_char = corpus_stats._sample([str(corpus)], 100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"traced peak {peak / 2**20:.1f} MiB for a {corpus.stat().st_size / 2**20:.1f} MiB line")
    assert peak < 30 * 2**20, f"peak {peak / 2**20:.1f} MiB for a 60 MiB line"
    text_chars = len(unit) * repeats  # the text starts and ends with a letter
    assert (count, st.documents, st.lines) == (1, 1, 1)
    assert sizes == [text_chars] and st.characters == text_chars
    assert heads == [
        (unit * (corpus_stats.MEASURE_CHARS // len(unit) + 1))[: corpus_stats.MEASURE_CHARS]
    ]
    assert st.bytes == corpus.stat().st_size
    utf8 = len(unit.encode()) * repeats
    assert bytes_per_char == (utf8 + 1) / (text_chars + 1)


def test_bounded_document_sizes_match_whole_documents(tmp_path):
    """The pieces of a long line give what the whole line gives: statistics, content hash (a
    cache key), de-duplication and heads, for lines cut anywhere (tiny caps and pieces)."""
    import random

    from gptplan.corpus import CorpusStats, iter_document_sizes, iter_documents

    rng = random.Random(7)
    alphabet = ["a", "b", " ", "\t", "\u3000", "\u4e2d", "\U0001f600", "\r", "\x1c", "\u00e9"]
    lines = []
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        lines.append(text.encode())
    lines += [
        b"",
        b"   ",
        b"ab\xff\xfecd" * 10,
        lines[5],
        lines[5],
        b" " * 50 + b"x",
        b"x" + b" " * 50,
    ]
    rng.shuffle(lines)
    data = b"\n".join(lines) + b"  \xe4\xb8\xad tail without newline  "
    path = tmp_path / "c.txt"
    path.write_bytes(data)
    for dedupe in (False, True):
        whole_stats = CorpusStats()
        whole = list(iter_documents([path], whole_stats, dedupe=dedupe))
        for cap, piece in ((8, 3), (16, 5), (33, 7), (10**6, 1 << 20)):
            stats = CorpusStats()
            got = list(
                iter_document_sizes(
                    [path], stats, dedupe=dedupe, head_chars=4, line_cap=cap, piece_bytes=piece
                )
            )
            assert stats == whole_stats, (dedupe, cap, piece)
            assert [(d.head, d.characters, d.utf8_bytes) for d in got] == [
                (t[:4], len(t), len(t.encode())) for t in whole
            ], (dedupe, cap, piece)
