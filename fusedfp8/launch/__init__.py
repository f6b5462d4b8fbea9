"""The launch: everything between "this call, these arrays" and cuLaunchKernel, and the one
interface that :mod:`fusedfp8.ops`, the torch custom ops and the JAX primitives call.

- :mod:`.kernels`: the CUDA sources, the NVRTC build and its cache, the probe, each kernel's
  stable id;
- :mod:`.plans`: the plans as data (the buffers of each family by name, the tile geometry, the
  parameter layouts, grids, workspaces, ``build_*_plan``);
- :mod:`.format`: what a plan is and its encoding for the compiled shim (``fusedfp8/csrc/plan.h``);
- :mod:`.executor`: the Python executor (the launch path without the shim).

Here: the plans of a signature on a device (``*_plan``: the kernels compiled on first use, the
device's occupancy read, the plan built once and cached, tagged with the device whose context
holds its kernels), which the compiled shim runs as well (the torch C++ ops, the XLA FFI
handler), and the launches on raw device pointers (:func:`quantize`, :func:`layernorm_quantize`,
:func:`block_quantize`, :func:`dequantize`, :func:`update_scales`), which take their buffers by name: ``{slot name: device
pointer}`` of the family's slots (:data:`QUANTIZE_SLOTS`, ...), a slot not named being null. They
check nothing: their callers own shapes, dtypes and lifetimes. And what ``python -m fusedfp8 info``
reports and builds: :func:`probe`, :func:`source_dir`, :func:`cuda_include_dirs`, every module
(:func:`all_module_keys`) and :func:`compile_module`.
"""
from __future__ import annotations

import functools

from ..numerics import layernorm as _ln
from . import kernels
from .executor import current_device, execute, plan_on, run
from .format import Plan
from .kernels import all_module_keys, cuda_include_dirs, probe, source_dir
from .plans import (BLOCK_SLOTS, DEQUANTIZE_SLOTS, LAYERNORM_SLOTS, META_UPDATE_SLOTS, QUANTIZE_SLOTS, UPDATE_SLOTS,
                    KernelRef, block_dbias_workspace, block_of, build_amax_plan, build_block_layernorm_plan,
                    build_block_quantize_plan,
                    build_dequantize_plan, build_layernorm_amax_plan, build_layernorm_plan, build_quantize_plan,
                    build_update_plan, dbias_workspace, layernorm_block, layernorm_tile, padded, split_transpose)

__all__ = ["probe", "source_dir", "cuda_include_dirs", "all_module_keys", "compile_module", "padded",
           "dbias_workspace", "block_dbias_workspace", "Plan", "plan_on", "execute", "run", "current_device",
           "QUANTIZE_SLOTS", "LAYERNORM_SLOTS", "BLOCK_SLOTS", "DEQUANTIZE_SLOTS", "UPDATE_SLOTS", "META_UPDATE_SLOTS",
           "quantize_plan", "layernorm_plan", "amax_plan", "layernorm_amax_plan", "block_quantize_plan",
           "block_layernorm_plan", "dequantize_plan", "update_plan", "quantize", "layernorm_quantize", "block_quantize",
           "block_layernorm_quantize", "dequantize", "update_scales"]


def compile_module(key: kernels.ModuleKey, device_id: int) -> None:
    """Build module ``key`` (one of :func:`all_module_keys`) on ``device_id`` now, or load it from
    the disk cache, as its first launch would."""
    kernels.load(key, device_id)


def kernel_refs(key: kernels.ModuleKey, device_id: int) -> dict:
    """Role -> :class:`~fusedfp8.launch.plans.KernelRef` of module ``key`` on ``device_id`` (compiles
    it on first use), each with its occupancy at the block it is launched with."""
    return {role: KernelRef(k.func, k.name, role, k.blocks_per_sm(block_of(role)), k.kid)
            for role, k in kernels.load(key, device_id).items()}


# ---- the plans of a signature on a device, cached. Pass the arguments positionally: the cache keys on
# them as given.
@functools.lru_cache(maxsize=4096)
def quantize_plan(device: int, dtype: str, fmt: str, op: str, rows: int, cols: int, transpose: bool = False,
                  dbias: bool = False, first: bool = False, margin_factor: float = 1.0, offset: int = 0,
                  pad_to: int = 1, coop: bool = True) -> Plan:
    """:func:`~fusedfp8.launch.plans.build_quantize_plan` for module (dtype, fmt, op) on ``device``
    (and, for a first step in one launch, its current_quantize twin). ``dbias`` goes with a
    gradient's ops only, the identity and the dgelu ops (the bias gradient: the column sums of
    what is cast); ValueError with a gelu op."""
    if dbias and op not in ("identity", "dgelu_tanh", "dgelu_erf"):
        raise ValueError(f"dbias: the column sums come with op 'identity', 'dgelu_tanh' or 'dgelu_erf' (a gradient); "
                         f"got op {op!r}")
    refs = kernel_refs(kernels.ModuleKey("quantize", dtype, fmt, op), device)
    if first and coop:
        refs = {**refs, **kernel_refs(kernels.ModuleKey("current_quantize", dtype, fmt, op), device)}
    return build_quantize_plan(refs, kernels.sm_count(device), rows, cols, transpose, dbias, first, margin_factor,
                               offset, pad_to, coop)._replace(device=device)


@functools.lru_cache(maxsize=4096)
def layernorm_plan(device: int, dtype: str, param: str, fmt: str, rows: int, cols: int, transpose: bool = False,
                   first: bool = False, eps: float = 1e-5, margin_factor: float = 1.0, offset: int = 0,
                   pad_to: int = 1) -> Plan:
    """:func:`~fusedfp8.launch.plans.build_layernorm_plan` for module (dtype, fmt, param) on
    ``device`` (compiles it on first use; with ``transpose``, allows the kernel the tile's shared
    memory: the tile of the padded columns)."""
    ks = kernels.load(kernels.ModuleKey("layernorm_quantize", dtype, fmt, param=param), device)
    pcols = padded(rows, cols, pad_to)[1]
    fused_t = transpose and rows and not split_transpose(pcols)
    tile = layernorm_tile(pcols, kernels.shared_optin(device)) if fused_t else (0, 0)
    tpr = _ln.threads_per_row(max(cols, 1))
    for role in ("layernorm_store1_t", "padded_layernorm_store1_t"):
        ks[role].allow_shared(tile[1])

    def per_sm(role, k):
        if role == "transpose_tiled":
            return k.blocks_per_sm(block_of(role))
        return k.blocks_per_sm(layernorm_block(tpr, tile[0]), tile[1]) if role.endswith("_t") else \
            k.blocks_per_sm(layernorm_block(tpr))

    refs = {role: KernelRef(k.func, k.name, role, per_sm(role, k), k.kid) for role, k in ks.items()}
    return build_layernorm_plan(refs, kernels.sm_count(device), rows, cols, transpose, first, eps, margin_factor,
                                offset, tile, pad_to)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def amax_plan(device: int, dtype: str, op: str, n: int) -> Plan:
    """:func:`~fusedfp8.launch.plans.build_amax_plan` for an input of ``dtype`` and kernel ``op`` on ``device``."""
    return build_amax_plan(kernel_refs(kernels.ModuleKey("quantize", dtype, "e4m3", op), device),
                           kernels.sm_count(device), n)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def layernorm_amax_plan(device: int, dtype: str, param: str, rows: int, cols: int, eps: float = 1e-5) -> Plan:
    """:func:`~fusedfp8.launch.plans.build_layernorm_amax_plan` for (dtype, param) on ``device``."""
    refs = kernel_refs(kernels.ModuleKey("layernorm_quantize", dtype, "e4m3", param=param), device)
    return build_layernorm_amax_plan(refs, kernels.sm_count(device), rows, cols, eps)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def block_quantize_plan(device: int, dtype: str, fmt: str, block: tuple, rows: int, cols: int, transpose: bool = False,
                        pow2: bool = False, pad_to: int = 1, op: str = "identity", dbias: bool = False) -> Plan:
    """:func:`~fusedfp8.launch.plans.build_block_quantize_plan` for module (dtype, fmt, op) on
    ``device`` (its kernels compiled on first use); ``block``: (1, 128) or (128, 128)."""
    return build_block_quantize_plan(kernel_refs(kernels.ModuleKey("block_quantize", dtype, fmt, op), device),
                                     kernels.sm_count(device), rows, cols, tuple(block), transpose, pow2,
                                     pad_to, dbias, op)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def block_layernorm_plan(device: int, dtype: str, param: str, fmt: str, rows: int, cols: int, transpose: bool = False,
                         pow2: bool = False, pad_to: int = 1, eps: float = 1e-5) -> Plan:
    """:func:`~fusedfp8.launch.plans.build_block_layernorm_plan` on ``device``: the statistics kernel of
    module layernorm_quantize (dtype, fmt, param), with its occupancy at the LayerNorm's block for
    the row, and block_quantize's LayerNorm instantiation of module (dtype, fmt, identity)."""
    stats = kernels.load(kernels.ModuleKey("layernorm_quantize", dtype, fmt, param=param), device)["layernorm_stats"]
    tpr = _ln.threads_per_row(max(cols, 1))
    refs = {**kernel_refs(kernels.ModuleKey("block_quantize", dtype, fmt, "identity"), device),
            "layernorm_stats": KernelRef(stats.func, stats.name, "layernorm_stats",
                                         stats.blocks_per_sm(layernorm_block(tpr)), stats.kid)}
    return build_block_layernorm_plan(refs, kernels.sm_count(device), rows, cols, param, transpose, pow2, pad_to,
                                      eps)._replace(device=device)


@functools.lru_cache(maxsize=1024)
def dequantize_plan(device: int, dtype: str, fmt: str, n: int) -> Plan:
    return build_dequantize_plan(kernel_refs(kernels.ModuleKey("dequantize", dtype, fmt), device),
                                 kernels.sm_count(device), n)._replace(device=device)


@functools.lru_cache(maxsize=256)
def update_plan(device: int, n: int, L: int, margin_factor: float, algo_max: bool, meta: bool = False) -> Plan:
    return build_update_plan(kernel_refs(kernels.ModuleKey("update_scales"), device), n, L, margin_factor, algo_max,
                             meta)._replace(device=device)


# ---- the launches on raw pointers, buffers by name (thin wrappers over the plans) -------------------
def quantize(device: int, stream: int, buffers: dict, *, dtype: str, fmt: str, op: str, rows: int, cols: int,
             first: bool = False, margin_factor: float = 1.0, pad_to: int = 1, coop: bool = True) -> None:
    """Launch the quantize kernels on raw device pointers (:func:`quantize_plan`, then :func:`run`).

    Parameters
    ----------
    device, stream : CUDA device ordinal and stream handle (0 = legacy default stream).
    buffers : {name: device pointer} of :data:`QUANTIZE_SLOTS` (a name left out, or 0, is null):
        ``x``, ``b``, ``q``: input(s) (rows x cols, row-major) and the FP8 output (same shape, bytes);
        for the dgelu ops ``x`` is dy and ``b`` the forward input.
        ``scale``: (1,) float32, read. ``amax``: (1,) float32, max-accumulated (NaN-propagating).
        ``q_t``: the (cols, rows) FP8 transpose (given: the plan writes it).
        ``dbias``: (cols,) float32 column sums (identity and dgelu ops; given: the plan computes them), with
        the workspaces ``partial`` and ``counters`` (:func:`dbias_workspace`; the plan zeroes the counters
        first, and dbias itself when rows * cols is 0).
        ``scale_inv_used``: (1,) float32 receiving ``1 / scale`` as used (written even when rows * cols is 0).
        With ``first``: ``updates`` (int32 flag, 0 = first step), ``scale_out`` and ``scale_inv_out``
        (the state's entries, written on a first step).
    dtype : 'float32' | 'float16' | 'bfloat16', the input's dtype.
    fmt : 'e4m3' | 'e5m2', the format of ``q`` / ``q_t``.
    op : a kernel op of :data:`fusedfp8.launch.kernels.OPS`.
    first : a first step is possible (current scaling, or delayed scaling's ``first_step='current'``).
    coop : with ``first``, the amax and the cast in one cooperative launch (default); False: the
        two-pass path (an amax pre-pass launch, then the cast). The same bytes either way.
    margin_factor : 2**margin, for the first-step scale.
    pad_to : q is (rows, cols) rounded up to multiples of it, q_t its transpose, zeros in the pad
        (:func:`padded`; the dbias workspace too).
    """
    if rows * cols == 0 and not buffers.get("scale_inv_used"):
        return
    with_dbias = bool(buffers.get("dbias") or buffers.get("partial") or buffers.get("counters"))
    plan = plan_on(stream, quantize_plan, device, dtype, fmt, op, rows, cols, bool(buffers.get("q_t")), with_dbias,
                   bool(first), float(margin_factor), 0, int(pad_to), bool(coop))
    run(plan, buffers, stream)


def layernorm_quantize(device: int, stream: int, buffers: dict, *, dtype: str, param: str, fmt: str, rows: int,
                       cols: int, eps: float, first: bool = False, margin_factor: float = 1.0, pad_to: int = 1) -> None:
    """Launch the layernorm_quantize kernels on raw device pointers (:func:`layernorm_plan`, then :func:`run`).

    Parameters
    ----------
    device, stream : CUDA device ordinal and stream handle.
    buffers : {name: device pointer} of :data:`LAYERNORM_SLOTS`: ``x`` (rows, cols) row-major input,
        cols >= 1; ``weight``, ``bias``: (cols,), or left out (1 and -0); ``q``: (rows, cols) FP8 output
        (bytes; padded with pad_to); ``q_t``: its (cols, rows) transpose (likewise; given: the plan
        writes it); ``mean``, ``rstd``: (rows,) float32 outputs; ``scale``, ``amax``, ``scale_inv_used``,
        ``updates``, ``scale_out``, ``scale_inv_out``: as :func:`quantize`.
    dtype : the dtype of x; param : the dtype of weight and bias ('float32' | 'float16' | 'bfloat16').
    fmt : 'e4m3' | 'e5m2', the format of ``q`` / ``q_t``.
    eps : added to the variance (rounded to float32).
    first, margin_factor : as :func:`quantize`.
    pad_to : q is (rows, cols) rounded up to multiples of it, q_t its transpose, zeros in the pad
        (:func:`padded`); mean and rstd stay (rows,).
    """
    if rows == 0 and not buffers.get("scale_inv_used"):
        return
    plan = plan_on(stream, layernorm_plan, device, dtype, param, fmt, rows, cols, bool(buffers.get("q_t")),
                   bool(first), float(eps), float(margin_factor), 0, int(pad_to))
    run(plan, buffers, stream)


def block_quantize(device: int, stream: int, buffers: dict, *, dtype: str, fmt: str, block: tuple, rows: int,
                   cols: int, pow2: bool = False, pad_to: int = 1, op: str = "identity") -> None:
    """Launch the block quantization (:func:`block_quantize_plan`, then :func:`run`) on raw device
    pointers; the bytes and scales of :func:`fusedfp8.numerics.block.block_quantize`.

    Parameters
    ----------
    device, stream : CUDA device ordinal and stream handle.
    buffers : {name: device pointer} of :data:`BLOCK_SLOTS`: ``x`` (rows, cols) row-major input;
        ``q``: the (prows, pcols) FP8 output (bytes), ``scale_inv``: its float32 scales in
        cuBLASLt's layout (:func:`fusedfp8.numerics.block.scale_shape` of (prows, pcols));
        ``q_t`` and ``scale_inv_t``: the (pcols, prows) transpose and its scales (given: the plan
        writes them; both or neither); ``amax``: (1,) float32, set to max |y| (the plan zeroes it first);
        ``b``: the forward input of the dgelu ops (``x`` is then dy); ``dbias``: (cols,) float32 column
        sums of y (the identity and the dgelu ops, 1x128; given: the plan computes them), with the
        workspaces ``partial`` and ``counters`` (:func:`block_dbias_workspace`).
    dtype : 'float32' | 'float16' | 'bfloat16', the input's dtype.
    fmt : 'e4m3' | 'e5m2'.
    block : (1, 128) or (128, 128) (only 1x128 with an op other than the identity).
    op : a kernel op of :data:`fusedfp8.launch.kernels.OPS`: y = op(x) is what is quantized.
    pow2 : the scales rounded down to powers of two.
    pad_to : (prows, pcols) = (rows, cols) rounded up to multiples of it (:func:`padded`), zeros in the pad.
    """
    plan = plan_on(stream, block_quantize_plan, device, dtype, fmt, tuple(block), rows, cols,
                   bool(buffers.get("q_t")), bool(pow2), int(pad_to), op, bool(buffers.get("dbias")))
    run(plan, buffers, stream)


def block_layernorm_quantize(device: int, stream: int, buffers: dict, *, dtype: str, param: str, fmt: str, rows: int,
                             cols: int, eps: float, pow2: bool = False, pad_to: int = 1) -> None:
    """Launch LayerNorm fused with 1x128 block quantization (:func:`block_layernorm_plan`, then
    :func:`run`) on raw device pointers: the bytes, scales and statistics of
    :func:`fusedfp8.numerics.block.block_layernorm_quantize`.

    buffers : {name: device pointer} of :data:`BLOCK_SLOTS`: ``x`` (rows, cols) row-major input;
        ``weight`` and ``bias``: (cols,) of dtype ``param``, or not given (1 and -0); ``mean`` and
        ``rstd``: (rows,) float32 outputs (always written: the second launch reads them); ``q``,
        ``scale_inv``, ``q_t``, ``scale_inv_t`` and ``amax`` as :func:`block_quantize`'s (1x128).
    dtype, param : 'float32' | 'float16' | 'bfloat16': x's, and the weight's and bias's.
    eps : added to the variance. fmt, pow2, pad_to: as :func:`block_quantize`'s.
    """
    plan = plan_on(stream, block_layernorm_plan, device, dtype, param, fmt, rows, cols, bool(buffers.get("q_t")),
                   bool(pow2), int(pad_to), float(eps))
    run(plan, buffers, stream)


def dequantize(device: int, stream: int, buffers: dict, *, dtype: str, fmt: str, n: int) -> None:
    """``out[i] = dtype(float32(q[i]) * scale_inv[0])`` for n elements (nothing for n == 0);
    ``buffers``: ``q``, ``out`` and ``scale_inv`` (:data:`DEQUANTIZE_SLOTS`)."""
    if n:
        run(plan_on(stream, dequantize_plan, device, dtype, fmt, n), buffers, stream)


def update_scales(device: int, stream: int, buffers: dict, *, n: int, L: int, margin_factor: float,
                  algo_max: bool) -> None:
    """Launch the fused update (:func:`fusedfp8.numerics.scaling.update_rule`) on raw pointers, in
    place; ``buffers`` (:data:`UPDATE_SLOTS`): ``amax_history`` (L, n) float32, ``scale`` /
    ``scale_inv`` (n,) float32, ``overflows`` / ``updates`` (n,) int32, ``fmt_max`` (n,) float32
    (each tensor's format max)."""
    run(plan_on(stream, update_plan, device, n, L, float(margin_factor), bool(algo_max)), buffers, stream)
