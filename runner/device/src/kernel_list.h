#pragma once
// Paddle CPU kernels the device runs in place (kernels.cc): X(kernel name, CPU kernel template).
// Each is one whose CPU fallback copies its outputs into new allocations (in-place updates of
// views lost) or leaves them on the CPU; the placement test (tests/test_device.py) finds more.
#define GPTPLAN_FORWARDED_KERNELS(X)          \
  X(adamw, phi::AdamwDenseKernel)             \
  X(adam, phi::AdamDenseKernel)               \
  X(scale, phi::ScaleKernel)                  \
  X(fill, phi::FillKernel)                    \
  X(split, phi::SplitKernel)                  \
  X(split_with_num, phi::SplitWithNumKernel)  \
  X(embedding_grad, phi::EmbeddingGradKernel)
