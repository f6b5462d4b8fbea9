// fusedfp8: one pass over memory that quantizes to FP8 and max-accumulates the amax, with an
// optional elementwise operation first (gelu, or dy * gelu'(x)) and, in the tiled kernel, the
// transposed copy and the column sums (dbias) from the same read.
//
// Template parameters: T = float | __half | __nv_bfloat16 (input), FMT = 0 (E4M3) | 1 (E5M2),
// OP = 0 identity | 1 gelu tanh | 2 gelu erf | 3 dgelu tanh | 4 dgelu erf (see common.cuh).
//
// Edge cases (the same table as reference.py):
//   x NaN          -> q = NaN (0x7f), amax = NaN (canonical 0x7fc00000, sorts above inf)
//   x +-inf        -> q = +-max (satfinite), amax = inf
//   |x*scale| > max-> q = +-max;  x*scale subnormal in FP8 -> kept, never flushed
//   0 elements     -> the host launches nothing; amax slot untouched
//   first step     -> see launch_scale() in common.cuh

#include "common.cuh"

using namespace ff8;

// ---------------------------------------------------------------------------------------------
// quantize_flat: any shape, seen as n contiguous elements.
// Grid: 1-D, min(ceil(n / (16 * FF8_THREADS)), 8 * SMs) blocks of FF8_THREADS threads, grid-
// stride. Vector path (VEC=true; x, b and q 16-byte aligned): each thread takes 16 elements per
// step, 2 independent 16-byte loads for 2-byte types (4 for float32) and one 16-byte store;
// the < 16-element tail is done element-wise by the last threads. VEC=false: element-wise.
// STORE=false is the first-step pre-pass: amax only, and only if *updates == 0.
// One atomicMax per block.
// ---------------------------------------------------------------------------------------------
template <typename T, int FMT, int OP, bool VEC, bool STORE>
__global__ void __launch_bounds__(FF8_THREADS) quantize_flat(
    const T* __restrict__ x,          // [n] input (dy for OP 3/4)
    const T* __restrict__ b,          // [n] second input (x for OP 3/4), else null
    u8* __restrict__ q,               // [n] FP8 output (bytes)
    const float* __restrict__ scale,  // [1] scale
    float* amax,                      // [1] amax slot, max-accumulated (NaN-propagating)
    float* scale_out,                 // [1] or null: first step writes the scale it used
    float* scale_inv_out,             // [1] or null: and its inverse
    const int* updates,               // [1] or null: first-step flag (0 = first step)
    i64 n,                            // number of elements
    float margin_factor)              // 2**margin, for the first-step scale
{
    if (!STORE && *updates != 0) return;  // pre-pass only runs on a first step
    float s = 1.0f;
    bool fresh = false;
    if (STORE) {
        fresh = launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, &s);
        if (fresh && blockIdx.x == 0 && threadIdx.x == 0 && scale_out != nullptr) {
            *scale_out = s;
            *scale_inv_out = fdiv(1.0f, s);
        }
    }
    u32 m = 0;
    const i64 tid = (i64)blockIdx.x * FF8_THREADS + threadIdx.x;
    const i64 nthreads = (i64)gridDim.x * FF8_THREADS;
    i64 done = 0;
    if (VEC) {
        const i64 nvec = n / 16;
        for (i64 i = tid; i < nvec; i += nthreads) {
            float v[16], w[16];
            load8<T>(x + i * 16, v);
            load8<T>(x + i * 16 + 8, v + 8);
            if (OP >= 3) {
                load8<T>(b + i * 16, w);
                load8<T>(b + i * 16 + 8, w + 8);
            }
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                float y = apply_op<OP>(v[j], OP >= 3 ? w[j] : 0.0f);
                m = max(m, abs_bits(y));
                v[j] = fmul(y, s);
            }
            if (STORE) {
                uint4 o;
                u64 lo = cvt8<FMT>(v), hi = cvt8<FMT>(v + 8);
                o.x = (u32)lo; o.y = (u32)(lo >> 32); o.z = (u32)hi; o.w = (u32)(hi >> 32);
                *reinterpret_cast<uint4*>(q + i * 16) = o;
            }
        }
        done = nvec * 16;
    }
    for (i64 i = done + tid; i < n; i += nthreads) {
        float y = apply_op<OP>(to_f32(x[i]), OP >= 3 ? to_f32(b[i]) : 0.0f);
        m = max(m, abs_bits(y));
        if (STORE) q[i] = cvt1<FMT>(fmul(y, s));
    }
    if (!fresh) block_amax_atomic<FF8_THREADS>(m, amax);  // on a first step the pre-pass already did it
}

// ---------------------------------------------------------------------------------------------
// quantize_tiled: x viewed as rows x cols (row-major). Writes q (rows x cols), optionally q_t
// (cols x rows, row-major: the transpose) and optionally dbias (column sums of the unquantized
// values, float32, deterministic: per-tile partial sums in fixed order, then the last tile of
// each column strip adds the partials in tile order).
// Tile: 64 rows x 64 cols. Block: 256 threads; grid: min(tiles, 4 * SMs), grid-stride over tiles.
// Load: thread t takes 8 consecutive elements of rows t/8 and t/8 + 32 (16-byte loads when
// `vec`), writes its 8 bytes of q and into a shared 64 x 72-byte tile. Transposed store: thread t
// writes 16 consecutive bytes of q_t row t/4 (one 16-byte store when rows % 16 == 0).
// Edge tiles are done element by element with bounds checks.
// One atomicMax per block.
// ---------------------------------------------------------------------------------------------
#define TILE 64
#define TILE_PITCH 72

template <typename T, int FMT, int OP>
__global__ void __launch_bounds__(256) quantize_tiled(
    const T* __restrict__ x,          // [rows, cols] input (dy for OP 3/4)
    const T* __restrict__ b,          // [rows, cols] second input (x for OP 3/4), else null
    u8* __restrict__ q,               // [rows, cols] FP8 output
    u8* __restrict__ q_t,             // [cols, rows] transposed FP8 output, or null
    float* __restrict__ dbias,        // [cols] column sums, or null
    float* __restrict__ partial,      // [ceil(rows/64), cols] workspace for dbias, or null
    int* __restrict__ strip_count,    // [ceil(cols/64)] zeroed counters for dbias, or null
    const float* __restrict__ scale,  // [1]
    float* amax,                      // [1] amax slot, max-accumulated
    float* scale_out,                 // [1] or null (first step)
    float* scale_inv_out,             // [1] or null (first step)
    const int* updates,               // [1] or null: first-step flag
    i64 rows, i64 cols,               // logical shape
    int vec,                          // 1: x, b, q 16-byte aligned and cols % 8 == 0
    int vec_t,                        // 1: q_t 16-byte aligned and rows % 16 == 0
    float margin_factor)              // 2**margin
{
    __shared__ __align__(16) u8 tile[TILE][TILE_PITCH];
    __shared__ float colsum[32][TILE + 1];
    __shared__ int is_last;
    float s;
    const bool fresh = launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, &s);
    if (fresh && blockIdx.x == 0 && threadIdx.x == 0 && scale_out != nullptr) {
        *scale_out = s;
        *scale_inv_out = fdiv(1.0f, s);
    }
    const i64 tiles_r = (rows + TILE - 1) / TILE, tiles_c = (cols + TILE - 1) / TILE;
    const int t = threadIdx.x, lr = t >> 3, lc = (t & 7) * 8;
    u32 m = 0;
    for (i64 tile_id = blockIdx.x; tile_id < tiles_r * tiles_c; tile_id += gridDim.x) {
        const i64 tr = tile_id / tiles_c, tc = tile_id % tiles_c;
        const i64 r0 = tr * TILE, c0 = tc * TILE;
        const bool full = r0 + TILE <= rows && c0 + TILE <= cols;
        float csum[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) csum[j] = 0.0f;
#pragma unroll
        for (int pass = 0; pass < 2; ++pass) {
            const int r = lr + pass * 32;
            const i64 gr = r0 + r;
            float v[8], w[8];
            u64 bytes = 0;
            if (full && vec) {
                const i64 off = gr * cols + c0 + lc;
                load8<T>(x + off, v);
                if (OP >= 3) load8<T>(b + off, w);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float y = apply_op<OP>(v[j], OP >= 3 ? w[j] : 0.0f);
                    m = max(m, abs_bits(y));
                    csum[j] = fadd(csum[j], y);
                    v[j] = fmul(y, s);
                }
                bytes = cvt8<FMT>(v);
                *reinterpret_cast<u64*>(q + off) = bytes;
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const i64 gc = c0 + lc + j;
                    u8 byte = 0;
                    if (gr < rows && gc < cols) {
                        const i64 off = gr * cols + gc;
                        float y = apply_op<OP>(to_f32(x[off]), OP >= 3 ? to_f32(b[off]) : 0.0f);
                        m = max(m, abs_bits(y));
                        csum[j] = fadd(csum[j], y);
                        byte = cvt1<FMT>(fmul(y, s));
                        q[off] = byte;
                    }
                    bytes |= (u64)byte << (8 * j);
                }
            }
            if (q_t != nullptr) *reinterpret_cast<u64*>(&tile[r][lc]) = bytes;
        }
        if (dbias != nullptr) {
            // Column sums of this tile in a fixed order: 32 row-pairs, then tile order.
#pragma unroll
            for (int j = 0; j < 8; ++j) colsum[lr][lc + j] = csum[j];
        }
        __syncthreads();
        if (q_t != nullptr) {
            const int tr_row = t >> 2, tr_col = (t & 3) * 16;  // q_t row (= x column), x rows
            const i64 gc = c0 + tr_row, gr = r0 + tr_col;
            u8 out[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) out[j] = tile[tr_col + j][tr_row];
            if (full && vec_t) {
                *reinterpret_cast<uint4*>(q_t + gc * rows + gr) = *reinterpret_cast<uint4*>(out);
            } else if (gc < cols) {
                for (int j = 0; j < 16; ++j)
                    if (gr + j < rows) q_t[gc * rows + gr + j] = out[j];
            }
        }
        if (dbias != nullptr) {
            if (t < TILE && c0 + t < cols) {
                float acc = 0.0f;
                for (int k = 0; k < 32; ++k) acc = fadd(acc, colsum[k][t]);
                partial[tr * cols + c0 + t] = acc;
            }
            __threadfence();
            __syncthreads();
            if (t == 0) is_last = atomicAdd(&strip_count[tc], 1) == (int)tiles_r - 1;
            __syncthreads();
            if (is_last) {
                __threadfence();
                if (t < TILE && c0 + t < cols) {
                    float acc = 0.0f;
                    for (i64 k = 0; k < tiles_r; ++k) acc = fadd(acc, __ldcg(&partial[k * cols + c0 + t]));
                    dbias[c0 + t] = acc;
                }
                if (t == 0) strip_count[tc] = 0;  // leave the counters zeroed for the next call
            }
        }
        __syncthreads();
    }
    if (!fresh) block_amax_atomic<256>(m, amax);
}
