"""Planner speed (benchmark 4 of bench/README.md): wall time of the model-only search on the
bank-FAQ spec over all shipped offers, and how it grows with offers and with the space.

Corpus statistics are computed once first (cached) and excluded: this times the search
(`evaluate_space` + `decide`), median of several repeats. Prints a table and writes
bench/results/planner_speed.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def time_search(spec, offers, target, repeats: int) -> tuple[float, float, int]:
    """Median wall and CPU seconds of the search. On a shared machine the wall time includes
    waiting for a core; the process's CPU time is what the search costs on an idle one."""
    from planner.search import decide, evaluate_space

    times, cpu, n = [], [], 0
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        table = evaluate_space(spec, offers, target)
        decide(spec, table, target)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        n = len(table)
    return statistics.median(times), statistics.median(cpu), n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5

    from planner.hardware import load_profiles
    from planner.pipeline import plan_space
    from planner.search import allowed_offers
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
    wide = dataclasses.replace(
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
