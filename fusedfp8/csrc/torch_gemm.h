// fusedfp8 host shim for torch: the cuBLASLt FP8 GEMM of gemm.h as the torch op
// fusedfp8::fp8_gemm_lt (CUDA and Meta kernels; included by torch_ops.cc). The torch layers run it
// with gemm='cublaslt' (fusedfp8/pytorch/gemm.py: scaled_mm -> _cublaslt_mm), for their
// forward (with its bias) and both gradients.
//
//   fp8_gemm_lt(Tensor a, Tensor b, Tensor scale_inv_a, Tensor scale_inv_b, ScalarType out_dtype,
//               bool fast_accum=False, Tensor? bias=None) -> Tensor
//   fp8_gemm_lt_block(Tensor a, Tensor b, Tensor scale_inv_a, Tensor scale_inv_b, int a_block,
//                     int b_block, ScalarType out_dtype, Tensor? bias=None) -> Tensor
//   out (M, N) = out_dtype(scale_inv_a * scale_inv_b * (a @ b.T) + bias), a (M, K) and b (N, K)
//   contiguous FP8 (float8_e4m3fn / float8_e5m2, not both e5m2), K and N multiples of 16 (as
//   torch._scaled_mm asks; the quantize kernels' pad_to=16 writes such operands), scales float32
//   of one element. bias: None, or (N,) of out_dtype, which must then be bfloat16 or float16 (as
//   torch._scaled_mm's bias); it is added in cuBLASLt's epilogue in float32 and the sum rounded
//   once (gemm.h). `bias` came last, with a default, so callers of the op without it are unchanged.
//   fp8_gemm_lt_block: the same product with a scale per block (BlockScaling): a_block / b_block
//   are each operand's block rows (1: 1x128 blocks, 128: 128x128; not both 128), its scale_inv the
//   contiguous float32 array of fusedfp8.numerics.block's layout, which cuBLASLt reads as it is
//   (VEC128_32F / BLK128x128_32F); always the split accumulator (cuBLASLt offers no other there).
// The workspace is one at::empty per call (the caching allocator, stream-ordered) of
// workspace_bytes(): 32 MiB unless set (gemm_set_workspace of torch_ops.cc). fusedfp8.pytorch.gemm
// sets it to torch's own cuBLASLt workspace size where torch tells it
// (torch._C._cuda_getCublasLtWorkspaceSize), so that the heuristic is asked what torch._scaled_mm
// asks it: torch's scaled_gemm passes that size as CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES and no
// alignment preference (cuBLASLt then assumes 256-byte aligned buffers); gemm.h passes the
// alignment the pointers have, 256 for the caching allocator's tensors: the same question. torch's
// size: 32 MiB on Hopper where the cuBLAS and cuBLASLt workspaces are unified and the cuBLASLt size
// defaults to the cuBLAS one (recent torch; 4096 * 8 KiB on sm_90 / sm_100 / sm_120), 1 MiB by the
// older default (CUBLASLT_WORKSPACE_SIZE=1024 KiB); the environment variables CUBLASLT_WORKSPACE_SIZE
// and CUBLAS_WORKSPACE_CONFIG change it. The size is part of gemm.h's cache key.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <optional>
#include <string>

#include "gemm.h"
#include "plan.h"

namespace ff8::torch_gemm {

constexpr int64_t kWorkspaceBytes = 32 << 20;

inline std::atomic<int64_t>& workspace_bytes() {
  static std::atomic<int64_t> w{kWorkspaceBytes};
  return w;
}

inline int32_t lt_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return lt::kR8F_E4M3;
    case at::kFloat8_e5m2: return lt::kR8F_E5M2;
    case at::kBFloat16: return lt::kR16BF;
    case at::kHalf: return lt::kR16F;
    case at::kFloat: return lt::kR32F;
    default: return -1;
  }
}

inline int32_t block_mode(int64_t block) { return block == 1 ? lt::kScaleVec128 : lt::kScaleBlk128x128; }

// The gemm.h shape of the call, after the argument checks (TORCH_CHECK: ValueError / TypeError-like
// messages naming the argument). `op` names the op in them; `a_block` / `b_block`: 0 for one scale
// per tensor (fp8_gemm_lt), else the operand's block rows (fp8_gemm_lt_block).
inline lt::Shape checked_shape(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa,
                               const at::Tensor& sb, at::ScalarType out_dtype, bool fast_accum,
                               const std::optional<at::Tensor>& bias, int64_t a_block = 0, int64_t b_block = 0) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, op, ": a and b must be 2-D; got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(a.size(1) == b.size(1), op, ": a (M, K) and b (N, K) must agree on K; got ", a.sizes(), " and ",
              b.sizes());
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), op, ": a and b must be contiguous (row-major)");
  TORCH_CHECK(a.device() == b.device() && sa.device() == a.device() && sb.device() == a.device(), op,
              ": a, b and the scales must be on one device");
  const int64_t m = a.size(0), n = b.size(0), k = a.size(1);
  if (a_block == 0) {
    for (const at::Tensor* s : {&sa, &sb})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->numel() == 1, op,
                  ": scale_inv_a and scale_inv_b must be float32 tensors of one element; got ", s->scalar_type(), " ",
                  s->sizes());
  } else {
    TORCH_CHECK((a_block == 1 || a_block == 128) && (b_block == 1 || b_block == 128), op,
                ": a_block and b_block must be 1 (1x128 blocks) or 128 (128x128 blocks); got ", a_block, " and ",
                b_block);
    const int64_t want_a = lt::block_scale_numel(m, k, a_block), want_b = lt::block_scale_numel(n, k, b_block);
    TORCH_CHECK(sa.scalar_type() == at::kFloat && sa.is_contiguous() && sa.numel() == want_a, op,
                ": scale_inv_a must be a contiguous float32 tensor of ", want_a, " elements (the ", a_block,
                "x128 block scales of a (", m, ", ", k, ") operand); got ", sa.scalar_type(), " ", sa.sizes());
    TORCH_CHECK(sb.scalar_type() == at::kFloat && sb.is_contiguous() && sb.numel() == want_b, op,
                ": scale_inv_b must be a contiguous float32 tensor of ", want_b, " elements (the ", b_block,
                "x128 block scales of a (", n, ", ", k, ") operand); got ", sb.scalar_type(), " ", sb.sizes());
  }
  lt::Shape s{m, n, k, k, k, n, lt_type(a.scalar_type()), lt_type(b.scalar_type()), lt_type(out_dtype),
              fast_accum ? 1 : 0, workspace_bytes().load()};
  if (a_block != 0) {
    s.sa_mode = block_mode(a_block);
    s.sb_mode = block_mode(b_block);
  }
  if (bias.has_value()) {
    const at::Tensor& v = *bias;
    TORCH_CHECK(v.dim() == 1 && v.size(0) == n, op, ": bias must be 1-D of N = b.size(0) = ", n,
                " elements; got shape ", v.sizes());
    TORCH_CHECK(v.device() == a.device(), op, ": bias must be on the operands' device (", a.device(), "); got ",
                v.device());
    TORCH_CHECK(v.scalar_type() == out_dtype && (out_dtype == at::kBFloat16 || out_dtype == at::kHalf), op,
                ": bias must have out_dtype, which must then be bfloat16 or float16 (cuBLASLt's FP8 bias "
                "epilogue, as torch._scaled_mm's); got a ", v.scalar_type(), " bias with out_dtype ", out_dtype);
    s.epilogue = lt::kEpilogueBias;
    s.bias_type = lt_type(v.scalar_type());
  }
  if (m > 0 && n > 0 && k > 0) {
    std::string why = lt::check_shape(s);
    TORCH_CHECK(why.empty(), op, ": ", why);
  } else {
    TORCH_CHECK(lt::out_bytes(s.td) > 0, op, ": out_dtype must be bfloat16, float16 or float32");
  }
  return s;
}

// Whether every size of the tensors is a number. Under torch.compile with dynamic shapes the Meta
// kernels see symbolic sizes, which the checks of checked_shape cannot read (numel, is_contiguous):
// there they only give the output, and the CUDA kernel checks the compiled graph's real call.
inline bool concrete_sizes(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts)
    for (const c10::SymInt& d : t->sym_sizes())
      if (!d.maybe_as_int().has_value()) return false;
  return true;
}

inline at::Tensor meta_out(const char* op, const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, op, ": a and b must be 2-D; got ", a.dim(), "-D and ", b.dim(), "-D");
  return at::empty_symint({a.sym_size(0), b.sym_size(0)}, a.options().dtype(out_dtype));
}

inline at::Tensor meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                       at::ScalarType out_dtype, bool fast_accum, const std::optional<at::Tensor>& bias) {
  if (concrete_sizes({&a, &b, &sa, &sb}) && (!bias || concrete_sizes({&*bias})))
    checked_shape("fp8_gemm_lt", a, b, sa, sb, out_dtype, fast_accum, bias);
  return meta_out("fp8_gemm_lt", a, b, out_dtype);
}

inline at::Tensor meta_block(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                             int64_t a_block, int64_t b_block, at::ScalarType out_dtype,
                             const std::optional<at::Tensor>& bias) {
  if (concrete_sizes({&a, &b, &sa, &sb}) && (!bias || concrete_sizes({&*bias})))
    checked_shape("fp8_gemm_lt_block", a, b, sa, sb, out_dtype, false, bias, a_block, b_block);
  return meta_out("fp8_gemm_lt_block", a, b, out_dtype);
}

// Runs the checked shape `s` (both ops' CUDA kernels). `stream_of(device)`: torch's current CUDA
// stream there (torch_ops.cc's current_stream).
template <void* (*stream_of)(const c10::Device&)>
at::Tensor run(const lt::Shape& s, const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa,
               const at::Tensor& sb, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias) {
  // the operands' device, not the caller's current one (the dispatcher adds no guard to a custom
  // op): the bias copy below runs there, and cuBLASLt in the current context (on_device below)
  const c10::DeviceGuard guard(a.device());
  at::Tensor out = at::empty({s.m, s.n}, a.options().dtype(out_dtype));
  if (s.m == 0 || s.n == 0) return out;
  if (s.k == 0) return bias ? out.copy_(bias->unsqueeze(0).expand({s.m, s.n})) : out.zero_();  // the empty sum
  // The bias as the epilogue reads it: contiguous, and 256-byte aligned so that it does not lower
  // the alignment the algorithm is chosen for (gemm.h's Key); a copy only for a strided or offset view.
  at::Tensor v;
  if (bias) {
    v = bias->contiguous();
    if (reinterpret_cast<uintptr_t>(v.data_ptr()) % 256) v = v.clone();
  }
  at::Tensor ws = at::empty({std::max<int64_t>(s.workspace, 1)}, a.options().dtype(at::kByte));
  const int device = a.device().index();
  std::string err = lt::on_device(device, [&] {
    return lt::run(device, s, a.data_ptr(), b.data_ptr(), static_cast<const float*>(sa.data_ptr()),
                   static_cast<const float*>(sb.data_ptr()), out.data_ptr(), ws.data_ptr(), stream_of(a.device()),
                   bias ? v.data_ptr() : nullptr);
  });
  TORCH_CHECK(err.empty(), err);
  return out;
}

template <void* (*stream_of)(const c10::Device&)>
at::Tensor cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                at::ScalarType out_dtype, bool fast_accum, const std::optional<at::Tensor>& bias) {
  return run<stream_of>(checked_shape("fp8_gemm_lt", a, b, sa, sb, out_dtype, fast_accum, bias), a, b, sa, sb,
                        out_dtype, bias);
}

template <void* (*stream_of)(const c10::Device&)>
at::Tensor cuda_block(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                      int64_t a_block, int64_t b_block, at::ScalarType out_dtype,
                      const std::optional<at::Tensor>& bias) {
  return run<stream_of>(checked_shape("fp8_gemm_lt_block", a, b, sa, sb, out_dtype, false, bias, a_block, b_block),
                        a, b, sa, sb, out_dtype, bias);
}

}  // namespace ff8::torch_gemm
