// fusedfp8: LayerNorm fused with FP8 quantization, in one read of x. Per row of x (rows x cols,
// row-major): mean and rstd in float32, y = LayerNorm(x) * weight + bias, q = fp8(y * scale) (as
// quantize does), amax = max |y| (max-accumulated into the slot), optionally the transpose q_t
// (cols x rows), and mean / rstd per row for the backward. The op order, which the reference
// twin (fusedfp8/numerics/layernorm.py) follows op for op, every operation one explicit rounding:
//     mean = S(x) / cols                            fdiv
//     d    = x - mean                               fsub
//     var  = S(d * d) / cols                        fmul, then S, fdiv (variance of the centred values)
//     rstd = 1 / sqrt(var + eps)                    fadd, fsqrt (sqrt.rn), fdiv (div.rn)
//     y    = ((d * rstd) * weight) + bias           fmul, fmul, fadd (weight null: 1; bias null: -0)
//     q    = cvt.rn.satfinite(y * scale)            fmul, cvt
// S is the fixed reduction below; nothing is contracted into an FMA and nothing is flushed.
//
// Template parameters: T = float | __half | __nv_bfloat16 (x), P = the same set (weight and bias,
// read as float32), FMT = 0 (E4M3) | 1 (E5M2), STORE = false for the first-step pre-pass (amax
// only, and only when *updates == 0; see launch_scale() in common.cuh), TRANSPOSE: also q_t,
// STATS (with STORE = false): the statistics only, every step: mean and rstd written, no y, no
// amax (block scaling's first launch: block_quantize.cu's LayerNorm instantiation then computes y
// from them, tile by tile, with the scales of y's own blocks).
//
// Layout. A row is cut into chunks of 8 columns (one 16-byte load of a 2-byte type, two of
// float32; the last chunk zero-padded), and tpr threads (a power of two, 32..512, chosen from
// cols by the host: numerics/layernorm.py threads_per_row) share a row: thread t takes chunks
// t, t + tpr, t + 2 tpr, ... so that a warp's loads are contiguous. The first LN_CACHED (4)
// chunks of a thread stay in registers as loaded (raw 16-bit values for 2-byte types), so x is
// read ONCE for rows up to 32 * tpr columns (16384 at tpr = 512); wider rows read their further
// chunks again in each of the three passes (sum, sum of squares, output). 1024 columns: one warp
// per row, 32 values a lane, no shared memory and no barrier in the reductions; 4096: 4 warps.
//
// Reduction S (deterministic, fixed; the reference computes the same tree): each thread keeps 8
// sums (one per position in a chunk), adding its chunks in order from +0 (a padded +0 changes
// nothing: a sum that starts at +0 is never -0); then halving trees a[j] += a[j + h] over the 8
// positions (h = 4, 2, 1), over the 32 lanes (the xor-butterfly with offsets 16 .. 1: every lane
// ends with the same bits, as IEEE addition commutes), and over the row's tpr / 32 warps through
// shared memory (a second butterfly over lanes 0 .. warps-1 of each warp, offsets warps/2 .. 1).
//
// (From LN_SPLIT_COLS columns on the plan writes q_t without the tile: this kernel without q_t, then
// transpose_fp8 below.)
// Grid and block: blockDim = max(256, tpr) threads (the host's choice, fusedfp8/launch/plans.py layernorm_block;
// the kernel reads blockDim; with q_t: min(512, tile_rows * tpr), a tile in one pass),
// blockDim / tpr rows per pass; grid = min(row groups, resident blocks) from the occupancy, grid-
// stride over the groups; one atomicMax per block. Without q_t (TRANSPOSE = false) a group is one
// pass. With q_t a group is a tile of tile_rows rows (16, 8 or 4, from cols: the host keeps
// tile_rows * pitch within its shared-memory budget): every pass also writes its FP8 bytes into a
// dynamic shared tile [tile_rows][pitch = cols rounded up to 16], then the block writes the tile
// transposed (store_transposed: tile_rows contiguous bytes per column of q_t, one 16-, 8- or 4-byte
// store each when q_t is aligned and rows % tile_rows == 0). Why: for hidden 1024 and 4096 a row is
// 2-8 KiB of bf16, which 32-128 threads hold in registers (4 independent 16-byte loads each):
// x is read once, q written once with 8-byte stores, and a 1024-wide row needs no barrier at all.
// Registers (sm_90, NVRTC, bf16 in, float32 / bf16 params): 108 / 98 without q_t, 126 with it,
// 126 / 110 in the pre-pass: two blocks of 256 per multiprocessor.
//
// Padding (layernorm_quantize_padded, the quantize family's pad_to): q is (prows x pcols) and q_t
// (pcols x prows), rounded up (to 16 for cuBLASLt's FP8 GEMMs), zeros outside the rows x cols
// corner, written in the same pass: an active row also zeroes its pad columns, the groups run to
// prows and a pad row writes a row of zeros, and with q_t the transposed store runs to pcols and
// prows and puts zeros where the pad is. The pad takes no part in the amax; mean / rstd stay
// (rows). Both kernels are one body (layernorm_rows, template flag PAD); the unpadded kernel's
// machine code is the one it had before padding existed (its PAD tests fold away). The vector path with weight
// and bias spends 74 SASS instructions on the output of 8 elements (3 FMUL + 2 FADD an element).

// Edge cases (the same table as the reference):
//   NaN anywhere in a row   -> the row's y all NaN: q = NaN bytes, amax NaN (canonical 0x7fc00000),
//                              mean / rstd written as the canonical NaN
//   +-inf in a row          -> mean +-inf (or NaN): the row's y NaN as above
//   constant row            -> var 0, rstd = 1 / sqrt(eps), y = bias (eps = 0: rstd inf, y NaN)
//   weight / bias null      -> 1 / -0 (exact identities: the same bits as not applying them)
//   rows == 0               -> one block publishes 1 / scale; nothing else (cols == 0 is refused
//                              by the host)
//   first step              -> the pre-pass (STORE = false) max-accumulates amax of y into the
//                              slot; the main launch takes its scale from it (launch_scale)

#include "common.cuh"

using namespace ff8;

#define LN_THREADS 512  // the largest block (and the most threads per row)
#define LN_CHUNK 8      // columns per chunk
#define LN_CACHED 4     // chunks per thread kept in registers

// 8 consecutive elements as loaded: one uint4 for 2-byte types, two for float32.
template <typename T> struct Raw8 { uint4 w[sizeof(T) / 2]; };

template <bool B> struct Bool { static constexpr bool value = B; };

// The chunk at p with n valid elements (n is 0 or 8 when VEC: p is then 16-byte aligned); missing
// elements read as +0. VEC: one predicated 16-byte load (two for float32), no branch.
template <typename T, bool VEC> __device__ __forceinline__ Raw8<T> load_chunk(const T* p, int n) {
    Raw8<T> r;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.w[i] = make_uint4(0u, 0u, 0u, 0u);
    if (VEC) {
#pragma unroll
        for (int i = 0; i < (int)(sizeof(T) / 2); ++i)
            if (n > 0) r.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    } else {
        T* e = reinterpret_cast<T*>(&r);
#pragma unroll
        for (int j = 0; j < LN_CHUNK; ++j)
            if (j < n) e[j] = p[j];
    }
    return r;
}

template <typename T> __device__ __forceinline__ void unpack(const Raw8<T>& r, float* v) {
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int j = 0; j < LN_CHUNK; ++j) v[j] = to_f32(e[j]);
}

// A parameter chunk (weight or bias) as float32, `dflt` where the pointer is null.
template <typename P, bool VEC> __device__ __forceinline__ void param_chunk(const P* p, i64 col, int n, float dflt,
                                                                           float* v) {
    if (p == nullptr) {
#pragma unroll
        for (int j = 0; j < LN_CHUNK; ++j) v[j] = dflt;
        return;
    }
    unpack<P>(load_chunk<P, VEC>(p + col, n), v);
}

// 4 floats (already scaled) -> 4 FP8 bytes, element j in byte j: cvt.rn.satfinite (the instruction
// cvt2 of common.cuh compiles to; the first operand goes to the upper byte) into two 16-bit
// halves, joined by one mov (no masking of zero-extended halves).
template <int FMT> __device__ __forceinline__ u32 pack4(float v0, float v1, float v2, float v3) {
    u32 r;
    if (FMT == 0)
        asm("{ .reg .b16 lo, hi;\n\t cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
            " cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t mov.b32 %0, {lo, hi}; }"
            : "=r"(r) : "f"(v0), "f"(v1), "f"(v2), "f"(v3));
    else
        asm("{ .reg .b16 lo, hi;\n\t cvt.rn.satfinite.e5m2x2.f32 lo, %2, %1;\n\t"
            " cvt.rn.satfinite.e5m2x2.f32 hi, %4, %3;\n\t mov.b32 %0, {lo, hi}; }"
            : "=r"(r) : "f"(v0), "f"(v1), "f"(v2), "f"(v3));
    return r;
}
template <int FMT> __device__ __forceinline__ uint2 pack8(const float* v) {
    return make_uint2(pack4<FMT>(v[0], v[1], v[2], v[3]), pack4<FMT>(v[4], v[5], v[6], v[7]));
}

__device__ __forceinline__ float canonical(float v) {
    return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u ? __uint_as_float(0x7fc00000u) : v;
}

// The row reduction S of the 8 per-position sums of each thread of a row (see the header). `red`
// is this row's slice of a shared array (warps floats); the barrier is only taken when a row has
// several warps (warps is the same for the whole block).
__device__ __forceinline__ float row_reduce(float* a, float* red, int lane, int wr, int warps) {
#pragma unroll
    for (int h = LN_CHUNK / 2; h >= 1; h >>= 1)
#pragma unroll
        for (int j = 0; j < h; ++j) a[j] = fadd(a[j], a[j + h]);
    float v = a[0];
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) v = fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (warps > 1) {
        if (lane == 0) red[wr] = v;
        __syncthreads();
        v = lane < warps ? red[lane] : 0.0f;
        for (int o = warps >> 1; o >= 1; o >>= 1) v = fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
        v = __shfl_sync(0xffffffffu, v, 0);
    }
    return v;
}

// Four 4-byte words (rows 0..3, 4 columns each) -> the word of column k (its bytes: rows 0..3).
__device__ __forceinline__ u32 column_word(u32 w0, u32 w1, u32 w2, u32 w3, int k) {
    const u32 sel = (u32)k | ((u32)(k + 4) << 4);
    return __byte_perm(__byte_perm(w0, w1, sel), __byte_perm(w2, w3, sel), 0x5410);
}

// Write the shared tile (tile_rows x cols FP8 bytes, rows r0.. of q) into q_t: thread g takes
// columns 4g..4g+3, reads 4-byte words of 4 rows at a time (consecutive threads read consecutive
// words: no bank conflict), transposes the bytes with byte_perm and stores tile_rows contiguous
// bytes per column (one 16-, 8- or 4-byte store with vec_t, else byte stores within rows).
// PAD: q_t is (pcols x prows); the columns run to pcols and the rows to prows, and the bytes of
// the pad (a column >= cols, a row >= rows: tile bytes no row wrote) are replaced by zeros as
// they leave the tile. (Without PAD prows == rows and pcols == cols: the same code as before.)
template <bool PAD>
__device__ __forceinline__ void store_transposed(const u8* tile, u8* q_t, i64 rows, i64 cols, i64 prows, i64 pcols,
                                                 i64 r0, i64 pitch, int tile_rows, int vec_t) {
    const int quads = tile_rows >> 2;
    const i64 out_rows = PAD ? prows : rows, out_cols = PAD ? pcols : cols;
    u32 keep[4];  // PAD: the bytes of row quad i that hold data (rows < rows)
    if (PAD) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const i64 n = rows - (r0 + 4 * i);
            keep[i] = n >= 4 ? 0xffffffffu : n <= 0 ? 0u : (1u << (8 * (int)n)) - 1u;
        }
    }
#pragma unroll 1
    for (i64 cg = threadIdx.x; cg < (out_cols + 3) / 4; cg += blockDim.x) {
        u32 cw[4][4];  // [column k][row quad i]
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (i < quads) {
                const u8* base = tile + (4 * i) * pitch + 4 * cg;
                const u32 w0 = *reinterpret_cast<const u32*>(base);
                const u32 w1 = *reinterpret_cast<const u32*>(base + pitch);
                const u32 w2 = *reinterpret_cast<const u32*>(base + 2 * pitch);
                const u32 w3 = *reinterpret_cast<const u32*>(base + 3 * pitch);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    cw[k][i] = column_word(w0, w1, w2, w3, k);
                    if (PAD) cw[k][i] = 4 * cg + k < cols ? cw[k][i] & keep[i] : 0u;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const i64 col = 4 * cg + k;
            if (col >= out_cols) break;
            u8* dst = q_t + col * out_rows + r0;
            if (vec_t) {
                if (quads == 4) *reinterpret_cast<uint4*>(dst) = make_uint4(cw[k][0], cw[k][1], cw[k][2], cw[k][3]);
                else if (quads == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(cw[k][0], cw[k][1]);
                else *reinterpret_cast<u32*>(dst) = cw[k][0];
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (i < quads) {
#pragma unroll
                        for (int bt = 0; bt < 4; ++bt)
                            if (r0 + 4 * i + bt < out_rows) dst[4 * i + bt] = (u8)(cw[k][i] >> (8 * bt));
                    }
                }
            }
        }
    }
}

// The kernels' body. PAD (layernorm_quantize_padded): q is (prows x pcols) and q_t (pcols x prows),
// prows >= rows and pcols >= cols, with zeros outside the rows x cols corner, written in the same
// pass: an active row zeroes its pad columns, the pad rows up to prows (the groups run to prows)
// write zeros, and with q_t the transposed store runs to pcols and prows with zeros for the pad
// (store_transposed<true>); the shared tile's pitch is pcols rounded up to 16. The pad takes no
// part in the amax (a pad row loads nothing). Without PAD, prows == rows and pcols == cols and
// the code is the unpadded kernel's: every PAD test is a compile-time constant.
template <typename T, typename P, int FMT, bool STORE, bool TRANSPOSE, bool PAD, bool STATS = false>
__device__ __forceinline__ void layernorm_rows(
    const T* __restrict__ x, const P* __restrict__ weight, const P* __restrict__ bias, u8* __restrict__ q,
    u8* __restrict__ q_t, float* __restrict__ mean_out, float* __restrict__ rstd_out, const float* __restrict__ scale,
    float* amax, float* scale_out, float* scale_inv_out, float* scale_inv_used, const int* updates, i64 rows,
    i64 cols, i64 prows, i64 pcols, int tpr, int tile_rows, int vec, int vec_t, float eps, float margin_factor)
{
    extern __shared__ __align__(16) u8 tile[];       // [tile_rows][pitch] when q_t
    __shared__ float red[2][LN_THREADS / 32];         // per-warp partial sums (sum, sum of squares)
    static_assert(!(STATS && (STORE || PAD)), "the statistics launch writes no FP8");
    if (!STORE && !STATS && *updates != 0) return;  // pre-pass only runs on a first step
    float s = 1.0f;
    bool fresh = false;
    if (STORE) {
        fresh = launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, &s);
        if (blockIdx.x == 0 && threadIdx.x == 0) publish_scale(fresh, s, scale_out, scale_inv_out, scale_inv_used);
    }
    constexpr bool transposed = STORE && TRANSPOSE;
    const int t = threadIdx.x & (tpr - 1), lr = threadIdx.x / tpr, per_pass = blockDim.x / tpr;
    const int lane = threadIdx.x & 31, wr = t >> 5, warps = tpr >> 5;
    const i64 nchunks = (cols + LN_CHUNK - 1) / LN_CHUNK;
    const int steps = (int)((nchunks + tpr - 1) / tpr);
    const int group_rows = transposed ? tile_rows : per_pass;
    const i64 groups = ((PAD ? prows : rows) + group_rows - 1) / group_rows;
    const i64 qcols = PAD ? pcols : cols;  // the row pitch of q
    const i64 pitch = (qcols + 15) & ~(i64)15;
    const float n = (float)cols;  // exact: cols < 2**24
    const bool affine = weight != nullptr && bias != nullptr;
    u32 m = 0;
    // One row (r = r0 + tr) of one pass. VEC: whole chunks, 16-byte loads issued together and
    // predicated (a missing chunk reads as +0: it adds nothing), no branch between them; else
    // element loads within the row. Three variants: vector loads with weight and bias (the fast
    // path), vector loads with a null weight or bias, element loads.
    auto row = [&](auto vec_tag, auto affine_tag, i64 r0, int tr) {
        constexpr bool VEC = decltype(vec_tag)::value;
        constexpr bool AFFINE = decltype(affine_tag)::value;  // weight and bias both given: no defaults to select
        const i64 r = r0 + tr;
        const bool active = r < rows;
        const T* xr = x + r * cols;
        Raw8<T> cache[LN_CACHED];
        int nks[LN_CACHED];
        float a[LN_CHUNK], e[LN_CHUNK];
        // valid columns of this thread's chunk k (0: none) and its first column
        auto valid = [&](int k, i64& col) -> int {
            const i64 c = (i64)k * tpr + t;
            col = c * LN_CHUNK;
            return active && c < nchunks ? (int)min((i64)LN_CHUNK, cols - col) : 0;
        };
        // pass 1: the sum
#pragma unroll
        for (int k = 0; k < LN_CACHED; ++k) {
            i64 col;
            nks[k] = valid(k, col);
            cache[k] = load_chunk<T, VEC>(xr + col, nks[k]);
        }
#pragma unroll
        for (int j = 0; j < LN_CHUNK; ++j) a[j] = 0.0f;
#pragma unroll
        for (int k = 0; k < LN_CACHED; ++k) {
            unpack<T>(cache[k], e);
#pragma unroll
            for (int j = 0; j < LN_CHUNK; ++j) a[j] = fadd(a[j], e[j]);
        }
        for (int k = LN_CACHED; k < steps; ++k) {  // rows wider than LN_CACHED chunks a thread
            i64 col;
            const int nk = valid(k, col);
            unpack<T>(load_chunk<T, VEC>(xr + col, nk), e);
#pragma unroll
            for (int j = 0; j < LN_CHUNK; ++j) a[j] = fadd(a[j], e[j]);
        }
        const float mean = fdiv(row_reduce(a, red[0] + lr * warps, lane, wr, warps), n);
        // pass 2: the sum of squares of the centred values (missing columns: exact zeros)
        auto squares = [&](const Raw8<T>& raw, int nk) {
            if (VEC && nk == 0) return;  // (VEC: whole chunks, so one test a chunk; adding +0 changes nothing)
            unpack<T>(raw, e);
#pragma unroll
            for (int j = 0; j < LN_CHUNK; ++j) {
                const float d = VEC || j < nk ? fsub(e[j], mean) : 0.0f;
                a[j] = fadd(a[j], fmul(d, d));
            }
        };
#pragma unroll
        for (int j = 0; j < LN_CHUNK; ++j) a[j] = 0.0f;
#pragma unroll
        for (int k = 0; k < LN_CACHED; ++k) squares(cache[k], nks[k]);
        for (int k = LN_CACHED; k < steps; ++k) {
            i64 col;
            const int nk = valid(k, col);
            squares(load_chunk<T, VEC>(xr + col, nk), nk);
        }
        const float var = fdiv(row_reduce(a, red[1] + lr * warps, lane, wr, warps), n);
        const float rstd = fdiv(1.0f, fsqrt(fadd(var, eps)));
        // pass 3: y, its amax, the FP8 bytes
        auto output = [&](const Raw8<T>& raw, i64 col, int nk) {
            if (nk == 0) return;
            float w[LN_CHUNK], b[LN_CHUNK];
            unpack<T>(raw, e);
            if (AFFINE) {
                unpack<P>(load_chunk<P, VEC>(weight + col, VEC ? LN_CHUNK : nk), w);
                unpack<P>(load_chunk<P, VEC>(bias + col, VEC ? LN_CHUNK : nk), b);
            } else {
                param_chunk<P, VEC>(weight, col, VEC ? LN_CHUNK : nk, 1.0f, w);
                param_chunk<P, VEC>(bias, col, VEC ? LN_CHUNK : nk, -0.0f, b);
            }
            u32 cm = 0;  // the chunk's amax bits
#pragma unroll
            for (int j = 0; j < LN_CHUNK; ++j) {
                const float y = fadd(fmul(fmul(fsub(e[j], mean), rstd), w[j]), b[j]);
                if (VEC || j < nk) cm = max(cm, abs_bits(y));
                e[j] = fmul(y, s);
            }
            m = max(m, cm);
            if (STORE) {
                const uint2 bytes = pack8<FMT>(e);
                u8* qr = q + r * qcols + col;
                if (VEC) {
                    *reinterpret_cast<uint2*>(qr) = bytes;
                } else {
                    for (int j = 0; j < nk; ++j) qr[j] = (u8)((j < 4 ? bytes.x : bytes.y) >> (8 * (j & 3)));
                }
                if (transposed) *reinterpret_cast<uint2*>(tile + tr * pitch + col) = bytes;
            }
        };
        if constexpr (!STATS) {
#pragma unroll
            for (int k = 0; k < LN_CACHED; ++k) output(cache[k], ((i64)k * tpr + t) * LN_CHUNK, nks[k]);
            for (int k = LN_CACHED; k < steps; ++k) {
                i64 col;
                const int nk = valid(k, col);
                output(load_chunk<T, VEC>(xr + col, nk), col, nk);
            }
        }
        if (PAD && r < prows) {  // the pad of q: an active row's columns cols.., a pad row's every column
            u8* qr = q + r * pcols;
            for (i64 c = (active ? cols : 0) + t; c < pcols; c += tpr) qr[c] = 0;
        }
        if ((STORE || STATS) && active && t == 0 && mean_out != nullptr) {
            mean_out[r] = canonical(mean);
            rstd_out[r] = canonical(rstd);
        }
    };
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const i64 r0 = g * group_rows;
        for (int p = 0; p < group_rows; p += per_pass) {
            if (vec && affine) row(Bool<true>(), Bool<true>(), r0, p + lr);
            else if (vec) row(Bool<true>(), Bool<false>(), r0, p + lr);
            else row(Bool<false>(), Bool<false>(), r0, p + lr);
        }
        if (transposed) {
            __syncthreads();
            store_transposed<PAD>(tile, q_t, rows, cols, prows, pcols, r0, pitch, tile_rows, vec_t);
            __syncthreads();  // the tile is rewritten by the next group
        }
    }
    if (!STATS && !fresh) block_amax_atomic<LN_THREADS>(m, amax, blockDim.x >> 5);  // on a first step the pre-pass did it
}

template <typename T, typename P, int FMT, bool STORE, bool TRANSPOSE, bool STATS = false>
__global__ void __launch_bounds__(LN_THREADS) layernorm_quantize(
    const T* __restrict__ x,          // [rows, cols] input
    const P* __restrict__ weight,     // [cols] or null (1)
    const P* __restrict__ bias,       // [cols] or null (-0)
    u8* __restrict__ q,               // [rows, cols] FP8 output (null in the pre-pass)
    u8* __restrict__ q_t,             // [cols, rows] transposed FP8 output, or null
    float* __restrict__ mean_out,     // [rows] or null
    float* __restrict__ rstd_out,     // [rows] or null
    const float* __restrict__ scale,  // [1] scale
    float* amax,                      // [1] amax slot, max-accumulated (NaN-propagating)
    float* scale_out,                 // [1] or null: first step writes the scale it used
    float* scale_inv_out,             // [1] or null: and its inverse
    float* scale_inv_used,            // [1] or null: 1 / the scale this launch used (any step)
    const int* updates,               // [1] or null: first-step flag (0 = first step)
    i64 rows, i64 cols,               // logical shape (cols >= 1)
    int tpr,                          // threads per row: a power of two, 32 .. blockDim
    int tile_rows,                    // rows per transposed tile (16, 8 or 4; a multiple of blockDim / tpr)
    int vec,                          // 1: x, weight, bias, q 16-byte aligned and cols % 8 == 0
    int vec_t,                        // 1: q_t 16-byte aligned and rows % tile_rows == 0
    float eps,                        // added to the variance
    float margin_factor)              // 2**margin, for the first-step scale
{
    layernorm_rows<T, P, FMT, STORE, TRANSPOSE, false, STATS>(x, weight, bias, q, q_t, mean_out, rstd_out, scale,
                                                              amax, scale_out, scale_inv_out, scale_inv_used, updates,
                                                              rows, cols, rows, cols, tpr, tile_rows, vec, vec_t, eps,
                                                              margin_factor);
}

// layernorm_quantize writing padded outputs (the quantize family's pad_to): the same parameters
// with the padded shape after the logical one; the main launch only (the first-step pre-pass
// only reads, the unpadded kernel's).
template <typename T, typename P, int FMT, bool TRANSPOSE>
__global__ void __launch_bounds__(LN_THREADS) layernorm_quantize_padded(
    const T* __restrict__ x,          // [rows, cols] input
    const P* __restrict__ weight,     // [cols] or null (1)
    const P* __restrict__ bias,       // [cols] or null (-0)
    u8* __restrict__ q,               // [prows, pcols] FP8 output, zeros outside [rows, cols]
    u8* __restrict__ q_t,             // [pcols, prows] transposed FP8 output, or null
    float* __restrict__ mean_out,     // [rows] or null
    float* __restrict__ rstd_out,     // [rows] or null
    const float* __restrict__ scale,  // [1] scale
    float* amax,                      // [1] amax slot, max-accumulated (NaN-propagating)
    float* scale_out,                 // [1] or null: first step writes the scale it used
    float* scale_inv_out,             // [1] or null: and its inverse
    float* scale_inv_used,            // [1] or null: 1 / the scale this launch used (any step)
    const int* updates,               // [1] or null: first-step flag (0 = first step)
    i64 rows, i64 cols,               // logical shape (rows, cols >= 1)
    i64 prows, i64 pcols,             // padded shape of q (q_t: pcols x prows), >= rows, cols
    int tpr,                          // threads per row: a power of two, 32 .. blockDim
    int tile_rows,                    // rows per transposed tile (16, 8 or 4; a multiple of blockDim / tpr)
    int vec,                          // 1: x, weight, bias, q 16-byte aligned and cols % 8 == 0 == pcols % 8
    int vec_t,                        // 1: q_t 16-byte aligned and prows % tile_rows == 0
    float eps,                        // added to the variance
    float margin_factor)              // 2**margin, for the first-step scale
{
    layernorm_rows<T, P, FMT, true, TRANSPOSE, true>(x, weight, bias, q, q_t, mean_out, rstd_out, scale, amax,
                                                     scale_out, scale_inv_out, scale_inv_used, updates, rows, cols,
                                                     prows, pcols, tpr, tile_rows, vec, vec_t, eps, margin_factor);
}

// ---------------------------------------------------------------------------------------------
// transpose_fp8: the FP8 bytes q (prows x pcols, row-major: the padded q of layernorm_quantize, zeros in
// its pad) written transposed into q_t (pcols x prows). It is the second launch of layernorm_quantize with
// q_t from LN_SPLIT_COLS columns on (fusedfp8/launch/plans.py build_layernorm_plan): the LayerNorm kernel
// without its shared tile, then this one. Why: the fused kernel's tile holds tile_rows whole rows of q (16 at 4096 columns,
// 8 at 16384: 128 KiB of the block's shared memory), so each column of q_t gets tile_rows contiguous
// bytes a store, and a wide row leaves one block of 16 warps per multiprocessor working on one row at a
// time; this kernel writes full 128-byte lines of q_t from 128 x 64-byte tiles at the cost of reading q
// once more (1 byte an element against the 4 of bf16 x in and q, q_t out).
// The tile and the transposed store are quantize_tiled's (common.cuh: tile_at, store_tile_t). Thread t
// loads rows t/4 and t/4 + 64, columns 16 (t % 4)..+15 of a tile (one 16-byte load a row when vec: q
// 16-byte aligned and pcols % 16 == 0; else byte loads within bounds, zeros past them, which are never
// stored); the next tile's loads are issued before the current tile is stored; two tiles alternate in
// shared memory (one barrier a tile). Block 256, grid min(tiles, resident blocks), grid-stride; the tile
// coordinates advance by the grid in both dimensions (no division in the loop).
__global__ void __launch_bounds__(256) transpose_fp8(const u8* __restrict__ q, u8* __restrict__ q_t, i64 prows,
                                                     i64 pcols, int vec, int vec_t) {
    __shared__ __align__(16) u8 tile[2][TILE_R * TILE_C];
    const int t = threadIdx.x, lr = t >> 2, lc = (t & 3) * 16;
    const TileLanes lanes = tile_lanes(t);
    const int wr_base = tile_at(lr, lc);  // row lr + 64 p at wr_base + 4096 p, its 8-byte halves swapped for p = 1
    const bool t16 = vec_t && (prows & 15) == 0 && (reinterpret_cast<u64>(q_t) & 15) == 0;
    const u32 tiles_c = (u32)((pcols + TILE_C - 1) / TILE_C), tiles_r = (u32)((prows + TILE_R - 1) / TILE_R);
    const i64 ntiles = (i64)tiles_r * tiles_c;
    const u32 step_r = gridDim.x / tiles_c, step_c = gridDim.x % tiles_c;
    auto load = [&](uint4* v, u32 tr, u32 tc) {
        const i64 gc = (i64)tc * TILE_C + lc;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const i64 gr = (i64)tr * TILE_R + lr + 64 * p;
            const u8* src = q + gr * pcols + gc;
            if (vec && gr < prows && gc < pcols) {  // (vec: pcols % 16 == 0, so all 16 columns are inside)
                v[p] = ldg_nc16(src);
            } else {
                u32 w[4] = {0u, 0u, 0u, 0u};
                if (gr < prows) {
#pragma unroll
                    for (int j = 0; j < 16; ++j)
                        if (gc + j < pcols) w[j >> 2] |= (u32)src[j] << (8 * (j & 3));
                }
                v[p] = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    };
    u32 tr = blockIdx.x / tiles_c, tc = blockIdx.x % tiles_c;
    uint4 cur[2], nxt[2];
    if (blockIdx.x < ntiles) load(cur, tr, tc);
    int buf = 0;
    for (i64 id = blockIdx.x; id < ntiles; id += gridDim.x) {
        u32 ntr = tr + step_r, ntc = tc + step_c;
        if (ntc >= tiles_c) { ntc -= tiles_c; ++ntr; }
        if (id + gridDim.x < ntiles) load(nxt, ntr, ntc);  // in flight while this tile is stored
        u8* tl = tile[buf];
        *reinterpret_cast<uint4*>(tl + wr_base) = cur[0];
        *reinterpret_cast<uint4*>(tl + wr_base + 4096) = make_uint4(cur[1].z, cur[1].w, cur[1].x, cur[1].y);
        __syncthreads();
        store_tile_t(tl, q_t, lanes, (i64)tr * TILE_R, (i64)tc * TILE_C, prows, pcols, t16);
        buf ^= 1;
        tr = ntr;
        tc = ntc;
        cur[0] = nxt[0];
        cur[1] = nxt[1];
    }
}
