"""The fused kernels as ``torch.library`` custom ops, namespace ``fusedfp8``.

CUDA tensors run the kernels on torch's current stream, outputs allocated by torch, from the
launch plans of :mod:`fusedfp8.launch`, checked once per call signature
(:mod:`fusedfp8.pytorch.op_plans`). Where the compiled shim is available the CUDA (and
AutogradCUDA) kernels of these ops are C++ (:mod:`fusedfp8.pytorch.cpp_path`: which path runs,
and the switch); without it the Python implementations below launch the same plans. CPU tensors
run the bit-exact NumPy reference through :mod:`fusedfp8.ops`. Being custom ops with declared
mutations and fake (meta) implementations, they trace under ``torch.compile(fullgraph=True)``
without graph breaks and can be captured in a CUDA graph. The ops that measure without casting
(``amax``, ``layernorm_amax``, ``reduce_current_scales``) are in :mod:`fusedfp8.pytorch.amax_ops`.

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
True the quantization runs the first-step path: ONE cooperative launch that stages the amax and
waits at a grid-wide barrier only when the device flag says the tensor is on its first step, else
casts with the state's scale). Whole state tensors are passed, not 1-element views, so
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

import inspect

import torch
from torch import Tensor

from .. import launch
from .. import ops as _ops
from . import cpp_path
from .cpp_path import _CPP_OPS, _cpp_ops
from .op_plans import (_checked_plan, _fp8_dtype, _layernorm_cuda, _pointers, _q_shapes, _rows, _scale_inv_like, _slot,
                       _state_buffers, _stream)

__all__ = ["quantize", "quantize_t", "gelu_quantize", "gelu_quantize_t", "dgelu_quantize_t", "layernorm_quantize",
           "dequantize", "call"]

_MUTATED = ("amax_history", "scale", "scale_inv")
_IMPLS: dict = {}  # custom op -> its Python implementation
_WRITES: dict = {}  # custom op -> the positions of the tensors it mutates (its schema's (a!) arguments)
_PLAIN = (Tensor, torch.nn.Parameter)  # tensor types that nothing can be tracing
_CPP_INDEX: dict = {}  # custom op -> its index in _CPP_OPS


def _register(name: str, mutates_args):
    """``torch.library.custom_op`` that also remembers the undecorated function for :func:`call`."""
    def wrap(fn):
        op = torch.library.custom_op(f"fusedfp8::{name}", mutates_args=mutates_args)(fn)
        _IMPLS[op] = fn
        _WRITES[op] = tuple(i for i, p in enumerate(inspect.signature(fn).parameters) if p in mutates_args)
        if name in _CPP_OPS:
            _CPP_INDEX[op] = _CPP_OPS.index(name)
        return op

    return wrap


def call(op, *args):
    """Run the custom op ``op`` on ``args``.

    In plain eager mode the implementation is called directly (for CUDA tensors the C++ one once
    the shim is loaded: no Python beyond this function): a round trip through the dispatcher
    costs 20-70 us of host time per call with the Python kernels (more for ops with mutated
    arguments), several times the kernel launch itself. Whenever anything may be tracing (torch.compile,
    a TorchDispatchMode such as make_fx or FakeTensorMode, functorch transforms, tensor
    subclasses) the call goes through the dispatcher, so the op is seen as the custom op it is.
    The direct call bumps the version counters of the tensors the op mutates, as the dispatcher
    does, so that autograd sees the writes.
    """
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()
            or any(isinstance(a, Tensor) and type(a) not in _PLAIN for a in args)):
        return op(*args)
    cpp = cpp_path._cpp
    if cpp is not None and args[0].is_cuda and op in _CPP_INDEX:  # the C++ implementation, without the dispatcher
        return cpp.call(_CPP_INDEX[op], *args)  # (it bumps the versions of what it writes, as below)
    out = _IMPLS[op](*args)
    if _WRITES[op]:  # what the dispatcher's ADInplaceOrView kernel does for the mutated arguments, so that
        # autograd's saved-tensor check sees the writes (inference tensors have no version counter)
        torch.autograd.graph.increment_version([args[i] for i in _WRITES[op]])
    return out


def _run(op: str, x: Tensor, b: Tensor | None, state: tuple, index: int, fmt: str, margin_factor: float,
         current_first: bool, approximate: str, transpose: bool, dbias: bool, pad_to: int = 1):
    """(q, q_t or None, dbias or None, scale_inv) of one quantizing op."""
    amax_history, scale, scale_inv, updates = state
    if not x.is_cuda:
        slot = _slot(amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first)
        if op == "identity":
            r = _ops.quantize(x, slot, transpose=transpose, pad_to=pad_to)
        elif op == "gelu":
            r = _ops.gelu_quantize(x, slot, approximate=approximate, transpose=transpose, pad_to=pad_to)
        else:
            r = _ops.dgelu_quantize(x, b, slot, approximate=approximate, transpose=transpose, dbias=dbias,
                                    pad_to=pad_to)
        return r.data, r.data_t, r.dbias, r.scale_inv
    cpp = _cpp_ops()
    if cpp is not None:  # the first CUDA call of a process comes here (later ones go straight to C++)
        name = {"identity": "quantize", "gelu": "gelu_quantize", "dgelu": "dgelu_quantize"}[op] + (
            "_t" if transpose else "")
        extra = () if op == "identity" else (approximate,) if op == "gelu" else (approximate, dbias)
        outs = cpp.call(_CPP_OPS.index(name), x, *(() if b is None else (b,)), *state, index, fmt, margin_factor,
                        current_first, *extra, pad_to)
        q, si = outs[0], outs[-1]
        return q, outs[1] if transpose else None, outs[2] if dbias else None, si
    plan = _checked_plan(op, x, b, state, index, fmt, margin_factor, current_first, approximate, transpose, dbias,
                         pad_to)
    rows, cols = (_rows(x), int(x.shape[-1])) if x.dim() else (1, 1)
    dt = _fp8_dtype(fmt)
    q_shape, t_shape = _q_shapes(x, pad_to)
    q = torch.empty(q_shape, dtype=dt, device=x.device)
    q_t = torch.empty(t_shape, dtype=dt, device=x.device) if transpose else None
    si = torch.empty((1,), dtype=torch.float32, device=x.device)
    db = partial = counters = None
    if dbias:  # the plan zeroes the counters (and dbias when there is nothing to sum)
        part_shape, n_counters = launch.dbias_workspace(rows, cols, pad_to)
        db = torch.empty((cols,), dtype=torch.float32, device=x.device)
        partial = torch.empty(part_shape, dtype=torch.float32, device=x.device)
        counters = torch.empty((n_counters,), dtype=torch.int32, device=x.device)
    buffers = {"x": x, "b": b, "q": q, "q_t": q_t, "dbias": db, "partial": partial, "counters": counters,
               "scale_inv_used": si, **_state_buffers(state)}
    launch.run(plan, _pointers(buffers), _stream(x))
    return q, q_t, db, si


# ---- quantize --------------------------------------------------------------------------------
@_register("quantize", _MUTATED)
def quantize(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
             fmt: str, margin_factor: float, current_first: bool, pad_to: int = 1) -> tuple[Tensor, Tensor]:
    """``fp8(x * scale[index])`` (same shape as x; with ``pad_to`` > 1 x's 2-D view rounded up
    to multiples of it, zeros in the pad) and its scale_inv; amax of x into
    ``amax_history[0, index]``."""
    q, _, _, si = _run("identity", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                       current_first, "tanh", False, False, pad_to)
    return q, si


@quantize.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, pad_to=1):
    return x.new_empty(_q_shapes(x, pad_to)[0], dtype=_fp8_dtype(fmt)), _scale_inv_like(x)


@_register("quantize_t", _MUTATED)
def quantize_t(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
               fmt: str, margin_factor: float, current_first: bool, pad_to: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """As :func:`quantize`, plus the contiguous quantized transpose (shape[-1], prod(shape[:-1]))
    before the scale_inv (padded as q)."""
    q, q_t, _, si = _run("identity", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                         current_first, "tanh", True, False, pad_to)
    return q, q_t, si


@quantize_t.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, pad_to=1):
    dt, (qs, ts) = _fp8_dtype(fmt), _q_shapes(x, pad_to)
    return x.new_empty(qs, dtype=dt), x.new_empty(ts, dtype=dt), _scale_inv_like(x)


# ---- gelu + quantize (forward activation) ----------------------------------------------------
@_register("gelu_quantize", _MUTATED)
def gelu_quantize(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
                  fmt: str, margin_factor: float, current_first: bool, approximate: str,
                  pad_to: int = 1) -> tuple[Tensor, Tensor]:
    """``fp8(gelu(x) * scale[index])`` and its scale_inv; the amax is of gelu(x).
    ``approximate``: 'tanh' or 'none'."""
    q, _, _, si = _run("gelu", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                       current_first, approximate, False, False, pad_to)
    return q, si


@gelu_quantize.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, approximate, pad_to=1):
    return x.new_empty(_q_shapes(x, pad_to)[0], dtype=_fp8_dtype(fmt)), _scale_inv_like(x)


@_register("gelu_quantize_t", _MUTATED)
def gelu_quantize_t(x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int,
                    fmt: str, margin_factor: float, current_first: bool,
                    approximate: str, pad_to: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """As :func:`gelu_quantize`, plus the quantized transpose of gelu(x) before the scale_inv."""
    q, q_t, _, si = _run("gelu", x, None, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                         current_first, approximate, True, False, pad_to)
    return q, q_t, si


@gelu_quantize_t.register_fake
def _(x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, approximate, pad_to=1):
    dt, (qs, ts) = _fp8_dtype(fmt), _q_shapes(x, pad_to)
    return x.new_empty(qs, dtype=dt), x.new_empty(ts, dtype=dt), _scale_inv_like(x)


# ---- dgelu + quantize (+ dbias) (backward of the activation) ---------------------------------
@_register("dgelu_quantize_t", _MUTATED)
def dgelu_quantize_t(dy: Tensor, x: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor,
                     updates: Tensor, index: int, fmt: str, margin_factor: float, current_first: bool,
                     approximate: str, dbias: bool, pad_to: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dx = dy * gelu'(x)`` quantized, its transpose, the (N,) float32 column sums of the
    unquantized dx when ``dbias`` (an empty (0,) float32 tensor otherwise) and the scale_inv.
    dy, x: same shape and dtype; the amax is of dx."""
    q, q_t, db, si = _run("dgelu", dy, x, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                          current_first, approximate, True, dbias, pad_to)
    return q, q_t, db if dbias else dy.new_empty((0,), dtype=torch.float32), si


@dgelu_quantize_t.register_fake
def _(dy, x, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first, approximate, dbias,
      pad_to=1):
    dt, (qs, ts) = _fp8_dtype(fmt), _q_shapes(dy, pad_to)
    return (dy.new_empty(qs, dtype=dt), dy.new_empty(ts, dtype=dt),
            dy.new_empty((dy.shape[-1] if dbias else 0,), dtype=torch.float32), _scale_inv_like(dy))


# ---- LayerNorm + quantize (the MLP's input) ----------------------------------------------------
@_register("layernorm_quantize", _MUTATED)
def layernorm_quantize(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, amax_history: Tensor,
                       scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int, fmt: str, margin_factor: float,
                       current_first: bool, transpose: bool,
                       pad_to: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``fp8(layernorm(x) * scale[index])`` of x viewed as (rows, cols) (the LayerNorm output is
    never written in 16 or 32 bits), its transpose (an empty tensor without ``transpose``), the
    scale_inv it used, and the (rows,) float32 mean and rstd for the backward; see
    :func:`fusedfp8.layernorm_quantize`. ``pad_to`` as for :func:`quantize` (the kernel writes the
    pad; the statistics are not padded). CUDA tensors run the kernel through the Python launch
    path (no C++ kernel yet)."""
    state = (amax_history, scale, scale_inv, updates)
    if x.is_cuda:
        q, q_t, si, mean, rstd = _layernorm_cuda(x, weight, bias, eps, state, index, fmt, margin_factor,
                                                 current_first, transpose, pad_to)
    else:
        slot = _slot(*state, index, fmt, margin_factor, current_first)
        r = _ops.layernorm_quantize(x, weight, bias, eps, slot, transpose=transpose, pad_to=pad_to)
        q, q_t, si, mean, rstd = r.quantized.data, r.quantized.data_t, r.quantized.scale_inv, r.mean, r.rstd
    if q_t is None:
        q_t = x.new_empty((0,), dtype=q.dtype)
    return q, q_t, si, mean, rstd


@layernorm_quantize.register_fake
def _(x, weight, bias, eps, amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first,
      transpose, pad_to=1):
    dt, (qs, ts) = _fp8_dtype(fmt), _q_shapes(x, pad_to)
    rows = _rows(x)
    return (x.new_empty(qs if pad_to > 1 else x.shape, dtype=dt), x.new_empty(ts if transpose else (0,), dtype=dt),
            _scale_inv_like(x), x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32))


# ---- dequantize ------------------------------------------------------------------------------
@_register("dequantize", ())
def dequantize(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """``dtype(float32(q) * scale_inv)``; q a float8 tensor, scale_inv a 1-element float32 tensor."""
    if q.is_cuda:
        cpp = _cpp_ops()
        if cpp is not None:
            return cpp.call(_CPP_OPS.index("dequantize"), q, scale_inv, dtype)
    return _ops.dequantize(q, scale_inv, str(dtype).replace("torch.", ""))


@dequantize.register_fake
def _(q, scale_inv, dtype):
    return q.new_empty(q.shape, dtype=dtype)
