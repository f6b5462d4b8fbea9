// fusedfp8: current scaling in ONE launch. The quantize kernels of quantize.cu (flat and tiled, every
// T / FMT / OP, transpose, dbias, padding) instantiated with the GridAmax and ChipAmax policies: on a first step
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
// (fusedfp8.csrc.plan: the launch step's `coop`).
// On chip: each thread's first 16-element vector (flat) or each block's first tile (tiled, 2 rows x 16
// columns a thread) is loaded once, into registers, before the barrier and cast from there after it.
// GridAmax: the rest of a block's share is read twice, the second time mostly from L2 (50 MB on an
// H200). ChipAmax (the default where at least half the tensor stays on chip; fusedfp8._cuda.chip_stage
// sizes it): the next vectors / tiles also go to the launch's dynamic shared memory during the amax pass
// (cp.async) and the cast takes them from there; only what does not fit is read twice. An H200 holds
// 132 x (64 KB of first vectors in registers + up to ~220 KB of shared memory): bf16 4096x4096 whole
// (flat). The amax pass walks what is read twice backwards, so that the cast, which walks it forwards,
// first reads what was read last (a tensor near the L2's size is not evicted just ahead of its second read).
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

struct GridAmax : StagedAmax {  // (the casts load from memory: StagedAmax's fetch_*)
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

// ---- ChipAmax: the block's share kept on chip -----------------------------------------------------
// As GridAmax, and the amax pass also copies the block's next vectors (flat) / tiles (tiled) into the
// launch's dynamic shared memory (cp.async: 16-byte copies that hold no register and all fly at once),
// so the cast after the barrier takes them from there instead of reading memory again: with the
// thread's first vector / the block's first tile in registers (xc / bc, as GridAmax), a tensor whose
// share fits in the registers and the dynamic shared memory of the grid is read from HBM once. The
// plan sizes the dynamic shared memory (fusedfp8._cuda.chip_stage); the kernel reads it from
// %dynamic_smem_size, so the launch signature is quantize.cu's. What does not fit (a thread's vectors /
// a block's tiles past the slots) is read twice, the amax pass walking it backwards as GridAmax does.
// Slot layout: 16-byte chunk c of slot k of thread t at stage[(k * CHUNKS + c) * BLOCK + t], CHUNKS the
// 16-byte loads of a vector / a thread's part of a tile (x's, then b's for OP 3/4): a warp's copies and
// reads of one chunk are 512 consecutive bytes (no bank conflict). Each thread reads back only what it
// copied itself (cp.async.wait_all makes that visible to it: no block barrier needed for the data).
extern __shared__ __align__(16) uint4 ff8_stage[];

__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cp_async16(uint4* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(smem)), "l"(gmem)
                 : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

template <int CHUNKS, int BLOCK> struct Slots {
    static __device__ __forceinline__ int count() { return (int)(dynamic_smem_bytes() / (16u * CHUNKS * BLOCK)); }
    // chunk c of slot k (k >= 1: the thread's / block's k-th vector / tile; k = 0 is in registers)
    static __device__ __forceinline__ uint4* at(int k, int c) {
        return ff8_stage + ((k - 1) * CHUNKS + c) * BLOCK + threadIdx.x;
    }
    // slot k -> xr / br (n 16-byte chunks each, b's after x's)
    template <int N, bool B>
    static __device__ __forceinline__ void read(int k, uint4* xr, uint4* br) {
#pragma unroll
        for (int c = 0; c < N; ++c) {
            xr[c] = *at(k, c);
            if (B) br[c] = *at(k, N + c);
        }
    }
};

struct ChipAmax {
    // Every thread's first vector stays in registers: the more resident threads, the more of the tensor
    // fits on chip. bf16 identity: 32 registers, a full multiprocessor (2048 threads), no spill (ptxas
    // gives it 40 unbounded; GridAmax's has 32); the others as ptxas chooses (float16 would spill).
    template <typename T, int OP> __host__ __device__ static constexpr int flat_min_blocks() {
        return flat_min_blocks_of((T*)nullptr, OP);
    }
    __host__ __device__ static constexpr int flat_min_blocks_of(const __nv_bfloat16*, int op) {
        return op == 0 ? 2048 / FF8_THREADS : 0;
    }
    __host__ __device__ static constexpr int flat_min_blocks_of(const void*, int) { return 0; }
    template <typename T, int OP> using FlatSlots = Slots<(int)sizeof(T) * (OP >= 3 ? 2 : 1), FF8_THREADS>;
    template <typename T, int OP> using TileSlots = Slots<T2_LOADS * (OP >= 3 ? 2 : 1), 256>;

    template <typename T, int FMT, int OP, bool VEC>
    static __device__ __forceinline__ bool flat(const T* x, const T* b, i64 n, const uint4* xc, const uint4* bc,
                                                const float* scale, float* amax, const int* updates,
                                                float margin_factor, float* s) {
        if (!first_step(updates)) return launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, s);
        constexpr int LOADS = (int)sizeof(T);
        using S = FlatSlots<T, OP>;
        const i64 tid = (i64)blockIdx.x * FF8_THREADS + threadIdx.x, nthreads = (i64)gridDim.x * FF8_THREADS;
        const i64 nvec = VEC ? n / 16 : 0;
        u32 m = 0;
        if (VEC && tid < nvec) {
            const int last = (int)((nvec - 1 - tid) / nthreads), staged = min(last, S::count());  // 1..staged: slots
            for (int k = 1; k <= staged; ++k) {
                const i64 i = tid + (i64)k * nthreads;
#pragma unroll
                for (int c = 0; c < LOADS; ++c) {
                    cp_async16(S::at(k, c), x + i * 16 + c * (16 / LOADS));
                    if (OP >= 3) cp_async16(S::at(k, LOADS + c), b + i * 16 + c * (16 / LOADS));
                }
            }
            m = vec_amax<T, OP>(xc, bc, m);
            for (int k = last; k > staged; --k)  // backwards
                m = loaded_vec_amax<T, OP>(x, b, tid + (i64)k * nthreads, m);
            cp_async_wait_all();
            for (int k = 1; k <= staged; ++k) {
                uint4 xr[LOADS], br[OP >= 3 ? LOADS : 1];
                S::template read<LOADS, OP >= 3>(k, xr, br);
                m = vec_amax<T, OP>(xr, br, m);
            }
        }
        for (i64 i = nvec * 16 + tid; i < n; i += nthreads) m = elem_amax<T, OP>(x, b, i, m);
        return stage_and_scale<FF8_THREADS, FMT>(m, scale, amax, updates, margin_factor, s);
    }
    template <typename T, int OP>
    static __device__ __forceinline__ bool fetch_flat(bool fresh, int k, uint4* xr, uint4* br) {
        using S = FlatSlots<T, OP>;
        if (!fresh || k > S::count()) return false;  // (k <= the thread's last vector: staged)
        S::template read<(int)sizeof(T), OP >= 3>(k, xr, br);
        return true;
    }

    // Tiles 1..staged of the block that are full (and `vec`) go to the slots; edge tiles are read row by row
    // (load_row16) in the amax pass and in the cast, as GridAmax does.
    template <typename T, int FMT, int OP>
    static __device__ __forceinline__ bool tiled(const T* x, const T* b, i64 rows, i64 cols, i64 prows, i64 pcols,
                                                 int vec, const uint4* xc, const uint4* bc, bool fast,
                                                 const float* scale, float* amax, const int* updates,
                                                 float margin_factor, float* s) {
        if (!first_step(updates)) return launch_scale(scale, amax, updates, FormatMax<FMT>::value, margin_factor, s);
        constexpr int PER_ROW = T2_LOADS / 2, ELEMS = 16 / (int)sizeof(T);
        using S = TileSlots<T, OP>;
        const int lr = threadIdx.x >> 2, lc = (threadIdx.x & 3) * 16;
        const i64 tiles_c = (pcols + TILE_C - 1) / TILE_C, ntiles = (prows + TILE_R - 1) / TILE_R * tiles_c;
        const int last = (int)((ntiles - 1 - blockIdx.x) / gridDim.x);  // (grid <= ntiles)
        const int staged = min(last, S::count());
        auto corner = [&](int k, i64& r0, i64& c0) {  // tile k's corner; whether it is full (and vec)
            const i64 id = blockIdx.x + (i64)k * gridDim.x;
            r0 = id / tiles_c * TILE_R;
            c0 = id % tiles_c * TILE_C;
            return vec && r0 + TILE_R <= rows && c0 + TILE_C <= cols;
        };
        for (int k = 1; k <= staged; ++k) {
            i64 r0, c0;
            if (!corner(k, r0, c0)) continue;
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const i64 off = (r0 + lr + 64 * p) * cols + c0 + lc;
#pragma unroll
                for (int c = 0; c < PER_ROW; ++c) {
                    cp_async16(S::at(k, p * PER_ROW + c), x + off + c * ELEMS);
                    if (OP >= 3) cp_async16(S::at(k, T2_LOADS + p * PER_ROW + c), b + off + c * ELEMS);
                }
            }
        }
        u32 m = 0;
        if (fast) {
#pragma unroll
            for (int p = 0; p < 2; ++p) m = vec_amax<T, OP>(xc + p * PER_ROW, bc + p * PER_ROW, m);
        }
        for (int k = last; k >= 0; --k) {  // backwards: what is read again, and the edge tiles
            i64 r0, c0;
            const bool full = corner(k, r0, c0);
            if (k == 0 ? !fast : k > staged || !full) m = loaded_tile_amax<T, OP>(x, b, rows, cols, vec, r0, c0, m);
        }
        cp_async_wait_all();
        for (int k = 1; k <= staged; ++k) {
            i64 r0, c0;
            if (!corner(k, r0, c0)) continue;
            uint4 xr[T2_LOADS], br[OP >= 3 ? T2_LOADS : 1];
            S::template read<T2_LOADS, OP >= 3>(k, xr, br);
#pragma unroll
            for (int p = 0; p < 2; ++p) m = vec_amax<T, OP>(xr + p * PER_ROW, br + p * PER_ROW, m);
        }
        return stage_and_scale<256, FMT>(m, scale, amax, updates, margin_factor, s);
    }
    template <typename T, int OP>
    static __device__ __forceinline__ bool fetch_tiled(bool fresh, int k, uint4* xr, uint4* br) {
        using S = TileSlots<T, OP>;
        if (!fresh || k > S::count()) return false;  // (called for a full tile of the block: staged)
        S::template read<T2_LOADS, OP >= 3>(k, xr, br);
        return true;
    }
};
