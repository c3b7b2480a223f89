"""A termination notice reaches every rank, whatever the launcher in between does with it.

`paddle.distributed.launch` starts each rank in a session of its own and stops them from its
SIGTERM handler, which ends by raising SystemExit; raised inside one of the bare `except:` of
its start-up code (Container._get_fd, Container.logs) the exit is swallowed, and ranks it starts
afterwards train to the end (seen in CI: SIGTERM one second into a run, exit 0 after all 400
steps). These tests stand a launcher that never passes a notice on in front of supervised ranks
(runner.supervise), so they fail whenever the runner relies on the launcher alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import group_members

REPO = Path(__file__).resolve().parents[1]

# A launcher that ignores SIGTERM (as one whose handler's SystemExit was swallowed) and starts
# its "rank" in a new session, after a delay, like Paddle's (setsid per container).
DEAF_LAUNCHER = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(float(sys.argv[2]))
    rank = subprocess.Popen([sys.executable, sys.argv[1]], start_new_session=True)
    rc = rank.wait()
    sys.exit(rc if rc >= 0 else 128 - rc)
""")

# A supervised rank: exits 143 on SIGTERM (what a training rank does after its checkpoint),
# 0 if it is left to "train" for 60 s.
RANK = textwrap.dedent("""
    import os, signal, sys, time
    from runner.supervise import supervise
    supervise()
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    open(os.environ["READY_FILE"], "w").close()
    time.sleep(60)
    sys.exit(0)
""")

# The runner's side: run_group with the supervision environment the runner gives its ranks.
DRIVER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from runner.launch import run_group
    from runner.parallel import LaunchCommand
    from runner.supervise import supervision_env
    launcher, rank, delay, status_dir = sys.argv[1:5]
    env = supervision_env(Path(status_dir), 1 << 34)
    result = run_group(LaunchCommand(0, [sys.executable, launcher, rank, delay], env))
    print(json.dumps({"rc": result.rc, "forwarded": result.forwarded_signals}))
""")


def scripts(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, text in {"launcher.py": DEAF_LAUNCHER, "rank.py": RANK, "driver.py": DRIVER}.items():
        out[name] = tmp_path / name
        out[name].write_text(text)
    return out


def environment(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), READY_FILE=str(tmp_path / "ready"))


@pytest.mark.parametrize("rank_starts", ["before the notice", "after the notice"])
def test_notice_reaches_ranks_the_launcher_does_not_tell(tmp_path, rank_starts):
    s = scripts(tmp_path)
    delay = "0" if rank_starts == "before the notice" else "1.5"
    driver = subprocess.Popen(
        [
            sys.executable,
            str(s["driver.py"]),
            str(s["launcher.py"]),
            str(s["rank.py"]),
            delay,
            str(tmp_path / "ranks"),
        ],
        env=environment(tmp_path),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if rank_starts == "before the notice":
            deadline = time.time() + 30
            while not (tmp_path / "ready").exists() and time.time() < deadline:
                time.sleep(0.05)
            assert (tmp_path / "ready").exists()
        else:
            time.sleep(0.5)  # the launcher is up, its rank not yet
            assert not (tmp_path / "ready").exists()
        began = time.time()
        driver.send_signal(signal.SIGTERM)
        out, _ = driver.communicate(timeout=45)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"rc": 143, "forwarded": [signal.SIGTERM]}
    assert time.time() - began < 30  # told, not left to run out its 60 s
    rank = json.loads((tmp_path / "ranks" / "rank_0.json").read_text())
    assert rank["exit_code"] == 143 and rank["ended"] is not None


def test_rank_stops_when_its_runner_is_gone(tmp_path):
    """The runner SIGKILLed while the launcher ignores its parent-death signal: the rank's
    supervisor notices the runner is gone and tells the rank (no training goes on unbilled)."""
    s = scripts(tmp_path)
    driver = subprocess.Popen(
        [
            sys.executable,
            str(s["driver.py"]),
            str(s["launcher.py"]),
            str(s["rank.py"]),
            "0",
            str(tmp_path / "ranks"),
        ],
        env=environment(tmp_path),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    status = tmp_path / "ranks" / "rank_0.json"
    try:
        deadline = time.time() + 30
        while not ((tmp_path / "ready").exists() and status.exists()) and time.time() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists() and status.exists()
        # Not reaped until the rank has ended: a dead runner whose parent is slow to reap it is
        # a zombie with its pid and start time, and must count as gone.
        os.kill(driver.pid, signal.SIGKILL)
        deadline = time.time() + 20
        while time.time() < deadline:
            record = json.loads(status.read_text())
            if record["ended"] is not None:
                break
            time.sleep(0.1)
        assert record["ended"] is not None, f"the rank went on after its runner died: {record}"
        assert record["exit_code"] == 143 and record.get("runner_gone") is True, record
        driver.wait(timeout=10)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def caught_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("SigCgt:"):
                return int(line.split()[1], 16)
    return 0


def test_launcher_signalled_while_importing_paddle_exits_cleanly(tmp_path):
    """A notice at the moment Paddle's import has installed its C-level handlers (before the
    launcher's controller replaces them) must end the launcher, not run Paddle's handler
    (FatalError, or a hang in malloc inside the handler, as seen once)."""
    from runner.parallel import LAUNCH_MODULE

    script = tmp_path / "rank.py"
    script.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            LAUNCH_MODULE,
            "--nnodes",
            "1",
            "--nproc_per_node",
            "1",
            "--log_dir",
            str(tmp_path / "logs"),
            str(script),
        ],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if caught_signals(proc.pid) & (1 << (signal.SIGTERM - 1)):
                break  # the first handler for SIGTERM is in place: Paddle's, from its import
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode in (128 + signal.SIGTERM, signal.SIGTERM), out[-2000:]
    assert "FatalError" not in out and "Termination signal" not in out


# ---- a notice while the runner's own pool workers run (issue 29) ---------------------------

NOTICE_BOUND_S = 20.0  # SIGTERM to the runner's exit with nothing of its group left


def _pool_workers(pid: int) -> list[int]:
    """The runner's multiprocessing pool workers (spawned children; not its resource tracker)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            out.append(int(entry))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("phase", ["tokenizer training", "data preparation"])
def test_notice_while_pool_workers_run_exits_143(tmp_path, shared_cache, finished_run, phase):
    """SIGTERM while the tokenizer is trained or the data prepared (spawn pools: workers that
    inherited a blocked SIGTERM could never be ended, and the pool's join waited for good):
    exit 143 within NOTICE_BOUND_S with no process of the runner's group left."""
    import tomli_w
    from conftest import BASE_PLAN, merge

    cache = tmp_path / "cache"
    overrides: dict = {"job": {"cache_dir": str(cache), "output_dir": str(tmp_path / "run")}}
    if phase == "tokenizer training":  # enough documents for the parallel jieba pass
        overrides["job"]["max_documents"] = 6000
    else:  # the trained tokenizer, no prepared data
        finished_run("gpt")
        cache.mkdir()
        shutil.copytree(shared_cache / "tokenizers", cache / "tokenizers")
    plan = tmp_path / "plan.toml"
    plan.write_text(tomli_w.dumps(merge(BASE_PLAN, overrides)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "execute", str(plan), "--dry-run"],
        cwd=tmp_path,
        env=environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not _pool_workers(proc.pid):
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.5)  # the workers are importing or working
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=NOTICE_BOUND_S)
        while group_members(proc.pid) and time.time() - sent < NOTICE_BOUND_S:
            time.sleep(0.05)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"SIGTERM during {phase}: exit {proc.returncode}, nothing left after {took:.1f} s")
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out
    assert not group_members(proc.pid), "processes of the runner's group outlived it"
    trained = list(cache.glob("tokenizers/*/tokenizer.json"))
    if phase == "tokenizer training":
        assert not trained, "the notice came after the tokenizer was trained"
    else:
        assert trained and not list(cache.glob("data/*/meta.json")), "not during preparation"


# A caller that blocks SIGTERM/SIGINT (the runner does while it starts) and then runs a pool:
# spawn passes the mask on through exec, so its workers must restore the default themselves.
# The caller blocks SIGTERM/SIGINT (as the runner does while it starts the pool). The main guard
# keeps the spawned workers from running the caller's own body again (spawn imports the main
# module): without it each worker blocked the signals itself, re-entered the pool and died of
# multiprocessing's bootstrapping error, and the test measured how fast that happened (it failed
# in full-suite runs). Spawned workers start with an empty mask (checked: SigBlk 0); the pool's
# initializer resets mask and handlers as well, for a start method that inherits them (fork).
BLOCKED_CALLER = textwrap.dedent("""
    import signal
    from gptplan.tokenizer import _segment_parallel
    if __name__ == "__main__":
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))
        _segment_parallel(["今天天气很好我们去公园散步吧" * 20] * 400000, 2, lambda n: None)
""")


def test_pool_workers_end_on_sigterm_whatever_their_starters_mask(tmp_path):
    """Pool.terminate() ends workers with SIGTERM: a worker that kept a blocked SIGTERM from
    its starter could never be ended, and the pool's join would wait for good (issue 29)."""
    script = tmp_path / "caller.py"
    script.write_text(BLOCKED_CALLER)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        env=environment(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        workers: list[int] = []
        while time.time() < deadline and proc.poll() is None and len(workers) < 2:
            workers = _pool_workers(proc.pid)
            time.sleep(0.05)
        assert len(workers) == 2, proc.stderr.read() if proc.poll() is not None else workers
        # working (a notice that comes before their initializer stays pending and is
        # delivered when it restores the default mask, so the moment does not matter)
        time.sleep(1.0)
        sent = []
        for pid in _pool_workers(proc.pid) or workers:  # the pool replaces an ended worker
            try:
                os.kill(pid, signal.SIGTERM)
                sent.append(pid)
            except ProcessLookupError:
                pass
        assert sent, "the pool's workers ended before the notice (the work was too short)"
        deadline = time.time() + 60  # a loaded machine: the workers may still be importing
        alive = sent
        while alive and time.time() < deadline:
            alive = [pid for pid in sent if _state(pid) not in ("", "Z")]
            time.sleep(0.05)
        assert not alive, f"pool workers ignored SIGTERM: {alive}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


# A process that trains a sentencepiece tokenizer on a long one-line corpus with the runner's
# signal rule (a handler that ends it, exit 143). The corpus is 4.5M random CJK characters on
# one line (no newline: the case); jieba's segmentation (minutes on such text) is
# skipped: sentencepiece's training alone takes about 45 s on the CPU test machine (5M: 58 s).
TOKENIZER_TRAINER = textwrap.dedent("""
    import random, signal, sys
    from pathlib import Path
    from gptplan import tokenizer as T

    def stop(signum, frame):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    T._segmented = lambda pieces, workers, progress: pieces  # unsegmented, as one long line
    rng = random.Random(0)
    alphabet = [chr(0x4E00 + i) for i in range(3000)]
    line = "".join(rng.choices(alphabet, k=4_500_000))
    T.train_tokenizer([line], vocab_size=8000, out_dir=Path(sys.argv[1]) / "tok",
                      scheme="cpm", log=lambda m: print(m, flush=True))
""")
STOP_BOUND_S = 20.0  # the README's bound for a notice during tokenizer training


def trainer_children(parent: int) -> list[int]:
    """Live processes running gptplan.tokenizer's sentencepiece child (its own group) whose
    parent is `parent` (another test's tokenizer training may run beside this one)."""
    from gptplan.tokenizer import SPM_CHILD

    found = []
    for entry in os.listdir("/proc"):
        try:
            if (
                entry.isdigit()
                and SPM_CHILD.encode() in Path(f"/proc/{entry}/cmdline").read_bytes()
            ):
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
                if int(fields[1]) == parent and fields[0] != "Z":
                    found.append(int(entry))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_during_sentencepiece_training_ends_within_the_bound(tmp_path):
    """Issue 39: sentencepiece's trainer is one native call; in the process that got the
    notice it held the handler off until it ended (76 s on a 200 MB one-line corpus). It runs
    in a child of its own group, killed on the way out: the notice ends all of it at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TOKENIZER_TRAINER, str(tmp_path)],  # ~8 s in all
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if "sentencepiece model" in line:
                break
        time.sleep(2.0)  # well inside the native call
        assert proc.poll() is None, "training ended before the notice: nothing tested"
        children = trainer_children(proc.pid)
        assert children, "no sentencepiece child is training: nothing tested"
        proc.send_signal(signal.SIGTERM)
        sent = time.time()
        proc.wait(timeout=STOP_BOUND_S + 30)
        took = time.time() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143
    assert took <= STOP_BOUND_S, f"{took:.1f} s after SIGTERM"
    assert group_members(proc.pid) == []  # nothing of its group left
    assert not [c for c in children if alive(c)], "the sentencepiece child outlived its parent"
    assert not (tmp_path / "tok").exists()  # no half-written cache entry


def test_no_resource_tracker_warning_after_the_runners_last_line():
    """Issue 39: the runner ends with os._exit (runner.__main__), so multiprocessing's exit hook
    never ran and its resource tracker warned about leaked semaphores after the error line.
    A semaphore of a spawn context stands for a pool's, left when a pool ended on an error."""
    script = textwrap.dedent("""
        import multiprocessing, sys
        import runner.__main__ as entry
        lock = multiprocessing.get_context("spawn").Lock()  # registered with the tracker
        sys.argv = ["runner", "--version"]
        entry.entry()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("runner ")
    assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
