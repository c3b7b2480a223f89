"""A plan as PaddleNLP 2.8.1 run_pretrain.py arguments (gptplan.paddlenlp_args): PaddleNLP's own
parser reads the JSON back to the plan's layout, batch, precision and schedule, and the
fleet strategy its TrainingArguments builds has the plan's degrees."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import List, Optional  # noqa: UP035  (PdArgumentParser reads these annotations)

import pytest
from conftest import REPO

from gptplan.paddlenlp_args import NAME_MAP, accepted_names, model_config, pretrain_args
from gptplan.plan import load_plan, no_recompute_layers, validate
from runner.parallel import strategy_settings


# llm/run_pretrain.py's own argument classes (PaddleNLP 2.8.1; the script is not in the wheel):
# the fields and types PdArgumentParser reads, as its source declares them.
@dataclass
class ModelArguments:
    model_name_or_path: str = "__internal_testing__/tiny-random-llama"
    tokenizer_name_or_path: Optional[str] = None  # noqa: UP045
    config_name: Optional[str] = None  # noqa: UP045
    use_flash_attention: bool = False
    use_fused_rms_norm: bool = False
    fuse_attention_qkv: bool = False
    fuse_attention_ffn: bool = False
    recompute_granularity: str = "full"
    virtual_pp_degree: int = 1
    continue_training: bool = False
    sequence_parallel: bool = False
    fuse_sequence_parallel_allreduce: bool = False
    use_fused_rope: Optional[bool] = False  # noqa: UP045
    no_recompute_layers: Optional[List[int]] = field(default=None)  # noqa: UP006, UP045
    pp_recompute_interval: int = 1
    recompute_use_reentrant: bool = False


@dataclass
class DataArguments:
    input_dir: str = None  # type: ignore[assignment]
    split: str = "949,50,1"
    max_seq_length: int = 1024
    share_folder: bool = False
    data_impl: str = "mmap"
    skip_warmup: bool = True
    data_cache: str = None  # type: ignore[assignment]


def hand_plan(**parallel):
    plan = load_plan(REPO / "plans" / "llama_zh.toml")
    p = dataclasses.replace(plan.parallel, **parallel)
    job = dataclasses.replace(plan.job, target_tokens=0)  # max_steps decides
    return dataclasses.replace(plan, parallel=p, job=job)


PLANS = {
    "bank_faq": lambda: load_plan(REPO / "plans" / "bank_faq.toml"),
    "llama_zh": lambda: load_plan(REPO / "plans" / "llama_zh.toml"),
    "tp4xpp2_recompute": lambda: hand_plan(
        sharding="",
        sharding_parallel_degree=1,
        tensor_parallel_degree=4,
        pipeline_parallel_degree=2,
        recompute="full_attn",
        recompute_layers=6,
    ),
    "pp4_interleaved_stage1": lambda: dataclasses.replace(
        hand_plan(
            sharding_parallel_degree=2,
            pipeline_parallel_degree=4,
            virtual_pp_degree=3,
        ),
        training=dataclasses.replace(
            load_plan(REPO / "plans" / "llama_zh.toml").training, gradient_accumulation_steps=8
        ),
    ),
    "tp2_sp_stage2": lambda: hand_plan(
        tensor_parallel_degree=2,
        sequence_parallel=True,
        sharding="stage2",
        sharding_parallel_degree=4,
        recompute="core_attn",
    ),
}


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """Each plan's JSON parsed by PaddleNLP (world size = the plan's; fleet.init recorded)."""
    import paddle.distributed
    from paddle.distributed import fleet
    from paddlenlp.trainer import PdArgumentParser, TrainingArguments

    @dataclass
    class PreTrainingArguments(TrainingArguments):  # run_pretrain.py's
        min_learning_rate: float = 1e-5
        decay_steps: float = None  # type: ignore[assignment]
        enable_linear_fused_grad_add: bool = False

    out = {}
    for name, make in PLANS.items():
        plan = make()
        validate(plan)  # a plan load_plan accepts
        args = pretrain_args(plan, model_dir="model")
        path = tmp_path_factory.mktemp(name) / "args.json"
        path.write_text(json.dumps(args))
        seen: dict = {}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(paddle.distributed, "get_world_size", lambda w=plan.parallel.world_size: w)
            mp.setattr(fleet, "init", lambda seen=seen, **kw: seen.update(kw))
            mp.setenv("PADDLE_RANK_IN_NODE", "0")  # rank 0 of the plan's world, as launched
            model, data, training = PdArgumentParser(
                (ModelArguments, DataArguments, PreTrainingArguments)
            ).parse_json_file(json_file=str(path))
        fields = tuple(f.name for f in dataclasses.fields(TrainingArguments))
        out[name] = (plan, args, model, data, training, seen.get("strategy"), fields)
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_paddlenlp_parses_the_plan_back(parsed, name):
    plan, args, model, data, training, strategy, fields = parsed[name]
    t, p, c = plan.training, plan.parallel, plan.checkpoint
    # nothing the writer says is dropped by PaddleNLP's parser (it drops unknown keys silently)
    assert set(args) <= accepted_names(fields)
    # batch and schedule
    assert data.max_seq_length == t.seq_len
    assert training.per_device_train_batch_size == t.per_device_train_batch_size
    assert training.gradient_accumulation_steps == t.gradient_accumulation_steps
    assert training.max_steps == t.max_steps
    assert training.warmup_steps == t.warmup_steps
    assert training.learning_rate == t.learning_rate
    assert training.min_learning_rate == t.min_learning_rate
    assert str(training.lr_scheduler_type.value) == t.lr_scheduler_type
    assert training.save_steps == c.interval_steps
    assert training.save_total_limit == c.keep_last
    assert training.seed == plan.job.seed
    # precision
    assert (training.bf16, training.fp16) == (t.precision == "bf16", t.precision == "fp16")
    if t.precision != "fp32":
        assert training.fp16_opt_level == t.fp16_opt_level
    # layout: the arguments and the strategy PaddleNLP hands to fleet.init
    assert model.virtual_pp_degree == p.virtual_pp_degree
    assert model.sequence_parallel == p.sequence_parallel
    assert training.recompute == (p.recompute != "none")
    if p.recompute != "none":
        assert model.recompute_granularity == p.recompute
    assert (model.no_recompute_layers or []) == no_recompute_layers(plan.model, plan.parallel)
    assert [s.value for s in training.sharding] == ([p.sharding] if p.sharding else [])
    assert strategy is not None, "PaddleNLP did not build a hybrid-parallel strategy"
    hybrid = strategy.hybrid_configs
    ours = strategy_settings(plan)["hybrid_configs"]
    for key in ("dp_degree", "mp_degree", "pp_degree", "sharding_degree"):
        assert hybrid[key] == ours[key], key
    if p.pipeline_parallel_degree > 1:
        assert strategy.pipeline_configs["accumulate_steps"] == t.gradient_accumulation_steps
        assert strategy.pipeline_configs["micro_batch_size"] == t.per_device_train_batch_size


def test_every_renamed_plan_key_is_written():
    args = pretrain_args(PLANS["tp4xpp2_recompute"](), model_dir="m")
    for plan_key, names in NAME_MAP.items():
        assert any(n in args for n in names), plan_key


def test_model_config_is_the_runners_model():
    """The config.json run_pretrain.py loads builds the same architecture the runner trains."""
    from paddlenlp.transformers import LlamaConfig

    plan = PLANS["llama_zh"]()
    config = model_config(plan)
    assert config["model_type"] == "llama"
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        assert config[key] == getattr(plan.model, key)
    assert "tensor_parallel_degree" not in config  # run_pretrain.py sets the layout per rank
    built = LlamaConfig(**config)
    assert (built.hidden_size, built.num_key_value_heads) == (768, 12)


def test_planner_writes_the_arguments_and_the_config(tmp_path):
    from conftest import run_main

    from planner.commands.main import main

    out = tmp_path / "bank"
    rc, stdout, _ = run_main(
        main, ["paddlenlp-args", str(REPO / "plans" / "bank_faq.toml"), "--out", str(out)]
    )
    assert rc == 0, stdout
    plan = load_plan(REPO / "plans" / "bank_faq.toml")
    args = json.loads((out / "run_pretrain.json").read_text())
    assert args == pretrain_args(plan, model_dir="model", input_dir="data")
    assert json.loads((out / "model" / "config.json").read_text()) == model_config(plan)
    assert "llm/run_pretrain.py run_pretrain.json" in stdout


def test_planner_paddlenlp_args_bad_plan_is_one_line(tmp_path):
    from conftest import run_main

    from planner.commands.main import main

    bad = tmp_path / "bad.toml"
    bad.write_text(
        (REPO / "plans" / "bank_faq.toml").read_text().replace("seq_len = 512", "seq_len = -1")
    )
    rc, stdout, stderr = run_main(main, ["paddlenlp-args", str(bad), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "seq_len" in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
