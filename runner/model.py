"""The model built through PaddleNLP from the plan (model facts: gptplan.modelfacts)."""

from __future__ import annotations

from gptplan.plan import ModelSection, ParallelSection


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
