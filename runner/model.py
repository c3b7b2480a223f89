"""GPT sizes, construction through PaddleNLP, and the two model facts everyone needs.

`parameter_count` and `training_flops_per_token` live here (the runner needs them for MFU and
must not import the planner); the planner's cost model imports them from here, so each formula
exists once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from runner.plan import ModelSection, ParallelSection


@dataclass(frozen=True)
class GPTSize:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int


# Named sizes. gpt-tiny trains on one CPU core in seconds; gpt-base-110m is the bank-FAQ model
# (GPT-Base with a 30k CPM-style Chinese vocabulary: 12 x 768, 12 heads).
MODEL_SIZES: dict[str, GPTSize] = {
    "gpt-tiny": GPTSize(8000, 128, 2, 4, 512, 128),
    "gpt-mini": GPTSize(8000, 256, 4, 4, 1024, 256),
    "gpt-small-cpu": GPTSize(8000, 384, 6, 6, 1536, 512),
    "gpt-base-110m": GPTSize(30000, 768, 12, 12, 3072, 1024),
    "gpt-medium-350m": GPTSize(50304, 1024, 24, 16, 4096, 2048),
    "gpt-large-760m": GPTSize(50304, 1536, 24, 16, 6144, 2048),
    "gpt-1.3b": GPTSize(50304, 2048, 24, 16, 8192, 2048),
    "gpt-2.7b": GPTSize(50304, 2560, 32, 32, 10240, 2048),
    "gpt-6.7b": GPTSize(50304, 4096, 32, 32, 16384, 2048),
    "gpt-13b": GPTSize(50304, 5120, 40, 40, 20480, 2048),
}


def size_fields(name: str) -> dict:
    return asdict(MODEL_SIZES[name])


def parameter_count(model: ModelSection, *, include_embeddings: bool = True) -> int:
    """Exact parameter count of PaddleNLP's GPTForCausalLM (tied LM head).

    Per layer: QKV and output projections 4h^2 + 4h, MLP 2·h·f + f + h, two layer norms 4h.
    Plus word and position embeddings and the final norm. For f = 4h this is Narayanan et al.
    2021 eq. 2: 12·L·h²·(1 + 13/(12h) + (V+s)/(12·L·h)).
    """
    h, f, L = model.hidden_size, model.intermediate_size, model.num_hidden_layers
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    body = L * per_layer + 2 * h
    if not include_embeddings:
        return body
    return body + model.vocab_size * h + model.max_position_embeddings * h


def training_flops_per_token(model: ModelSection, seq_len: int) -> float:
    """Model FLOPs per trained token: 6·N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B).

    N excludes embedding parameters but the tied LM-head matmul (2·h·V per token forward) is
    real compute, so it is added back: 6·(N_body + V·h) + 12·L·h·s. The 12·L·h·s term is the
    attention score/value matmuls (the O(s²) part). Recompute is not counted: this is *model*
    FLOPs, the numerator of MFU.
    """
    n = parameter_count(model, include_embeddings=False) + model.vocab_size * model.hidden_size
    return 6.0 * n + 12.0 * model.num_hidden_layers * model.hidden_size * seq_len


def flash_attention_supported(precision: str) -> bool:
    """Paddle's flash attention (FlashAttention-2 kernels) runs on CUDA GPUs of compute
    capability >= 8.0 (Ampere and newer) in fp16/bf16 only."""
    if precision not in ("fp16", "bf16"):
        return False
    import paddle

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return False
    major, _ = paddle.device.cuda.get_device_capability()
    return major >= 8


def build_gpt_config(model: ModelSection, parallel: ParallelSection, *, seq_len: int,
                     use_flash_attention: bool = False):
    """PaddleNLP GPTConfig from the plan (labels use -100 as the ignored id).

    `use_flash_attention` is the plan's request; the caller decides whether this device can
    run it (see `flash_attention_supported`)."""
    from paddlenlp.transformers import GPTConfig

    config = GPTConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_hidden_layers,
        num_attention_heads=model.num_attention_heads,
        intermediate_size=model.intermediate_size,
        max_position_embeddings=model.max_position_embeddings,
        seq_length=seq_len,
        hidden_dropout_prob=model.hidden_dropout_prob,
        attention_probs_dropout_prob=model.attention_probs_dropout_prob,
        initializer_range=model.initializer_range,
        ignore_index=-100,
        tensor_parallel_degree=parallel.tensor_parallel_degree,
        tensor_parallel_output=True,
        sequence_parallel=parallel.sequence_parallel,
        recompute_granularity=(parallel.recompute if parallel.recompute != "none" else "full"),
        use_flash_attention=use_flash_attention,
        virtual_pp_degree=parallel.virtual_pp_degree,
    )
    return config


def build_model(model: ModelSection, parallel: ParallelSection, *, seq_len: int,
                use_flash_attention: bool = False, precision: str = "fp32"):
    """GPTForCausalLM, random init (pipeline parallel uses PaddleNLP's GPTForCausalLMPipe).

    Flash attention is enabled when the plan asks for it and this device can run it; where it
    cannot, a warning says so and the standard kernel runs (more activation memory)."""
    from paddlenlp.transformers import GPTForCausalLM

    flash = use_flash_attention and flash_attention_supported(precision)
    if use_flash_attention and not flash:
        import warnings

        warnings.warn("the plan asks for flash attention but this device cannot run it "
                      f"(needs a CUDA GPU of compute capability >= 8.0 and fp16/bf16, precision "
                      f"is {precision}); using the standard attention kernel", stacklevel=2)
    config = build_gpt_config(model, parallel, seq_len=seq_len, use_flash_attention=flash)
    if parallel.pipeline_parallel_degree > 1:
        from paddlenlp.transformers.gpt.modeling_pp import GPTForCausalLMPipe

        net = GPTForCausalLMPipe(config)
    else:
        net = GPTForCausalLM(config)
    if parallel.recompute != "none":
        net.recompute_enable()
    return net
