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

// ---- helpers of the vector paths -----------------------------------------------------------------
__device__ __forceinline__ u32 word_of(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// Element j (0..15, compile-time) of 16 consecutive elements held raw in 16-byte chunks c[].
template <typename T> __device__ __forceinline__ float raw_elem(const uint4* c, int j);
template <> __device__ __forceinline__ float raw_elem<float>(const uint4* c, int j) {
    return __uint_as_float(word_of(c[j >> 2], j & 3));
}
template <> __device__ __forceinline__ float raw_elem<__nv_bfloat16>(const uint4* c, int j) {
    const u32 w = word_of(c[j >> 3], (j >> 1) & 3);
    return __uint_as_float((j & 1) ? (w & 0xffff0000u) : (w << 16));
}
template <> __device__ __forceinline__ float raw_elem<__half>(const uint4* c, int j) {
    const u32 w = word_of(c[j >> 3], (j >> 1) & 3);
    return __half2float(__ushort_as_half((unsigned short)((j & 1) ? (w >> 16) : (w & 0xffffu))));
}

// The raw bits of one element, as raw_elem reads them back (a 2-byte type in the low half).
__device__ __forceinline__ u32 raw_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ u32 raw_bits(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ u32 raw_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// Elements p[0..15] as raw 16-byte chunks c[] (the layout raw_elem reads): 16-byte loads when `whole`
// (all 16 there, p 16-byte aligned), else element loads of p[0..n-1] (all issued before the first
// is used) and zeros after them.
template <typename T>
__device__ __forceinline__ void load16(const T* p, int n, bool whole, uint4* c) {
    constexpr int LOADS = (int)sizeof(T);  // 16-byte chunks for 16 elements
    if (whole) {
#pragma unroll
        for (int k = 0; k < LOADS; ++k) c[k] = ldg_nc16(p + k * (16 / LOADS));
        return;
    }
    u32 w[4 * LOADS];
#pragma unroll
    for (int k = 0; k < 4 * LOADS; ++k) w[k] = 0u;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        if (j < n) {
            const u32 e = raw_bits(p[j]);
            if constexpr (LOADS == 4) w[j] = e;
            else w[j >> 1] |= e << (16 * (j & 1));
        }
    }
#pragma unroll
    for (int k = 0; k < LOADS; ++k) c[k] = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
}

// Columns gc..gc+15 of row gr of x (and b), rows x cols row-major, as raw chunks: 16-byte loads when
// all 16 are inside and `vec` (x, b 16-byte aligned, cols % 8 == 0), else element loads of those
// inside (none in a row >= rows), zeros for the rest. Returns how many are inside (0..16).
template <typename T, int OP>
__device__ __forceinline__ int load_row16(const T* x, const T* b, i64 rows, i64 cols, i64 gr, i64 gc, int vec,
                                          uint4* xr, uint4* br) {
    const int n = gr < rows ? (int)max((i64)0, min((i64)16, cols - gc)) : 0;
    const i64 off = gr * cols + gc;
    load16<T>(x + off, n, vec && n == 16, xr);
    if (OP >= 3) load16<T>(b + off, n, vec && n == 16, br);
    return n;
}

// The low k bytes of a u64 set (k <= 0: none, k >= 8: all).
__device__ __forceinline__ u64 low_bytes(int k) {
    return k <= 0 ? 0ull : k >= 8 ? ~0ull : (1ull << (8 * k)) - 1ull;
}

// Bytes 0..n-1 of (lo, hi) to p: one 16-byte store (mode 2: p 16-byte aligned) or two 8-byte stores
// (mode 1: 8-byte aligned) when n == 16, else byte stores.
__device__ __forceinline__ void store16(u8* p, u64 lo, u64 hi, int n, int mode) {
    if (n == 16 && mode == 2) {
        *reinterpret_cast<uint4*>(p) = make_uint4((u32)lo, (u32)(lo >> 32), (u32)hi, (u32)(hi >> 32));
    } else if (n == 16 && mode == 1) {
        reinterpret_cast<u64*>(p)[0] = lo;
        reinterpret_cast<u64*>(p)[1] = hi;
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j)
            if (j < n) p[j] = (u8)((j < 8 ? lo : hi) >> (8 * (j & 7)));
    }
}

// Where column c (0..63) of a row of quantize_tiled's colsum lives (a float4 group stays whole).
__device__ __forceinline__ int cs_at(int c) { return c ^ ((c >> 5) << 3); }

template <bool V> struct Flag { static constexpr bool value = V; };

// Where a launch's amax and scale come from (the kernels' Pre policy, called once per thread after the
// thread's first loads, with those loads; returns whether first-step mode applied, see launch_scale).
// StagedAmax: launch_scale() as it stands: on a first step a separate pre-pass launch has already
// staged the tensor's amax in *amax. (GridAmax in current_quantize.cu stages it in the same launch,
// behind a grid-wide barrier.)
struct StagedAmax {
    template <typename T, int FMT, int OP, bool VEC>
    static __device__ __forceinline__ bool flat(const T*, const T*, i64, const uint4*, const uint4*, const float* scale,
                                                float* amax, const int* updates, float margin_factor, float* s) {
        return launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, s);
    }
    template <typename T, int FMT, int OP>
    static __device__ __forceinline__ bool tiled(const T*, const T*, i64, i64, i64, i64, int, const uint4*, const uint4*,
                                                 bool, const float* scale, float* amax, const int* updates,
                                                 float margin_factor, float* s) {
        return launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, s);
    }
};

// ---------------------------------------------------------------------------------------------
// quantize_flat: any shape, seen as n contiguous elements.
// Grid: 1-D, min(ceil(n / (16 * FF8_THREADS)), resident blocks) blocks of FF8_THREADS threads, grid-
// stride. Vector path (VEC=true; x, b and q 16-byte aligned): each thread takes 16 elements per
// step, 2 independent 16-byte loads for 2-byte types (4 for float32) per input, kept raw in
// registers, and one 16-byte store; a thread's first loads are issued before the scale is read
// (a block's first step waits for one memory latency, not two). (Loads of the next step
// issued ahead, or of two steps side by side, do not survive ptxas: in the sm_90 SASS it sinks them
// to their first use to save registers.) The < 16-element tail is done element-wise by the last
// threads. VEC=false: element-wise.
// npad: zero bytes of q after its n (the pad rows of a q padded in rows only, prows x cols: x's bytes,
// then (prows - rows) * cols zeros), byte stores grid-stride (fewer than 16 * cols bytes: a byte or
// two per thread of a grid that quantizes the rest).
// STORE=false is the first-step pre-pass: amax only, and only if *updates == 0.
// One atomicMax per block.
// ---------------------------------------------------------------------------------------------
template <typename T, int FMT, int OP, bool VEC, bool STORE, class Pre = StagedAmax>
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
    i64 npad,                         // zero bytes of q after the n (STORE only)
    float margin_factor)              // 2**margin, for the first-step scale
{
    constexpr int LOADS = (int)sizeof(T);  // 16-byte loads per input and step (16 elements)
    if (!STORE && *updates != 0) return;  // pre-pass only runs on a first step
    const i64 tid = (i64)blockIdx.x * FF8_THREADS + threadIdx.x;
    const i64 nthreads = (i64)gridDim.x * FF8_THREADS;
    const i64 nvec = VEC ? n / 16 : 0;
    uint4 xc[LOADS], bc[OP >= 3 ? LOADS : 1];
    auto load = [&](uint4* xr, uint4* br, i64 i) {
#pragma unroll
        for (int k = 0; k < LOADS; ++k) {
            xr[k] = ldg_nc16(x + i * 16 + k * (16 / LOADS));
            if (OP >= 3) br[k] = ldg_nc16(b + i * 16 + k * (16 / LOADS));
        }
    };
    if (VEC && tid < nvec) load(xc, bc, tid);  // before the scale: the first loads wait on nothing
    float s = 1.0f;
    bool fresh = false;
    if (STORE) {
        fresh = Pre::template flat<T, FMT, OP, VEC>(x, b, n, xc, bc, scale, amax, updates, margin_factor, &s);
        if (blockIdx.x == 0 && threadIdx.x == 0) publish_scale(fresh, s, scale_out, scale_inv_out, scale_inv_used);
    }
    u32 m = 0;  // the running amax (amax_update)
    if (VEC) {
        for (i64 i = tid; i < nvec; i += nthreads) {
            if (i != tid) load(xc, bc, i);  // (the first step's were issued before the scale)
            float v[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                float y = apply_op<OP>(raw_elem<T>(xc, j), OP >= 3 ? raw_elem<T>(bc, j) : 0.0f);
                m = amax_update<OP>(m, y);
                v[j] = fmul(y, s);
            }
            if (STORE) {
                const u64 lo = cvt8<FMT>(v), hi = cvt8<FMT>(v + 8);
                *reinterpret_cast<uint4*>(q + i * 16) = make_uint4((u32)lo, (u32)(lo >> 32), (u32)hi, (u32)(hi >> 32));
            }
        }
    }
    for (i64 i = nvec * 16 + tid; i < n; i += nthreads) {
        float y = apply_op<OP>(to_f32(x[i]), OP >= 3 ? to_f32(b[i]) : 0.0f);
        m = amax_update<OP>(m, y);
        if (STORE) q[i] = cvt1<FMT>(fmul(y, s));
    }
    if (STORE) {  // the pad after the n bytes: at most a byte or two per thread
        for (i64 i = n + tid; i < n + npad; i += nthreads) q[i] = 0;
    }
    if (!fresh) block_amax_atomic<FF8_THREADS>(m, amax);  // on a first step the pre-pass already did it
}

// ---------------------------------------------------------------------------------------------
// quantize_tiled: x viewed as rows x cols (row-major). Writes q (prows x pcols), optionally q_t
// (pcols x prows, row-major: the transpose) and optionally dbias (column sums of the unquantized
// values, float32, deterministic: per-tile partial sums in a fixed order, then the last tile of
// each column strip to finish adds the partials in tile order), all from one read of x (and b).
// Tile: 128 rows x 64 cols; block: 256 threads; grid: min(tiles, resident blocks) from the
// occupancy, grid-stride.
// Software pipeline: a block issues the 16-byte loads of its next tile (raw, in registers) before
// it computes the current one, and the first tile's loads before it reads the scale, so loads are
// in flight while the block computes and stores: per thread 2 rows x 16 columns of x (and b), i.e.
// 4 loads of 16 bytes for a 2-byte type (8 for float32) per input, current + next tile.
// Thread t owns rows t/4 and t/4 + 64, columns 16(t%4)..+15 of the tile: q is written with one
// 16-byte store per row (two 8-byte stores when pcols % 16 != 0, byte stores when pcols % 8 != 0 or q
// is not 8-byte aligned), and the FP8 bytes go to a shared
// 128 x 64-byte tile (two of them, alternating, so one barrier a tile suffices) at a swizzled place
//     phys(r, c) = 64 r + 16 ((c / 16) ^ (r / 16 % 4)) + 8 ((c / 8 % 2) ^ (r / 64)) + c % 8
// (16-byte chunks permuted within a row: the stores and the transposed reads are conflict-free).
// Transposed store: lane l of warp w takes tile rows 16(l%8)..+15 and columns 2p, 2p+1 with
// p = 4w + l/8: 16 4-byte reads (the word of columns 4(p/2)..+3), byte_perm, and one 16-byte store
// per column, so 8 lanes write one full 128-byte line of q_t and a warp store writes 4 lines
// (when q_t is 16-byte aligned and prows % 16 == 0, in every tile: a 16-row group lies wholly inside
// prows or wholly past it; else byte stores with bounds).
// dbias (a gradient's: OP 3/4, dgelu, and OP 0, the identity, with HAS_DBIAS; the plan refuses it
// with gelu): each thread adds its two rows (y0 + y1,
// per column), a thread per (column, 16-row group) adds its 16 rows in order, one per column adds the
// 4 groups ((g0 + g1) + (g2 + g3)) into the tile's row of the workspace; after its last tile a block
// counts its tiles on their strips' counters (one fence first) and the block that completes a strip
// adds the strip's partials in tile order (finish_dbias; the same sums in the same order as when the
// last tile of a strip did it, which cost a fence and an atomic round trip every tile).
// Edge tiles (a tile that reaches past rows or cols: the last row / column strip of a ragged or
// padded shape) take the same vector path, decided per thread row rather than per tile: a row of
// 16 columns wholly inside is loaded with 16-byte loads (when vec), a row that crosses cols with
// element loads (all issued at once) and zeros after, a row past rows loads nothing; the values
// past the edge count as 0 (no amax, no dbias, FP8 byte 0 = the pad), and q is stored up to
// prows x pcols with the same 16-byte stores (byte stores only where a row's 16 bytes cross pcols).
// Their dbias rows are added from +0 in row order (as the element-wise path that did them before:
// the same bits; a full tile of a tensor that is not vec, which that path also took, now adds
// y0 + y1 like every full tile: the same sum but for the sign of a zero). A tensor that is not vec
// (cols % 8 != 0, or x / b not 16-byte aligned) loads every row element-wise and still stores q and
// q_t 16 bytes at a time. One atomicMax per block.
// Padding (prows >= rows, pcols >= cols; both rounded up to 16 for cuBLASLt's FP8 GEMMs, which
// need every dimension a multiple of 16): q and q_t are written with the padded pitches and hold
// zeros outside the rows x cols corner, so a GEMM over the padded operands sums exact zeros there;
// the pad takes no part in the amax or dbias (the plan sends a shape padded in rows only, without
// q_t or dbias, to quantize_flat with npad). Tiles cover the padded shape (for a pad to 16 that
// is the same tile grid: 128 and 64 are multiples of 16); the dbias workspace has one row per
// row tile and one counter per column strip of the padded shape.
// ---------------------------------------------------------------------------------------------
// dbias, after the block's last tile: the partials the block wrote are made visible (one fence), then
// one count per tile on its column strip's counter; the block whose count completes a strip (all
// tiles_r of its tiles written) adds the strip's partials in tile order into dbias and zeroes the
// counter for the next call. (The sums and their order are a tile's: the bits do not depend on the
// grid.) A fence and the counting once per block, not per tile: a per-tile fence waited for the
// tile's q and q_t stores to land before the next tile, with two blocks per multiprocessor.
// W: the width of a column strip (the tile's columns: TILE_C here, 128 for block_quantize).
template <int W = TILE_C>
__device__ __forceinline__ void finish_dbias(float* __restrict__ dbias, const float* __restrict__ partial,
                                             int* __restrict__ strip_count, i64 cols, u32 tiles_r, u32 tiles_c,
                                             i64 ntiles) {
    __shared__ int done[256];  // strips this block completed (at most one per tile of a chunk)
    __shared__ int ndone;
    const int t = threadIdx.x;
    __threadfence();
    for (i64 base = blockIdx.x; base < ntiles; base += (i64)256 * gridDim.x) {  // the block's tiles, 256 at a time
        if (t == 0) ndone = 0;
        __syncthreads();
        const i64 id = base + (i64)t * gridDim.x;
        if (id < ntiles) {
            const int tc = (int)(id % tiles_c);
            if (atomicAdd(&strip_count[tc], 1) == (int)tiles_r - 1) done[atomicAdd(&ndone, 1)] = tc;
        }
        __syncthreads();
        const int n = ndone;
        if (n > 0) __threadfence();
        for (int k = t / W; k < n; k += 256 / W) {  // 256 / W strips at a time, a thread per column
            const int tc = done[k];
            const i64 c = (i64)tc * W + (t & (W - 1));
            if (c < cols) {
                float acc = 0.0f;
                for (u32 r = 0; r < tiles_r; ++r) acc = fadd(acc, __ldcg(&partial[(i64)r * cols + c]));
                dbias[c] = acc;
            }
            if ((t & (W - 1)) == 0) strip_count[tc] = 0;  // leave the counters zeroed for the next call
        }
        __syncthreads();  // (done / ndone are reused by the next chunk)
    }
}
#define T2_LOADS (2 * (int)sizeof(T))  // 16-byte loads per thread, tile and input (2 rows x 16 columns)

// HAS_DBIAS: the column sums' code is compiled in (dgelu: always; the identity: its own instantiation
// for a plain gradient, so the forward's identity kernel keeps its registers, 58 against 128).
template <typename T, int FMT, int OP, class Pre = StagedAmax, bool HAS_DBIAS = (OP >= 3)>
__global__ void __launch_bounds__(256) quantize_tiled(
    const T* __restrict__ x,          // [rows, cols] input (dy for OP 3/4)
    const T* __restrict__ b,          // [rows, cols] second input (x for OP 3/4), else null
    u8* __restrict__ q,               // [prows, pcols] FP8 output
    u8* __restrict__ q_t,             // [pcols, prows] transposed FP8 output, or null
    float* __restrict__ dbias,        // [cols] column sums, or null
    float* __restrict__ partial,      // [ceil(prows/128), cols] workspace for dbias, or null
    int* __restrict__ strip_count,    // [ceil(pcols/64)] zeroed counters for dbias, or null
    const float* __restrict__ scale,  // [1]
    float* amax,                      // [1] amax slot, max-accumulated
    float* scale_out,                 // [1] or null (first step)
    float* scale_inv_out,             // [1] or null (first step)
    float* scale_inv_used,            // [1] or null: 1 / the scale this launch used (any step)
    const int* updates,               // [1] or null: first-step flag
    i64 rows, i64 cols,               // logical shape
    i64 prows, i64 pcols,             // padded shape of q (q_t: pcols x prows), >= rows, cols
    int vec,                          // 1: x, b 16-byte aligned and cols % 8 == 0 (16-byte loads)
    int vec_t,                        // 1: q_t 8-byte aligned and prows % 8 == 0
    float margin_factor)              // 2**margin
{
    constexpr int PER_ROW = T2_LOADS / 2;       // 16-byte loads per row
    constexpr int ELEMS = 16 / (int)sizeof(T);  // elements per 16-byte load
    __shared__ __align__(16) u8 tile[2][TILE_R * TILE_C];
    // dbias: each thread's two-row sums; column c stored at cs_at(c) (columns 32..63 with bit 3 flipped), so
    // the float4 stores of a quarter warp (2 rows x columns 0, 16, 32, 48) hit 8 distinct bank groups
    __shared__ __align__(16) float colsum[64][TILE_C + 4];
    __shared__ float colsum4[4][TILE_C];                    // dbias: the 16-row groups' sums
    const int t = threadIdx.x, lr = t >> 2, lc = (t & 3) * 16;
    const u32 tiles_c = (u32)((pcols + TILE_C - 1) / TILE_C), tiles_r = (u32)((prows + TILE_R - 1) / TILE_R);
    const i64 ntiles = (i64)tiles_r * tiles_c;
    const TileLanes lanes = tile_lanes(t);  // the transposed store's
    // the tile stores: row lr + 64 p, chunk t % 4 (tile_at(lr + 64 p, lc) = wr_base + 4096 p, halves swapped for p = 1)
    const int wr_base = tile_at(lr, lc);
    // q's stores: 16 bytes (q 16-byte aligned, pcols % 16 == 0), 8 (8-byte aligned, pcols % 8 == 0), else 1
    const int qmode = (reinterpret_cast<u64>(q) & 15) == 0 && (pcols & 15) == 0 ? 2
                      : (reinterpret_cast<u64>(q) & 7) == 0 && (pcols & 7) == 0 ? 1 : 0;
    const bool t16 = vec_t && (prows & 15) == 0 && (reinterpret_cast<u64>(q_t) & 15) == 0;

    // tile coordinates advance by the grid in both dimensions (no division in the loop)
    const u32 step_r = gridDim.x / tiles_c, step_c = gridDim.x % tiles_c;
    u32 tr = blockIdx.x / tiles_c, tc = blockIdx.x % tiles_c;
    auto is_full = [&](u32 r, u32 c) {  // no edge, no pad
        return (i64)(r + 1) * TILE_R <= rows && (i64)(c + 1) * TILE_C <= cols;
    };
    // a tile's loads: 16-byte ones for a full tile of a vec tensor; else row by row (load_row16):
    // 16-byte loads for each thread row whose 16 columns are inside, element loads at the edge
    auto load = [&](uint4* xr, uint4* br, u32 r, u32 c) {
        const i64 gr = (i64)r * TILE_R + lr, gc = (i64)c * TILE_C + lc;
        if (vec && is_full(r, c)) {
            const i64 off = gr * cols + gc;
#pragma unroll
            for (int p = 0; p < 2; ++p)
#pragma unroll
                for (int k = 0; k < PER_ROW; ++k) {
                    xr[p * PER_ROW + k] = ldg_nc16(x + off + p * 64 * cols + k * ELEMS);
                    if (OP >= 3) br[p * PER_ROW + k] = ldg_nc16(b + off + p * 64 * cols + k * ELEMS);
                }
        } else {
#pragma unroll
            for (int p = 0; p < 2; ++p)
                load_row16<T, OP>(x, b, rows, cols, gr + 64 * p, gc, vec, xr + p * PER_ROW,
                                  OP >= 3 ? br + p * PER_ROW : br);
        }
    };

    uint4 xc[T2_LOADS], bc[OP >= 3 ? T2_LOADS : 1];
    const bool first_loaded = blockIdx.x < ntiles;
    if (first_loaded) load(xc, bc, tr, tc);  // before the scale: the first loads wait on nothing

    float s;
    const bool fresh = Pre::template tiled<T, FMT, OP>(x, b, rows, cols, prows, pcols, vec, xc, bc, first_loaded,
                                                        scale, amax, updates, margin_factor, &s);
    if (blockIdx.x == 0 && threadIdx.x == 0) publish_scale(fresh, s, scale_out, scale_inv_out, scale_inv_used);
    u32 m = 0;  // the running amax (amax_update)
    int buf = 0;
    for (i64 id = blockIdx.x; id < ntiles; id += gridDim.x) {
        const i64 r0 = (i64)tr * TILE_R, c0 = (i64)tc * TILE_C;
        const bool full = is_full(tr, tc);
        u32 ntr = tr + step_r, ntc = tc + step_c;
        if (ntc >= tiles_c) { ntc -= tiles_c; ++ntr; }
        uint4 xn[T2_LOADS], bn[OP >= 3 ? T2_LOADS : 1];
        // the next tile's loads fly while this one is computed
        if (id + gridDim.x < ntiles) load(xn, bn, ntr, ntc);
        u8* tl = tile[buf];
        // Every tile takes this path. Each thread row has n of its 16 columns inside rows x cols (16
        // but at an edge); the loads left zeros past them, whose values (op(0) = +-0) take no part in
        // the amax or the column sums, and whose FP8 bytes are masked to 0 (the pad, whatever the
        // scale); q is written where the row and its columns are inside prows x pcols.
        auto body = [&](auto with_dbias) {
            constexpr bool DB = decltype(with_dbias)::value;
            float cs[16];
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const i64 gr = r0 + lr + 64 * p, gc = c0 + lc;
                float v[16];
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    float y = apply_op<OP>(raw_elem<T>(xc + p * PER_ROW, j),
                                           OP >= 3 ? raw_elem<T>(bc + p * PER_ROW, j) : 0.0f);
                    m = amax_update<OP>(m, y);
                    if (DB) cs[j] = p == 0 ? y : fadd(cs[j], y);
                    v[j] = fmul(y, s);
                }
                u64 lo = cvt8<FMT>(v), hi = cvt8<FMT>(v + 8);
                int nq = 16;
                if (!full) {
                    const int n = gr < rows ? (int)max((i64)0, min((i64)16, cols - gc)) : 0;
                    lo &= low_bytes(n);
                    hi &= low_bytes(n - 8);
                    nq = gr < prows ? (int)max((i64)0, min((i64)16, pcols - gc)) : 0;
                }
                store16(q + gr * pcols + gc, lo, hi, nq, qmode);
                if (q_t != nullptr)  // the 8-byte halves swapped in rows 64..127 (tile_at)
                    *reinterpret_cast<uint4*>(tl + wr_base + 4096 * p) =
                        p == 0 ? make_uint4((u32)lo, (u32)(lo >> 32), (u32)hi, (u32)(hi >> 32))
                               : make_uint4((u32)hi, (u32)(hi >> 32), (u32)lo, (u32)(lo >> 32));
            }
            if (DB) {
                // an edge tile's sums start from +0, as the element-wise path's did: (+0 + y0) + y1 ==
                // +0 + (y0 + y1) bit for bit, and a pad's +-0 changes neither
                if (!full) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) cs[j] = fadd(0.0f, cs[j]);
                }
#pragma unroll
                for (int j = 0; j < 16; j += 4)
                    *reinterpret_cast<float4*>(&colsum[lr][cs_at(lc + j)]) = make_float4(cs[j], cs[j + 1], cs[j + 2], cs[j + 3]);
            }
        };
        if (HAS_DBIAS && dbias != nullptr) body(Flag<true>());
        else body(Flag<false>());
        __syncthreads();
        if (q_t != nullptr) store_tile_t(tl, q_t, lanes, r0, c0, prows, pcols, t16);
        if (HAS_DBIAS && dbias != nullptr) {  // the tile's column sums: one partial row of the workspace
            {
                const int c = t & 63, g = t >> 6;
                float acc = colsum[16 * g][cs_at(c)];
#pragma unroll
                for (int k = 1; k < 16; ++k) acc = fadd(acc, colsum[16 * g + k][cs_at(c)]);
                colsum4[g][c] = acc;
            }
            __syncthreads();
            if (t < TILE_C && c0 + t < cols)
                partial[(i64)tr * cols + c0 + t] = fadd(fadd(colsum4[0][t], colsum4[1][t]), fadd(colsum4[2][t], colsum4[3][t]));
        }
        buf ^= 1;
        tr = ntr;
        tc = ntc;
#pragma unroll
        for (int k = 0; k < T2_LOADS; ++k) {
            xc[k] = xn[k];
            if (OP >= 3) bc[k] = bn[k];
        }
    }
    if (HAS_DBIAS && dbias != nullptr) finish_dbias(dbias, partial, strip_count, cols, tiles_r, tiles_c, ntiles);
    if (!fresh) block_amax_atomic<256>(m, amax);
}
