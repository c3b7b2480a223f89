"""Planner speed (benchmark 4 of bench/README.md): wall time of the model-only search on the
bank-FAQ spec over all shipped offers, and how it grows with offers and with the space.

Corpus statistics are computed once first (cached) and excluded: this times the search
(`evaluate_space` + `decide`), median of several repeats. Prints a table and writes
bench/results/planner_speed.json.

`--against REV` runs this checkout and another commit side by side in one run (a git worktree
of REV in a temporary folder, each timed in its own subprocess, alternating A, B, A, B, ... so
that the machine's load hits both alike) and prints the CPU-time ratio per space with its noise
(median and the 10-90% range of the per-pair ratios), and whether both chose the same plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def time_search(spec, offers, target, repeats: int) -> tuple[float, float, int]:
    """Median wall and CPU seconds of the search. On a shared machine the wall time includes
    waiting for a core; the process's CPU time is what the search costs on an idle one."""
    from planner.screen.decide import decide
    from planner.screen.evaluate import evaluate_space

    times, cpu, n = [], [], 0
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        table = evaluate_space(spec, offers, target)
        decide(spec, table, target)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        n = len(table)
    return statistics.median(times), statistics.median(cpu), n


def wide_spec(spec):
    """The wide space: no batch range, up to 32 nodes, 3 sequence lengths, 8 micro-batches."""
    return dataclasses.replace(
        spec,
        search=dataclasses.replace(
            spec.search,
            micro_batch_sizes=[1, 2, 4, 8, 16, 32, 64, 128],
            node_counts=[1, 2, 4, 8, 16, 32],
        ),
        constraints=dataclasses.replace(
            spec.constraints,
            max_nodes=32,
            seq_lens=[256, 512, 1024],
            global_batch_tokens_min=0,
            global_batch_tokens_max=0,
        ),
    )


# One timing in a subprocess, with whichever `planner` package is first on its path: CPU
# seconds of the search per space, the number of candidates and the chosen row (described).
_TIMER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from planner.market.hardware import load_profiles
from planner.pipeline import plan_space
from planner.screen import allowed_offers, decide, evaluate_space
from planner.spec import load_spec
spec = load_spec(None, cwd=Path(sys.argv[2]) / "bench")
wide_spec = WIDE_SPEC
_, target, _, _ = plan_space(spec, log=lambda *a: None)
offers = allowed_offers(spec, load_profiles())
out = {}
for name, s in (("bank-FAQ", spec), ("wide", wide_spec(spec))):
    start = time.process_time()
    table = evaluate_space(s, offers, target)
    d = decide(s, table, target)
    cpu = time.process_time() - start
    row = table.row(d.chosen) if d.chosen is not None else {}
    keys = ("offer", "nodes", "precision_code", "seq", "micro", "acc", "tp", "pp", "vpp",
            "stage_code", "shard_degree", "recompute_code", "sp", "spot")
    out[name] = {"cpu_s": cpu, "candidates": len(table),
                 "chosen": [row.get(k) for k in keys], "cost": float(row.get("cost", 0))}
print("RESULT " + json.dumps(out))
"""


def _time_tree(tree: Path, rounds: int) -> dict:
    import inspect

    # the same wide space for both trees (the other commit's bench file may not define it)
    source = "import dataclasses\n" + inspect.getsource(wide_spec) + "WIDE_SPEC = wide_spec\n"
    timer = _TIMER.replace("wide_spec = WIDE_SPEC", source)
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, "-c", timer, str(tree), str(REPO), str(rounds)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"timing {tree} failed: {proc.stderr.strip().splitlines()[-1:]}")


def side_by_side(rev: str, pairs: int) -> int:
    """This checkout against commit `rev`, alternating, `pairs` times each."""
    resolved = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True
    )
    if resolved.returncode != 0:
        print(f"error: --against {rev}: not a commit of this repository", file=sys.stderr)
        return 2
    short = resolved.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="planner_speed-") as tmp:
        other = Path(tmp) / short
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(other), short],
            cwd=REPO,
            check=True,
        )
        try:
            runs: dict = {"this": [], short: []}
            for _ in range(pairs):
                runs["this"].append(_time_tree(REPO, 1))
                runs[short].append(_time_tree(other, 1))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(other)], cwd=REPO, check=False
            )
    rows = []
    for space in runs["this"][0]:
        mine = [r[space]["cpu_s"] for r in runs["this"]]
        theirs = [r[space]["cpu_s"] for r in runs[short]]
        ratios = sorted(a / b for a, b in zip(theirs, mine))
        same = all(
            r[space]["chosen"] == runs[short][0][space]["chosen"]
            for r in runs["this"] + runs[short]
        )
        rows.append(
            [
                space,
                f"{runs['this'][0][space]['candidates']:,} / "
                f"{runs[short][0][space]['candidates']:,}",
                f"{statistics.median(mine):.2f}",
                f"{statistics.median(theirs):.2f}",
                f"{statistics.median(ratios):.2f}x",
                f"{np.quantile(ratios, 0.1):.2f}-{np.quantile(ratios, 0.9):.2f}",
                "yes" if same else "NO",
            ]
        )
    print(
        tabulate(
            rows,
            headers=[
                "space",
                "candidates (this / other)",
                "CPU s this (median)",
                f"CPU s {short} (median)",
                "speed-up (median)",
                "10-90% of pairs",
                "same plan chosen",
            ],
            tablefmt="github",
        )
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{pairs} pairs, alternating; CPU time of each search in its own process (measured); "
        f"load average at the end {load:.1f} on {os.cpu_count()} cores"
    )
    return 0 if all(r[-1] == "yes" for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument(
        "--against",
        default="",
        metavar="REV",
        help="time this checkout and commit REV side by side and print the ratio",
    )
    parser.add_argument("--pairs", type=int, default=5, help="with --against: A/B pairs")
    args = parser.parse_args()
    if args.against:
        return side_by_side(args.against, args.pairs)
    repeats = 2 if args.quick else 5

    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.pipeline import plan_space
    from planner.spec import load_spec

    spec = load_spec(None, cwd=REPO / "bench")  # the embedded bank-FAQ spec
    _, target, _, _ = plan_space(spec, log=lambda *a: None)  # warms the statistics cache
    offers = allowed_offers(spec, load_profiles())
    rows = []
    for count in sorted({1, 4, len(offers) // 2, len(offers)}):
        seconds, cpu, n = time_search(spec, offers[:count], target, repeats)
        rows.append(
            {
                "offers": count,
                "space": "bank-FAQ spec",
                "candidates": n,
                "search_s": seconds,
                "search_cpu_s": cpu,
            }
        )
    wide = wide_spec(spec)
    seconds, cpu, n = time_search(wide, offers, target, repeats)
    rows.append(
        {
            "offers": len(offers),
            "space": "wide (no batch range, 32 nodes, 3 seq)",
            "candidates": n,
            "search_s": seconds,
            "search_cpu_s": cpu,
        }
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        tabulate(
            [
                [
                    r["offers"],
                    r["space"],
                    f"{r['candidates']:,}",
                    f"{r['search_s']:.2f}",
                    f"{r['search_cpu_s']:.2f}",
                    f"{r['candidates'] / r['search_cpu_s']:,.0f}",
                ]
                for r in rows
            ],
            headers=[
                "offers",
                "space",
                "candidates",
                "wall s (median)",
                "CPU s (median)",
                "candidates per CPU s",
            ],
            tablefmt="github",
        )
    )
    print(f"load average at the end: {load:.1f} on {os.cpu_count()} cores")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("planner_speed_quick.json" if args.quick else "planner_speed.json")
    out.write_text(
        json.dumps(
            {
                "date": dt.datetime.now().isoformat(timespec="seconds"),
                "repeats": repeats,
                "rows": rows,
                "load_average": load,
                "command": "python bench/planner_speed.py" + (" --quick" if args.quick else ""),
            },
            indent=1,
        )
    )
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
