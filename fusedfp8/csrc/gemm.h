// fusedfp8 host shim: the FP8 GEMM through cuBLASLt. C++17, no CUDA headers: the few cuBLASLt
// types and enum values it needs are declared below (tests/kernels/test_gemm_shim.py compiles
// gemm_check.cc, which static_asserts them against the real cublasLt.h wherever one is found), and
// the library is found with dlopen at first use: a libcublasLt already loaded in the process (the
// copy XLA uses), else the path Python resolved (fusedfp8.csrc.cublaslt_path: the nvidia cuBLAS
// wheel), else the soname.
//
// What it computes, in the row-major terms of our quantize kernels:
//   out (m, n) = scale_inv_a * scale_inv_b * (a[:m] @ b[:n].T)
//   a: (>= m rows, k) row stride lda; b: (>= n rows, k) row stride ldb; out: row stride ldd
// Both operands are "K-contiguous": the forward's x_q (M, K) and the weight's w_t_q (N, K), the
// dgrad's g_q (M, N) and w_q (K, N), the wgrad's x_t_q (K, M) and g_t_q (N, M) -- the forms the
// quantize kernels write (q and its transpose q_t), so no operand is copied. cuBLASLt is
// column-major and its FP8 GEMMs need the "TN" layout (op(A) transposed, op(B) not); a row-major
// (rows, cols) array is a column-major (cols, rows) one, so the call is
//   D (n x m, ld ldd) = op(A) op(B), A = b (k x n column-major, ld ldb, TRANSA = T),
//                                    B = a (k x m column-major, ld lda, TRANSB = N)
// i.e. cuBLASLt's (m, n, k) = our (n, m, k), A_SCALE_POINTER = scale_inv_b, B_SCALE_POINTER =
// scale_inv_a, alpha 1, beta 0 (C = D, never read). The output is written directly in bf16 / fp16
// / fp32 with the scales applied in the epilogue: no float32 intermediate, no host sync.
//
// Bias (optional, Shape::epilogue = kEpilogueBias): out = round(scale_inv_a * scale_inv_b * acc +
// bias[j]) with CUBLASLT_EPILOGUE_BIAS: the sum is formed in float32 in the epilogue and rounded
// once to the output type, as torch._scaled_mm's bias does (the same cuBLASLt epilogue). The bias
// is a vector of n elements of the output's type, bfloat16 or float16 (cublasLt.h: "Bias vector
// elements are the same type as the elements of output matrix (Dtype)", except for FP8 kernels
// with a float32 output, which take a bfloat16 one; that pairing is not offered here, and
// torch._scaled_mm refuses a bias with a float32 output too). The XLA target passes no bias.
//
// Requirements (checked by check_shape, which the Python wrapper mirrors): k, lda, ldb multiples
// of 16 (ragged K: our kernels pad the operands with zeros, pad_to=16; zeros add nothing), the
// output row (ldd elements) a multiple of 16 elements (a ragged N is computed padded and sliced),
// every pointer 16-byte aligned, and not both operands E5M2 (cuBLASLt has no e5m2 x e5m2 GEMM).
//
// Per shape (device, m, n, k, leading dims, formats, output type, fast accumulation, workspace
// bytes, epilogue and bias type) the matmul descriptor, the three layouts and the heuristic's
// algorithm are made once and cached; a call then sets the two scale pointers (and the bias
// pointer) and runs cublasLtMatmul under the entry's lock.
// One cublasLt handle per device. Entries are made by prepare() (called at trace time, for every
// local GPU, outside any stream capture) or, failing that, on the first call.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "plan.h"

namespace ff8::lt {

// ---- the cuBLASLt declarations this file uses (values checked against cublasLt.h) -----------
using Status = int;  // cublasStatus_t
using Handle = void*;
using MatmulDesc = void*;
using Layout = void*;
using Preference = void*;
struct Algo {  // cublasLtMatmulAlgo_t
  uint64_t data[8];
};
struct HeuristicResult {  // cublasLtMatmulHeuristicResult_t
  Algo algo;
  size_t workspaceSize;
  Status state;
  float wavesCount;
  int reserved[4];
};
// cudaDataType_t
enum : int32_t { kR32F = 0, kR16F = 2, kR16BF = 14, kR8F_E4M3 = 28, kR8F_E5M2 = 29 };
enum : int32_t { kCompute32F = 68 };   // cublasComputeType_t CUBLAS_COMPUTE_32F
enum : int32_t { kOpN = 0, kOpT = 1 };  // cublasOperation_t
// cublasLtMatmulDescAttributes_t
enum : int32_t {
  kDescTransA = 3,
  kDescTransB = 4,
  kDescEpilogue = 7,
  kDescBiasPointer = 8,
  kDescAScalePointer = 17,
  kDescBScalePointer = 18,
  kDescFastAccum = 25,
  kDescBiasDataType = 26,
  kDescAScaleMode = 31,
  kDescBScaleMode = 32
};
// cublasLtMatmulMatrixScale_t: one float32 scale per tensor, per 1x128 block (VEC128_32F), per
// 128x128 block (BLK128x128_32F)
enum : int32_t { kScaleScalar = 0, kScaleVec128 = 4, kScaleBlk128x128 = 5 };
// cublasLtEpilogue_t (the attribute is a uint32_t)
enum : uint32_t { kEpilogueDefault = 1, kEpilogueBias = 4 };
// cublasLtMatmulPreferenceAttributes_t
enum : int32_t { kPrefMaxWorkspaceBytes = 1, kPrefMinAlignA = 5, kPrefMinAlignB = 6, kPrefMinAlignC = 7, kPrefMinAlignD = 8 };

struct Api {
  Status (*create)(Handle*) = nullptr;
  const char* (*status_string)(Status) = nullptr;
  size_t (*version)() = nullptr;
  Status (*desc_create)(MatmulDesc*, int32_t, int32_t) = nullptr;
  Status (*desc_destroy)(MatmulDesc) = nullptr;
  Status (*desc_set)(MatmulDesc, int32_t, const void*, size_t) = nullptr;
  Status (*layout_create)(Layout*, int32_t, uint64_t, uint64_t, int64_t) = nullptr;
  Status (*layout_destroy)(Layout) = nullptr;
  Status (*pref_create)(Preference*) = nullptr;
  Status (*pref_destroy)(Preference) = nullptr;
  Status (*pref_set)(Preference, int32_t, const void*, size_t) = nullptr;
  Status (*heuristic)(Handle, MatmulDesc, Layout, Layout, Layout, Layout, Preference, int, HeuristicResult*,
                      int*) = nullptr;
  Status (*matmul)(Handle, MatmulDesc, const void*, const void*, Layout, const void*, Layout, const void*, const void*,
                   Layout, void*, Layout, const Algo*, void*, size_t, CUstream) = nullptr;
  std::string where;  // the library loaded
  std::string why;    // empty when every entry point was found
};

inline std::mutex& lock() {
  static std::mutex m;
  return m;
}

inline std::string& library_path() {  // set by Python before the first use (ff8_gemm_set_library)
  static std::string p;
  return p;
}

inline std::string last_dl_error() {
  const char* e = dlerror();
  return e ? e : "?";
}

inline const Api& api() {
  static const Api a = [] {
    Api r;
    std::string path;
    {
      std::lock_guard<std::mutex> g(lock());
      path = library_path();
    }
    void* lib = nullptr;
    for (const char* so : {"libcublasLt.so.13", "libcublasLt.so.12"}) {  // the copy already in the process
      if ((lib = dlopen(so, RTLD_NOW | RTLD_NOLOAD | RTLD_LOCAL)) != nullptr) {
        r.where = so;
        break;
      }
    }
    std::string tried;
    if (lib == nullptr && !path.empty()) {
      lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) r.where = path;
      else tried = path + ": " + last_dl_error() + "; ";
    }
    for (const char* so : {"libcublasLt.so.13", "libcublasLt.so.12"}) {
      if (lib != nullptr) break;
      if ((lib = dlopen(so, RTLD_NOW | RTLD_LOCAL)) != nullptr) r.where = so;
      else tried += std::string(so) + ": " + last_dl_error() + "; ";
    }
    if (lib == nullptr) {
      r.why = "libcublasLt cannot be loaded (" + tried.substr(0, tried.size() - 2) + ")";
      return r;
    }
    auto sym = [&](const char* name, auto& fn) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr && r.why.empty()) r.why = r.where + " has no " + name;
    };
    sym("cublasLtCreate", r.create);
    sym("cublasLtGetStatusString", r.status_string);
    sym("cublasLtGetVersion", r.version);
    sym("cublasLtMatmulDescCreate", r.desc_create);
    sym("cublasLtMatmulDescDestroy", r.desc_destroy);
    sym("cublasLtMatmulDescSetAttribute", r.desc_set);
    sym("cublasLtMatrixLayoutCreate", r.layout_create);
    sym("cublasLtMatrixLayoutDestroy", r.layout_destroy);
    sym("cublasLtMatmulPreferenceCreate", r.pref_create);
    sym("cublasLtMatmulPreferenceDestroy", r.pref_destroy);
    sym("cublasLtMatmulPreferenceSetAttribute", r.pref_set);
    sym("cublasLtMatmulAlgoGetHeuristic", r.heuristic);
    sym("cublasLtMatmul", r.matmul);
    return r;
  }();
  return a;
}

inline std::string status_text(Status s) {
  const char* t = api().status_string ? api().status_string(s) : nullptr;
  return "cuBLASLt status " + std::to_string(s) + " (" + (t ? t : "?") + ")";
}

// ---- one GEMM shape --------------------------------------------------------------------------
struct Shape {
  int64_t m, n, k;       // out (m, n) = a[:m] @ b[:n].T, contracting over k
  int64_t lda, ldb, ldd;  // row strides (elements) of a, b and out
  int32_t ta, tb, td;     // cudaDataType of a, b (FP8) and out (bf16 / fp16 / fp32)
  int32_t fast_accum;     // cuBLASLt's FP8 fast accumulation (1) or the split accumulator (0)
  int64_t workspace;      // bytes of workspace the call provides
  uint32_t epilogue = kEpilogueDefault;  // kEpilogueDefault, or kEpilogueBias: + bias[j] before the rounding
  int32_t bias_type = kR16BF;            // cudaDataType of the bias (read with kEpilogueBias only)
  int32_t sa_mode = kScaleScalar;        // how a's scales are laid out (cublasLtMatmulMatrixScale_t), b's:
  int32_t sb_mode = kScaleScalar;        // kScaleScalar, or the block modes (the layout: docs/design.md)

  bool operator==(const Shape& o) const { return std::memcmp(this, &o, sizeof(Shape)) == 0; }
};
static_assert(sizeof(Shape) == 8 * 7 + 4 * 8, "Shape must have no padding (it is hashed and compared bytewise)");

inline int64_t out_bytes(int32_t td) { return td == kR32F ? 4 : (td == kR16BF || td == kR16F) ? 2 : 0; }

inline const char* type_name(int32_t t) {
  switch (t) {
    case kR8F_E4M3: return "float8_e4m3fn";
    case kR8F_E5M2: return "float8_e5m2";
    case kR16BF: return "bfloat16";
    case kR16F: return "float16";
    case kR32F: return "float32";
    default: return "an unsupported type";
  }
}

// The floats of the scale_inv of an operand (rows, k) with blocks of `block` rows (1: 1x128, 128:
// 128x128) in fusedfp8.numerics.block's layout (docs/design.md "Block scaling"), which cuBLASLt's
// VEC128_32F / BLK128x128_32F modes read: (ceil(k/128), pad4(rows)) or (ceil(rows/128), pad4(ceil(k/128))).
inline int64_t block_scale_numel(int64_t rows, int64_t k, int64_t block) {
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  auto pad4 = [&](int64_t a) { return ceil_div(a, 4) * 4; };
  return block == 1 ? ceil_div(k, 128) * pad4(rows) : ceil_div(rows, 128) * pad4(ceil_div(k, 128));
}

// "" or why the scale modes of `s` are not a block-scaled GEMM cuBLASLt offers (tests/run/
// cublaslt_block_probe.py asked its heuristic on the H200): both operands scaled per tensor, or
// both per block with at most one 128x128 operand (128x128 x 128x128 is not offered) and the split
// accumulator (fast accumulation is not offered with block scales).
inline std::string check_scale_modes(const Shape& s, const std::string& at) {
  auto known = [](int32_t m) { return m == kScaleScalar || m == kScaleVec128 || m == kScaleBlk128x128; };
  if (!known(s.sa_mode) || !known(s.sb_mode))
    return at + "scale modes must be " + std::to_string(kScaleScalar) + " (per tensor), " +
           std::to_string(kScaleVec128) + " (1x128 blocks) or " + std::to_string(kScaleBlk128x128) +
           " (128x128 blocks); got " + std::to_string(s.sa_mode) + " and " + std::to_string(s.sb_mode);
  if ((s.sa_mode == kScaleScalar) != (s.sb_mode == kScaleScalar))
    return at + "one operand is scaled per tensor and the other per block: scale both per block or neither";
  if (s.sa_mode == kScaleBlk128x128 && s.sb_mode == kScaleBlk128x128)
    return at + "cuBLASLt has no 128x128 x 128x128 block-scaled GEMM (one operand must have 1x128 blocks)";
  if (s.sa_mode != kScaleScalar && s.fast_accum)
    return at + "block-scaled FP8 GEMMs take the split accumulator only (fast_accum must be 0)";
  return "";
}

// "" or why cuBLASLt's FP8 GEMM cannot take this shape (before anything runs).
inline std::string check_shape(const Shape& s) {
  auto fp8 = [](int32_t t) { return t == kR8F_E4M3 || t == kR8F_E5M2; };
  const std::string at = "fusedfp8 FP8 GEMM (m=" + std::to_string(s.m) + ", n=" + std::to_string(s.n) +
                         ", k=" + std::to_string(s.k) + "): ";
  if (!fp8(s.ta) || !fp8(s.tb))
    return at + "operands must be float8_e4m3fn or float8_e5m2; got " + type_name(s.ta) + " and " + type_name(s.tb);
  if (s.ta == kR8F_E5M2 && s.tb == kR8F_E5M2)
    return at + "cuBLASLt has no float8_e5m2 x float8_e5m2 GEMM (one operand must be float8_e4m3fn)";
  if (out_bytes(s.td) == 0) return at + "the output must be bfloat16, float16 or float32; got " + type_name(s.td);
  if (s.m < 1 || s.n < 1 || s.k < 1) return at + "every dimension must be >= 1 (empty GEMMs are not launched)";
  if (s.k % 16 || s.lda % 16 || s.ldb % 16)
    return at + "k and the operands' row strides must be multiples of 16 (pad the FP8 operands with zeros: pad_to=16); "
                "got lda=" + std::to_string(s.lda) + ", ldb=" + std::to_string(s.ldb);
  if (s.lda < s.k || s.ldb < s.k || s.ldd < s.n) return at + "a row stride is shorter than its row";
  if (s.ldd % 16) return at + "the output row stride must be a multiple of 16 elements; got " + std::to_string(s.ldd);
  if (s.fast_accum != 0 && s.fast_accum != 1) return at + "fast_accum must be 0 or 1";
  if (s.workspace < 0) return at + "negative workspace";
  if (s.epilogue != kEpilogueDefault && s.epilogue != kEpilogueBias)
    return at + "epilogue must be " + std::to_string(kEpilogueDefault) + " (none) or " + std::to_string(kEpilogueBias) +
           " (bias); got " + std::to_string(s.epilogue);
  if (s.epilogue == kEpilogueBias && (s.td == kR32F || s.bias_type != s.td))
    return at + "the bias must have the output's type, bfloat16 or float16 (cuBLASLt's FP8 bias epilogue); got a " +
           type_name(s.bias_type) + " bias for a " + type_name(s.td) + " output";
  return check_scale_modes(s, at);
}

struct Entry {
  MatmulDesc desc = nullptr;
  Layout la = nullptr, lb = nullptr, ld = nullptr;  // cuBLASLt's A (our b), B (our a), C = D
  Algo algo{};
  size_t workspace_needed = 0;
  std::mutex mu;  // the scale pointers are attributes of the shared descriptor: set + matmul under it
};

struct ShapeHash {
  size_t operator()(const Shape& s) const {
    const unsigned char* p = reinterpret_cast<const unsigned char*>(&s);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(Shape); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

// The heuristic assumes 256-byte aligned buffers unless told otherwise, and may pick an algorithm
// that needs them; the key carries the alignment the algorithm was chosen for: the smallest of
// the three pointers' (and the bias's) (a power of two, 16..256), or for XLA's custom calls the
// alignment XLA guarantees (kXlaAlign), which the trace-time prepare() keys by too, so that a call
// never builds an entry inside XLA's command-buffer recording. The heuristic reads the bias
// pointer's value for its alignment (cublasLt.h), so build() hands it a stand-in of exactly the
// key's alignment.
struct Key {
  int device;
  uint32_t align;
  Shape shape;
  bool operator==(const Key& o) const { return device == o.device && align == o.align && shape == o.shape; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return (ShapeHash()(k.shape) * 31 + static_cast<size_t>(k.device)) * 31 + k.align;
  }
};

// XLA aligns a custom call's buffers to 16 bytes at least (its allocations: 64 or 16), not 256.
constexpr uint32_t kXlaAlign = 16;

inline uint32_t alignment(std::initializer_list<const void*> ptrs) {
  uint32_t a = 256;
  for (const void* p : ptrs)
    while (p != nullptr && a > 16 && reinterpret_cast<uintptr_t>(p) % a) a /= 2;
  return a;
}

inline std::unordered_map<int, Handle>& handles() {
  static std::unordered_map<int, Handle> h;
  return h;
}
inline std::unordered_map<Key, std::unique_ptr<Entry>, KeyHash>& entries() {
  static std::unordered_map<Key, std::unique_ptr<Entry>, KeyHash> e;
  return e;
}

// Builds the descriptor, layouts and algorithm of `s` for `device` (whose context is current).
inline std::string build(Handle h, const Shape& s, uint32_t align, Entry& e) {
  const Api& a = api();
  Status st = 0;
  auto fail = [&](const char* what) { return "fusedfp8 FP8 GEMM: " + std::string(what) + " failed: " + status_text(st); };
  if ((st = a.desc_create(&e.desc, kCompute32F, kR32F))) return fail("cublasLtMatmulDescCreate");
  const int32_t ta = kOpT, tb = kOpN;
  const int8_t fast = static_cast<int8_t>(s.fast_accum);
  if ((st = a.desc_set(e.desc, kDescTransA, &ta, sizeof ta)) || (st = a.desc_set(e.desc, kDescTransB, &tb, sizeof tb)) ||
      (st = a.desc_set(e.desc, kDescFastAccum, &fast, sizeof fast)))
    return fail("cublasLtMatmulDescSetAttribute");
  const void* unit = nullptr;  // stand-ins until a call sets them (the heuristic reads no pointer)
  if ((st = a.desc_set(e.desc, kDescAScalePointer, &unit, sizeof unit)) ||
      (st = a.desc_set(e.desc, kDescBScalePointer, &unit, sizeof unit)))
    return fail("setting the scale pointers");
  if (s.sa_mode != kScaleScalar &&  // cuBLASLt's A is our b
      ((st = a.desc_set(e.desc, kDescAScaleMode, &s.sb_mode, sizeof s.sb_mode)) ||
       (st = a.desc_set(e.desc, kDescBScaleMode, &s.sa_mode, sizeof s.sa_mode))))
    return fail("setting the block scale modes") + " (block-scaled FP8 GEMMs need cuBLAS 12.9 or newer)";
  if (s.epilogue == kEpilogueBias) {
    const void* aligned = reinterpret_cast<const void*>(static_cast<uintptr_t>(align));  // never read
    if ((st = a.desc_set(e.desc, kDescEpilogue, &s.epilogue, sizeof s.epilogue)) ||
        (st = a.desc_set(e.desc, kDescBiasDataType, &s.bias_type, sizeof s.bias_type)) ||
        (st = a.desc_set(e.desc, kDescBiasPointer, &aligned, sizeof aligned)))
      return fail("setting the bias epilogue");
  }
  if ((st = a.layout_create(&e.la, s.tb, s.k, s.n, s.ldb)) || (st = a.layout_create(&e.lb, s.ta, s.k, s.m, s.lda)) ||
      (st = a.layout_create(&e.ld, s.td, s.n, s.m, s.ldd)))
    return fail("cublasLtMatrixLayoutCreate");
  Preference pref = nullptr;
  if ((st = a.pref_create(&pref))) return fail("cublasLtMatmulPreferenceCreate");
  const uint64_t ws = static_cast<uint64_t>(s.workspace);
  HeuristicResult res{};
  int found = 0;
  st = a.pref_set(pref, kPrefMaxWorkspaceBytes, &ws, sizeof ws);
  for (int32_t attr : {kPrefMinAlignA, kPrefMinAlignB, kPrefMinAlignC, kPrefMinAlignD})
    if (st == 0) st = a.pref_set(pref, attr, &align, sizeof align);
  if (st == 0) st = a.heuristic(h, e.desc, e.la, e.lb, e.ld, e.ld, pref, 1, &res, &found);
  a.pref_destroy(pref);
  if (st) return fail("cublasLtMatmulAlgoGetHeuristic");
  if (found < 1 || res.state != 0)
    return "fusedfp8 FP8 GEMM: cuBLASLt has no algorithm for (m=" + std::to_string(s.m) + ", n=" +
           std::to_string(s.n) + ", k=" + std::to_string(s.k) + ", " + type_name(s.ta) + " x " + type_name(s.tb) +
           " -> " + type_name(s.td) + ") on this GPU" +
           (s.sa_mode != kScaleScalar || s.sb_mode != kScaleScalar
                ? " (cuBLASLt runs block-scaled FP8 GEMMs on Hopper GPUs, compute capability 9.0)"
                : "");
  e.algo = res.algo;
  e.workspace_needed = res.workspaceSize;
  return "";
}

// The cached entry of (device, s), made on first use. The device's context must be current.
inline std::string entry(int device, const Shape& s, uint32_t align, Entry** out) {
  const Api& a = api();
  if (!a.why.empty()) return "fusedfp8 FP8 GEMM: " + a.why;
  std::string bad = check_shape(s);
  if (!bad.empty()) return bad;
  std::lock_guard<std::mutex> g(lock());
  auto& map = entries();
  auto it = map.find(Key{device, align, s});
  if (it != map.end()) {
    *out = it->second.get();
    return "";
  }
  Handle& h = handles()[device];
  if (h == nullptr) {
    if (Status st = a.create(&h)) {
      h = nullptr;
      return "fusedfp8 FP8 GEMM: cublasLtCreate failed on CUDA device " + std::to_string(device) + ": " + status_text(st);
    }
  }
  auto e = std::make_unique<Entry>();
  std::string err = build(h, s, align, *e);
  if (!err.empty()) {  // nothing cached: the descriptors of a failed build are dropped
    if (e->desc) a.desc_destroy(e->desc);
    for (Layout l : {e->la, e->lb, e->ld})
      if (l) a.layout_destroy(l);
    return err;
  }
  *out = e.get();
  map.emplace(Key{device, align, s}, std::move(e));
  return "";
}

// Runs out = sa * sb * (a[:m] @ b[:n].T) (+ bias) on `stream` (device `device`, whose context is
// current). `bias`: n elements of s.bias_type when s.epilogue is kEpilogueBias, else nullptr.
// `align`: the alignment the algorithm is chosen for (0: the pointers' own, alignment()).
inline std::string run(int device, const Shape& s, const void* a, const void* b, const float* sa, const float* sb,
                       void* out, void* workspace, CUstream stream, const void* bias = nullptr,
                       uint32_t align = 0) {
  for (const void* p : {a, b, static_cast<const void*>(out), bias})
    if (reinterpret_cast<uintptr_t>(p) % 16)
      return "fusedfp8 FP8 GEMM: the operands, the bias and the output must be 16-byte aligned (cuBLASLt FP8)";
  if ((s.epilogue == kEpilogueBias) != (bias != nullptr))
    return bias ? "fusedfp8 FP8 GEMM: a bias was given for a shape without the bias epilogue"
                : "fusedfp8 FP8 GEMM: the bias epilogue needs a bias pointer";
  Entry* e = nullptr;
  std::string err = entry(device, s, align ? align : alignment({a, b, out, bias}), &e);
  if (!err.empty()) return err;
  Handle h;
  {
    std::lock_guard<std::mutex> g(lock());
    h = handles()[device];
  }
  const Api& lt = api();
  const float one = 1.0f, zero = 0.0f;
  std::lock_guard<std::mutex> g(e->mu);
  Status st = lt.desc_set(e->desc, kDescAScalePointer, &sb, sizeof sb);  // cuBLASLt's A is our b
  if (st == 0) st = lt.desc_set(e->desc, kDescBScalePointer, &sa, sizeof sa);
  if (st == 0 && bias != nullptr) st = lt.desc_set(e->desc, kDescBiasPointer, &bias, sizeof bias);
  if (st == 0)
    st = lt.matmul(h, e->desc, &one, b, e->la, a, e->lb, &zero, out, e->ld, out, e->ld, &e->algo, workspace,
                   static_cast<size_t>(s.workspace), stream);
  if (st) return "fusedfp8 FP8 GEMM: cublasLtMatmul failed: " + status_text(st);
  return "";
}

// Runs fn() with `device`'s primary context current on this thread, restoring the previous one.
template <class Fn>
std::string on_device(int device, Fn fn) {
  ContextGuard ctx(device);
  if (!ctx.error().empty()) return ctx.error();
  return fn();
}

}  // namespace ff8::lt
