"""Block scaling for torch: the custom ops ``torch.ops.fusedfp8.block_quantize`` and
``block_layernorm_quantize`` (with their fake implementations, so that torch.compile and
FakeTensorMode see their shapes) and :func:`block_quantize`, :func:`block_gelu_quantize`,
:func:`block_dgelu_quantize` and :func:`block_layernorm_quantize`, which take a
:class:`fusedfp8.BlockScaling` as their :mod:`fusedfp8` namesakes do.

The op's arguments are the recipe's fields, the call's flags and its activation (a custom op takes
no recipe object); its implementation is :mod:`fusedfp8.block`'s (the kernel on CUDA tensors, the
NumPy definition on CPU ones). It returns six tensors: without ``transpose`` the transpose and its
scales come back empty, without ``dbias`` the column sums, and the functions hand out None for them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import block as _api
from ..recipe import BlockScaling
from ..types import BlockQuantized, LayerNormQuantized

__all__ = ["block_quantize", "block_gelu_quantize", "block_dgelu_quantize", "block_layernorm_quantize"]


def _recipe(fp8_format: str, weight_side: int, power_of_two_scales: bool) -> BlockScaling:
    return BlockScaling(weight_block=(weight_side, 128), fp8_format=fp8_format, power_of_two_scales=power_of_two_scales)


_OUTS = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("fusedfp8::block_quantize", mutates_args=())
def block_quantize_op(x: Tensor, fp8_format: str, weight_side: int, power_of_two_scales: bool, weight: bool,
                      grad: bool, transpose: bool, pad_to: int, op: str = "identity", b: Tensor | None = None,
                      approximate: str = "tanh", dbias: bool = False) -> _OUTS:
    """(q, scale_inv, q_t, scale_inv_t, amax, dbias) of the block quantization of ``op(x)``
    ('identity', 'gelu', or 'dgelu' with x = dy and ``b`` the forward input) under
    ``BlockScaling(weight_block=(weight_side, 128), fp8_format, power_of_two_scales)``; q_t and
    scale_inv_t empty without ``transpose``, dbias without ``dbias``."""
    recipe = _recipe(fp8_format, weight_side, power_of_two_scales)
    r = _api.run_block(x, recipe, weight, grad, transpose, pad_to, _api.BlockOp(op, approximate, dbias), b)
    def none():  # (a fresh one each: the outputs of a custom op must not alias)
        return r.scale_inv.new_empty((0,))

    return (r.data, r.scale_inv, r.data_t if transpose else r.data.new_empty((0,)),
            r.scale_inv_t if transpose else none(), r.amax, r.dbias if dbias else none())


@block_quantize_op.register_fake
def _(x, fp8_format, weight_side, power_of_two_scales, weight, grad, transpose, pad_to, op="identity", b=None,
      approximate="tanh", dbias=False):
    args = _api.check_block_args(_recipe(fp8_format, weight_side, power_of_two_scales), weight, grad, transpose,
                                 pad_to)
    _api.check_block_op(op, approximate, dbias, args.block)
    _api.check_block_input(str(x.dtype).removeprefix("torch."), x.shape)
    sh = _api.block_shapes(x.shape, args)
    fp8 = getattr(torch, args.fmt.dtype_name)
    f32 = torch.float32
    q, s = x.new_empty(sh.q, dtype=fp8), x.new_empty(sh.scale_inv, dtype=f32)
    if transpose:
        q_t, s_t = x.new_empty(sh.q_t, dtype=fp8), x.new_empty(sh.scale_inv_t, dtype=f32)
    else:
        q_t, s_t = x.new_empty((0,), dtype=fp8), x.new_empty((0,), dtype=f32)
    return q, s, q_t, s_t, x.new_empty((1,), dtype=f32), x.new_empty((sh.cols,) if dbias else (0,), dtype=f32)


@torch.library.custom_op("fusedfp8::block_layernorm_quantize", mutates_args=())
def block_layernorm_quantize_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, fp8_format: str,
                                power_of_two_scales: bool, transpose: bool,
                                pad_to: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, scale_inv, q_t, scale_inv_t, amax, mean, rstd) of LayerNorm(x) quantized with 1x128
    blocks in the forward format of ``BlockScaling(fp8_format, power_of_two_scales)``; q_t and
    scale_inv_t empty without ``transpose``."""
    recipe = _recipe(fp8_format, 128, power_of_two_scales)
    r = _api.block_layernorm_quantize(x, weight, bias, eps, recipe, transpose=transpose, pad_to=pad_to)
    q = r.quantized
    return (q.data, q.scale_inv, q.data_t if transpose else q.data.new_empty((0,)),
            q.scale_inv_t if transpose else q.scale_inv.new_empty((0,)), q.amax, r.mean, r.rstd)


@block_layernorm_quantize_op.register_fake
def _(x, weight, bias, eps, fp8_format, power_of_two_scales, transpose, pad_to):
    args = _api.check_block_args(_recipe(fp8_format, 128, power_of_two_scales), False, False, transpose, pad_to)
    _api.check_block_input(str(x.dtype).removeprefix("torch."), x.shape)
    sh = _api.block_shapes(x.shape, args)
    fp8, f32 = getattr(torch, args.fmt.dtype_name), torch.float32
    q_t = x.new_empty(sh.q_t if transpose else (0,), dtype=fp8)
    s_t = x.new_empty(sh.scale_inv_t if transpose else (0,), dtype=f32)
    return (x.new_empty(sh.q, dtype=fp8), x.new_empty(sh.scale_inv, dtype=f32), q_t, s_t,
            x.new_empty((1,), dtype=f32), x.new_empty((sh.rows,), dtype=f32), x.new_empty((sh.rows,), dtype=f32))


def _check_tensor(x, argname: str, public: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor; got {type(x).__module__}.{type(x).__name__} "
                        f"(fusedfp8.{public} takes the arrays of every framework)")


def _result(outs, transpose: bool, dbias: bool) -> BlockQuantized:
    q, s, q_t, s_t, amax, db = outs
    return BlockQuantized(q, s, q_t if transpose else None, s_t if transpose else None, amax, db if dbias else None)


def block_quantize(x: Tensor, recipe: BlockScaling, *, weight: bool = False, grad: bool = False,
                   transpose: bool = False, dbias: bool = False, pad_to: int = 1) -> BlockQuantized:
    """:func:`fusedfp8.block_quantize` through the custom op (seen as one op by torch.compile):
    the same arguments, checks, results and bytes; no derivative."""
    args = _api.check_block_args(recipe, weight, grad, transpose, pad_to)
    _api.check_block_op("identity", "tanh", dbias, args.block)
    _check_tensor(x, "x", "block_quantize")
    return _result(block_quantize_op(x, recipe.fp8_format, recipe.weight_block[0], recipe.power_of_two_scales,
                                     weight, grad, transpose, pad_to, dbias=dbias), transpose, dbias)


def block_gelu_quantize(x: Tensor, recipe: BlockScaling, *, approximate: str = "tanh", transpose: bool = False,
                        pad_to: int = 1) -> BlockQuantized:
    """:func:`fusedfp8.block_gelu_quantize` through the custom op; no derivative."""
    args = _api.check_block_args(recipe, False, False, transpose, pad_to)
    _api.check_block_op("gelu", approximate, False, args.block)
    _check_tensor(x, "x", "block_gelu_quantize")
    return _result(block_quantize_op(x, recipe.fp8_format, recipe.weight_block[0], recipe.power_of_two_scales,
                                     False, False, transpose, pad_to, "gelu", None, approximate), transpose, False)


def block_dgelu_quantize(dy: Tensor, x: Tensor, recipe: BlockScaling, *, approximate: str = "tanh",
                         transpose: bool = False, dbias: bool = False, pad_to: int = 1) -> BlockQuantized:
    """:func:`fusedfp8.block_dgelu_quantize` through the custom op; no derivative."""
    args = _api.check_block_args(recipe, False, True, transpose, pad_to)
    _api.check_block_op("dgelu", approximate, dbias, args.block)
    _check_tensor(dy, "dy", "block_dgelu_quantize")
    _check_tensor(x, "x", "block_dgelu_quantize")
    return _result(block_quantize_op(dy, recipe.fp8_format, recipe.weight_block[0], recipe.power_of_two_scales,
                                     False, True, transpose, pad_to, "dgelu", x, approximate, dbias), transpose, dbias)


def block_layernorm_quantize(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, recipe: BlockScaling,
                             *, transpose: bool = False, pad_to: int = 1) -> LayerNormQuantized:
    """:func:`fusedfp8.block_layernorm_quantize` through the custom op; no derivative."""
    _api.check_block_args(recipe, False, False, transpose, pad_to)
    _check_tensor(x, "x", "block_layernorm_quantize")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            _check_tensor(p, name, "block_layernorm_quantize")
    q, s, q_t, s_t, amax, mean, rstd = block_layernorm_quantize_op(x, weight, bias, eps, recipe.fp8_format,
                                                                   recipe.power_of_two_scales, transpose, pad_to)
    return LayerNormQuantized(_result((q, s, q_t, s_t, amax, None), transpose, False), mean, rstd)
