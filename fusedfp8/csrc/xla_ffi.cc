// fusedfp8 host shim for JAX: the XLA FFI handler `ff8_xla_launch` (registered by
// fusedfp8/jax/callbacks.py as the CUDA custom call target "fusedfp8_launch") and the C entry
// points that Python reaches through ctypes. Header-only XLA FFI (jax.ffi.include_dir()); no
// jaxlib or CUDA library is linked: the driver is found at first use (plan.h).
//
// The handler is declared command-buffer compatible: it only launches kernels and memsets /
// copies on XLA's stream, on XLA's buffers, so XLA records it into a CUDA graph and replays it
// without calling back into the host.
//
// Attributes (written by fusedfp8/jax/callbacks.py for the primitives' launches, cuda_backend.py):
//   plans    int64[]  the encoded plans of every local GPU, one after the other (kernels named by
//                     id, resolved in the kernel registry of plan.h: nothing in the attributes
//                     differs between processes, so XLA's persistent compilation cache finds the
//                     program in the next process that traces it). The ids are resolved at every
//                     call (a lock-free probe a launch), not once in an instantiate stage: one
//                     executable serves every local GPU, each with its own handles, and a process
//                     may load the kernels after XLA instantiated the handler.
//   offsets  int64[]  CUDA ordinal -> where its plan starts in `plans` (-1: no plan)
//   slots    int64[]  plan slot -> its buffer: k >= 0 the k-th argument, -1 none (null),
//                     k <= -2 the (-k - 2)-th result
//   aliases  int64[]  (argument, result) pairs that XLA aliases (input_output_aliases): when the
//                     two buffers differ the argument is copied into the result first
//   names    string   the plans' kernel names (';'-separated), for error messages
//
// The FP8 GEMM (gemm.h) is a second handler, `ff8_xla_fp8_gemm`, registered by
// fusedfp8/jax/gemm.py as "fusedfp8_fp8_gemm" (command-buffer compatible):
//   operands  a (>= m, k) FP8, b (>= n, k) FP8, scale_inv_a (1,) f32, scale_inv_b (1,) f32
//   results   out (m, n) bf16 / f16 / f32, workspace u8[bytes] (cuBLASLt's, buffer-assigned by XLA)
//   attrs     fast_accum int64 (0 / 1)
// out = scale_inv_a * scale_inv_b * (a[:m] @ b[:n].T). `ff8_xla_fp8_gemm_bias` ("fusedfp8_fp8_gemm_bias")
// takes a fifth operand, bias (n,) of the output's type, added in cuBLASLt's epilogue before the
// one rounding to the output type. `ff8_xla_fp8_gemm_block` / `_block_bias` ("fusedfp8_fp8_gemm_block"
// / "_bias") are the block-scaled GEMM of BlockScaling: attrs a_block, b_block (1: 1x128 blocks,
// 128: 128x128), the scales each operand's block scales (gemm.h's block_scale_numel floats), out
// (a's rows, b's rows), the split accumulator. The workspace is a result rather than an
// ffi::ScratchAllocator allocation: a scratch allocation is released when the handler returns,
// and a CUDA graph recorded from the handler would keep its address; an XLA-assigned buffer is
// what XLA's own cuBLASLt calls use, and stays valid for every replay.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "gemm.h"
#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <class Buffers, class Get>
ffi::Error pointer_of(const Buffers& list, int64_t k, Get get, uint64_t* out, size_t* bytes) {
  auto buf = get(list, k);
  if (!buf.has_value()) return buf.error();
  *bytes = buf->size_bytes();
  *out = buf->element_count() ? reinterpret_cast<uint64_t>(buf->untyped_data()) : 0;  // 0-size: null, as in Python
  return ffi::Error::Success();
}

auto get_arg = [](const ffi::RemainingArgs& a, int64_t k) { return a.get<ffi::AnyBuffer>(static_cast<size_t>(k)); };

struct RetView {
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> r;
  bool has_value() const { return r.has_value(); }
  ffi::Error error() const { return r.error(); }
  const ffi::AnyBuffer* operator->() { return &**r; }
};
auto get_ret = [](const ffi::RemainingRets& a, int64_t k) {
  return RetView{a.get<ffi::AnyBuffer>(static_cast<size_t>(k))};
};

ffi::Error Launch(void* stream, ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> plans,
                  ffi::Span<const int64_t> offsets, ffi::Span<const int64_t> slots, ffi::Span<const int64_t> aliases,
                  std::string_view names) {
  const ff8::Driver& d = ff8::driver();
  if (!d.why.empty()) return ffi::Error::Internal("fusedfp8: " + d.why);
  int dev = -1;
  if (ff8::CUresult e = d.ctx_get_device(&dev))
    return ffi::Error::Internal("fusedfp8: cuCtxGetDevice failed in the XLA FFI handler: " + ff8::cuda_error(e));
  if (dev < 0 || static_cast<size_t>(dev) >= offsets.size() || offsets[dev] < 0 ||
      static_cast<size_t>(offsets[dev]) >= plans.size())
    return ffi::Error::InvalidArgument("fusedfp8: this XLA program holds no launch plan for CUDA device " +
                                       std::to_string(dev) + " (plans are made at trace time for jax's local GPUs)");
  if (slots.size() > 63) return ffi::Error::InvalidArgument("fusedfp8: too many buffer slots");
  uint64_t bufs[64];
  size_t bytes = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t src = slots[i];
    ffi::Error err = ffi::Error::Success();
    if (src == -1)
      bufs[i] = 0;
    else if (src >= 0)
      err = pointer_of(args, src, get_arg, &bufs[i], &bytes);
    else
      err = pointer_of(rets, -src - 2, get_ret, &bufs[i], &bytes);
    if (err.failure()) return err;
  }
  if (aliases.size() % 2) return ffi::Error::InvalidArgument("fusedfp8: aliases must come in pairs");
  for (size_t i = 0; i < aliases.size(); i += 2) {
    uint64_t in = 0, out = 0;
    size_t in_bytes = 0, out_bytes = 0;
    if (ffi::Error e = pointer_of(args, aliases[i], get_arg, &in, &in_bytes); e.failure()) return e;
    if (ffi::Error e = pointer_of(rets, aliases[i + 1], get_ret, &out, &out_bytes); e.failure()) return e;
    if (in != out && in_bytes && in_bytes == out_bytes) {  // XLA did not alias them: carry the values over
      if (ff8::CUresult e = d.memcpy_dtod_async(out, in, in_bytes, stream))
        return ffi::Error::Internal("fusedfp8: copying an aliased state buffer failed: " + ff8::cuda_error(e));
    }
  }
  const int64_t at = offsets[dev];
  std::string err = ff8::run(plans.begin() + at, plans.size() - at, bufs, slots.size(), dev, stream, names);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

int32_t lt_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return ff8::lt::kR8F_E4M3;
    case ffi::DataType::F8E5M2: return ff8::lt::kR8F_E5M2;
    case ffi::DataType::BF16: return ff8::lt::kR16BF;
    case ffi::DataType::F16: return ff8::lt::kR16F;
    case ffi::DataType::F32: return ff8::lt::kR32F;
    default: return -1;
  }
}

// `bias`: null, or the (n,) bias of the bias epilogue (the output's type). `a_block` / `b_block`:
// 0 for one scale per tensor, else the operand's block rows (1: 1x128, 128: 128x128), its scales
// the block_scale_numel floats of gemm.h's layout for the operand as stored, which must then be
// the GEMM's (m = a's rows, n = b's rows: the scale layout follows the GEMM's dimensions).
ffi::Error Fp8GemmImpl(void* stream, ffi::AnyBuffer& a, ffi::AnyBuffer& b, ffi::AnyBuffer& sa, ffi::AnyBuffer& sb,
                       const ffi::AnyBuffer* bias, ffi::Result<ffi::AnyBuffer>& out, ffi::Result<ffi::AnyBuffer>& ws,
                       int64_t fast_accum, int64_t a_block = 0, int64_t b_block = 0) {
  const ff8::Driver& d = ff8::driver();
  if (!d.why.empty()) return ffi::Error::Internal("fusedfp8: " + d.why);
  auto da = a.dimensions(), db = b.dimensions(), dout = out->dimensions();
  if (da.size() != 2 || db.size() != 2 || dout.size() != 2)
    return ffi::Error::InvalidArgument("fusedfp8 FP8 GEMM: a, b and the output must be 2-D");
  if (da[1] != db[1] || da[0] < dout[0] || db[0] < dout[1])
    return ffi::Error::InvalidArgument("fusedfp8 FP8 GEMM: a (" + std::to_string(da[0]) + ", " + std::to_string(da[1]) +
                                       ") and b (" + std::to_string(db[0]) + ", " + std::to_string(db[1]) +
                                       ") do not give an output of (" + std::to_string(dout[0]) + ", " +
                                       std::to_string(dout[1]) + ")");
  ff8::lt::Shape shape{dout[0], dout[1], da[1], da[1], db[1], dout[1], lt_type(a.element_type()),
                       lt_type(b.element_type()), lt_type(out->element_type()), static_cast<int32_t>(fast_accum),
                       static_cast<int64_t>(ws->size_bytes())};
  if (a_block == 0 && b_block == 0) {
    for (const ffi::AnyBuffer* s : {&sa, &sb})
      if (s->element_type() != ffi::DataType::F32 || s->element_count() < 1)
        return ffi::Error::InvalidArgument("fusedfp8 FP8 GEMM: the scales must be float32 arrays of one element");
  } else {
    const auto block_ok = [](int64_t v) { return v == 1 || v == 128; };
    if (!block_ok(a_block) || !block_ok(b_block) || (a_block == 128 && b_block == 128))
      return ffi::Error::InvalidArgument("fusedfp8 block-scaled FP8 GEMM: a_block and b_block must be 1 or 128, not "
                                         "both 128; got " + std::to_string(a_block) + " and " + std::to_string(b_block));
    if (da[0] != dout[0] || db[0] != dout[1])
      return ffi::Error::InvalidArgument("fusedfp8 block-scaled FP8 GEMM: the output must be (a's rows, b's rows)");
    const int64_t want[2] = {ff8::lt::block_scale_numel(da[0], da[1], a_block),
                             ff8::lt::block_scale_numel(db[0], db[1], b_block)};
    const ffi::AnyBuffer* scales[2] = {&sa, &sb};
    for (int i = 0; i < 2; ++i)
      if (scales[i]->element_type() != ffi::DataType::F32 ||
          static_cast<int64_t>(scales[i]->element_count()) != want[i])
        return ffi::Error::InvalidArgument("fusedfp8 block-scaled FP8 GEMM: scale_inv_" + std::string(i ? "b" : "a") +
                                           " must be " + std::to_string(want[i]) + " float32 values (its block scales)");
    shape.sa_mode = a_block == 1 ? ff8::lt::kScaleVec128 : ff8::lt::kScaleBlk128x128;
    shape.sb_mode = b_block == 1 ? ff8::lt::kScaleVec128 : ff8::lt::kScaleBlk128x128;
  }
  if (bias != nullptr) {
    if (bias->element_count() != static_cast<size_t>(dout[1]))
      return ffi::Error::InvalidArgument("fusedfp8 FP8 GEMM: the bias must have one element per output column (" +
                                         std::to_string(dout[1]) + "); got " + std::to_string(bias->element_count()));
    shape.epilogue = ff8::lt::kEpilogueBias;
    shape.bias_type = lt_type(bias->element_type());
  }
  int dev = -1;
  if (ff8::CUresult e = d.ctx_get_device(&dev))
    return ffi::Error::Internal("fusedfp8: cuCtxGetDevice failed in the XLA FFI handler: " + ff8::cuda_error(e));
  std::string err = ff8::lt::run(dev, shape, a.untyped_data(), b.untyped_data(), static_cast<const float*>(sa.untyped_data()),
                                 static_cast<const float*>(sb.untyped_data()), out->untyped_data(), ws->untyped_data(),
                                 stream, bias ? bias->untyped_data() : nullptr, ff8::lt::kXlaAlign);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error Fp8Gemm(void* stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa, ffi::AnyBuffer sb,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws, int64_t fast_accum) {
  return Fp8GemmImpl(stream, a, b, sa, sb, nullptr, out, ws, fast_accum);
}

ffi::Error Fp8GemmBias(void* stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa, ffi::AnyBuffer sb,
                       ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws,
                       int64_t fast_accum) {
  return Fp8GemmImpl(stream, a, b, sa, sb, &bias, out, ws, fast_accum);
}

ffi::Error Fp8GemmBlock(void* stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa, ffi::AnyBuffer sb,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws, int64_t a_block,
                        int64_t b_block) {
  return Fp8GemmImpl(stream, a, b, sa, sb, nullptr, out, ws, 0, a_block, b_block);
}

ffi::Error Fp8GemmBlockBias(void* stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer sa, ffi::AnyBuffer sb,
                            ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws,
                            int64_t a_block, int64_t b_block) {
  return Fp8GemmImpl(stream, a, b, sa, sb, &bias, out, ws, 0, a_block, b_block);
}

}  // namespace

// a, b, scale_inv_a, scale_inv_b -> out, workspace
XLA_FFI_DEFINE_HANDLER_SYMBOL(ff8_xla_fp8_gemm, Fp8Gemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fast_accum"),
                              {ffi::Traits::kCmdBufferCompatible});

// the block-scaled GEMM (BlockScaling): a, b, scale_inv_a, scale_inv_b (the block scales) -> out, workspace
XLA_FFI_DEFINE_HANDLER_SYMBOL(ff8_xla_fp8_gemm_block, Fp8GemmBlock,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("a_block")
                                  .Attr<int64_t>("b_block"),
                              {ffi::Traits::kCmdBufferCompatible});

// the same with a bias in the epilogue
XLA_FFI_DEFINE_HANDLER_SYMBOL(ff8_xla_fp8_gemm_block_bias, Fp8GemmBlockBias,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("a_block")
                                  .Attr<int64_t>("b_block"),
                              {ffi::Traits::kCmdBufferCompatible});

// a, b, scale_inv_a, scale_inv_b, bias -> out, workspace: out = the product + bias[j], rounded once
XLA_FFI_DEFINE_HANDLER_SYMBOL(ff8_xla_fp8_gemm_bias, Fp8GemmBias,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("fast_accum"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(ff8_xla_launch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("plans")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<ffi::Span<const int64_t>>("slots")
                                  .Attr<ffi::Span<const int64_t>>("aliases")
                                  .Attr<std::string_view>("names"),
                              {ffi::Traits::kCmdBufferCompatible});

// ---- C entry points (ctypes) -------------------------------------------------------------------
extern "C" {

// The plan format this library reads (fusedfp8.launch.format.PLAN_VERSION must match).
int64_t ff8_plan_version() { return ff8::kPlanVersion; }

namespace {
int64_t put_error(const std::string& why, char* err, int64_t errcap) {
  if (errcap > 0) {
    size_t k = std::min(why.size(), static_cast<size_t>(errcap - 1));
    std::memcpy(err, why.data(), k);
    err[k] = '\0';
  }
  return why.empty() ? 0 : -1;
}
}  // namespace

// Test entry point: what running `plan` on `bufs` with the kernels registered for `device` would
// hand the driver, without launching (the byte format of fusedfp8.launch.executor.dry_run); `names` as
// the handler's attribute. Returns the bytes written, or -1 with the reason in `err`
// (NUL-terminated, truncated to errcap).
int64_t ff8_dry_run(const int64_t* plan, int64_t n, const uint64_t* bufs, int64_t nbuf, int64_t device,
                    const char* names, unsigned char* out, int64_t cap, char* err, int64_t errcap) {
  ff8::RecordSink sink{out, static_cast<size_t>(cap)};
  std::string why = ff8::walk(plan, static_cast<size_t>(n), bufs, static_cast<size_t>(nbuf), device,
                              names ? names : "", sink);
  if (why.empty()) return static_cast<int64_t>(sink.used);
  return put_error(why, err, errcap);
}

// Registers n kernels of CUDA device `device`: ids[i] is the handle funcs[i] (fusedfp8.csrc.
// register_kernels calls it for every module loaded). 0, or -1 with the reason in `err`.
int64_t ff8_register_kernels(int64_t device, const int64_t* ids, const uint64_t* funcs, int64_t n, char* err,
                             int64_t errcap) {
  for (int64_t i = 0; i < n; ++i) {
    std::string why = ff8::kernels::add(device, ids[i], funcs[i]);
    if (!why.empty()) return put_error(why, err, errcap);
  }
  return 0;
}

namespace {

// m, n, k, lda, ldb, ldd, ta, tb, td, fast_accum, workspace, epilogue, bias_type, sa_mode, sb_mode
ff8::lt::Shape gemm_shape(const int64_t* v) {
  return ff8::lt::Shape{v[0], v[1], v[2], v[3], v[4], v[5], static_cast<int32_t>(v[6]), static_cast<int32_t>(v[7]),
                        static_cast<int32_t>(v[8]), static_cast<int32_t>(v[9]), v[10], static_cast<uint32_t>(v[11]),
                        static_cast<int32_t>(v[12]), static_cast<int32_t>(v[13]), static_cast<int32_t>(v[14])};
}
}  // namespace

// The FP8 GEMM's library: the path cuBLASLt is loaded from when the process has none loaded yet
// (call before the first GEMM; later calls change nothing).
void ff8_gemm_set_library(const char* path) {
  std::lock_guard<std::mutex> g(ff8::lt::lock());
  ff8::lt::library_path() = path ? path : "";
}

// Loads cuBLASLt now: its version (cublasLtGetVersion), or -1 with the reason in `err`.
int64_t ff8_gemm_load(char* err, int64_t errcap) {
  const ff8::lt::Api& a = ff8::lt::api();
  if (!a.why.empty()) return put_error(a.why, err, errcap);
  put_error(a.where, err, errcap);
  return static_cast<int64_t>(a.version());
}

// 0 when cuBLASLt's FP8 GEMM takes the shape `v` (15 int64s: m, n, k, lda, ldb, ldd, a's, b's and
// the output's cudaDataType, fast_accum, workspace bytes, epilogue, the bias's cudaDataType, a's and
// b's cublasLtMatmulMatrixScale_t), else
// -1 with the reason. No GPU needed.
int64_t ff8_gemm_check(const int64_t* v, char* err, int64_t errcap) {
  return put_error(ff8::lt::check_shape(gemm_shape(v)), err, errcap);
}

// Makes (once) the descriptors and the heuristic's algorithm of the shape `v` (as ff8_gemm_check)
// on CUDA device `device`: called at trace time so that no cuBLASLt set-up runs inside XLA's
// stream capture. 0, or -1 with the reason.
int64_t ff8_gemm_prepare(int64_t device, const int64_t* v, char* err, int64_t errcap) {
  const ff8::lt::Shape s = gemm_shape(v);
  std::string why = ff8::lt::on_device(static_cast<int>(device), [&] {
    ff8::lt::Entry* e = nullptr;
    return ff8::lt::entry(static_cast<int>(device), s, ff8::lt::kXlaAlign, &e);  // the key the handler runs with
  });
  return put_error(why, err, errcap);
}

}  // extern "C"
