"""Which FP8 GEMM the torch layers run on CUDA: the shim's cuBLASLt GEMM or ``torch._scaled_mm``.

Every FP8 layer (:class:`~fusedfp8.pytorch.Fp8Linear`, :class:`~fusedfp8.pytorch.Fp8MLP`,
:func:`~fusedfp8.pytorch.convert_to_fp8`) takes ``gemm``, one of :data:`GEMMS`:

- ``'cublaslt'``: ``torch.ops.fusedfp8.fp8_gemm_lt``, the compiled shim's cuBLASLt FP8 GEMM
  (fusedfp8/csrc/torch_gemm.h): cuBLASLt descriptors and the heuristic's algorithm cached per
  shape in C++, the scales read from device memory, the output written in its final dtype. Far
  less host time per call than ``torch._scaled_mm`` (the reason it exists: ~55 us of host time
  per ``_scaled_mm`` call on the H200, six GEMMs per MLP step). An error on the first CUDA
  forward where the shim cannot be had (no compiler, ``FUSEDFP8_NO_SHIM``, an old build).
- ``'scaled_mm'``: ``torch._scaled_mm`` (the only GEMM before the shim's).
- ``'auto'`` (the default): ``'cublaslt'`` where the shim can be had, else ``'scaled_mm'`` (the
  reason is in :func:`gemm_path`). With the bias in the GEMM's epilogue both run the same cuBLASLt
  kernels (``scripts/gemm_backends.py`` compares them GEMM by GEMM); the shim's call costs less
  host time per GEMM, which is what an eager step is made of.

The choice is made once per process and value (the first CUDA forward loads, and if needed
compiles, the shim), never per call; :func:`gemm_path` says what it is. On the CPU every value
runs the same float32 emulation (:func:`fusedfp8.pytorch.autograd.scaled_mm`).

Numerics. Both backends are one cuBLASLt FP8 matmul of the same operands with the same scales
and the same accumulation mode (``fast_accum``: the forward GEMM's fast accumulation, the
backward GEMMs' split accumulator), so their results differ only by the order of the float32
accumulation (the two may get different algorithms, tile shapes or split-K from cuBLASLt's
heuristic; the shim asks it the same question torch does: torch's cuBLASLt workspace size (set
when the backend is decided, where torch tells it: :func:`torch_lt_workspace`; else 32 MiB, torch's
size on Hopper) and 256-byte alignment for the caching allocator's tensors, see
fusedfp8/csrc/torch_gemm.h). A bias is
added the same way too: a bias of the output's dtype (bf16 / fp16) in cuBLASLt's bias epilogue,
``round(scale_a * scale_b * acc + bias)`` in float32 with one rounding to the output dtype; any other
pairing (a float32 output, or a bias of another dtype, which cuBLASLt's FP8 epilogue and
``_scaled_mm`` refuse) as the float32 product plus the bias, rounded once.
"""
from __future__ import annotations

import threading

import torch

from .. import csrc as _shim

__all__ = ["GEMMS", "check_gemm", "backend", "gemm_path"]

GEMMS = ("auto", "cublaslt", "scaled_mm")
_resolved: dict = {}  # gemm -> (backend, why), decided once per process
_lock = threading.Lock()


def check_gemm(gemm) -> str:
    """``gemm`` itself when it is one of :data:`GEMMS`; else ValueError naming the argument."""
    if not isinstance(gemm, str) or gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}; got {gemm!r}")
    return gemm


def torch_lt_workspace() -> int | None:
    """The cuBLASLt workspace bytes torch gives ``torch._scaled_mm`` in this process, or None where
    torch does not say (no CUDA, a torch without ``torch._C._cuda_getCublasLtWorkspaceSize``)."""
    get = getattr(torch._C, "_cuda_getCublasLtWorkspaceSize", None)
    if get is None or not torch.cuda.is_available():
        return None
    try:
        return int(get())
    except RuntimeError:
        return None


def _lt_op():
    """(the fp8_gemm_lt OpOverload, where it came from) or (None, why not); loads the shim and
    gives its GEMM torch's cuBLASLt workspace size (the heuristic then answers both alike)."""
    lib, why = _shim.library("torch")
    if lib is None:
        return None, f"the torch launch shim is not available: {why}"
    try:
        op = torch.ops.fusedfp8.fp8_gemm_lt.default
    except (AttributeError, RuntimeError):
        return None, f"the torch shim ({why}) defines no fusedfp8::fp8_gemm_lt (an older build)"
    ws = torch_lt_workspace()
    if ws is not None and hasattr(lib, "gemm_set_workspace"):
        lib.gemm_set_workspace(ws)
        why += f"; cuBLASLt workspace {ws} bytes, as torch's"
    return op, f"fusedfp8::fp8_gemm_lt of the torch shim ({why})"


def _resolve(gemm: str) -> tuple[str, str]:
    if gemm == "scaled_mm":
        return "scaled_mm", "torch._scaled_mm, as asked (gemm='scaled_mm')"
    op, why = _lt_op()
    if op is not None:
        return "cublaslt", why if gemm == "cublaslt" else f"{why}; gemm='auto'"
    if gemm == "cublaslt":
        raise RuntimeError(f"gemm='cublaslt': the shim's cuBLASLt FP8 GEMM cannot be used: {why}. gemm='auto' "
                           "falls back to torch._scaled_mm")
    return "scaled_mm", f"torch._scaled_mm: {why}"


@torch.compiler.assume_constant_result
def backend(gemm: str) -> str:
    """The CUDA backend of ``gemm`` ('cublaslt' or 'scaled_mm'), decided on the first call for
    each value and remembered (under torch.compile a constant of the graph: nothing is traced).

    Raises
    ------
    ValueError
        ``gemm`` is not one of :data:`GEMMS`.
    RuntimeError
        ``gemm='cublaslt'`` where the shim's GEMM cannot be had (says why).
    """
    got = _resolved.get(gemm)
    if got is None:
        check_gemm(gemm)
        with _lock:
            got = _resolved.get(gemm)
            if got is None:
                got = _resolved[gemm] = _resolve(gemm)
    return got[0]


def gemm_path(gemm: str = "auto") -> tuple[str, str]:
    """(backend, why) of ``gemm`` on CUDA, without building or loading anything: the decision when
    it was made in this process, else what the first CUDA forward will decide."""
    check_gemm(gemm)
    if gemm in _resolved:
        return _resolved[gemm]
    if gemm == "scaled_mm":
        return _resolve(gemm)
    ready, why = _shim.status("torch")
    if ready is False:
        if gemm == "auto":
            return "scaled_mm", f"torch._scaled_mm (gemm='auto'): the torch launch shim is not available: {why}"
        return "error", f"the torch launch shim is not available: {why}"
    return "cublaslt", f"from the first CUDA forward on ({why})"
