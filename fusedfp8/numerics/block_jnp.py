"""Block scaling (:mod:`fusedfp8.numerics.block`) in ``jax.numpy``: the CPU backend of
:func:`fusedfp8.jax.block.block_quantize` and the twin of ``cuda_src/block_quantize.cu`` on any
backend, byte for byte.

The rule and the layout are :mod:`.block`'s; the arithmetic is :mod:`.jnp`'s, written against
XLA's habits: each block's amax is taken on the bits (exact with denormals, which XLA:CPU reads
as zero; a NaN's bits sort above inf's, so a non-finite block is seen as such), the scale is the
update rule's formula with the correctly rounded division (:func:`.jnp.div_rn`; XLA's own ``/`` is not
IEEE on either backend), and ``x * scale`` is :func:`.jnp.mul` (rounded once, denormal operands
included).

Imports jax; load it only when needed.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..formats import Format, get_format
from ..types import BlockQuantized, check_pad_to
from . import jnp as jn
from .block import BLOCK, OPS, check_block, scale_shape
from .jnp_gelu import dgelu_f32, gelu_f32
from .jnp_layernorm import layernorm_f32

f32 = jnp.float32
_MAG = np.int32(0x7FFFFFFF)
_INF_BITS = np.int32(0x7F800000)
_POW2_MASK = np.int32(np.uint32(0xFF800000).view(np.int32))  # sign and exponent: clearing the rest rounds down


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad2(a, shape, value):
    """``a`` (2-D) padded at the end of each axis to ``shape`` with ``value``."""
    return jnp.pad(a, ((0, shape[0] - a.shape[0]), (0, shape[1] - a.shape[1])), constant_values=value)


def block_scale(amax_bits, fmt: Format, power_of_two: bool):
    """(scale, scale_inv) float32 of blocks whose max |x| has the bits ``amax_bits`` (int32, any
    shape; NaN above inf): the update rule's formula with margin 0 where the amax is finite and
    not 0, else 1; with ``power_of_two`` rounded down to a power of two; ``scale_inv = 1 / scale``
    (:func:`fusedfp8.numerics.block.block_scale`)."""
    a = jn.from_bits(jnp.minimum(amax_bits, _INF_BITS))  # a NaN block as an inf one: both take scale 1
    s = jn.current_scale(a, fmt, 1.0, jnp.ones((), f32))
    if power_of_two:
        s = jn.from_bits(jn.bits(s) & _POW2_MASK)
    return s, jn.div_rn(1.0, s)


def _layout(grid, block: tuple, shape: tuple):
    """The (nr, nc) scale_inv grid of a (rows, cols) operand in cuBLASLt's layout: 1x128 transposed,
    128x128 as it is; the pad entries 1.0 (:func:`fusedfp8.numerics.block._layout`)."""
    return _pad2(grid.T if block[0] == 1 else grid, shape, 1.0)


def _blocks(z, block: tuple):
    """(the blocks of the float32 2-D ``z`` padded with zeros to whole blocks, shape (nr, br, nc,
    bc), and the bits of each block's max |x|, shape (nr, nc))."""
    br, bc = block
    zz = _pad2(z, (_ceil_to(z.shape[0], br), _ceil_to(z.shape[1], bc)), 0.0)
    blocks = zz.reshape(zz.shape[0] // br, br, zz.shape[1] // bc, bc)
    return blocks, jnp.max(jn.bits(blocks) & _MAG, axis=(1, 3), initial=np.int32(0))


def _quantize_blocks(z, blocks, s, s_inv, fmt: Format, block: tuple):
    """(q codes, scale_inv in the layout) of ``z`` from its blocks (:func:`_blocks`) and their
    scales."""
    rows, cols = z.shape
    nr, br, nc, bc = blocks.shape
    q = jn.cast_to_fp8(jn.mul(blocks, s[:, None, :, None]), fmt).reshape(nr * br, nc * bc)
    return q[:rows, :cols], _layout(s_inv, block, scale_shape(rows, cols, block))


def _block_scales(grids, fmt: Format, power_of_two: bool):
    """:func:`block_scale` of several grids of amax bits in one call (one division graph for XLA to
    compile instead of one per grid): [(scale, scale_inv)]."""
    s, s_inv = block_scale(jnp.concatenate([g.ravel() for g in grids]), fmt, power_of_two)
    at = np.cumsum([g.size for g in grids])[:-1]
    return [(a.reshape(g.shape), b.reshape(g.shape)) for g, a, b in zip(grids, jnp.split(s, at), jnp.split(s_inv, at))]


def activation(op: str, x, b, approximate: str):
    """:func:`fusedfp8.numerics.reference.activation` in jax.numpy, bit for bit (float32 inputs)."""
    if op == "identity":
        return x
    if op == "gelu":
        return jn.computed_once(gelu_f32(x, approximate))  # (once, not in each of the amax, casts and sums)
    return jn.computed_once(jn._mul(x, dgelu_f32(b, approximate)))


@jn._traced_once("fmt", "block", "power_of_two", "transpose", "pad_to", "op", "approximate", "dbias")
def _block_quantize(x, b, fmt: str, block: tuple, power_of_two: bool, transpose: bool, pad_to: int, op: str,
                    approximate: str, dbias: bool):
    f = get_format(fmt)
    v = activation(op, jnp.asarray(x).astype(f32), None if b is None else jnp.asarray(b).astype(f32), approximate)
    rows, cols = (int(np.prod(v.shape[:-1])), int(v.shape[-1]))
    z = _pad2(v.reshape(rows, cols), (_ceil_to(rows, pad_to), _ceil_to(cols, pad_to)), 0.0)
    both = transpose and block[0] == 1  # the transposed copy has blocks of its own
    faces = [_blocks(z, block)] + ([_blocks(z.T, block)] if both else [])
    scales = _block_scales([grid for _, grid in faces], f, power_of_two)
    q, s_inv = _quantize_blocks(z, faces[0][0], *scales[0], f, block)
    q_t = s_inv_t = None
    if both:
        q_t, s_inv_t = _quantize_blocks(z.T, faces[1][0], *scales[1], f, block)
    elif transpose:
        q_t = q.T
        s_inv_t = _layout(scales[0][1].T, block, scale_shape(z.shape[1], z.shape[0], block))
    db = jnp.sum(v.reshape(rows, cols), axis=0, dtype=f32) if dbias else None
    return BlockQuantized(q.reshape(v.shape) if pad_to == 1 else q, s_inv, q_t, s_inv_t, jn.amax(v), db)


def block_quantize(x, fmt: str | Format = "e4m3", block=(1, BLOCK), power_of_two: bool = False,
                   transpose: bool = False, pad_to: int = 1, op: str = "identity", b=None,
                   approximate: str = "tanh", dbias: bool = False) -> BlockQuantized:
    """:func:`fusedfp8.numerics.block.block_quantize` in jax.numpy, traced or eager: the same
    arguments, the same bytes and scales (``dbias``: float32 sums in XLA's order, equal to the
    definition's within rounding). ``x`` (and ``b``): float32, float16 or bfloat16 arrays (widened
    exactly; under ``jax.jit`` the caller keeps a narrow input rounded, see
    :func:`fusedfp8.jax.primitives._as_f32`), at least 1-D. ``data`` and ``data_t`` come back as
    uint8 codes (bitcast them to the format's float8 dtype), ``amax`` as a float32 scalar."""
    fmt, block, pad = get_format(fmt), check_block(block), check_pad_to(pad_to)
    if jnp.ndim(x) == 0:
        raise ValueError("x: block scaling needs an input of at least 1 dimension; got a scalar")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}; got {op!r}")
    if (op != "identity" or dbias) and block != (1, BLOCK):
        raise ValueError(f"op={op!r} / dbias take 1x128 blocks (an activation or a gradient); got {block}")
    return _block_quantize(x, b if op == "dgelu" else None, fmt.name, block, bool(power_of_two), bool(transpose), pad,
                           op, approximate, bool(dbias))


@jn.shares_one_zero
def block_layernorm_quantize(x, weight, bias, eps, fmt: str | Format = "e4m3", power_of_two: bool = False,
                             transpose: bool = False, pad_to: int = 1):
    """:func:`fusedfp8.numerics.block.block_layernorm_quantize` in jax.numpy: (BlockQuantized of
    y as :func:`block_quantize` returns it, mean, rstd), the LayerNorm :mod:`.jnp_layernorm`'s."""
    fmt, pad = get_format(fmt), check_pad_to(pad_to)
    if jnp.ndim(x) == 0:
        raise ValueError("x: block scaling needs an input of at least 1 dimension; got a scalar")
    y, mean, rstd = layernorm_f32(x, weight, bias, eps)
    y = jn.computed_once(y)  # (once, not in each of the amax and the casts)
    return _block_quantize(y, None, fmt.name, (1, BLOCK), bool(power_of_two), bool(transpose), pad, "identity",
                           "tanh", False), mean, rstd


__all__ = ["block_quantize", "block_scale", "block_layernorm_quantize"]
