"""Block scaling, framework-agnostic: :func:`block_quantize`, the activation's and its
gradient's fused twins :func:`block_gelu_quantize` and :func:`block_dgelu_quantize`, and
LayerNorm fused with the quantization, :func:`block_layernorm_quantize`.

As :mod:`fusedfp8.ops`: the argument contract first (everything checked before anything is
allocated or launched), then the host run (the NumPy definition,
:func:`fusedfp8.numerics.block.block_quantize`, on numpy arrays and CPU tensors) or the device
run (the block_quantize kernel through the launch interface, :func:`fusedfp8.launch.block_quantize`,
on the caller's current stream; jax GPU arrays through DLPack), with the same bytes. Results come
back in the caller's framework: FP8 data as ``torch.float8_*`` tensors, ``jnp.float8_*`` arrays,
ml_dtypes arrays (numpy) or uint8 arrays (cupy).

Block scaling keeps no state: nothing is written in place, and a call is a pure function of its
arguments.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import _interop as io
from . import launch
from .formats import Format
from .numerics import block as _block
from .recipe import BlockScaling
from .types import (FLOAT_INPUTS, BlockQuantized, LayerNormQuantized, check_approximate, check_pad_to, check_recipe,
                    kernel_op)

__all__ = ["block_quantize", "block_gelu_quantize", "block_dgelu_quantize", "block_layernorm_quantize",
           "check_block_args", "check_block_input", "check_block_op", "block_shapes", "run_block", "BlockArgs",
           "BlockShapes", "BlockOp"]


def _check_flag(value, argname: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{argname} must be a bool; got {type(value).__name__} {value!r}")
    return bool(value)


class BlockArgs(NamedTuple):
    """What a block quantization of one tensor is, read from the recipe and the flags."""

    fmt: Format
    block: tuple  # (1, 128) or (128, 128)
    pow2: bool  # the scales rounded down to powers of two
    transpose: bool
    pad_to: int


def check_block_args(recipe, weight, grad, transpose, pad_to) -> BlockArgs:
    """The arguments of a block quantization but the input (shared by :func:`block_quantize` and
    :func:`fusedfp8.jax.block.block_quantize`), checked by name: a :class:`~fusedfp8.BlockScaling`,
    bool flags (at most one of ``weight`` and ``grad``), a positive ``pad_to``."""
    check_recipe(recipe, block=True)
    if not isinstance(recipe, BlockScaling):
        raise TypeError(f"recipe must be a fusedfp8.BlockScaling (a scale per block of each tensor); got "
                        f"{type(recipe).__name__}, a per-tensor recipe: fusedfp8.quantize takes those, with a "
                        f"ScalingState slot")
    weight, grad = _check_flag(weight, "weight"), _check_flag(grad, "grad")
    transpose = _check_flag(transpose, "transpose")
    if weight and grad:
        raise ValueError("weight and grad: a weight is a forward tensor (its format is the recipe's forward one); "
                         "pass at most one of them as True")
    return BlockArgs(recipe.format_for(grad), recipe.block_for(weight), recipe.power_of_two_scales, transpose,
                     check_pad_to(pad_to))


def check_block_input(dtype: str, shape, argname: str = "x") -> None:
    """x of a block quantization: a float32 / float16 / bfloat16 array of at least 1 dimension."""
    if dtype not in FLOAT_INPUTS:
        raise TypeError(f"{argname} must be float32, float16 or bfloat16; got {dtype}")
    if not len(shape):
        raise ValueError(f"{argname}: block scaling needs an input of at least 1 dimension (viewed as rows x cols); "
                         "got a scalar")


class BlockOp(NamedTuple):
    """What is quantized: ``op`` ('identity', 'gelu': y = gelu(x), 'dgelu': y = dy * gelu'(x)) with
    its ``approximate``, and whether the column sums of y come back (``dbias``)."""

    op: str = "identity"
    approximate: str = "tanh"
    dbias: bool = False

    @property
    def kernel(self) -> str:
        """The kernels' name of the op (:func:`fusedfp8.types.kernel_op`)."""
        return kernel_op(self.op, self.approximate)


def check_block_op(op: str, approximate, dbias, block: tuple) -> BlockOp:
    """The op of a block quantization checked against its block: an op and ``dbias`` take 1x128
    blocks (an activation, a gradient), ``dbias`` goes with a gradient (the identity or dgelu)."""
    if op not in _block.OPS:
        raise ValueError(f"op must be one of {_block.OPS}; got {op!r}")
    dbias = _check_flag(dbias, "dbias")
    approximate = check_approximate(approximate)
    if (dbias or op != "identity") and tuple(block) != (1, _block.BLOCK):
        what = "dbias: the column sums of a gradient" if dbias else f"op={op!r}: an activation or its gradient"
        raise ValueError(f"{what} go with 1x128 blocks; this tensor takes {block} (weight=True): pass weight=False")
    if dbias and op == "gelu":
        raise ValueError("dbias goes with a gradient (op 'identity' or 'dgelu'); got op='gelu'")
    return BlockOp(op, approximate, dbias)


class BlockShapes(NamedTuple):
    """The shapes of a block quantization's outputs for an input shape (the 2-D view (rows, cols),
    padded to (prows, pcols))."""

    rows: int
    cols: int
    prows: int
    pcols: int
    q: tuple  # x's shape, or (prows, pcols) when padded
    scale_inv: tuple
    q_t: tuple  # (pcols, prows)
    scale_inv_t: tuple


def block_shapes(shape, args) -> BlockShapes:
    """``args``: anything with the ``block`` and ``pad_to`` of a :class:`BlockArgs`."""
    rows, cols = math.prod(shape[:-1]), int(shape[-1])
    prows, pcols = launch.padded(rows, cols, args.pad_to)
    return BlockShapes(rows, cols, prows, pcols, tuple(shape) if args.pad_to == 1 else (prows, pcols),
                       _block.scale_shape(prows, pcols, args.block), (pcols, prows),
                       _block.scale_shape(pcols, prows, args.block))


def _describe_input(x, argname: str) -> io.ArrayInfo:
    info = io.describe(x, argname)
    check_block_input(info.dtype, info.shape, argname)
    if not info.contiguous:
        raise ValueError(f"{argname} must be contiguous (row-major); got a non-contiguous view of shape {info.shape}: "
                         "call .contiguous() / np.ascontiguousarray first")
    return info


class _BlockCall:
    """A checked block quantization: the input(s), the format and block the recipe gives the
    tensor, the op, the shapes of every output."""

    def __init__(self, x, recipe, weight, grad, transpose, pad_to, op: BlockOp, b=None):
        args = check_block_args(recipe, weight, grad, transpose, pad_to)
        self.fmt, self.block, self.pow2, self.transpose, self.pad_to = args
        self.op = check_block_op(op.op, op.approximate, op.dbias, args.block)
        self.xi = xi = _describe_input(x, "dy" if op.op == "dgelu" else "x")
        self.bi = None
        if op.op == "dgelu":
            self.bi = bi = _describe_input(b, "x")
            if bi.shape != xi.shape:
                raise ValueError(f"dy and x must have the same shape; got {xi.shape} and {bi.shape}")
            if bi.dtype != xi.dtype:
                raise TypeError(f"dy and x must have the same dtype; got {xi.dtype} and {bi.dtype}")
            if (bi.framework, bi.device) != (xi.framework, xi.device):
                raise ValueError(f"dy is on {xi.where()} ({xi.framework}) but x is on {bi.where()} ({bi.framework}); "
                                 "they must be on the same device")
        self.shapes = block_shapes(xi.shape, args)


def _host_run(c: _BlockCall) -> BlockQuantized:
    r = _block.block_quantize(io.to_numpy(c.xi), c.fmt, c.block, c.pow2, c.transpose, c.pad_to, c.op.op,
                              None if c.bi is None else io.to_numpy(c.bi), c.op.approximate, c.op.dbias)

    def out(a):
        return None if a is None else io.from_numpy(a, c.xi)

    return BlockQuantized(out(r.data), out(r.scale_inv), out(r.data_t), out(r.scale_inv_t),
                          out(np.array([r.amax], np.float32)), out(r.dbias))


def _device_run(c: _BlockCall) -> BlockQuantized:
    xv = io.device_view(c.xi)
    sh = c.shapes
    q = io.empty(c.xi, sh.q, c.fmt.dtype_name)
    s = io.empty(c.xi, sh.scale_inv, "float32")
    amax = io.empty(c.xi, (1,), "float32")  # (the plan zeroes it before the kernel max-accumulates)
    ptr = io.data_ptr
    buffers = {"x": xv.ptr, "q": ptr(q), "scale_inv": ptr(s), "amax": ptr(amax)}
    if c.bi is not None:
        buffers["b"] = io.device_view(c.bi).ptr
    q_t = s_t = dbias = None
    if c.transpose:
        q_t = io.empty(c.xi, sh.q_t, c.fmt.dtype_name)
        s_t = io.empty(c.xi, sh.scale_inv_t, "float32")
        buffers.update(q_t=ptr(q_t), scale_inv_t=ptr(s_t))
    work = ()
    if c.op.dbias:
        (pr, pc), nc = launch.block_dbias_workspace(sh.rows, sh.cols, c.pad_to)
        dbias = io.empty(c.xi, (sh.cols,), "float32")
        work = (io.empty(c.xi, (pr, pc), "float32"), io.empty(c.xi, (nc,), "int32"))  # (alive until launched)
        buffers.update(dbias=ptr(dbias), partial=ptr(work[0]), counters=ptr(work[1]))
    launch.block_quantize(xv.device, io.stream_ptr(c.xi), buffers, dtype=xv.dtype, fmt=c.fmt.name, block=c.block,
                          rows=sh.rows, cols=sh.cols, pow2=c.pow2, pad_to=c.pad_to, op=c.op.kernel)
    del work
    x = c.xi
    return BlockQuantized(io.fp8_out(q, c.fmt, x), io.out_for_caller(s, x),
                          io.fp8_out(q_t, c.fmt, x) if q_t is not None else None,
                          io.out_for_caller(s_t, x) if s_t is not None else None, io.out_for_caller(amax, x),
                          io.out_for_caller(dbias, x) if dbias is not None else None)


def run_block(x, recipe: BlockScaling, weight: bool, grad: bool, transpose: bool, pad_to: int, op: BlockOp,
              b=None) -> BlockQuantized:
    """The three functions below in one (the torch custom op calls it): checked whole, then the
    device or the host run."""
    c = _BlockCall(x, recipe, weight, grad, transpose, pad_to, op, b)
    return _device_run(c) if c.xi.is_gpu else _host_run(c)


def block_quantize(x, recipe: BlockScaling, *, weight: bool = False, grad: bool = False, transpose: bool = False,
                   dbias: bool = False, pad_to: int = 1) -> BlockQuantized:
    """Quantize ``x`` to FP8 with a scale per block, in one pass (:class:`~fusedfp8.BlockScaling`).

    ``x`` is viewed as 2-D, (rows, cols) = (prod(shape[:-1]), shape[-1]), and cut into the
    recipe's blocks: 1x128 (128 consecutive elements of a row) for activations and gradients,
    ``recipe.weight_block`` for a weight. Each block takes the scale of its own max (the rule and
    the scale layout: :mod:`fusedfp8.numerics.block`, docs/design.md "Block scaling"); on a GPU
    the block_quantize kernel writes the bytes and the scales, on the CPU the NumPy definition
    does, byte for byte the same.

    Parameters
    ----------
    x : array, float32 / float16 / bfloat16, at least 1-D, contiguous (numpy, torch, jax, cupy)
    recipe : fusedfp8.BlockScaling
        The blocks, the formats (``fp8_format``) and ``power_of_two_scales``.
    weight : bool
        ``x`` is a weight: ``recipe.weight_block`` blocks, the forward format.
    grad : bool
        ``x`` is a gradient: the recipe's gradient format (E5M2 under 'hybrid', else E4M3).
    transpose : bool
        Also quantize the transpose of the 2-D view (the weight-gradient GEMM's operand): for 1x128
        blocks with its own scales (along the other axis), for 128x128 the same bytes and scales
        transposed.
    dbias : bool
        Also return the view's (cols,) float32 column sums (a gradient's bias gradient), from the
        same read; 1x128 blocks only (not with ``weight=True``). Deterministic: fixed-order float32
        sums, equal to the float64 sums within rounding.
    pad_to : int
        1 (default): ``data`` has x's shape. Else ``data`` is the (rows, cols) view rounded up to
        multiples of ``pad_to`` (zeros in the pad, and the scales of the zero-padded input), as
        FP8 GEMMs need (16).

    Returns
    -------
    BlockQuantized
        ``data`` (FP8), ``scale_inv`` (float32, :func:`fusedfp8.numerics.block.scale_shape` of the
        (padded) 2-D view: the layout cuBLASLt's block-scaled GEMM reads), ``data_t`` /
        ``scale_inv_t`` (the transpose and its scales, or None), ``amax`` ((1,) float32: max |x|
        of the whole tensor, NaN-propagating), ``dbias`` ((cols,) float32, or None).

    Raises
    ------
    TypeError, ValueError
        On a recipe that is not a BlockScaling, a bad dtype, shape, flag or pad_to, or a
        non-contiguous input, naming the argument; nothing is allocated or launched.
    """
    return run_block(x, recipe, weight, grad, transpose, pad_to, BlockOp("identity", "tanh", dbias))


def block_gelu_quantize(x, recipe: BlockScaling, *, approximate: str = "tanh", transpose: bool = False,
                        pad_to: int = 1) -> BlockQuantized:
    """``y = gelu(x)`` (float32; ``approximate`` 'tanh' or 'none', the per-tensor kernels' gelu bit
    for bit) quantized with 1x128 blocks in the recipe's forward format, in one pass: the
    activation a block-scaled linear reads, never written in 16 or 32 bits. ``amax = max |y|``.
    Arguments, results and errors as :func:`block_quantize` (x is an activation: no ``weight``,
    ``grad`` or ``dbias``)."""
    return run_block(x, recipe, False, False, transpose, pad_to, BlockOp("gelu", approximate, False))


def block_dgelu_quantize(dy, x, recipe: BlockScaling, *, approximate: str = "tanh", transpose: bool = False,
                         dbias: bool = False, pad_to: int = 1) -> BlockQuantized:
    """The gelu backward: ``y = dy * gelu'(x)`` in float32 quantized with 1x128 blocks in the
    recipe's gradient format, in one pass, with ``dbias=True`` also y's column sums (the bias
    gradient of the linear before the gelu). ``dy`` and ``x``: same shape, dtype and device.
    Arguments, results and errors as :func:`block_quantize`."""
    return run_block(dy, recipe, False, True, transpose, pad_to, BlockOp("dgelu", approximate, dbias), x)


class _LayerNormCall:
    """A checked block_layernorm_quantize: x as a block quantization's input (an activation:
    1x128 blocks, the forward format), a nonempty last dimension, eps, weight and bias as
    :func:`fusedfp8.layernorm_quantize` takes them."""

    def __init__(self, x, weight, bias, eps, recipe, transpose, pad_to):
        from .checks import check_layernorm_args

        args = check_block_args(recipe, False, False, transpose, pad_to)
        self.fmt, self.block, self.pow2, self.transpose, self.pad_to = args
        self.xi = _describe_input(x, "x")
        self.shapes = block_shapes(self.xi.shape, args)
        if self.shapes.cols == 0:
            raise ValueError(f"x: LayerNorm normalises over the last dimension, which must not be empty; got shape "
                             f"{tuple(self.xi.shape)}")
        self.wi, self.bi, self.param, self.eps = check_layernorm_args(weight, bias, eps, self.xi, self.shapes.cols)


def _host_layernorm(c: _LayerNormCall) -> LayerNormQuantized:
    def arr(i):
        return None if i is None else io.to_numpy(i)

    r, mean, rstd = _block.block_layernorm_quantize(arr(c.xi), arr(c.wi), arr(c.bi), c.eps, c.fmt, c.pow2, c.transpose,
                                                    c.pad_to)

    def out(a):
        return None if a is None else io.from_numpy(a, c.xi)

    return LayerNormQuantized(BlockQuantized(out(r.data), out(r.scale_inv), out(r.data_t), out(r.scale_inv_t),
                                             out(np.array([r.amax], np.float32)), None), out(mean), out(rstd))


def _device_layernorm(c: _LayerNormCall) -> LayerNormQuantized:
    x, sh, ptr = c.xi, c.shapes, io.data_ptr
    xv = io.device_view(x)
    q, s = io.empty(x, sh.q, c.fmt.dtype_name), io.empty(x, sh.scale_inv, "float32")
    amax = io.empty(x, (1,), "float32")
    mean, rstd = io.empty(x, (sh.rows,), "float32"), io.empty(x, (sh.rows,), "float32")
    buffers = {"x": xv.ptr, "q": ptr(q), "scale_inv": ptr(s), "amax": ptr(amax), "mean": ptr(mean),
               "rstd": ptr(rstd)}
    for name, i in (("weight", c.wi), ("bias", c.bi)):
        if i is not None:
            buffers[name] = io.device_view(i).ptr
    q_t = s_t = None
    if c.transpose:
        q_t, s_t = io.empty(x, sh.q_t, c.fmt.dtype_name), io.empty(x, sh.scale_inv_t, "float32")
        buffers.update(q_t=ptr(q_t), scale_inv_t=ptr(s_t))
    launch.block_layernorm_quantize(xv.device, io.stream_ptr(x), buffers, dtype=xv.dtype, param=c.param,
                                    fmt=c.fmt.name, rows=sh.rows, cols=sh.cols, eps=c.eps, pow2=c.pow2,
                                    pad_to=c.pad_to)
    return LayerNormQuantized(BlockQuantized(io.fp8_out(q, c.fmt, x), io.out_for_caller(s, x),
                                             io.fp8_out(q_t, c.fmt, x) if q_t is not None else None,
                                             io.out_for_caller(s_t, x) if s_t is not None else None,
                                             io.out_for_caller(amax, x), None),
                              io.out_for_caller(mean, x), io.out_for_caller(rstd, x))


def block_layernorm_quantize(x, weight, bias, eps: float, recipe: BlockScaling, *, transpose: bool = False,
                             pad_to: int = 1) -> LayerNormQuantized:
    """LayerNorm over the last dimension of ``x``, quantized with 1x128 blocks in the recipe's
    forward format: y is :func:`fusedfp8.layernorm_quantize`'s (float32, the same op order and
    summation, bit for bit), and each block of y takes the scale of its own max, as
    :func:`block_quantize` scales an activation. On a GPU two launches (the rows' statistics, then
    y computed from them tile by tile, cast with its scales, and with ``transpose`` cast again along
    the other axis); y is never written in 16 or 32 bits.

    Parameters
    ----------
    x : array, float32 / float16 / bfloat16, at least 1-D (last dimension >= 1), contiguous
    weight, bias : (cols,) arrays of one float dtype on x's device, or None (1 and 0)
    eps : number >= 0, added to the variance (as float32)
    recipe, transpose, pad_to : as :func:`block_quantize` (x is an activation)

    Returns
    -------
    LayerNormQuantized
        ``quantized``: a :class:`BlockQuantized` of y (no dbias); ``mean`` / ``rstd``: (rows,)
        float32 for the backward, as :func:`fusedfp8.layernorm_quantize` returns them.

    Raises
    ------
    TypeError, ValueError
        As :func:`block_quantize`, and on a weight / bias of the wrong shape, dtype or device,
        weight and bias of different dtypes, or a bad eps; nothing is allocated or launched.
    """
    c = _LayerNormCall(x, weight, bias, eps, recipe, transpose, pad_to)
    return _device_layernorm(c) if c.xi.is_gpu else _host_layernorm(c)
