// fusedfp8 host shim for JAX: the XLA FFI handler `ff8_xla_launch` (registered by
// fusedfp8/jax/primitives.py as the CUDA custom call target "fusedfp8_launch") and the C entry
// points that Python reaches through ctypes. Header-only XLA FFI (jax.ffi.include_dir()); no
// jaxlib or CUDA library is linked: the driver is found at first use (plan.h).
//
// The handler is declared command-buffer compatible: it only launches kernels and memsets /
// copies on XLA's stream, on XLA's buffers, so XLA records it into a CUDA graph and replays it
// without calling back into the host.
//
// Attributes (written by fusedfp8/jax/primitives.py):
//   plans    int64[]  the encoded plans of every local GPU, one after the other
//   offsets  int64[]  CUDA ordinal -> where its plan starts in `plans` (-1: no plan)
//   slots    int64[]  plan slot -> its buffer: k >= 0 the k-th argument, -1 none (null),
//                     k <= -2 the (-k - 2)-th result
//   aliases  int64[]  (argument, result) pairs that XLA aliases (input_output_aliases): when the
//                     two buffers differ the argument is copied into the result first
//   names    string   the plans' kernel names (';'-separated), for error messages
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

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
  std::string err = ff8::run(plans.begin() + at, plans.size() - at, bufs, slots.size(), stream, names);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace

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

// The plan format this library reads (fusedfp8.csrc.plan.PLAN_VERSION must match).
int64_t ff8_plan_version() { return ff8::kPlanVersion; }

// Test entry point: what running `plan` on `bufs` would hand the driver, without launching
// (the byte format of fusedfp8.csrc.plan.dry_run). Returns the bytes written, or -1 with the
// reason in `err` (NUL-terminated, truncated to errcap).
int64_t ff8_dry_run(const int64_t* plan, int64_t n, const uint64_t* bufs, int64_t nbuf, unsigned char* out,
                    int64_t cap, char* err, int64_t errcap) {
  ff8::RecordSink sink{out, static_cast<size_t>(cap)};
  std::string why = ff8::walk(plan, static_cast<size_t>(n), bufs, static_cast<size_t>(nbuf), sink);
  if (why.empty()) return static_cast<int64_t>(sink.used);
  if (errcap > 0) {
    size_t k = std::min(why.size(), static_cast<size_t>(errcap - 1));
    std::memcpy(err, why.data(), k);
    err[k] = '\0';
  }
  return -1;
}

}  // extern "C"
