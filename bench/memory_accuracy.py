"""Memory model vs measured peak memory per device, and the feasibility band derived from it.

Sources (each measured, none fitted to here):
- Paddle's own peaks: the CPU rehearsals of bench/plan_quality.py (bench/results/
  plan_quality.json, 104 configurations of the CPU demo job: 1-2 processes, fp32/bf16, seq
  64/128, micro 4-32, accumulation 1-2, recompute none/full; peak RSS per process tree).
  Their modelled figure is recomputed here with today's memory model (gptplan.memory), term
  by term, for the same configurations.
- torchtitan's published per-device peaks (benchmarks/llama3_h100_202412_torchtitan.md,
  tables 1 and 3, FSDP rows: 82.4 and 67.0 GiB), rows r218/r219 of
  hardware_profiles/published_runs.csv. PyTorch with per-op selective checkpointing, not
  Paddle: shown, not used for the band.
- Korthikanti et al. 2022 gives per-layer activation bytes (table 2, the model's own source)
  and shares of an 80 GB device in figures, not per-device totals: not a check of the model.

- Paddle's own code (issue 35): the gradient bytes Paddle 3.3.1's group-sharded stage 2
  holds on the busiest rank, computed by running its partition and storage code on each
  GPT shape's parameter list (bench/paddle_memory_code.py), against the model's term.
- Rajbhandari et al. 2020 (ZeRO) table 1: published per-device model states of a 7.5B
  model under P_os / P_os+g / P_os+g+p at DP 4-1024 (bench/published/memory_tables.csv),
  against the model's weights + gradients + optimizer terms.

The band (issue 35) is per layout, each term at its worst credible error
(gptplan.memory.TERM_BAND, memory_band); MEMORY_RATIO_P10/P90 are its widest ends over the
published layouts of hardware_profiles/published_runs.csv (the single factors the
recompute-layer search uses). Writes bench/results/memory_accuracy.json and prints the tables
bench/README.md quotes. Runs in seconds (no probes: it reads the recorded peaks).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np
from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
RESULTS = REPO / "bench" / "results"
TORCHTITAN_PEAK_GIB = {"r218": 82.4, "r219": 67.0}  # the source's tables 1 and 3 (FSDP rows)


def cpu_rows() -> list[dict]:
    """Per recorded CPU configuration: measured peak and today's modelled terms (GB)."""
    from plan_quality import describe, space

    from gptplan.memory import layout_memory_bytes
    from planner.screen import costmodel as cm
    from planner.screen.evaluate import memory_args

    recorded = json.loads((RESULTS / "plan_quality.json").read_text())["grid"]
    measured = {
        r["config"]: r["measured_memory_gb"] for r in recorded if r.get("measured_memory_gb")
    }
    spec, table, _, _ = space(False)
    shape = cm.ModelShape.from_section(spec.model_section())
    out = []
    for i in range(len(table)):
        name = describe(table, i)
        if name not in measured or name in {r["config"] for r in out}:
            continue
        g = {k: table[k][i : i + 1] for k in table.columns}
        prof = table.offers[int(table["offer"][i])].profile
        terms = layout_memory_bytes(shape, g, terms=True, **memory_args(prof))
        terms = {k: float(v[0]) / cm.GB for k, v in terms.items()}
        out.append(
            {
                "config": name,
                "measured_gb": measured[name],
                "modelled_gb": sum(terms.values()),
                "terms_gb": terms,
            }
        )
    return out


def torchtitan_rows() -> list[dict]:
    from gptplan.memory import GIB
    from planner.screen import published as pb

    rows = [r for r in pb.load_rows() if r.id in TORCHTITAN_PEAK_GIB]
    ratio = pb.modelled_memory_over_device(rows)
    return [
        {
            "config": f"{r.id} torchtitan Llama 3.1 8B FSDP, {r.world} H100",
            "measured_gb": TORCHTITAN_PEAK_GIB[r.id] * GIB / 1e9,
            "modelled_gb": float(q * r.prof.memory_gb * GIB / 1e9),
        }
        for r, q in zip(rows, ratio, strict=True)
    ]


def stage2_rows() -> list[dict]:
    """Per GPT shape, stage 2 over 8 ranks, bf16: the gradient bytes Paddle's own code holds
    on the busiest rank (bench/paddle_memory_code.py) and the model's gradient term."""
    from paddle_memory_code import paddle_stage2_gradient_bytes

    from gptplan import memory as mem
    from gptplan import precision
    from gptplan.modelfacts import MODEL_SIZES
    from gptplan.plan import ModelSection

    out = []
    for size in ("gpt-base-110m", "gpt-1.3b", "gpt-6.7b", "gpt-13b"):
        m = ModelSection(**vars(MODEL_SIZES[size]))
        g = dict(seq=2048, micro=1, acc=8, tp=1, pp=1, vpp=1, stage_code=2, shard_degree=8)
        g |= dict(recompute_code=3, sp=0, flash=1, precision_code=precision.code("bf16"))
        g = {k: np.array([v]) for k, v in g.items()}
        shape = mem.ModelShape.from_section(m)
        terms = mem.layout_memory_bytes(
            shape, g, terms=True, **mem.device_memory_args("gpu", 0.0, 1.0)
        )
        out.append(
            {
                "config": f"{size} stage2 x 8 bf16",
                "paddle_code_gb": paddle_stage2_gradient_bytes(m, 8) / 1e9,
                "modelled_gb": float(terms["gradients"][0]) / 1e9,
                "before_gb": 2.0 * shape.params_total / 8 / 1e9,  # 2 bytes x P / d
            }
        )
    return out


def zero_table_rows() -> list[dict]:
    """ZeRO table 1 (bench/published/memory_tables.csv) against the model's model states:
    as the paper splits them (evenly) and as Paddle partitions them (whole parameters; stage
    2's GradStorage buffers)."""
    import csv

    from gptplan import memory as mem
    from gptplan import precision
    from gptplan.plan import SHARDING_STAGES

    out = []
    path = REPO / "bench" / "published" / "memory_tables.csv"
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            n = float(r["params_billion"]) * 1e9
            d = int(r["dp_degree"])
            # a GPT-3-like 7.5B shape (h 4096, 36 layers, ffn 16384, vocab 50304)
            shape = mem.ModelShape(36, 4096, 32, 16384, 50304, int(n), int(n) - 50304 * 4096)
            g = dict(seq=2048, micro=1, acc=1, tp=1, pp=1, vpp=1, shard_degree=d, dp=1)
            g |= dict(recompute_code=3, sp=0, flash=1, precision_code=precision.code("fp16"))
            g["stage_code"] = SHARDING_STAGES.index(r["stage"])
            g = {k: np.array([v]) for k, v in g.items()}
            terms = mem.layout_memory_bytes(
                shape, g, terms=True, **mem.device_memory_args("gpu", 0.0, 1.0)
            )
            states = sum(float(terms[k][0]) for k in ("weights", "gradients", "optimizer"))
            stage = g["stage_code"][0]
            even = n * (2 + (2 if stage < 2 else 2 / d) + 12 / d) if stage < 3 else n * 16 / d
            out.append(
                {
                    "config": f"{r['params_billion']}B {r['stage']} DP {d}",
                    "published_gb": float(r["published_gb"]),
                    "even_split_gb": even / 1e9,
                    "paddle_gb": states / 1e9,
                }
            )
    return out


def published_band() -> dict:
    """The band of every published layout (hardware_profiles/published_runs.csv), as factors
    on its modelled peak: the widest low and high ends, and which term decides them."""
    from gptplan import memory as mem
    from planner.screen import published as pb

    rows = [r for r in pb.load_rows() if r.prof is not None]
    terms = pb.published_memory_terms(rows)
    floor = terms.pop(mem.OPTIMISTIC_FLOOR, None)
    # the terms' own band (the factors MEMORY_RATIO_P10/P90 stand for), then the recompute floor
    low, point, high, decider = mem.memory_band(terms)
    lo, hi = low / point, high / point
    names, counts = np.unique([mem.TERMS[int(k)] for k in decider], return_counts=True)
    card = np.array([r.prof.memory_gb for r in rows]) * mem.GIB
    optimistic = low if floor is None else np.minimum(low, floor)
    return {
        "rows": len(rows),
        "refused": int((optimistic > card).sum()),
        "refused_without_recompute_floor": int((low > card).sum()),
        "optimistic_end_from_full_recompute": int((optimistic < low).sum()),
        "low_min": float(lo.min()),
        "low_median": float(np.median(lo)),
        "high_median": float(np.median(hi)),
        "high_max": float(hi.max()),
        "deciding_terms": dict(zip(names.tolist(), counts.tolist(), strict=True)),
    }


def summary(rows: list[dict]) -> dict:
    ratio = np.array([r["measured_gb"] / r["modelled_gb"] for r in rows])
    ape = np.abs(ratio - 1.0)
    return {
        "rows": len(rows),
        "ratio_p10": float(np.quantile(ratio, 0.1)),
        "ratio_median": float(np.median(ratio)),
        "ratio_p90": float(np.quantile(ratio, 0.9)),
        "ape_median": float(np.median(ape)),
        "ape_worst": float(ape.max()),
    }


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same (it takes seconds)")
    parser.parse_args()
    cpu = cpu_rows()
    titan = torchtitan_rows()
    s_cpu, s_titan = summary(cpu), summary(titan)
    # per term: the share of the modelled peak each term holds, and the residual
    # (measured - modelled) against the runtime term (the one the CPU rehearsals measure best)
    terms = list(cpu[0]["terms_gb"])
    per_term = {
        k: statistics.median(r["terms_gb"][k] / r["modelled_gb"] for r in cpu) for k in terms
    }
    residual = [r["measured_gb"] - r["modelled_gb"] for r in cpu]
    # error per term: measured ~ sum of a factor x each term (least squares); the CPU models are
    # small, so only the runtime and logits terms are large enough to be resolved
    col = {k: np.array([r["terms_gb"][k] for r in cpu]) for k in terms}
    rest = sum(col[k] for k in terms if k not in ("runtime", "logits"))
    x = np.stack([col["runtime"], col["logits"], rest], 1)
    y = np.array([r["measured_gb"] for r in cpu])
    factors = dict(
        zip(("runtime", "logits", "rest"), np.linalg.lstsq(x, y, rcond=None)[0], strict=True)
    )
    print("memory: measured / modelled peak per device")
    print(
        tabulate(
            [
                [
                    name,
                    s["rows"],
                    f"{s['ratio_p10']:.3f}",
                    f"{s['ratio_median']:.3f}",
                    f"{s['ratio_p90']:.3f}",
                    f"{s['ape_median']:.1%}",
                    f"{s['ape_worst']:.1%}",
                ]
                for name, s in (("Paddle CPU rehearsals", s_cpu), ("torchtitan (PyTorch)", s_titan))
            ],
            headers=["source", "rows", "p10", "median", "p90", "median |err|", "worst |err|"],
        )
    )
    print("\nCPU rehearsals, median share of the modelled peak per term:")
    print(tabulate([[k, f"{v:.1%}"] for k, v in per_term.items()], headers=["term", "share"]))
    print(
        f"\nresidual (measured - modelled), GB: median {statistics.median(residual):+.3f}, "
        f"min {min(residual):+.3f}, max {max(residual):+.3f}"
    )
    print(
        "per-term measured/modelled factors (least squares over the CPU rehearsals): "
        + ", ".join(f"{k} x{v:.2f}" for k, v in factors.items())
        + " (rest = weights + gradients + optimizer + activations + allocator, under 6% of "
        "these peaks: not resolved)"
    )
    stage2 = stage2_rows()
    print("\nstage 2 x 8, bf16: gradient GB on the busiest rank, Paddle's code vs the model")
    print(
        tabulate(
            [
                [
                    r["config"],
                    f"{r['paddle_code_gb']:.3f}",
                    f"{r['modelled_gb']:.3f} ({r['modelled_gb'] / r['paddle_code_gb'] - 1:+.1%})",
                    f"{r['before_gb']:.3f} ({r['before_gb'] / r['paddle_code_gb'] - 1:+.1%})",
                ]
                for r in stage2
            ],
            headers=["layout", "Paddle code", "model now", "model before"],
        )
    )
    zero = zero_table_rows()
    print("\nZeRO table 1 (7.5B, model states per device, GB): published vs the model")
    print(
        tabulate(
            [
                [
                    r["config"],
                    r["published_gb"],
                    f"{r['even_split_gb']:.2f}",
                    f"{r['paddle_gb']:.2f}",
                ]
                for r in zero
            ],
            headers=["layout", "published", "even split (paper)", "as Paddle partitions"],
        )
    )
    band = published_band()
    print(
        f"\nband over {band['rows']} published layouts (each term at its worst credible error):"
        f" low x{band['low_min']:.2f} (median x{band['low_median']:.2f}), high median "
        f"x{band['high_median']:.2f}, widest x{band['high_max']:.2f}; deciding terms "
        f"{band['deciding_terms']}"
    )
    print(
        f"refused (even the optimistic end past the card): {band['refused']} of {band['rows']}"
        f" (without the selective-recompute floor, gptplan.memory [SELECTIVE]: "
        f"{band['refused_without_recompute_floor']}); optimistic end from full recompute: "
        f"{band['optimistic_end_from_full_recompute']} layouts"
    )
    print(
        f"MEMORY_RATIO_P10 = {band['low_min']:.2f}, MEMORY_RATIO_P90 = {band['high_max']:.2f}"
        " (gptplan.memory; the single factors where a layout's own band is not at hand)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory_accuracy.json").write_text(
        json.dumps(
            {
                "command": "python bench/memory_accuracy.py",
                "paddle_cpu": s_cpu,
                "torchtitan": s_titan,
                "per_term_share_median": per_term,
                "residual_gb_median": statistics.median(residual),
                "per_term_factor": {k: float(v) for k, v in factors.items()},
                "band": {"p10": band["low_min"], "p90": band["high_max"]},
                "published_band": band,
                "stage2_gradients": stage2,
                "zero_table_1": zero,
                "rows": cpu + titan,
            },
            indent=1,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
