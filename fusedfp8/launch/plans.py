"""The launch plans of every kernel family, as pure data: the buffer slots of each family (by
name, the order written once), the tile geometry, the kernels' parameter layouts
(:data:`SIGNATURES`), grids, the workspaces' shapes and the ``build_*_plan`` functions, which
build a :class:`~fusedfp8.launch.format.Plan` from :class:`KernelRef` s. Nothing here touches a
device: :mod:`fusedfp8.launch` compiles the kernels, reads the device's occupancy and caches the
plans built here per signature; tests build the same plans from made-up kernel references.

The kernels hold the same numbers: tests/kernels/test_launch_layout.py holds the slots against the
C++ shim's (torch_ops.cc), the parameter layouts against the kernels' parameter lists in
``cuda_src/*.cu``, and the geometry against the constants of the ``.cu`` files.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from ..numerics import block as _bk
from ..numerics import layernorm as _ln
from .format import NULLPTR, Launch, Memset, Plan, Slots, Variant, flag, imm32, imm64, immf32, make_plan, mask, ptr

# ---- the buffers of each family, by name: the order the pointers come in --------------------------
QUANTIZE_SLOTS = Slots("x", "b", "q", "q_t", "dbias", "partial", "counters", "scale", "amax", "scale_out",
                       "scale_inv_out", "scale_inv_used", "updates")
LAYERNORM_SLOTS = Slots("x", "weight", "bias", "q", "q_t", "mean", "rstd", "scale", "amax", "scale_out",
                        "scale_inv_out", "scale_inv_used", "updates")
DEQUANTIZE_SLOTS = Slots("q", "out", "scale_inv")
UPDATE_SLOTS = Slots("amax_history", "scale", "scale_inv", "overflows", "updates", "fmt_max")
# update_meta (JAX, out of place): the meta's arrays in, the state's (int32 counters) and the output meta's counters out
META_UPDATE_SLOTS = Slots("amax_history", "scale", "overflows_f", "updates_f", "writes", "fmt_max", "amax_history_out",
                          "scale_out", "scale_inv_out", "overflows", "updates", "overflows_f_out", "updates_f_out")
# block scaling: the input(s), q and q_t with their per-block scales, the tensor's amax (no state), a
# gradient's column sums with their workspaces, and the fused LayerNorm's parameters and statistics
BLOCK_SLOTS = Slots("x", "b", "q", "scale_inv", "q_t", "scale_inv_t", "amax", "dbias", "partial", "counters", "mean",
                    "rstd", "weight", "bias")

# ---- the tile geometry: the one source of the grids, the padding rules and the workspaces --------
THREADS = 256  # the element-wise kernels' block: -DFF8_THREADS (kernels.COMPILE_OPTIONS)
FLAT_ELEMS = 16  # elements a thread of the flat kernels takes a step (one 16-byte load of 1-byte codes)
TILE_R, TILE_C = 128, 64  # the tiled kernels' tile (rows, columns): TILE_R, TILE_C in common.cuh
TILED_BLOCK = 256  # the tiled kernels' block: the __launch_bounds__ of quantize_tiled and transpose_fp8
LN_THREADS = _ln.MAX_THREADS_PER_ROW  # the layernorm kernel's largest block (LN_THREADS in layernorm_quantize.cu)
BLOCK_SIDE = _bk.BLOCK  # a scaling block's side (128); block_quantize.cu takes one 128 x 128 tile a block and step
BLOCK_THREADS = 256  # its block: the __launch_bounds__ of block_quantize
LN_BLOCK = 256  # its block when a row takes fewer threads (blockDim / threads-per-row rows per pass)
# the layernorm kernel's transposed tile: (rows per tile, most shared bytes), first that fits wins
LN_TILES = ((16, 64 << 10), (8, 128 << 10), (4, 1 << 30))
LN_STATIC_SHARED = 2048  # room left for the kernel's static shared memory (1216 bytes on sm_90)

# From this many columns on, layernorm_quantize's q_t comes from a second launch (transpose_fp8 over
# q): the fused tile holds few rows of a wide tensor, so each q_t store is a few bytes, while the
# second launch writes full 128-byte lines for one more read of q (1 byte an element). Below it the
# fused tile is faster (one launch, no second read).
LN_SPLIT_COLS = 4096


def block_of(role: str) -> int:
    """The block a kernel of ``role`` launches with, outside the layernorm family (whose block
    follows the row: :func:`layernorm_block`): the tiled kernels', block_quantize's or the
    element-wise kernels'."""
    if role.startswith("block"):
        return BLOCK_THREADS
    return TILED_BLOCK if "tiled" in role else THREADS


def split_transpose(cols: int) -> bool:
    """Whether layernorm_quantize with q_t over ``cols`` (padded) columns writes q_t with a second
    launch (transpose_fp8) instead of from the kernel's shared tile. Any width takes q_t then."""
    return cols >= LN_SPLIT_COLS


# Parameter layouts (struct format, native alignment) of every kernel, by role prefix. The packed
# size must equal the kernel's parameter size exactly (no trailing padding), or the driver
# refuses the launch (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES); tests/kernels/test_compile.py checks each
# against the parameter bank size NVRTC records in the cubin, tests/kernels/test_launch_layout.py
# against the parameter lists of the .cu files, and every plan below is checked against these when
# it is built.
SIGNATURES = {
    "flat": "@9Pqqf",        # quantize_flat: x, b, q, scale, amax, scale_out, scale_inv_out, scale_inv_used,
                             #                updates, n, npad, margin
    "tiled": "@13Pqqqqiif",  # quantize_tiled: 13 pointers, rows, cols, prows, pcols, vec, vec_t, margin
    "coop_flat": "@9Pqqf",   # the same two kernels of current_quantize.cu (GridAmax), cooperative launches
    "coop_tiled": "@13Pqqqqiif",
    "layernorm": "@13Pqq4i2f",  # layernorm_quantize: 13 pointers, rows, cols, tpr, tile_rows, vec, vec_t, eps,
                                #                     margin
    "padded_layernorm": "@13Pqqqq4i2f",  # layernorm_quantize_padded: 13 pointers, rows, cols, prows, pcols, tpr,
                                         #                            tile_rows, vec, vec_t, eps, margin
    "transpose": "@2Pqqii",  # transpose_fp8: q, q_t, prows, pcols, vec, vec_t
    "dequant": "@3Pqi",      # dequantize_flat: q, out, scale_inv, n, vec
    "block": "@14Pqqqqi",    # block_quantize: x, b, q, scale_inv, q_t, scale_inv_t, amax, dbias, partial,
                             #                counters, mean, rstd, ln_weight, ln_bias, rows, cols, prows, pcols,
                             #                pow2
    "update": "@6Piifi",     # update_scales: 6 pointers, n, L, margin, algo_max
    "meta_update": "@13Piifi",  # update_meta: 13 pointers (the meta in, the state and counters out), n, L, margin,
                                #              algo_max
}


def signature(role: str) -> str:
    """The parameter layout of a kernel role, one struct character per parameter ('@PPPqf')."""
    fmt = SIGNATURES[next(k for k in SIGNATURES if role.startswith(k))]
    return "@" + "".join(c * int(n or 1) for n, c in re.findall(r"(\d*)([a-zA-Z])", fmt))


# ---- plan builders ---------------------------------------------------------------------------
class KernelRef(NamedTuple):
    """What a plan needs of a compiled kernel."""

    func: int  # CUfunction
    name: str  # name expression (for errors)
    role: str  # its role (SIGNATURES key prefix)
    per_sm: int  # resident blocks per multiprocessor at the block size it is launched with
    kid: int  # its stable id (fusedfp8.launch.kernels.kernel_id), which the encoded plan holds


def _flat_grid(ref: KernelRef, sms: int, n: int) -> int:
    """One resident wave: min(work items of FLAT_ELEMS elements per thread, resident blocks); grid-stride beyond."""
    return max(1, min(-(-n // (FLAT_ELEMS * THREADS)), ref.per_sm * sms))


def _tiled_grid(ref: KernelRef, sms: int, rows: int, cols: int) -> int:
    """One resident wave of tiles (grid-stride beyond): the tiled kernel pipelines a block's tiles."""
    return max(1, min(-(-rows // TILE_R) * -(-cols // TILE_C), ref.per_sm * sms))


def _resident(ref: KernelRef, sms: int, grid: int) -> int:
    """A cooperative launch's grid: every block resident at once (the driver refuses more), whatever
    the grid rule asked for (the kernels' grid-stride loops cover the rest)."""
    return max(1, min(grid, ref.per_sm * sms))


def _launch(variants, select: int, block: int, params: tuple, shared: int = 0, coop: bool = False) -> Launch:
    """A Launch whose parameter layout is checked against SIGNATURES for every variant's kernel
    (``coop``: a cooperative launch, whose grid must not exceed the resident blocks)."""
    step = Launch(tuple(Variant(r.func, grid, r.name, r.kid) for r, grid in variants), select, block, tuple(params),
                  shared, coop)
    for r, _ in variants:
        if step.layout != signature(r.role):
            raise RuntimeError(f"fusedfp8: the plan lays out {r.name}'s parameters as {step.layout}, but its "
                               f"signature is {signature(r.role)}")
    return step


def aligned(*ptrs: int) -> bool:
    """All pointers 16-byte aligned (the vector paths' requirement)."""
    return all(q % 16 == 0 for q in ptrs)


def padded(rows: int, cols: int, pad_to: int = 1) -> tuple[int, int]:
    """(rows, cols) rounded up to multiples of ``pad_to`` (the shape of a padded FP8 output)."""
    return -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to


def dbias_workspace(rows: int, cols: int, pad_to: int = 1) -> tuple[tuple[int, int], int]:
    """Shapes of the dbias workspaces of the tiled kernel: ``partial`` (float32, (row tiles,
    cols)) and the int32 ``counters`` (one per column strip; the plan zeroes them first), tiles
    of the padded shape."""
    prows, pcols = padded(rows, cols, pad_to)
    return (max(1, -(-prows // TILE_R)), cols), max(1, -(-pcols // TILE_C))


def block_dbias_workspace(rows: int, cols: int, pad_to: int = 1) -> tuple[tuple[int, int], int]:
    """The dbias workspaces of block_quantize: ``partial`` (float32, (row tiles, cols)) and the int32
    ``counters`` (one per 128-column strip; the plan zeroes them first), tiles (128 x 128) of the
    padded shape."""
    prows, pcols = padded(rows, cols, pad_to)
    return (max(1, -(-prows // BLOCK_SIDE)), cols), max(1, -(-pcols // BLOCK_SIDE))


def build_quantize_plan(refs: dict, sms: int, rows: int, cols: int, transpose: bool = False, dbias: bool = False,
                        first: bool = False, margin_factor: float = 1.0, offset: int = 0, pad_to: int = 1,
                        coop: bool = True) -> Plan:
    """The plan of one quantize call over :data:`QUANTIZE_SLOTS` (``refs``: role -> KernelRef of the
    module, and with ``first`` and ``coop`` of its current_quantize twin; ``sms``: the device's
    multiprocessors). ``offset``: the byte offset of the tensor's entry in the scale / amax /
    scale_out / scale_inv_out / updates slots (4 * index for a state).
    ``first``: the first step (the tensor's ``updates`` is 0; every step under CurrentScaling)
    quantizes with the scale of its own amax, and the kernel writes the scale it used. With ``coop``
    (default) that is ONE cooperative launch of the current_quantize kernels (the amax, a grid-wide
    barrier, the cast); without, the two-pass path: an amax pre-pass launch, then the cast.
    ``pad_to``: q is (rows, cols) rounded up to multiples of it (q_t its transpose), zeros in the
    pad. A shape padded in rows only, without q_t or dbias, takes the flat kernel (q's first
    rows * cols bytes are x's, row-major, in either shape) with the (prows - rows) * cols zeros
    after them written by the same launch (npad); any other padded shape the tiled kernel."""
    k = QUANTIZE_SLOTS
    n = rows * cols
    prows, pcols = padded(rows, cols, pad_to)
    mf = immf32(margin_factor)

    def st(slot):  # the tensor's entry of a state buffer
        return ptr(slot, offset)

    steps = []
    if dbias and n == 0 and cols:
        steps.append(Memset(k.dbias, 4 * cols))  # no kernel runs: the column sums of nothing are 0
    if n == 0:  # nothing to quantize: still hand out 1 / scale (amax max-accumulates 0)
        r = refs["flat_vec0_store1"]
        steps.append(_launch([(r, 1)], 0, THREADS, (ptr(k.x), ptr(k.b), ptr(k.q), st(k.scale), st(k.amax), NULLPTR,
                                                    NULLPTR, ptr(k.scale_inv_used), NULLPTR, imm64(0), imm64(0), mf)))
        return make_plan(k, steps)
    if dbias:
        steps.append(Memset(k.counters, 4 * dbias_workspace(rows, cols, pad_to)[1]))
    vec = (k.x, k.b, k.q)

    def flat(store):
        # the pre-pass (store 0) runs at most one block per multiprocessor: on a first step it
        # reads the tensor grid-stride (once in a training run), on every other step each block
        # reads the flag and exits, so a small grid keeps that launch cheap
        return [(refs[f"flat_vec{v}_store{store}"], min(_flat_grid(refs[f"flat_vec{v}_store{store}"], sms, n),
                                                        sms if store == 0 else n)) for v in (1, 0)]

    coop = coop and first
    if first and not coop:  # first-step pre-pass: amax of the whole tensor, only if *updates == 0
        steps.append(_launch(flat(0), mask(vec), THREADS, (ptr(k.x), ptr(k.b), ptr(k.q), st(k.scale), st(k.amax),
                                                           NULLPTR, NULLPTR, NULLPTR, st(k.updates), imm64(n), imm64(0),
                                                           mf)))
    so, sio, u = (st(k.scale_out), st(k.scale_inv_out), st(k.updates)) if first else (NULLPTR, NULLPTR, NULLPTR)
    if transpose or dbias or pcols != cols:
        role = "coop_tiled" if coop else "tiled"
        r = refs.get(f"{role}_dbias", refs[role]) if dbias else refs[role]  # (the identity's own dbias kernel)
        opt = {slot: ptr(slot) if on else NULLPTR for slot, on in ((k.q_t, transpose), (k.dbias, dbias),
                                                                    (k.partial, dbias), (k.counters, dbias))}
        grid = _tiled_grid(r, sms, prows, pcols)
        steps.append(_launch([(r, _resident(r, sms, grid) if coop else grid)], 0, TILED_BLOCK, (
            ptr(k.x), ptr(k.b), ptr(k.q), opt[k.q_t], opt[k.dbias], opt[k.partial], opt[k.counters], st(k.scale),
            st(k.amax), so, sio, ptr(k.scale_inv_used), u, imm64(rows), imm64(cols), imm64(prows), imm64(pcols),
            flag((k.x, k.b), 16, cols % 8 == 0), flag((k.q_t,), 8, transpose and prows % 8 == 0), mf), coop=coop))
    else:
        if coop:
            main = [(r, _resident(r, sms, _flat_grid(r, sms, n)))
                    for r in (refs[f"coop_flat_vec{v}"] for v in (1, 0))]
        else:
            main = flat(1)
        steps.append(_launch(main, mask(vec), THREADS, (
            ptr(k.x), ptr(k.b), ptr(k.q), st(k.scale), st(k.amax), so, sio, ptr(k.scale_inv_used), u, imm64(n),
            imm64((prows - rows) * cols), mf), coop=coop))
    return make_plan(k, steps)


def build_amax_plan(refs: dict, sms: int, n: int) -> Plan:
    """The amax-only plan over :data:`QUANTIZE_SLOTS`: ``amax`` (a (2,) float32 buffer) gets
    ``max |op(x, b)|`` of the ``n`` elements in its word 0, nothing is cast. It is the first-step
    pre-pass of :func:`build_quantize_plan` (the same kernel, so the same amax bits as the
    quantization stages) with its first-step flag read from word 1 of the buffer, which the plan
    zeroes with the amax: a memset of 8 bytes, then one grid-stride launch (none for n == 0). The
    current-scaling path of several ranks takes it (the local amax, reduced across the ranks
    before the cast with the given scale)."""
    k = QUANTIZE_SLOTS
    steps = [Memset(k.amax, 8)]
    if n:
        variants = [(refs[f"flat_vec{v}_store0"], _flat_grid(refs[f"flat_vec{v}_store0"], sms, n)) for v in (1, 0)]
        steps.append(_launch(variants, mask((k.x, k.b)), THREADS, (
            ptr(k.x), ptr(k.b), NULLPTR, NULLPTR, ptr(k.amax), NULLPTR, NULLPTR, NULLPTR, ptr(k.amax, 4), imm64(n),
            imm64(0), immf32(1.0))))
    return make_plan(k, steps)


def layernorm_tile(cols: int, optin: int) -> tuple[int, int]:
    """(rows per transposed tile, dynamic shared bytes) of the layernorm kernel with q_t: the first
    of :data:`LN_TILES` whose tile of FP8 bytes (rows x cols rounded up to 16) fits both its cap and
    ``optin`` (the device's most shared memory per block) less the kernel's static shared memory."""
    pitch = -(-cols // 16) * 16
    room = optin - LN_STATIC_SHARED
    for tile_rows, cap in LN_TILES:
        if tile_rows * pitch <= min(cap, room):
            return tile_rows, tile_rows * pitch
    most = room // LN_TILES[-1][0] // 16 * 16
    raise ValueError(f"layernorm_quantize: transpose=True needs {LN_TILES[-1][0]} rows of FP8 bytes per block in "
                     f"shared memory ({optin} bytes on this GPU), so at most {most} columns; got {cols}")


def layernorm_block(tpr: int, tile_rows: int = 0) -> int:
    """Threads per block of the layernorm kernel for ``tpr`` threads per row: at least
    :data:`LN_BLOCK`, one row wide; with q_t (``tile_rows`` > 0), enough rows for one pass per tile,
    up to :data:`LN_THREADS`: the rows of a tile are normalised side by side, not in tile_rows / 8
    passes one after another (at hidden 1024 a tile of 16 rows is 16 warps in one pass; the grid of a
    2048-row tensor is only 128 tiles, so the warps a block holds are all an SM gets). The rows per
    tile stay a multiple of the rows per pass: both are powers of two."""
    block = max(LN_BLOCK, tpr)
    if tile_rows:
        block = max(block, min(LN_THREADS, tile_rows * tpr))
    return block


def build_layernorm_plan(refs: dict, sms: int, rows: int, cols: int, transpose: bool = False, first: bool = False,
                         eps: float = 1e-5, margin_factor: float = 1.0, offset: int = 0,
                         tile: tuple[int, int] = (0, 0), pad_to: int = 1) -> Plan:
    """The plan of one layernorm_quantize call over :data:`LAYERNORM_SLOTS` (``refs``: role ->
    KernelRef, the main kernel's ``per_sm`` counted with the tile's shared memory; ``tile``: (rows
    per tile, shared bytes) from :func:`layernorm_tile`, used with ``transpose``). ``offset``: the
    byte offset of the tensor's entry in the state slots. ``first``: launch the first-step
    pre-pass (amax of y only, when the tensor's ``updates`` is 0), and let the main kernel write
    the scale it used. The row layout (threads per row) comes from
    :func:`fusedfp8.numerics.layernorm.threads_per_row`, the one the reference sums in.
    ``pad_to``: q is (rows, cols) rounded up to multiples of it (q_t its transpose), zeros in the
    pad, written by the padded main kernel (its groups run to the padded rows; ``tile`` must then
    be the one of the padded columns); a shape that needs no pad (or 0 rows) launches exactly what
    ``pad_to=1`` launches. With ``transpose`` over :data:`LN_SPLIT_COLS` padded columns or more
    (:func:`split_transpose`), q_t does not come from the kernel's shared tile (``tile`` unused) but
    from a second launch, transpose_fp8 over the q the kernel without q_t wrote (padded: with its
    zeros), in 128 x 64-byte tiles."""
    k = LAYERNORM_SLOTS
    prows, pcols = padded(rows, cols, pad_to)
    pad = rows > 0 and (prows, pcols) != (rows, cols)
    tpr = _ln.threads_per_row(max(cols, 1))
    split = transpose and split_transpose(pcols)
    fused_t = transpose and not split  # q_t from the kernel's shared tile
    tile_rows, shared = tile if fused_t else (0, 0)
    block = layernorm_block(tpr)  # the pre-pass's (and without q_t the main kernel's)
    per_pass = block // tpr
    ins = (k.x, k.weight, k.bias, k.q)
    vec_in = flag(ins, 16, cols % 8 == 0)  # the pre-pass (and a launch for no rows) writes no q
    vec = flag(ins, 16, cols % 8 == 0 and pcols % 8 == 0)  # q's rows start 8-byte aligned
    main = refs[("padded_" if pad else "") + ("layernorm_store1_t" if fused_t else "layernorm_store1")]
    pre = refs["layernorm_store0"]

    def st(slot):  # the tensor's entry of a state buffer
        return ptr(slot, offset)

    def params(q, q_t, mean, rstd, so, sio, siu, u, n_rows, t_rows, vec_t, padded_shape=(), vec=vec):
        return (ptr(k.x), ptr(k.weight), ptr(k.bias), q, q_t, mean, rstd, st(k.scale), st(k.amax), so, sio, siu, u,
                imm64(n_rows), imm64(cols), *map(imm64, padded_shape), imm32(tpr), imm32(t_rows), vec, vec_t,
                immf32(eps), immf32(margin_factor))

    if rows == 0:  # nothing to normalise: still hand out 1 / scale (one block, no row)
        return make_plan(k, [_launch([(main, 1)], 0, block, params(
            NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, ptr(k.scale_inv_used), NULLPTR, 0, 0,
            flag((), 16, False), vec=vec_in))])
    steps = []
    if first:  # at most one block per multiprocessor: past the first step each block reads the flag and exits
        steps.append(_launch([(pre, min(-(-rows // per_pass), sms))], 0, block, params(
            NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, st(k.updates), rows, 0, flag((), 16, False),
            vec=vec_in)))
    so, sio, u = (st(k.scale_out), st(k.scale_inv_out), st(k.updates)) if first else (NULLPTR, NULLPTR, NULLPTR)
    groups = -(-prows // (tile_rows if fused_t else per_pass))
    steps.append(_launch([(main, max(1, min(groups, main.per_sm * sms)))], 0, layernorm_block(tpr, tile_rows), params(
        ptr(k.q), ptr(k.q_t) if fused_t else NULLPTR, ptr(k.mean), ptr(k.rstd), so, sio, ptr(k.scale_inv_used), u, rows,
        tile_rows, flag((k.q_t,), 16, fused_t and prows % max(tile_rows, 1) == 0), (prows, pcols) if pad else ()),
        shared))
    if split:
        tr = refs["transpose_tiled"]
        steps.append(_launch([(tr, _tiled_grid(tr, sms, prows, pcols))], 0, TILED_BLOCK, (
            ptr(k.q), ptr(k.q_t), imm64(prows), imm64(pcols), flag((k.q,), 16, pcols % 16 == 0),
            flag((k.q_t,), 16, prows % 16 == 0))))
    return make_plan(k, steps)


def build_layernorm_amax_plan(refs: dict, sms: int, rows: int, cols: int, eps: float = 1e-5) -> Plan:
    """The amax-only plan of LayerNorm over :data:`LAYERNORM_SLOTS`: ``amax`` (a (2,) float32
    buffer) gets ``max |LayerNorm(x) * weight + bias|`` in word 0; nothing else is written. The
    first-step pre-pass of :func:`build_layernorm_plan` (the same amax bits) with its flag read
    from word 1, zeroed with the amax by the plan's memset."""
    k = LAYERNORM_SLOTS
    steps = [Memset(k.amax, 8)]
    if rows:
        tpr = _ln.threads_per_row(max(cols, 1))
        block = max(LN_BLOCK, tpr)
        pre = refs["layernorm_store0"]
        steps.append(_launch([(pre, min(-(-rows // (block // tpr)), sms))], 0, block, (
            ptr(k.x), ptr(k.weight), ptr(k.bias), NULLPTR, NULLPTR, NULLPTR, NULLPTR, NULLPTR, ptr(k.amax), NULLPTR,
            NULLPTR, NULLPTR, ptr(k.amax, 4), imm64(rows), imm64(cols), imm32(tpr), imm32(0),
            flag((k.x, k.weight, k.bias), 16, cols % 8 == 0), flag((), 16, False), immf32(eps), immf32(1.0))))
    return make_plan(k, steps)


def build_dequantize_plan(refs: dict, sms: int, n: int) -> Plan:
    """``out[i] = dtype(float32(q[i]) * scale_inv[0])`` over :data:`DEQUANTIZE_SLOTS` (nothing for n == 0)."""
    k = DEQUANTIZE_SLOTS
    if n == 0:
        return make_plan(k, ())
    r = refs["dequant"]
    return make_plan(k, [_launch([(r, _flat_grid(r, sms, n))], 0, THREADS, (
        ptr(k.q), ptr(k.out), ptr(k.scale_inv), imm64(n), flag((k.q, k.out), 16)))])


def build_update_plan(refs: dict, n: int, L: int, margin_factor: float, algo_max: bool, meta: bool = False) -> Plan:
    """The fused update over :data:`UPDATE_SLOTS`: one block per tensor. ``meta``: update_meta over
    :data:`META_UPDATE_SLOTS` (a flax meta decoded, updated and its counters converted, in one launch)."""
    slots, role = (META_UPDATE_SLOTS, "meta_update") if meta else (UPDATE_SLOTS, "update")
    # the kernels take every buffer, in slot order
    return make_plan(slots, [_launch([(refs[role], max(n, 1))], 0, THREADS, (
        *map(ptr, range(len(slots))), imm32(n), imm32(L), immf32(margin_factor), imm32(int(algo_max))))])


def block_role(block, dbias: bool = False) -> str:
    """The role of block_quantize's instantiation for ``block``: (1, 128) or (128, 128); ``dbias``:
    the identity's instantiation with the column sums (the dgelu ops' ``block_1x128`` has them)."""
    role = {(1, BLOCK_SIDE): "block_1x128", (BLOCK_SIDE, BLOCK_SIDE): "block_128x128"}[tuple(block)]
    return role + "_dbias" if dbias else role


def build_block_quantize_plan(refs: dict, sms: int, rows: int, cols: int, block=(1, BLOCK_SIDE),
                              transpose: bool = False, pow2: bool = False, pad_to: int = 1, dbias: bool = False,
                              op: str = "identity") -> Plan:
    """The plan of one block quantization over :data:`BLOCK_SLOTS` (``refs``: role -> KernelRef of
    the block_quantize module of ``op``): ``amax`` zeroed (a memset: the kernel max-accumulates into
    it, and block scaling keeps no state to accumulate into), then, unless the input is empty, one
    launch of the kernel for ``block`` over the 128 x 128 tiles of the padded shape, grid-stride
    beyond one resident wave. With ``transpose`` it writes ``q_t`` and ``scale_inv_t`` as well;
    ``pow2``: the scales rounded down to powers of two; ``dbias`` (1x128, the identity and the dgelu
    ops): the column sums of what is cast into ``dbias``, through ``partial`` and ``counters``
    (:func:`block_dbias_workspace`; the counters zeroed first, and ``dbias`` zeroed instead of a
    launch for an input without rows). The kernel checks its own pointers' alignment (no flag)."""
    k = BLOCK_SLOTS
    if op != "identity" and tuple(block) != (1, BLOCK_SIDE):
        raise ValueError(f"block_quantize: {op} takes 1x128 blocks (an activation or a gradient); got {block}")
    if dbias and op not in ("identity", "dgelu_tanh", "dgelu_erf"):
        raise ValueError(f"block_quantize: dbias goes with a gradient (the identity or dgelu); got {op}")
    steps = [Memset(k.amax, 4)]
    prows, pcols = padded(rows, cols, pad_to)
    if dbias and rows * cols == 0 and cols:
        steps.append(Memset(k.dbias, 4 * cols))  # no kernel runs: the column sums of nothing are 0
    if rows * cols:
        r = refs[block_role(block, dbias and op == "identity")]
        tiles = -(-prows // BLOCK_SIDE) * -(-pcols // BLOCK_SIDE)
        if dbias:
            steps.append(Memset(k.counters, 4 * block_dbias_workspace(rows, cols, pad_to)[1]))
        q_t, s_t = (ptr(k.q_t), ptr(k.scale_inv_t)) if transpose else (NULLPTR, NULLPTR)
        db = (ptr(k.dbias), ptr(k.partial), ptr(k.counters)) if dbias else (NULLPTR,) * 3
        steps.append(_launch([(r, max(1, min(tiles, r.per_sm * sms)))], 0, BLOCK_THREADS, (
            ptr(k.x), ptr(k.b), ptr(k.q), ptr(k.scale_inv), q_t, s_t, ptr(k.amax), *db, *(NULLPTR,) * 4, imm64(rows),
            imm64(cols), imm64(prows), imm64(pcols), imm32(int(bool(pow2))))))
    return make_plan(k, steps)


def block_layernorm_role(param: str) -> str:
    """The role of block_quantize's LayerNorm instantiation whose weight and bias are ``param``."""
    return f"block_1x128_ln_{param}"


def build_block_layernorm_plan(refs: dict, sms: int, rows: int, cols: int, param: str, transpose: bool = False,
                               pow2: bool = False, pad_to: int = 1, eps: float = 1e-5) -> Plan:
    """LayerNorm fused with 1x128 block quantization over :data:`BLOCK_SLOTS` (``refs``: role ->
    KernelRef of the layernorm_quantize module, for its statistics launch ``layernorm_stats``, and
    of the block_quantize identity module, for :func:`block_layernorm_role`; ``param``: the dtype of
    ``weight`` and ``bias``, either slot null for none): ``amax`` zeroed; the statistics launch
    (the per-row mean and rstd into ``mean`` and ``rstd``, in the row layout the reference sums in,
    :func:`fusedfp8.numerics.layernorm.threads_per_row`, one resident wave of row groups); then
    block_quantize's LayerNorm instantiation over the 128 x 128 tiles of the padded shape, y from
    x and the statistics, q (and with ``transpose`` q_t) with the scales of y's blocks. Nothing
    but the memset for an input without rows (cols >= 1 is the caller's)."""
    k = BLOCK_SLOTS
    steps = [Memset(k.amax, 4)]
    prows, pcols = padded(rows, cols, pad_to)
    if rows * cols:
        tpr = _ln.threads_per_row(cols)
        block = layernorm_block(tpr)
        stats = refs["layernorm_stats"]
        steps.append(_launch([(stats, max(1, min(-(-rows // (block // tpr)), stats.per_sm * sms)))], 0, block, (
            ptr(k.x), NULLPTR, NULLPTR, NULLPTR, NULLPTR, ptr(k.mean), ptr(k.rstd), *(NULLPTR,) * 6, imm64(rows),
            imm64(cols), imm32(tpr), imm32(0), flag((k.x,), 16, cols % 8 == 0), flag((), 16, False), immf32(eps),
            immf32(1.0))))
        r = refs[block_layernorm_role(param)]
        tiles = -(-prows // BLOCK_SIDE) * -(-pcols // BLOCK_SIDE)
        q_t, s_t = (ptr(k.q_t), ptr(k.scale_inv_t)) if transpose else (NULLPTR, NULLPTR)
        steps.append(_launch([(r, max(1, min(tiles, r.per_sm * sms)))], 0, BLOCK_THREADS, (
            ptr(k.x), NULLPTR, ptr(k.q), ptr(k.scale_inv), q_t, s_t, ptr(k.amax), *(NULLPTR,) * 3, ptr(k.mean),
            ptr(k.rstd), ptr(k.weight), ptr(k.bias), imm64(rows), imm64(cols), imm64(prows), imm64(pcols),
            imm32(int(bool(pow2))))))
    return make_plan(k, steps)
