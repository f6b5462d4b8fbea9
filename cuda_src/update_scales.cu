// fusedfp8: the delayed-scaling update for every tensor of a state in ONE launch; byte for byte
// the rule of fusedfp8/state.py::update_rule.
// Grid: one block of FF8_THREADS threads per tensor (column i of the history; rows are n floats
// apart). The block reduces max |history[1:, i]| (a max of bits: exact in any order) and rolls
// the column in parallel, in chunks whose reads all land before their writes (a __syncthreads
// between), so a 1024-row history costs a few memory round trips, not 1024 dependent ones.
// Per tensor, a = history[0, i] (bits, so a denormal amax counts as seen):
//   a NaN or inf  -> overflow: overflows += 1, history[0, i] = 0, scale kept, no roll
//   a == 0 (+-0)  -> not quantized this step: nothing changes (a -0 slot is cleared to +0)
//   otherwise     -> amax = max |history[:, i]| (algo_max) or |a|; scale = fmt_max / amax / 2**margin,
//                    FLT_MAX if that is inf (tiny amax); the column rolls by -1 (a moves to the
//                    last row, the oldest past row is dropped), history[0, i] = 0; updates += 1
//   always        -> scale_inv = 1 / scale

#include "common.cuh"

using namespace ff8;

#define UPD_ROWS 4  // rows per thread per roll chunk
static_assert(FF8_THREADS % 32 == 0, "update_scales reduces whole warps");

__device__ __forceinline__ void update_scales_body(
    float* __restrict__ history,        // [L, n] amax history; row 0 is the staging slot
    float* __restrict__ scale,          // [n]
    float* __restrict__ scale_inv,      // [n]
    int* __restrict__ overflows,        // [n]
    int* __restrict__ updates,          // [n]
    const float* __restrict__ fmt_max,  // [n] max of each tensor's FP8 format
    int n,                              // tensors
    int L,                              // history rows
    float margin_factor,                // 2**margin
    int algo_max)                       // 1: 'max', 0: 'most_recent'
{
    const int i = blockIdx.x;  // the tensor: every branch below is uniform over the block
    if (i >= n) return;
    const int t = threadIdx.x;
    __shared__ float a_sh;
    __shared__ u32 red[FF8_THREADS / 32];
    if (t == 0) a_sh = history[i];  // read once: thread 0 clears the slot at the end
    __syncthreads();
    const float a = a_sh;
    const u32 abits = __float_as_uint(a) & 0x7fffffffu;  // |a|: -0 is 0 (not quantized this step)
    float s = scale[i];
    const bool overflow = (abits & 0x7f800000u) == 0x7f800000u;  // NaN or inf
    if (!overflow && abits != 0u) {
        u32 amax = abits;  // max of |history| as bits (finite, non-negative: ordered as floats)
        if (algo_max) {
            for (int r = 1 + t; r < L; r += FF8_THREADS)
                amax = max(amax, __float_as_uint(history[(i64)r * n + i]) & 0x7fffffffu);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            if ((t & 31) == 0) red[t >> 5] = amax;
            __syncthreads();  // also: every read of the max lands before the roll writes
#pragma unroll
            for (int w = 0; w < FF8_THREADS / 32; ++w) amax = max(amax, red[w]);
        }
        s = scale_from_amax(__uint_as_float(amax), fmt_max[i], margin_factor);
        // roll: row r <- row r + 1 for r = 1 .. L-2, row L-1 <- a, row 0 <- 0. A chunk writes rows
        // [base, base + C) after reading rows [base + 1, base + C]; the next chunk writes row
        // base + C only after its own barrier, which every reader of this chunk has passed.
        for (int base = 1; base < L - 1; base += FF8_THREADS * UPD_ROWS) {
            float v[UPD_ROWS];
#pragma unroll
            for (int k = 0; k < UPD_ROWS; ++k) {
                const int r = base + k * FF8_THREADS + t;
                if (r < L - 1) v[k] = history[(i64)(r + 1) * n + i];
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < UPD_ROWS; ++k) {
                const int r = base + k * FF8_THREADS + t;
                if (r < L - 1) history[(i64)r * n + i] = v[k];
            }
        }
        __syncthreads();  // row L-1 was read by the last chunk
        if (t == 0) {
            if (L > 1) history[(i64)(L - 1) * n + i] = a;
            scale[i] = s;
            updates[i] += 1;
        }
    } else if (overflow && t == 0) {
        overflows[i] += 1;
    }
    if (t == 0) {
        history[i] = 0.0f;  // the staging slot is cleared in every case (a -0 included)
        scale_inv[i] = fdiv(1.0f, s);
    }
}

// The kernel (its body a device function, as quantize_flat's in quantize.cu).
extern "C" __global__ void __launch_bounds__(FF8_THREADS) update_scales(
    float* __restrict__ history, float* __restrict__ scale, float* __restrict__ scale_inv, int* __restrict__ overflows,
    int* __restrict__ updates, const float* __restrict__ fmt_max, int n, int L, float margin_factor, int algo_max) {
    update_scales_body(history, scale, scale_inv, overflows, updates, fmt_max, n, L, margin_factor, algo_max);
}
