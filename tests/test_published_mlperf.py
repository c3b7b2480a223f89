"""MLPerf Training GPT-3 175B rows of hardware_profiles/published_runs.csv: the extraction
(bench/published/mlperf_gpt3.py) on synthetic configs and logs, and the shipped rows against
the committed cache they are built from."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench" / "published"))

import mlperf_gpt3 as mp  # noqa: E402

RUNS = REPO / "hardware_profiles" / "published_runs.csv"


class FakeMirror(mp.Mirror):
    def __init__(self, files: dict[str, str]):
        self.path, self.commit = Path("fake"), "0" * 40
        self._text = files
        self.files = sorted(files)

    def read(self, name: str) -> str | None:
        return self._text.get(name)


IMPL = "X/benchmarks/gpt3/implementations/nemo"
CONFIG = """\
export MINIBS="${MINIBS:=128}"
export TENSOR_MODEL_PARALLEL=4   #  training.model.tensor_model_parallel_size
export PIPELINE_MODEL_PARALLEL=8
export DGXNNODES="${DGXNNODES:=64}"
if [[ "${MLPERF_VERSION:-}" == "v31" ]]; then
    source $(dirname ${BASH_SOURCE[0]})/config_common_v31.sh
else
    source $(dirname ${BASH_SOURCE[0]})/config_common.sh
fi
source $(dirname ${BASH_SOURCE[0]})/config_fp8.sh
export MICRO_BATCH_SIZE=2
export INTERLEAVED_PIPELINE=6
if [ $MINIBS -eq 128 ];  then
    export INTERLEAVED_PIPELINE=99
fi
"""
FILES = {
    f"{IMPL}/config_DGXH100_64x8x128x4x8_mbs2.sh": CONFIG,
    f"{IMPL}/config_common.sh": "export USE_DIST_OPTIMIZER=True\nexport MICRO_BATCH_SIZE=1\n",
    f"{IMPL}/config_common_v31.sh": "export USE_DIST_OPTIMIZER=False\n",
    f"{IMPL}/config_fp8.sh": "export FP8=True\nexport FP8_HYBRID=True\n",
    f"{IMPL}/conf/custom.yaml": "  sequence_parallel: ${oc.decode:${oc.env:SEQ_PARALLEL,True}}\n"
    "  a: ${oc.decode:${oc.env:ACT_CKPT_GRANULARITY,null}} # 'selective' or 'full'\n",
}


def test_config_follows_sources_takes_the_current_common_and_skips_other_if_bodies():
    mirror = FakeMirror(FILES)
    env = mp.run_config(mirror, f"{IMPL}/config_DGXH100_64x8x128x4x8_mbs2.sh")
    assert env["MINIBS"] == "128" and env["DGXNNODES"] == "64" and env["TENSOR_MODEL_PARALLEL"]
    assert env["USE_DIST_OPTIMIZER"] == "True"  # config_common.sh, not the v31 branch
    assert env["MICRO_BATCH_SIZE"] == "2"  # the config's own line after the sourced common
    assert env["INTERLEAVED_PIPELINE"] == "6" and env["FP8"] == env["FP8_HYBRID"] == "True"
    defaults = mp.implementation_defaults(mirror, IMPL)
    assert defaults == {"SEQ_PARALLEL": "True", "ACT_CKPT_GRANULARITY": "null"}


def _mllog(key, value, time_ms, **meta) -> str:
    rec = {"time_ms": time_ms, "key": key, "value": value, "metadata": meta}
    return ":::MLLOG " + json.dumps(rec)


def test_log_step_time_from_tracked_stats_and_from_blocks():
    gbs, tokens = 4, 4 * mp.SEQ
    lines = [
        _mllog("global_batch_size", gbs, 0),
        _mllog("gradient_accumulation_steps", 2, 0),
        _mllog("run_start", None, 5),
        _mllog("block_start", None, 1000, epoch_count=3 * tokens),
        _mllog("tracked_stats", {"train_step_timing in s": 2.0}, 3000),
        _mllog("tracked_stats", {"train_step_timing": 1.0}, 4000),  # v3.x key
        _mllog("tracked_stats", {"validation_step_timing in s": 9.0}, 4500),
        _mllog("tracked_stats", {"train_step_timing in s": 1.5}, 5000),
        _mllog("block_stop", None, 7000, epoch_count=3 * tokens),
        "noise that is not MLLOG",
    ]
    info = mp.parse_log("\n".join(lines))
    assert info["steps"] == [2.0, 1.0, 1.5] and info["run_start_ms"] == 5
    assert info["global_batch_size"] == 4 and info["gradient_accumulation_steps"] == 2
    assert mp.block_step_s(info) == pytest.approx(2.0)  # 6 s over 3 steps


@pytest.mark.parametrize(
    "text, gbits",
    [
        ("Storage: 2x ConnectX-7 IB NDR 400Gb/s, Compute: 8x ConnectX-7 IB NDR 400Gb/s", 3200),
        ("1x Ethernet 100Gb/Sec, 8x NVIDIA Quantum-2 CX7 InfiniBand (400Gb/s)", 3200),
        ("ROCE2; Data bandwidth for GPU-PCIe: 504 GB/s; PCIe-NIC: 500 GB/s", None),
        ("", None),
    ],
)
def test_inter_node_bandwidth_from_the_system_description(text, gbits):
    assert mp.inter_node_gbits(text) == gbits


def test_vocab_padding_follows_tensor_parallel():
    assert mp.padded_vocab(4) == 50688 and mp.padded_vocab(8) == 51200


def test_shipped_rows_are_the_cache_and_consistent():
    with RUNS.open() as f:
        shipped = [r for r in csv.DictReader(f) if r["source"].startswith("MLPerf Training")]
    built = mp.rows_from_cache()
    assert len(shipped) == len(built) >= 20
    for row, want in zip(shipped, built):
        assert {k: row[k] for k in want} == {k: str(v) for k, v in want.items()}, row["id"]
        world = int(row["nodes"]) * int(row["gpus_per_node"])
        tokens = int(row["micro"]) * int(row["acc"]) * int(row["sharding_degree"]) * mp.SEQ
        assert int(row["tp"]) * int(row["pp"]) * int(row["sharding_degree"]) == world
        assert row["precision"] == "fp8" and row["gpu_profile"] == "h100-80gb"
        step = float(row["notes"].split("; step ")[1].split(" s:")[0])
        assert float(row["measured"]) == pytest.approx(tokens / step / world, rel=1e-3)
    keys = {r["source"].split(",")[0] for r in shipped}
    assert keys == {
        f"MLPerf Training {v} (mlcommons/training_results_{v})"
        for v in ("v3.0", "v3.1", "v4.0", "v4.1")
    }


def test_copies_of_the_same_runs_are_not_rows_twice():
    with mp.CACHE.open() as f:
        cache = list(csv.DictReader(f))
    kept = [r for r in cache if not r["duplicate_of"]]
    starts = [frozenset(r["run_start_ms"].split()) for r in kept]
    assert len(set(starts)) == len(starts)
    assert {r["submitter"] for r in cache if r["duplicate_of"]} >= {"smc-ac-power", "smc-dc-power"}
    rows = [dict(r) for r in cache[:2]]
    rows[1]["run_start_ms"] = rows[0]["run_start_ms"]
    rows[1]["duplicate_of"] = ""
    mp.mark_duplicates(rows)
    first = rows[0]
    assert rows[1]["duplicate_of"] == f"{first['round']} {first['submitter']}/{first['system']}"
