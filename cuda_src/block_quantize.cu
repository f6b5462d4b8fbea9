// fusedfp8: block scaling in one pass. A 2-D input (rows x cols, row-major) is read once and written as
// FP8 with one scale per block, plus optionally the transposed copy with the scales its own GEMM needs
// and, for a gradient, its column sums (the bias gradient). What is quantized is y = op(x) (OP, as
// quantize_tiled's: the identity, gelu, or dy * gelu'(x) with x the second input b), computed once per
// element in float32 and kept in registers for both casts:
//   SQUARE = false, 1x128 blocks (activations, gradients): q with a scale per 128 consecutive elements
//     of a row; q_t (the transpose) with its own scale per 128 consecutive elements of a column of x,
//     both from the same 128x128 tile in registers and shared memory;
//   SQUARE = true, 128x128 blocks (weights): q with one scale per 128x128 tile; q_t the same bytes
//     transposed, its scales the same values transposed.
// The rule, the scale layout and the edge cases are those of fusedfp8/numerics/block.py, byte for byte:
//   amax of a block   exact max |x| (as bits: NaN sorts above inf), the pad's zeros take no part
//   scale             scale_from_amax(amax, fmt_max, 1) (the update rule's formula: fmt_max / amax, one
//                     div.rn, FLT_MAX where inf; the division by 1 is exact); 1 where the amax is 0
//                     (either sign), inf or NaN; with pow2 its mantissa bits cleared (rounded down to
//                     a power of two)
//   q                 cvt.rn.satfinite(fmul(x, scale)): NaN -> 0x7f, +-inf and overflow -> +-max
//   scale_inv         fdiv(1, scale)
//   amax (optional)   max |y| of the whole tensor, max-accumulated as every quantize kernel's
//   dbias (optional)  column sums of y (1x128 only: OP 3/4, and the identity's HAS_DBIAS instantiation):
//                     per 128 x 128 tile, each thread adds its 4 rows in order, the 4 lanes that share
//                     columns add pairwise (two xor shuffles), one thread per column adds the 8 warps in
//                     order into the tile's row of `partial`; after its last tile a block counts its tiles
//                     on their 128-column strips' counters and the block that completes a strip adds its
//                     partials in tile order (finish_dbias<128>). The order is the tile's: the bits do
//                     not depend on the grid. Pad rows and columns add +0.
// Scale layout (cuBLASLt's VEC128_32F / BLK128x128_32F scale modes; float32, row-major, pad4(n) = n
// rounded up to a multiple of 4, pad entries 1.0, the scale_inv of an all-zero block):
//   1x128    of an (R, C) operand: [ceil(C / 128)][pad4(R)], element [k][r] = row r's K block k
//   128x128  of an (R, C) operand: [ceil(R / 128)][pad4(ceil(C / 128))], element [i][k] = tile (i, k)
// where (R, C) is (prows, pcols) for q and (pcols, prows) for q_t. Padding (prows >= rows, pcols >= cols):
// q and q_t hold zeros outside rows x cols, and every scale is that of the zero-padded input.
//
// LayerNorm (LN, 1x128, the identity, no dbias): y = ((x - mean) * rstd) * weight + bias, the fused
// LayerNorm's y op for op (layernorm_quantize.cu: fsub, fmul, fmul, fadd; weight null: 1, bias null:
// -0), from the per-row mean and rstd that layernorm_quantize's statistics launch (STATS) wrote just
// before, in its fixed summation order; the pad is +0 (zeros of y). x is read twice (statistics, then
// here) so that a 128-row tile of y exists for the transposed copy's column scales: a row of the
// LayerNorm kernel's own tile cannot hold 128 rows of a hidden-4096 y.
//
// Template parameters: T = float | __half | __nv_bfloat16 (input), FMT = 0 (E4M3) | 1 (E5M2), SQUARE,
// OP (0 identity | 1 gelu tanh | 2 gelu erf | 3 dgelu tanh | 4 dgelu erf; not 0 only with 1x128),
// HAS_DBIAS (the column sums' code compiled in; 1x128 only), P (LN's weight and bias, read as float32:
// the set of T), LN.
// Registers: the LayerNorm instantiation asks ptxas for two blocks a multiprocessor (left to itself it takes 145
// registers a thread with bfloat16 parameters: one block of 8 warps on each multiprocessor; at 128 it spills
// nothing); the others give no minimum (0), which leaves their allocation as ptxas chooses it.
// Grid: 1-D, any number of blocks (grid-stride over the 128x128 tiles of prows x pcols; the host takes
// min(tiles, resident blocks)); block: 256 threads (launch bounds).
// Thread t owns rows lr + 32 p (p = 0..3, lr = t / 8) and columns lc..lc+15 (lc = 16 (t % 8)) of a tile:
// 4 rows x 16 elements, loaded at once (16-byte loads for a row wholly inside when x is 16-byte aligned
// and a row is a multiple of 16 bytes; element loads and zeros at an edge: load_row16), kept raw in
// registers. The 8 threads of a row (lanes 8k..8k+7) reduce its amax with 3 shuffles and each casts its
// 16 elements with the row's scale: one 16-byte store of q per row. Columns (1x128 with q_t): the 4
// lanes of a warp that share columns reduce with 2 shuffles, the 8 warps through shared memory, and a
// thread per column takes its scale; then each thread casts its 4 x 16 elements again with the column
// scales into the swizzled 128 x 64-byte tiles of quantize_tiled (two halves, the second 64 bytes
// further so that a quarter warp's 16-byte stores into both hit distinct banks), and store_tile_t writes
// them transposed (full 128-byte lines of q_t). Three barriers a tile with q_t (1x128), one or two
// for 128x128, none for 1x128 without q_t (two with dbias and no q_t). One atomicMax per block for the
// tensor's amax. 0 elements: the host launches nothing (and zeroes dbias).

#include "quantize.cu"

// The scale of a block from its amax bits (numerics/block.py: block_scale).
template <int FMT> __device__ __forceinline__ float block_scale(u32 amax_bits, int pow2) {
    float s = 1.0f;
    if (amax_bits != 0u && amax_bits < 0x7f800000u)  // (finite and not 0: the bits of |x| order as the floats)
        s = scale_from_amax(__uint_as_float(amax_bits), FormatMax<FMT>::value, 1.0f);
    return pow2 ? __uint_as_float(__float_as_uint(s) & 0xff800000u) : s;
}

__device__ __forceinline__ i64 pad4(i64 n) { return (n + 3) & ~(i64)3; }

#define BQ_HALF (TILE_R * TILE_C + 64)  // bytes from one 128 x 64 half of the transposed tile to the other

// The thread's 16 bytes of tile row r, columns lc..lc+15, into the swizzled halves (tile_at; the
// 8-byte halves of a chunk swapped in rows 64..127).
__device__ __forceinline__ void put_tile(u8* tile, int r, int lc, u64 lo, u64 hi) {
    const int cc = lc & 63;
    u8* at = tile + (lc >> 6) * BQ_HALF + 64 * r + 16 * ((cc >> 4) ^ ((r >> 4) & 3));
    *reinterpret_cast<uint4*>(at) = (r >> 6) & 1 ? make_uint4((u32)hi, (u32)(hi >> 32), (u32)lo, (u32)(lo >> 32))
                                                 : make_uint4((u32)lo, (u32)(lo >> 32), (u32)hi, (u32)(hi >> 32));
}

template <typename T, int FMT, bool SQUARE, int OP = 0, bool HAS_DBIAS = (OP >= 3), typename P = T, bool LN = false>
__global__ void __launch_bounds__(256, LN ? 2 : 0) block_quantize(
    const T* __restrict__ x,              // [rows, cols] input (dy for OP 3/4)
    const T* __restrict__ b,              // [rows, cols] second input (x for OP 3/4), else null
    u8* __restrict__ q,                   // [prows, pcols] FP8 output
    float* __restrict__ scale_inv,        // q's scales, in the layout above
    u8* __restrict__ q_t,                 // [pcols, prows] transposed FP8 output, or null
    float* __restrict__ scale_inv_t,      // q_t's scales (with q_t)
    float* amax,                          // [1] or null: max |y|, max-accumulated
    float* __restrict__ dbias,            // [cols] column sums of y, or null
    float* __restrict__ partial,          // [ceil(prows / 128), cols] workspace for dbias, or null
    int* __restrict__ strip_count,        // [ceil(pcols / 128)] zeroed counters for dbias, or null
    const float* __restrict__ mean,       // LN: [rows] the rows' mean and rstd (the statistics launch), else null
    const float* __restrict__ rstd,
    const P* __restrict__ ln_weight,      // LN: [cols] or null (1)
    const P* __restrict__ ln_bias,        // LN: [cols] or null (-0)
    i64 rows, i64 cols,                   // logical shape
    i64 prows, i64 pcols,                 // padded shape, >= rows, cols
    int pow2)                             // 1: scales rounded down to powers of two
{
    static_assert(!SQUARE || (OP == 0 && !HAS_DBIAS), "128x128 blocks are a weight's: no activation, no dbias");
    static_assert(!LN || (!SQUARE && OP == 0 && !HAS_DBIAS), "the LayerNorm's output is an activation: 1x128");
    constexpr int L16 = (int)sizeof(T);  // 16-byte chunks per 16 elements
    __shared__ __align__(16) u8 tile[2 * BQ_HALF];
    __shared__ u32 colmax[8][128];        // 1x128 with q_t: each warp's column maxima
    __shared__ __align__(16) float colscale[128];
    __shared__ u32 warpmax[2][8];         // 128x128: each warp's max (two, alternating by tile)
    __shared__ float colsum[HAS_DBIAS ? 8 : 1][128];  // dbias: each warp's column sums
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, lr = t >> 3, lc = (t & 7) * 16;
    const i64 tiles_c = (pcols + 127) / 128, tiles_r = (prows + 127) / 128, ntiles = tiles_r * tiles_c;
    const bool vec = (reinterpret_cast<u64>(x) & 15) == 0 && (OP < 3 || (reinterpret_cast<u64>(b) & 15) == 0) &&
                     (cols * (i64)sizeof(T)) % 16 == 0;
    const bool with_dbias = HAS_DBIAS && dbias != nullptr;
    const int qmode = (reinterpret_cast<u64>(q) & 15) == 0 && (pcols & 15) == 0 ? 2
                      : (reinterpret_cast<u64>(q) & 7) == 0 && (pcols & 7) == 0 ? 1 : 0;
    const bool t16 = (prows & 15) == 0 && (reinterpret_cast<u64>(q_t) & 15) == 0;
    const TileLanes lanes = tile_lanes(t);
    const i64 ld = SQUARE ? pad4(tiles_c) : pad4(prows), ld_t = SQUARE ? pad4(tiles_r) : pad4(pcols);
    u32 m = 0;  // the thread's running amax (bits)
    int parity = 0;
    for (i64 id = blockIdx.x; id < ntiles; id += gridDim.x) {
        const i64 tr = id / tiles_c, tc = id % tiles_c, r0 = tr * 128, c0 = tc * 128;
        uint4 xc[4 * L16], bc[OP >= 3 ? 4 * L16 : 1];
#pragma unroll
        for (int p = 0; p < 4; ++p)
            load_row16<T, OP>(x, b, rows, cols, r0 + lr + 32 * p, c0 + lc, vec, xc + p * L16,
                              OP >= 3 ? bc + p * L16 : bc);
        float y[OP == 0 && !LN ? 1 : 64];  // op(x) of the thread's 4 x 16 elements (the pad's zeros give +0)
        if constexpr (LN) {
            float w[16], bb[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const bool in = c0 + lc + j < cols;
                w[j] = ln_weight != nullptr && in ? to_f32(ln_weight[c0 + lc + j]) : 1.0f;
                bb[j] = ln_bias != nullptr && in ? to_f32(ln_bias[c0 + lc + j]) : -0.0f;
            }
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const i64 gr = r0 + lr + 32 * p;
                const bool in = gr < rows;
                const float mu = in ? mean[gr] : 0.0f, rs = in ? rstd[gr] : 0.0f;
#pragma unroll
                for (int j = 0; j < 16; ++j)
                    y[16 * p + j] = in && c0 + lc + j < cols
                                        ? fadd(fmul(fmul(fsub(raw_elem<T>(xc + p * L16, j), mu), rs), w[j]), bb[j])
                                        : 0.0f;
            }
        } else if constexpr (OP != 0) {
#pragma unroll
            for (int p = 0; p < 4; ++p)
#pragma unroll
                for (int j = 0; j < 16; ++j)
                    y[16 * p + j] = apply_op<OP>(raw_elem<T>(xc + p * L16, j),
                                                 OP >= 3 ? raw_elem<T>(bc + p * L16, j) : 0.0f);
        }
        auto val = [&](int p, int j) -> float {  // element j of the thread's row p, as quantized
            if constexpr (OP == 0 && !LN) return raw_elem<T>(xc + p * L16, j);
            else return y[16 * p + j];
        };
        u32 rm[4], cm[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) cm[j] = 0u;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            rm[p] = 0u;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const u32 a = abs_bits(val(p, j));
                rm[p] = max(rm[p], a);
                cm[j] = max(cm[j], a);
            }
            m = max(m, rm[p]);
        }
        float s[4];  // the scale of each of the thread's rows
        if (SQUARE) {
            u32 w = max(max(rm[0], rm[1]), max(rm[2], rm[3]));
            for (int o = 16; o > 0; o >>= 1) w = max(w, __shfl_xor_sync(0xffffffffu, w, o));
            if (lane == 0) warpmax[parity][warp] = w;
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 8; ++k) w = max(w, warpmax[parity][k]);
            parity ^= 1;  // (the next tile writes the other one: no barrier needed before it)
            const float st = block_scale<FMT>(w, pow2);
#pragma unroll
            for (int p = 0; p < 4; ++p) s[p] = st;
            if (t == 0) {
                const float inv = fdiv(1.0f, st);
                scale_inv[tr * ld + tc] = inv;
                if (tc == tiles_c - 1)
                    for (i64 k = tiles_c; k < ld; ++k) scale_inv[tr * ld + k] = 1.0f;
                if (q_t != nullptr) {
                    scale_inv_t[tc * ld_t + tr] = inv;
                    if (tr == tiles_r - 1)
                        for (i64 k = tiles_r; k < ld_t; ++k) scale_inv_t[tc * ld_t + k] = 1.0f;
                }
            }
        } else {
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                u32 a = rm[p];
#pragma unroll
                for (int o = 1; o < 8; o <<= 1) a = max(a, __shfl_xor_sync(0xffffffffu, a, o));
                s[p] = block_scale<FMT>(a, pow2);
                const i64 gr = r0 + lr + 32 * p;
                if ((t & 7) == 0 && gr < ld) scale_inv[tc * ld + gr] = fdiv(1.0f, s[p]);
            }
        }
#pragma unroll
        for (int p = 0; p < 4; ++p) {  // q (and, for 128x128, the tile of q_t: the same bytes)
            float v[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) v[j] = fmul(val(p, j), s[p]);
            const u64 lo = cvt8<FMT>(v), hi = cvt8<FMT>(v + 8);
            const i64 gr = r0 + lr + 32 * p, gc = c0 + lc;
            const int nq = gr < prows ? (int)max((i64)0, min((i64)16, pcols - gc)) : 0;
            store16(q + gr * pcols + gc, lo, hi, nq, qmode);
            if (SQUARE && q_t != nullptr) put_tile(tile, lr + 32 * p, lc, lo, hi);
        }
        if (q_t == nullptr && !with_dbias) continue;
        if (!SQUARE) {  // the column scales (then the tile of q_t cast with them) and the column sums
            if (q_t != nullptr) {
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    cm[j] = max(cm[j], __shfl_xor_sync(0xffffffffu, cm[j], 8));
                    cm[j] = max(cm[j], __shfl_xor_sync(0xffffffffu, cm[j], 16));
                }
                if (lane < 8) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) colmax[warp][lc + j] = cm[j];
                }
            }
            if constexpr (HAS_DBIAS) {
                if (with_dbias) {
                    float cs[16];
#pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        cs[j] = fadd(fadd(fadd(val(0, j), val(1, j)), val(2, j)), val(3, j));
                        cs[j] = fadd(cs[j], __shfl_xor_sync(0xffffffffu, cs[j], 8));
                        cs[j] = fadd(cs[j], __shfl_xor_sync(0xffffffffu, cs[j], 16));
                    }
                    if (lane < 8) {
#pragma unroll
                        for (int j = 0; j < 16; ++j) colsum[warp][lc + j] = cs[j];
                    }
                }
            }
            __syncthreads();
            if (t < 128) {
                if (q_t != nullptr) {
                    u32 a = colmax[0][t];
#pragma unroll
                    for (int w = 1; w < 8; ++w) a = max(a, colmax[w][t]);
                    const float sc = block_scale<FMT>(a, pow2);
                    colscale[t] = sc;
                    if (c0 + t < ld_t) scale_inv_t[tr * ld_t + c0 + t] = fdiv(1.0f, sc);
                }
                if constexpr (HAS_DBIAS) {
                    if (with_dbias && c0 + t < cols) {
                        float acc = colsum[0][t];
#pragma unroll
                        for (int w = 1; w < 8; ++w) acc = fadd(acc, colsum[w][t]);
                        partial[tr * cols + c0 + t] = acc;
                    }
                }
            }
            __syncthreads();  // (without q_t: colsum is written again by the next tile)
            if (q_t == nullptr) continue;
            float cs[16];
#pragma unroll
            for (int j = 0; j < 16; j += 4) {
                const float4 f = *reinterpret_cast<const float4*>(&colscale[lc + j]);
                cs[j] = f.x;
                cs[j + 1] = f.y;
                cs[j + 2] = f.z;
                cs[j + 3] = f.w;
            }
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                float v[16];
#pragma unroll
                for (int j = 0; j < 16; ++j) v[j] = fmul(val(p, j), cs[j]);
                put_tile(tile, lr + 32 * p, lc, cvt8<FMT>(v), cvt8<FMT>(v + 8));
            }
        }
        __syncthreads();
        store_tile_t(tile, q_t, lanes, r0, c0, prows, pcols, t16);
        store_tile_t(tile + BQ_HALF, q_t, lanes, r0, c0 + 64, prows, pcols, t16);
    }
    if (amax != nullptr) block_amax_atomic<256>(m, amax);
    if constexpr (HAS_DBIAS) {
        if (with_dbias)
            finish_dbias<128>(dbias, partial, strip_count, cols, (u32)tiles_r, (u32)tiles_c, ntiles);
    }
}
