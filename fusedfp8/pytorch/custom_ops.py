"""The fused kernels as ``torch.library`` custom ops, namespace ``fusedfp8``.

CUDA tensors launch the kernels straight through :mod:`fusedfp8._cuda`'s launch interface on
torch's current stream, outputs allocated by torch; the full argument check of
:mod:`fusedfp8.ops` runs once per call signature (shapes, dtypes, device, 16-byte alignment,
state shapes, index, format) and is cached. CPU tensors run the bit-exact NumPy reference
through :mod:`fusedfp8.ops`. Being custom ops with declared mutations and fake (meta)
implementations, they trace under ``torch.compile(fullgraph=True)`` without graph breaks and can
be captured in a CUDA graph.

State arguments (the tensors of a :class:`fusedfp8.ScalingState`, or views of them):

amax_history : (L, n) float32, mutated
    Row 0, column ``index`` max-accumulates the amax of the quantized tensor.
scale : (n,) float32, mutated
    ``scale[index]`` multiplies before the cast; written on a first step with current scaling.
scale_inv : (n,) float32, mutated
    ``1 / scale``; written together with ``scale``.
updates : (n,) int32, read
    Completed updates per tensor; ``updates[index] == 0`` marks a first step, decided on the
    device by the kernel, never read by the host.

Plain arguments: ``index`` (the tensor's column), ``fmt`` ('e4m3' or 'e5m2'), ``margin_factor``
(``recipe.margin_factor``) and ``current_first`` (``recipe.first_step == 'current'``; when
True the kernel launches the first-step pre-pass, which does nothing unless the device flag
says the tensor is on its first step). Whole state tensors are passed, not 1-element views, so
that the mutation is declared on what the caller owns (module buffers).

Ops: ``quantize``, ``quantize_t``, ``gelu_quantize``, ``gelu_quantize_t``, ``dgelu_quantize_t``
and ``dequantize``; the ``_t`` variants also return the quantized transpose of the input
viewed as 2-D (``prod(shape[:-1])``, ``shape[-1]``). Every quantizing op returns last a (1,)
float32 ``scale_inv``: 1 / the scale it used, written by the kernel into a buffer of its own.
That is the operand scale for ``torch._scaled_mm`` (cuBLASLt refuses scale pointers that are
not 16-byte aligned, such as column views of the state) and a value frozen for the backward
(the state moves on at the next update).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _cuda
from .. import ops as _ops
from ..formats import get_format
from ..state import Slot
from ..types import kernel_op

__all__ = ["quantize", "quantize_t", "gelu_quantize", "gelu_quantize_t", "dgelu_quantize_t", "dequantize", "call"]

_MUTATED = ("amax_history", "scale", "scale_inv")
_IMPLS: dict = {}  # custom op -> its Python implementation
_PLAIN = (Tensor, torch.nn.Parameter)  # tensor types that nothing can be tracing
_checked: set = set()  # call signatures whose full argument check has passed


def _register(name: str, mutates_args):
    """``torch.library.custom_op`` that also remembers the undecorated function for :func:`call`."""
    def wrap(fn):
        op = torch.library.custom_op(f"fusedfp8::{name}", mutates_args=mutates_args)(fn)
        _IMPLS[op] = fn
        return op

    return wrap


def call(op, *args):
    """Run the custom op ``op`` on ``args``.

    In plain eager mode the implementation is called directly: a round trip through the
    dispatcher costs 20-70 us of host time per call (more for ops with mutated arguments),
    several times the kernel launch itself. Whenever anything may be tracing (torch.compile,
    a TorchDispatchMode such as make_fx or FakeTensorMode, functorch transforms, tensor
    subclasses) the call goes through the dispatcher, so the op is seen as the custom op it is.
    """
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()
            or any(isinstance(a, Tensor) and type(a) not in _PLAIN for a in args)):
        return op(*args)
    return _IMPLS[op](*args)


def _slot(amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int, fmt: str,
          margin_factor: float, current_first: bool) -> Slot:
    """The Slot of column ``index``."""
    i = slice(index, index + 1)
    return Slot(scale[i], scale_inv[i], amax_history[0, i], updates[i], get_format(fmt), float(margin_factor),
                bool(current_first))


def _fp8_dtype(fmt: str) -> torch.dtype:
    return getattr(torch, get_format(fmt).dtype_name)


def _rows(x: Tensor):
    return math.prod(x.shape[:-1])


def _scale_inv_like(x: Tensor) -> Tensor:
    return x.new_empty((1,), dtype=torch.float32)


def _run(op: str, x: Tensor, b: Tensor | None, state: tuple, index: int, fmt: str, margin_factor: float,
         current_first: bool, approximate: str, transpose: bool, dbias: bool):
    """(q, q_t or None, dbias or None, scale_inv) of one quantizing op."""
    amax_history, scale, scale_inv, updates = state
    if not x.is_cuda:
        slot = _slot(amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first)
        if op == "identity":
            r = _ops.quantize(x, slot, transpose=transpose)
        elif op == "gelu":
            r = _ops.gelu_quantize(x, slot, approximate=approximate, transpose=transpose)
        else:
            r = _ops.dgelu_quantize(x, b, slot, approximate=approximate, transpose=transpose, dbias=dbias)
        return r.data, r.data_t, r.dbias, r.scale_inv
    key = (op, x.shape, x.dtype, x.device, x.data_ptr() % 16, b is not None and b.data_ptr() % 16,
           amax_history.shape, amax_history.dtype, scale.dtype, scale_inv.dtype, updates.dtype,
           amax_history.data_ptr() % 4, index, fmt, approximate, transpose, dbias, bool(current_first))
    if key not in _checked:  # the full check of fusedfp8.ops, once per signature (it writes nothing)
        slot = _slot(amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first)
        _ops._Plan(x, b, slot, None, None, op, transpose, dbias, argname="x" if b is None else "dy")
        if not (x.is_contiguous() and (b is None or b.is_contiguous())
                and all(t.is_contiguous() for t in state) and updates.device == x.device):
            raise ValueError("fusedfp8 custom ops need contiguous inputs and state tensors on the input's device")
        _checked.add(key)
    rows, cols = (_rows(x), int(x.shape[-1])) if x.dim() else (1, 1)
    dt = _fp8_dtype(fmt)
    q = torch.empty(x.shape, dtype=dt, device=x.device)
    q_t = torch.empty((cols, rows), dtype=dt, device=x.device) if transpose else None
    si = torch.empty((1,), dtype=torch.float32, device=x.device)
    db = partial = counters = None
    if dbias:
        part_shape, n_counters = _cuda.dbias_workspace(rows, cols)
        db = (torch.empty if x.numel() else torch.zeros)((cols,), dtype=torch.float32, device=x.device)
        partial = torch.empty(part_shape, dtype=torch.float32, device=x.device)
        counters = torch.zeros((n_counters,), dtype=torch.int32, device=x.device)
    f32 = 4
    off = index * f32
    h, s, sinv = amax_history.data_ptr(), scale.data_ptr(), scale_inv.data_ptr()
    device = x.get_device()
    _cuda.launch_quantize(
        device, torch._C._cuda_getCurrentRawStream(device), dtype=str(x.dtype)[6:], fmt=fmt,
        op=kernel_op(op, approximate), x=x.data_ptr(), b=b.data_ptr() if b is not None else 0, q=q.data_ptr(),
        scale=s + off, amax=h + off, rows=rows, cols=cols, q_t=q_t.data_ptr() if q_t is not None else 0,
        dbias=db.data_ptr() if dbias and x.numel() else 0, partial=partial.data_ptr() if dbias else 0,
        counters=counters.data_ptr() if dbias else 0, scale_inv_used=si.data_ptr(), first=bool(current_first),
        updates=updates.data_ptr() + off, scale_out=s + off, scale_inv_out=sinv + off,
        margin_factor=float(margin_factor))
    return q, q_t, db, si


# ---- quantize --------------------------------------------------------------------------------
@_register("quantize", _MUTATED)
def quantize(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
             fmt: str, margin_factor: float, current_first: bool) -> tuple[Tensor, Tensor]:
    """``fp8(x * scale[index])`` (same shape as x) and its scale_inv; amax of x into
    ``amax_history[0, index]``."""
    q, _, _, si = _run("identity", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                       current_first, "tanh", False, False)
    return q, si


@quantize.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first):
    return x.new_empty(x.shape, dtype=_fp8_dtype(fmt)), _scale_inv_like(x)


@_register("quantize_t", _MUTATED)
def quantize_t(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
               fmt: str, margin_factor: float, current_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    """As :func:`quantize`, plus the contiguous quantized transpose (shape[-1], prod(shape[:-1]))
    before the scale_inv."""
    q, q_t, _, si = _run("identity", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                         current_first, "tanh", True, False)
    return q, q_t, si


@quantize_t.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first):
    dt = _fp8_dtype(fmt)
    return x.new_empty(x.shape, dtype=dt), x.new_empty((x.shape[-1], _rows(x)), dtype=dt), _scale_inv_like(x)


# ---- gelu + quantize (forward activation) ----------------------------------------------------
@_register("gelu_quantize", _MUTATED)
def gelu_quantize(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
                  fmt: str, margin_factor: float, current_first: bool, approximate: str) -> tuple[Tensor, Tensor]:
    """``fp8(gelu(x) * scale[index])`` and its scale_inv; the amax is of gelu(x).
    ``approximate``: 'tanh' or 'none'."""
    q, _, _, si = _run("gelu", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                       current_first, approximate, False, False)
    return q, si


@gelu_quantize.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, approximate):
    return x.new_empty(x.shape, dtype=_fp8_dtype(fmt)), _scale_inv_like(x)


@_register("gelu_quantize_t", _MUTATED)
def gelu_quantize_t(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
                    fmt: str, margin_factor: float, current_first: bool,
                    approximate: str) -> tuple[Tensor, Tensor, Tensor]:
    """As :func:`gelu_quantize`, plus the quantized transpose of gelu(x) before the scale_inv."""
    q, q_t, _, si = _run("gelu", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                         current_first, approximate, True, False)
    return q, q_t, si


@gelu_quantize_t.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, approximate):
    dt = _fp8_dtype(fmt)
    return x.new_empty(x.shape, dtype=dt), x.new_empty((x.shape[-1], _rows(x)), dtype=dt), _scale_inv_like(x)


# ---- dgelu + quantize (+ dbias) (backward of the activation) ---------------------------------
@_register("dgelu_quantize_t", _MUTATED)
def dgelu_quantize_t(dy: Tensor, x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor,
                     updates: Tensor, index: int, fmt: str, margin_factor: float, current_first: bool,
                     approximate: str, dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dx = dy * gelu'(x)`` quantized, its transpose, the (N,) float32 column sums of the
    unquantized dx when ``dbias`` (an empty (0,) float32 tensor otherwise) and the scale_inv.
    dy, x: same shape and dtype; the amax is of dx."""
    q, q_t, db, si = _run("dgelu", dy, x, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                          current_first, approximate, True, dbias)
    return q, q_t, db if dbias else dy.new_empty((0,), dtype=torch.float32), si


@dgelu_quantize_t.register_fake
def _(dy, x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, approximate, dbias):
    dt = _fp8_dtype(fmt)
    return (dy.new_empty(dy.shape, dtype=dt), dy.new_empty((dy.shape[-1], _rows(dy)), dtype=dt),
            dy.new_empty((dy.shape[-1] if dbias else 0,), dtype=torch.float32), _scale_inv_like(dy))


# ---- dequantize ------------------------------------------------------------------------------
@_register("dequantize", ())
def dequantize(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """``dtype(float32(q) * scale_inv)``; q a float8 tensor, scale_inv a 1-element float32 tensor."""
    return _ops.dequantize(q, scale_inv, str(dtype).replace("torch.", ""))


@dequantize.register_fake
def _(q, scale_inv, dtype):
    return q.new_empty(q.shape, dtype=dtype)
