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
#include <cstring>
#include <vector>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "paddle/phi/backends/context_pool.h"
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
// the upcast kernels (kernel_list.h: GPTPLAN_UPCAST_KERNELS)
#include "paddle/phi/kernels/activation_grad_kernel.h"
#include "paddle/phi/kernels/activation_kernel.h"
#include "paddle/phi/kernels/amp_kernel.h"
#include "paddle/phi/kernels/clip_kernel.h"
#include "paddle/phi/kernels/reduce_max_kernel.h"
#include "paddle/phi/kernels/squared_l2_norm_kernel.h"
#include "paddle/phi/kernels/arange_kernel.h"
#include "paddle/phi/kernels/gather_nd_grad_kernel.h"
#include "paddle/phi/kernels/gather_nd_kernel.h"
#include "paddle/phi/kernels/concat_grad_kernel.h"
#include "paddle/phi/kernels/cross_entropy_grad_kernel.h"
#include "paddle/phi/kernels/cross_entropy_kernel.h"
#include "paddle/phi/kernels/elementwise_add_grad_kernel.h"
#include "paddle/phi/kernels/elementwise_add_kernel.h"
#include "paddle/phi/kernels/elementwise_divide_grad_kernel.h"
#include "paddle/phi/kernels/elementwise_divide_kernel.h"
#include "paddle/phi/kernels/elementwise_kernel.h"
#include "paddle/phi/kernels/elementwise_multiply_grad_kernel.h"
#include "paddle/phi/kernels/elementwise_multiply_kernel.h"
#include "paddle/phi/kernels/gelu_grad_kernel.h"
#include "paddle/phi/kernels/gelu_kernel.h"
#include "paddle/phi/kernels/layer_norm_grad_kernel.h"
#include "paddle/phi/kernels/layer_norm_kernel.h"
#include "paddle/phi/kernels/matmul_grad_kernel.h"
#include "paddle/phi/kernels/matmul_kernel.h"
#include "paddle/phi/kernels/reduce_mean_grad_kernel.h"
#include "paddle/phi/kernels/reduce_mean_kernel.h"
#include "paddle/phi/kernels/softmax_grad_kernel.h"
#include "paddle/phi/kernels/softmax_kernel.h"
#include "paddle/phi/kernels/swiglu_grad_kernel.h"
#include "paddle/phi/kernels/swiglu_kernel.h"
#include "paddle/phi/kernels/where_grad_kernel.h"
#include "paddle/phi/kernels/gather_grad_kernel.h"
#include "paddle/phi/kernels/gather_kernel.h"
#include "paddle/phi/kernels/index_select_grad_kernel.h"
#include "paddle/phi/kernels/index_select_kernel.h"
#include "paddle/phi/kernels/tile_grad_kernel.h"
#include "paddle/phi/kernels/tile_kernel.h"
#include "paddle/phi/kernels/tril_triu_kernel.h"
#include "paddle/phi/kernels/unsqueeze_kernel.h"
#include "paddle/phi/kernels/where_kernel.h"
// the custom-device kernels of tensor parallelism (kernel_list.h: GPTPLAN_CUSTOM_UPCAST_KERNELS)
#include "paddle/phi/kernels/c_identity_kernel.h"
#include "paddle/phi/kernels/c_softmax_with_cross_entropy_grad_kernel.h"
#include "paddle/phi/kernels/mp_allreduce_sum_kernel.h"

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

// (a kernel can be in both lists: forwarded for the types Paddle's CPU build has, upcast for
// bf16/fp16)
#define GPTPLAN_NAME(op, fn) constexpr char forwarded_##op[] = #op;
GPTPLAN_FORWARDED_KERNELS(GPTPLAN_NAME)
#undef GPTPLAN_NAME
#define GPTPLAN_NAME(op, fn) constexpr char name_##op[] = #op;
GPTPLAN_UPCAST_KERNELS(GPTPLAN_NAME)
GPTPLAN_CUSTOM_UPCAST_KERNELS(GPTPLAN_NAME)
#undef GPTPLAN_NAME

// ---- upcast kernels: bf16/fp16 in, fp32 CPU kernel, bf16/fp16 out ----------------------------

bool low_precision(phi::DataType t) { return t == phi::DataType::BFLOAT16 || t == phi::DataType::FLOAT16; }

template <typename From, typename To>
void convert(const phi::DenseTensor& in, To* out) {
  const From* src = in.data<From>();
  const int64_t n = in.numel();
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<To>(static_cast<float>(src[i]));
}

// Paddle's CPU context (CPU place): the upcast kernels run the fp32 CPU kernel on CPU-place
// tensors (some CPU kernels copy with phi::Copy, which takes a device place for a custom one
// and then its stream), and cast the results into the device's tensors.
const phi::CPUContext& plain_cpu_context() {
  return *static_cast<const phi::CPUContext*>(phi::DeviceContextPool::Instance().Get(phi::CPUPlace()));
}

// What one upcast call allocates, and the outputs it casts back when the fp32 kernel is done.
struct Scratch {
  const phi::CPUContext& dev;  // on the device's place: the caller's outputs
  // the fp32 inputs on the device (for a custom-device kernel, which runs on the device's
  // context) rather than on the CPU place (for a CPU kernel)
  bool on_device = false;
  const phi::CPUContext& ctx = plain_cpu_context();  // on the CPU place: the fp32 kernel's
  std::vector<std::unique_ptr<phi::DenseTensor>> tensors;
  std::vector<std::unique_ptr<paddle::optional<phi::DenseTensor>>> optionals;
  std::vector<std::unique_ptr<std::vector<const phi::DenseTensor*>>> inputs;
  std::vector<std::pair<phi::DenseTensor*, phi::DenseTensor*>> outputs;  // (the caller's, fp32)
  std::vector<phi::DataType> wanted;  // the caller's output's data type (from InferMeta)

  // a tensor of the device seen on the CPU place (the same memory: the device's is host memory)
  const phi::DenseTensor* on_cpu(const phi::DenseTensor& x) {
    if (on_device || !x.initialized() || x.place().GetType() == phi::AllocationType::CPU) return &x;
    auto holder = std::make_shared<phi::Allocation>(x.Holder()->ptr(), x.Holder()->size(), phi::CPUPlace());
    tensors.push_back(std::make_unique<phi::DenseTensor>(holder, x.meta()));
    return tensors.back().get();
  }

  const phi::DenseTensor* up(const phi::DenseTensor& x) {
    if (!x.initialized() || !low_precision(x.dtype())) return on_cpu(x);
    auto t = std::make_unique<phi::DenseTensor>();
    t->Resize(x.dims());
    float* o = (on_device ? dev : ctx).template Alloc<float>(t.get());
    if (x.dtype() == phi::DataType::BFLOAT16)
      convert<phi::dtype::bfloat16>(x, o);
    else
      convert<phi::dtype::float16>(x, o);
    tensors.push_back(std::move(t));
    return tensors.back().get();
  }

  phi::DenseTensor* out(phi::DenseTensor* o) {
    if (o == nullptr) return nullptr;
    auto t = std::make_unique<phi::DenseTensor>();
    phi::DenseTensorMeta meta = o->meta();  // the shape InferMeta gave (kernels read it)
    wanted.push_back(meta.dtype);
    if (low_precision(meta.dtype)) meta.dtype = phi::DataType::FLOAT32;
    t->set_meta(meta);
    outputs.emplace_back(o, t.get());
    tensors.push_back(std::move(t));
    return tensors.back().get();
  }

  // every fp32 result into the caller's tensor, in its own allocation where it is big enough
  // (in-place updates stay in place), cast to the caller's data type (`low` where InferMeta set
  // none)
  void finish(phi::DataType low) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      phi::DenseTensor* dst = outputs[i].first;
      const phi::DenseTensor* src = outputs[i].second;
      if (!src->initialized()) continue;
      phi::DataType want = wanted[i];
      if (want == phi::DataType::UNDEFINED) want = src->dtype() == phi::DataType::FLOAT32 ? low : src->dtype();
      dst->Resize(src->dims());
      if (src->dtype() == phi::DataType::FLOAT32 && want == phi::DataType::BFLOAT16) {
        convert<float>(*src, dev.template Alloc<phi::dtype::bfloat16>(dst));
      } else if (src->dtype() == phi::DataType::FLOAT32 && want == phi::DataType::FLOAT16) {
        convert<float>(*src, dev.template Alloc<phi::dtype::float16>(dst));
      } else {
        void* d = dev.Alloc(dst, src->dtype());
        if (d != src->data()) std::memcpy(d, src->data(), src->numel() * phi::SizeOf(src->dtype()));
      }
    }
  }
};

template <typename A>
struct Conv {
  static A go(A a, Scratch&) { return a; }
};
template <>
struct Conv<const phi::DenseTensor&> {
  static const phi::DenseTensor& go(const phi::DenseTensor& a, Scratch& s) { return *s.up(a); }
};
template <>
struct Conv<phi::DenseTensor*> {
  static phi::DenseTensor* go(phi::DenseTensor* a, Scratch& s) { return s.out(a); }
};
template <>
struct Conv<const paddle::optional<phi::DenseTensor>&> {
  static const paddle::optional<phi::DenseTensor>& go(const paddle::optional<phi::DenseTensor>& a, Scratch& s) {
    if (!a) return a;
    s.optionals.push_back(std::make_unique<paddle::optional<phi::DenseTensor>>(*s.up(*a)));
    return *s.optionals.back();
  }
};
template <>
struct Conv<const std::vector<const phi::DenseTensor*>&> {
  static const std::vector<const phi::DenseTensor*>& go(const std::vector<const phi::DenseTensor*>& a,
                                                        Scratch& s) {
    auto v = std::make_unique<std::vector<const phi::DenseTensor*>>();
    for (const auto* t : a) v->push_back(t == nullptr ? nullptr : s.up(*t));
    s.inputs.push_back(std::move(v));
    return *s.inputs.back();
  }
};
template <>
struct Conv<std::vector<phi::DenseTensor*>> {
  static std::vector<phi::DenseTensor*> go(std::vector<phi::DenseTensor*> a, Scratch& s) {
    std::vector<phi::DenseTensor*> v;
    for (auto* t : a) v.push_back(s.out(t));
    return v;
  }
};

template <typename Sig>
struct Upcast;

template <typename Ctx, typename... Args>
struct Upcast<void (*)(const Ctx&, Args...)> {
  template <const char* Name, phi::DataType DType>
  static void Run(const phi::CustomContext& dev, Args... args) {
    static const phi::Kernel& k = cpu_kernel(Name, phi::DataLayout::ALL_LAYOUT, phi::DataType::FLOAT32);
    using Variadic = void (*)(const phi::DeviceContext&, Args...);
    auto fn = k.template GetVariadicKernelFn<Variadic>();
    Scratch s{cpu_context(dev)};
    fn(s.ctx, Conv<Args>::go(args, s)...);
    s.finish(DType);
  }
};

// the device's kernel for (name, dtype) from the CPU fp32 kernel's argument definitions
void install_upcast(const char* name, phi::DataType dtype, phi::KernelFn fn, void* variadic) {
  auto& all = phi::KernelFactory::Instance().kernels();
  auto it = all.find(name);
  if (it == all.end()) return;
  const phi::DataLayout L = phi::DataLayout::ALL_LAYOUT;
  if (it->second.count(phi::KernelKey(phi::Backend::CPU, L, dtype))) return;  // Paddle has one
  if (it->second.count(phi::KernelKey(device_backend(), L, dtype))) return;   // the device has one
  auto f = it->second.find(phi::KernelKey(phi::Backend::CPU, L, phi::DataType::FLOAT32));
  if (f == it->second.end() || f->second.GetKernelRegisteredType() != phi::KernelRegisteredType::FUNCTION) return;
  install(name, phi::KernelKey(phi::Backend::CPU, L, dtype), f->second, fn, variadic);
  auto& defs = *all[name][phi::KernelKey(device_backend(), L, dtype)].mutable_args_def();
  for (auto& d : defs.input_defs())
    if (d.dtype == phi::DataType::FLOAT32) d.dtype = dtype;
  for (auto& d : defs.output_defs())
    if (d.dtype == phi::DataType::FLOAT32) d.dtype = dtype;
}

template <typename Sig, const char* Name>
void upcast_low_types() {
  constexpr auto bf16 = &Upcast<Sig>::template Run<Name, phi::DataType::BFLOAT16>;
  constexpr auto fp16 = &Upcast<Sig>::template Run<Name, phi::DataType::FLOAT16>;
  using B = phi::KernelImpl<std::remove_const_t<decltype(bf16)>, bf16>;
  using F = phi::KernelImpl<std::remove_const_t<decltype(fp16)>, fp16>;
  install_upcast(Name, phi::DataType::BFLOAT16, &B::Compute, reinterpret_cast<void*>(&B::VariadicCompute));
  install_upcast(Name, phi::DataType::FLOAT16, &F::Compute, reinterpret_cast<void*>(&F::VariadicCompute));
}

// ---- custom-device kernels without bf16 (tensor parallelism): the same, around Paddle's fp32
// custom-device kernel, on the device ------------------------------------------------------------

// declared for its signature only (Paddle 3.3.1 has no header for it)
template <typename T, typename Context>
void CSoftmaxWithCrossEntropyKernel(const Context& dev_ctx, const phi::DenseTensor& logits,
                                    const phi::DenseTensor& label, int64_t ignore_index, int rank, int nranks,
                                    phi::DenseTensor* softmax, phi::DenseTensor* loss);

const phi::KernelKey custom_fp32_key() {
  return phi::KernelKey(phi::Backend::CUSTOM, phi::DataLayout::ALL_LAYOUT, phi::DataType::FLOAT32);
}

template <typename Sig>
struct UpcastCustom;

template <typename Ctx, typename... Args>
struct UpcastCustom<void (*)(const Ctx&, Args...)> {
  template <const char* Name, phi::DataType DType>
  static void Run(const phi::CustomContext& dev, Args... args) {
    static const phi::Kernel& k = [] () -> const phi::Kernel& {
      auto& all = phi::KernelFactory::Instance().kernels();
      return all.at(Name).at(custom_fp32_key());
    }();
    using Variadic = void (*)(const phi::DeviceContext&, Args...);
    auto fn = k.template GetVariadicKernelFn<Variadic>();
    Scratch s{cpu_context(dev), true};
    fn(dev, Conv<Args>::go(args, s)...);  // the device's context: its communicator, its stream
    s.finish(DType);
  }
};

// the device's kernel for (name, dtype) from the custom-device fp32 kernel's argument definitions
void install_custom_upcast(const char* name, phi::DataType dtype, phi::KernelFn fn, void* variadic) {
  auto& all = phi::KernelFactory::Instance().kernels();
  auto it = all.find(name);
  if (it == all.end()) return;
  const phi::DataLayout L = phi::DataLayout::ALL_LAYOUT;
  const phi::KernelKey key(device_backend(), L, dtype);
  if (it->second.count(key)) return;  // the device has one
  auto f = it->second.find(custom_fp32_key());
  if (f == it->second.end() || f->second.GetKernelRegisteredType() != phi::KernelRegisteredType::FUNCTION) return;
  phi::Kernel k(fn, variadic);
  *k.mutable_args_def() = f->second.args_def();
  k.get_kerneltype_forvar_fn_ = f->second.get_kerneltype_forvar_fn_;
  auto& defs = *k.mutable_args_def();
  for (auto& d : defs.input_defs()) {
    if (d.backend == phi::Backend::CUSTOM) d.backend = device_backend();
    if (d.dtype == phi::DataType::FLOAT32) d.dtype = dtype;
  }
  for (auto& d : defs.output_defs()) {
    if (d.backend == phi::Backend::CUSTOM) d.backend = device_backend();
    if (d.dtype == phi::DataType::FLOAT32) d.dtype = dtype;
  }
  all[name][key] = k;
}

template <typename Sig, const char* Name>
void custom_upcast_low_types() {
  constexpr auto bf16 = &UpcastCustom<Sig>::template Run<Name, phi::DataType::BFLOAT16>;
  constexpr auto fp16 = &UpcastCustom<Sig>::template Run<Name, phi::DataType::FLOAT16>;
  using B = phi::KernelImpl<std::remove_const_t<decltype(bf16)>, bf16>;
  using F = phi::KernelImpl<std::remove_const_t<decltype(fp16)>, fp16>;
  install_custom_upcast(Name, phi::DataType::BFLOAT16, &B::Compute, reinterpret_cast<void*>(&B::VariadicCompute));
  install_custom_upcast(Name, phi::DataType::FLOAT16, &F::Compute, reinterpret_cast<void*>(&F::VariadicCompute));
}

// AdamW of low-precision parameters: with master weights (O2) the fp32 kernel updates the master
// weight in place and the parameter becomes its cast; without, the parameter's fp32 copy.
template <phi::DataType DType>
void AdamwUpcast(const phi::CustomContext& dev, const phi::DenseTensor& param, const phi::DenseTensor& grad,
                 const phi::DenseTensor& learning_rate, const phi::DenseTensor& moment1,
                 const phi::DenseTensor& moment2, const paddle::optional<phi::DenseTensor>& moment2_max,
                 const phi::DenseTensor& beta1_pow, const phi::DenseTensor& beta2_pow,
                 const paddle::optional<phi::DenseTensor>& master_param,
                 const paddle::optional<phi::DenseTensor>& skip_update, const phi::Scalar& beta1,
                 const phi::Scalar& beta2, const phi::Scalar& epsilon, float lr_ratio, float coeff, bool with_decay,
                 bool lazy_mode, int64_t min_row_size_to_use_multithread, bool multi_precision,
                 bool use_global_beta_pow, bool amsgrad, phi::DenseTensor* param_out, phi::DenseTensor* moment1_out,
                 phi::DenseTensor* moment2_out, phi::DenseTensor* moment2_max_out, phi::DenseTensor* beta1_pow_out,
                 phi::DenseTensor* beta2_pow_out, phi::DenseTensor* master_param_outs) {
  using Sig = decltype(&phi::AdamwDenseKernel<float, phi::CPUContext>);
  static const phi::Kernel& k = cpu_kernel("adamw", phi::DataLayout::ALL_LAYOUT, phi::DataType::FLOAT32);
  using Variadic = void (*)(const phi::DeviceContext&, const phi::DenseTensor&, const phi::DenseTensor&,
                            const phi::DenseTensor&, const phi::DenseTensor&, const phi::DenseTensor&,
                            const paddle::optional<phi::DenseTensor>&, const phi::DenseTensor&,
                            const phi::DenseTensor&, const paddle::optional<phi::DenseTensor>&,
                            const paddle::optional<phi::DenseTensor>&, const phi::Scalar&, const phi::Scalar&,
                            const phi::Scalar&, float, float, bool, bool, int64_t, bool, bool, bool,
                            phi::DenseTensor*, phi::DenseTensor*, phi::DenseTensor*, phi::DenseTensor*,
                            phi::DenseTensor*, phi::DenseTensor*, phi::DenseTensor*);
  static_assert(std::is_same<Sig, decltype(&phi::AdamwDenseKernel<float, phi::CPUContext>)>::value, "");
  auto fn = k.template GetVariadicKernelFn<Variadic>();
  Scratch s{cpu_context(dev)};
  const bool master = multi_precision && master_param && master_param_outs != nullptr;
  const phi::DenseTensor& p32 = master ? *s.on_cpu(*master_param) : *s.up(param);
  // the fp32 result: into the master weight (then cast into the parameter) or the parameter
  phi::DenseTensor* p32_out = s.out(master ? master_param_outs : param_out);
  const paddle::optional<phi::DenseTensor> none;
  fn(s.ctx, p32, *s.up(grad), *s.up(learning_rate), *s.up(moment1), *s.up(moment2), Conv<const paddle::optional<phi::DenseTensor>&>::go(moment2_max, s), *s.up(beta1_pow), *s.up(beta2_pow), none,
     Conv<const paddle::optional<phi::DenseTensor>&>::go(skip_update, s), beta1, beta2, epsilon, lr_ratio, coeff,
     with_decay, lazy_mode, min_row_size_to_use_multithread, false, use_global_beta_pow, amsgrad, p32_out,
     s.out(moment1_out), s.out(moment2_out), s.out(moment2_max_out), s.out(beta1_pow_out), s.out(beta2_pow_out),
     nullptr);
  s.finish(DType);
  if (master) {  // the parameter: the master weight's cast
    param_out->Resize(master_param_outs->dims());
    if (DType == phi::DataType::BFLOAT16)
      convert<float>(*master_param_outs, s.dev.template Alloc<phi::dtype::bfloat16>(param_out));
    else
      convert<float>(*master_param_outs, s.dev.template Alloc<phi::dtype::float16>(param_out));
  }
}

template <phi::DataType DType>
void install_adamw_upcast() {
  using Impl = phi::KernelImpl<decltype(&AdamwUpcast<DType>), &AdamwUpcast<DType>>;
  install_upcast("adamw", DType, &Impl::Compute, reinterpret_cast<void*>(&Impl::VariadicCompute));
}

void register_kernels() {
#define GPTPLAN_FORWARD(op, fn) forward_all_types<decltype(&fn<float, phi::CPUContext>), forwarded_##op>();
  GPTPLAN_FORWARDED_KERNELS(GPTPLAN_FORWARD)
#undef GPTPLAN_FORWARD
  install_one_hot<phi::DataType::INT32, int32_t>();
  install_one_hot<phi::DataType::INT64, int64_t>();
#define GPTPLAN_UPCAST(op, fn) upcast_low_types<decltype(&fn<float, phi::CPUContext>), name_##op>();
  GPTPLAN_UPCAST_KERNELS(GPTPLAN_UPCAST)
#undef GPTPLAN_UPCAST
  install_adamw_upcast<phi::DataType::BFLOAT16>();
  install_adamw_upcast<phi::DataType::FLOAT16>();
#define GPTPLAN_CUSTOM_UPCAST(op, fn) custom_upcast_low_types<decltype(&fn<float, phi::CustomContext>), name_##op>();
  GPTPLAN_CUSTOM_UPCAST_KERNELS(GPTPLAN_CUSTOM_UPCAST)
#undef GPTPLAN_CUSTOM_UPCAST
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
