// fusedfp8: the delayed-scaling update for every tensor of a state in ONE launch; byte for byte
// the rule of fusedfp8/state.py::update_rule.
// Grid: ceil(n / 128) blocks of 128 threads; thread i owns column i of the history (rows are
// n floats apart, so a warp's accesses are coalesced) and walks it 8 rows at a time.
// Per tensor, a = history[0, i] (bits, so a denormal amax counts as seen):
//   a NaN or inf  -> overflow: overflows += 1, history[0, i] = 0, scale kept, no roll
//   a == 0 (+-0)  -> not quantized this step: nothing changes (a -0 slot is cleared to +0)
//   otherwise     -> amax = max |history[:, i]| (algo_max) or |a|; scale = fmt_max / amax / 2**margin,
//                    FLT_MAX if that is inf (tiny amax); the column rolls by -1 (a moves to the
//                    last row, the oldest past row is dropped), history[0, i] = 0; updates += 1
//   always        -> scale_inv = 1 / scale

#include "common.cuh"

using namespace ff8;

extern "C" __global__ void __launch_bounds__(128) update_scales(
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
    const int i = blockIdx.x * 128 + threadIdx.x;
    if (i >= n) return;
    const float a = history[i];
    const u32 abits = __float_as_uint(a) & 0x7fffffffu;  // |a|: -0 is 0 (not quantized this step)
    float s = scale[i];
    if ((abits & 0x7f800000u) == 0x7f800000u) {  // NaN or inf: overflow
        overflows[i] += 1;
    } else if (abits != 0u) {
        u32 amax = abits;  // max of |history| as bits (finite, non-negative: ordered as floats)
        if (algo_max) {
            int r = 1;
            for (; r + 8 <= L; r += 8) {
                u32 v[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) v[k] = __float_as_uint(history[(i64)(r + k) * n + i]) & 0x7fffffffu;
#pragma unroll
                for (int k = 0; k < 8; ++k) amax = max(amax, v[k]);
            }
            for (; r < L; ++r) amax = max(amax, __float_as_uint(history[(i64)r * n + i]) & 0x7fffffffu);
        }
        s = scale_from_amax(__uint_as_float(amax), fmt_max[i], margin_factor);
        // roll: row r <- row r + 1 for r = 1 .. L-2, row L-1 <- a, row 0 <- 0
        int r = 1;
        for (; r + 8 <= L - 1; r += 8) {
            float v[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = history[(i64)(r + k + 1) * n + i];
#pragma unroll
            for (int k = 0; k < 8; ++k) history[(i64)(r + k) * n + i] = v[k];
        }
        for (; r < L - 1; ++r) history[(i64)r * n + i] = history[(i64)(r + 1) * n + i];
        if (L > 1) history[(i64)(L - 1) * n + i] = a;
        scale[i] = s;
        updates[i] += 1;
    }
    history[i] = 0.0f;  // the staging slot is cleared in every case (a -0 included)
    scale_inv[i] = fdiv(1.0f, s);
}
