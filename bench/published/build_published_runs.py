"""Build hardware_profiles/published_runs.csv: published training measurements with their exact
sources, the only data the efficiency priors are fitted to (issue 9's source list).

Rows come from:
- MosaicML llm-foundry, scripts/train/benchmarking/README.md (commit 4952183, 2024-04-22; read
  from a checkout passed as --llm-foundry-readme): every BF16 row of the tables "H100 80GB BF16
  (Large Scale)", "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" and
  "A100 40GB with 1600 Gbps node-node interconnect (RoCE)". FP8 rows are left out (no FP8 in
  the planner). Model shapes from scripts/train/yamls/pretrain/mpt-*.yaml.
- Narayanan et al. 2021 (Megatron-LM, SC'21), table 1: the rows for 3.6B, 18.4B, 39.1B, 76.1B,
  310.1B, 529.6B and 1008.0B parameters (only these: the issue reserves the others).
- Zhang et al. 2022 (OPT), section 2.4 / the OPT-175B logbook: 147 TFLOP/s per A100.
- BigScience BLOOM-176B model card (training section): about 150 TFLOP/s per A100.
- torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 9dec370 era, 2024-12):
  Llama 3.1 8B FSDP rows without torch.compile/Float8 (tables 1 and 3), as Llama shapes (GQA 8
  key/value heads, SwiGLU ffn 14336) on the platform the file states (HBM2e 2.4 TB/s, 500 W:
  peak "between SXM and NVL", taken as their midpoint 912 TFLOP/s). The 70B/405B rows use
  Float8 (the 70B bf16 numbers of the 2025-06 async-TP file are only in an image) and are
  left out.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  table 4 (end-to-end iteration time, full recompute vs selective recompute + sequence
  parallel) with the configurations of its table 3 (22B, 175B, 530B, 1T on Selene).
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B",
  system-performance table: 113-126 TFLOP/s per GPU at 280, 350 and 420 DGX A100 nodes.
- MLPerf Training GPT-3 175B, rounds v3.0, v3.1, v4.0 and v4.1 (issue 17), every H100 result
  directory (NVIDIA, NVIDIA_CoreWeave, Azure+NVIDIA, smc, Oracle): rows appended from the
  cached extraction bench/published/mlperf_gpt3_h100.csv (bench/published/mlperf_gpt3.py,
  which reads git snapshots of mlcommons/training_results_vX.Y: the layout from each system's
  config_*.sh and what it sources, global batch and step time from the MLLOG result files).
  Every H100 submission sources config_fp8.sh (FP8=True, FP8_HYBRID=True: Transformer Engine
  FP8 GEMMs, bf16 elsewhere), so these rows have precision `fp8`. Left out: Gaudi2, TPU and
  the B200 preview; smc-ac-power and smc-dc-power (the same logs as smc) and v4.1's 1452-node
  NVIDIA directory (the v4.0 runs again). GPT-3 entered MLPerf Training in v3.0.
PaddleNLP/Paddle: no published GPT pretraining throughput with a full layout was found in the
sources available here; none is included.

Run: python bench/published/build_published_runs.py --llm-foundry-readme README.md
     (or --keep-llm-foundry: keep the llm-foundry rows already in the CSV, rebuild the rest;
     the MLPerf rows come from the cache: refresh it with bench/published/mlperf_gpt3.py)
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlperf_gpt3 import rows_from_cache as mlperf_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "hardware_profiles" / "published_runs.csv"

COLUMNS = [
    "id",
    "source",
    "gpu_profile",
    "nodes",
    "gpus_per_node",
    "model",
    "hidden",
    "layers",
    "heads",
    "ffn",
    "vocab",
    "seq",
    "micro",
    "acc",
    "dp",
    "tp",
    "pp",
    "vpp",
    "sharding",
    "sharding_degree",
    "recompute",
    "sequence_parallel",
    "flash_attention",
    "precision",
    "inter_node_gbits_per_s",
    "measured",
    "measured_unit",
    "notes",
    "family",
    "kv_heads",
    "device_peak_tflops",
    "device_hbm_gbytes_per_s",
    "dropout",
]
# family/kv_heads: the model family (gpt, llama) and grouped-query key/value heads (0 = all);
# device_peak_tflops/device_hbm_gbytes_per_s: the run's device where it differs from the
# profile's datasheet figures (blank = the profile's)

LLMF = (
    "MosaicML llm-foundry scripts/train/benchmarking/README.md @4952183 (2024-04-22), "
    "table '{table}'"
)
MPT = {  # scripts/train/yamls/pretrain/mpt-*.yaml: d_model, n_heads, n_layers; ffn 4h
    "125m": (768, 12, 12),
    "350m": (1024, 16, 24),
    "760m": (1536, 12, 24),
    "1b": (2048, 16, 24),
    "3b": (2560, 20, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}
TABLES = {  # table heading -> (profile, inter-node Gbit/s, note on the network)
    "H100 80GB BF16 (Large Scale, >= 128 GPUs)": (
        "h100-80gb",
        3200,
        "network not stated in the source; 3200 Gbps assumed",
    ),
    "H100 80GB BF16": ("h100-80gb", 3200, "network not stated in the source; 3200 Gbps assumed"),
    "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": ("a100-80gb", 1600, ""),
    "A100 40GB with 1600 Gbps node-node interconnect (RoCE)": ("a100-40gb", 1600, ""),
}


def llm_foundry_rows(readme: Path) -> list[dict]:
    rows, table = [], None
    for line in readme.read_text().splitlines():
        if line.startswith("## "):
            table = line[3:].strip()
            continue
        if table not in TABLES or not line.startswith("|  ") or "---" in line or "Model |" in line:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        (
            model,
            seq,
            gpus,
            _gpu,
            _mfu,
            _hfu,
            _tflop,
            micro,
            acc,
            _gbs,
            _sps,
            _tps,
            tps_gpu,
            _gbt,
            precision,
            _mp,
            shard,
            ckpt,
            _offload,
            _params,
        ) = cells[:20]
        if "fp8" in precision:
            continue
        profile, gbps, note = TABLES[table]
        h, a, L = MPT[model]
        gpus = int(gpus)
        rows.append(
            {
                "source": LLMF.format(table=table),
                "gpu_profile": profile,
                "nodes": gpus // 8,
                "gpus_per_node": 8,
                "model": f"mpt-{model}",
                "hidden": h,
                "layers": L,
                "heads": a,
                "ffn": 4 * h,
                "vocab": 50368,
                "seq": int(seq),
                "micro": int(micro),
                "acc": int(acc),
                "dp": 1,
                "tp": 1,
                "pp": 1,
                "vpp": 1,
                "sharding": {"FULL_SHARD": "stage3", "SHARD_GRAD_OP": "stage2"}[shard],
                "sharding_degree": gpus,
                "recompute": "full" if ckpt == "True" else "none",
                "sequence_parallel": 0,
                "flash_attention": 1,
                "precision": "bf16",
                "inter_node_gbits_per_s": gbps,
                "measured": float(tps_gpu),
                "measured_unit": "tokens_per_s_per_device",
                "notes": "; ".join(
                    x
                    for x in (
                        note,
                        "PyTorch FSDP (Composer), MPT with flash "
                        "attention, ALiBi (no position embeddings)",
                    )
                    if x
                ),
            }
        )
    return rows


MEGATRON = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU "
    "Clusters Using Megatron-LM (SC'21), table 1, row {name}"
)
MEGATRON_NOTE = (
    "Selene: 8 x A100 80GB per node, 8 x 200 Gbps HDR InfiniBand; fp16, full "
    "activation recompute; measured = achieved TFLOP/s per GPU counted with the "
    "paper's eq. 3 (recompute included); micro-batch not in table 1: 1 assumed"
)
# name, params label, heads, hidden, layers, tp, pp, gpus, global batch, TFLOP/s per GPU
MEGATRON_ROWS = [
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def paper_rows() -> list[dict]:
    rows = []
    for name, a, h, L, tp, pp, gpus, batch, tflops in MEGATRON_ROWS:
        dp = gpus // (tp * pp)
        rows.append(
            {
                "source": MEGATRON.format(name=name),
                "gpu_profile": "a100-80gb",
                "nodes": gpus // 8,
                "gpus_per_node": 8,
                "model": f"gpt-{name}",
                "hidden": h,
                "layers": L,
                "heads": a,
                "ffn": 4 * h,
                "vocab": 51200,
                "seq": 2048,
                "micro": 1,
                "acc": batch // dp,
                "dp": dp,
                "tp": tp,
                "pp": pp,
                "vpp": 1,
                "sharding": "",
                "sharding_degree": 1,
                "recompute": "full",
                "sequence_parallel": 0,
                "flash_attention": 0,
                "precision": "fp16",
                "inter_node_gbits_per_s": 1600,
                "measured": float(tflops),
                "measured_unit": "tflops_per_device_megatron_eq3",
                "notes": MEGATRON_NOTE,
            }
        )
    rows.append(
        {
            "source": "Zhang et al. 2022, OPT: Open Pre-trained Transformer Language Models, "
            "section 2.4 (and the OPT-175B logbook): 147 TFLOP/s per GPU",
            "gpu_profile": "a100-80gb",
            "nodes": 124,
            "gpus_per_node": 8,
            "model": "opt-175b",
            "hidden": 12288,
            "layers": 96,
            "heads": 96,
            "ffn": 49152,
            "vocab": 50272,
            "seq": 2048,
            "micro": 8,
            "acc": 1,
            "dp": 1,
            "tp": 8,
            "pp": 1,
            "vpp": 1,
            "sharding": "stage3",
            "sharding_degree": 124,
            "recompute": "full",
            "sequence_parallel": 0,
            "flash_attention": 0,
            "precision": "fp16",
            "inter_node_gbits_per_s": 1600,
            "measured": 147.0,
            "measured_unit": "tflops_per_device_megatron_eq3",
            "family": "gpt",
            "kv_heads": 0,
            "notes": "992 A100 80GB, Megatron tensor parallel 8 + FSDP, ~2M-token batch (micro 8 "
            "x 124 data ranks assumed); network: Azure NDm A100 v4 class (8 x 200 Gbps) "
            "assumed; the FLOP count convention of 147 is taken as Megatron's eq. 3",
        }
    )
    rows.append(
        {
            "source": "BigScience BLOOM-176B model card, training section (about 150 TFLOP/s per "
            "GPU) with the layout of its Megatron-DeepSpeed config",
            "gpu_profile": "a100-80gb",
            "nodes": 48,
            "gpus_per_node": 8,
            "model": "bloom-176b",
            "hidden": 14336,
            "layers": 70,
            "heads": 112,
            "ffn": 57344,
            "vocab": 250880,
            "seq": 2048,
            "micro": 2,
            "acc": 128,
            "dp": 8,
            "tp": 4,
            "pp": 12,
            "vpp": 1,
            "sharding": "",
            "sharding_degree": 1,
            "recompute": "full",
            "sequence_parallel": 0,
            "flash_attention": 0,
            "precision": "bf16",
            "inter_node_gbits_per_s": 400,
            "measured": 150.0,
            "measured_unit": "tflops_per_device_megatron_eq3",
            "family": "gpt",
            "kv_heads": 0,
            "notes": "384 A100 80GB on 48 nodes (Jean Zay), tp 4 pp 12 dp 8, ZeRO stage 1 "
            "(optimizer states over dp 8; modelled as plain dp), global batch 2048 x 2048; "
            "4 x 100 Gbps Omni-Path per node",
        }
    )
    titan = (
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024-12), table {t}, "
        "row FSDP (no torch.compile, no Float8)"
    )
    for t, gpus, tps in ((1, 8, 5762.0), (3, 128, 5605.0)):
        rows.append(
            {
                "source": titan.format(t=t),
                "gpu_profile": "h100-80gb",
                "nodes": gpus // 8,
                "gpus_per_node": 8,
                "model": "llama3.1-8b",
                "hidden": 4096,
                "layers": 32,
                "heads": 32,
                "ffn": 14336,
                "vocab": 128256,
                "seq": 8192,
                "micro": 2,
                "acc": 1,
                "dp": 1,
                "tp": 1,
                "pp": 1,
                "vpp": 1,
                "sharding": "stage3",
                "sharding_degree": gpus,
                "recompute": "core_attn",
                "sequence_parallel": 0,
                "flash_attention": 1,
                "precision": "bf16",
                "inter_node_gbits_per_s": 3200,
                "measured": tps,
                "measured_unit": "tokens_per_s_per_device",
                "family": "llama",
                "kv_heads": 8,
                "device_peak_tflops": 912.0,
                "device_hbm_gbytes_per_s": 2400.0,
                "notes": "Grand Teton H100 96GB HBM2e (2.4 TB/s) at a 500 W power limit; peak "
                "between SXM (989) and NVL (835) per the source, midpoint taken; 400 Gb/s "
                "RDMA per GPU; selective activation checkpointing modelled as core_attn",
            }
        )
    return rows + korthikanti_rows() + mtnlg_rows()


KORTHIKANTI = (
    "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer "
    "Models, table 4 ({mode}), model {name} of table 3"
)
# name, heads, hidden, layers, tp, pp, GPUs, global batch, seconds per iteration: full
# recompute, selective recompute + sequence parallel (table 4)
KORTHIKANTI_ROWS = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
]


def korthikanti_rows() -> list[dict]:
    rows = []
    for name, a, h, L, tp, pp, gpus, batch, full_s, selective_s in KORTHIKANTI_ROWS:
        for mode, seconds, recompute, sp in (
            ("full recompute", full_s, "full", 0),
            ("present work", selective_s, "core_attn", 1),
        ):
            rows.append(
                {
                    "source": KORTHIKANTI.format(mode=mode, name=name),
                    "gpu_profile": "a100-80gb",
                    "nodes": max(gpus // 8, 1),
                    "gpus_per_node": 8,
                    "model": f"gpt-{name}",
                    "hidden": h,
                    "layers": L,
                    "heads": a,
                    "ffn": 4 * h,
                    "vocab": 51200,
                    "seq": 2048,
                    "micro": 1,
                    "acc": batch // (gpus // (tp * pp)),
                    "dp": gpus // (tp * pp),
                    "tp": tp,
                    "pp": pp,
                    "vpp": 1,
                    "sharding": "",
                    "sharding_degree": 1,
                    "recompute": recompute,
                    "sequence_parallel": sp,
                    "flash_attention": 0,
                    "precision": "fp16",
                    "inter_node_gbits_per_s": 1600,
                    "measured": round(batch * 2048 / seconds / gpus, 2),
                    "measured_unit": "tokens_per_s_per_device",
                    "family": "gpt",
                    "kv_heads": 0,
                    "notes": "Selene DGX A100 80GB, 8 x 200 Gbps HDR InfiniBand; "
                    f"measured = global "
                    f"batch {batch} x 2048 tokens / {seconds} s / {gpus} GPUs; micro-batch 1 "
                    "assumed; selective recompute modelled as core_attn",
                }
            )
    return rows


MTNLG = (
    "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, "
    "system performance table, {nodes} nodes: {tflops} TFLOP/s per GPU"
)


def mtnlg_rows() -> list[dict]:
    rows = []
    for nodes, tflops in ((280, 126.0), (350, 121.0), (420, 113.0)):
        dp = nodes * 8 // (8 * 35)
        rows.append(
            {
                "source": MTNLG.format(nodes=nodes, tflops=int(tflops)),
                "gpu_profile": "a100-80gb",
                "nodes": nodes,
                "gpus_per_node": 8,
                "model": "mt-nlg-530b",
                "hidden": 20480,
                "layers": 105,
                "heads": 128,
                "ffn": 81920,
                "vocab": 51200,
                "seq": 2048,
                "micro": 1,
                "acc": 1920 // dp,
                "dp": dp,
                "tp": 8,
                "pp": 35,
                "vpp": 1,
                "sharding": "",
                "sharding_degree": 1,
                "recompute": "full",
                "sequence_parallel": 0,
                "flash_attention": 0,
                "precision": "fp16",
                "inter_node_gbits_per_s": 1600,
                "measured": tflops,
                "measured_unit": "tflops_per_device_megatron_eq3",
                "family": "gpt",
                "kv_heads": 0,
                "notes": "Selene DGX A100 80GB, 8 x 200 Gbps HDR InfiniBand; tp 8 x pp 35 x dp; "
                "global batch 1920 x 2048; micro-batch 1; full activation checkpointing; "
                "DeepSpeed ZeRO-1 modelled as plain data parallel",
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llm-foundry-readme",
        type=Path,
        help="scripts/train/benchmarking/README.md of an llm-foundry checkout",
    )
    parser.add_argument(
        "--keep-llm-foundry",
        action="store_true",
        help="take the llm-foundry rows from the current CSV",
    )
    args = parser.parse_args()
    if args.keep_llm_foundry:
        with OUT.open() as f:
            foundry = [r for r in csv.DictReader(f) if "llm-foundry" in r["source"]]
    elif args.llm_foundry_readme:
        foundry = llm_foundry_rows(args.llm_foundry_readme)
    else:
        parser.error("give --llm-foundry-readme or --keep-llm-foundry")
    for row in foundry:
        row.setdefault("family", "gpt")
        row["family"] = row.get("family") or "gpt"
        row["kv_heads"] = row.get("kv_heads") or 0
        row["dropout"] = 0.0  # MPT's attn_pdrop, resid_pdrop and emb_pdrop default to 0
    rows = foundry + paper_rows() + mlperf_rows()
    for i, row in enumerate(rows):
        row["id"] = f"r{i:03d}"
    with OUT.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
