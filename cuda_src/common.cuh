// fusedfp8 shared device helpers.
//
// Bit-exactness with fusedfp8/reference.py rests on three rules kept everywhere below:
//  1. every float32 operation on the numeric path is an inline-PTX instruction with explicit
//     rounding (mul.rn / add.rn / sub.rn / div.rn / fma.rn / cvt.rni). CuPy compiles with
//     -ftz=true and NVCC contracts a*b+c into FMA; neither applies to inline PTX, so denormals
//     are kept and each operation rounds once, exactly as NumPy's float32 arithmetic does (the
//     reference emulates fma.rn exactly: reference.fma_f32);
//  2. comparisons that could see a denormal are done on the bit pattern;
//  3. the activation uses the library's own exp / erfc (the same op sequence as the reference),
//     never libdevice's tanhf / erff / expf. The one hardware approximation used, rcp.approx in
//     rcp_f32, is followed by the Newton step that makes the result the correctly rounded 1 / d
//     (rcp.rn.f32's own fast path), so no approximate bits reach a result.
// Tunables (-D on the command line): FF8_THREADS (threads per block).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#ifndef FF8_THREADS
#define FF8_THREADS 256
#endif

namespace ff8 {

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// ---- float32 arithmetic with one explicit rounding and no flush-to-zero -------------------
__device__ __forceinline__ float fmul(float a, float b) {
    float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float fadd(float a, float b) {
    float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float fsub(float a, float b) {
    float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float fdiv(float a, float b) {
    float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float ffma(float a, float b, float c) {
    float r; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c)); return r;
}
__device__ __forceinline__ float fsqrt(float a) {
    float r; asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r;
}
__device__ __forceinline__ float frint(float a) {
    float r; asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a)); return r;
}
__device__ __forceinline__ float fabs_bits(float a) { return __uint_as_float(__float_as_uint(a) & 0x7fffffffu); }
__device__ __forceinline__ bool sign_bit(float a) { return (__float_as_uint(a) >> 31) != 0u; }
__device__ __forceinline__ float copysign_bits(float mag, float sgn) {
    return __uint_as_float((__float_as_uint(mag) & 0x7fffffffu) | (__float_as_uint(sgn) & 0x80000000u));
}

// ---- input element -> float32 (exact; no arithmetic, so no flush) -------------------------
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) {
    return __uint_as_float(((u32)__bfloat16_as_ushort(v)) << 16);
}

// ---- float32 -> output element (round to nearest even) ------------------------------------
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

template <typename T> __device__ __forceinline__ T canonical_nan();
template <> __device__ __forceinline__ float canonical_nan<float>() { return __uint_as_float(0x7fc00000u); }
template <> __device__ __forceinline__ __half canonical_nan<__half>() { return __ushort_as_half(0x7e00); }
template <> __device__ __forceinline__ __nv_bfloat16 canonical_nan<__nv_bfloat16>() {
    return __ushort_as_bfloat16(0x7fc0);
}

// ---- FP8 cast: cvt.rn.satfinite (RNE, saturate finite and inf to +-max, NaN -> NaN) -------
// FMT: 0 = E4M3 (float8_e4m3fn), 1 = E5M2.
template <int FMT> __device__ __forceinline__ unsigned short cvt2(float a, float b) {
    return (unsigned short)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE,
                                                     FMT == 0 ? __NV_E4M3 : __NV_E5M2);
}
template <int FMT> __device__ __forceinline__ u8 cvt1(float a) {
    return (u8)__nv_cvt_float_to_fp8(a, __NV_SATFINITE, FMT == 0 ? __NV_E4M3 : __NV_E5M2);
}
template <int FMT> __device__ __forceinline__ float fp8_to_f32(u8 b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, FMT == 0 ? __NV_E4M3 : __NV_E5M2);
    return __half2float(__half(h));
}
template <int FMT> struct FormatMax;
template <> struct FormatMax<0> { static constexpr float value = 448.0f; };
template <> struct FormatMax<1> { static constexpr float value = 57344.0f; };

// ---- amax as ordered bits ------------------------------------------------------------------
// |x| as uint32 orders like the float for non-negative values, and every NaN sorts above inf, so
// the running max of the magnitudes is the amax (NaN-propagating) with one instruction an element.
__device__ __forceinline__ u32 abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }
// The running amax of a thread, as the bits of max |y|. For an activation (OP > 0) a float max.NaN(m, |y|):
// one FMNMX.NAN, |y| an operand modifier, where the bits take two (LOP3, VIMNMX); for the identity the
// bits (the mask folds into the bf16 / half unpacking and ptxas pairs the maxima into VIMNMX3). Exact,
// denormals kept, a NaN sticks (possibly with the sign bit: every NaN pattern sorts above inf as bits).
template <int OP> __device__ __forceinline__ u32 amax_update(u32 m, float y) {
    if (OP == 0) return max(m, abs_bits(y));
    float r;
    asm("{ .reg .f32 a; abs.f32 a, %2; max.NaN.f32 %0, %1, a; }" : "=f"(r) : "f"(__uint_as_float(m)), "f"(y));
    return __float_as_uint(r);
}

// Max over the block, then ONE atomicMax into dst (a float32 slot viewed as uint32). A NaN is
// canonicalised (0x7fc00000) once here, so the stored amax is one fixed pattern. A slot that holds
// -0 (bits 0x80000000, above every amax) is first turned into +0: -0 behaves as 0. THREADS bounds
// the block size; `warps` is the block's actual warp count when it launches with fewer threads.
template <int THREADS> __device__ __forceinline__ void block_amax_atomic(u32 v, float* dst,
                                                                          int warps = THREADS / 32) {
    __shared__ u32 warp_max[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? warp_max[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (v > 0x7f800000u) v = 0x7fc00000u;  // (any NaN, also one with the sign bit)
        if (lane == 0) {
            u32* slot = reinterpret_cast<u32*>(dst);
            atomicCAS(slot, 0x80000000u, 0u);  // a slot holding -0 holds 0 (its bits would outrank every amax),
            if (v != 0u) atomicMax(slot, v);    // also when this block's amax is 0
        }
    }
}

// ---- the update rule's scale formula: (fmt_max / amax) / margin_factor, FLT_MAX if inf ------
__device__ __forceinline__ float scale_from_amax(float amax, float fmt_max, float margin_factor) {
    float s = fdiv(fdiv(fmt_max, amax), margin_factor);
    return __float_as_uint(s) == 0x7f800000u ? 3.402823466e38f : s;
}

// Scale used by a quantization launch. Normally *scale. In first-step mode (updates != null,
// *updates == 0: the tensor has never completed an update) it is computed from the tensor's
// own amax, which a pre-pass has already max-accumulated into *amax; amax 0 or non-finite
// keeps *scale. Returns whether first-step mode applied.
__device__ __forceinline__ bool launch_scale(const float* scale, const float* amax, const int* updates,
                                             float fmt_max, float margin_factor, float* s_out) {
    float s = *scale;
    bool fresh = updates != nullptr && *updates == 0;
    if (fresh) {
        u32 a = __float_as_uint(*amax);
        if (a != 0u && a < 0x7f800000u) s = scale_from_amax(__uint_as_float(a), fmt_max, margin_factor);
    }
    *s_out = s;
    return fresh;
}

// Block 0, thread 0 of a quantize launch: a first step stores the scale it chose (and its
// inverse) into the state; every launch may also hand out 1 / s in a separate, aligned 1-float
// output, the operand scale of the GEMM that consumes the FP8 data (bitwise the state's
// scale_inv, which the update also computes as fdiv(1, s)).
__device__ __forceinline__ void publish_scale(bool fresh, float s, float* scale_out, float* scale_inv_out,
                                              float* scale_inv_used) {
    const float inv = fdiv(1.0f, s);
    if (fresh && scale_out != nullptr) {
        *scale_out = s;
        *scale_inv_out = inv;
    }
    if (scale_inv_used != nullptr) *scale_inv_used = inv;
}

// ---- the library's own exp / erfc / gelu (op for op as in reference.py) --------------------
#define FF8_LOG2E 0x1.715476p+0f
#define FF8_LOG2E_LO 0x1.4ae0c0p-26f
#define FF8_EXP_SHIFTER 0x1.8p+23f
#define FF8_GELU_X_MAX 0x1.3cp+3f
#define FF8_GELU_K2 -0x1.26aec2p+1f
#define FF8_GELU_KC1 -0x1.a5a7d0p-4f
#define FF8_GELU_M0 0x1.988454p+0f
#define FF8_GELU_M3 0x1.b6676cp-3f
#define FF8_ERFC_T_SCALE 0x1.6a09e6p-2f
#define FF8_INV_SQRT_2PI 0x1.988454p-2f

// min / max that keep a NaN operand (max.NaN: one FMNMX.NAN), and a min that drops it (FMNMX: the
// other operand), no flush-to-zero either way.
__device__ __forceinline__ float fmin_nan(float a, float b) {
    float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float fmin_num(float a, float b) {
    float r; asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}

// 1 / d correctly rounded for d in [1, 2**126): the hardware seed (rcp.approx) and one Newton step.
// This is rcp.rn.f32's own fast path on sm_90 (ptxas emits MUFU.RCP, FFMA, FFMA behind a range check
// that every such d passes), so the bits are IEEE's and NumPy's f32(1) / d; without the check and its
// out-of-line slow path it is 3 instructions instead of about 10 (tests/kernels: every d checked).
__device__ __forceinline__ float rcp_f32(float d) {
    float y; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
    return ffma(y, ffma(-d, y, 1.0f), y);
}

// p(f) ~ 2**f for |f| <= 1/2 (degree-5 minimax, 1.94 ulp), times 2**k: t is the shifter sum that
// holds k in its low bits, so (t << 23) is k << 23, added to the bits of p (one LEA; exact while the
// result is a normal float).
__device__ __forceinline__ float pow2_poly(float f, float t) {
    float p = 0x1.5bba0cp-10f;
    p = ffma(p, f, 0x1.3cea88p-7f);
    p = ffma(p, f, 0x1.c6b74ap-5f);
    p = ffma(p, f, 0x1.ebf9c6p-3f);
    p = ffma(p, f, 0x1.62e42ap-1f);
    p = ffma(p, f, 0x1p+0f);
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
}

// 2**(q x) for q x in [-125, 125] (the product unrounded), branch-free: t = fma(q, x, 1.5 * 2**23) rounds
// q x to an integer k (in t's low bits), f = fma(q, x, -k) in [-1/2, 1/2]; outside the range the bits
// mean nothing.
__device__ __forceinline__ float exp2_product(float q, float x) {
    const float t = ffma(q, x, FF8_EXP_SHIFTER);
    return pow2_poly(ffma(q, x, -fsub(t, FF8_EXP_SHIFTER)), t);
}

// e**(s a) for s a <= 0 (a few ulp above 0 also fine), s = 1 or -1/2 (HALF; folded exactly into the
// constants), as 2**(s a log2 e): k from one FMA with the shifter, f = s a log2 e - k from two FMAs
// with log2 e split in two floats (error below 2**-25); 0 where s a < -87 (above, a normal float).
template <bool HALF = false> __device__ __forceinline__ float exp_f32(float a) {
    constexpr float s = HALF ? -0.5f : 1.0f;
    const float t = ffma(a, s * FF8_LOG2E, FF8_EXP_SHIFTER);
    const float y = pow2_poly(ffma(a, s * FF8_LOG2E_LO, ffma(a, s * FF8_LOG2E, -fsub(t, FF8_EXP_SHIFTER))), t);
    if (HALF ? a > 174.0f : a < -87.0f) return 0.0f;  // (a select, after the arithmetic: no branch)
    return y;
}

// erfc(|x| / sqrt 2) = t R(t) exp(-x^2 / 2) for ax = |x| <= 40 (the caller caps it; a NaN stays NaN), with
// t = 1 / (1 + ax / (2 sqrt 2)) in [0.066, 1] and R of degree 8, a relative minimax fit of erfcx(a) / t, a =
// ax / sqrt 2 (4.3e-8 on t >= 0.16, where erfc is a normal float; R(1) = 1 exactly); E = exp(-x^2 / 2) comes
// from the caller (the erf gelu' shares it with the pdf).
__device__ __forceinline__ float erfc_of_abs(float ax, float E) {
    const float t = rcp_f32(ffma(ax, FF8_ERFC_T_SCALE, 1.0f));
    float p = -0x1.e4e962p-5f;
    p = ffma(p, t, 0x1.240704p-2f);
    p = ffma(p, t, -0x1.f42f34p-2f);
    p = ffma(p, t, 0x1.1e38aep-2f);
    p = ffma(p, t, -0x1.c4968ap-6f);
    p = ffma(p, t, 0x1.9ff82cp-3f);
    p = ffma(p, t, 0x1.f1a830p-3f);
    p = ffma(p, t, 0x1.212adcp-2f);
    p = ffma(p, t, 0x1.20db0ap-2f);
    return fmul(fmul(t, p), E);
}
// erfc(-x / sqrt 2) = 2 erf cdf: 2 - erfc(|x| / sqrt 2) for x >= 0 (sign bit clear), erfc(|x| / sqrt 2) otherwise
__device__ __forceinline__ float erfc_neg(float x, float e) { return sign_bit(x) ? e : fsub(2.0f, e); }

__device__ __forceinline__ float clamp_keep_nan(float x, float lim) { return fmax_nan(fmin_nan(x, lim), -lim); }

// 0.5 (1 + tanh u) = r = 1 / (1 + E), E = 2**(q xc), q = K2 + KC1 xc^2: q xc = -2 u log2 e for u = sqrt(2/pi)
// (xc + 0.044715 xc^3). xc is x clamped (by the caller) to at most X_MAX = 9.875, where E < 2**-121 and r
// is 1 (and above -X_MAX where x is not: E stays below 2**122); r is 0 for x < -X_MAX (below 2**-121).
struct SigmoidParts { float x2, e, r; };
__device__ __forceinline__ SigmoidParts sigmoid_parts(float xc, float x) {
    SigmoidParts p;
    p.x2 = fmul(xc, xc);
    p.e = exp2_product(ffma(p.x2, FF8_GELU_KC1, FF8_GELU_K2), xc);
    const float r = rcp_f32(fadd(1.0f, p.e));
    p.r = x < -FF8_GELU_X_MAX ? 0.0f : r;
    return p;
}
// x r, xc = min(x, X_MAX) (a NaN x gives a number there and NaN through x)
__device__ __forceinline__ float gelu_tanh(float x) { return fmul(x, sigmoid_parts(fmin_num(x, FF8_GELU_X_MAX), x).r); }
// 0.5 x erfc(-x / sqrt 2), |x| capped at 40 inside erfc (exp(-x^2 / 2) is 0 from 18.7 on)
__device__ __forceinline__ float gelu_erf(float x) {
    const float e = erfc_of_abs(fmin_nan(fabs_bits(x), 40.0f), exp_f32<true>(fmul(x, x)));
    return fmul(fmul(0.5f, x), erfc_neg(x, e));
}
// d/dx = r + x (2 E r^2) du/dx = r (1 + (x M) (E r)), M = 2 du/dx = M0 + M3 x^2 (0.5 (1 - tanh^2 u) = 2 E r^2);
// x clamped to +-X_MAX (NaN kept), where the float32 result is 1, or 0 by the select.
__device__ __forceinline__ float dgelu_tanh(float x) {
    const float xc = clamp_keep_nan(x, FF8_GELU_X_MAX);
    const SigmoidParts p = sigmoid_parts(xc, x);
    return fmul(ffma(fmul(xc, ffma(p.x2, FF8_GELU_M3, FF8_GELU_M0)), fmul(p.e, p.r), 1.0f), p.r);
}
__device__ __forceinline__ float dgelu_erf(float x) {
    const float xc = clamp_keep_nan(x, 40.0f);
    const float E = exp_f32<true>(fmul(xc, xc));
    return ffma(xc, fmul(E, FF8_INV_SQRT_2PI), fmul(0.5f, erfc_neg(xc, erfc_of_abs(fabs_bits(xc), E))));
}

// The elementwise operation before quantization. OP: 0 identity, 1 gelu (tanh), 2 gelu (erf),
// 3 dy * gelu'(x) (tanh), 4 dy * gelu'(x) (erf). `a` is x (or dy), `b` is x for OP 3/4.
template <int OP> __device__ __forceinline__ float apply_op(float a, float b) {
    if (OP == 0) return a;
    if (OP == 1) return gelu_tanh(a);
    if (OP == 2) return gelu_erf(a);
    if (OP == 3) return fmul(a, dgelu_tanh(b));
    return fmul(a, dgelu_erf(b));
}

// Quantize 8 floats (already multiplied by the scale) into 8 bytes.
template <int FMT> __device__ __forceinline__ u64 cvt8(const float* v) {
    u64 r = 0;
#pragma unroll
    for (int j = 0; j < 8; j += 2) r |= (u64)cvt2<FMT>(v[j], v[j + 1]) << (8 * j);
    return r;
}

// A 16-byte load through the read-only path, as written (volatile: issued where it stands, so the
// next step's loads are in flight while this step computes).
__device__ __forceinline__ uint4 ldg_nc16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// ---- the 128 x 64-byte shared tile of the tiled kernels (quantize_tiled, transpose_fp8) ---------
#define TILE_R 128  // the tile (fusedfp8/launch/plans.py TILE_R, TILE_C)
#define TILE_C 64

// Byte offset of tile element (r, c) in the swizzled 128 x 64 shared tile (quantize_tiled's header):
// 16-byte chunks permuted within a row, so that the row stores and the transposed reads are conflict-free.
__device__ __forceinline__ int tile_at(int r, int c) {
    return 64 * r + 16 * ((c >> 4) ^ ((r >> 4) & 3)) + 8 * (((c >> 3) & 1) ^ ((r >> 6) & 1)) + (c & 7);
}

// What thread t reads of a tile for the transposed store: tile rows 16 rm..+15, the word of columns
// 4 (cp / 2)..+3 at each (rd_base + 64 i), bytes kb and kb + 1 of it (columns 2 cp and 2 cp + 1).
struct TileLanes { int rm, cp, kb, rd_base; };
__device__ __forceinline__ TileLanes tile_lanes(int t) {
    const int lane = t & 31, rm = lane & 7, cp = (t >> 5) * 4 + (lane >> 3);
    return TileLanes{rm, cp, 2 * (cp & 1), tile_at(16 * rm, 4 * (cp >> 1))};
}

// The tile tl (rows r0.., columns c0.. of a prows x pcols FP8 array) written transposed into q_t (pcols x
// prows): 16 4-byte reads a thread, byte_perm, and one 16-byte store per column (t16: q_t 16-byte aligned
// and prows % 16 == 0, so a 16-row group lies wholly inside prows or wholly past it; else byte stores
// within bounds). 8 lanes write one full 128-byte line of q_t, a warp store 4 lines.
__device__ __forceinline__ void store_tile_t(const u8* tl, u8* __restrict__ q_t, const TileLanes& L, i64 r0, i64 c0,
                                             i64 prows, i64 pcols, bool t16) {
    u32 wd[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) wd[i] = *reinterpret_cast<const u32*>(tl + L.rd_base + 64 * i);
    const i64 gr = r0 + 16 * L.rm;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const u32 sel = (u32)(L.kb + k) | ((u32)(L.kb + k + 4) << 4);  // byte kb + k of two words
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            o[i] = __byte_perm(__byte_perm(wd[4 * i], wd[4 * i + 1], sel), __byte_perm(wd[4 * i + 2], wd[4 * i + 3], sel),
                               0x5410);
        const i64 gc = c0 + 2 * L.cp + k;
        if (t16 && gc < pcols && gr < prows) {  // (gr % 16 == 0 == prows % 16: all 16 inside)
            *reinterpret_cast<uint4*>(q_t + gc * prows + gr) = make_uint4(o[0], o[1], o[2], o[3]);
        } else if (gc < pcols) {
#pragma unroll
            for (int i = 0; i < 16; ++i)
                if (gr + i < prows) q_t[gc * prows + gr + i] = (u8)(o[i >> 2] >> (8 * (i & 3)));
        }
    }
}

}  // namespace ff8
