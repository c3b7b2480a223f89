"""MLPerf Training GPT-3 175B results on H100 (rounds v3.0, v3.1, v4.0, v4.1) as published-run
rows (issue 17 allows this source).

Two stages, so hardware_profiles/published_runs.csv can be rebuilt without the repositories:
1. `extract` (this file's CLI) reads bare git snapshots of mlcommons/training_results_v3.0 ...
   v4.1 (`git show HEAD:path`, no work tree needed) and writes the raw fields of every H100
   GPT-3 result directory to bench/published/mlperf_gpt3_h100.csv (committed):
   - the layout from the submitter's config_<SYSTEM>_<nodes>x8x<minibs>x<tp>x<pp>_mbs<m>.sh and
     what it sources (config_common.sh, config_fp8.sh, config_tp_h100.sh), with the defaults of
     the implementation's conf/custom.yaml (`${oc.env:NAME,default}`) or run_and_time.sh
     (`: "${NAME:=default}"`) for variables the scripts leave unset (INTERLEAVED_PIPELINE,
     SEQ_PARALLEL, ACT_CKPT_*);
   - global batch and gradient-accumulation steps from the result logs (MLLOG
     `global_batch_size`, `gradient_accumulation_steps`): they are what ran, and they override
     the config's MINIBS default where the two differ (NVIDIA v4.0 n64 ran MINIBS 144);
   - step time: per result file the median of MLLOG `tracked_stats` `train_step_timing`; where
     a log has none (NVIDIA's CUDA-graph runs at 1344/1452 nodes) the median over training
     blocks of (block_stop - block_start) / steps in the block (`epoch_count` is in tokens);
     then the median over the result files. Both estimates are kept where both exist;
   - the inter-node network from <submitter>/systems/<system>.json `host_networking`.
2. `rows_from_cache` turns that CSV into published_runs rows (precision `fp8`: every H100
   submission sources config_fp8.sh, FP8=True FP8_HYBRID=True, i.e. Transformer Engine FP8
   GEMMs with bf16 elsewhere).

Run: python bench/published/mlperf_gpt3.py --mirror v3.0=DIR --mirror v3.1=DIR ...
     (DIR: a bare git directory or a checkout of mlcommons/training_results_vX.Y)
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

CACHE = Path(__file__).resolve().parent / "mlperf_gpt3_h100.csv"
SEQ = 2048
# The benchmark's SentencePiece model (c4_en_301_5Mexp2_spm) has 50257 entries (the MLPerf Pax
# reference's PassThroughVocabulary(size=50257)); NeMo pads to a multiple of
# make_vocab_size_divisible_by (128) x tp.
SPM_VOCAB = 50257
CACHE_COLUMNS = [
    "round",
    "commit",
    "submitter",
    "system",
    "config",
    "config_copies",
    "accelerator",
    "nodes",
    "gpus_per_node",
    "tp",
    "pp",
    "vpp",
    "micro",
    "config_minibs",
    "gbs",
    "acc",
    "sequence_parallel",
    "dist_optimizer",
    "act_ckpt_granularity",
    "fp8",
    "fp8_hybrid",
    "cuda_graph",
    "defaults_from",
    "host_networking",
    "inter_node_gbits_per_s",
    "result_files",
    "step_s_tracked",
    "step_s_blocks",
    "step_s",
    "step_method",
    "throughput_logged",
    "run_start_ms",
    "duplicate_of",
]


class Mirror:
    """One snapshot of a results repository, read through git (works on a bare directory)."""

    def __init__(self, path: Path):
        self.path = path
        out = self._git("ls-tree", "-r", "--name-only", "HEAD")
        self.files = out.splitlines()
        self.commit = self._git("rev-parse", "HEAD").strip()

    def _git(self, *args: str) -> str:
        proc = subprocess.run(
            ["git", "-C", str(self.path), *args], capture_output=True, text=True, check=False
        )
        if proc.returncode:
            raise OSError(f"{self.path}: git {' '.join(args[:2])}: {proc.stderr.strip()}")
        return proc.stdout

    def read(self, name: str) -> str | None:
        try:
            return self._git("show", f"HEAD:{name}")
        except OSError:
            return None  # listed but absent from the snapshot (large files may be)


# ---------------------------------------------------------------- shell configs


ASSIGN = re.compile(r"^(?:export\s+)?([A-Z_][A-Z0-9_]*)=(.*)$")
DEFAULT_ONLY = re.compile(r'^:\s*"?\$\{([A-Z_][A-Z0-9_]*):?[=-]([^}]*)\}"?')
SOURCE = re.compile(r"^source\s+\$\(dirname \$\{BASH_SOURCE\[0\]\}\)/(\S+)")


def _value(raw: str, env: dict[str, str]) -> str | None:
    """The value of a simple shell right-hand side; None for what this reader does not run."""
    raw = raw.split(" #", 1)[0].strip().strip('"').strip("'")
    m = re.fullmatch(r"\$\{([A-Z_][A-Z0-9_]*):?[=-]([^}]*)\}", raw)
    if m:  # "${X:=default}": the default unless already set (the run's environment is unknown)
        return env.get(m.group(1)) or m.group(2)
    if "$" in raw or "`" in raw:
        return None
    return raw


def run_config(mirror: Mirror, path: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables a config script sets, following `source` of sibling scripts. Bodies of `if`
    blocks are skipped (they set clocks, walltimes and proxy-run values), except that the
    `MLPERF_VERSION == v31` choice takes its else branch (the current config_common.sh)."""
    env = {} if env is None else env
    text = mirror.read(path) or ""
    depth, in_version_if, taking = 0, False, True
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("if "):
            depth += 1
            in_version_if, taking = "MLPERF_VERSION" in line, False
            continue
        if line.startswith(("elif", "else")) and depth == 1:
            taking = in_version_if and line.startswith("else")
            continue
        if line == "fi" or line.startswith("fi "):
            depth = max(depth - 1, 0)
            in_version_if, taking = False, True
            continue
        if depth and not taking:
            continue
        m = SOURCE.match(line)
        if m:
            run_config(mirror, str(Path(path).parent / m.group(1)), env)
            continue
        m = DEFAULT_ONLY.match(line)
        if m:
            env.setdefault(m.group(1), m.group(2).strip('"'))
            continue
        m = ASSIGN.match(line)
        if m:
            val = _value(m.group(2), env)
            if val is not None:
                env[m.group(1)] = val
    return env


def implementation_defaults(mirror: Mirror, impl_dir: str) -> dict[str, str]:
    """Defaults the implementation applies to unset variables: conf/custom.yaml's
    `${oc.env:NAME,default}` and run_and_time.sh's `: "${NAME:=default}"`."""
    out: dict[str, str] = {}
    yaml = mirror.read(f"{impl_dir}/conf/custom.yaml") or ""
    for name, default in re.findall(r"oc\.env:([A-Z_][A-Z0-9_]*),([^}$]+)\}", yaml):
        out.setdefault(name, default.strip())
    script = mirror.read(f"{impl_dir}/run_and_time.sh") or ""
    for line in script.splitlines():
        m = DEFAULT_ONLY.match(line.strip())
        if m:
            out.setdefault(m.group(1), m.group(2).strip('"'))
    return out


# ---------------------------------------------------------------- result logs


def parse_log(text: str) -> dict:
    """Step times and batch facts from one MLLOG result file."""
    info: dict = {"steps": [], "blocks": [], "throughput": None}
    block_start = None
    for line in text.splitlines():
        if ":::MLLOG" not in line:
            continue
        try:
            rec = json.loads(line.split(":::MLLOG", 1)[1])
        except json.JSONDecodeError:
            continue
        key, val, meta = rec.get("key"), rec.get("value"), rec.get("metadata") or {}
        if key == "tracked_stats" and isinstance(val, dict):
            for k, v in val.items():
                if k.startswith("train_step_timing"):
                    info["steps"].append(float(v))
                elif k == "throughput":
                    info["throughput"] = float(v)
        elif key in ("global_batch_size", "gradient_accumulation_steps", "submission_platform"):
            info.setdefault(key, val)
        elif key == "run_start":
            info.setdefault("run_start_ms", rec["time_ms"])
        elif key == "block_start":
            block_start = rec["time_ms"]
        elif key == "block_stop" and block_start is not None:
            info["blocks"].append((rec["time_ms"] - block_start, meta.get("epoch_count")))
            block_start = None
    return info


def block_step_s(info: dict) -> float | None:
    """Median seconds per step over training blocks (block_stop - block_start; epoch_count is
    the block's tokens)."""
    gbs = info.get("global_batch_size")
    per = [
        ms / 1000 / (count / (gbs * SEQ)) for ms, count in info["blocks"] if count and gbs and ms
    ]
    return statistics.median(per) if per else None


# ---------------------------------------------------------------- systems


def inter_node_gbits(host_networking: str) -> int | None:
    """Compute-fabric bandwidth per node from a system description, e.g. 'Compute: 8x
    ConnectX-7 IB NDR 400Gb/s' or '8x NVIDIA Quantum-2 CX7 InfiniBand (400Gb/s)' -> 3200."""
    for part in host_networking.split(","):
        if "storage" in part.lower() and "compute" not in part.lower():
            continue
        m = re.search(r"(\d+)\s*x\s*[^,]*?(?:IB|InfiniBand)[^,]*?(\d+)\s*Gb", part)
        if m:
            return int(m.group(1)) * int(m.group(2))
    return None


# ---------------------------------------------------------------- extraction


HELPER_CONFIGS = ("config_common", "config_fp8", "config_tp_", "config_shared")


def _fallback_defaults(mirror: Mirror, impl: str) -> tuple[dict[str, str], str]:
    """conf/custom.yaml defaults of the round's NVIDIA NeMo implementation built from the same
    container (Dockerfile FROM image:tag), for a submitter that published its scripts without conf/
    (Oracle v4.1 runs NVIDIA's v4.1 code)."""
    base = _from_line(mirror.read(f"{impl}/Dockerfile") or "")
    for name in sorted(mirror.files):
        if name.startswith("NVIDIA/benchmarks/gpt3/") and name.endswith("/conf/custom.yaml"):
            nv_impl = name[: -len("/conf/custom.yaml")]
            if base and _from_line(mirror.read(f"{nv_impl}/Dockerfile") or "") == base:
                return implementation_defaults(mirror, nv_impl), nv_impl
    return {}, ""


def _from_line(dockerfile: str) -> str:
    m = re.search(r"^ARG FROM_IMAGE_NAME=(\S+)", dockerfile, re.M)
    return m.group(1).rsplit("/", 1)[-1] if m else ""  # the image and tag, any registry


def _configs(mirror: Mirror, submitter: str) -> dict[str, dict[str, str]]:
    """Every system config of a submitter's GPT-3 implementation(s) with its variables;
    `_defaults_from` names where unset variables' defaults came from."""
    out = {}
    for name in mirror.files:
        base = name.rsplit("/", 1)[-1]
        if not name.startswith(f"{submitter}/benchmarks/gpt3/") or not base.endswith(".sh"):
            continue
        if not base.startswith("config_") or base.startswith(HELPER_CONFIGS):
            continue
        env = run_config(mirror, name)
        impl = str(Path(name).parent)
        defaults, origin = implementation_defaults(mirror, impl), impl
        if "SEQ_PARALLEL" not in defaults and "SEQ_PARALLEL" not in env:
            defaults, origin = _fallback_defaults(mirror, impl)
        out[name] = {**defaults, **env, "_defaults_from": origin}
    return out


def _pick_config(configs: dict, nodes: int, system: str) -> tuple[str, dict, int] | None:
    """The config whose DGXNNODES is the run's node count: the one under the system's own
    implementation directory if there is one, else the first (identical copies are counted)."""
    match = [(p, env) for p, env in sorted(configs.items()) if env.get("DGXNNODES") == str(nodes)]
    if not match:
        return None
    own = [m for m in match if f"/{system}/" in m[0]]
    path, env = (own or match)[0]
    texts = {json.dumps({**e, "_defaults_from": ""}, sort_keys=True) for _, e in match}
    return path, env, len(match) if len(texts) == 1 else 1


def _result_dirs(mirror: Mirror) -> dict[tuple[str, str], list[str]]:
    dirs: dict[tuple[str, str], list[str]] = {}
    for name in mirror.files:
        parts = name.split("/")
        if len(parts) == 5 and parts[1] == "results" and parts[3] == "gpt3":
            if parts[4].startswith("result_") and parts[4].endswith(".txt"):
                dirs.setdefault((parts[0], parts[2]), []).append(name)
    return dirs


def extract_round(mirror: Mirror, rnd: str, skipped: list[str]) -> list[dict]:
    rows = []
    for (submitter, system), files in sorted(_result_dirs(mirror).items()):
        sysjson = json.loads(mirror.read(f"{submitter}/systems/{system}.json") or "{}")
        accel = sysjson.get("accelerator_model_name", "")
        if "H100" not in accel:
            skipped.append(f"{rnd} {submitter}/{system}: accelerator {accel or 'unknown'}")
            continue
        logs = [(f, mirror.read(f)) for f in sorted(files)]
        missing = [f for f, t in logs if t is None]
        infos = [parse_log(t) for _, t in logs if t]
        if missing:
            skipped.append(f"{rnd} {submitter}/{system}: absent from the snapshot: {missing}")
        if not infos:
            continue
        nodes = int(sysjson.get("number_of_nodes") or 0)
        picked = _pick_config(_configs(mirror, submitter), nodes, system)
        if picked is None:
            skipped.append(f"{rnd} {submitter}/{system}: no config_*.sh for {nodes} nodes")
            continue
        record = _record(rnd, submitter, system, sysjson, picked, infos)
        rows.append({"commit": mirror.commit, **record})
    return rows


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def _record(rnd, submitter, system, sysjson, picked, infos) -> dict:
    path, env, copies = picked
    tracked = _median([statistics.median(i["steps"]) if i["steps"] else None for i in infos])
    blocks = _median([block_step_s(i) for i in infos])
    gbs = {i.get("global_batch_size") for i in infos}
    acc = {i.get("gradient_accumulation_steps") for i in infos}
    if len(gbs) != 1 or len(acc) != 1:
        raise ValueError(f"{submitter}/{system}: result files disagree on batch: {gbs} {acc}")
    net = sysjson.get("host_networking", "")
    return {
        "round": rnd,
        "submitter": submitter,
        "system": system,
        "config": path,
        "config_copies": copies,
        "accelerator": sysjson.get("accelerator_model_name", ""),
        "nodes": int(sysjson["number_of_nodes"]),
        "gpus_per_node": int(sysjson.get("accelerators_per_node") or 8),
        "tp": int(env["TENSOR_MODEL_PARALLEL"]),
        "pp": int(env["PIPELINE_MODEL_PARALLEL"]),
        "vpp": int(env.get("INTERLEAVED_PIPELINE") or 1),
        "micro": int(env["MICRO_BATCH_SIZE"]),
        "config_minibs": int(env["MINIBS"]),
        "gbs": gbs.pop(),
        "acc": acc.pop(),
        "sequence_parallel": env.get("SEQ_PARALLEL", ""),
        "dist_optimizer": env.get("USE_DIST_OPTIMIZER", ""),
        "act_ckpt_granularity": env.get("ACT_CKPT_GRANULARITY", ""),
        "fp8": env.get("FP8", ""),
        "fp8_hybrid": env.get("FP8_HYBRID", ""),
        "cuda_graph": int(env.get("LAYER_CUDA_GRAPH", "0") in ("1", "True")),
        "defaults_from": env["_defaults_from"],
        "host_networking": net,
        "inter_node_gbits_per_s": inter_node_gbits(net) or "",
        "result_files": len(infos),
        "step_s_tracked": tracked if tracked is not None else "",
        "step_s_blocks": blocks if blocks is not None else "",
        "step_s": tracked if tracked is not None else blocks,
        "step_method": "train_step_timing" if tracked is not None else "blocks",
        "throughput_logged": _median([i["throughput"] for i in infos]) or "",
        "run_start_ms": " ".join(str(i.get("run_start_ms")) for i in infos),
        "duplicate_of": "",
    }


def mark_duplicates(rows: list[dict]) -> None:
    """A result directory whose runs (run_start times) were already seen is a copy (smc-ac-power
    and smc-dc-power repeat smc's logs; v4.1 re-lists v4.0's 1452-node runs)."""
    seen: dict[frozenset, str] = {}
    for row in rows:
        key = frozenset(row["run_start_ms"].split())
        if key in seen:
            row["duplicate_of"] = seen[key]
        else:
            seen[key] = f"{row['round']} {row['submitter']}/{row['system']}"


def extract(mirrors: dict[str, Path]) -> tuple[list[dict], list[str]]:
    rows: list[dict] = []
    skipped: list[str] = []
    for rnd in sorted(mirrors):
        rows += extract_round(Mirror(mirrors[rnd]), rnd, skipped)
    mark_duplicates(rows)
    return rows, skipped


def write_cache(rows: list[dict], path: Path = CACHE) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CACHE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


# ---------------------------------------------------------------- published_runs rows


ASSUMED_GBITS = 3200  # 8 x 400 Gb/s per node, where the system description does not say


def padded_vocab(tp: int, divisible_by: int = 128) -> int:
    """NeMo/Megatron pad the vocabulary to a multiple of make_vocab_size_divisible_by x tp."""
    multiple = divisible_by * tp
    return -(-SPM_VOCAB // multiple) * multiple


def source_of(rec: dict) -> str:
    """`MLPerf Training vX.Y (mlcommons/training_results_vX.Y)` is the source key (one source
    per round, planner.screen.published.source_key); the config and the results directory follow."""
    rnd = rec["round"]
    return (
        f"MLPerf Training {rnd} (mlcommons/training_results_{rnd}), {rec['config']} and "
        f"{rec['submitter']}/results/{rec['system']}/gpt3 (commit {rec['commit'][:7]})"
    )


def _row_notes(rec: dict, dp: int, step_s: float, gbits_assumed: bool) -> str:
    notes = [
        f"round {rec['round']}, submitter {rec['submitter']}, system {rec['system']} "
        f"({rec['nodes']} x {rec['gpus_per_node']} {rec['accelerator']}; network: "
        f"{rec['host_networking'] or 'not stated'})",
        "NeMo Megatron GPT with Transformer Engine FP8 hybrid (config_fp8.sh: FP8=True, "
        "FP8_HYBRID=True): GEMMs in FP8, the rest bf16",
        f"tp {rec['tp']} pp {rec['pp']}, interleaved schedule with {rec['vpp']} model chunks "
        "per stage, "
        f"sequence parallel, distributed optimizer (ZeRO-1-like: stage1 over {dp} data ranks), "
        "no activation checkpointing (ACT_CKPT_* null), TE fused/flash attention",
        f"global batch {rec['gbs']} x {SEQ} tokens, micro {rec['micro']}, acc {rec['acc']}",
        f"step {step_s:g} s: median over {rec['result_files']} result files of "
        + (
            "each run's median MLLOG train_step_timing"
            if rec["step_method"] == "train_step_timing"
            else "each run's median block time per step (block_stop - block_start over its "
            "steps; the logs have no train_step_timing; where both exist on NVIDIA's runs the "
            "block estimate is 0.2-2.4% longer, 1.3-2.4% at 512-1344 nodes)"
        ),
        f"vocab {SPM_VOCAB} (SentencePiece c4_en_301_5Mexp2_spm) padded by NeMo to a multiple "
        f"of 128 x tp",
    ]
    if int(rec["config_minibs"]) * dp != int(rec["gbs"]):
        notes.append(
            f"the config's default MINIBS {rec['config_minibs']} gives global batch "
            f"{int(rec['config_minibs']) * dp}; the logs record {rec['gbs']} (run with an "
            "override), used here"
        )
    if int(rec["cuda_graph"]):
        notes.append("per-layer CUDA graphs (LAYER_CUDA_GRAPH=1)")
    if int(rec["config_copies"]) > 1:
        notes.append(f"the same config is published in {rec['config_copies']} directories")
    if not rec["config"].startswith(rec["defaults_from"]):
        notes.append(
            "the submitter published no conf/custom.yaml; its defaults (SEQ_PARALLEL True, "
            f"ACT_CKPT null, ...) taken from {rec['defaults_from']} (same container)"
        )
    if gbits_assumed:
        notes.append(f"per-node network bandwidth not stated: {ASSUMED_GBITS} Gb/s assumed")
    return "; ".join(notes)


def rows_from_cache(path: Path = CACHE) -> list[dict]:
    """published_runs.csv rows (without id) from the cached extraction; copies skipped."""
    with path.open() as f:
        recs = [r for r in csv.DictReader(f) if not r["duplicate_of"]]
    rows = []
    for rec in recs:
        nodes, gpn = int(rec["nodes"]), int(rec["gpus_per_node"])
        tp, pp, micro, gbs = int(rec["tp"]), int(rec["pp"]), int(rec["micro"]), int(rec["gbs"])
        dp = nodes * gpn // (tp * pp)
        if gbs % (dp * micro) or gbs // (dp * micro) != int(rec["acc"]):
            raise ValueError(f"{path}: {rec['system']}: gbs {gbs} != dp {dp} x micro x acc")
        if rec["act_ckpt_granularity"] not in ("", "null") or rec["sequence_parallel"] != "True":
            raise ValueError(f"{path}: {rec['system']}: layout outside what this reader maps")
        step_s = float(rec["step_s"])
        gbits = int(rec["inter_node_gbits_per_s"] or 0)
        rows.append(
            {
                "source": source_of(rec),
                "gpu_profile": "h100-80gb",
                "nodes": nodes,
                "gpus_per_node": gpn,
                "model": "gpt3-175b",
                "hidden": 12288,
                "layers": 96,
                "heads": 96,
                "ffn": 49152,
                "vocab": padded_vocab(tp),
                "seq": SEQ,
                "micro": micro,
                "acc": int(rec["acc"]),
                "dp": 1,
                "tp": tp,
                "pp": pp,
                "vpp": int(rec["vpp"]),
                "sharding": "stage1",
                "sharding_degree": dp,
                "recompute": "none",
                "sequence_parallel": 1,
                "flash_attention": 1,
                "precision": "fp8",
                "inter_node_gbits_per_s": gbits or ASSUMED_GBITS,
                "measured": round(gbs * SEQ / step_s / (nodes * gpn), 2),
                "measured_unit": "tokens_per_s_per_device",
                "family": "gpt",
                "kv_heads": 0,
                "notes": _row_notes(rec, dp, step_s, not gbits),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mirror",
        action="append",
        required=True,
        metavar="ROUND=DIR",
        help="a git directory of mlcommons/training_results_ROUND, e.g. v4.1=path (repeat)",
    )
    parser.add_argument("--out", type=Path, default=CACHE, help="the cache CSV to write")
    args = parser.parse_args(argv)
    mirrors = {}
    for item in args.mirror:
        rnd, sep, d = item.partition("=")
        if not sep or not re.fullmatch(r"v\d+\.\d+", rnd) or not Path(d).is_dir():
            parser.error(f"--mirror {item}: expected ROUND=DIR, ROUND like v4.1, DIR a directory")
        mirrors[rnd] = Path(d)
    try:
        rows, skipped = extract(mirrors)
    except (OSError, ValueError) as exc:
        print(f"mlperf_gpt3: {exc}", file=sys.stderr)
        return 2
    write_cache(rows, args.out)
    for line in skipped:
        print(f"skipped: {line}")
    dup = sum(1 for r in rows if r["duplicate_of"])
    print(f"wrote {len(rows)} result directories ({dup} copies of others) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
