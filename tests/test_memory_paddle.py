"""Memory as Paddle allocates it (issue 35): the terms follow Paddle 3.3.1's own code, the
GPU-side terms their cited sources, the band each term's worst credible error, and the
throughput cap only the interval's top.

The stage-2 test runs Paddle's own partition code (GroupShardedOptimizerStage2 and
GroupShardedStage2, what paddle.distributed.sharding.group_sharded_parallel(level="os_g")
builds) on the parameter list of the GPT-1.3B shape; no device is needed for the sizes."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from gptplan import memory as mem
from gptplan import precision
from gptplan.modelfacts import MODEL_SIZES
from gptplan.plan import ModelSection


def _paddle_code():
    """bench/paddle_memory_code.py (the bench's per-term table uses the same functions)."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location(
        "paddle_memory_code", REPO / "bench" / "paddle_memory_code.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _terms(m: ModelSection, **layout):
    g = dict(seq=2048, micro=1, acc=8, tp=1, pp=1, vpp=1, stage_code=2, shard_degree=8)
    g |= dict(recompute_code=3, sp=0, flash=1, precision_code=precision.code("bf16"), dp=1)
    g |= layout
    g = {k: np.array([v]) for k, v in g.items()}
    shape = mem.ModelShape.from_section(m)
    args = mem.device_memory_args("gpu", 0.0, 1.0)
    return {
        k: float(v[0]) for k, v in mem.layout_memory_bytes(shape, g, terms=True, **args).items()
    }


@pytest.mark.parametrize(
    "size,rel", [("gpt-1.3b", 0.03), ("gpt-6.7b", 0.03), ("gpt-base-110m", 0.06)]
)
def test_stage2_gradients_are_what_paddles_code_allocates(size, rel):
    """A stage 2 x 8 layout's gradient term equals what Paddle's stage-2 code holds on the
    busiest rank within 3% (6% for the 110M model, where the fp32 LayerNorm storages and
    the position embedding are a larger share): its share (whole parameters per rank), the
    seven other ranks' GradStorage buffers (min(share, 2**23) elements each, alive through
    backward) and the largest parameter's transient gradient. The model used to charge
    2 bytes x P / 8."""
    m = ModelSection(**vars(MODEL_SIZES[size]))
    paddle_bytes = _paddle_code().paddle_stage2_gradient_bytes(m, 8)
    modelled = _terms(m)["gradients"]
    assert modelled == pytest.approx(paddle_bytes, rel=rel)


def test_sharded_optimizer_states_are_the_busiest_ranks_whole_parameters():
    """Stage 1/2 give whole parameters to ranks: a rank holding the 30k x 768 embedding of the
    bank-FAQ model holds more than P/d of the optimizer states."""
    m = ModelSection(**vars(MODEL_SIZES["gpt-base-110m"]))
    shape = mem.ModelShape.from_section(m)
    opt = _terms(m, stage_code=1, shard_degree=8)["optimizer"]
    assert opt == pytest.approx(12.0 * shape.largest_param)
    assert opt > 12.0 * shape.params_total / 8 * 1.5


def test_main_grad_and_the_fused_data_parallel_copy():
    """PaddleNLP's amp_master_grad keeps fp32 gradients (4 bytes a parameter, not 2); data
    parallel without group sharding holds a fused copy of every gradient (kept by plain data
    parallel for the whole run; under fleet's hybrid all-reduce only as backward ends, charged
    beyond the activations it outlives)."""
    m = ModelSection(**vars(MODEL_SIZES["gpt-1.3b"]))
    shape = mem.ModelShape.from_section(m)
    plain = _terms(m, stage_code=0, shard_degree=1, dp=8)
    master = _terms(m, stage_code=0, shard_degree=1, dp=8, main_grad=1)
    assert plain["gradients"] == pytest.approx(2.0 * shape.params_total)
    assert master["gradients"] == pytest.approx(4.0 * shape.params_total)
    # plain data parallel (paddle.DataParallel) keeps its fused buffers: a second copy
    assert plain["comm_buffers"] == pytest.approx(plain["gradients"])
    hybrid = _terms(m, stage_code=0, shard_degree=1, dp=4, tp=2)
    assert hybrid["comm_buffers"] == pytest.approx(
        max(0.0, hybrid["gradients"] - hybrid["activations"])
    )
    assert _terms(m, stage_code=2)["comm_buffers"] == 0.0


def test_recompute_keeps_one_layer_in_full_and_pipelines_their_outputs():
    """Full recompute holds each layer's input plus one layer's full activations in its
    backward with that backward's gradient temporaries (x1.4, fitted on the rehearsal
    device) and flash attention's fp32 dq accumulator; pipeline stage 0 holds p
    micro-batches in flight, each with its stage output."""
    m = ModelSection(**vars(MODEL_SIZES["gpt-1.3b"]))
    shape = mem.ModelShape.from_section(m)
    args = (shape, 2048, 1, 1, 0)
    keep = float(mem.activation_bytes_per_layer(*args, 0, 2.0, True))
    kept = float(mem.activation_bytes_per_layer(*args, 3, 2.0, True))
    sbh = 2048 * 1 * m.hidden_size
    working = keep * (1 + mem.RECOMPUTE_BACKWARD_EXTRA) - kept + 4.0 * sbh
    one = _terms(m, stage_code=0, shard_degree=1)["activations"]
    assert one == pytest.approx(m.num_hidden_layers * kept + working)
    piped = _terms(m, stage_code=0, shard_degree=1, pp=4, acc=8)["activations"]
    per_stage = m.num_hidden_layers / 4 * kept + 2.0 * sbh
    assert piped == pytest.approx(4 * per_stage + working)


def test_gpu_side_terms_come_from_their_sources():
    """CUDA context 0.29-0.67 GB (lazy / eager loading), cuBLAS workspaces, NCCL 544 MB a
    2-rank and 688 MB a larger communicator, GMLake's 15% (up to 33%) fragmentation."""
    assert mem.CUDA_CONTEXT_GB == (0.29, 0.48, 0.67)
    assert mem.GPU_FRAGMENTATION == pytest.approx(1 / 0.85)
    got = mem.communicator_gb_total(world=64, tp=2, pp=1, shard_degree=32, dp=1)
    assert float(got) == pytest.approx(mem.NCCL_GB_GROUP * 2 + mem.NCCL_GB_PAIR)
    cpu = mem.device_memory_args("cpu", 0.55, 1.1)
    assert cpu == dict(
        overhead_gb=0.55, fragmentation=1.1, communicator_gb=0.0, fused_kernels=False
    )


def test_band_from_term_errors_and_the_verdict():
    """The band's ends are each term at its worst credible error; "surely fits" needs the
    high end within the usable memory, a refusal needs even the low end past the card."""
    terms = {k: np.array([0.0, 0.0, 0.0]) for k in mem.TERMS}
    terms["optimizer"] = np.array([40.0, 60.0, 100.0]) * mem.GB
    terms["activations"] = np.array([20.0, 20.0, 20.0]) * mem.GB
    low, point, high, decider = mem.memory_band(terms)
    assert point == pytest.approx([60e9, 80e9, 120e9])
    assert high == pytest.approx(point + 20e9 * 0.25 + terms["optimizer"] * 0.06)
    assert low == pytest.approx(terms["optimizer"] * 0.98 + 20e9 * 0.85)
    assert mem.TERMS[int(decider[0])] == "activations"
    sure, may = mem.memory_fit(low, high, 80 * mem.GIB, 0.9)
    assert list(sure) == [True, False, False] and list(may) == [False, True, False]


@functools.lru_cache(maxsize=2)
def _planned(profiles: tuple[str, ...], caps: tuple | None = None):
    from planner.market.hardware import load_profiles
    from planner.market.offers import allowed_offers
    from planner.screen import coverage
    from planner.screen.decide import decide
    from planner.screen.evaluate import evaluate_space
    from planner.spec import spec_from_dict

    data = {
        "job": {"name": "llama13b", "target_tokens": 260e9},
        "model": {"size": "llama-13b"},
        "constraints": {
            "currency": "USD",
            "seq_lens": [4096],
            "global_batch_tokens_min": 2_000_000,
            "global_batch_tokens_max": 4_200_000,
            "profiles": list(profiles),
            "max_nodes": 8,
            "launcher_attaches_efa": True,  # 8 x p5/p4de costed on EFA (planner/skypilot.py)
        },
        "search": {"node_counts": [8]},
    }
    spec = spec_from_dict(data, file="spec.toml")
    saved = dict(coverage.mfu_caps())
    try:
        if caps is not None:
            coverage.mfu_caps().clear()
            coverage.mfu_caps().update({g: coverage.MfuCap(g, c, "t", "test") for g, c in caps})
        table = evaluate_space(spec, allowed_offers(spec, load_profiles()), spec.job.target_tokens)
        decision = decide(spec, table, spec.job.target_tokens)
        iv = table.intervals(np.arange(len(table)))
    finally:
        coverage.mfu_caps().clear()
        coverage.mfu_caps().update(saved)
    return table, decision, iv


def test_the_point_estimate_is_never_clamped_only_the_interval_top():
    """With a cap below what the model predicts, the point estimates stay the model's median
    (the same as without a cap); only the interval's top is held to the cap, never below the
    point; where the point is the top, the row is flagged capped (the console says so)."""
    free, _, _ = _planned(("h100-80gb",))
    low = (("hopper", 0.30), ("ampere", 0.30), ("", 0.30))
    table, decision, iv = _planned(("h100-80gb",), low)
    assert np.array_equal(table["tokens_per_s"], free["tokens_per_s"])
    assert (table["mfu"] > 0.30).any()
    top = iv["tokens_per_s_p90"]
    assert (top >= table["tokens_per_s"] * (1 - 1e-12)).all()
    at_top = np.isclose(top, table["tokens_per_s"], rtol=1e-9)
    assert at_top.any() and iv["throughput_capped"][at_top].all()


def test_no_chosen_point_equals_its_top_unless_capped():
    """The shipped caps: the 13B spec's chosen plan (A100 or H100) has its point strictly
    inside its interval, or the interval says it is capped."""
    for profiles in (("a100-80gb", "h100-80gb"), ("h100-80gb",)):
        table, decision, iv = _planned(profiles)
        i = decision.chosen
        point, top = table["tokens_per_s"][i], iv["tokens_per_s_p90"][i]
        assert top > point or bool(iv["throughput_capped"][i])


def test_caps_are_the_published_best_not_the_fitted_rows():
    """The cap per generation is the best 16-bit MFU in hardware_profiles/mfu_published.csv
    (cited training runs and kernels), above what H100 runs publish (up to ~55% MFU)."""
    from planner.screen import coverage

    caps = coverage.mfu_caps()
    assert caps["hopper"].mfu >= 0.55 and caps["ampere"].mfu >= 0.64
    assert "mfu_published.csv" in caps["hopper"].words()
    assert caps[""].mfu == max(c.mfu for c in caps.values())
