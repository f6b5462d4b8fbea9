"""From a call of a quantizing custom op to its checked launch plan on torch's current stream.

The full argument check of :mod:`fusedfp8.ops` runs once per call signature (shapes, dtypes,
device, 16-byte alignment, state shapes, index, format) and is cached with the plan
(:func:`_checked_plan`); :func:`_cpp_plan` is what the C++ ops call back on a new signature.
Also the shapes and buffers every implementation of the ops shares: the FP8 outputs' shapes
(padded or not), the state's slots of a plan, and the LayerNorm op's Python launch.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import launch
from ..checks import _LayerNormPlan, _Plan, check_dequantize
from ..formats import get_format
from ..state import Slot
from ..types import kernel_op

_checked: dict = {}  # call signature -> its launch plan (the full argument check has passed)
# (kernel op, transpose) of each quantizing op
_OP_OF = {"quantize": ("identity", False), "quantize_t": ("identity", True), "gelu_quantize": ("gelu", False),
          "gelu_quantize_t": ("gelu", True), "dgelu_quantize_t": ("dgelu", True)}


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
        _Plan(x, b, slot, None, None, op, transpose, dbias, argname="x" if b is None else "dy", pad_to=pad_to)
        if not (x.is_contiguous() and (b is None or b.is_contiguous())
                and all(t.is_contiguous() and t.device == x.device for t in state)):
            raise ValueError("fusedfp8 custom ops need contiguous inputs and state tensors on the input's device")
        rows, cols = (_rows(x), int(x.shape[-1])) if x.dim() else (1, 1)
        plan = _checked[key] = launch.plan_on(_stream(x), launch.quantize_plan, x.get_device(), str(x.dtype)[6:],
                                              fmt, kernel_op(op, approximate), rows, cols, transpose, dbias,
                                              bool(current_first), float(margin_factor), index * 4, int(pad_to))
    return plan


def _state_buffers(state: tuple) -> dict:
    """The slots of a quantizing plan that the state fills: the scale read (and written on a first
    step), the amax staged in row 0 of the history, the first-step flag; the plan adds the tensor's
    offset."""
    amax_history, scale, scale_inv, updates = state
    return {"scale": scale, "amax": amax_history, "scale_out": scale, "scale_inv_out": scale_inv, "updates": updates}


def _pointers(buffers: dict) -> dict:
    """{slot name: tensor or None} as {slot name: device pointer} (0 for None)."""
    return {name: 0 if t is None else t.data_ptr() for name, t in buffers.items()}


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
        p = _LayerNormPlan(x, weight, bias, eps, slot, None, None, transpose, pad_to=pad_to)
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


def _cpp_plan(name: str, args: tuple):
    """The C++ ops' call back on a new signature (under the GIL): the full argument check, then
    (encoded plan, kernel names, dbias workspace rows, dbias counters, whether the FP8 outputs
    are E5M2)."""
    if name == "dequantize":
        q, scale_inv, dtype = args
        dtype = str(dtype).replace("torch.", "")
        qi, _, f = check_dequantize(q, scale_inv, dtype, None)
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
