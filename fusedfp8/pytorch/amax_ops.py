"""The custom ops that measure without casting: ``amax`` and ``layernorm_amax`` (the amax a
quantizing op would stage), and ``reduce_current_scales`` (current scaling across ranks: one
all-reduce of those amaxes, then the scales), with :func:`check_group` for the process group
they reduce over.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import launch
from .. import ops as _ops
from ..types import kernel_op
from .custom_ops import _register
from .op_plans import _pointers, _rows, _stream

__all__ = ["amax", "layernorm_amax", "reduce_current_scales", "check_group"]

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
