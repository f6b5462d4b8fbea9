"""The fused kernels as ``torch.library`` custom ops, namespace ``fusedfp8``.

CUDA tensors run the kernels on torch's current stream, outputs allocated by torch, from the
launch plans of :mod:`fusedfp8.launch`; the full argument check of :mod:`fusedfp8.ops` runs once
per call signature (shapes, dtypes, device, 16-byte alignment, state shapes, index, format) and
is cached with the plan. Where the compiled shim is available (:mod:`fusedfp8.csrc`; compiled on
the first CUDA call when it was not built at install time) the CUDA (and AutogradCUDA) kernels
of these ops are C++: eager calls, torch.compile graphs and CUDA graphs then run no Python per
call, and only a new signature calls back into Python (:func:`_cpp_plan`). Without it the
Python implementations below launch the same plans. CPU tensors run the bit-exact NumPy
reference through :mod:`fusedfp8.ops`. Being custom ops with declared mutations and fake (meta)
implementations, they trace under ``torch.compile(fullgraph=True)`` without graph breaks and can
be captured in a CUDA graph. :func:`launch_path` says which path runs; :func:`use_cpp` switches.

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
import math
import threading

import torch
from torch import Tensor

from .. import csrc as _shim
from .. import launch
from .. import ops as _ops
from ..formats import get_format
from ..state import Slot
from ..types import kernel_op

__all__ = ["quantize", "quantize_t", "gelu_quantize", "gelu_quantize_t", "dgelu_quantize_t", "layernorm_quantize",
           "dequantize", "amax", "layernorm_amax", "reduce_current_scales", "call", "launch_path", "use_cpp"]

_MUTATED = ("amax_history", "scale", "scale_inv")
_IMPLS: dict = {}  # custom op -> its Python implementation
_WRITES: dict = {}  # custom op -> the positions of the tensors it mutates (its schema's (a!) arguments)
_PLAIN = (Tensor, torch.nn.Parameter)  # tensor types that nothing can be tracing
_checked: dict = {}  # call signature -> its launch plan (the full argument check has passed)
# the ops in the order of torch_ops.cc's Op enum; (kernel op, transpose) of each quantizing one
_CPP_OPS = ("quantize", "quantize_t", "gelu_quantize", "gelu_quantize_t", "dgelu_quantize_t", "dequantize")
_OP_OF = {"quantize": ("identity", False), "quantize_t": ("identity", True), "gelu_quantize": ("gelu", False),
          "gelu_quantize_t": ("gelu", True), "dgelu_quantize_t": ("dgelu", True)}
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
    if _cpp is not None and args[0].is_cuda and op in _CPP_INDEX:  # the C++ implementation, without the dispatcher
        return _cpp.call(_CPP_INDEX[op], *args)  # (it bumps the versions of what it writes, as below)
    out = _IMPLS[op](*args)
    if _WRITES[op]:  # what the dispatcher's ADInplaceOrView kernel does for the mutated arguments, so that
        # autograd's saved-tensor check sees the writes (inference tensors have no version counter)
        torch.autograd.graph.increment_version([args[i] for i in _WRITES[op]])
    return out


# ---- the C++ implementation (fusedfp8/csrc/torch_ops.cc) --------------------------------------
_cpp = None  # the registered extension module, else None
_cpp_state: list = []  # [(on, why)] once decided: loading happens on the first CUDA call
_cpp_lock = threading.Lock()


def _cpp_ops():
    """The C++ ops module, loaded (compiled on first use) and registered for the CUDA keys; None
    where the shim cannot be had or was switched off."""
    if not _cpp_state:
        with _cpp_lock:
            if not _cpp_state:
                on, why = _shim.default_on()
                lib, why = _shim.library("torch") if on else (None, why)
                if lib is not None:
                    use_cpp(True, _lib=lib)
                _cpp_state.append((lib is not None, why))
    return _cpp


def use_cpp(on: bool, _lib=None) -> None:
    """Switch the CUDA implementation of the ops between C++ (``on``; the default where the shim
    is available and opted into, see :func:`fusedfp8.csrc.default_on`) and the Python executor
    (``on=False``, e.g. to compare the two). Raises RuntimeError when the shim is wanted but
    cannot be had."""
    global _cpp
    if on:
        lib = _lib
        if lib is None:
            lib, why = _shim.library("torch")
            if lib is None:
                raise RuntimeError(f"fusedfp8: the torch launch shim is not available: {why}")
        lib.register(_cpp_plan, _cpp_grad_path)
        _cpp = lib
    else:
        if _cpp is not None:
            _cpp.unregister()
        _cpp = None
        _cpp_state[:] = [(False, "switched off with use_cpp(False)")]


def launch_path() -> tuple[str, str]:
    """('C++' | 'Python', why) of the ops' CUDA implementation (without building the shim: before
    the first CUDA call this reports what that call will do)."""
    if _cpp is not None:
        return "C++", _shim.library("torch")[1]
    if _cpp_state:
        return "Python", _cpp_state[0][1]
    on, why = _shim.default_on()
    if not on:
        return "Python", why
    ready, why = _shim.status("torch")
    return ("C++" if ready is not False else "Python"), (why if ready is not None else
                                                         f"from the first CUDA call on ({why})")


def _cpp_plan(name: str, args: tuple):
    """The C++ ops' call back on a new signature (under the GIL): the full argument check, then
    (encoded plan, kernel names, dbias workspace rows, dbias counters, whether the FP8 outputs
    are E5M2)."""
    if name == "dequantize":
        q, scale_inv, dtype = args
        dtype = str(dtype).replace("torch.", "")
        qi, _, f = _ops.check_dequantize(q, scale_inv, dtype, None)
        data, names = launch.plan_on(_stream(q), launch.dequantize_plan, qi.device, dtype, f.name, qi.size).encode()
        return data.tobytes(), names, 0, 0, False
    op, transpose = _OP_OF[name]
    x, b, rest = (args[0], args[1], args[2:]) if op == "dgelu" else (args[0], None, args[1:])
    amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first = rest[:8]
    approximate = rest[8] if op != "identity" else "tanh"
    dbias = bool(rest[9]) if op == "dgelu" else False
    n_plain = 8 + (op != "identity") + (op == "dgelu")
    pad_to = rest[n_plain] if len(rest) > n_plain else 1  # the direct call may leave the default out
    plan = _checked_plan(op, x, b, (amax_history, scale, scale_inv, updates), index, fmt, margin_factor,
                         current_first, approximate, transpose, dbias, pad_to)
    rows, cols = (_rows(x), int(x.shape[-1])) if x.dim() else (1, 1)
    (part_rows, _), n_counters = launch.dbias_workspace(rows, cols, pad_to)
    data, names = plan.encode()
    return data.tobytes(), names, part_rows, n_counters, get_format(fmt).name == "e5m2"


class _NoDerivative(torch.autograd.Function):
    """What the custom op's own autograd kernel does when a gradient is wanted: the op runs (grad
    mode is off inside, so the C++ kernel runs), and a backward through its outputs raises."""

    @staticmethod
    def forward(ctx, name, *args):
        ctx.name = name
        return getattr(torch.ops.fusedfp8, name).default(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"Trying to backward through fusedfp8::{ctx.name} but no autograd formula was "
                           "registered (use fusedfp8.pytorch's autograd functions)")


def _cpp_grad_path(name: str, args: tuple):
    return _NoDerivative.apply(name, *args)


def _slot(amax_history: Tensor, scale: Tensor, scale_inv: Tensor, updates: Tensor, index: int, fmt: str,
          margin_factor: float, current_first: bool) -> Slot:
    """The Slot of column ``index``."""
    i = slice(index, index + 1)
    return Slot(scale[i], scale_inv[i], amax_history[0, i], updates[i], get_format(fmt), float(margin_factor),
                bool(current_first))


def _fp8_dtype(fmt: str) -> torch.dtype:
    return getattr(torch, get_format(fmt).dtype_name)


def _stream(x: Tensor) -> int:
    """torch's current stream on x's device (the stream every launch of the ops runs on)."""
    return torch._C._cuda_getCurrentRawStream(x.get_device())


def _rows(x: Tensor):
    return math.prod(x.shape[:-1])


def _scale_inv_like(x: Tensor) -> Tensor:
    return x.new_empty((1,), dtype=torch.float32)


def _q_shapes(x: Tensor, pad_to: int) -> tuple[tuple, tuple]:
    """Shapes of (q, q_t): x's shape and its 2-D view transposed, or both rounded up to multiples
    of ``pad_to`` (q then 2-D)."""
    rows, cols = (_rows(x), int(x.shape[-1])) if x.dim() else (1, 1)
    if pad_to == 1:
        return tuple(x.shape), (cols, rows)
    prows, pcols = launch.padded(rows, cols, pad_to)
    return (prows, pcols), (pcols, prows)


def _checked_plan(op: str, x: Tensor, b: Tensor | None, state: tuple, index: int, fmt: str, margin_factor: float,
                  current_first: bool, approximate: str, transpose: bool, dbias: bool, pad_to: int = 1) -> launch.Plan:
    """The launch plan of a CUDA call, after the full check of fusedfp8.ops once per signature
    (the check writes nothing)."""
    amax_history, scale, scale_inv, updates = state
    key = (op, x.shape, x.dtype, x.device, x.data_ptr() % 16, b is not None and b.data_ptr() % 16,
           amax_history.shape, amax_history.dtype, scale.dtype, scale_inv.dtype, updates.dtype,
           amax_history.data_ptr() % 4, index, fmt, approximate, transpose, dbias, bool(current_first),
           float(margin_factor), pad_to)
    plan = _checked.get(key)
    if plan is None:
        slot = _slot(amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first)
        _ops._Plan(x, b, slot, None, None, op, transpose, dbias, argname="x" if b is None else "dy", pad_to=pad_to)
        if not (x.is_contiguous() and (b is None or b.is_contiguous())
                and all(t.is_contiguous() and t.device == x.device for t in state)):
            raise ValueError("fusedfp8 custom ops need contiguous inputs and state tensors on the input's device")
        rows, cols = (_rows(x), int(x.shape[-1])) if x.dim() else (1, 1)
        plan = _checked[key] = launch.plan_on(_stream(x), launch.quantize_plan, x.get_device(), str(x.dtype)[6:],
                                              fmt, kernel_op(op, approximate), rows, cols, transpose, dbias,
                                              bool(current_first), float(margin_factor), index * 4, int(pad_to))
    return plan


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


def _state_buffers(state: tuple) -> dict:
    """The slots of a quantizing plan that the state fills: the scale read (and written on a first
    step), the amax staged in row 0 of the history, the first-step flag; the plan adds the tensor's
    offset."""
    amax_history, scale, scale_inv, updates = state
    return {"scale": scale, "amax": amax_history, "scale_out": scale, "scale_inv_out": scale_inv, "updates": updates}


def _pointers(buffers: dict) -> dict:
    """{slot name: tensor or None} as {slot name: device pointer} (0 for None)."""
    return {name: 0 if t is None else t.data_ptr() for name, t in buffers.items()}


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


def _layernorm_cuda(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, state: tuple, index: int,
                    fmt: str, margin_factor: float, current_first: bool, transpose: bool, pad_to: int):
    """(q, q_t or None, scale_inv, mean, rstd) on CUDA: the full check of fusedfp8.ops once per
    signature (cached with the launch plan), then the plan on torch's current stream."""
    amax_history, scale, scale_inv, updates = state

    def sig(t):
        return None if t is None else (t.shape, t.dtype, t.device, t.data_ptr() % 16, t.is_contiguous())

    key = ("layernorm", sig(x), sig(weight), sig(bias), float(eps), amax_history.shape, amax_history.dtype,
           scale.dtype, scale_inv.dtype, updates.dtype, amax_history.data_ptr() % 4, index, fmt,
           float(margin_factor), bool(current_first), transpose, pad_to)
    plan = _checked.get(key)
    rows, cols = _rows(x), int(x.shape[-1])
    if plan is None:
        slot = _slot(amax_history, scale, scale_inv, updates, index, fmt, margin_factor, current_first)
        p = _ops._LayerNormPlan(x, weight, bias, eps, slot, None, None, transpose, pad_to=pad_to)
        if not (x.is_contiguous() and all(t.is_contiguous() and t.device == x.device for t in state)):
            raise ValueError("fusedfp8 custom ops need contiguous inputs and state tensors on the input's device")
        plan = _checked[key] = launch.plan_on(_stream(x), launch.layernorm_plan, x.get_device(), str(x.dtype)[6:],
                                              p.param_dtype, fmt, rows, cols, transpose, bool(current_first),
                                              float(eps), float(margin_factor), index * 4, int(pad_to))
    dt = _fp8_dtype(fmt)
    q_shape, t_shape = _q_shapes(x, pad_to)
    q = torch.empty(q_shape, dtype=dt, device=x.device)
    q_t = torch.empty(t_shape, dtype=dt, device=x.device) if transpose else None
    mean = torch.empty((rows,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    si = torch.empty((1,), dtype=torch.float32, device=x.device)
    buffers = {"x": x, "weight": weight, "bias": bias, "q": q, "q_t": q_t, "mean": mean, "rstd": rstd,
               "scale_inv_used": si, **_state_buffers(state)}
    launch.run(plan, _pointers(buffers), _stream(x))
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


# ---- amax only, and the cross-rank current scales (CurrentScaling with an amax_group) ----------
def _amax_buffer(x: Tensor) -> Tensor:
    return x.new_zeros((2,), dtype=torch.float32)


def _check_amax_input(x: Tensor, b: Tensor | None, op: str) -> None:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float32, float16 or bfloat16; got {x.dtype}")
    if (b is not None) != (op == "dgelu"):
        raise ValueError(f"b is the dgelu's second input: given exactly for op 'dgelu'; got op {op!r} and "
                         f"b {'given' if b is not None else 'None'}")
    if b is not None and (b.shape != x.shape or b.dtype != x.dtype or b.device != x.device):
        raise ValueError(f"b must match x's shape, dtype and device; got {tuple(b.shape)} {b.dtype} {b.device} and "
                         f"{tuple(x.shape)} {x.dtype} {x.device}")
    if not (x.is_contiguous() and (b is None or b.is_contiguous())):
        raise ValueError("fusedfp8 custom ops need contiguous inputs")


@_register("amax", ())
def amax(x: Tensor, b: Tensor | None, op: str, approximate: str) -> Tensor:
    """``max |op(x, b)|`` without a cast: a (2,) float32 tensor, the amax in element 0 (element 1 is
    0). ``op``: 'identity', 'gelu' or 'dgelu' (then ``b`` is the gelu's input x and ``x`` the
    incoming gradient, as :func:`dgelu_quantize_t`). The same bits as the amax the quantizing op
    stages: on CUDA the quantize kernels' first-step pre-pass (:func:`fusedfp8.launch.amax_plan`,
    one memset and one launch), on the CPU the reference."""
    _check_amax_input(x, b, op)
    if not x.is_cuda:
        if op == "identity":
            r = _ops.quantize(x, 1.0)
        elif op == "gelu":
            r = _ops.gelu_quantize(x, 1.0, approximate=approximate)
        else:
            r = _ops.dgelu_quantize(x, b, 1.0, approximate=approximate)
        return torch.cat([r.amax.reshape(1), r.amax.new_zeros((1,))])
    out = _amax_buffer(x)
    stream = _stream(x)
    plan = launch.plan_on(stream, launch.amax_plan, x.get_device(), str(x.dtype)[6:], kernel_op(op, approximate),
                          x.numel())
    launch.run(plan, _pointers({"x": x, "b": b, "amax": out}), stream)
    return out


@amax.register_fake
def _(x, b, op, approximate):
    return _amax_buffer(x)


@_register("layernorm_amax", ())
def layernorm_amax(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """``max |LayerNorm(x) * weight + bias|`` without a cast, as :func:`amax` (a (2,) float32
    tensor, the amax in element 0): the amax :func:`layernorm_quantize` stages, from its
    kernel's first-step pre-pass on CUDA (:func:`fusedfp8.launch.layernorm_amax_plan`), from the
    reference on the CPU."""
    _check_amax_input(x, None, "identity")
    if not x.is_cuda:
        r = _ops.layernorm_quantize(x, weight, bias, eps, 1.0).quantized
        return torch.cat([r.amax.reshape(1), r.amax.new_zeros((1,))])
    params = [t for t in (weight, bias) if t is not None]
    if any(t.dtype != params[0].dtype or t.device != x.device or not t.is_contiguous()
           or tuple(t.shape) != (int(x.shape[-1]),) for t in params):
        raise ValueError(f"weight / bias must be contiguous ({x.shape[-1]},) tensors of one dtype on x's device")
    out = _amax_buffer(x)
    param = str(params[0].dtype)[6:] if params else "float32"
    stream = _stream(x)
    plan = launch.plan_on(stream, launch.layernorm_amax_plan, x.get_device(), str(x.dtype)[6:], param, _rows(x),
                          int(x.shape[-1]), float(eps))
    launch.run(plan, _pointers({"x": x, "weight": weight, "bias": bias, "amax": out}), stream)
    return out


@layernorm_amax.register_fake
def _(x, weight, bias, eps):
    return _amax_buffer(x)


def _nan_max(a: Tensor, b: Tensor) -> Tensor:
    """max of staged amaxes ``a`` and amaxes ``b`` (>= 0 or NaN / inf), NaN-propagating; -0 counts as 0."""
    return torch.where(torch.isnan(a) | torch.isnan(b), torch.full_like(a, float("nan")), torch.maximum(a.abs(), b))


@_register("reduce_current_scales", ("amax", "amax_history", "scale", "scale_inv"))
def reduce_current_scales(amax: Tensor, amax_history: Tensor, scale: Tensor, scale_inv: Tensor, index: int,
                          fmt_max: float, margin_factor: float, group_name: str) -> None:
    """Current scaling across ranks for the tensors ``index .. index + k - 1`` of a state.

    ``amax``: (k, 2) float32, row j = :func:`amax` of tensor ``index + j`` on this rank, reduced in
    place: NaN sent as +inf, then ONE ``all_reduce(MAX)`` over the process group named
    ``group_name`` (element 1 of every row is 0 on every rank and stays 0). Then, per tensor, as
    the current-scaled first step of a quantizing op stages and scales (the reference's
    ``_host_quantize``): ``a = nan_max(amax_history[0, i], global amax)`` is staged, and
    ``scale[i]`` / ``scale_inv[i]`` become :func:`fusedfp8.numerics.scaling.current_scale` of it
    (the old scale where ``a`` is 0 or non-finite) and its inverse. A quantizing op called with
    ``current_first=False`` then casts with that scale: every rank holds bitwise the same scale,
    staged amax (a local NaN aside, which makes the slot NaN where the other ranks hold +inf:
    both an overflow at the step's close) and FP8 bytes as one process quantizing the
    concatenated tensors."""
    import torch.distributed as dist

    from ..numerics.scaling import current_scale
    from ..numerics.xp import TorchNamespace

    k = amax.shape[0]
    amax.copy_(torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax))
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=dist.distributed_c10d._resolve_process_group(group_name))
    staged = amax_history[0, index:index + k]
    acc = _nan_max(staged, amax[:, 0])
    # tensors on both sides of every division: torch computes ``float / tensor`` as a reciprocal
    # times the float, which is not the correctly rounded quotient the kernels compute
    s = current_scale(TorchNamespace(), acc, torch.full_like(acc, fmt_max), torch.full_like(acc, margin_factor),
                      scale[index:index + k])
    staged.copy_(acc)
    scale[index:index + k] = s
    scale_inv[index:index + k] = torch.ones_like(s) / s


@reduce_current_scales.register_fake
def _(amax, amax_history, scale, scale_inv, index, fmt_max, margin_factor, group_name):
    return None


def check_group(group, argname: str) -> None:
    """Raise if ``group``, passed as the argument ``argname`` (``group`` of update_model_scales,
    ``amax_group`` of the modules and convert_to_fp8), cannot carry a reduction of amaxes across
    ranks (before anything is built or written). Here beside the collective it checks for, below
    the modules and scaling.py that both take it."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(f"{argname}: torch.distributed is not available in this build of torch, so amaxes cannot "
                           f"be reduced across ranks; pass {argname}=None")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{argname} must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD or "
                        f"one made by torch.distributed.new_group) or None; got {type(group).__name__}")
    if not dist.is_initialized():
        raise RuntimeError(f"{argname}: torch.distributed is not initialized; call "
                           f"torch.distributed.init_process_group first, or pass {argname}=None")
