"""Model facts (checked against hand-computed values) and the GPU-only strategy/launch paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import BASE_PLAN, merge

from gptplan.modelfacts import MODEL_SIZES, parameter_count, training_flops_per_token
from gptplan.plan import ModelSection, plan_from_dict
from runner.parallel import launch_commands, strategy_settings
from runner.train import learning_rate_at


def test_parameter_count_matches_narayanan_eq2_for_gpt_base():
    """N = 12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)), Narayanan et al. 2021 eq. 2."""
    m = ModelSection(**vars(MODEL_SIZES["gpt-base-110m"]))
    L, h, V, s = 12, 768, 30000, 1024
    narayanan = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    assert parameter_count(m) == pytest.approx(narayanan, rel=1e-3)
    # by hand: per layer 4h²+4h + 2hf+f+h + 4h = 7,087,872; x12 + final norm 2h = 85,056,000;
    # + word embeddings V·h = 23,040,000 + positions s·h = 786,432
    assert parameter_count(m) == 108_882_432


def test_parameter_count_matches_built_paddlenlp_model():
    import paddle

    from gptplan.plan import ParallelSection
    from runner.model import build_model

    paddle.set_device("cpu")
    m = ModelSection(
        vocab_size=500,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=40,
    )
    net = build_model(m, ParallelSection(), seq_len=16)
    assert sum(int(p.numel()) for p in net.parameters()) == parameter_count(m)


def test_flops_per_token_palm_formula():
    """6·N + 12·L·h·s with N = non-embedding params + the tied head (PaLM appendix B)."""
    m = ModelSection(**vars(MODEL_SIZES["gpt-base-110m"]))
    body = 12 * (4 * 768**2 + 4 * 768 + 2 * 768 * 3072 + 3072 + 768 + 4 * 768) + 2 * 768
    expected = 6 * (body + 30000 * 768) + 12 * 12 * 768 * 1024
    assert training_flops_per_token(m, 1024) == expected
    # attention share s/(6h)-ish: about 15% at s=2048, h=2048 (REFERENCES 1)
    big = ModelSection(**vars(MODEL_SIZES["gpt-1.3b"]))
    att = 12 * 24 * 2048 * 2048
    assert 0.10 < att / training_flops_per_token(big, 2048) < 0.16


def test_learning_rate_schedule():
    t = plan_from_dict(
        merge(
            BASE_PLAN,
            {
                "training": {
                    "max_steps": 100,
                    "warmup_steps": 10,
                    "learning_rate": 1.0,
                    "min_learning_rate": 0.1,
                }
            },
        )
    ).training
    assert learning_rate_at(0, t) == pytest.approx(0.1)
    assert learning_rate_at(9, t) == pytest.approx(1.0)
    assert learning_rate_at(10, t) == pytest.approx(1.0)
    assert learning_rate_at(55, t) == pytest.approx(0.55)
    assert learning_rate_at(100, t) == pytest.approx(0.1)


GPU = {"hardware": {"device": "gpu", "precisions": ["fp32", "fp16", "bf16"]}}


def test_hybrid_strategy_for_tp_pp_sharding():
    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            merge(
                GPU,
                {
                    "model": {"num_hidden_layers": 4},
                    "parallel": {
                        "nnodes": 2,
                        "nproc_per_node": 8,
                        "data_parallel_degree": 2,
                        "tensor_parallel_degree": 2,
                        "pipeline_parallel_degree": 2,
                        "sharding": "stage1",
                        "sharding_parallel_degree": 2,
                        "sequence_parallel": True,
                        "recompute": "core_attn",
                    },
                    "training": {
                        "gradient_accumulation_steps": 4,
                        "precision": "fp16",
                        "fp16_opt_level": "O2",
                    },
                },
            ),
        )
    )
    s = strategy_settings(plan)
    assert s["hybrid_configs"] == {
        "dp_degree": 2,
        "mp_degree": 2,
        "pp_degree": 2,
        "sharding_degree": 2,
        "pp_configs": {"delay_scale_loss": False},
        "mp_configs": {"sync_param": True, "sync_grad": False, "sync_moment": False},
    }
    assert s["pipeline_configs"] == {"accumulate_steps": 4, "micro_batch_size": 4}
    assert s["sharding_stage"] == 1
    assert s["amp"]["dtype"] == "float16" and s["amp"]["use_dynamic_loss_scaling"]
    assert s["amp"]["level"] == "O2"
    assert s["recompute"] == {"granularity": "core_attn"}
    assert plan.global_batch_size == 4 * 4 * 2 * 2  # micro x acc x dp x sharding


def test_real_fleet_strategy_object():
    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            merge(
                GPU,
                {
                    "parallel": {
                        "nproc_per_node": 4,
                        "data_parallel_degree": 2,
                        "tensor_parallel_degree": 2,
                    }
                },
            ),
        )
    )
    from runner.parallel import build_strategy

    strategy = build_strategy(plan)
    assert strategy.hybrid_configs["mp_degree"] == 2
    assert strategy.hybrid_configs["dp_degree"] == 2


def test_multinode_gpu_launch_commands():
    plan = plan_from_dict(
        merge(
            BASE_PLAN,
            merge(
                GPU, {"parallel": {"nnodes": 2, "nproc_per_node": 8, "data_parallel_degree": 16}}
            ),
        )
    )
    cmds = launch_commands(
        plan,
        plan_path=Path("run/plan.toml"),
        data_dir=Path("d"),
        run_dir=Path("run"),
        log_dir=Path("run/logs"),
        master="10.0.0.1:8090",
        python="python",
    )
    assert len(cmds) == 2
    argv = cmds[1].argv
    assert argv[:3] == ["python", "-m", "runner.paddle_launch"]
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--nproc_per_node") + 1] == "8"
    assert argv[argv.index("--master") + 1] == "10.0.0.1:8090"
    assert argv[argv.index("--rank") + 1] == "1"
    assert argv[argv.index("--devices") + 1] == "0,1,2,3,4,5,6,7"
    assert argv[-6:] == ["--plan", "run/plan.toml", "--data-dir", "d", "--run-dir", "run"]
    assert cmds[0].env == {}  # no CPU thread pinning on GPU


def test_cpu_launch_splits_threads():
    plan = plan_from_dict(
        merge(BASE_PLAN, {"parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}})
    )
    (cmd,) = launch_commands(
        plan,
        plan_path=Path("p"),
        data_dir=Path("d"),
        run_dir=Path("r"),
        log_dir=Path("l"),
        python="python",
    )
    assert "--devices" not in cmd.argv and "--master" not in cmd.argv
    assert int(cmd.env["OMP_NUM_THREADS"]) >= 1


def test_device_launches_carry_their_runs_tag(tmp_path, monkeypatch):
    """Two runs on one machine never share a device communicator (runner/device/src/runtime.cc
    joins only its own run's): each run's ranks get a tag of its own, the same on every node
    and attempt of that run; a plan off the device gets none."""
    from gptplan.plan import REHEARSAL_PROFILE
    from runner.device import support as rehearsal_device
    from runner.parallel import DEVICE_RUN_ENV

    monkeypatch.setattr(
        rehearsal_device,
        "launch_env",
        lambda plan: {"CUSTOM_DEVICE_ROOT": "lib"} if rehearsal_device.uses_device(plan) else {},
    )

    def tags(run_dir: Path, plan_overrides: dict, master: str = "") -> list:
        plan = plan_from_dict(merge(BASE_PLAN, plan_overrides))
        cmds = launch_commands(
            plan,
            plan_path=run_dir / "plan.toml",
            data_dir=Path("d"),
            run_dir=run_dir,
            log_dir=run_dir / "logs",
            master=master,
            python="python",
        )
        return [c.env.get(DEVICE_RUN_ENV) for c in cmds]

    on_device = {
        "parallel": {"nproc_per_node": 2, "data_parallel_degree": 2},
        "hardware": {"profile": REHEARSAL_PROFILE},
    }
    (a,) = tags(tmp_path / "a", on_device)
    (b,) = tags(tmp_path / "b", on_device)
    assert a and b and a != b
    assert tags(tmp_path / "a", on_device) == [a]  # a rerun of that run: the same
    two_nodes = merge(on_device, {"parallel": {"nnodes": 2, "data_parallel_degree": 4}})
    node0, node1 = tags(tmp_path / "a", two_nodes, "127.0.0.1:8090")
    assert node0 == node1
    cpu = {"parallel": {"nproc_per_node": 2, "data_parallel_degree": 2}}
    assert tags(tmp_path / "a", cpu) == [None]


@pytest.mark.parametrize(
    "recompute, layer_runs, attention_runs",
    [("none", 1, 1), ("full", 2, 2), ("full_attn", 1, 2), ("core_attn", 1, 1)],
)
def test_gpt_recomputes_what_the_plan_names(recompute, layer_runs, attention_runs):
    """PaddleNLP 2.8.1's GPTForCausalLM reads no 'full' granularity (a plain 'full' recomputes
    nothing) and nests two non-reentrant recomputes for 'full_attn' (Paddle refuses it): the
    GPT family switches on what the plan means. Counted: how often each decoder layer and its
    attention block run in one forward and backward."""
    import paddle

    from gptplan.plan import ParallelSection
    from runner.model import build_model

    paddle.set_device("cpu")

    m = ModelSection(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    paddle.seed(0)
    net = build_model(m, ParallelSection(recompute=recompute), seq_len=16)
    net.train()
    runs = {"layer": 0, "attention": 0}

    def counter(kind):
        def hook(layer, inputs):
            runs[kind] += 1

        return hook

    layer = net.gpt.decoder.layers[0]
    layer.register_forward_pre_hook(counter("layer"))
    layer.self_attn.register_forward_pre_hook(counter("attention"))
    ids = paddle.randint(0, 64, [2, 16])
    logits = net(ids)
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits
    logits.mean().backward()
    assert (runs["layer"], runs["attention"]) == (layer_runs, attention_runs)


# ---- the ranks wait for rank 0's TCP store before Paddle's first try (runner.parallel) --------


def test_the_store_endpoint_is_found_as_paddle_finds_it():
    from runner.parallel import store_endpoint

    trainers = {"PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:6071,127.0.0.1:6072"}
    assert store_endpoint(trainers) == ("127.0.0.1", 6071)
    assert store_endpoint(trainers | {"PADDLE_MASTER": "10.0.0.2:8090"}) == ("10.0.0.2", 8090)
    both = trainers | {"PADDLE_MASTER": "10.0.0.2:8090", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert store_endpoint(both) == ("h", 1)
    assert store_endpoint({"PADDLE_MASTER": "[::1]:8090"}) == ("::1", 8090)
    assert store_endpoint({}) is None and store_endpoint({"PADDLE_MASTER": "nohost"}) is None


def test_a_rank_waits_until_the_store_listens_and_the_wait_is_bounded():
    import socket
    import threading
    import time

    from runner.parallel import wait_for_the_store

    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"PADDLE_MASTER": f"127.0.0.1:{port}", "PADDLE_TRAINER_ID": "1"}
    assert wait_for_the_store(0.3, env) >= 0.3  # nobody listens: it gives up, no hang
    assert wait_for_the_store(60, env | {"PADDLE_TRAINER_ID": "0"}) == 0.0  # rank 0 starts it

    server = socket.socket()
    accepted: list[socket.socket] = []

    def listen_late() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()
        accepted.append(server.accept()[0])

    thread = threading.Thread(target=listen_late, daemon=True)
    thread.start()
    try:
        waited = wait_for_the_store(60, env)
        thread.join(timeout=60)
        assert accepted, "the wait ended before the store accepted a connection"
        assert waited >= 0.3
    finally:
        for s in accepted:
            s.close()
        server.close()
