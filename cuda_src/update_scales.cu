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
#define META_CHECK 12  // meta cells per thread whose corruption check loads are issued early (3 x 1024 rows)
static_assert(FF8_THREADS % 32 == 0, "update_scales reduces whole warps");

// update_meta (JAX): the same rule on a flax meta (fusedfp8/jax/meta.py), in the same launch as
// the meta's decoding and its counters' conversions, which XLA would otherwise run as separate
// kernels around the update (a decode fusion and two converts each way per module). The meta's
// counters are float32 (exact integers); a column whose marker writes[i] != 1 is decoded to a
// fresh one first (history zeros, scale 1, counters 0: meta.decode), on which the rule changes
// nothing but scale_inv = 1. Writes the counters both as the state's int32 (for the
// quantizations) and back as float32 (the output meta). Out of place: the meta is the step's
// input (a parameter XLA would copy before an in-place kernel), so every output element is
// written, the column copied where it does not roll. A meta holding what no step writes
// (meta.corrupted: a negative amax in any row of any column, a counter or marker that is not a
// whole number >= 0: an optimizer updated it as a parameter) is refused in the same launch: NaN
// scales, so the step's outputs are NaN under jax.jit, where the refusal cannot raise.
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

// update_column: the rule for column blockIdx.x, in place (update_scales).
__device__ __forceinline__ void update_column(
    float* history, float* scale, float* __restrict__ scale_inv, int* overflows, int* updates,
    const float* __restrict__ fmt_max, int n, int L, float margin_factor, int algo_max)
{
    const int i = blockIdx.x;  // the tensor: every branch below is uniform over the block
    if (i >= n) return;
    const int t = threadIdx.x;
    __shared__ float a_sh;
    __shared__ u32 red[FF8_THREADS / 32];
    // every thread reads what thread 0 writes back in place before the barrier below
    const int ovf = overflows[i];
    const int upd = updates[i];
    float s = scale[i];
    if (t == 0) a_sh = history[i];  // read once: thread 0 clears the slot at the end
    __syncthreads();
    const float a = a_sh;
    const u32 abits = __float_as_uint(a) & 0x7fffffffu;  // |a|: -0 is 0 (not quantized this step)
    const bool overflow = (abits & 0x7f800000u) == 0x7f800000u;  // NaN or inf
    const bool updated = !overflow && abits != 0u;
    if (updated) {
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
        if (t == 0 && L > 1) history[(i64)(L - 1) * n + i] = a;
    }
    if (t == 0) {
        overflows[i] = ovf + (overflow ? 1 : 0);
        updates[i] = upd + (updated ? 1 : 0);
        history[i] = 0.0f;  // the staging slot is cleared in every case (a -0 included)
        scale[i] = s;
        scale_inv[i] = fdiv(1.0f, s);
    }
}

// A float32 meta counter or marker as a step writes it: a whole number >= 0 (meta.corrupted's
// test; NaN fails it, inf passes as jnp.floor(inf) == inf).
__device__ __forceinline__ bool whole(float v) { return v >= 0.0f && v == floorf(v); }

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
    update_column(history, scale, scale_inv, overflows, updates, fmt_max, n, L, margin_factor, algo_max);
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
    const int i = blockIdx.x;  // the tensor: every branch below is uniform over the block
    if (i >= n) return;
    const int t = threadIdx.x;
    __shared__ u32 red[FF8_THREADS / 32];
    // The corruption check (meta.corrupted) of the whole meta, which every column's block makes
    // itself: its first chunk of loads is in flight during the column's own work and compared
    // after it, so the check adds no round trip where the history fits the chunk.
    const i64 cells = (i64)L * n;
    float early[META_CHECK];
#pragma unroll
    for (int k = 0; k < META_CHECK; ++k) {
        const i64 e = t + (i64)k * FF8_THREADS;
        early[k] = e < cells ? history[e] : 0.0f;
    }
    if (writes[i] != 1.0f) {  // decode: a fresh column (the rule then changes nothing but scale_inv)
        for (int r = t; r < L; r += FF8_THREADS) history_out[(i64)r * n + i] = 0.0f;
        if (t == 0) {
            scale_out[i] = 1.0f;
            scale_inv_out[i] = fdiv(1.0f, 1.0f);
            overflows[i] = 0;
            updates[i] = 0;
            overflows_f_out[i] = 0.0f;
            updates_f_out[i] = 0.0f;
        }
    } else {  // (meta_to_state's astype(int32))
        update_meta_column(history, history_out, scale[i], scale_out, scale_inv_out, (int)overflows_f[i],
                           (int)updates_f[i], overflows, updates, fmt_max, overflows_f_out, updates_f_out, n, L,
                           margin_factor, algo_max, red);
    }
    bool bad = false;
#pragma unroll
    for (int k = 0; k < META_CHECK; ++k) bad |= early[k] < 0.0f;
    for (i64 e = t + (i64)META_CHECK * FF8_THREADS; e < cells; e += FF8_THREADS) bad |= history[e] < 0.0f;
    for (int c = t; c < n; c += FF8_THREADS) bad |= !whole(overflows_f[c]) || !whole(updates_f[c]) || !whole(writes[c]);
    // Refused: NaN scales, so that this step's casts and GEMM outputs are NaN, and an int32 update
    // count of at least 1, so that no quantization takes its first-step scale from its own amax
    // instead. Thread 0 overwrites what it wrote itself above.
    if (__syncthreads_or(bad) && t == 0) {
        scale_out[i] = __uint_as_float(0x7fc00000u);
        scale_inv_out[i] = __uint_as_float(0x7fc00000u);
        updates[i] = max(updates[i], 1);
    }
}
