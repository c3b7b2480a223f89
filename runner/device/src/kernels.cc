// Kernels of the rehearsal device: Paddle's own CPU kernels, run IN PLACE on the device.
//
// For an op the device has no kernel for, Paddle runs the CPU kernel on copies of the inputs and
// copies the outputs into NEW device allocations. That breaks in-place updates of views (the
// group-sharded stage 2/3 parameter and gradient storages: adamw_, scale_, fill_) and leaves
// some outputs on the CPU (split, embedding_grad). The device's memory is host memory, so the
// CPU kernel can work on the device tensors directly: each forwarded kernel calls Paddle's CPU
// kernel (looked up in Paddle's kernel registry, same data type and layout) with a CPU context
// whose place and allocators are the device's, so outputs stay where they are or are allocated on
// the device.
//
// one_hot is the device's own: the custom-device c_softmax_with_cross_entropy_grad of tensor
// parallelism computes one_hot(label - rank * D, D) and needs all-zero rows for labels another
// rank owns (the CPU kernel raises "Illegal index value" instead).

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "paddle/phi/backends/cpu/cpu_context.h"
#include "paddle/phi/backends/custom/custom_context.h"
#include "paddle/phi/common/backend.h"
#include "paddle/phi/core/kernel_factory.h"
#include "paddle/phi/core/kernel_utils.h"
#include "paddle/phi/kernels/adam_kernel.h"
#include "paddle/phi/kernels/adamw_kernel.h"
#include "paddle/phi/kernels/embedding_grad_kernel.h"
#include "paddle/phi/kernels/fill_kernel.h"
#include "paddle/phi/kernels/full_kernel.h"
#include "paddle/phi/kernels/one_hot_kernel.h"
#include "paddle/phi/kernels/scale_kernel.h"
#include "paddle/phi/kernels/split_kernel.h"

#include "device_name.h"
#include "kernel_list.h"

namespace gptplan_device {

// A CPU context on the device's place and allocators, one per device context and thread. Never
// freed: destroying one at exit, after Paddle's allocators are gone, corrupts the heap.
const phi::CPUContext& cpu_context(const phi::DeviceContext& dev) {
  thread_local auto* contexts = new std::unordered_map<const phi::DeviceContext*, phi::CPUContext*>();
  auto& slot = (*contexts)[&dev];
  if (slot == nullptr) {
    auto* ctx = new phi::CPUContext(dev.GetPlace());
    ctx->SetAllocator(&dev.GetAllocator());
    ctx->SetHostAllocator(&dev.GetHostAllocator());
    ctx->SetZeroAllocator(&dev.GetZeroAllocator());
    ctx->SetHostZeroAllocator(&dev.GetHostZeroAllocator());
    try {
      ctx->SetPinnedAllocator(&dev.GetPinnedAllocator());
    } catch (...) {
    }
    try {
      ctx->SetGenerator(dev.GetGenerator());
    } catch (...) {
    }
    try {
      ctx->SetHostGenerator(dev.GetHostGenerator());
    } catch (...) {
    }
    slot = ctx;
  }
  return *slot;
}

const phi::Kernel& cpu_kernel(const char* name, phi::DataLayout layout, phi::DataType dtype) {
  auto& all = phi::KernelFactory::Instance().kernels();
  auto it = all.find(name);
  PADDLE_ENFORCE_NE(it, all.end(), common::errors::NotFound("no CPU kernel %s", name));
  auto k = it->second.find(phi::KernelKey(phi::Backend::CPU, layout, dtype));
  PADDLE_ENFORCE_NE(k, it->second.end(), common::errors::NotFound("no CPU kernel %s for this data type", name));
  return k->second;
}

template <typename Sig>
struct Forward;

template <typename Ctx, typename... Args>
struct Forward<void (*)(const Ctx&, Args...)> {
  template <const char* Name, phi::DataLayout Layout, phi::DataType DType>
  static void Run(const phi::CustomContext& dev, Args... args) {
    static const phi::Kernel& k = cpu_kernel(Name, Layout, DType);
    using Variadic = void (*)(const phi::DeviceContext&, Args...);
    auto fn = k.template GetVariadicKernelFn<Variadic>();
    fn(cpu_context(dev), args...);
  }
};

phi::Backend device_backend() { return paddle::experimental::StringToBackend(GPTPLAN_DEVICE_TYPE); }

// The device's kernel for (name, layout, dtype): the CPU kernel's argument definitions, with the
// CPU backend replaced by the device's.
void install(const char* name, const phi::KernelKey& cpu_key, const phi::Kernel& cpu, phi::KernelFn fn,
             void* variadic) {
  phi::Kernel k(fn, variadic);
  *k.mutable_args_def() = cpu.args_def();
  phi::Backend dev = device_backend();
  auto& defs = *k.mutable_args_def();
  for (auto& d : defs.input_defs())
    if (d.backend == phi::Backend::CPU) d.backend = dev;
  for (auto& d : defs.output_defs())
    if (d.backend == phi::Backend::CPU) d.backend = dev;
  k.get_kerneltype_forvar_fn_ = cpu.get_kerneltype_forvar_fn_;
  phi::KernelFactory::Instance().kernels()[name][phi::KernelKey(dev, cpu_key.layout(), cpu_key.dtype())] = k;
}

template <typename Sig, const char* Name, phi::DataLayout Layout, phi::DataType DType>
void forward_one() {
  auto& all = phi::KernelFactory::Instance().kernels();
  auto it = all.find(Name);
  if (it == all.end()) return;
  phi::KernelKey key(phi::Backend::CPU, Layout, DType);
  auto k = it->second.find(key);
  if (k == it->second.end() || k->second.GetKernelRegisteredType() != phi::KernelRegisteredType::FUNCTION) return;
  constexpr auto run = &Forward<Sig>::template Run<Name, Layout, DType>;
  using Impl = phi::KernelImpl<std::remove_const_t<decltype(run)>, run>;
  install(Name, key, k->second, &Impl::Compute, reinterpret_cast<void*>(&Impl::VariadicCompute));
}

template <typename Sig, const char* Name>
void forward_all_types() {
  using DT = phi::DataType;
  constexpr auto L = phi::DataLayout::ALL_LAYOUT;
  forward_one<Sig, Name, L, DT::FLOAT32>();
  forward_one<Sig, Name, L, DT::FLOAT64>();
  forward_one<Sig, Name, L, DT::FLOAT16>();
  forward_one<Sig, Name, L, DT::BFLOAT16>();
  forward_one<Sig, Name, L, DT::INT32>();
  forward_one<Sig, Name, L, DT::INT64>();
  forward_one<Sig, Name, L, DT::INT16>();
  forward_one<Sig, Name, L, DT::INT8>();
  forward_one<Sig, Name, L, DT::UINT8>();
  forward_one<Sig, Name, L, DT::BOOL>();
  forward_one<Sig, Name, L, DT::COMPLEX64>();
  forward_one<Sig, Name, L, DT::COMPLEX128>();
}

// one_hot with all-zero rows for out-of-range labels
template <typename T>
void OneHot(const phi::CustomContext& dev, const phi::DenseTensor& x, const phi::Scalar& num_classes,
            phi::DenseTensor* out) {
  const int64_t depth = num_classes.to<int64_t>();
  auto dims = x.dims();
  if (out->dims().size() == 0 || out->dims()[out->dims().size() - 1] != depth) {
    auto od = common::vectorize(dims);
    od.push_back(depth);
    out->Resize(common::make_ddim(od));
  }
  float* o = cpu_context(dev).template Alloc<float>(out);
  const T* in = x.data<T>();
  const int64_t n = x.numel();
  std::fill(o, o + n * depth, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(in[i]);
    if (v >= 0 && v < depth) o[i * depth + v] = 1.0f;
  }
}

template <phi::DataType DType, typename T>
void install_one_hot() {
  auto& all = phi::KernelFactory::Instance().kernels();
  auto it = all.find("one_hot");
  if (it == all.end()) return;
  phi::KernelKey key(phi::Backend::CPU, phi::DataLayout::ALL_LAYOUT, DType);
  auto k = it->second.find(key);
  if (k == it->second.end()) return;
  using Impl = phi::KernelImpl<decltype(&OneHot<T>), &OneHot<T>>;
  install("one_hot", key, k->second, &Impl::Compute, reinterpret_cast<void*>(&Impl::VariadicCompute));
}

#define GPTPLAN_NAME(op, fn) constexpr char name_##op[] = #op;
GPTPLAN_FORWARDED_KERNELS(GPTPLAN_NAME)
#undef GPTPLAN_NAME

void register_kernels() {
#define GPTPLAN_FORWARD(op, fn) forward_all_types<decltype(&fn<float, phi::CPUContext>), name_##op>();
  GPTPLAN_FORWARDED_KERNELS(GPTPLAN_FORWARD)
#undef GPTPLAN_FORWARD
  install_one_hot<phi::DataType::INT32, int32_t>();
  install_one_hot<phi::DataType::INT64, int64_t>();
}

}  // namespace gptplan_device

// Runs when Paddle loads the plugin (its CPU kernels are registered by then).
// GPTPLAN_DEVICE_PLAIN_FALLBACK=1 leaves them out (Paddle's copying CPU fallback runs instead):
// only to show what they fix (tests/test_device.py).
__attribute__((constructor)) static void gptplan_device_register_kernels() {
  const char* plain = std::getenv("GPTPLAN_DEVICE_PLAIN_FALLBACK");
  if (plain != nullptr && plain[0] == '1') return;
  try {
    gptplan_device::register_kernels();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[%s device] registering kernels failed: %s\n", GPTPLAN_DEVICE_TYPE, e.what());
  }
}
