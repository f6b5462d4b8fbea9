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
//     never libdevice's tanhf / erff / expf.
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
        if (v > 0x7f800000u) v = 0x7fc00000u;
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
#define FF8_LN2_HI 0x1.62e4p-1f
#define FF8_LN2_LO 0x1.7f7d1cp-20f
#define FF8_SQRT_2_OVER_PI 0x1.988454p-1f
#define FF8_GELU_C1 0x1.6e4e26p-5f
#define FF8_GELU_C3 0x1.12ba9ep-3f
#define FF8_INV_SQRT2 0x1.6a09e6p-1f
#define FF8_INV_SQRT_2PI 0x1.988454p-2f
#define FF8_ERFC_C0 0x1.43f89cp+0f
#define FF8_EXP_SHIFTER 0x1.8p+23f
#define FF8_TWO_M64 0x1p-64f
#define FF8_GELU_K -0x1.988454p+0f
#define FF8_RCP_C0 0x1.69696ap+0f
#define FF8_RCP_C1 0x1.e1e1e2p-2f
#define FF8_RCP_MAGIC 0x7EF311C7u

// e**a for a <= 0 (a few ulp above 0 also fine), branch-free: k = round(a log2 e) from one FMA with
// the shifter 1.5 * 2**23 (t holds k in its low bits, and t << 23 is k << 23), Cody-Waite reduction
// with FMA, degree-6 polynomial p, then p * 2**(k + 64) built from the bits (exact: a normal float
// for every k >= -126) times 2**-64 (one rounding, so a denormal result is right); 0 below -87.
__device__ __forceinline__ float exp_f32(float a) {
    const float t = ffma(a, FF8_LOG2E, FF8_EXP_SHIFTER);
    const float k = fsub(t, FF8_EXP_SHIFTER);
    float r = ffma(k, -FF8_LN2_HI, a);
    r = ffma(k, -FF8_LN2_LO, r);
    float p = 0x1.6c16c2p-10f;
    p = ffma(p, r, 0x1.111112p-7f);
    p = ffma(p, r, 0x1.555556p-5f);
    p = ffma(p, r, 0x1.555556p-3f);
    p = ffma(p, r, 0x1p-1f);
    p = ffma(p, r, 0x1p+0f);
    p = ffma(p, r, 0x1p+0f);
    const float y = fmul(__uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23) + (64u << 23)), FF8_TWO_M64);
    if (a < -87.0f) return 0.0f;  // (a select, after the arithmetic: no branch)
    return y;
}

// 1 / d for d in [1, 2]: the linear seed 24/17 - 8/17 d (within 1/17) and three Newton steps,
// FMA only (no division, no branch); within an ulp of the correctly rounded quotient.
__device__ __forceinline__ float rcp_1_2(float d) {
    float r = ffma(d, -FF8_RCP_C1, FF8_RCP_C0);
    float e = ffma(-d, r, 1.0f);
    r = ffma(r, e, r);
    e = ffma(-d, r, 1.0f);
    r = ffma(r, e, r);
    e = ffma(-d, r, 1.0f);
    return ffma(r, e, r);
}

// 1 / d for d in [1, 16): the integer seed 0x7EF311C7 - bits(d) (within 13%) and four Newton steps.
__device__ __forceinline__ float rcp_1_16(float d) {
    float r = __uint_as_float(FF8_RCP_MAGIC - __float_as_uint(d));
#pragma unroll
    for (int i = 0; i < 4; ++i) r = ffma(r, ffma(-d, r, 1.0f), r);
    return r;
}

// erfc(z), Numerical Recipes' Chebyshev fit; z < 0 (sign bit) through 2 - erfc(|z|). |z| is capped
// at 20 (erfc is 0 in float32 from about 10 on), so t = 1 / (1 + |z| / 2) needs no division.
__device__ __forceinline__ float erfc_f32(float z) {
    float a = fabs_bits(z);
    a = a > 20.0f ? 20.0f : a;
    float t = rcp_1_16(ffma(0.5f, a, 1.0f));
    float p = 0x1.5df28ap-3f;
    p = ffma(p, t, -0x1.a4f124p-1f);
    p = ffma(p, t, 0x1.7d0f6p+0f);
    p = ffma(p, t, -0x1.229cbap+0f);
    p = ffma(p, t, 0x1.1d8f98p-2f);
    p = ffma(p, t, -0x1.7d8498p-3f);
    p = ffma(p, t, 0x1.8c6d92p-4f);
    p = ffma(p, t, 0x1.7f11f6p-2f);
    p = ffma(p, t, 0x1.00018ep+0f);
    float e = fmul(t, exp_f32(fadd(ffma(-a, a, -FF8_ERFC_C0), fmul(p, t))));
    return sign_bit(z) ? fsub(2.0f, e) : e;
}

__device__ __forceinline__ float clamp_keep_nan(float x, float lim) {
    return x > lim ? lim : (x < -lim ? -lim : x);
}

// u = sqrt(2/pi) w with w = x + 0.044715 x^3, e = exp(-2|u|) (-2|u| = K|w|, K = -2 sqrt(2/pi):
// the same float as -2 * (sqrt(2/pi) w) rounded, one multiply less), d = 1 + e in [1, 2], r = 1 / d:
// 0.5 (1 + tanh u) = sel r with sel = (u >= 0 ? 1 : e); 0.5 (1 - tanh^2 u) = 2 e r^2.
struct SigmoidParts { float x2, e, r, sel; };
__device__ __forceinline__ SigmoidParts sigmoid_parts(float x) {
    SigmoidParts p;
    p.x2 = fmul(x, x);
    const float w = ffma(FF8_GELU_C1, fmul(p.x2, x), x);
    p.e = exp_f32(fmul(FF8_GELU_K, fabs_bits(w)));
    p.r = rcp_1_2(fadd(1.0f, p.e));
    p.sel = sign_bit(w) ? p.e : 1.0f;
    return p;
}
__device__ __forceinline__ float gelu_tanh(float x) {
    SigmoidParts p = sigmoid_parts(x);
    return fmul(fmul(x, p.sel), p.r);
}
__device__ __forceinline__ float gelu_erf(float x) {
    return fmul(fmul(0.5f, x), erfc_f32(fmul(-x, FF8_INV_SQRT2)));
}
__device__ __forceinline__ float dgelu_tanh(float x) {
    float xc = clamp_keep_nan(x, 20.0f);
    SigmoidParts p = sigmoid_parts(xc);
    float rd = p.r;
    float dudx = fmul(FF8_SQRT_2_OVER_PI, ffma(FF8_GELU_C3, p.x2, 1.0f));
    return ffma(fmul(fmul(fmul(fmul(2.0f, xc), p.e), rd), rd), dudx, fmul(p.sel, rd));
}
__device__ __forceinline__ float dgelu_erf(float x) {
    float xc = clamp_keep_nan(x, 40.0f);
    float pdf = fmul(exp_f32(fmul(-0.5f, fmul(xc, xc))), FF8_INV_SQRT_2PI);
    return ffma(xc, pdf, fmul(0.5f, erfc_f32(fmul(-xc, FF8_INV_SQRT2))));
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

}  // namespace ff8
