// fusedfp8: current scaling in ONE launch. The quantize kernels of quantize.cu (flat and tiled, every
// T / FMT / OP, transpose, dbias, padding) instantiated with the GridAmax policy: on a first step
// (*updates == 0, every step under CurrentScaling) each block first computes the amax of the elements
// it will quantize, max-accumulates it into the amax slot (block_amax_atomic, one atomic per block, as
// the pre-pass of the two-launch path does), and the grid waits at a grid-wide barrier; then every
// block reads the slot, now max(slot, amax of the whole tensor), takes the scale from it
// (launch_scale, common.cuh) and casts. The slot ends with the same bits as after the pre-pass
// (a max is exact and order-free, a NaN is canonicalised per block in both), so the scale, q, q_t,
// dbias and the state are byte-for-byte those of the two-launch path, and of the reference.
// Off a first step (*updates != 0) nothing above runs: the kernel is quantize.cu's, amax at the end.
//
// Grid / block: those of quantize_flat / quantize_tiled (FF8_THREADS / 256 threads; grid at most the
// resident blocks, which a cooperative launch requires: the driver refuses a larger grid rather than
// letting the barrier wait for a block that never runs). Launched with cuLaunchCooperativeKernel
// (fusedfp8.launch.format: the launch step's `coop`).
// On chip: each thread's first 16-element vector (flat) or each block's first tile (tiled, 2 rows x 16
// columns a thread) is loaded once, into registers, before the barrier and cast from there after it.
// The rest of a block's share is read twice, the second time mostly from L2 (50 MB on an H200). (Keeping
// it in shared memory through the barrier as well was slower: fewer resident blocks, and the same grid
// for the later steps of the delayed recipe.) The amax pass walks what is read twice backwards, so
// that the cast, which walks it forwards, first reads what was read last (a tensor near the L2's size
// is not evicted just ahead of its second read).
// Barrier: the driver's grid workspace that a cooperative launch provides (what cooperative_groups'
// grid.sync() uses; its headers need libcu++, which NVRTC does not find here): a self-resetting
// arrive counter whose top bit flips once every block has arrived. No workspace of ours, no memset.
//
// Edge cases: as quantize.cu (NaN -> amax NaN, scale kept; inf -> amax inf, scale kept; amax 0 ->
// scale kept; tiny amax -> FLT_MAX), decided by launch_scale from the slot, as in the two-pass path.

#include "quantize.cu"

// Grid-wide barrier of a cooperative launch: cooperative_groups/details/driver_abi.h (the workspace
// address in %envreg1:%envreg2, the barrier word after its size) and sync.h (block 0 adds
// 2**31 - (blocks - 1), every other block 1: the word's top bit flips when the last block arrives).
// A launch that is not cooperative has no workspace: trap rather than hang.
__device__ __forceinline__ void grid_sync() {
    u32 hi, lo;
    asm volatile("mov.u32 %0, %%envreg1;" : "=r"(hi));
    asm volatile("mov.u32 %0, %%envreg2;" : "=r"(lo));
    u32* bar = reinterpret_cast<u32*>(((u64)hi << 32) | lo) + 1;
    __syncthreads();
    if (threadIdx.x == 0) {
        if (hi == 0u && lo == 0u) __trap();
        const u32 nb = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1u) : 1u;
        u32 old, cur;
        asm volatile("atom.add.release.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(bar), "r"(nb) : "memory");
        do {
            asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(cur) : "l"(bar) : "memory");
        } while (((old ^ cur) & 0x80000000u) == 0u);
    }
    __syncthreads();
}

// The amax of a thread's elements of 16-element vector i (16-byte loads) and of element i.
template <typename T, int OP>
__device__ __forceinline__ u32 vec_amax(const uint4* xc, const uint4* bc, u32 m) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
        m = amax_update<OP>(m, apply_op<OP>(raw_elem<T>(xc, j), OP >= 3 ? raw_elem<T>(bc, j) : 0.0f));
    return m;
}
template <typename T, int OP>
__device__ __forceinline__ u32 elem_amax(const T* x, const T* b, i64 i, u32 m) {
    return amax_update<OP>(m, apply_op<OP>(to_f32(x[i]), OP >= 3 ? to_f32(b[i]) : 0.0f));
}
// ... of vector i read from memory (quantize_flat's loads), and of the thread's part of the tile at (r0, c0)
// read from memory (quantize_tiled's: rows lr, lr + 64, columns lc..lc+15; 16-byte loads when the tile is
// full and `vec`, else row by row as the cast loads it (load_row16): only the rows x cols corner counts,
// the zeros past it (op(0) = +-0) take no part).
template <typename T, int OP>
__device__ __forceinline__ u32 loaded_vec_amax(const T* x, const T* b, i64 i, u32 m) {
    constexpr int LOADS = (int)sizeof(T);
    uint4 xr[LOADS], br[OP >= 3 ? LOADS : 1];
#pragma unroll
    for (int k = 0; k < LOADS; ++k) {
        xr[k] = ldg_nc16(x + i * 16 + k * (16 / LOADS));
        if (OP >= 3) br[k] = ldg_nc16(b + i * 16 + k * (16 / LOADS));
    }
    return vec_amax<T, OP>(xr, br, m);
}
template <typename T, int OP>
__device__ __forceinline__ u32 loaded_tile_amax(const T* x, const T* b, i64 rows, i64 cols, int vec, i64 r0, i64 c0,
                                                u32 m) {
    constexpr int PER_ROW = T2_LOADS / 2, ELEMS = 16 / (int)sizeof(T);
    const int lr = threadIdx.x >> 2, lc = (threadIdx.x & 3) * 16;
    if (vec && r0 + TILE_R <= rows && c0 + TILE_C <= cols) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const i64 off = (r0 + lr + 64 * p) * cols + c0 + lc;
            uint4 xr[PER_ROW], br[OP >= 3 ? PER_ROW : 1];
#pragma unroll
            for (int k = 0; k < PER_ROW; ++k) {
                xr[k] = ldg_nc16(x + off + k * ELEMS);
                if (OP >= 3) br[k] = ldg_nc16(b + off + k * ELEMS);
            }
            m = vec_amax<T, OP>(xr, br, m);
        }
    } else {  // an edge tile (or a tensor that is not vec)
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            uint4 xr[PER_ROW], br[OP >= 3 ? PER_ROW : 1];
            load_row16<T, OP>(x, b, rows, cols, r0 + lr + 64 * p, c0 + lc, vec, xr, br);
            m = vec_amax<T, OP>(xr, br, m);
        }
    }
    return m;
}

// A first step (the flag 0): the amax in this launch. Else the kernel is quantize.cu's (the state's scale).
__device__ __forceinline__ bool first_step(const int* updates) { return updates != nullptr && *updates == 0; }

// Stage the block's amax in the slot, wait for every block, and take the scale from the slot.
template <int THREADS, int FMT>
__device__ __forceinline__ bool stage_and_scale(u32 m, const float* scale, float* amax, const int* updates,
                                                float margin_factor, float* s) {
    block_amax_atomic<THREADS>(m, amax);
    grid_sync();
    const float a = __ldcg(amax);  // (from L2: the atomics went there, this SM's L1 may hold nothing newer)
    return launch_scale(scale, &a, updates, FormatMax<FMT>::value, margin_factor, s);
}

struct GridAmax {
    // quantize_flat: vector i of thread tid is tid + k * nthreads; the first is in xc / bc.
    template <typename T, int FMT, int OP, bool VEC>
    static __device__ __forceinline__ bool flat(const T* x, const T* b, i64 n, const uint4* xc, const uint4* bc,
                                                const float* scale, float* amax, const int* updates,
                                                float margin_factor, float* s) {
        if (!first_step(updates)) return launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, s);
        const i64 tid = (i64)blockIdx.x * FF8_THREADS + threadIdx.x, nthreads = (i64)gridDim.x * FF8_THREADS;
        const i64 nvec = VEC ? n / 16 : 0;
        u32 m = 0;
        if (VEC && tid < nvec) {
            m = vec_amax<T, OP>(xc, bc, m);
            for (i64 i = tid + (nvec - 1 - tid) / nthreads * nthreads; i > tid; i -= nthreads)  // backwards
                m = loaded_vec_amax<T, OP>(x, b, i, m);
        }
        for (i64 i = nvec * 16 + tid; i < n; i += nthreads) m = elem_amax<T, OP>(x, b, i, m);
        return stage_and_scale<FF8_THREADS, FMT>(m, scale, amax, updates, margin_factor, s);
    }

    // quantize_tiled: the block's tiles are blockIdx.x + k * gridDim.x over the padded tile grid; the
    // thread's part of a tile is rows lr, lr + 64 and columns lc..lc+15; the first tile is in xc / bc
    // when `fast` (zeros past the edge). Only the rows x cols corner counts (the pad takes no part in
    // the amax): an edge tile is loaded row by row as the cast loads it (load_row16: 16-byte loads
    // for a row wholly inside, element loads where a row crosses cols, nothing past rows).
    template <typename T, int FMT, int OP>
    static __device__ __forceinline__ bool tiled(const T* x, const T* b, i64 rows, i64 cols, i64 prows, i64 pcols,
                                                 int vec, const uint4* xc, const uint4* bc, bool fast,
                                                 const float* scale, float* amax, const int* updates,
                                                 float margin_factor, float* s) {
        if (!first_step(updates)) return launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, s);
        constexpr int PER_ROW = T2_LOADS / 2;
        const i64 tiles_c = (pcols + TILE_C - 1) / TILE_C, ntiles = (prows + TILE_R - 1) / TILE_R * tiles_c;
        u32 m = 0;
        const i64 last = blockIdx.x + (ntiles - 1 - blockIdx.x) / gridDim.x * gridDim.x;  // (grid <= ntiles)
        for (i64 id = last; id >= (i64)blockIdx.x; id -= gridDim.x) {  // backwards
            if (id == blockIdx.x && fast) {
#pragma unroll
                for (int p = 0; p < 2; ++p) m = vec_amax<T, OP>(xc + p * PER_ROW, bc + p * PER_ROW, m);
            } else {
                m = loaded_tile_amax<T, OP>(x, b, rows, cols, vec, id / tiles_c * TILE_R, id % tiles_c * TILE_C, m);
            }
        }
        return stage_and_scale<256, FMT>(m, scale, amax, updates, margin_factor, s);
    }
};
