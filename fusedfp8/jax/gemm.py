"""The FP8 GEMM of the JAX front end: cuBLASLt called by the compiled shim, or XLA's dot.

:func:`fp8_gemm` computes ``out_dtype((a[:m] @ b[:n].T) * scale_inv_a * scale_inv_b)`` for FP8
``a`` (>= m, K) and ``b`` (>= n, K), both "K-contiguous" (the forms the quantize kernels write: q
and its transpose q_t; see :mod:`fusedfp8.jax.dot` for which operand is which in each
GEMM of a linear layer). Two backends:

- ``'ffi'``: a custom call to ``fusedfp8_fp8_gemm``, the XLA FFI handler of the compiled shim
  (fusedfp8/csrc/gemm.h): one ``cublasLtMatmul`` in cuBLASLt's FP8 "TN" layout with the two
  per-tensor scales as device pointers (no host sync), writing ``out_dtype`` (bf16, fp16 or fp32)
  directly: no float32 product, no conversion kernel after it. A ragged K is computed on the
  operands zero-padded to a multiple of 16 (our kernels write them so; an unpadded operand is
  padded here, one copy); the output is written at its exact (m, n) shape when its rows allow
  (n a multiple of 16), else (m, n rounded up to 16) and sliced. The descriptors and the
  cuBLASLt heuristic's algorithm are made at trace time for every local GPU (never inside XLA's
  stream capture, so the call is recorded into XLA's command buffers); cuBLASLt's workspace is a
  second, XLA-assigned result of :data:`WORKSPACE_BYTES`.
- XLA's dot: ``dot_general(a, b, preferred_element_type=float32) * (scale_inv_a * scale_inv_b)``
  then the cast, the only form XLA's GEMM rewriter turns into its own cuBLASLt FP8 call (float32
  out, converted by a separate kernel; with a ragged dimension it falls back to a GEMM in high
  precision even on padded operands, so every operand is padded to 16 here).

``impl`` as the primitives': ``'auto'`` (the FFI GEMM on CUDA where the shim and cuBLASLt are
available, XLA's dot elsewhere), ``'ffi'`` (the FFI GEMM; an error where it cannot run),
``'jnp'`` / ``'callback'`` (XLA's dot, as before the FFI GEMM).
"""
from __future__ import annotations

import ctypes
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import csrc as _shim
from ..types import FP8_DTYPES, GEMM_MULTIPLE
from . import callbacks, cuda_backend
from . import primitives as P

__all__ = ["fp8_gemm", "fp8_block_gemm", "gemm_target", "gemm_path", "block_gemm_path", "output_cols", "TARGET", "TARGET_BIAS",
           "TARGET_BLOCK", "TARGET_BLOCK_BIAS", "WORKSPACE_BYTES"]

TARGET = "fusedfp8_fp8_gemm"  # command-buffer compatible
TARGET_BIAS = "fusedfp8_fp8_gemm_bias"  # the same with cuBLASLt's bias epilogue
TARGET_BLOCK = "fusedfp8_fp8_gemm_block"  # the block-scaled GEMM (BlockScaling)
TARGET_BLOCK_BIAS = "fusedfp8_fp8_gemm_block_bias"
WORKSPACE_BYTES = 32 << 20  # cuBLASLt's workspace on Hopper (torch and Transformer Engine give it 32 MiB)
OUT_DTYPES = ("bfloat16", "float16", "float32")
_LT_TYPE = {"float8_e4m3fn": 28, "float8_e5m2": 29, "bfloat16": 14, "float16": 2, "float32": 0}  # cudaDataType
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4  # cublasLtEpilogue_t
_SCALE_MODE = {0: 0, 1: 4, 128: 5}  # block rows -> cublasLtMatmulMatrixScale_t (0: one scale per tensor)
_XLA_IMPLS = ("jnp", "callback")


def _round_up(v: int) -> int:
    return -(-v // GEMM_MULTIPLE) * GEMM_MULTIPLE


def output_cols(n: int) -> int:
    """Columns of the FFI GEMM's output for ``n`` wanted: ``n`` when cuBLASLt's FP8 GEMM can write
    rows of that length (a multiple of 16 elements), else ``n`` rounded up (then sliced)."""
    return n if n % GEMM_MULTIPLE == 0 else _round_up(n)


def _shape_code(m, n, k, lda, ldb, ldd, ta, tb, td, fast, workspace, bias: bool = False, blocks=(0, 0)) -> np.ndarray:
    """The 15 int64s of the shim's GEMM shape (ff8_gemm_check / ff8_gemm_prepare); ``bias``: the
    bias epilogue, the bias of the output's type; ``blocks``: each operand's block rows (0: one
    scale per tensor, 1: 1x128 blocks, 128: 128x128)."""
    return np.array([m, n, k, lda, ldb, ldd, _LT_TYPE[ta], _LT_TYPE[tb], _LT_TYPE[td], int(fast), workspace,
                     _EPILOGUE_BIAS if bias else _EPILOGUE_DEFAULT, _LT_TYPE[td] if bias else _LT_TYPE["bfloat16"],
                     _SCALE_MODE[blocks[0]], _SCALE_MODE[blocks[1]]], np.int64)


def _call(fn, *args) -> str:
    """Calls a shim entry point that ends in (err, errcap): "" or the reason it gave."""
    err = ctypes.create_string_buffer(1024)
    rc = fn(*args, err, len(err))
    return "" if rc >= 0 else err.value.decode(errors="replace")


@functools.lru_cache(maxsize=None)
def gemm_target() -> tuple[bool, str]:
    """(ok, why): the shim is loaded, cuBLASLt found, and the GEMM handler registered with jax as
    the CUDA custom call target :data:`TARGET`."""
    ok, why = callbacks.ffi_target()
    if not ok:
        return False, why
    lib, _ = _shim.library("xla")  # (loading it told the shim where cuBLASLt is: csrc.cublaslt_path)
    err = ctypes.create_string_buffer(1024)
    version = lib.ff8_gemm_load(err, len(err))
    if version < 0:
        return False, f"the FP8 GEMM cannot load cuBLASLt: {err.value.decode(errors='replace')}"
    try:
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ff8_xla_fp8_gemm), platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_BIAS, jax.ffi.pycapsule(lib.ff8_xla_fp8_gemm_bias), platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_BLOCK, jax.ffi.pycapsule(lib.ff8_xla_fp8_gemm_block), platform="CUDA")
        jax.ffi.register_ffi_target(TARGET_BLOCK_BIAS, jax.ffi.pycapsule(lib.ff8_xla_fp8_gemm_block_bias),
                                    platform="CUDA")
    except Exception as e:  # noqa: BLE001 - say why and keep XLA's dot
        return False, f"registering the FP8 GEMM's XLA FFI target failed ({type(e).__name__}: {e})"
    return True, f"cuBLASLt {version} ({err.value.decode(errors='replace')})"


def gemm_path() -> tuple[str, str]:
    """(backend, why) of impl='auto''s FP8 GEMM on CUDA, without building or loading anything:
    'fusedfp8_fp8_gemm' (cuBLASLt called by the shim) or "XLA's dot"."""
    if gemm_target.cache_info().currsize:  # decided in this process already
        ok, why = gemm_target()
        return (TARGET, why) if ok else ("XLA's dot", why)
    path, why = cuda_backend.launch_path()
    if path != "ffi":
        return "XLA's dot", f"the shim is not in use: {why}"
    where = _shim.cublaslt_path() or "libcublasLt.so.13 / .so.12 on the loader's path"
    return TARGET, f"from the first CUDA trace on, cuBLASLt from {where} (or the copy already loaded)"


def check_shape(m, n, k, lda, ldb, ldd, ta, tb, td, fast=False, workspace=WORKSPACE_BYTES, bias=False,
                blocks=(0, 0)) -> str:
    """"" or why the shim's FP8 GEMM refuses the shape (its own check, gemm.h's check_shape; no GPU
    needed, the shim is built on first use)."""
    lib, why = _shim.library("xla")
    if lib is None:
        return f"the shim is not available: {why}"
    code = _shape_code(m, n, k, lda, ldb, ldd, ta, tb, td, fast, workspace, bias, blocks)
    return _call(lib.ff8_gemm_check, code.ctypes.data)


@functools.lru_cache(maxsize=None)
def _prepared(code: tuple) -> str:
    """Makes the cuBLASLt descriptors and algorithm of the shape ``code`` on every local GPU (at
    trace time, outside any stream capture): "" or the first device's reason."""
    lib, _ = _shim.library("xla")
    arr = np.array(code, np.int64)
    for dev in callbacks.gpu_devices():
        why = _call(lib.ff8_gemm_prepare, dev, arr.ctypes.data)
        if why:
            return f"CUDA device {dev}: {why}"
    return ""


# ---- the two backends ------------------------------------------------------------------------
def _xla_dot(a, b, sa, sb, bias, out_dtype, m: int, n: int, fast_accum: bool):
    """XLA's dot (its GEMM rewriter makes it one cuBLASLt FP8 call with a float32 output). XLA maps
    the dot's precision to the FP8 accumulation: DEFAULT fast, HIGHEST the split accumulator.
    Every operand dimension padded to 16 when one is ragged (XLA's rewriter needs them all). The
    bias (or None) is added in float32 before the one rounding, as the epilogue does."""
    if any(d % GEMM_MULTIPLE for d in (*a.shape, *b.shape)):
        a, b = (jnp.pad(x, [(0, -d % GEMM_MULTIPLE) for d in x.shape]) for x in (a, b))
    precision = lax.Precision.DEFAULT if fast_accum else lax.Precision.HIGHEST
    y = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    y = (y * (sa[0] * sb[0]))[:m, :n]
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(out_dtype)


def _pad_to(x, rows: int, cols: int):
    if x.shape == (rows, cols):
        return x
    return jnp.pad(x, [(0, rows - x.shape[0]), (0, cols - x.shape[1])])


def _ffi_operands(a, b, bias, out_name: str, m: int, n: int, fast_accum: bool):
    """(a, b, bias, output columns, shape code) of the FFI call: K zero-padded to 16, b's rows and
    the bias to the output columns (only where the caller's operands are not padded already)."""
    k, cols = _round_up(a.shape[1]), output_cols(n)
    a = _pad_to(a, a.shape[0], k)
    b = _pad_to(b, max(b.shape[0], cols), k)
    if bias is not None and cols != n:
        bias = jnp.pad(bias, (0, cols - n))
    code = _shape_code(m, cols, k, k, k, cols, a.dtype.name, b.dtype.name, out_name, fast_accum, WORKSPACE_BYTES,
                       bias is not None)
    return a, b, bias, cols, tuple(int(v) for v in code)


def _ffi_gemm(a, b, sa, sb, bias, out_name: str, m: int, n: int, fast_accum: bool):
    a, b, bias, cols, code = _ffi_operands(a, b, bias, out_name, m, n, fast_accum)
    why = _prepared(code)
    if why:
        raise RuntimeError(f"fusedfp8: the FP8 GEMM (m={m}, n={n}, k={a.shape[1]}) cannot run: {why}")
    call = jax.ffi.ffi_call(TARGET if bias is None else TARGET_BIAS,
                            (jax.ShapeDtypeStruct((m, cols), jnp.dtype(out_name)),
                             jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)), vmap_method="sequential")
    out, _ = call(a, b, sa, sb, *(() if bias is None else (bias,)), fast_accum=int(bool(fast_accum)))
    return out if cols == n else out[:, :n]


def _auto_uses_ffi(a, b, bias, out_name: str, m: int, n: int, fast_accum: bool) -> bool:
    """impl='auto' on CUDA: the FFI GEMM where the shim and cuBLASLt are available and cuBLASLt has
    an algorithm for the shape on every local GPU (decided at trace time), else XLA's dot."""
    if not (_shim.default_on()[0] and callbacks.gpu_devices() and gemm_target()[0]):
        return False
    why = _prepared(_ffi_operands(a, b, bias, out_name, m, n, fast_accum)[4])
    if why:
        warnings.warn(f"fusedfp8: the FP8 GEMM (m={m}, n={n}, k={a.shape[1]}) runs as XLA's dot: {why}", stacklevel=2)
    return not why


# ---- the public function ---------------------------------------------------------------------
def _check(a, b, scale_inv_a, scale_inv_b, out_dtype, shape, bias):
    a, b = jnp.asarray(a), jnp.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if x.dtype.name not in FP8_DTYPES:
            raise TypeError(f"{name} must be a float8_e4m3fn or float8_e5m2 array; got {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be 2-D (rows, K); got shape {x.shape}")
    if a.dtype.name == b.dtype.name == "float8_e5m2":
        raise TypeError("a and b cannot both be float8_e5m2: cuBLASLt has no e5m2 x e5m2 FP8 GEMM (make one operand "
                        "float8_e4m3fn)")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) must agree on K; got {a.shape} and {b.shape}")
    scales = []
    for name, s in (("scale_inv_a", scale_inv_a), ("scale_inv_b", scale_inv_b)):
        s = jnp.asarray(s)
        if s.dtype != jnp.float32 or s.shape not in ((), (1,)):
            raise ValueError(f"{name} must be a float32 array of shape (1,) (or a scalar); got {s.dtype} {s.shape}")
        scales.append(s.reshape(1))
    out_name = jnp.dtype(out_dtype).name
    if out_name not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}; got {out_name}")
    m, n = (a.shape[0], b.shape[0]) if shape is None else shape
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (m, n)):
        raise TypeError(f"shape must be None or a pair of ints (m, n); got {shape!r}")
    if not (0 <= m <= a.shape[0] and 0 <= n <= b.shape[0]):
        raise ValueError(f"shape (m, n) must be within a's rows ({a.shape[0]}) and b's rows ({b.shape[0]}); "
                         f"got {(m, n)}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (int(n),) or bias.dtype.name != out_name:
            raise ValueError(f"bias must be None or a ({int(n)},) {out_name} array (one element per output column, "
                             f"the output's dtype); got {bias.dtype} {bias.shape}")
    return a, b, *scales, bias, out_name, int(m), int(n)


def fp8_gemm(a, b, scale_inv_a, scale_inv_b, out_dtype=jnp.bfloat16, *, shape=None, fast_accum: bool = False,
             bias=None, impl: str = "auto"):
    """``out_dtype((a[:m] @ b[:n].T) * scale_inv_a * scale_inv_b (+ bias))``: the FP8 GEMM of every
    linear layer in :mod:`fusedfp8.jax.dot`.

    Parameters
    ----------
    a : (>= m, K) float8_e4m3fn / float8_e5m2;  b : (>= n, K), the same choice (not both e5m2)
    scale_inv_a, scale_inv_b : (1,) float32, the operands' dequantization scales (device values)
    out_dtype : bfloat16 (default), float16 or float32
    shape : (m, n), the output wanted (default: (a's rows, b's rows)); rows of a and b beyond them
        (the zero padding our kernels write for ragged GEMMs) are not read by the FFI GEMM
    fast_accum : cuBLASLt's FP8 fast accumulation (partial sums never promoted); False: the split
        accumulator
    bias : None, or (n,) of ``out_dtype``: added to each row in float32 before the one rounding to
        ``out_dtype`` (cuBLASLt's bias epilogue on the FFI GEMM, bf16 / fp16 outputs; added by XLA
        to a float32 output), so no separate pass over the output
    impl : see the module docstring

    Returns the (m, n) array of ``out_dtype``.
    """
    P._check_impl(impl)
    a, b, sa, sb, bias, out_name, m, n = _check(a, b, scale_inv_a, scale_inv_b, out_dtype, shape, bias)
    fast = bool(fast_accum)
    if impl == "ffi":
        ok, why = gemm_target()
        if not ok:
            raise ValueError(f"impl='ffi' needs the FP8 GEMM of the compiled shim, which is not available: {why}. "
                             "Use impl='auto' or impl='callback' (XLA's dot)")
    if m == 0 or n == 0 or a.shape[1] == 0:  # nothing to multiply: no GEMM is launched
        zeros = jnp.zeros((m, n), out_name)
        return zeros if bias is None else zeros + bias
    if bias is not None and out_name == "float32":  # (cuBLASLt's FP8 bias epilogue has no float32 output)
        return fp8_gemm(a, b, sa, sb, out_name, shape=(m, n), fast_accum=fast, impl=impl) + bias
    args = (a, b, sa, sb) + (() if bias is None else (bias,))

    def xla(a, b, sa, sb, *bias):
        return _xla_dot(a, b, sa, sb, bias[0] if bias else None, out_name, m, n, fast)

    def ffi(a, b, sa, sb, *bias):
        out = _ffi_gemm(a, b, sa, sb, bias[0] if bias else None, out_name, m, n, fast)
        return P._as_varying_as((out,), (a, b, sa, sb, *bias))[0]

    if impl in _XLA_IMPLS:
        return xla(*args)
    if impl == "ffi":
        return ffi(*args)

    def cuda(a, b, sa, sb, *bias):
        use = _auto_uses_ffi(a, b, bias[0] if bias else None, out_name, m, n, fast)
        return (ffi if use else xla)(a, b, sa, sb, *bias)

    return lax.platform_dependent(*args, cuda=cuda, default=xla)


# ---- the block-scaled GEMM (BlockScaling) ---------------------------------------------------------
_BLOCK = 128


def _expand_block_scales(s, rows: int, k: int, block: int):
    """(rows, k) float32: each element's scale_inv read from ``s`` in the layout of a (rows, k)
    operand with ``block``-row blocks (:func:`fusedfp8.numerics.block.expand_scales` in jax.numpy)."""
    kb = -(-k // _BLOCK)
    if block == 1:  # (ceil(k/128), pad4(rows)), element [kb, r]
        return jnp.repeat(s[:, :rows].T, _BLOCK, axis=1, total_repeat_length=kb * _BLOCK)[:, :k]
    per = s[:, :kb]  # (ceil(rows/128), kb), element [rb, kb]
    per = jnp.repeat(per, _BLOCK, axis=0, total_repeat_length=per.shape[0] * _BLOCK)[:rows]
    return jnp.repeat(per, _BLOCK, axis=1, total_repeat_length=kb * _BLOCK)[:, :k]


def _block_emulation(a, b, sa, sb, a_block: int, b_block: int, bias, out_name: str):
    """The float32 product of the dequantized operands (each FP8 value times its block's
    scale_inv, exact), plus the bias, rounded once."""
    (m, k), n = a.shape, b.shape[0]
    da = a.astype(jnp.float32) * _expand_block_scales(sa, m, k, a_block)
    db = b.astype(jnp.float32) * _expand_block_scales(sb, n, k, b_block)
    y = lax.dot_general(da, db, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
    return (y if bias is None else y + bias.astype(jnp.float32)).astype(out_name)


def _padded_block_operands(a, b, sa, sb, a_block: int, b_block: int, bias):
    """The operands with M, N and K rounded up to multiples of 16 (what cuBLASLt's FP8 GEMM takes):
    zero FP8 bytes (a zero product changes no sum), a 1x128 operand's scale array widened to the
    padded rows with 1s (padding to 16 adds no 128-block, so every other scale stays where it is),
    the bias with zeros. Slicing the (M', N') product to (M, N) gives the unpadded one."""
    from ..numerics.block import scale_shape

    (m, k), n = a.shape, b.shape[0]
    pm, pn, pk = (_round_up(d) for d in (m, n, k))
    out = [jnp.pad(a, [(0, pm - m), (0, pk - k)]), jnp.pad(b, [(0, pn - n), (0, pk - k)])]
    for s, rows, prows, blk in ((sa, m, pm, a_block), (sb, n, pn, b_block)):
        want = scale_shape(prows, pk, (blk, _BLOCK))
        out.append(jnp.pad(s, [(0, w - d) for w, d in zip(want, s.shape)], constant_values=1.0))
    out.append(None if bias is None else jnp.pad(bias, (0, pn - n)))
    return out


def _fails_when_run(message: str, shape: tuple, dtype: str, like):
    """A ``(shape, dtype)`` array whose computation raises ``RuntimeError(message)`` when it runs
    (a host callback): the CUDA branch's answer where the block-scaled GEMM cannot be had.
    ``lax.platform_dependent`` traces every branch, so raising at trace time would also break
    the program lowered for the CPU on a GPU host without the shim (or on a GPU cuBLASLt has no
    block-scaled GEMM for); the CUDA program fails when it runs, with this message."""

    def fail(_):
        raise RuntimeError(message)

    return jax.pure_callback(fail, jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), like, vmap_method="sequential")


def _block_ffi(a, b, sa, sb, a_block: int, b_block: int, bias, out_name: str):
    (m, k), n = a.shape, b.shape[0]
    if bias is not None and out_name == "float32":  # (cuBLASLt's FP8 bias epilogue has no float32 output)
        return _block_ffi(a, b, sa, sb, a_block, b_block, None, out_name) + bias
    code = _shape_code(m, n, k, k, k, n, a.dtype.name, b.dtype.name, out_name, False, WORKSPACE_BYTES,
                       bias is not None, (a_block, b_block))
    why = _prepared(tuple(int(v) for v in code))
    if why:
        return _fails_when_run(f"fusedfp8: the block-scaled FP8 GEMM (m={m}, n={n}, k={k}) cannot run: {why}",
                               (m, n), out_name, sa)
    call = jax.ffi.ffi_call(TARGET_BLOCK if bias is None else TARGET_BLOCK_BIAS,
                            (jax.ShapeDtypeStruct((m, n), jnp.dtype(out_name)),
                             jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)), vmap_method="sequential")
    out, _ = call(a, b, sa, sb, *(() if bias is None else (bias,)), a_block=int(a_block), b_block=int(b_block))
    return out


def _has_gpu() -> bool:
    return bool(callbacks.gpu_devices())


def _block_ready() -> tuple[bool, str]:
    """(True, why) where the block-scaled GEMM can run on CUDA (the shim's cuBLASLt GEMM, loaded
    now), else (False, why not): there is no other block-scaled FP8 GEMM for JAX on a GPU."""
    if not _shim.default_on()[0]:
        return False, f"the shim is not in use: {_shim.default_on()[1]}"
    return gemm_target()


def block_gemm_path() -> tuple[str, str]:
    """(backend, why) of the block-scaled GEMM on CUDA, without building or loading anything:
    :data:`TARGET_BLOCK` where :func:`gemm_path` finds the shim's GEMM, else 'none' (block-scaled
    layers then fail when they run on CUDA)."""
    path, why = gemm_path()
    if path == TARGET:
        return TARGET_BLOCK, f"{why}; the scale pairs cuBLASLt offers are asked at first use"
    return "none", f"{why}: block-scaled layers fail when they run on CUDA (impl='jnp' runs the float32 emulation)"


def fp8_block_gemm(a, b, scale_inv_a, scale_inv_b, a_block: int, b_block: int, out_dtype=jnp.bfloat16, *,
                   bias=None, impl: str = "auto"):
    """``out_dtype(a @ b.T (+ bias))`` for FP8 operands with a scale per block (BlockScaling).

    Parameters
    ----------
    a : (M, K), b : (N, K), float8_e4m3fn / float8_e5m2 (not both e5m2), both K-contiguous (the q
        and q_t that :func:`fusedfp8.jax.block.block_quantize` writes)
    scale_inv_a, scale_inv_b : float32, each operand's block scales in the layout of
        :mod:`fusedfp8.numerics.block` (``scale_shape(M, K, (a_block, 128))``, ...)
    a_block, b_block : 1 (1x128 blocks) or 128 (128x128; not both)
    out_dtype : bfloat16 (default), float16 or float32
    bias : None, or (N,) of ``out_dtype``, added in float32 before the one rounding
    impl : 'auto' and 'callback' (on CUDA the shim's cuBLASLt block-scaled GEMM, a custom call to
        ``fusedfp8_fp8_gemm_block``, on operands padded with zeros to multiples of 16 where they are
        not, a copy that ``pad_to=16`` in the block quantization avoids: XLA has no block-scaled FP8
        dot to call instead; elsewhere the emulation), 'ffi' (that GEMM; an error where it cannot
        run), 'jnp' (the emulation everywhere: the float32 product of the dequantized operands)

    On CUDA without the shim (or where cuBLASLt has no block-scaled GEMM: Hopper only) 'auto'
    fails when the CUDA program runs, saying why (there is no other block-scaled FP8 GEMM; a silent
    float32 product would not be the FP8 GEMM asked for): impl='jnp' asks for the emulation. The
    same program lowered for the CPU runs the emulation.
    Returns the (M, N) array of ``out_dtype``.
    """
    from ..numerics.block import scale_shape

    P._check_impl(impl)
    a, b = jnp.asarray(a), jnp.asarray(b)
    for name, x in (("a", a), ("b", b)):
        if x.dtype.name not in FP8_DTYPES or x.ndim != 2:
            raise TypeError(f"{name} must be a 2-D float8_e4m3fn or float8_e5m2 array; got {x.dtype} {x.shape}")
    if a.dtype.name == b.dtype.name == "float8_e5m2":
        raise TypeError("a and b cannot both be float8_e5m2: cuBLASLt has no e5m2 x e5m2 FP8 GEMM")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a (M, K) and b (N, K) must agree on K; got {a.shape} and {b.shape}")
    if a_block not in (1, 128) or b_block not in (1, 128) or a_block == b_block == 128:
        raise ValueError(f"a_block and b_block must be 1 (1x128 blocks) or 128 (128x128), not both 128; got "
                         f"{a_block!r} and {b_block!r}")
    (m, k), n = a.shape, b.shape[0]
    scales = []
    for name, s, rows, blk in (("scale_inv_a", scale_inv_a, m, a_block), ("scale_inv_b", scale_inv_b, n, b_block)):
        s = jnp.asarray(s)
        want = scale_shape(rows, k, (blk, 128))
        if s.dtype != jnp.float32 or s.shape != want:
            raise ValueError(f"{name} must be a float32 array of shape {want} (the {blk}x128 block scales of a "
                             f"({rows}, {k}) operand); got {s.dtype} {s.shape}")
        scales.append(s)
    out_name = jnp.dtype(out_dtype).name
    if out_name not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}; got {out_name}")
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (n,) or bias.dtype.name != out_name:
            raise ValueError(f"bias must be None or a ({n},) {out_name} array; got {bias.dtype} {bias.shape}")
    sa, sb = scales
    if impl == "ffi":
        ok, why = _block_ready()
        if not ok:
            raise ValueError(f"impl='ffi' needs the block-scaled FP8 GEMM of the compiled shim, which is not "
                             f"available: {why}")
    if m == 0 or n == 0 or k == 0:
        zeros = jnp.zeros((m, n), out_name)
        return zeros if bias is None else zeros + bias
    args = (a, b, sa, sb) + (() if bias is None else (bias,))

    def emulation(a, b, sa, sb, *bias):
        return _block_emulation(a, b, sa, sb, a_block, b_block, bias[0] if bias else None, out_name)

    def cuda(a, b, sa, sb, *bias):
        if not _has_gpu():  # (traced by platform_dependent on a machine without a GPU: never run)
            return emulation(a, b, sa, sb, *bias)
        ok, why = _block_ready()
        if ok:
            pa, pb, psa, psb, pbias = _padded_block_operands(a, b, sa, sb, a_block, b_block, bias[0] if bias else None)
            out = _block_ffi(pa, pb, psa, psb, a_block, b_block, pbias, out_name)[:m, :n]
        else:
            out = _fails_when_run(f"fusedfp8: the block-scaled FP8 GEMM on CUDA needs the compiled shim's cuBLASLt "
                                  f"GEMM, which is not available: {why}. impl='jnp' runs the float32 emulation "
                                  "instead", (m, n), out_name, sa)
        return P._as_varying_as((out,), (a, b, sa, sb, *bias))[0]

    if impl == "jnp":
        return emulation(*args)
    if impl == "ffi":
        return cuda(*args)
    return lax.platform_dependent(*args, cuda=cuda, default=emulation)  # 'auto', 'callback'
