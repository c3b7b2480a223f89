"""Leave-one-source-out of the cost model BEFORE issue 17 (the fitted efficiency curve
max · T/(T + T½) · H/(H + H½)), for bench/estimate_accuracy.py's before/after table.

Run inside a checkout of the old model (commit c16353a) with this repository's
published_runs.csv copied in, from that checkout's root:
    git worktree add ../old c16353a && cp hardware_profiles/published_runs.csv \
        ../old/hardware_profiles/ && cd ../old && \
        python <this repo>/bench/published/loso_old_model.py \
        --out <this repo>/bench/results/estimate_accuracy_before_issue17.json
The old model has no model families: Llama rows are read as GPT layers of the same shape
(its behaviour on them). Its interval is the shipped profile's p10/p90 (leave-one-ROW-out).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    sys.path.insert(0, str(Path.cwd()))
    from planner.market.hardware import load_profiles
    from planner.screen import published as pb

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = pb.load_rows()
    cols = pb._columns(rows)
    gens = np.array([r.generation for r in rows])
    srcs = np.array(
        [re.split(r",| table| scripts/| benchmarks/| section", r.source)[0].strip() for r in rows]
    )
    loo = pb.leave_one_out(rows)
    loso = np.full(len(rows), np.nan)
    for gen in sorted(set(gens) - {""}):
        for src in sorted(set(srcs[gens == gen])):
            test = (gens == gen) & (srcs == src)
            train = (gens == gen) & (srcs != src)
            f = pb.fit(cols, train)
            idx = np.flatnonzero(test)
            loso[idx] = pb.predict({k: v[idx] for k, v in cols.items()}, *f.params)
    profiles = load_profiles()
    out = []
    for i, r in enumerate(rows):
        lo, hi = profiles[r.profile].efficiency.interval_ratios(r.params_billion * 1e9)
        out.append(
            {
                "id": r.id,
                "loo_predicted": float(loo["predicted"][i]),
                "loso_predicted": float(loso[i]),
                "measured": float(cols["measured"][i]),
                "interval_p10": lo,
                "interval_p90": hi,
            }
        )
    args.out.write_text(
        json.dumps({"model": "fitted efficiency curve (before issue 17)", "rows": out}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
