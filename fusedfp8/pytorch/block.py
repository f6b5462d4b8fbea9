"""Block scaling for torch: the custom op ``torch.ops.fusedfp8.block_quantize`` (with its fake
implementation, so that torch.compile and FakeTensorMode see its shapes) and :func:`block_quantize`,
which takes a :class:`fusedfp8.BlockScaling` as :func:`fusedfp8.block_quantize` does.

The op's arguments are the recipe's fields and the call's flags (a custom op takes no recipe
object); its implementation is :func:`fusedfp8.block.block_quantize` (the kernel on CUDA tensors,
the NumPy definition on CPU ones). It returns five tensors: without ``transpose`` the transpose
and its scales come back empty, and :func:`block_quantize` hands out None for them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import block as _api
from ..recipe import BlockScaling
from ..types import BlockQuantized

__all__ = ["block_quantize"]


def _recipe(fp8_format: str, weight_side: int, power_of_two_scales: bool) -> BlockScaling:
    return BlockScaling(weight_block=(weight_side, 128), fp8_format=fp8_format, power_of_two_scales=power_of_two_scales)


@torch.library.custom_op("fusedfp8::block_quantize", mutates_args=())
def block_quantize_op(x: Tensor, fp8_format: str, weight_side: int, power_of_two_scales: bool, weight: bool,
                      grad: bool, transpose: bool, pad_to: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, scale_inv, q_t, scale_inv_t, amax) of :func:`fusedfp8.block_quantize` under
    ``BlockScaling(weight_block=(weight_side, 128), fp8_format, power_of_two_scales)``; q_t and
    scale_inv_t empty without ``transpose``."""
    r = _api.block_quantize(x, _recipe(fp8_format, weight_side, power_of_two_scales), weight=weight, grad=grad,
                            transpose=transpose, pad_to=pad_to)
    if not transpose:
        return r.data, r.scale_inv, r.data.new_empty((0,)), r.scale_inv.new_empty((0,)), r.amax
    return r.data, r.scale_inv, r.data_t, r.scale_inv_t, r.amax


@block_quantize_op.register_fake
def _(x, fp8_format, weight_side, power_of_two_scales, weight, grad, transpose, pad_to):
    args = _api.check_block_args(_recipe(fp8_format, weight_side, power_of_two_scales), weight, grad, transpose,
                                 pad_to)
    _api.check_block_input(str(x.dtype).removeprefix("torch."), x.shape)
    sh = _api.block_shapes(x.shape, args)
    fp8 = getattr(torch, args.fmt.dtype_name)
    q, s = x.new_empty(sh.q, dtype=fp8), x.new_empty(sh.scale_inv, dtype=torch.float32)
    if transpose:
        q_t, s_t = x.new_empty(sh.q_t, dtype=fp8), x.new_empty(sh.scale_inv_t, dtype=torch.float32)
    else:
        q_t, s_t = x.new_empty((0,), dtype=fp8), x.new_empty((0,), dtype=torch.float32)
    return q, s, q_t, s_t, x.new_empty((1,), dtype=torch.float32)


def block_quantize(x: Tensor, recipe: BlockScaling, *, weight: bool = False, grad: bool = False,
                   transpose: bool = False, pad_to: int = 1) -> BlockQuantized:
    """:func:`fusedfp8.block_quantize` through the custom op (seen as one op by torch.compile):
    the same arguments, checks, results and bytes; no derivative."""
    _api.check_block_args(recipe, weight, grad, transpose, pad_to)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__module__}.{type(x).__name__} "
                        "(fusedfp8.block_quantize takes the arrays of every framework)")
    q, s, q_t, s_t, amax = block_quantize_op(x, recipe.fp8_format, recipe.weight_block[0],
                                             recipe.power_of_two_scales, weight, grad, transpose, pad_to)
    return BlockQuantized(q, s, q_t if transpose else None, s_t if transpose else None, amax)
