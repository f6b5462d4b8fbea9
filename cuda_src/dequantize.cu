// fusedfp8: dequantize. out = TOut(float32(q) * scale_inv), element-wise, any shape seen as
// n contiguous bytes. TOut = float | __half | __nv_bfloat16; FMT = 0 (E4M3) | 1 (E5M2).
// Grid: 1-D, min(ceil(n / (16 * FF8_THREADS)), 8 * SMs) blocks of FF8_THREADS, grid-stride.
// Vector path (vec = 1: q and out 16-byte aligned): 16 bytes in, 16 elements out per step.
// Edge cases: NaN byte -> the output type's canonical NaN (float 0x7fc00000, half 0x7e00,
// bfloat16 0x7fc0: the hardware's NaN payloads differ from NumPy's, so both sides write the
// canonical one); E5M2 inf byte -> inf; scale_inv subnormal kept (no flush).

#include "common.cuh"

using namespace ff8;

template <typename TOut, int FMT> __device__ __forceinline__ TOut dequant1(u8 b, float si) {
    float v = fmul(fp8_to_f32<FMT>(b), si);
    return v != v ? canonical_nan<TOut>() : from_f32<TOut>(v);
}

template <typename TOut, int FMT>
__global__ void __launch_bounds__(FF8_THREADS) dequantize_flat(
    const u8* __restrict__ q,             // [n] FP8 bytes
    TOut* __restrict__ out,               // [n] output
    const float* __restrict__ scale_inv,  // [1]
    i64 n,                                // number of elements
    int vec)                              // 1: 16-byte aligned pointers
{
    const float si = *scale_inv;
    const i64 tid = (i64)blockIdx.x * FF8_THREADS + threadIdx.x;
    const i64 nthreads = (i64)gridDim.x * FF8_THREADS;
    i64 done = 0;
    if (vec) {
        const i64 nvec = n / 16;
        for (i64 i = tid; i < nvec; i += nthreads) {
            uint4 in = __ldg(reinterpret_cast<const uint4*>(q) + i);
            const u8* bytes = reinterpret_cast<const u8*>(&in);
            __align__(16) TOut o[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) o[j] = dequant1<TOut, FMT>(bytes[j], si);
            uint4* dst = reinterpret_cast<uint4*>(out + i * 16);
#pragma unroll
            for (int k = 0; k < (int)(16 * sizeof(TOut) / 16); ++k) dst[k] = reinterpret_cast<uint4*>(o)[k];
        }
        done = nvec * 16;
    }
    for (i64 i = done + tid; i < n; i += nthreads) out[i] = dequant1<TOut, FMT>(q[i], si);
}
