"""The model built through PaddleNLP from the plan (model facts: gptplan.modelfacts)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from gptplan import families
from gptplan import precision as precisions
from gptplan.plan import ModelSection, ParallelSection, no_recompute_layers

if TYPE_CHECKING:
    import paddle

# A PaddleNLP model config (GPTConfig, LlamaConfig...; paddlenlp is untyped)
PretrainedConfig = Any

# PaddleNLP 2.8.1's Llama MLP calls paddle.incubate's swiglu, deprecated in Paddle 3.3 (the same
# kernel); its warning would show in every Llama run, export and sample
warnings.filterwarnings("ignore", message=r"(?s).*incubate\.nn\.functional\.swiglu")


def flash_attention_supported(precision: str) -> bool:
    """Paddle's flash attention (FlashAttention-2 kernels) runs on CUDA GPUs of compute
    capability >= 8.0 (Ampere and newer) in fp16/bf16 only."""
    if not precisions.row(precision).flash_attention:
        return False
    import paddle

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return False
    major, _ = paddle.device.cuda.get_device_capability()
    return major >= 8


def _import(path: str) -> Any:  # a PaddleNLP class
    """The class at 'module:Class' (a family's PaddleNLP class)."""
    from gptplan import paddlenlp_light

    module, _, name = path.partition(":")
    return getattr(paddlenlp_light.import_module(module), name)


def build_config(
    model: ModelSection,
    parallel: ParallelSection,
    *,
    seq_len: int,
    kernels: dict | None = None,
    no_recompute: list[int] | None = None,
) -> PretrainedConfig:
    """The family's PaddleNLP config from the plan (gptplan.families: its config class and
    arguments; labels use -100 as the ignored id). `kernels`: see `kernel_choice` (the
    caller decides what this device runs). `no_recompute`: the layers that keep every
    activation (default: from the plan's parallel.recompute_layers,
    gptplan.plan.no_recompute_layers)."""
    spec = families.get(model.family)
    if no_recompute is None:
        no_recompute = no_recompute_layers(model, parallel)
    kwargs = spec.config_kwargs(
        model, parallel, seq_len=seq_len, kernels=kernels or {}, no_recompute=no_recompute
    )
    return _import(spec.config_class)(**kwargs)


def fused_kernels_supported() -> bool:
    """PaddleNLP's fused RMSNorm and fused RoPE kernels exist in CUDA builds only (2.8.1 falls
    back or fails elsewhere): on only with a CUDA device present."""
    import paddle

    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return False
    try:
        from paddle.incubate.nn.functional import fused_rotary_position_embedding  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_choice(
    model: ModelSection, *, use_flash_attention: bool, precision: str
) -> dict[str, bool]:
    """Which kernels this device runs for the plan: {'flash_attention', 'fused_rms_norm',
    'fused_rope'} -> bool. Flash attention only where the plan asks and the device can; the
    fused RMSNorm/RoPE kernels where the family uses them (gptplan.families) and they exist
    (GPU)."""
    fused = families.get(model.family).fused_kernels and fused_kernels_supported()
    return {
        "flash_attention": use_flash_attention and flash_attention_supported(precision),
        "fused_rms_norm": fused,
        "fused_rope": fused,
    }


def _network(
    model: ModelSection, parallel: ParallelSection, config: PretrainedConfig
) -> paddle.nn.Layer:
    spec = families.get(model.family)
    pipeline = parallel.pipeline_parallel_degree > 1
    return _import(spec.pipeline_class if pipeline else spec.causal_lm_class)(config)


def build_model(
    model: ModelSection,
    parallel: ParallelSection,
    *,
    seq_len: int,
    use_flash_attention: bool = False,
    precision: str = "fp32",
    no_recompute: list[int] | None = None,
) -> paddle.nn.Layer:
    """The family's PaddleNLP causal LM (GPTForCausalLM, LlamaForCausalLM, QWenForCausalLM,
    ...: gptplan.families), random init (pipeline parallel uses the family's *Pipe class).
    `no_recompute`: see `build_config`.

    Kernels follow `kernel_choice`: flash attention when the plan asks for it and this device
    can run it (where it cannot, a warning says so and the standard kernel runs, with more
    activation memory); fused RMSNorm and RoPE on GPUs only."""
    kernels = kernel_choice(model, use_flash_attention=use_flash_attention, precision=precision)
    if use_flash_attention and not kernels["flash_attention"]:
        warnings.warn(
            "the plan asks for flash attention but this device cannot run it "
            f"(needs a CUDA GPU of compute capability >= 8.0 and fp16/bf16, precision "
            f"is {precision}); using the standard attention kernel",
            stacklevel=2,
        )
    config = build_config(
        model, parallel, seq_len=seq_len, kernels=kernels, no_recompute=no_recompute
    )
    net = _network(model, parallel, config)
    if parallel.recompute != "none":
        spec = families.get(model.family)
        if spec.enable_recompute is None:
            net.recompute_enable()
        else:  # the family knows which of its layers the granularity switches on
            spec.enable_recompute(net, parallel.recompute, parallel.pipeline_parallel_degree > 1)
    return net


# ---- the padding rows of the vocabulary --------------------------------------------------------
# model.vocab_size is at least the tokenizer's size (padded to a multiple of the plan's tp where
# tp does not divide it, gptplan.tokenizer.padded_vocab): ids at and above the tokenizer's size
# never occur in the data;
# they are masked out of the loss (their logits get PADDING_LOGIT before the cross-entropy, so
# they take no probability mass) and out of sampling.
PADDING_LOGIT = -1.0e4  # exp(-1e4) is 0 in fp16, bf16 and fp32 alike, and -1e4 is finite in fp16


def padding_mask(real: int, total: int, dtype: paddle.dtype) -> paddle.Tensor:
    """[total] additive mask: 0 for ids below `real`, PADDING_LOGIT for the padding rows."""
    import paddle

    return paddle.concat(
        [paddle.zeros([real], dtype="float32"), paddle.full([total - real], PADDING_LOGIT)]
    ).astype(dtype)


def mask_padding_in_loss(net: paddle.nn.Layer, real: int) -> bool:
    """Wrap the model's criterion so the padding rows (ids >= `real`) are out of the loss.

    Only where one rank holds the whole vocabulary (no tensor-parallel split of the logits, no
    pipeline criterion); returns whether the mask is in place."""
    import paddle

    criterion = getattr(net, "criterion", None)
    total = int(net.config.vocab_size)
    if criterion is None or real >= total or int(net.config.tensor_parallel_degree or 1) > 1:
        return False

    class MaskedCriterion(paddle.nn.Layer):
        def __init__(self, inner: paddle.nn.Layer) -> None:
            super().__init__()
            self.inner = inner

        def forward(
            self, logits: paddle.Tensor, labels: paddle.Tensor, *args: Any, **kwargs: Any
        ) -> paddle.Tensor:
            return self.inner(
                logits + padding_mask(real, total, logits.dtype), labels, *args, **kwargs
            )

    net.criterion = MaskedCriterion(criterion)
    return True


def sample_tokenizer_ids_only(net: paddle.nn.Layer, real: int) -> None:
    """Keep PaddleNLP's sampling to the tokenizer's ids (< `real`): the padding rows get
    PADDING_LOGIT in `adjust_logits_during_generation`, which its sampling loop calls on every
    step's logits before top-k (2.8.1's own `logits_processors` argument fails: it iterates a
    LogitsProcessorList, which is not iterable)."""
    total = int(net.config.vocab_size)
    if real >= total:
        return
    inner = net.adjust_logits_during_generation

    def adjust(logits: paddle.Tensor) -> paddle.Tensor:
        logits = inner(logits)
        return logits + padding_mask(real, total, logits.dtype)

    net.adjust_logits_during_generation = adjust


def recomputed_layers_of(net: paddle.nn.Layer, family: str) -> list[int] | None:
    """Indices of the decoder layers a built model of `family` recomputes (None for a family
    without per-layer recompute): what the dry run checks against the plan."""
    path = families.get(family).decoder_layers
    layers: Any = net  # walks down to the decoder layers (nn.LayerList)
    for attribute in path.split(".") if path else ():
        layers = getattr(layers, attribute, None)
    if not path or layers is None:
        return None
    return [i for i, layer in enumerate(layers) if getattr(layer, "layerwise_recompute", True)]
