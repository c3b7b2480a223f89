#pragma once
// Paddle CPU kernels the device runs in place (kernels.cc): X(kernel name, CPU kernel template).
// Each is one whose CPU fallback copies its outputs into new allocations (in-place updates of
// views lost) or leaves them on the CPU; the placement test (tests/test_device.py) finds more.
#define GPTPLAN_FORWARDED_KERNELS(X)                            \
  X(adamw, phi::AdamwDenseKernel)                               \
  X(adam, phi::AdamDenseKernel)                                 \
  X(scale, phi::ScaleKernel)                                    \
  X(fill, phi::FillKernel)                                      \
  X(split, phi::SplitKernel)                                    \
  X(split_with_num, phi::SplitWithNumKernel)                    \
  X(embedding_grad, phi::EmbeddingGradKernel)                   \
  X(check_finite_and_unscale, phi::CheckFiniteAndUnscaleKernel)

// Paddle CPU kernels without a bfloat16 / float16 version that a training step of the families
// runs (listed by GLOG_vmodule=kernel_factory=3 on a Llama and a GPT step): the device's bf16 and
// fp16 kernels of these cast the low-precision inputs to fp32, run the CPU fp32 kernel and cast
// the outputs back (kernels.cc, `Upcast`), so AMP (O1/O2) runs on the device. Registered only
// where Paddle has no CPU kernel of that precision. adamw has its own (master weights).
#define GPTPLAN_UPCAST_KERNELS(X)                                              \
  X(add, phi::AddKernel)                                                       \
  X(add_grad, phi::AddGradKernel)                                              \
  X(multiply, phi::MultiplyKernel)                                             \
  X(multiply_grad, phi::MultiplyGradKernel)                                    \
  X(divide, phi::DivideKernel)                                                 \
  X(divide_grad, phi::DivideGradKernel)                                        \
  X(elementwise_pow, phi::ElementwisePowKernel)                                \
  X(matmul, phi::MatmulKernel)                                                 \
  X(matmul_grad, phi::MatmulGradKernel)                                        \
  X(softmax, phi::SoftmaxKernel)                                               \
  X(softmax_grad, phi::SoftmaxGradKernel)                                      \
  X(cross_entropy_with_softmax, phi::CrossEntropyWithSoftmaxKernel)            \
  X(cross_entropy_with_softmax_grad, phi::CrossEntropyWithSoftmaxGradKernel)   \
  X(mean, phi::MeanKernel)                                                     \
  X(mean_grad, phi::ReduceMeanGradKernel)                                      \
  X(pow, phi::PowKernel)                                                       \
  X(pow_grad, phi::PowGradKernel)                                              \
  X(rsqrt, phi::RsqrtKernel)                                                   \
  X(rsqrt_grad, phi::RsqrtGradKernel)                                          \
  X(sqrt, phi::SqrtKernel)                                                     \
  X(tanh, phi::TanhKernel)                                                     \
  X(tanh_grad, phi::TanhGradKernel)                                            \
  X(sin, phi::SinKernel)                                                       \
  X(cos, phi::CosKernel)                                                       \
  X(gelu, phi::GeluKernel)                                                     \
  X(gelu_grad, phi::GeluGradKernel)                                            \
  X(layer_norm, phi::LayerNormKernel)                                          \
  X(layer_norm_grad, phi::LayerNormGradKernel)                                 \
  X(swiglu, phi::SwiGLUKernel)                                                 \
  X(swiglu_grad, phi::SwiGLUGradKernel)                                        \
  X(where, phi::WhereKernel)                                                   \
  X(where_grad, phi::WhereGradKernel)                                          \
  X(concat_grad, phi::ConcatGradKernel)                                        \
  X(gather_nd, phi::GatherNdKernel)                                            \
  X(gather_nd_grad, phi::GatherNdGradKernel)                                   \
  X(arange_tensor, phi::ArangeTensorKernel)                                    \
  X(unsqueeze, phi::UnsqueezeKernel)                                           \
  X(squared_l2_norm, phi::SquaredL2NormKernel)                                 \
  X(check_finite_and_unscale, phi::CheckFiniteAndUnscaleKernel)                \
  X(update_loss_scaling, phi::UpdateLossScalingKernel)                         \
  X(maximum, phi::MaximumKernel)                                               \
  X(max, phi::MaxKernel)                                                       \
  X(clip, phi::ClipKernel)                                                     \
  X(square, phi::SquareKernel)                                                 \
  X(square_grad, phi::SquareGradKernel)                                        \
  X(tril, phi::TrilKernel)                                                     \
  X(triu, phi::TriuKernel)                                                     \
  X(tile, phi::TileKernel)                                                     \
  X(tile_grad, phi::TileGradKernel)                                            \
  X(gather, phi::GatherKernel)                                                 \
  X(gather_grad, phi::GatherGradKernel)                                        \
  X(index_select, phi::IndexSelectKernel)                                      \
  X(index_select_grad, phi::IndexSelectGradKernel)                             \
  X(silu, phi::SiluKernel)                                                     \
  X(silu_grad, phi::SiluGradKernel)

// Paddle's custom-device kernels (tensor parallelism) registered for fp32/fp16 only, not bf16
// (Paddle 3.3.1; its fp16 c_softmax_with_cross_entropy reads fp16 data as float): the device's
// bf16 and fp16 kernels of these cast the inputs to fp32 on the device, run the custom-device fp32
// kernel with the device's context (its communicator) and cast the outputs back.
#define GPTPLAN_CUSTOM_UPCAST_KERNELS(X)                                                    \
  X(c_identity, phi::CIdentityKernel)                                                       \
  X(mp_allreduce_sum, phi::MpAllReduceSumKernel)                                            \
  X(c_softmax_with_cross_entropy, gptplan_device::CSoftmaxWithCrossEntropyKernel)           \
  X(c_softmax_with_cross_entropy_grad, phi::CSoftmaxWithCrossEntropyGradKernel)
