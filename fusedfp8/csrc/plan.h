// fusedfp8 host shim: the launch-plan interpreter shared by the XLA FFI handler (xla_ffi.cc) and
// the torch C++ ops (torch_ops.cc). C++17, no CUDA headers: the few driver entry points it needs
// are declared here and found with dlopen("libcuda.so.1") / dlsym at first use.
//
// A plan is the int64 encoding of fusedfp8.launch.format.Plan (Plan.encode there is the writer):
//   [PLAN_VERSION, n_slots, n_steps, step...]
//   memset step: [MEMSET, slot, nbytes]                     zero nbytes (cuMemsetD32Async); none
//                                                           for a null slot
//   launch step: [LAUNCH | COOP_LAUNCH, n_variants, select, block, shared, n_params,
//                 (kernel id, grid) * n_variants, (kind, a, b, c) * n_params]
//     A kernel is named by its id (fusedfp8.launch.kernels.kernel_id), resolved to its CUfunction in
//     the kernel registry below when the plan runs: see there for why not the handle.
//     COOP_LAUNCH goes through cuLaunchCooperativeKernel (a pointer per parameter into the packed
//     buffer), which guarantees every block resident (the kernels' grid-wide barrier).
//     variant 0 runs when every slot in the bit mask `select` is 16-byte aligned, else variant 1.
//     parameter kinds: I64 / I32 immediate a; F32 bits a; PTR slot a + b bytes (null if the slot
//     is null); NULL; FLAG int32 (c != 0 and every slot in mask a aligned to b bytes).
//     Parameters are packed at their natural alignment, without trailing padding (the layout
//     the kernels declare, and what Python's struct '@' gives).
// Names: the variants' kernel names in plan order, joined by ';' (for error messages).
//
// The interpreter walks the encoded plan in place (no allocation on the hot path) and checks
// every index against the plan's length and the slot count before using it.
#pragma once

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>

namespace ff8 {

constexpr int64_t kPlanVersion = 3;  // 2: the cooperative launch step; 3: kernels named by id
enum : int64_t { kMemset = 0, kLaunch = 1, kCoopLaunch = 2 };
enum : int64_t { kI64 = 1, kI32 = 2, kF32 = 3, kPtr = 4, kNull = 5, kFlag = 6 };
constexpr size_t kMaxParamBytes = 4096;  // the driver's limit for kernel parameters
constexpr int64_t kMaxCoopParams = 64;     // parameters of a cooperative launch (one pointer each)

// ---- the driver ------------------------------------------------------------------------------
using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using CUdevice = int;
using CUdeviceptr = unsigned long long;

struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**) = nullptr;
  CUresult (*launch_coop)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                          void**) = nullptr;
  CUresult (*memset_d32_async)(CUdeviceptr, unsigned, size_t, CUstream) = nullptr;
  CUresult (*memcpy_dtod_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*ctx_get_device)(int*) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  // (stream, status*, id*, ...): every version of cuStreamGetCaptureInfo begins with these three, and
  // the optional outputs after them are passed as null (ignored by the versions without them); optional
  CUresult (*capture_info)(CUstream, int*, unsigned long long*, void*, void*, void*, void*) = nullptr;
  std::string why;  // empty when every required entry point was found
};

inline const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      r.why = std::string("libcuda.so.1 cannot be loaded (") + (e ? e : "?") + ")";
      return r;
    }
    auto sym = [&](const char* name, auto& fn) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && r.why.empty()) r.why = std::string("libcuda.so.1 has no ") + name;
    };
    sym("cuLaunchKernel", r.launch);
    sym("cuLaunchCooperativeKernel", r.launch_coop);
    sym("cuMemsetD32Async", r.memset_d32_async);
    sym("cuMemcpyDtoDAsync_v2", r.memcpy_dtod_async);
    sym("cuCtxGetDevice", r.ctx_get_device);
    sym("cuCtxGetCurrent", r.ctx_get_current);
    sym("cuCtxSetCurrent", r.ctx_set_current);
    sym("cuDeviceGet", r.device_get);
    sym("cuDevicePrimaryCtxRetain", r.primary_ctx_retain);
    sym("cuGetErrorName", r.error_name);
    sym("cuGetErrorString", r.error_string);
    for (const char* name : {"cuStreamGetCaptureInfo_v2", "cuStreamGetCaptureInfo"}) {
      if (r.capture_info == nullptr)
        r.capture_info = reinterpret_cast<decltype(r.capture_info)>(dlsym(lib, name));
    }
    return r;
  }();
  return d;
}

// "CUDA error 700 (CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered)"
inline std::string cuda_error(CUresult err) {
  const Driver& d = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.error_name) d.error_name(err, &name);
  if (d.error_string) d.error_string(err, &text);
  return "CUDA error " + std::to_string(err) + " (" + (name ? name : "?") + ": " + (text ? text : "?") + ")";
}

// The primary context of `device` (the one the CUDA runtime, and so torch, CuPy and XLA, use),
// retained once per device and kept. "" or the error.
inline std::string primary_context(int device, CUcontext* out) {
  const Driver& d = driver();
  if (!d.why.empty()) return "fusedfp8: " + d.why;
  constexpr int kMaxDevices = 64;
  static CUcontext primary[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return "fusedfp8: CUDA device index " + std::to_string(device) + " out of range";
  CUcontext ctx = __atomic_load_n(&primary[device], __ATOMIC_ACQUIRE);
  if (ctx == nullptr) {
    CUdevice dev = 0;
    CUresult err = d.device_get(&dev, device);
    if (err == 0) err = d.primary_ctx_retain(&ctx, dev);
    if (err != 0) return "fusedfp8: retaining the primary context of CUDA device " + std::to_string(device) +
                         " failed: " + cuda_error(err);
    CUcontext none = nullptr;  // another thread may have retained it first: keep one retain
    if (!__atomic_compare_exchange_n(&primary[device], &none, ctx, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      ctx = none;
  }
  *out = ctx;
  return "";
}

// Holds `device`'s primary context current on this thread for its scope and restores the thread's
// previous context after (nothing to do when it is current already). The driver API launches into
// the current context and a kernel handle is valid in its own context only, while the thread's
// current context may be another GPU's (the caller's current device), none (a thread that made no
// CUDA runtime call yet: torch's autograd engine runs the backward on worker threads of its own,
// and the caching allocator hands out memory without touching the runtime) or a context of the
// same GPU that is not the primary one. error() is "" or why the context could not be made current.
class ContextGuard {
 public:
  explicit ContextGuard(int device) {
    CUcontext ctx = nullptr;
    error_ = primary_context(device, &ctx);
    if (!error_.empty()) return;
    const Driver& d = driver();
    if (CUresult err = d.ctx_get_current(&prev_)) {
      error_ = "fusedfp8: reading the thread's current CUDA context failed: " + cuda_error(err);
      return;
    }
    if (prev_ == ctx) return;
    if (CUresult err = d.ctx_set_current(ctx)) {
      error_ = "fusedfp8: making CUDA device " + std::to_string(device) + "'s context current failed: " +
               cuda_error(err);
      return;
    }
    swapped_ = true;
  }
  ~ContextGuard() {
    if (swapped_) driver().ctx_set_current(prev_);
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;
  const std::string& error() const { return error_; }

 private:
  CUcontext prev_ = nullptr;
  bool swapped_ = false;
  std::string error_;
};

// ---- the kernel registry ---------------------------------------------------------------------
// A plan names each kernel by a stable id (fusedfp8.launch.kernels.kernel_id: a hash of its name, its
// module's source, the compile options and the target), not by its CUfunction handle, a pointer
// that means something in one process only: an XLA program holding plans is then the same program
// in every process that traces it (JAX's persistent compilation cache finds it), and an
// executable run in a process that has not loaded its kernels is refused with their names
// instead of launching dead handles. Python registers (device, id) -> handle for every kernel of
// every module it loads (fusedfp8.csrc.register_kernels); the walk resolves the ids here.
//
// One open-addressing table per device, allocated on its first kernel. Writers take a lock;
// readers take none: a slot's handle is stored before its id is published (release / acquire),
// and a slot, once taken, keeps its id (a later registration of the id replaces the handle).
namespace kernels {
constexpr int kMaxDevices = 64;
constexpr int kSlotBits = 12;  // 4096 slots per device: every module of every family is 446 kernels
constexpr size_t kSlots = size_t{1} << kSlotBits;

struct Slot {
  std::atomic<int64_t> id{0};  // 0: free
  std::atomic<uint64_t> func{0};
};
struct Table {
  Slot slot[kSlots];
};

inline std::atomic<Table*>& table(int device) {
  static std::atomic<Table*> tables[kMaxDevices] = {};
  return tables[device];
}

inline size_t home(int64_t id) {  // Fibonacci hashing: the top bits of id * 2^64 / phi
  return static_cast<size_t>((static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> (64 - kSlotBits));
}

// Kernel `id` is the handle `func` on CUDA device `device` from now on. "" or why not.
inline std::string add(int64_t device, int64_t id, uint64_t func) {
  if (device < 0 || device >= kMaxDevices)
    return "fusedfp8: CUDA device index " + std::to_string(device) + " out of range for the kernel registry";
  if (id <= 0 || func == 0) return "fusedfp8: a kernel registration needs a positive id and a non-null handle";
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  Table* t = table(static_cast<int>(device)).load(std::memory_order_acquire);
  if (t == nullptr) {
    t = new Table();  // kept for the process's lifetime, as the kernels it points at
    table(static_cast<int>(device)).store(t, std::memory_order_release);
  }
  for (size_t k = 0, i = home(id); k < kSlots; ++k, i = (i + 1) & (kSlots - 1)) {
    const int64_t at = t->slot[i].id.load(std::memory_order_relaxed);
    if (at != 0 && at != id) continue;
    t->slot[i].func.store(func, std::memory_order_release);
    if (at == 0) t->slot[i].id.store(id, std::memory_order_release);
    return "";
  }
  return "fusedfp8: the kernel registry of CUDA device " + std::to_string(device) + " is full (" +
         std::to_string(kSlots) + " kernels)";
}

// The handle of kernel `id` on `device`, or null when no module holding it was loaded there.
inline const void* find(int64_t device, int64_t id) {
  if (device < 0 || device >= kMaxDevices || id <= 0) return nullptr;
  const Table* t = table(static_cast<int>(device)).load(std::memory_order_acquire);
  if (t == nullptr) return nullptr;
  for (size_t k = 0, i = home(id); k < kSlots; ++k, i = (i + 1) & (kSlots - 1)) {
    const int64_t at = t->slot[i].id.load(std::memory_order_acquire);
    if (at == id)
      return reinterpret_cast<const void*>(static_cast<uintptr_t>(t->slot[i].func.load(std::memory_order_acquire)));
    if (at == 0) return nullptr;
  }
  return nullptr;
}
}  // namespace kernels

// ---- the plan walk ---------------------------------------------------------------------------
inline std::string_view nth_name(std::string_view names, int64_t i) {
  size_t start = 0;
  for (int64_t k = 0; k < i; ++k) {
    size_t at = names.find(';', start);
    if (at == std::string_view::npos) return "a fusedfp8 kernel";  // fewer names than variants
    start = at + 1;
  }
  size_t end = names.find(';', start);
  return names.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
}

inline std::string not_loaded(std::string_view names, int64_t name_index, int64_t id, int64_t device) {
  char hex[24];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(id));
  return "fusedfp8: kernel " + std::string(nth_name(names, name_index)) + " is not loaded on CUDA device " +
         std::to_string(device) + " in this process (kernel id " + hex + "). A process loads a kernel when it " +
         "traces (JAX) or first calls (torch) a fusedfp8 function that launches it, so an XLA executable that was " +
         "deserialized, or compiled by another version of fusedfp8, may name kernels this process never loaded: " +
         "trace the function in this process first (calling the jitted function, or jax.jit(f).lower(...), " +
         "loads its kernels), or compile it again with this version";
}

// Walks the plan `p` (n int64s) over the device pointers `bufs` (nbuf, one per slot), its kernels
// resolved in `device`'s registry, calling
//   sink.memset(ptr, nbytes) -> std::string (empty = ok)
//   sink.launch(func, grid, block, shared, params, size, name_index, coop_args) -> std::string
//     (coop_args: null, or for a cooperative launch one pointer per parameter into params)
// Returns "" or the first error (a malformed plan, a kernel not loaded, or the sink's); `names`
// (the plan's kernel names, ';'-separated) name the kernel in an error.
template <class Sink>
std::string walk(const int64_t* p, size_t n, const uint64_t* bufs, size_t nbuf, int64_t device,
                 std::string_view names, Sink& sink) {
  size_t at = 0;
  auto need = [&](size_t k) { return at + k <= n; };
  if (!need(3) || p[0] != kPlanVersion) return "fusedfp8: not a launch plan of version " + std::to_string(kPlanVersion);
  if (p[1] < 0 || static_cast<uint64_t>(p[1]) != nbuf || nbuf > 63)
    return "fusedfp8: the plan takes " + std::to_string(p[1]) + " buffers, " + std::to_string(nbuf) + " were given";
  const int64_t steps = p[2];
  at = 3;
  int64_t name_base = 0;
  alignas(16) unsigned char params[kMaxParamBytes];
  void* coop_args[kMaxCoopParams];
  for (int64_t s = 0; s < steps; ++s) {
    if (!need(1)) return "fusedfp8: truncated launch plan";
    const int64_t kind = p[at];
    if (kind == kMemset) {
      if (!need(3) || p[at + 1] < 0 || static_cast<uint64_t>(p[at + 1]) >= nbuf || p[at + 2] < 0 || p[at + 2] % 4)
        return "fusedfp8: malformed memset step in a launch plan";
      const uint64_t ptr = bufs[p[at + 1]];
      const int64_t nbytes = p[at + 2];
      at += 3;
      if (ptr != 0 && nbytes != 0) {
        std::string err = sink.memset(ptr, nbytes);
        if (!err.empty()) return err;
      }
      continue;
    }
    if ((kind != kLaunch && kind != kCoopLaunch) || !need(6)) return "fusedfp8: malformed step in a launch plan";
    const bool coop = kind == kCoopLaunch;
    const int64_t nvar = p[at + 1], select = p[at + 2], block = p[at + 3], shared = p[at + 4], ntok = p[at + 5];
    if (nvar < 1 || nvar > 2 || ntok < 0 || block < 1 || shared < 0 || select < 0 || (select >> nbuf) != 0 ||
        (coop && ntok > kMaxCoopParams) || !need(6 + 2 * nvar + 4 * ntok))
      return "fusedfp8: malformed launch step in a launch plan";
    at += 6;
    int64_t choice = 0;
    for (size_t i = 0; i < nbuf; ++i)
      if ((select >> i & 1) && bufs[i] % 16 != 0) choice = 1;
    if (choice >= nvar) return "fusedfp8: a launch plan selects a variant it does not have";
    const void* func = kernels::find(device, p[at + 2 * choice]);
    if (func == nullptr) return not_loaded(names, name_base + choice, p[at + 2 * choice], device);
    const int64_t grid = p[at + 2 * choice + 1];
    if (grid < 1) return "fusedfp8: a launch plan has an empty grid";
    at += 2 * nvar;
    size_t size = 0;
    for (int64_t t = 0; t < ntok; ++t, at += 4) {
      const int64_t tk = p[at], a = p[at + 1], b = p[at + 2], c = p[at + 3];
      const size_t width = (tk == kI64 || tk == kPtr || tk == kNull) ? 8 : 4;
      size = (size + width - 1) / width * width;
      if (size + width > kMaxParamBytes) return "fusedfp8: a launch plan's parameters exceed 4 KiB";
      unsigned char* dst = params + size;
      if (coop) coop_args[t] = dst;
      size += width;
      switch (tk) {
        case kI64:
          std::memcpy(dst, &a, 8);
          break;
        case kI32:
        case kF32: {
          const uint32_t v = static_cast<uint32_t>(a);
          std::memcpy(dst, &v, 4);
          break;
        }
        case kPtr: {
          if (a < 0 || static_cast<uint64_t>(a) >= nbuf) return "fusedfp8: a launch plan points past its buffers";
          const uint64_t v = bufs[a] ? bufs[a] + static_cast<uint64_t>(b) : 0;
          std::memcpy(dst, &v, 8);
          break;
        }
        case kNull:
          std::memset(dst, 0, 8);
          break;
        case kFlag: {
          if (a < 0 || (a >> nbuf) != 0 || b < 1) return "fusedfp8: malformed flag in a launch plan";
          int32_t v = c != 0;
          for (size_t i = 0; i < nbuf; ++i)
            if ((a >> i & 1) && bufs[i] % static_cast<uint64_t>(b) != 0) v = 0;
          std::memcpy(dst, &v, 4);
          break;
        }
        default:
          return "fusedfp8: unknown parameter kind " + std::to_string(tk) + " in a launch plan";
      }
    }
    std::string err = sink.launch(func, grid, block, shared, params, size, name_base + choice,
                                  coop ? coop_args : nullptr);
    if (!err.empty()) return err;
    name_base += nvar;
  }
  return "";
}

// The sink that runs the plan: cuLaunchKernel with the CU_LAUNCH_PARAM_BUFFER_POINTER form, or
// cuLaunchCooperativeKernel with a pointer per parameter (it takes no 'extra').
struct DriverSink {
  CUstream stream;
  std::string_view names;

  std::string memset(uint64_t ptr, int64_t nbytes) {
    CUresult err = driver().memset_d32_async(ptr, 0, static_cast<size_t>(nbytes) / 4, stream);
    if (err == 0) return "";
    return "fusedfp8: zeroing " + std::to_string(nbytes) + " bytes of a workspace failed: " + cuda_error(err);
  }

  std::string launch(const void* func, int64_t grid, int64_t block, int64_t shared, unsigned char* params,
                     size_t size, int64_t name_index, void** coop_args) {
    void* extra[] = {reinterpret_cast<void*>(1), params, reinterpret_cast<void*>(2), &size, nullptr};
    const Driver& d = driver();
    if (coop_args != nullptr && d.launch_coop == nullptr)
      return "fusedfp8: libcuda.so.1 has no cuLaunchCooperativeKernel";
    CUresult err = coop_args != nullptr
        ? d.launch_coop(const_cast<void*>(func), static_cast<unsigned>(grid), 1, 1, static_cast<unsigned>(block), 1, 1,
                        static_cast<unsigned>(shared), stream, coop_args)
        : d.launch(const_cast<void*>(func), static_cast<unsigned>(grid), 1, 1, static_cast<unsigned>(block), 1, 1,
                   static_cast<unsigned>(shared), stream, nullptr, extra);
    if (err == 0) return "";
    return "fusedfp8: launching " + std::string(nth_name(names, name_index)) + (coop_args ? " (cooperative)" : "") +
           " failed: " + cuda_error(err);
  }
};

// Runs the plan on the stream, with the kernels `device` registered. "" or the error.
inline std::string run(const int64_t* p, size_t n, const uint64_t* bufs, size_t nbuf, int64_t device, CUstream stream,
                       std::string_view names) {
  const Driver& d = driver();
  if (!d.why.empty()) return "fusedfp8: " + d.why;
  DriverSink sink{stream, names};
  return walk(p, n, bufs, nbuf, device, names, sink);
}

// The sink of ff8_dry_run: records what the driver would get, in the byte format of
// fusedfp8.launch.executor.dry_run (int64 fields, little-endian; parameters zero-padded to 8 bytes).
struct RecordSink {
  unsigned char* out;
  size_t cap;
  size_t used = 0;

  bool put(const void* src, size_t k) {
    if (used + k > cap) return false;
    std::memcpy(out + used, src, k);
    used += k;
    return true;
  }
  std::string memset(uint64_t ptr, int64_t nbytes) {
    const int64_t head[3] = {kMemset, static_cast<int64_t>(ptr), nbytes};
    return put(head, sizeof head) ? "" : "fusedfp8: dry-run buffer too small";
  }
  std::string launch(const void* func, int64_t grid, int64_t block, int64_t shared, unsigned char* params,
                     size_t size, int64_t, void** coop_args) {
    const int64_t head[6] = {coop_args ? kCoopLaunch : kLaunch, static_cast<int64_t>(reinterpret_cast<uintptr_t>(func)), grid, block, shared,
                             static_cast<int64_t>(size)};
    const unsigned char zeros[8] = {0};
    if (!put(head, sizeof head) || !put(params, size) || !put(zeros, (8 - size % 8) % 8))
      return "fusedfp8: dry-run buffer too small";
    return "";
  }
};

}  // namespace ff8
