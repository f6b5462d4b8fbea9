// fusedfp8: the delayed-scaling update for every tensor of a state in ONE launch; byte for byte
// the rule of fusedfp8/state.py::update_rule.
// Grid: one block of FF8_THREADS threads per tensor (column i of the history; rows are n floats
// apart). The block reduces max |history[1:, i]| (a max of bits: exact in any order) and rolls
// the column in parallel, in chunks whose reads all land before their writes (a __syncthreads
// between), so a 1024-row history costs a few memory round trips, not 1024 dependent ones.
// update_meta (out of place) reads each row once and writes it to its rolled place in the same
// pass (update_meta_column): one round trip and one barrier.
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

// update_meta (JAX): the same rule on a flax meta (fusedfp8/jax/meta.py), in the same launch as
// the meta's decoding and its counters' conversions, which XLA would otherwise run as separate
// kernels around the update (a decode fusion and two converts each way per module). The meta's
// counters are float32 (exact integers); a column whose marker writes[i] != 1 is decoded to a
// fresh one first (history zeros, scale 1, counters 0: meta.decode), on which the rule changes
// nothing but scale_inv = 1. Writes the counters both as the state's int32 (for the
// quantizations) and back as float32 (the output meta). Out of place: the meta is the step's
// input (a parameter XLA would copy before an in-place kernel), so every output element is
// written, the column copied where it does not roll.
// The out-of-place rule (update_meta's, after the decode): every thread reads the staging slot itself
// (nothing writes it in place) and each past row once, into the max and straight to its rolled place
// in hout (row r to row r - 1, or to row r where the column does not roll), so the column costs one
// read and one write of every row and one barrier (the max's), where the in-place roll below needs
// the max pass, then chunks that read before they write. The same outputs, bit for bit (a max of
// bits is exact in any order; the rows move unchanged).
__device__ __forceinline__ void update_meta_column(
    const float* __restrict__ hin, float* __restrict__ hout, float s, float* __restrict__ sout,
    float* __restrict__ siout, int ovf, int upd, int* __restrict__ oout, int* __restrict__ uout,
    const float* __restrict__ fmt_max, float* __restrict__ ofout, float* __restrict__ ufout, int n, int L,
    float margin_factor, int algo_max, u32* red)
{
    const int i = blockIdx.x, t = threadIdx.x;
    const float a = hin[i];
    const u32 abits = __float_as_uint(a) & 0x7fffffffu;
    const bool overflow = (abits & 0x7f800000u) == 0x7f800000u;  // NaN or inf
    const bool updated = !overflow && abits != 0u;                // (uniform over the block)
    const int shift = updated ? 1 : 0;                            // rolled: row r goes to row r - 1
    u32 amax = abits;
    for (int base = 1; base < L; base += FF8_THREADS * UPD_ROWS) {
        float v[UPD_ROWS];
#pragma unroll
        for (int k = 0; k < UPD_ROWS; ++k) {  // the loads first, all in flight
            const int r = base + k * FF8_THREADS + t;
            if (r < L) v[k] = hin[(i64)r * n + i];
        }
#pragma unroll
        for (int k = 0; k < UPD_ROWS; ++k) {
            const int r = base + k * FF8_THREADS + t;
            if (r < L) {
                if (updated && algo_max) amax = max(amax, __float_as_uint(v[k]) & 0x7fffffffu);
                if (r - shift >= 1) hout[(i64)(r - shift) * n + i] = v[k];  // (row 1 drops out of a roll)
            }
        }
    }
    if (updated) {
        if (algo_max) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            if ((t & 31) == 0) red[t >> 5] = amax;
            __syncthreads();
#pragma unroll
            for (int w = 0; w < FF8_THREADS / 32; ++w) amax = max(amax, red[w]);
        }
        s = scale_from_amax(__uint_as_float(amax), fmt_max[i], margin_factor);
    }
    if (t == 0) {
        const int o = ovf + (overflow ? 1 : 0), u = upd + (updated ? 1 : 0);
        oout[i] = o;
        uout[i] = u;
        ofout[i] = (float)o;
        ufout[i] = (float)u;
        if (updated && L > 1) hout[(i64)(L - 1) * n + i] = a;
        hout[i] = 0.0f;  // the staging slot is cleared in every case (a -0 included)
        sout[i] = s;
        siout[i] = fdiv(1.0f, s);
    }
}

// update_column: the rule for column blockIdx.x, from (hin, sin, counters in) to (hout, sout,
// siout, counters out); in place (update_scales) when hin == hout and sin == sout.
template <bool META>
__device__ __forceinline__ void update_column(
    const float* hin, float* hout, const float* sin, float* sout, float* __restrict__ siout,
    const int* oin, const int* uin, int* oout, int* uout, const float* __restrict__ fmt_max,
    const float* __restrict__ ofin, const float* __restrict__ ufin, float* __restrict__ ofout,
    float* __restrict__ ufout, const float* __restrict__ writes, int n, int L, float margin_factor, int algo_max)
{
    const int i = blockIdx.x;  // the tensor: every branch below is uniform over the block
    if (i >= n) return;
    const int t = threadIdx.x;
    __shared__ float a_sh;
    __shared__ u32 red[FF8_THREADS / 32];
    if (META && writes[i] != 1.0f) {  // decode: a fresh column (the rule then changes nothing but scale_inv)
        for (int r = t; r < L; r += FF8_THREADS) hout[(i64)r * n + i] = 0.0f;
        if (t == 0) {
            sout[i] = 1.0f;
            siout[i] = fdiv(1.0f, 1.0f);
            oout[i] = 0;
            uout[i] = 0;
            ofout[i] = 0.0f;
            ufout[i] = 0.0f;
        }
        return;
    }
    // every thread reads what thread 0 writes back in place before the barrier below
    const int ovf = META ? (int)ofin[i] : oin[i];  // (meta_to_state's astype(int32))
    const int upd = META ? (int)ufin[i] : uin[i];
    float s = sin[i];
    if (META) {  // out of place: one pass, every row read once (update_meta_column)
        update_meta_column(hin, hout, s, sout, siout, ovf, upd, oout, uout, fmt_max, ofout, ufout, n, L, margin_factor,
                           algo_max, red);
        return;
    }
    if (t == 0) a_sh = hin[i];  // read once: thread 0 clears the slot at the end
    __syncthreads();
    const float a = a_sh;
    const u32 abits = __float_as_uint(a) & 0x7fffffffu;  // |a|: -0 is 0 (not quantized this step)
    const bool overflow = (abits & 0x7f800000u) == 0x7f800000u;  // NaN or inf
    const bool updated = !overflow && abits != 0u;
    if (updated) {
        u32 amax = abits;  // max of |history| as bits (finite, non-negative: ordered as floats)
        if (algo_max) {
            for (int r = 1 + t; r < L; r += FF8_THREADS)
                amax = max(amax, __float_as_uint(hin[(i64)r * n + i]) & 0x7fffffffu);
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
                if (r < L - 1) v[k] = hin[(i64)(r + 1) * n + i];
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < UPD_ROWS; ++k) {
                const int r = base + k * FF8_THREADS + t;
                if (r < L - 1) hout[(i64)r * n + i] = v[k];
            }
        }
        __syncthreads();  // row L-1 was read by the last chunk
        if (t == 0 && L > 1) hout[(i64)(L - 1) * n + i] = a;
    } else if (hin != hout) {  // out of place: the past rows as they were
        for (int r = 1 + t; r < L; r += FF8_THREADS) hout[(i64)r * n + i] = hin[(i64)r * n + i];
    }
    if (t == 0) {
        const int o = ovf + (overflow ? 1 : 0), u = upd + (updated ? 1 : 0);
        oout[i] = o;
        uout[i] = u;
        if (META) {
            ofout[i] = (float)o;
            ufout[i] = (float)u;
        }
        hout[i] = 0.0f;  // the staging slot is cleared in every case (a -0 included)
        sout[i] = s;
        siout[i] = fdiv(1.0f, s);
    }
}

// The entry points.
extern "C" __global__ void __launch_bounds__(FF8_THREADS) update_scales(
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
    update_column<false>(history, history, scale, scale, scale_inv, overflows, updates, overflows, updates, fmt_max,
                         nullptr, nullptr, nullptr, nullptr, nullptr, n, L, margin_factor, algo_max);
}

extern "C" __global__ void __launch_bounds__(FF8_THREADS) update_meta(
    const float* __restrict__ history,      // [L, n] the meta's history
    const float* __restrict__ scale,        // [n] its scale
    const float* __restrict__ overflows_f,  // [n] its counters (float32)
    const float* __restrict__ updates_f,    // [n]
    const float* __restrict__ writes,       // [n] its marker (1: a valid column)
    const float* __restrict__ fmt_max,      // [n]
    float* __restrict__ history_out,        // [L, n] the state's, decoded and updated
    float* __restrict__ scale_out,          // [n]
    float* __restrict__ scale_inv_out,      // [n]
    int* __restrict__ overflows,            // [n] the state's counters (int32)
    int* __restrict__ updates,              // [n]
    float* __restrict__ overflows_f_out,    // [n] and the output meta's (float32)
    float* __restrict__ updates_f_out,      // [n]
    int n, int L, float margin_factor, int algo_max)
{
    update_column<true>(history, history_out, scale, scale_out, scale_inv_out, nullptr, nullptr, overflows, updates,
                        fmt_max, overflows_f, updates_f, overflows_f_out, updates_f_out, writes, n, L, margin_factor,
                        algo_max);
}
