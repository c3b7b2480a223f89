"""The run directory's own files, verified before the runner uses them.

A damaged file never ends in a traceback and is never used silently: it is moved into
`<run_dir>/damaged/` (kept, never deleted) with one line, and rebuilt where it can be:

- `result.json` (garbled, truncated, a folder): rebuilt from the newest verified checkpoint's
  state and `metrics.jsonl` (the report says so); `report.json`, `launcher.json`, `plan.toml`:
  rewritten by the run;
- `metrics.jsonl`: the damaged file is kept in damaged/, the run goes on with its readable
  records (a resumed run rewrites the steps after its checkpoint);
- `checkpoints`, `logs`, `tokenizer`, `export` that are files: moved aside (a run without
  checkpoints starts from step 0, the same losses as any first run);
- `billing.json` / `billing.copy.json`: see runner.billing.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from gptplan import money
from gptplan.plan import Plan
from gptplan.progress import Log
from gptplan.tomlconf import write_text_atomic
from runner.billing import DAMAGED_DIR, move_damaged

JSON_FILES = ("result.json", "report.json", "launcher.json")
FILES = (*JSON_FILES, "plan.toml", "metrics.jsonl")
FOLDERS = ("checkpoints", "logs", "tokenizer", "export")


def _json_problem(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"not readable JSON: {type(exc).__name__}"
    return None if isinstance(data, dict) else "not a JSON object"


def _metrics_problem(path: Path) -> tuple[str | None, list[str]]:
    """(problem, readable lines): a torn last line is what a kill leaves, not damage."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        return f"not readable: {type(exc).__name__}", []
    good, bad = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(line)
            good.append(line)
        except ValueError:
            bad += i < len(lines) - 1
    return (f"{bad} unreadable line(s)" if bad else None), good


def check_run_files(run_dir: Path, *, log: Log = print) -> list[Path]:
    """Move damaged run files into damaged/ (one line each); returns the files moved."""
    run_dir = Path(run_dir)
    moved = []
    for name in (*FOLDERS, *FILES):
        path = run_dir / name
        if not (path.exists() or path.is_symlink()):
            continue
        want_dir = name in FOLDERS
        problem: str | None
        if path.is_symlink() or path.is_dir() != want_dir:
            problem = f"a {'file' if want_dir else 'folder'} where the run keeps its {name}"
        elif name in JSON_FILES:
            problem = _json_problem(path)
        elif name == "metrics.jsonl":
            problem, good = _metrics_problem(path)
            if problem:
                shutil.copy2(path, _target(run_dir, name))
                write_text_atomic(path, "".join(f"{line}\n" for line in good))
                log(
                    f"{path} had {problem}; a copy is in {run_dir / DAMAGED_DIR}, the run goes "
                    f"on with its {len(good)} readable step records"
                )
                continue
        else:
            problem = None
        if problem:
            target = move_damaged(path, run_dir)
            moved.append(target)
            fix = (
                "rebuilt from the newest checkpoint"
                if name == "result.json"
                else "rewritten by this run"
            )
            log(f"{path} is damaged ({problem}); moved to {target}, {fix}")
    return moved


def _target(run_dir: Path, name: str) -> Path:
    folder = run_dir / DAMAGED_DIR
    folder.mkdir(exist_ok=True)
    n = len(list(folder.glob(f"{name}*")))
    return folder / f"{name}.{n + 1}"


def read_metrics(run_dir: Path) -> list[dict]:
    """The readable step records of metrics.jsonl, one per step, in step order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step = {}
    for line in _metrics_problem(path)[1]:
        record = json.loads(line)
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def rebuild_result(
    plan: Plan, run_dir: Path, state: dict, *, billed_seconds: float, checkpoint_bytes: int
) -> dict:
    """result.json of a run whose result was lost: the newest checkpoint's state (steps,
    tokens, loss; measured) and the step records in metrics.jsonl (times, throughput)."""
    from runner.metrics import WARMUP_STEPS

    records = read_metrics(run_dir)
    steady = records[WARMUP_STEPS:] or records

    def median(key: str) -> float:
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else 0.0

    tokens, padded = state["tokens_trained"], state["padded_tokens"]
    cost = money.cost(
        price_per_node_hour=plan.hardware.price_per_node_hour,
        nodes=plan.parallel.nnodes,
        seconds=billed_seconds,
    )
    step_times = [r["step_time_s"] for r in steady if "step_time_s" in r]
    measured = {
        "steps_this_attempt": 0,
        "tokens_trained": tokens,
        "padded_tokens": padded,
        "useful_token_fraction": tokens / max(1, tokens + padded),
        "step_time_s": median("step_time_s"),
        "step_time_spread_s": max(step_times) - min(step_times) if step_times else 0.0,
        "tokens_per_second": median("tokens_per_second"),
        "mfu": median("mfu"),
        "peak_memory_gb": max((r.get("peak_memory_gb", 0.0) for r in records), default=0.0),
        "peak_memory_method": "peak RSS" if plan.hardware.device == "cpu" else "allocator peak",
        "billed_hours": billed_seconds / 3600.0,
        "cost": cost,
        "currency": plan.hardware.currency,
        "cost_per_million_tokens": cost / tokens * 1e6 if tokens else 0.0,
        "checkpoint_seconds_median": 0.0,
        "final_loss": state.get("loss"),
    }
    step = state["step"]
    finished = step >= plan.training.max_steps
    return {
        "plan": plan.name,
        "completed_steps": step,
        "max_steps": plan.training.max_steps,
        "finished": finished,
        "stop_reason": "finished" if finished else "interrupted",
        "last_checkpoint_step": step,
        "resumed_from_step": step,
        "world_size": plan.parallel.world_size,
        "checkpoint_bytes": checkpoint_bytes,
        "measured": measured,
        "last_step": records[-1] if records else None,
        "rebuilt_from": "newest checkpoint's state and metrics.jsonl",
    }
