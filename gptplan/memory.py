"""Memory per device: the formulas shared by the planner's cost model and the runner's
local rehearsal (`runner execute --local`), so both predict the same bytes.

All functions take numpy arrays (or scalars) and broadcast. Sources:
- [K22]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
         Models", table 2: activation memory per layer.
- [Z20]  Rajbhandari et al. 2020, ZeRO: bytes per parameter of model states under sharding.
The planner re-exports these from planner.screen.costmodel (its one formula module); the runner may
not import the planner, so they live here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from gptplan import families, precision
from gptplan.modelfacts import parameter_count
from gptplan.plan import ModelSection

GB = 1e9  # modelled bytes are shown in GB (10^9)
# A device's memory (profile memory_gb, plan hardware.memory_gb) is in binary gigabytes: an
# "80 GB" H100 or A100 has 81,920 MiB of HBM (nvidia-smi), a "40 GB" A100 40,960 MiB, and the
# CPU profile is half of a 24 GiB machine. Counting them as 10^9 bytes cut 7% off every device.
GIB = 2**30
MIB = 2**20
# The memory model's median absolute error against the measured peak memory of Paddle runs,
# 52 held-out configurations (bench/README.md section 2, bench/results/plan_quality.json
# memory_ape_median 0.1197, worst 0.20; CPU, the only hardware where Paddle ran here).
MEMORY_MODEL_ERROR = 0.12

# ---- the GPU-side terms, each from a cited source (no GPU on this project's machines) --------
# [CTX] CUDA context of one process: 287 MB with lazy module loading, 667 MB eager, measured
#   on one GPU (PyTorch PR 86509, "Sets CUDA_MODULE_LOADING to LAZY when not set by the
#   user"); lazy loading is the default on Linux from CUDA 12.2 (CUDA C++ Programming Guide,
#   "Lazy Loading", change history). Paddle 3.3.1's GPU wheels are CUDA 11.8 and 12.x builds,
#   so either can apply: the point is the midpoint, the band the two measurements.
CUDA_CONTEXT_GB = (0.29, 0.48, 0.67)  # (low, point, high)
# [CUBLAS] cuBLAS Library, cublasSetWorkspace: recommended workspace 32 MiB on Hopper, 4 MiB
#   on earlier GPUs, per handle; CUBLAS_WORKSPACE_CONFIG=":4096:8" (the documented setting
#   for deterministic results) holds 8 x 4 MiB. Paddle keeps a cuBLAS and a cuBLASLt handle
#   per stream (compute and communication): 4 handles x 32 MiB at the high end.
CUBLAS_WORKSPACE_GB = (4 * MIB / GB, 2 * 32 * MIB / GB, 4 * 32 * MIB / GB)
# The fixed runtime of a GPU process: context + library workspaces (cuDNN's handle is small
# next to them; flash attention's workspace scales with the tokens and is charged with the
# activations, `FLASH_DQ_ACCUM_BYTES`).
GPU_RUNTIME_GB = tuple(a + b for a, b in zip(CUDA_CONTEXT_GB, CUBLAS_WORKSPACE_GB))
# [FA2] FlashAttention-2 backward (flash_api.cpp mha_bwd, the kernels Paddle's
#   flash_attention calls): a float32 `dq_accum` of shape (b, s, heads, head_dim), i.e.
#   4 bytes per element of the layer's s·b·h/t query, alive during one layer's backward.
FLASH_DQ_ACCUM_BYTES = 4.0
# [NCCL] Each communicator holds its own buffers ("more communicators = more memory used",
#   NCCL maintainers in NVIDIA/nccl issue 864; NCCL_BUFFSIZE, default 4 MiB per channel and
#   peer, NCCL User Guide "Environment Variables"). Measured per communicator with a 4 MiB
#   all-reduce on 4 x A100 with NVLink: 544 MB for a 2-rank group, 688 MB for 3-4 ranks
#   (NVIDIA/nccl issue 964). Memory is linear in the channel count, which is higher on H100
#   NVLink (issue 864), and a communicator that never runs a collective costs less (lazy
#   connection): the band is x0.5-x1.5 of the measurement.
NCCL_GB_PAIR = 0.544
NCCL_GB_GROUP = 0.688
NCCL_GB_PER_COMMUNICATOR = NCCL_GB_GROUP  # kept for callers that price one communicator
NCCL_BAND = (0.5, 1.5)
# [FRAG] GPU caching allocators (PyTorch's, and Paddle's auto_growth best-fit allocator,
#   FLAGS_allocator_strategy's default since Paddle 2.0, which also splits cached blocks)
#   fragment under recompute, sharding and pipelining: GMLake (Guo et al., ASPLOS 2024,
#   arXiv 2401.08156) measured 15% fragmentation on average and up to 33% across eight LLMs
#   on A100-80GB (reserved = allocated / (1 - fragmentation)). The blocks that fragment are
#   the short-lived ones (activations, logits, transient buffers); model states are allocated
#   once. Point 1/(1-0.15) on the dynamic part, band 1 (no caching: the allocated peak) to
#   1/(1-0.33).
GPU_FRAGMENTATION = 1.0 / (1.0 - 0.15)
FRAGMENTATION_HIGH = 1.0 / (1.0 - 0.33)

# ---- Paddle's own buffers (paddle 3.3.1; the code each term follows) ---------------------------
# [STAGE2] paddle/distributed/fleet/meta_parallel/sharding/group_sharded_stage2.py, what
#   paddle.distributed.sharding.group_sharded_parallel(level="os_g") builds (runner/train.py
#   and PaddleNLP 2.8.1's Trainer both call it with the default buffer_max_size = 2**23):
#   `_setup_use_grad_storage` makes one GradStorage per (dtype, owning rank) of
#   min(largest rank's share, 2**23) elements, `_build_grad_storages` rebuilds the d-1
#   storages of the other ranks at every forward and `_get_reduce_fn` frees each only after
#   its reduce, which waits for its last (first-layer) gradient: they live through backward.
#   A parameter that fits no storage keeps its own gradient until its hook reduces and
#   clears it (the largest one is the transient).
STAGE2_BUFFER_ELEMENTS = 2**23
FP32_BYTES = precision.FP32_BYTES
# [AMPACT] What 16-bit training keeps beyond the 16-bit count of [K22], measured on the
#   rehearsal device (Paddle's allocator, bench/memory_device.py: tiny GPT and Llama with 2 and
#   4 layers at seq 64 and 128, fp32 / bf16 / fp16, O1 / O2; one layer's kept bytes by
#   difference, split into its s·b·h and a·s²·b parts by the two sequence lengths): the
#   family's fp32 tensors (gptplan.families `amp_activation`, `unfused_activation`,
#   `softmax_fp32`), and at O1 (paddle.amp.auto_cast level O1 without decorate: fp32
#   parameters) three more things. (1) The fp32 residual stream: the embedding lookup is
#   black-listed (paddle/amp/amp_lists.py EXTRA_BLACK_LIST lookup_table_v2), so the residual
#   adds promote to fp32 and the norms keep fp32 inputs and outputs: measured +8 (GPT) and +10
#   (Llama) bytes per s·b·h per layer over O2, AMP_O1_LAYER_BYTES their mean. (2) The softmax
#   black-listed (FP16_BLACK_LIST softmax): 4 bytes a score where the family computes it in
#   16-bit (GPT: 7 bytes a score at O1, 5 at O2, measured). (3) Every white-listed matmul casts
#   its fp32 weight to 16-bit at each forward (egr::AmpAutoCast, no cast cache in dygraph) and
#   the matmul keeps that copy for its backward: 2 bytes a matrix parameter per micro-batch in
#   flight (`O1_WEIGHT_COPY`; measured: the s-independent part of a layer's O1 excess equals
#   its matrices at 2 bytes).
AMP_O1_LAYER_BYTES = 9.0
# [TPIN] Tensor parallel: each column-parallel projection keeps its own input for its weight
#   gradient. Without sequence parallel that input is a copy of the layer's replicated input:
#   paddle/distributed/fleet/layers/mpu/mp_layers.py ColumnParallelLinear.forward ->
#   mp_ops._c_identity -> _C_ops.c_identity ("Return a copy of the tensor"; mp_skip_c_identity
#   off, the runner's mp_configs); with sequence parallel the full sequence all-gathered:
#   fleet/utils/sequence_parallel_utils.py ColumnSequenceParallelLinear.forward
#   (`AllGatherOp.apply(x)`, then the matmul keeps it; Megatron re-gathers in backward, which
#   [K22] counts). So a layer keeps n 16-bit inputs of s·b·h (family `column_projections`:
#   GPT's q, k, v, linear1 = 4; Llama 5; QWen 3) where [K22] counts 2 (/t with sp). Measured
#   on the rehearsal device: tp 2 GPT and Llama, tp 2 + sp GPT (bench/memory_device.py).
O1_WEIGHT_COPY = 2.0  # bytes a matrix parameter (the 16-bit copy)
RECOMPUTE_BACKWARD_EXTRA = 0.4  # [RECOMP]
# [PARTITION] Both sharding optimizers give whole parameters to ranks (greedy to the least
#   loaded rank: GroupShardedOptimizerStage2._segment_params, and
#   DygraphShardingOptimizer._partition_parameters, largest first): the busiest rank holds
#   at least the largest parameter, so its share is max(P/d, largest), not P/d. Stage 3
#   (GroupShardedStage3) slices parameters into segments and is even.
# [DPFUSE] Data parallel without group sharding copies every gradient into fused buffers
#   before all-reducing them. paddle.DataParallel's EagerReducer
#   (paddle/fluid/distributed/collective/reducer.cc: InitializeGroups allocates every dense
#   group's `dense_contents_`, all its gradients' elements, when the model is wrapped, and
#   keeps it; ConcatTensors / SplitTensors copy through it): a second copy of the gradients
#   for the whole run, measured on the rehearsal device (data parallel x 2: +4 bytes a
#   parameter in fp32 after the first step, bench/memory_device.py). Fleet's hybrid
#   all-reduce (fleet/utils/hybrid_parallel_util.py _apply_collective_grads_eager:
#   build_groups coalesces all gradients before the first all_reduce) holds its copy as
#   backward ends, when the activations are freed: max(0, copy - activations).
# [PLACE] Where the parameters are under tensor and pipeline parallelism (`params_on_device`).
# [BUFFERS] The model's own non-parameter tensors (`model_buffers`).
# [MAINGRAD] PaddleNLP's amp_master_grad (paddle/distributed/fleet/utils/mix_precision_utils
#   MixPrecisionLayer): an fp32 `main_grad` per parameter replaces the 16-bit gradient
#   (4 bytes, not 2); the runner does not use it (paddle.amp.decorate O2, 16-bit gradients).
# [1F1B] paddle/distributed/fleet/meta_parallel/pipeline_parallel.py
#   forward_backward_pipeline: stage k runs min(p - k - 1, m) warm-up forwards, so stage 0
#   holds p micro-batches' activations, and keeps each one's input and output tensors
#   (input_buffers / output_buffers) until its backward; interleaved: (p - k - 1)·2 +
#   (v - 1)·p warm-up chunks ([K22] section 4.2.3's 1 + (p-1)/(p·v)).
# [RECOMP] paddle.distributed.fleet.recompute: the backward of a recomputed layer re-runs its
#   forward with gradients on, so one layer's full activations exist again while the others
#   keep only what the granularity keeps (Chen et al. 2016, "Training Deep Nets with
#   Sublinear Memory Cost": peak = checkpoints + one segment), and that layer's backward
#   adds the gradients of its activations: measured on the rehearsal device (full
#   recompute, GPT and Llama, bench/memory_device.py), the working layer held 1.32-1.52 x
#   its full activations; RECOMPUTE_BACKWARD_EXTRA = 0.4 is their mean.
# [LOSS] The loss path (PaddleNLP 2.8.1 criteria, runner/train.py): at the loss kernel and
#   its backward the logits, their fp32 copy, the fp32 softmax and the fp32 logit gradient
#   are alive (precision `logit_bytes`); through the layers' backward only the logits the
#   runner keeps bound (`loss, _ = model(...)`) remain, so a recomputed layer's working set
#   and the loss path's peak never coexist: activations + logits = kept + max(loss path,
#   bound logits + working layer). A pipeline's criterion layer keeps no bound logits
#   (train_batch), and its loss is on the last stage. Measured on the rehearsal device:
#   12 bytes a logit in fp32 at the loss; the last stage, not the first, holds it.

# The band: each term's worst credible error, as factors (low, high) on the term. Weights
# match Paddle's allocator on the rehearsal device to the byte (+2% for alignment); the sharded
# gradients and optimizer states follow Paddle's partition, which the model approximates: the
# worst on the device was Llama stage 2 x 2 at measured/modelled 1.063 (bench/README.md
# section 8), on Paddle's own code GPT-110M stage 2 x 8 at 1.053, the lowest 0.984 (stage 1 x
# 2): x0.98-x1.06; activations follow [K22]'s per-tensor accounting with [AMPACT], measured/
# modelled on the device 0.87-1.17 for activations + loss path over 60 layouts in fp32 and AMP
# (2026-12-06; full recompute under tp 0.87, under AMP 1.17) (x0.85-x1.25); the loss path
# was fitted x1.08 on Paddle's CPU peaks (x0.9-x1.1); the allocator from no caching to
# GMLake's worst; the runtime and communicators their sources'.
TERM_BAND = {
    "weights": (1.0, 1.02),
    "gradients": (0.98, 1.06),
    "optimizer": (0.98, 1.06),
    "activations": (0.85, 1.25),
    "logits": (0.9, 1.1),
    "comm_buffers": (0.0, 1.0),  # the fused copy may overlap nothing or everything it can
    "allocator": (0.0, (FRAGMENTATION_HIGH - 1.0) / (GPU_FRAGMENTATION - 1.0)),
    "runtime": (GPU_RUNTIME_GB[0] / GPU_RUNTIME_GB[1], GPU_RUNTIME_GB[2] / GPU_RUNTIME_GB[1]),
    "communicators": NCCL_BAND,
}
TERMS = tuple(TERM_BAND)
# A "may fit" layout is chosen only when it costs at least this share less than the best
# layout that surely fits (planner.screen.decide); otherwise the surely-fitting one is chosen.
MAY_FIT_SAVING = 0.05


# [SELECTIVE] Where a layout's recompute is another framework's own selective scheme (a published
# run's "selective" checkpointing: Megatron's is [K22]'s core attention, torchtitan's per-op
# policy saves every other matmul output, others their own), the model reads it as the nearest
# Paddle granularity (core_attn / full_attn), which may keep far more than the scheme did; every
# checkpointing scheme keeps at least what full recompute keeps (the layer inputs). Such a
# layout's terms may carry this key: the low end of the same layout's band under full recompute.
# The optimistic end is then the lower of the two: such a run is refused only where even full
# recompute would exceed the card. Point and high end are unchanged.
OPTIMISTIC_FLOOR = "optimistic_floor_bytes"


def memory_band(terms: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(low, point, high, deciding term index into TERMS) per layout: each term times its
    worst credible error (TERM_BAND), summed. The deciding term is the one whose error
    moves the high end the most."""
    each = [np.asarray(terms[k], dtype=float) for k in TERMS]
    # elementwise, term by term: a row's band is the same evaluated alone or in a table
    point, low, high = 0.0 * each[0], 0.0 * each[0], 0.0 * each[0]
    for k, x in zip(TERMS, each, strict=True):
        point = point + x
        low = low + x * TERM_BAND[k][0]
    spread = [x * (TERM_BAND[k][1] - 1.0) for k, x in zip(TERMS, each, strict=True)]
    for x in spread:
        high = high + x
    if OPTIMISTIC_FLOOR in terms:  # [SELECTIVE]: a scheme known only between two of ours
        low = np.minimum(low, np.asarray(terms[OPTIMISTIC_FLOOR], dtype=float))
    return low, point, point + high, np.argmax(np.array(spread), axis=0)


def memory_fit(
    low_bytes: Any, high_bytes: Any, physical_bytes: Any, headroom: Any
) -> tuple[np.ndarray, np.ndarray]:
    """(surely fits, may fit) per layout. Surely fits: the band's high end within the usable
    memory (physical x headroom). May fit: not surely, but the optimistic end within the
    card's physical memory. Past that even the optimistic end exceeds the card: refused."""
    physical = np.asarray(physical_bytes, dtype=float)
    sure = np.asarray(high_bytes, dtype=float) <= physical * headroom
    return sure, ~sure & (np.asarray(low_bytes, dtype=float) <= physical)


# The band as single factors on the modelled peak, where a layout's own band is not at hand
# (the recompute-layer search's target): the lowest low/point and the highest high/point over
# the published per-device check layouts (bench/memory_accuracy.py writes them to
# bench/results/memory_accuracy.json; bench/README.md section 8). Every decision uses the
# layout's own band (memory_band).
MEMORY_RATIO_P10 = 0.72
MEMORY_RATIO_P90 = 1.47


def band_ratios(terms: dict) -> tuple[np.ndarray, np.ndarray]:
    """(low / point, high / point) per layout: its band as factors on the modelled peak."""
    low, point, high, _ = memory_band(terms)
    return low / point, high / point


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    params_total: int
    params_body: int  # without embeddings
    # Activation bytes per layer in units of s·b·h at 16 bit, by family (see
    # `activation_coefficients`); GPT's are [K22] table 2's.
    act_replicated: float = 10.0  # not split by tensor parallel (norm and matmul inputs)
    act_split: float = 24.0  # split by tensor parallel
    act_scores: float = 5.0  # times a·s/h: the stored attention scores
    kept_replicated: float = 4.0  # full_attn recompute keeps the norms ...
    kept_split: float = 19.0  # ... and the MLP
    kv_heads: int = 0  # grouped-query attention (Llama); 0 = as many as heads
    gated: bool = False  # SwiGLU MLP (Llama: gate, up and down projections)
    # [AMPACT] beyond the 16-bit count, from the family (gptplan.families): bytes per s·b·h
    # per layer 16-bit training keeps (replicated); the unfused RMSNorm / RoPE's 16-bit
    # units (split) and fp32 bytes (replicated); whether it applies where the device has fused
    # kernels (1: the family runs them there); the softmax in fp32 (1) and cast back
    amp_layer: float = 0.0
    unfused_split: float = 0.0
    unfused_amp_layer: float = 0.0
    fuses: float = 0.0
    softmax_fp32: float = 0.0
    column_projections: float = 0.0  # [TPIN] 0 = [K22]'s two inputs a layer
    # Where the parameters are ([PLACE]); 0 = not known (a shape from bare numbers: the
    # parameters are then spread evenly over tensor and pipeline ranks)
    vocab_params: float = 0.0  # the word embedding V·h (split by tensor parallel)
    head_params: float = 0.0  # an untied LM head V·h (0 when tied)
    position_params: float = 0.0  # learned positions s·h (not split by tensor parallel)
    final_norm_params: float = 0.0
    replicated_layer: float = 0.0  # a layer's elements tensor parallel does not split
    # [BUFFERS] non-parameter tensors the PaddleNLP class holds: bytes per model, per layer in
    # weight elements (cast with the weights) and per model in weight elements
    buffer_bytes: float = 0.0
    buffer_layer_elements: float = 0.0
    # [STAGE3] a layer's matrices: (elements, how many) in three slots (split by tensor parallel)
    mat_a: float = 0.0
    n_a: float = 0.0
    mat_b: float = 0.0
    n_b: float = 0.0
    mat_c: float = 0.0
    n_c: float = 0.0

    @property
    def largest_param(self) -> np.ndarray:
        """Elements of the largest single parameter before tensor parallelism: the word
        embedding (V·h), an MLP matrix (h·ffn) or a fused QKV projection (3h²). Sharding
        gives whole parameters to ranks ([PARTITION])."""
        h = np.asarray(self.hidden, dtype=float)
        v, f = np.asarray(self.vocab, dtype=float), np.asarray(self.ffn, dtype=float)
        return np.maximum(np.maximum(v * h, h * f), 3.0 * h * h)

    @classmethod
    def from_section(cls, m: ModelSection) -> ModelShape:
        """The family's shape (gptplan.families): `ffn` is the width of one MLP branch (QWen's
        intermediate_size counts both SwiGLU branches), `gated` its SwiGLU."""
        spec = families.get(m.family)
        h, v = m.hidden_size, m.vocab_size
        final_norm = spec.final_norm_parameters(m)
        buffer_bytes, buffer_layer = model_buffers(m)
        mats = layer_matrices(m)
        return cls(
            m.num_hidden_layers,
            h,
            m.num_attention_heads,
            spec.mlp_width(m),
            v,
            parameter_count(m),
            parameter_count(m, include_embeddings=False),
            *activation_coefficients(m),
            m.num_key_value_heads or m.num_attention_heads,
            spec.gated_mlp,
            amp_layer=spec.amp_activation,
            unfused_split=spec.unfused_activation[0],
            unfused_amp_layer=spec.unfused_activation[1],
            fuses=float(spec.fused_kernels),
            softmax_fp32=float(spec.softmax_fp32),
            column_projections=float(spec.column_projections),
            vocab_params=float(v * h),
            head_params=0.0 if spec.lm_head_tied(m) else float(v * h),
            position_params=float(m.max_position_embeddings * h if spec.learned_positions else 0),
            final_norm_params=float(final_norm),
            # two norms a layer like the final one; LayerNorm's bias comes with biases on the
            # row-parallel projections (GPT's out_proj and linear2), which tp replicates too
            replicated_layer=float(2 * final_norm + (2 * h if final_norm == 2 * h else 0)),
            buffer_bytes=buffer_bytes,
            buffer_layer_elements=buffer_layer,
            mat_a=float(mats[0][0]),
            n_a=float(mats[0][1]),
            mat_b=float(mats[1][0]),
            n_b=float(mats[1][1]),
            mat_c=float(mats[2][0]),
            n_c=float(mats[2][1]),
        )

    def framework_neutral(self) -> ModelShape:
        """This shape without what only Paddle and PaddleNLP's classes do: the classes'
        buffers ([BUFFERS]), stage 3's unsliced small parameters ([STAGE3]) and Paddle's
        pipeline segmentation by layers ([PLACE]: parameters spread evenly instead). For runs
        of other frameworks (the published runs: PyTorch FSDP flattens and shards every
        parameter; Megatron-DeepSpeed balances stages counting the embedding as a layer)."""
        zero: dict[str, Any] = {f: 0.0 for f in _PADDLE_ONLY_FIELDS}
        return dataclasses.replace(self, **zero)

    @property
    def kv_fraction(self) -> np.ndarray:
        """Key/value heads over query heads (1 without grouped-query attention)."""
        kv = np.asarray(self.kv_heads, dtype=float)
        heads = np.asarray(self.heads, dtype=float)
        return np.where(kv > 0, kv / heads, 1.0)


_PADDLE_ONLY_FIELDS = (
    "vocab_params",
    "head_params",
    "position_params",
    "final_norm_params",
    "replicated_layer",
    "buffer_bytes",
    "buffer_layer_elements",
    "amp_layer",
    "unfused_split",
    "unfused_amp_layer",
    "column_projections",
    "n_a",
    "n_b",
    "n_c",
)


def model_buffers(m: ModelSection) -> tuple[float, float]:
    """[BUFFERS] The non-parameter tensors PaddleNLP 2.8.1's class holds (allocated with the
    model, on the device): (bytes per model, elements per layer), from the family
    (gptplan.families `model_buffers`): GPT's int64 causal mask s_max x s_max (8 bytes a
    position pair, GPTModel.__init__), Llama's rotary `cos_cached` / `sin_cached` [1, s_max, 1,
    head_dim] and `inv_freq` per layer (LlamaRotaryEmbedding), QWen's `logn_tensor` [1, 32767,
    1, 1] and rotary `inv_freq` per layer (QWenAttention). Float buffers are cast with the
    weights (paddle.amp.decorate O2 casts a layer's buffers with its parameters,
    Layer._to_impl(floating_only=True)). Measured on the rehearsal device: the weights'
    allocation after the build is the parameters plus exactly these
    (bench/memory_device.py)."""
    return families.get(m.family).model_buffers(m)


def layer_matrices(m: ModelSection) -> tuple[tuple[int, int], ...]:
    """[STAGE3] A layer's weight matrices as (elements, how many), three slots, before tensor
    parallelism, from the family (gptplan.families `layer_matrices`): GPT q, k, v, out_proj
    h x h and linear1/linear2 h x f; Llama q and o h x h, k and v h x (h·kv/a), gate/up/down
    h x f; QWen c_attn h x 3h, c_proj h x h, w1/w2/c_proj h x f/2. The rest of a layer
    (biases, norms) are vectors."""
    return families.get(m.family).layer_matrices(m)


def activation_coefficients(m: ModelSection) -> tuple[float, float, float, float, float]:
    """(replicated, split, scores, kept_replicated, kept_split) per family, 16-bit units:
    each family's `activation_coefficients` (gptplan.families). GPT's are [K22] table 2's
    with its dropout terms; Llama and QWen (no dropout) a pre-norm SwiGLU decoder's."""
    return families.get(m.family).activation_coefficients(m)


# ---- memory ------------------------------------------------------------------------------------


def model_state_bytes_per_param(precision_code: Any, stage_code: Any, shard_degree: Any) -> Any:
    """[Z20] bytes per parameter for weights + grads + AdamW states on one rank, by the
    precision's row (gptplan.precision; codes, numbers or arrays).

    Mixed precision (fp16/bf16): 2 + 2 + 12 (fp32 master, momentum, variance). fp32: 4 + 4 + 8.
    stage1 shards optimizer states, stage2 also grads, stage3 also weights, over shard_degree.
    """
    w = g = precision.of_codes("bytes_per_element", precision_code)
    o = precision.of_codes("optimizer_bytes_per_param", precision_code)
    d = np.asarray(shard_degree, dtype=float)
    stage = np.asarray(stage_code)
    return np.select(
        [stage == 0, stage == 1, stage == 2, stage == 3],
        [w + g + o, w + g + o / d, w + (g + o) / d, (w + g + o) / d],
    )


def activation_bytes_per_layer(
    shape: ModelShape,
    seq_len: Any,
    micro_batch: Any,
    tp: Any,
    seq_parallel: Any,
    recompute_code: Any,
    act_bytes: Any,
    flash_attention: Any = False,
    amp_o1: Any = False,
    unfused: Any = True,
    extras: Any = True,
) -> Any:
    """[K22] table 2, scaled from 16-bit to `act_bytes` per element, and [AMPACT] what 16-bit
    training keeps beyond that count (`act_bytes` < 4): the family's fp32 tensors
    (`amp_layer`, replicated), its unfused norm and rotary kernels' (`unfused`: the device has
    no fused ones, or the family runs none), a softmax kept in fp32 and cast back (6 bytes a
    score), and at AMP level O1 (`amp_o1`) the fp32 residual stream (AMP_O1_LAYER_BYTES) and
    the black-listed softmax in fp32 (4 bytes where the family computes it in 16-bit).
    `extras=False`: [K22]'s count alone (gptplan.steptime's traffic proxy, fitted on published
    runs with that count).

    none:      s·b·h·(34 + 5·a·s/h)            (tp: 10 + 24/t + 5as/(ht); tp+sp: all / t)
               (GPT's coefficients; each family's come from `activation_coefficients`)
    core_attn: drops the 5·a·s/h term (selective recompute)
    full_attn: keeps layer input, MLP and norms: s·b·h·23 (/t where split)
    full:      only each layer's input, 2·s·b·h
    flash_attention: the fused kernel never stores the b·a·s² scores, softmax or dropout mask
    (Dao et al. 2022, FlashAttention), so the 5·a·s/h term goes, as with core_attn.
    """
    s = np.asarray(seq_len, dtype=float)
    b = np.asarray(micro_batch, dtype=float)
    t = np.asarray(tp, dtype=float)
    sp = np.asarray(seq_parallel, dtype=bool)
    h, a = np.asarray(shape.hidden, dtype=float), np.asarray(shape.heads, dtype=float)
    sbh = s * b * h
    w = np.asarray(act_bytes, dtype=float)
    sixteen = (w < FP32_BYTES) & np.asarray(extras, dtype=bool)
    o1 = sixteen & np.asarray(amp_o1, dtype=bool)
    unf = np.asarray(extras, dtype=bool) & (
        np.asarray(unfused, dtype=bool) | (np.asarray(shape.fuses, dtype=float) == 0)
    )
    soft32 = np.asarray(shape.softmax_fp32, dtype=float) > 0
    # scores in bytes per a·s²·b at 16 bit, then what 16-bit training adds ([AMPACT])
    scores_16 = shape.act_scores * w / 2.0 + np.where(
        sixteen, np.where(soft32, FP32_BYTES, np.where(o1, FP32_BYTES - w, 0.0)), 0.0
    )
    attn_scores = scores_16 * 2.0 / w * a * s / h
    split = shape.act_split + np.where(unf, shape.unfused_split, 0.0)
    kept_split = shape.kept_split
    # bytes per s·b·h kept in fp32 by 16-bit training, replicated, as 16-bit units
    amp_rep = np.where(
        sixteen,
        shape.amp_layer
        + np.where(unf, shape.unfused_amp_layer, 0.0)
        + np.where(o1, AMP_O1_LAYER_BYTES, 0.0),
        0.0,
    ) * (2.0 / w)
    rep = shape.act_replicated + amp_rep
    kept_rep = shape.kept_replicated + amp_rep
    linear_part = np.where(sp, (rep + split) / t, np.where(t > 1, rep + split / t, rep + split))
    # [TPIN] under tensor parallel each column-parallel projection keeps its own input
    n_col = np.asarray(shape.column_projections, dtype=float)
    tp_inputs = np.where(
        (t > 1) & (n_col > 0) & np.asarray(extras, dtype=bool),
        np.where(sp, 2.0 * n_col - 4.0 / t, 2.0 * (n_col - 2.0)),
        0.0,
    )
    linear_part = linear_part + tp_inputs
    scores_part = np.where(np.asarray(flash_attention, dtype=bool), 0.0, attn_scores / t)
    code = np.asarray(recompute_code)
    kept = np.where(
        sp,
        (kept_rep + kept_split) / t,
        np.where(t > 1, kept_rep + kept_split / t, kept_rep + kept_split),
    )
    per_layer_16bit = np.select(
        [code == 0, code == 1, code == 2, code == 3],
        [
            sbh * (linear_part + scores_part),
            sbh * linear_part,
            sbh * (kept + tp_inputs / 2),
            2.0 * sbh,
        ],
    )
    return per_layer_16bit * (w / 2.0)


# ---- the runtime: what a process holds beyond tensors the model owns ------------------------


def device_memory_args(device: str, overhead_gb: float, fragmentation: float) -> dict:
    """The terms of `memory_terms` that depend on the device kind, not the layout: on a GPU
    the cited GPU-side terms (GPU_RUNTIME_GB, GPU_FRAGMENTATION, NCCL communicators);
    elsewhere the profile's measured process overhead and allocator margin (on CPU gloo's
    buffers are inside the measured overhead: no communicator term)."""
    if device == "gpu":
        return dict(
            overhead_gb=GPU_RUNTIME_GB[1],
            fragmentation=GPU_FRAGMENTATION,
            communicator_gb=NCCL_GB_GROUP,
            fused_kernels=True,
        )
    return dict(
        overhead_gb=overhead_gb,
        fragmentation=fragmentation,
        communicator_gb=0.0,
        fused_kernels=False,
    )


def communicators(*, world: Any, tp: Any, pp: Any, shard_degree: Any, dp: Any) -> np.ndarray:
    """NCCL communicators a rank of this layout joins (groups of more than one rank): the
    global group, data, tensor, pipeline (Paddle builds one p2p group per stage pair) and
    sharding. [NCCL] each holds its own buffers."""
    one = np.ones_like(np.asarray(world, dtype=float))
    return sum(
        (np.asarray(x, dtype=float) > 1) * one for x in (world, dp, tp, pp, pp, shard_degree)
    )


def communicator_gb_total(
    *, world: Any, tp: Any, pp: Any, shard_degree: Any, dp: Any
) -> np.ndarray:
    """GB of NCCL buffers a rank holds ([NCCL]): NCCL_GB_PAIR for a 2-rank group (the
    pipeline's p2p pairs, any group of 2), NCCL_GB_GROUP for a larger one."""
    one = np.ones_like(np.asarray(world, dtype=float))
    total = 0.0 * one
    for x in (world, dp, tp, shard_degree):
        n = np.asarray(x, dtype=float) * one
        total = total + np.where(n > 2, NCCL_GB_GROUP, np.where(n == 2, NCCL_GB_PAIR, 0.0))
    # the previous and the next stage: two p2p pairs on a middle stage, one on the first
    return total + np.where(np.asarray(pp, dtype=float) * one > 1, 2.0 * NCCL_GB_PAIR, 0.0)


def sharded_share(
    params_per_device: Any,
    largest: Any,
    layer_matrix: Any,
    shard_degree: Any,
    stage_code: Any,
    unsliced: Any = 0.0,
) -> np.ndarray:
    """Elements of the busiest rank's share of sharded states ([PARTITION]) for stage 1 and
    2 (whole parameters per rank): max(P/d + half a layer matrix, the largest parameter);
    for stage 3 (P - U)/d + U, where U are the elements of the parameters stage 3 keeps whole
    on every rank ([STAGE3]: those of at most 2**20 elements). Greedy placement in parameter
    order leaves the busiest rank about half of one layer's largest matrix above the mean
    (Paddle's own partition of the GPT 1.3B, 6.7B and 13B shapes over 8 ranks: 0.45-0.6 of
    h x ffn, tests/test_memory_paddle.py)."""
    d = np.asarray(shard_degree, dtype=float)
    even = params_per_device / d
    kept = np.minimum(np.asarray(unsliced, dtype=float), params_per_device)
    stage3 = (params_per_device - kept) / d + kept
    greedy = even + (1.0 - 1.0 / d) * layer_matrix / 2.0
    whole = np.maximum(greedy, np.minimum(largest, params_per_device))
    return np.where(np.asarray(stage_code) >= 3, stage3, np.where(d > 1, whole, even))


# [STAGE3] paddle/distributed/fleet/meta_parallel/sharding/group_sharded_stage3.py
#   (GroupShardedStage3, segment_size=2**20 by default; group_sharded_parallel passes it on):
#   `_segment_rank_params` slices only parameters of more than segment_size elements
#   (`if p._numel() > self._segment_size`); the others go to `_unslice_params`, which every
#   rank keeps whole with their gradients and optimizer states. Measured on the rehearsal
#   device: a model of such parameters only holds under stage 3 x 8 what one unsharded rank
#   holds (bench/memory_device.py).
STAGE3_SEGMENT_ELEMENTS = 2**20


def stage3_unsliced(shape: ModelShape, tp: Any, stage_layers: Any, pp: Any) -> np.ndarray:
    """[STAGE3] Elements of a rank's parameters that stage 3 does not slice (at most
    STAGE3_SEGMENT_ELEMENTS each, after tensor parallelism): per layer the small matrices and
    every vector (biases, norms), plus a small embedding, head or position table. 0 for a
    shape without its matrices (a shape from bare numbers)."""
    t = np.asarray(tp, dtype=float)
    seg = float(STAGE3_SEGMENT_ELEMENTS)

    def small(x: Any) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        return np.where(x <= seg, x, 0.0)

    slots = [(shape.mat_a, shape.n_a), (shape.mat_b, shape.n_b), (shape.mat_c, shape.n_c)]
    matrices = sum(np.asarray(n, dtype=float) * np.asarray(m, dtype=float) for m, n in slots)
    layer = (np.asarray(shape.params_body, dtype=float) - shape.final_norm_params) / np.asarray(
        shape.layers, dtype=float
    )
    vectors = np.maximum(layer - matrices, 0.0)
    split_vectors = np.maximum(vectors - shape.replicated_layer, 0.0) / t
    per_layer = sum(np.asarray(n, dtype=float) * small(np.asarray(m) / t) for m, n in slots)
    per_layer = per_layer + split_vectors + shape.replicated_layer
    embed = small(np.asarray(shape.vocab_params) / t)
    extras = np.where(
        np.asarray(pp, dtype=float) > 1,
        embed + np.maximum(small(shape.position_params), shape.final_norm_params),
        embed + small(np.asarray(shape.head_params) / t) + small(shape.position_params),
    )
    extras = extras + shape.final_norm_params * (np.asarray(pp, dtype=float) <= 1)
    known = np.asarray(shape.n_a, dtype=float) > 0
    return np.where(known, stage_layers * per_layer + extras, 0.0)


def params_on_device(shape: ModelShape, tp: Any, pp: Any) -> np.ndarray:
    """[PLACE] Parameters on the busiest rank of tensor degree `tp` and pipeline degree `pp`.
    Tensor parallel splits the matrices, the word embedding and the LM head, and replicates
    the norms, the row-parallel biases and learned positions (PaddleNLP's mpu layers). A
    pipeline stage holds ceil(L/p) layers; the first also the embeddings, the last the final
    norm and the LM head, which a tied model keeps as a second copy of the embedding there
    (PaddleNLP 2.8.1 GPTForCausalLMPipe / LlamaForCausalLMPipe: SharedLayerDesc or their own
    head; Paddle's PipelineLayer segments by layers): the larger of the two. Measured on the
    rehearsal device: the allocation after the build is these parameters and the model's
    buffers to the byte (bench/memory_device.py). A shape without these facts spreads all
    parameters evenly."""
    t = np.asarray(tp, dtype=float)
    p = np.asarray(pp, dtype=float)
    layers = np.asarray(shape.layers, dtype=float)
    stage_layers = np.ceil(layers / p)
    even = shape.params_total / (t * p) * stage_layers * p / layers
    layer = (np.asarray(shape.params_body, dtype=float) - shape.final_norm_params) / layers
    per_layer = (layer - shape.replicated_layer) / t + shape.replicated_layer
    embed = np.asarray(shape.vocab_params, dtype=float) / t
    head = np.asarray(shape.head_params, dtype=float) / t
    whole = layers * per_layer + embed + head + shape.position_params + shape.final_norm_params
    first = stage_layers * per_layer + embed + shape.position_params
    last = stage_layers * per_layer + np.where(head > 0, head, embed) + shape.final_norm_params
    placed = np.where(p > 1, np.maximum(first, last), whole)
    return np.where(np.asarray(shape.vocab_params, dtype=float) > 0, placed, even)


def memory_terms(
    shape: ModelShape,
    *,
    seq_len: Any,
    micro_batch: Any,
    accumulation: Any,
    tp: Any,
    pp: Any,
    stage_code: Any,
    shard_degree: Any,
    recompute_code: Any,
    seq_parallel: Any,
    precision_code: Any,
    overhead_gb: Any,
    fragmentation: Any,
    flash_attention: Any = False,
    virtual_pp: Any = 1,
    recompute_layers: Any = 0,
    dp: Any = 1,
    communicator_gb: Any = 0.0,
    main_grad: Any = False,
    amp_o1: Any = False,
    fused_kernels: Any = False,
) -> dict[str, np.ndarray]:
    """Peak bytes on the busiest device, term by term (each an array; their sum is the peak).

    `amp_o1`: a 16-bit precision at AMP level O1 (paddle.amp.auto_cast O1, no decorate, as
    runner/train.py runs it): fp32 weights and gradients, AdamW's two moments without a master
    weight (8 bytes), and the O1 activations of [AMPACT] with every matmul's 16-bit weight copy
    per micro-batch in flight. `fused_kernels`: the device runs the family's fused RMSNorm and
    RoPE (a GPU; gptplan.families `fused_kernels`), else their unfused code's activations.

    weights, gradients, optimizer: [Z20] per sharding stage as Paddle 3.3.1 holds them.
      16-bit training keeps bf16/fp16 weights and gradients (paddle.amp.decorate O2) and the
      fp32 master weight and two AdamW moments (12 bytes); `main_grad` (PaddleNLP's
      amp_master_grad, [MAINGRAD]) makes the gradient an fp32 one (4 bytes). Stage 1 and 2
      shard the optimizer over whole parameters ([PARTITION]: the busiest rank holds
      max(P/d, largest parameter)); stage 2's gradients are that share plus the d-1 other
      ranks' GradStorage buffers of min(share, 2**23) elements and the largest parameter's
      transient gradient ([STAGE2]); stage 3 shards everything evenly.
    activations: per layer by recompute choice (`activation_bytes_per_layer`, [K22] table 2
      with each family's coefficients); with `recompute_layers` k > 0 only k of a stage's
      ceil(L/p) layers keep the recompute granularity's bytes and the others keep everything
      (PaddleNLP 2.8.1 LlamaModel / LlamaForCausalLMPipe `no_recompute_layers`). Under
      recompute, one layer's full activations exist again in its backward ([RECOMP]); flash
      attention's backward adds its fp32 dq accumulator ([FA2]). The first pipeline stage
      holds min(p, m) micro-batches in flight (1F1B; interleaved: x (1 + (p-1)/(p·v))), each
      with its stage output kept for backward ([1F1B]).
    logits: the loss path as PaddleNLP 2.8.1 computes it (LlamaPretrainingCriterion and
      GPTPretrainingCriterion: `prediction_scores.astype("float32")` into CrossEntropyLoss, or
      ParallelCrossEntropy under tp, whose softmax is kept for backward). The runner keeps
      the model's logits alive through the step (`loss, _ = model(...)`, runner/train.py), so
      at the loss kernel the 16-bit logits (2 bytes), their fp32 copy (4) and the fp32 softmax
      (4) are all alive, and in backward the logits, the softmax and the fp32 logit gradient
      (4): 10 bytes a logit in 16-bit training; 12 in fp32 (Paddle's cast to the same dtype
      copies); b·s·V/t logits. Through the layers' backward only the bound logits remain,
      so the term is max(that peak - the working layer, the bound logits) ([LOSS]); under
      pipeline parallel what the last stage holds beyond the first stage's activations.
    comm_buffers: data parallel without group sharding copies all gradients into fused
      buffers ([DPFUSE]): paddle.DataParallel keeps them for the whole run; fleet's hybrid
      all-reduce needs its copy beyond the activations freed as backward ends.
    allocator: the fragmentation margin on the dynamic part (activations, logits, buffers):
      [FRAG] on a GPU, the profile's measured margin elsewhere.
    runtime: the process's fixed overhead (GPU: CUDA context and cuBLAS workspaces, [CTX]
      [CUBLAS]; CPU: the Python + Paddle process, measured).
    communicators: NCCL buffers per communicator ([NCCL]; 0 on CPU, where gloo's buffers are
      in the measured overhead). `communicator_gb` scales them (NCCL_GB_GROUP = as measured).
    """
    t = np.asarray(tp, dtype=float)
    p = np.asarray(pp, dtype=float)
    # uneven stages (layers not divisible by pp): the biggest stage holds ceil(L/p) layers
    stage_layers = np.ceil(np.asarray(shape.layers, dtype=float) / p)
    params_per_device = params_on_device(shape, t, p)
    d = np.asarray(shard_degree, dtype=float)
    stage = np.asarray(stage_code)
    w = precision.of_codes("bytes_per_element", precision_code)  # gptplan.precision's rows
    o = precision.of_codes("optimizer_bytes_per_param", precision_code)
    mixed = np.asarray(o, dtype=float) > 2.0 * np.asarray(w, dtype=float)  # master weights kept
    o1 = mixed & np.asarray(amp_o1, dtype=bool)
    # O1: fp32 parameters, gradients and moments, no master weight (runner/train.py:
    # multi_precision only at O2)
    o = np.where(o1, o - FP32_BYTES, o)
    wp = np.where(o1, FP32_BYTES, w)  # the parameters' (and buffers') bytes
    g = np.where((np.asarray(main_grad, dtype=bool) & mixed) | o1, FP32_BYTES, w)
    largest = shape.largest_param / t
    layer_matrix = np.asarray(shape.hidden, dtype=float) * np.asarray(shape.ffn, dtype=float) / t
    unsliced = stage3_unsliced(shape, t, stage_layers, p)
    share = sharded_share(params_per_device, largest, layer_matrix, d, stage, unsliced)
    buffer = np.minimum(STAGE2_BUFFER_ELEMENTS, share)
    # the transient: the largest parameter another rank owns (the busiest rank owns the
    # largest one where it sets the share; then the next, a layer matrix)
    owns_largest = share <= largest * (1 + 1e-12)
    transient = np.where(owns_largest, layer_matrix, largest)
    # its own storage is allocated whole (GradStorage.rebuild) and, on a rank whose share is
    # one large parameter that fits no storage, stays nearly empty beside it
    storages = (d - 1.0 + (owns_largest & (share > buffer))) * buffer
    stage2_grads = share + storages + np.where(share > buffer, transient, 0.0)
    # [BUFFERS] the model's own non-parameter tensors, allocated with it
    buffers = np.asarray(shape.buffer_bytes, dtype=float) + (
        stage_layers * np.asarray(shape.buffer_layer_elements, dtype=float) * wp
    )
    weights = np.where(stage >= 3, share, params_per_device) * wp + buffers
    gradients = g * np.select(
        [stage <= 1, stage == 2], [params_per_device, stage2_grads], default=share
    )
    optimizer = o * np.where(stage >= 1, share, params_per_device)
    act_bytes = w
    args = (shape, seq_len, micro_batch, tp, seq_parallel)
    kinds = dict(amp_o1=o1, unfused=~np.asarray(fused_kernels, dtype=bool))
    per_layer = activation_bytes_per_layer(
        *args, recompute_code, act_bytes, flash_attention, **kinds
    )
    keep_all = activation_bytes_per_layer(*args, 0, act_bytes, flash_attention, **kinds)
    k = np.minimum(np.asarray(recompute_layers, dtype=float), stage_layers)
    code = np.asarray(recompute_code)
    partial = (k > 0) & (code > 0)
    # [AMPACT] O1's 16-bit weight copies: every layer whose forward keeps its graph (all but
    # the fully recomputed ones), the working layer in its backward and, without pipeline
    # parallel, the LM head (a tied model casts the embedding for it)
    layer_params = (
        np.asarray(shape.params_body, dtype=float) - shape.final_norm_params
    ) / np.asarray(shape.layers, dtype=float)
    layer_copy = np.where(o1, O1_WEIGHT_COPY * layer_params / t, 0.0)
    head = np.where(np.asarray(shape.head_params) > 0, shape.head_params, shape.vocab_params)
    head_copy = np.where(o1 & (p <= 1), O1_WEIGHT_COPY * np.asarray(head, dtype=float) / t, 0.0)
    graph_layers = np.where(code == 3, np.where(partial, stage_layers - k, 0.0), stage_layers)
    stage_acts = (
        np.where(partial, k * per_layer + (stage_layers - k) * keep_all, stage_layers * per_layer)
        + graph_layers * layer_copy
        + head_copy
    )
    v = np.asarray(virtual_pp, dtype=float)
    in_flight = np.minimum(p, np.asarray(accumulation, dtype=float)) * np.where(
        v > 1, 1.0 + (p - 1.0) / (p * v), 1.0
    )
    sp = np.asarray(seq_parallel, dtype=bool)
    sbh = (
        np.asarray(seq_len, dtype=float)
        * np.asarray(micro_batch, dtype=float)
        * np.asarray(shape.hidden, dtype=float)
        / np.where(sp, t, 1.0)
    )
    stage_output = np.where(p > 1, sbh * act_bytes, 0.0)  # [1F1B] output_buffers
    # the layer in backward: recomputed in full ([RECOMP]) with its backward's gradient
    # temporaries, plus flash's dq accumulator ([FA2])
    working = np.where(
        code > 0,
        keep_all * (1.0 + RECOMPUTE_BACKWARD_EXTRA)
        - per_layer
        + np.where(code == 3, layer_copy, 0),
        0.0,
    ) + np.where(
        np.asarray(flash_attention, dtype=bool),
        FLASH_DQ_ACCUM_BYTES
        * np.asarray(seq_len, dtype=float)
        * np.asarray(micro_batch, dtype=float)
        * np.asarray(shape.hidden, dtype=float)
        / t,
        0.0,
    )
    activations = (stage_acts + stage_output) * in_flight + working
    per_logit = precision.of_codes("logit_bytes", precision_code)
    count = np.asarray(micro_batch) * np.asarray(seq_len) * shape.vocab / t
    # [LOSS] the loss path at its peak, and what of it stays through the layers' backward
    held = np.where(p > 1, 0.0, w) * count
    full = np.where(p > 1, per_logit - w, per_logit) * count
    loss_path = np.maximum(full - working, held)  # beyond the working layer it overlaps
    # a pipeline's loss is on the last stage, one micro-batch in flight there (1F1B): the
    # term is what that stage holds beyond the first stage's activations, if anything
    last_stage = stage_acts + stage_output + working + loss_path
    logits = np.where(p > 1, np.maximum(0.0, last_stage - activations), loss_path)
    data_parallel = np.asarray(dp, dtype=float) > 1
    fused_copy = np.where(data_parallel & (stage <= 1), g * params_per_device, 0.0)
    # [DPFUSE] plain data parallel (paddle.DataParallel, what fleet.distributed_model returns
    # for a data-parallel-only layout) keeps its fused buffers for the whole run; fleet's
    # hybrid all-reduce (with tensor or pipeline parallel or sharding) only as backward ends
    reducer = data_parallel & (stage == 0) & (t == 1) & (p == 1)
    comm_buffers = np.where(reducer, fused_copy, np.maximum(0.0, fused_copy - activations))
    allocator = (activations + logits + comm_buffers) * (
        np.asarray(fragmentation, dtype=float) - 1.0
    )
    world = t * p * d * np.asarray(dp, dtype=float)
    comms = communicator_gb_total(world=world, tp=t, pp=p, shard_degree=d, dp=dp)
    comms = comms * (np.asarray(communicator_gb, dtype=float) / NCCL_GB_GROUP) * GB
    runtime = np.asarray(overhead_gb, dtype=float) * GB
    ones = np.ones_like(weights + activations + logits + runtime + comms)
    return {
        "weights": weights * ones,
        "gradients": gradients * ones,
        "optimizer": optimizer * ones,
        "activations": activations * ones,
        "logits": logits * ones,
        "comm_buffers": comm_buffers * ones,
        "allocator": allocator * ones,
        "runtime": runtime * ones,
        "communicators": comms * ones,
    }


def memory_per_device_bytes(shape: ModelShape, **kwargs: Any) -> Any:
    """Peak bytes on the busiest device: the sum of `memory_terms` (model states +
    activations + logits + buffers + allocator margin + runtime + communicators).

    Uneven pipeline stages (L not divisible by p, which Paddle's PipelineLayer segments
    allow): the biggest stage, ceil(L/p) layers, sets the peak. The logits live on the last
    stage: the peak is the larger of the first stage's in-flight activations and the last
    stage's one micro-batch with its loss path ([LOSS])."""
    return sum(memory_terms(shape, **kwargs).values())


def layout_memory_bytes(
    shape: ModelShape,
    g: dict[str, Any],
    *,
    overhead_gb: Any,
    fragmentation: Any,
    communicator_gb: Any = 0.0,
    fused_kernels: Any = False,
    terms: bool = False,
) -> Any:
    """`memory_per_device_bytes` of layout columns `g` (the names gptplan.steptime uses: seq,
    micro, acc, tp, pp, vpp, stage_code, shard_degree, recompute_code, sp, flash,
    precision_code; optional dp, rc_layers (the recomputed layers per stage), main_grad and
    amp_o1 (a 16-bit precision at AMP level O1)); `fused_kernels`: the device runs the
    family's fused norm / rotary kernels (a GPU, `device_memory_args`):
    the one call the planner's search and the published-run check share. `terms=True`: the
    dict of `memory_terms` instead of the sum."""
    n = np.asarray(g["tp"]).shape
    terms_ = memory_terms(
        shape,
        seq_len=g["seq"],
        micro_batch=g["micro"],
        accumulation=g["acc"],
        tp=g["tp"],
        pp=g["pp"],
        stage_code=g["stage_code"],
        shard_degree=g["shard_degree"],
        recompute_code=g["recompute_code"],
        seq_parallel=g["sp"],
        precision_code=g["precision_code"],
        overhead_gb=overhead_gb,
        fragmentation=fragmentation,
        flash_attention=g["flash"],
        virtual_pp=g["vpp"],
        recompute_layers=g.get("rc_layers", np.zeros(n)),
        dp=g.get("dp", np.ones(n)),
        communicator_gb=communicator_gb,
        main_grad=g.get("main_grad", np.zeros(n, dtype=bool)),
        amp_o1=g.get("amp_o1", np.zeros(n, dtype=bool)),
        fused_kernels=fused_kernels,
    )
    return terms_ if terms else sum(terms_.values())
