"""The plan numbers the README and the manual state, derived from the shipped plans (and the
measured demo times).

README.md and the pages of docs/ mark every stated plan number with a block

    <!-- readme-numbers: NAME -->text<!-- /readme-numbers -->

whose text this script derives from `plans/bank_faq.toml` / `plans/llama_zh.toml` (written by
`planner optimize`) and `bench/results/demo_time.json`. `--check` (the default; the test suite
runs it) exits 1 naming every block, with its file, that drifted from what the code prints, and
every block name that no file holds any more; `--write` rewrites the blocks in every file after
the plans were re-derived (e.g. after merging branches that change the cost
model or prices); `--time-demo` runs `make demo`'s commands, appends the wall time and the
machine's load average to bench/results/demo_time.json, and then rewrites the demo-time block.

    python bench/readme_numbers.py            # check
    python bench/readme_numbers.py --write    # regenerate after re-deriving the plans
    python bench/readme_numbers.py --time-demo

`--write` also refreshes the README's worked example, the ```console block of
`planner optimize --budget 12000`: it runs the command in a temporary folder and shows the
lines `example_lines` picks (tests/test_docs_commands.py checks that every shown line is one
the command prints).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
DEMO_TIMES = REPO / "bench" / "results" / "demo_time.json"
BLOCK = re.compile(
    r"<!-- readme-numbers: (?P<name>[a-z0-9_]+) -->(?P<text>.*?)<!-- /readme-numbers -->", re.S
)
sys.path.insert(0, str(REPO))


def _device(profile: str) -> str:
    """'a100-80gb' -> 'A100 80GB'."""
    name, _, mem = profile.partition("-")
    return f"{name.upper()} {mem.upper()}".strip()


def _offer(plan) -> str:
    provider, _, instance = plan.hardware.offer.partition("/")
    return f"{provider} {instance}" if instance else provider


def _settings(plan) -> str:
    t, p = plan.training, plan.parallel
    parts = [t.precision + (f" {t.fp16_opt_level}" if t.precision != "fp32" else "")]
    if t.use_flash_attention:
        parts.append("flash attention")
    parts.append(
        f"micro {t.per_device_train_batch_size} x acc {t.gradient_accumulation_steps} x "
        f"{p.batch_ranks}"
    )
    parts.append(f"seq {t.seq_len}")
    if p.tensor_parallel_degree > 1:
        parts.append(f"tp {p.tensor_parallel_degree}")
    if p.pipeline_parallel_degree > 1:
        parts.append(f"pp {p.pipeline_parallel_degree}")
    if p.sharding:
        parts.append(f"ZeRO-{p.sharding[-1]} over {p.sharding_parallel_degree}")
    if p.recompute != "none":
        parts.append(f"recompute {p.recompute}")
    return ", ".join(parts)


def _note(plan, pattern: str) -> str:
    for note in plan.provenance.notes:
        m = re.search(pattern, note)
        if m:
            return m.group(1)
    return ""


def _hardware(plan) -> str:
    capacity = "spot" if plan.hardware.spot else "on-demand"
    return (
        f"{plan.parallel.nnodes} x {_offer(plan)} ({plan.parallel.nproc_per_node} x "
        f"{_device(plan.hardware.profile)}), {capacity}"
    )


def _time(plan) -> str:
    e = plan.estimate
    return f"{e.hours:.1f} hours (p10-p90 {e.hours_p10:.1f}-{e.hours_p90:.1f})"


def _cost(plan) -> str:
    e, cur = plan.estimate, plan.budget.currency
    out = f"{e.cost:,.0f} {cur} (p10-p90 {e.cost_p10:,.0f}-{e.cost_p90:,.0f})"
    if plan.hardware.spot:
        pre = _note(plan, r"spot: ([0-9.e+-]+) expected preemptions")
        od = _note(plan, r"the same plan on-demand: ([0-9,]+) ")
        out += f", {pre} expected preemptions included; {od} {cur} on-demand"
    return out


def _tokens_per_char(plan) -> str:
    j = plan.job
    if j.tokens_per_char_source == "extrapolated":
        return (
            f"{j.tokens_per_char:.2f} tokens per character, extrapolated to the planned "
            f"{j.tokenizer_vocab_size:,}-piece vocabulary (80% range "
            f"{j.tokens_per_char_p10:.2f}-{j.tokens_per_char_p90:.2f}) from smaller "
            "tokenizers the sample supports"
        )
    return f"{j.tokens_per_char:.2f} tokens per character on the sample"


def _corpus(plan) -> str:
    j = plan.job
    return f"{j.corpus_tokens / 1e9:.2f}B corpus tokens, {j.planned_epochs:.1f} epochs"


def _demo_time() -> str:
    runs = json.loads(DEMO_TIMES.read_text()) if DEMO_TIMES.exists() else []
    if not runs:
        return "not measured yet (python bench/readme_numbers.py --time-demo)"
    minutes = [r["wall_s"] / 60 for r in runs]
    loads = [r["load_average_1min"] for r in runs if r.get("load_average_1min") is not None]
    load = f", 1-minute load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    span = (
        f"{minutes[0]:.0f} min" if len(runs) == 1 else f"{min(minutes):.0f}-{max(minutes):.0f} min"
    )
    return (
        f"{span} measured over {len(runs)} run(s) on "
        f"{runs[-1]['cpus']} CPU cores ({runs[0]['date']}"
        + (f" to {runs[-1]['date']}" if len(runs) > 1 else "")
        + f"{load}; "
        "bench/results/demo_time.json)"
    )


def blocks() -> dict[str, str]:
    """Every README block's text, from the shipped plans and the demo measurements."""
    from gptplan.plan import load_plan

    bank = load_plan(REPO / "plans" / "bank_faq.toml")
    llama = load_plan(REPO / "plans" / "llama_zh.toml")
    table = "\n".join(
        [
            "| | the article | this planner (modelled) |",
            "|---|---|---|",
            f'| hardware | 8 cards (P4, "two machines") | {_hardware(bank)} |',
            "| settings | fp16, micro 16 x 8 cards x acc 2, seq 1024, ZeRO-1 | "
            f"{_settings(bank)} |",
            f"| time | about 7 days | {_time(bank)} |",
            f"| cost | about 12,000 CNY | {_cost(bank)} |",
        ]
    )
    return {
        "bank_faq_table": "\n" + table + "\n",
        "bank_faq_short": (
            f"{bank.model.name} GPT, {_hardware(bank)}, {_settings(bank)}; "
            f"{bank.estimate.cost:,.0f} {bank.budget.currency} modelled"
        ),
        "bank_faq_tokens_per_char": _tokens_per_char(bank),
        "bank_faq_corpus": _corpus(bank),
        "bank_faq_ceiling": (
            f"{bank.budget.max_cost:,.0f} {bank.budget.currency}"
            if bank.budget.budget_total
            else f"{bank.budget.max_cost:,.0f} {bank.budget.currency} (the whole budget: "
            "written before the plan-sized ceiling)"
        ),
        "llama_zh": f"{_hardware(llama)}, {_settings(llama)}, {_time(llama)}, {_cost(llama)}",
        "demo_time": _demo_time(),
    }


def files() -> list[Path]:
    """The files that may hold blocks: README.md and every page of the manual."""
    return [README, *sorted(DOCS.glob("*.md"))]


def check(text: str, want: dict[str, str], *, label: str = "README.md") -> list[str]:
    """One problem per block of `text` whose text differs from `want`, or whose name is not a
    known block ('NAME: ...')."""
    out = []
    for m in BLOCK.finditer(text):
        name = m["name"]
        if name not in want:
            out.append(f"{name}: {label} has a block no plan derives (known: {sorted(want)})")
        elif m["text"] != want[name]:
            out.append(f"{name}: {label} says {m['text']!r}, the plans give {want[name]!r}")
    return out


def check_files(want: dict[str, str], paths: list[Path] | None = None) -> list[str]:
    """check() over every file, and every block name held by at least one of them."""
    out: list[str] = []
    seen: set[str] = set()
    for path in paths if paths is not None else files():
        text = path.read_text(encoding="utf-8")
        seen.update(m["name"] for m in BLOCK.finditer(text))
        label = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
        out += check(text, want, label=label)
    out += [f"{name}: no file holds this block" for name in want if name not in seen]
    return out


def rewrite(text: str, want: dict[str, str]) -> str:
    return BLOCK.sub(
        lambda m: (
            f"<!-- readme-numbers: {m['name']} -->{want.get(m['name'], m['text'])}"
            "<!-- /readme-numbers -->"
        ),
        text,
    )


EXAMPLE = ("planner", "optimize", "--budget", "12000")
# what the README shows of the example's output: (first line's prefix, lines from there)
EXAMPLE_PICKS = (
    ("corpus tokens:", 1),
    ("Top ", 7),  # the heading (2 lines), the table's header (2) and its first 3 rows
    ("chosen:", 4),
    ("        sensitivity:", 1),
    ("wrote ", 1),
)
CONSOLE = re.compile(r"(```console\n\$ " + re.escape(" ".join(EXAMPLE)) + r"\n)(.*?)(```)", re.S)


def example_lines(printed: str) -> list[str]:
    """The README's excerpt of the example's output, '...' where lines are left out."""
    lines = printed.splitlines()
    out: list[str] = []
    at = 0
    for prefix, count in EXAMPLE_PICKS:
        start = next((i for i in range(at, len(lines)) if lines[i].startswith(prefix)), None)
        if start is None:
            raise SystemExit(f"the example's output has no line starting {prefix!r}")
        if start > at or not out:
            out.append("...")
        out += [line.rstrip() for line in lines[start : start + count]]
        at = start + count
    return out


def run_example() -> str:
    """`planner optimize --budget 12000` in a temporary folder (the shipped plans untouched)."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(REPO / "planner" / "specs", Path(tmp) / "planner" / "specs")
        proc = subprocess.run(
            [sys.executable, "-m", *EXAMPLE],
            cwd=tmp,
            capture_output=True,
            text=True,
            env=dict(os.environ, COLUMNS="120", PYTHONPATH=str(REPO)),
        )
    if proc.returncode:
        raise SystemExit(f"{' '.join(EXAMPLE)} failed (exit {proc.returncode}):\n{proc.stderr}")
    return proc.stdout + proc.stderr


def rewrite_example(text: str, printed: str) -> str:
    """README text with its console block of the example replaced by the output's excerpt."""
    body = "\n".join(example_lines(printed)) + "\n"
    new, n = CONSOLE.subn(lambda m: m[1] + body + m[3], text)
    if n != 1:
        raise SystemExit(f"README.md has {n} console block(s) of {' '.join(EXAMPLE)}, not 1")
    return new


def time_demo() -> None:
    """Run `make demo` (its commands, through the Makefile) and record wall time and load."""
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(["make", "demo"], cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"make demo failed (exit {proc.returncode}); nothing recorded")
    runs = json.loads(DEMO_TIMES.read_text()) if DEMO_TIMES.exists() else []
    runs.append(
        {
            "date": dt.date.today().isoformat(),
            "wall_s": round(wall, 1),
            "cpus": os.cpu_count(),
            "load_average_1min": round(max(load_before, os.getloadavg()[0]), 2),
        }
    )
    DEMO_TIMES.write_text(json.dumps(runs, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--write", action="store_true", help="rewrite the blocks of README.md and docs/*.md"
    )
    ap.add_argument("--time-demo", action="store_true", help="time make demo, then --write")
    args = ap.parse_args(argv)
    if args.time_demo:
        time_demo()
    want = blocks()
    if args.write or args.time_demo:
        changed = []
        printed = run_example()
        for path in files():
            text = path.read_text(encoding="utf-8")
            new = rewrite(text, want)
            if path == README:
                new = rewrite_example(new, printed)
            if new != text:
                path.write_text(new, encoding="utf-8")
                changed.append(path.relative_to(REPO).as_posix())
        print(f"rewrote the blocks of {', '.join(changed) or 'no file (all agreed)'}")
        return 0
    problems = check_files(want)
    for p in problems:
        print(p)
    if problems:
        print("the plan numbers drifted: python bench/readme_numbers.py --write")
        return 1
    print(f"README.md and docs/: {len(want)} block(s) agree with the plans")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
