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
    float* scale_inv_used,            // [1] or null: 1 / the scale this launch used (any step)
    const int* updates,               // [1] or null: first-step flag (0 = first step)
    i64 n,                            // number of elements
    float margin_factor)              // 2**margin, for the first-step scale
{
    if (!STORE && *updates != 0) return;  // pre-pass only runs on a first step
    float s = 1.0f;
    bool fresh = false;
    if (STORE) {
        fresh = launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, &s);
        if (blockIdx.x == 0 && threadIdx.x == 0) publish_scale(fresh, s, scale_out, scale_inv_out, scale_inv_used);
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
// quantize_tiled: x viewed as rows x cols (row-major). Writes q (prows x pcols), optionally q_t
// (pcols x prows, row-major: the transpose) and optionally dbias (column sums of the unquantized
// values, float32, deterministic: per-tile partial sums in a fixed order, then the last tile of
// each column strip to finish adds the partials in tile order).
// Tile: 128 rows x 64 cols; block: 256 threads; grid: min(tiles, 4 * SMs), grid-stride.
// Load: thread t takes 8 consecutive elements of rows t/8 + 32p, p = 0..3, all four loads issued
// before any is used (16-byte loads when `vec`); it writes its 8 bytes of q per row and into a
// shared 128 x 72-byte tile. Transposed store: thread t reads the 4-byte words of tile columns
// 4(t%16)..+3 in rows 8(t/16)..+7 (conflict-free with the 72-byte pitch), transposes the bytes
// with byte_perm, and writes 8 bytes to each of 4 rows of q_t.
// Edge tiles are done element by element with bounds checks. One atomicMax per block.
// Padding (prows >= rows, pcols >= cols; both rounded up to 16 for cuBLASLt's FP8 GEMMs, which
// need every dimension a multiple of 16): q and q_t are written with the padded pitches and hold
// zeros outside the rows x cols corner, so a GEMM over the padded operands sums exact zeros there;
// the pad takes no part in the amax or dbias. Tiles cover the padded shape (for a pad to 16 that
// is the same tile grid: 128 and 64 are multiples of 16); the dbias workspace has one row per
// row tile and one counter per column strip of the padded shape.
// ---------------------------------------------------------------------------------------------
#define TILE_R 128
#define TILE_C 64
#define TILE_PITCH 72

template <typename T, int FMT, int OP>
__global__ void __launch_bounds__(256) quantize_tiled(
    const T* __restrict__ x,          // [rows, cols] input (dy for OP 3/4)
    const T* __restrict__ b,          // [rows, cols] second input (x for OP 3/4), else null
    u8* __restrict__ q,               // [rows, cols] FP8 output
    u8* __restrict__ q_t,             // [cols, rows] transposed FP8 output, or null
    float* __restrict__ dbias,        // [cols] column sums, or null
    float* __restrict__ partial,      // [ceil(rows/128), cols] workspace for dbias, or null
    int* __restrict__ strip_count,    // [ceil(cols/64)] zeroed counters for dbias, or null
    const float* __restrict__ scale,  // [1]
    float* amax,                      // [1] amax slot, max-accumulated
    float* scale_out,                 // [1] or null (first step)
    float* scale_inv_out,             // [1] or null (first step)
    float* scale_inv_used,            // [1] or null: 1 / the scale this launch used (any step)
    const int* updates,               // [1] or null: first-step flag
    i64 rows, i64 cols,               // logical shape
    i64 prows, i64 pcols,             // padded shape of q (q_t: pcols x prows), >= rows, cols
    int vec,                          // 1: x, b, q 16-byte aligned and cols % 8 == 0 == pcols % 8
    int vec_t,                        // 1: q_t 8-byte aligned and prows % 8 == 0
    float margin_factor)              // 2**margin
{
    __shared__ __align__(16) u8 tile[TILE_R][TILE_PITCH];
    __shared__ float colsum[32][TILE_C + 1];
    __shared__ int is_last;
    float s;
    const bool fresh = launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, &s);
    if (blockIdx.x == 0 && threadIdx.x == 0) publish_scale(fresh, s, scale_out, scale_inv_out, scale_inv_used);
    const i64 tiles_r = (prows + TILE_R - 1) / TILE_R, tiles_c = (pcols + TILE_C - 1) / TILE_C;
    const int t = threadIdx.x, lr = t >> 3, lc = (t & 7) * 8;
    u32 m = 0;
    for (i64 tile_id = blockIdx.x; tile_id < tiles_r * tiles_c; tile_id += gridDim.x) {
        const i64 tr = tile_id / tiles_c, tc = tile_id % tiles_c;
        const i64 r0 = tr * TILE_R, c0 = tc * TILE_C;
        const bool full = r0 + TILE_R <= rows && c0 + TILE_C <= cols;  // no edge, no pad
        float csum[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) csum[j] = 0.0f;
        if (full && vec) {
            float v[4][8], w[4][8];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const i64 off = (r0 + lr + 32 * p) * cols + c0 + lc;
                load8<T>(x + off, v[p]);
                if (OP >= 3) load8<T>(b + off, w[p]);
            }
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int r = lr + 32 * p;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float y = apply_op<OP>(v[p][j], OP >= 3 ? w[p][j] : 0.0f);
                    m = max(m, abs_bits(y));
                    csum[j] = fadd(csum[j], y);
                    v[p][j] = fmul(y, s);
                }
                const u64 bytes = cvt8<FMT>(v[p]);
                *reinterpret_cast<u64*>(q + (r0 + r) * pcols + c0 + lc) = bytes;
                if (q_t != nullptr) *reinterpret_cast<u64*>(&tile[r][lc]) = bytes;
            }
        } else {
#pragma unroll 1
            for (int p = 0; p < 4; ++p) {
                const int r = lr + 32 * p;
                const i64 gr = r0 + r;
                u64 bytes = 0;
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
                        q[gr * pcols + gc] = byte;
                    } else if (gr < prows && gc < pcols) {
                        q[gr * pcols + gc] = 0;  // the pad
                    }
                    bytes |= (u64)byte << (8 * j);
                }
                if (q_t != nullptr) *reinterpret_cast<u64*>(&tile[r][lc]) = bytes;
            }
        }
        if (dbias != nullptr) {
#pragma unroll
            for (int j = 0; j < 8; ++j) colsum[lr][lc + j] = csum[j];
        }
        __syncthreads();
        if (q_t != nullptr) {
            const int cg = (t & 15) * 4, rg = (t >> 4) * 8;  // tile columns cg..cg+3, rows rg..rg+7
            u32 wd[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) wd[i] = *reinterpret_cast<const u32*>(&tile[rg + i][cg]);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 sel = (u32)k | ((u32)(k + 4) << 4);  // byte k of the first word, byte k of the second
                const u32 lo = __byte_perm(__byte_perm(wd[0], wd[1], sel), __byte_perm(wd[2], wd[3], sel), 0x5410);
                const u32 hi = __byte_perm(__byte_perm(wd[4], wd[5], sel), __byte_perm(wd[6], wd[7], sel), 0x5410);
                const i64 gc = c0 + cg + k, gr = r0 + rg;
                if (full && vec_t) {
                    *reinterpret_cast<u64*>(q_t + gc * prows + gr) = (u64)lo | ((u64)hi << 32);
                } else if (gc < pcols) {
                    const u64 both = (u64)lo | ((u64)hi << 32);
                    for (int i = 0; i < 8; ++i)
                        if (gr + i < prows) q_t[gc * prows + gr + i] = (u8)(both >> (8 * i));
                }
            }
        }
        if (dbias != nullptr) {
            if (t < TILE_C && c0 + t < cols) {
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
                if (t < TILE_C && c0 + t < cols) {
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
