"""The torch layers' FP8 GEMM: which one runs on CUDA (the shim's cuBLASLt GEMM or
``torch._scaled_mm``) and the call itself (:func:`scaled_mm`, with its CPU emulation).

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
runs the same float32 emulation (:func:`scaled_mm`).

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
from torch import Tensor

from .. import csrc as _shim

__all__ = ["GEMMS", "check_gemm", "backend", "backend_for", "GemmChoice", "gemm_path", "block_gemm_path", "scaled_mm",
           "block_scaled_mm"]

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


def backend_for(gemm: str, x: Tensor) -> str:
    """The backend a call on ``x`` runs: :func:`backend` on CUDA; 'scaled_mm' on the CPU, where
    every value runs the same float32 emulation."""
    return backend(gemm) if x.is_cuda else "scaled_mm"


class GemmChoice:
    """The ``gemm`` attribute of an FP8 layer (Fp8Linear, Fp8BlockLinear): checked when set."""

    _gemm = "auto"  # (also the value of a module pickled before the argument existed)

    @property
    def gemm(self) -> str:
        """The FP8 GEMM on CUDA: 'auto', 'cublaslt' or 'scaled_mm' (see :mod:`fusedfp8.pytorch.gemm`)."""
        return self._gemm

    @gemm.setter
    def gemm(self, gemm: str) -> None:
        self._gemm = check_gemm(gemm)

    def _gemm_backend(self, x: Tensor) -> str:
        """The GEMM backend of a forward on ``x`` (:func:`backend_for`)."""
        return backend_for(self._gemm, x)


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


def block_gemm_path(gemm: str = "auto") -> tuple[str, str]:
    """(backend, why) of the block-scaled GEMM (BlockScaling) of ``gemm`` on CUDA, as
    :func:`gemm_path` (nothing built or loaded): the shim's ``fusedfp8::fp8_gemm_lt_block`` or
    ``torch._scaled_mm``'s blockwise recipes (torch >= 2.9 on Hopper)."""
    path, why = gemm_path(gemm)
    if path == "cublaslt":
        return "fusedfp8::fp8_gemm_lt_block", why
    if path == "scaled_mm":
        return "torch._scaled_mm (blockwise)", why
    return path, why


# ---- the call --------------------------------------------------------------------------------
_BIAS_FUSABLE = (torch.bfloat16, torch.float16)


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None,
              out_dtype: torch.dtype, fast_accum: bool = False, gemm: str = "scaled_mm") -> Tensor:
    """``out_dtype((a @ b) * scale_a * scale_b + bias)`` for FP8 operands.

    Parameters
    ----------
    a : (M, K) float8, row-major
    b : (K, N) float8, column-major (the ``.t()`` of a contiguous (N, K) tensor)
    scale_a, scale_b : (1,) float32 on the operands' device; the operands' ``scale_inv``. On CUDA
        each must start 16-byte aligned (cuBLASLt refuses others with CUBLAS_STATUS_NOT_SUPPORTED):
        pass the ``scale_inv`` the quantize ops return, not a view into a state.
    bias : (N,) tensor or None
        Fused into ``_scaled_mm`` where it allows (bf16/fp16 output and a bias of that dtype);
        added in float32 otherwise.
    out_dtype : torch.dtype
    fast_accum : bool
        ``use_fast_accum`` of ``_scaled_mm`` / ``fast_accum`` of ``fp8_gemm_lt`` (CUDA only; the CPU
        emulation accumulates in float32).
    gemm : {'scaled_mm', 'cublaslt'}
        The CUDA backend (:func:`fusedfp8.pytorch.gemm.backend` of the layer's ``gemm``):
        ``torch._scaled_mm``, or the shim's ``torch.ops.fusedfp8.fp8_gemm_lt`` (then ``b`` must be
        the ``.t()`` of a contiguous (N, K) tensor; a bias fused into its epilogue as into
        ``_scaled_mm``'s, see :mod:`fusedfp8.pytorch.gemm`). Ignored on the CPU.

    Returns
    -------
    (M, N) tensor of ``out_dtype``. CUDA runs the ``gemm`` backend (K and N multiples of 16: the
    callers pad the operands); the CPU computes the float32 product of the exact FP8 values,
    scales it by ``scale_a * scale_b`` and adds the bias in float32.
    """
    if a.shape[0] == 0 or a.shape[1] == 0 or b.shape[1] == 0:  # nothing to multiply: as torch's matmul
        y = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
        return (y if bias is None else y + bias.float()).to(out_dtype)
    if a.is_cuda:
        if gemm == "cublaslt":
            return _cublaslt_mm(a, b, scale_a, scale_b, bias, out_dtype, fast_accum)
        fused = bias is not None and out_dtype in _BIAS_FUSABLE and bias.dtype == out_dtype
        if bias is None or fused:
            return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                    use_fast_accum=fast_accum)
        y = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32,
                             use_fast_accum=fast_accum)
        return (y + bias.float()).to(out_dtype)
    with torch.autocast("cpu", enabled=False):  # the emulation is float32, whatever autocast says
        y = torch.mm(a.float(), b.float()) * (scale_a * scale_b)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)


def _cublaslt_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None,
                 out_dtype: torch.dtype, fast_accum: bool) -> Tensor:
    """:func:`scaled_mm` through ``fusedfp8::fp8_gemm_lt`` (a (M, K), b.t() (N, K), both contiguous).
    A bias of the output's dtype (bf16 / fp16) goes into the op's epilogue, as into ``_scaled_mm``'s;
    any other pairing (a float32 output, a bias of another dtype) is added to the float32 product
    and rounded once, as :func:`scaled_mm` does for ``_scaled_mm``."""
    op = torch.ops.fusedfp8.fp8_gemm_lt.default
    if bias is None or (out_dtype in _BIAS_FUSABLE and bias.dtype == out_dtype):
        return op(a, b.t(), scale_a, scale_b, out_dtype, fast_accum, bias)
    y = op(a, b.t(), scale_a, scale_b, torch.float32, fast_accum).add_(bias)  # one rounding, as an epilogue
    return y if out_dtype == torch.float32 else y.to(out_dtype)


# ---- the block-scaled call (BlockScaling) ---------------------------------------------------------
_BLOCK = 128


def _expand_block_scales(s: Tensor, rows: int, k: int, block: int) -> Tensor:
    """(rows, k) float32: each element's scale_inv, read from ``s`` in the layout of a (rows, k)
    operand with ``block``-row blocks (:func:`fusedfp8.numerics.block.expand_scales` in torch)."""
    kb = -(-k // _BLOCK)
    if block == 1:  # (ceil(k/128), pad4(rows)), element [kb, r]
        per = s[:, :rows].t()  # (rows, kb)
        return per.repeat_interleave(_BLOCK, dim=1)[:, :k]
    per = s[:, :kb]  # (ceil(rows/128), kb), element [rb, kb]
    return per.repeat_interleave(_BLOCK, dim=0)[:rows].repeat_interleave(_BLOCK, dim=1)[:, :k]


def _scaled_mm_scale(s: Tensor, rows: int, k: int, block: int, operand: str) -> Tensor:
    """``s`` (our layout) as the view ``torch._scaled_mm`` checks for its blockwise recipes: for
    ``a`` (M, K) 1x128 (M, ceil(K/128)) with strides (1, pad4(M)), 128x128 (ceil(M/128),
    ceil(K/128)); for ``b`` (passed as the (K, N) ``.t()`` of our (N, K) operand) the transposes."""
    kb = -(-k // _BLOCK)
    if block == 1:
        v = s[:, :rows]  # (kb, rows), rows contiguous
        return v.t() if operand == "a" else v
    v = s[:, :kb]  # (ceil(rows/128), kb), K blocks contiguous
    return v if operand == "a" else v.t()


def _k_padded_for_scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, a_block: int, b_block: int,
                            m: int, n: int, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """The operands and scales for ``torch._scaled_mm``'s blockwise recipes, with K padded where they
    need it. torch checks a 128x128 scale of more than one block row as (ceil(rows/128), ceil(K/128))
    with a row stride of exactly ceil(K/128), while cuBLASLt reads it with each row's K blocks
    padded to a multiple of 4 (our layout): where ceil(K/128) is not a multiple of 4, no view of the
    scales is both accepted and read right. There both operands are padded with zero bytes to K' =
    128 * pad4(ceil(K/128)), where the two layouts coincide (a zero product changes no sum), and the
    1x128 operand's scales get rows of 1 for the new K blocks (the 128x128 operand's pad columns
    already hold 1)."""
    from ..numerics.block import scale_shape

    rows128 = m if a_block == _BLOCK else n if b_block == _BLOCK else 0
    if -(-k // _BLOCK) % 4 == 0 or rows128 <= _BLOCK:
        return a, b, scale_a, scale_b, k
    kp = _BLOCK * scale_shape(rows128, k, (_BLOCK, _BLOCK))[1]  # the K blocks each scale row is padded to

    def operand(t: Tensor) -> Tensor:
        return torch.nn.functional.pad(t.view(torch.uint8), (0, kp - k)).view(t.dtype)

    def scales(s: Tensor, rows: int, block: int) -> Tensor:  # a 128x128 array keeps its shape
        want = scale_shape(rows, kp, (block, _BLOCK))
        return s if block == _BLOCK else torch.nn.functional.pad(s, (0, 0, 0, want[0] - s.shape[0]), value=1.0)

    return operand(a), operand(b), scales(scale_a, m, a_block), scales(scale_b, n, b_block), kp


def block_scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, a_block: int, b_block: int,
                    bias: Tensor | None, out_dtype: torch.dtype, gemm: str = "scaled_mm") -> Tensor:
    """``out_dtype(a @ b.T + bias)`` for FP8 operands with a scale per block (BlockScaling).

    Parameters
    ----------
    a : (M, K) float8, row-major; b : (N, K) float8, row-major (both K-contiguous, as the block
        quantize kernel writes q and q_t)
    scale_a, scale_b : float32, each operand's ``scale_inv`` as :func:`fusedfp8.block_quantize`
        returns it (the layout of :mod:`fusedfp8.numerics.block`)
    a_block, b_block : 1 (1x128 blocks) or 128 (128x128 blocks; not both)
    bias : (N,) tensor or None
    out_dtype : torch.dtype
    gemm : {'scaled_mm', 'cublaslt'}
        The CUDA backend: the shim's ``torch.ops.fusedfp8.fp8_gemm_lt_block`` (cuBLASLt with the
        VEC128_32F / BLK128x128_32F scale modes, reading the scales as they are) or
        ``torch._scaled_mm``'s blockwise recipes (views of the same scales). Ignored on the CPU.

    Returns
    -------
    (M, N) tensor of ``out_dtype``. CUDA: one block-scaled cuBLASLt GEMM with the split
    accumulator (the only one cuBLASLt offers with block scales), K and N multiples of 16 (the
    callers pad); a bias of the output's dtype (bf16 / fp16) in the epilogue, any other added to
    the float32 product and rounded once. The CPU: the float32 product of the dequantized
    operands (each FP8 value times its block's scale_inv, exact) plus the bias in float32.
    """
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    if m == 0 or n == 0 or k == 0:
        y = torch.zeros((m, n), dtype=torch.float32, device=a.device)
        return (y if bias is None else y + bias.float()).to(out_dtype)
    fused = bias is None or (out_dtype in _BIAS_FUSABLE and bias.dtype == out_dtype)
    if a.is_cuda:
        if gemm == "cublaslt":
            op = torch.ops.fusedfp8.fp8_gemm_lt_block.default
            if fused:
                return op(a, b, scale_a, scale_b, a_block, b_block, out_dtype, bias)
            y = op(a, b, scale_a, scale_b, a_block, b_block, torch.float32).add_(bias)
        else:
            a, b, scale_a, scale_b, k = _k_padded_for_scaled_mm(a, b, scale_a, scale_b, a_block, b_block, m, n, k)
            sa = _scaled_mm_scale(scale_a, m, k, a_block, "a")
            sb = _scaled_mm_scale(scale_b, n, k, b_block, "b")
            if fused:
                return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
            y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32).add_(bias)
        return y if out_dtype == torch.float32 else y.to(out_dtype)
    with torch.autocast("cpu", enabled=False):  # the emulation is float32, whatever autocast says
        da = a.float() * _expand_block_scales(scale_a, m, k, a_block)
        db = b.float() * _expand_block_scales(scale_b, n, k, b_block)
        y = torch.mm(da, db.t())
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)
