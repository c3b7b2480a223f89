"""A plan as PaddleNLP 2.8.1 pretraining arguments: the JSON `llm/run_pretrain.py args.json` reads.

run_pretrain.py parses one flat JSON object with `PdArgumentParser((ModelArguments,
DataArguments, PreTrainingArguments))`: TrainingArguments' fields (paddlenlp.trainer), plus the
script's own model and data arguments (RUN_PRETRAIN_MODEL_ARGS, RUN_PRETRAIN_DATA_ARGS, the
names as its 2.8.1 source declares them). The parser silently drops a key none of those
declares, so this writer emits only those names; tests/test_paddlenlp_args.py parses the file
back with PaddleNLP's own parser and compares layout, batch, precision and schedule.

Where a plan's name differs from PaddleNLP's (NAME_MAP says each once):

    training.seq_len                    -> max_seq_length
    training.precision = "bf16"/"fp16"  -> bf16 / fp16 = true, fp16_opt_level
    parallel.recompute                  -> recompute (bool) + recompute_granularity
    parallel.recompute_layers           -> no_recompute_layers (the layers that do not)
    parallel.sharding                   -> sharding ("stage1" ...) + sharding_parallel_degree
    checkpoint.interval_steps           -> save_steps
    checkpoint.keep_last                -> save_total_limit

The architecture is not an argument of run_pretrain.py: it reads a PaddleNLP config from
`model_name_or_path`. `model_config` is that config (the family's own config arguments, as the
runner builds the model); the CLI writes it as `config.json` in a folder next to the JSON.
The data-parallel degree is not an argument either: PaddleNLP derives it (world size /
tp / pp / sharding), as the plan does.

Pure: imports neither paddle nor paddlenlp.
"""

from __future__ import annotations

from typing import Any

from gptplan import families
from gptplan import precision as precisions
from gptplan.plan import Plan, no_recompute_layers

# llm/run_pretrain.py (PaddleNLP 2.8.1): ModelArguments and DataArguments field names.
RUN_PRETRAIN_MODEL_ARGS = (
    "model_name_or_path",
    "tokenizer_name_or_path",
    "config_name",
    "use_flash_attention",
    "use_fused_rms_norm",
    "fuse_attention_qkv",
    "fuse_attention_ffn",
    "recompute_granularity",
    "virtual_pp_degree",
    "continue_training",
    "sequence_parallel",
    "fuse_sequence_parallel_allreduce",
    "use_fused_rope",
    "no_recompute_layers",
    "pp_recompute_interval",
    "recompute_use_reentrant",
)
RUN_PRETRAIN_DATA_ARGS = (
    "input_dir",
    "split",
    "max_seq_length",
    "share_folder",
    "data_impl",
    "skip_warmup",
    "data_cache",
)
# run_pretrain.py's PreTrainingArguments(TrainingArguments) adds these.
RUN_PRETRAIN_TRAINING_ARGS = ("min_learning_rate", "decay_steps", "enable_linear_fused_grad_add")

# plan key -> PaddleNLP argument(s), where the names differ (the module doc explains each).
NAME_MAP = {
    "training.seq_len": ("max_seq_length",),
    "training.precision": ("bf16", "fp16"),
    "training.fp16_opt_level": ("fp16_opt_level",),
    "parallel.recompute": ("recompute", "recompute_granularity"),
    "parallel.recompute_layers": ("no_recompute_layers",),
    "parallel.sharding": ("sharding",),
    "checkpoint.interval_steps": ("save_steps",),
    "checkpoint.keep_last": ("save_total_limit",),
}


def model_config(plan: Plan) -> dict[str, Any]:
    """The PaddleNLP config.json of the plan's model (what run_pretrain.py loads from
    model_name_or_path): the family's config arguments as the runner builds the model, fused
    kernels off (the arguments switch them on where the device has them), plus model_type and
    architectures so AutoConfig/AutoModelForCausalLM find the class."""
    spec = families.get(plan.model.family)
    kernels = {"flash_attention": plan.training.use_flash_attention}
    config = spec.config_kwargs(
        plan.model,
        plan.parallel,
        seq_len=plan.training.seq_len,
        kernels=kernels,
        no_recompute=no_recompute_layers(plan.model, plan.parallel),
    )
    # the layout is run_pretrain.py's to set (from the arguments, per rank); a config that
    # carried it would be overwritten anyway
    for key in ("tensor_parallel_degree", "sequence_parallel", "virtual_pp_degree"):
        config.pop(key, None)
    config["model_type"] = spec.model_type
    config["architectures"] = [spec.causal_lm_class.rpartition(":")[2]]
    if spec.has_dropout:
        config["hidden_dropout_prob"] = plan.model.hidden_dropout_prob
        config["attention_probs_dropout_prob"] = plan.model.attention_probs_dropout_prob
    return config


def pretrain_args(
    plan: Plan, *, model_dir: str, tokenizer: str = "", input_dir: str = "data"
) -> dict[str, Any]:
    """The plan as run_pretrain.py arguments (one flat dict, JSON-ready).

    `model_dir`: the folder holding `model_config(plan)` as config.json; `tokenizer`: a
    PaddleNLP tokenizer name or folder (default: model_dir); `input_dir`: PaddleNLP's
    preprocessed corpus (llm/tools/preprocess's *.bin/*.idx, not the runner's cache)."""
    t, p, c = plan.training, plan.parallel, plan.checkpoint
    row = precisions.row(t.precision)
    args: dict[str, Any] = {
        # what to train
        "model_name_or_path": model_dir,
        "tokenizer_name_or_path": tokenizer or model_dir,
        "continue_training": False,  # from scratch, as the plan
        "input_dir": input_dir,
        "split": "1,0,0",  # every document trains (the plan holds none out)
        "max_seq_length": t.seq_len,
        "output_dir": str(plan.run_dir),
        "do_train": True,
        "do_eval": False,
        "seed": plan.job.seed,
        # batch and schedule
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "max_steps": t.max_steps,
        "learning_rate": t.learning_rate,
        "min_learning_rate": t.min_learning_rate,
        "warmup_steps": t.warmup_steps,
        "decay_steps": t.max_steps,
        "lr_scheduler_type": t.lr_scheduler_type,
        "weight_decay": t.weight_decay,
        "adam_beta1": t.adam_beta1,
        "adam_beta2": t.adam_beta2,
        "max_grad_norm": t.max_grad_norm,
        "logging_steps": t.logging_steps,
        "save_strategy": "steps",
        "save_steps": c.interval_steps,
        "save_total_limit": c.keep_last,
        # precision
        "bf16": t.precision == "bf16",
        "fp16": t.precision == "fp16",
        "fp16_opt_level": t.fp16_opt_level if row.mixed else "O1",
        "scale_loss": t.scale_loss if row.loss_scaling else 1.0,
        # layout
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "virtual_pp_degree": p.virtual_pp_degree,
        "sharding_parallel_degree": p.sharding_parallel_degree if p.sharding else 1,
        "sharding": p.sharding,
        "sequence_parallel": p.sequence_parallel,
        "recompute": p.recompute != "none",
        "recompute_granularity": p.recompute if p.recompute != "none" else "full",
        "use_flash_attention": t.use_flash_attention,
    }
    skipped = no_recompute_layers(plan.model, plan.parallel)
    if skipped:  # absent = every layer recomputes (PaddleNLP's parser refuses a null list)
        args["no_recompute_layers"] = skipped
    return args


def accepted_names(training_fields: tuple[str, ...]) -> frozenset[str]:
    """Every key run_pretrain.py's parser keeps, given TrainingArguments' field names."""
    return frozenset(
        training_fields
        + RUN_PRETRAIN_TRAINING_ARGS
        + RUN_PRETRAIN_MODEL_ARGS
        + RUN_PRETRAIN_DATA_ARGS
    )
