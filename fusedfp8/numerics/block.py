"""Block scaling: the NumPy definition of the bytes and the scales (the oracle of
``cuda_src/block_quantize.cu``, which agrees byte for byte).

A tensor is viewed as 2-D, (rows, cols) = (prod(shape[:-1]), shape[-1]), and cut into blocks of
1x128 (128 consecutive elements of a row: activations and gradients) or 128x128 (weights); the
last block of a row or column is shorter where cols or rows is not a multiple of 128. Per block:

- ``amax`` = max |x| over the block's elements, float32 (exact), NaN-propagating;
- ``scale`` = ``fmt_max / amax``: one float32 division, round to nearest even, FLT_MAX where
  that is inf (a tiny amax) -- the update rule's formula (:func:`.scaling.compute_scale`) with
  margin 0. A block whose amax is 0 (all zeros, either sign), inf or NaN takes scale 1: a scale
  is never 0, inf or NaN. Its NaN elements still cast to the format's NaN byte and its infs
  saturate to +-max (as every quantization here), and the tensor's amax, returned beside the
  scales, carries the NaN or inf to the caller;
- with ``power_of_two``, the scale is then rounded DOWN to a power of two (its mantissa bits
  cleared; FLT_MAX gives 2**127), so ``x * scale`` and ``q * scale_inv`` are exact wherever no
  FP8 rounding happens, and ``amax * scale <= fmt_max`` but for the rounding of the division,
  which the saturating cast absorbs;
- ``q = fp8(float32(x) * scale)``: one float32 multiply, then the cast of every other
  quantization (:func:`.reference.cast_to_fp8`: round to nearest even, saturating, NaN kept);
- ``scale_inv = 1 / scale``: one float32 division (exact for a power of two; 2**-127 is a
  float32 subnormal, kept).

An activation (``op``, as the per-tensor kernels' and :func:`.reference.activation`): what is
quantized is ``y = gelu(x)`` or ``y = dy * gelu'(b)`` in float32 (the same functions, bit for
bit), taking x's place above: the blocks, amaxes and scales are y's; the pad is zeros of y. A
gradient's ``dbias`` is the column sums of y over the 2-D view (float32, accumulated in float64
here: the oracle the kernel's fixed-order float32 sums are held to within rounding).

The transposed copy (``transpose=True``) is the block quantization of ``x.T`` (the 2-D view's):
for 1x128 blocks its own scales, one per 128 consecutive elements of a column of x; for 128x128
blocks the same bytes transposed and the same scales transposed.

Scale layout (what cuBLASLt's block-scaled FP8 matmul reads on Hopper, CUDA 12.9+: scale modes
CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F and BLK128x128_32F; the layout Transformer Engine's
Float8BlockScaling hands it; ``torch._scaled_mm``'s blockwise recipes take views of it, a 128x128
one of several block rows only where ceil(cols / 128) is a multiple of 4: fusedfp8.pytorch.gemm
pads K there), for an operand
stored row-major as (rows, cols) whose cols are the GEMM's K (every operand of our GEMMs: q for
the forward, q_t for the weight gradient), float32, C-contiguous:

- 1x128: shape ``(ceil(cols / 128), pad4(rows))``, element ``[k, r]`` = the block ``x[r, 128k:128k+128]``:
  the rows ("M-major", the outer dimension contiguous), one row of the array per K block;
- 128x128: shape ``(ceil(rows / 128), pad4(ceil(cols / 128)))``, element ``[i, k]`` = the tile
  ``x[128i:128i+128, 128k:128k+128]``: K blocks contiguous;

``pad4(n)`` rounds up to a multiple of 4 (each row of the array starts 16-byte aligned); the pad
entries hold 1.0, the scale_inv of an all-zero block (the array is that of the input padded with
zeros to its extent). torch's ``_scaled_mm`` views the same memory transposed: ``scale_inv.T``,
shape (rows, ceil(cols / 128)) with strides (1, pad4(rows)), for a 1x128 operand.

Padding (``pad_to``, the FP8 GEMMs' multiple of 16): the data is (prows, pcols) with zeros outside
the rows x cols corner, and everything, scales included, is that of the input padded with zeros.
"""
from __future__ import annotations

import numpy as np

from ..formats import Format, get_format
from ..types import BlockQuantized, check_pad_to
from . import scaling
from .layernorm import layernorm_f32
from .reference import activation, as_2d, cast_to_fp8, column_sums, float32_to
from .reference import amax as tensor_amax
from .xp import NumpyNamespace

BLOCK = 128  # the side of a block
BLOCKS = ((1, BLOCK), (BLOCK, BLOCK))  # 1x128 (activations, gradients), 128x128 (weights)
SCALE_ALIGN = 4  # the contiguous axis of a scale array is padded to this many floats (16 bytes)
POW2_MASK = np.uint32(0xFF800000)  # sign and exponent of a float32: clearing the rest rounds down

f32 = np.float32
_NP = NumpyNamespace()


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def check_block(block, argname: str = "block") -> tuple:
    """``block`` as (1, 128) or (128, 128); ValueError naming ``argname`` otherwise."""
    try:
        b = tuple(int(d) for d in block) if not isinstance(block, (str, bytes)) else None
    except (TypeError, ValueError):
        b = None
    if b not in BLOCKS:
        raise ValueError(f"{argname} must be (1, 128) or (128, 128); got {block!r}")
    return b


def scale_shape(rows: int, cols: int, block) -> tuple[int, int]:
    """The shape of the scale array of a (rows, cols) operand (see the module's docstring):
    (ceil(cols / 128), pad4(rows)) for 1x128 blocks, (ceil(rows / 128), pad4(ceil(cols / 128)))
    for 128x128."""
    if check_block(block)[0] == 1:
        return -(-cols // BLOCK), _ceil_to(rows, SCALE_ALIGN)
    return -(-rows // BLOCK), _ceil_to(-(-cols // BLOCK), SCALE_ALIGN)


def block_scale(amax, fmt: str | Format, power_of_two: bool) -> tuple[np.ndarray, np.ndarray]:
    """(scale, scale_inv) float32 of blocks whose amaxes are ``amax`` (any shape): the update
    rule's formula with margin 0 where the amax is finite and not 0, else 1; with
    ``power_of_two`` rounded down to a power of two; ``scale_inv = 1 / scale``."""
    a = np.asarray(amax, np.float32)
    one = f32(1.0)
    s = np.asarray(scaling.current_scale(_NP, a, f32(get_format(fmt).max), one, one), np.float32)
    if power_of_two:
        s = (s.view(np.uint32) & POW2_MASK).view(np.float32)
    with np.errstate(divide="ignore"):
        return s, np.asarray(one / s, np.float32)


def _blocks(z: np.ndarray, block: tuple) -> np.ndarray:
    """The (nr, nc) grid of max |z| over blocks of z, whose shape is a multiple of ``block``."""
    br, bc = block
    nr, nc = z.shape[0] // br, z.shape[1] // bc
    return np.max(np.abs(z).reshape(nr, br, nc, bc), axis=(1, 3), initial=f32(0.0))


def _layout(grid: np.ndarray, block: tuple, shape: tuple) -> np.ndarray:
    """The (nr, nc) grid of a (rows, cols) operand's scale_inv in cuBLASLt's layout: 1x128 transposed
    (row r of the operand along the contiguous axis), 128x128 as it is; the pad entries 1.0."""
    out = np.ones(shape, np.float32)
    g = grid.T if block[0] == 1 else grid
    out[:g.shape[0], :g.shape[1]] = g
    return out


def _quantize_2d(z: np.ndarray, fmt: Format, block: tuple, power_of_two: bool):
    """(q, scale_inv in the layout, the scale_inv grid) of the float32 2-D ``z`` (already padded
    with zeros to its quantized shape)."""
    rows, cols = z.shape
    br, bc = block
    zz = np.zeros((_ceil_to(rows, br), _ceil_to(cols, bc)), np.float32)
    zz[:rows, :cols] = z
    s, s_inv = block_scale(_blocks(zz, block), fmt, power_of_two)
    per_elem = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:rows, :cols]
    with np.errstate(over="ignore", invalid="ignore"):
        q = cast_to_fp8(z * per_elem, fmt)
    return q, _layout(s_inv, block, scale_shape(rows, cols, block)), s_inv


OPS = ("identity", "gelu", "dgelu")


def block_quantize(x, fmt: str | Format = "e4m3", block=(1, BLOCK), power_of_two: bool = False,
                   transpose: bool = False, pad_to: int = 1, op: str = "identity", b=None,
                   approximate: str = "tanh", dbias: bool = False) -> BlockQuantized:
    """Block-scaled quantization of ``y = op(x)`` (x float32, float16 or bfloat16, at least 1-D,
    viewed as 2-D): the bytes, the per-block ``scale_inv`` in cuBLASLt's layout, optionally the
    transposed copy with its own scales, the tensor's amax, and optionally ``dbias``. See the
    module's docstring for the rule.

    ``pad_to``: the FP8 data is (prows, pcols), rows and cols rounded up to a multiple of it, zeros
    outside the input (and its scales those of the zero-padded input); with 1 the data has ``x``'s
    shape. ``op``: 'identity', 'gelu' (y = gelu(x)) or 'dgelu' (y = x * gelu'(b): x is dy, ``b``
    the forward input, of x's shape), with ``approximate`` 'tanh' or 'none'; an op takes 1x128
    blocks. ``dbias`` (the identity and 'dgelu'): the column sums of y.
    """
    fmt, block, pad = get_format(fmt), check_block(block), check_pad_to(pad_to)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}; got {op!r}")
    if op != "identity" and block != (1, BLOCK):
        raise ValueError(f"op={op!r} takes 1x128 blocks (an activation or a gradient); got {block}")
    if dbias and op == "gelu":
        raise ValueError("dbias goes with a gradient (op 'identity' or 'dgelu'); got op='gelu'")
    if op == "dgelu" and np.shape(b) != np.shape(x):
        raise ValueError(f"b must have dy's shape {np.shape(x)}; got {np.shape(b)}")
    v = activation(op, x, b, approximate)
    v2 = as_2d(v, need="block scaling")
    rows, cols = v2.shape
    z = np.zeros((_ceil_to(rows, pad), _ceil_to(cols, pad)), np.float32)
    z[:rows, :cols] = v2
    q, s_inv, grid = _quantize_2d(z, fmt, block, power_of_two)
    q_t = s_inv_t = None
    if transpose and block[0] == 1:
        q_t, s_inv_t, _ = _quantize_2d(np.ascontiguousarray(z.T), fmt, block, power_of_two)
    elif transpose:
        q_t = np.ascontiguousarray(q.T)
        s_inv_t = _layout(grid.T, block, scale_shape(z.shape[1], z.shape[0], block))
    data = q.reshape(v.shape) if pad == 1 else q
    return BlockQuantized(data, s_inv, q_t, s_inv_t, tensor_amax(v), column_sums(v2, "y") if dbias else None)


def block_layernorm_quantize(x, weight, bias, eps, fmt: str | Format = "e4m3", power_of_two: bool = False,
                             transpose: bool = False, pad_to: int = 1):
    """(BlockQuantized of y, mean, rstd): ``y = LayerNorm(x) * weight + bias`` in float32, bit for
    bit :func:`fusedfp8.numerics.layernorm.layernorm_f32` (the per-tensor fused LayerNorm's y, its
    fixed summation order and its (rows,) mean and rstd), then block-quantized in 1x128 blocks as
    :func:`block_quantize` quantizes an input: y's blocks, y's amaxes, the pad zeros of y (not
    LayerNorm of zeros). ``weight`` / ``bias``: (cols,) arrays or None (1 and -0). The operand of a
    GEMM whose K is the hidden dimension, and with ``transpose`` the one whose K is the tokens."""
    y, mean, rstd = layernorm_f32(x, weight, bias, eps)
    return block_quantize(y, fmt, (1, BLOCK), power_of_two, transpose, pad_to), mean, rstd


def expand_scales(scale_inv: np.ndarray, rows: int, cols: int, block) -> np.ndarray:
    """The (rows, cols) float32 array of each element's scale_inv, read from ``scale_inv`` in the
    layout of a (rows, cols) operand (the inverse of the layout: what a GEMM applies)."""
    block = check_block(block)
    s = np.asarray(scale_inv, np.float32)
    if s.shape != scale_shape(rows, cols, block):
        raise ValueError(f"scale_inv must have shape {scale_shape(rows, cols, block)} for a ({rows}, {cols}) operand "
                         f"with {block[0]}x{block[1]} blocks; got {s.shape}")
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    return s[c // BLOCK, r] if block[0] == 1 else s[r // BLOCK, c // BLOCK]


def block_dequantize(q, scale_inv, block=(1, BLOCK), dtype=np.float32) -> np.ndarray:
    """``dtype(float32(q) * scale_inv of q's block)`` for FP8 ``q`` (viewed as 2-D, as quantized)
    and its scales in the layout; NaN as the dtype's canonical NaN (as :func:`.reference.dequantize`)."""
    q2 = as_2d(np.asarray(q), "q", need="block scaling")
    with np.errstate(all="ignore"):
        v = q2.astype(np.float32) * expand_scales(scale_inv, *q2.shape, block)
    return float32_to(v, dtype).reshape(np.shape(q))

