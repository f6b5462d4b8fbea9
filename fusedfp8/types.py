"""The library's shared vocabulary: the result type, the dtype names, the activation flavours,
and the checks of a recipe argument and of ``pad_to``.

Everything here is plain Python: no framework, no device.
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple

FLOAT_INPUTS = ("float32", "float16", "bfloat16")  # the dtypes the kernels read
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # the dtypes they write (bytes on CuPy)

# gelu flavours, as torch.nn.functional.gelu / jax.nn.gelu name them -> the kernels' op suffix
GELU_APPROXIMATIONS = {"tanh": "tanh", "none": "erf"}

# the elementwise operation fused before the cast; 'identity' is plain quantization
OPS = ("identity", "gelu", "dgelu")

GEMM_MULTIPLE = 16  # cuBLASLt's FP8 GEMMs need every dimension a multiple of this


def check_pad_to(pad_to) -> int:
    """``pad_to`` (the padding of a quantization's FP8 outputs) as an int >= 1; ValueError naming
    it otherwise."""
    if isinstance(pad_to, bool) or not isinstance(pad_to, numbers.Integral) or pad_to < 1:
        raise ValueError(f"pad_to must be a positive int (1: no padding; 16: what FP8 GEMMs need); got {pad_to!r}")
    return int(pad_to)


def gemm_pad_to(*dims: int) -> int:
    """The ``pad_to`` of an FP8 GEMM's operands: :data:`GEMM_MULTIPLE` when one of its dimensions
    is not a multiple of it (then every operand is padded), else 1."""
    return GEMM_MULTIPLE if any(d % GEMM_MULTIPLE for d in dims) else 1


class Quantized(NamedTuple):
    """Result of a quantization.

    data : the FP8 array, shape of the input.
    amax : float32 max |input| (or of the activation / gradient), NaN-propagating.
    data_t : the quantized transpose (N, M) of the input viewed as (M, N), or None.
    dbias : (N,) float32 column sums of the unquantized gradient (dgelu only), or None.
    scale_inv : (1,) float32, ``1 / scale`` of the scale the data was quantized with (its own
        buffer: the operand scale to hand to an FP8 GEMM), or None (the reference functions).
    """

    data: Any
    amax: Any
    data_t: Any = None
    dbias: Any = None
    scale_inv: Any = None


class BlockQuantized(NamedTuple):
    """Result of a block-scaled quantization (:func:`fusedfp8.numerics.block.block_quantize`).

    data : the FP8 array (the input's shape; (prows, pcols) when padded).
    scale_inv : float32 ``1 / scale`` of every block, in the layout cuBLASLt's block-scaled GEMM
        reads (:func:`fusedfp8.numerics.block.scale_shape`).
    data_t : the FP8 transpose (pcols, prows) of the 2-D view, or None.
    scale_inv_t : its scales, in the same layout for the transposed shape (its own 1x128 blocks,
        along the other axis; for 128x128 blocks the same values transposed), or None.
    amax : float32 max |y| of the whole tensor (y: the input, or the activation quantized),
        NaN-propagating (what reaches the caller of a block that held a NaN or an inf, whose scale is 1).
    dbias : float32 (cols,) column sums of y over the 2-D view (a gradient's bias gradient), or None.
    """

    data: Any
    scale_inv: Any
    data_t: Any = None
    scale_inv_t: Any = None
    amax: Any = None
    dbias: Any = None


class LayerNormQuantized(NamedTuple):
    """Result of :func:`fusedfp8.layernorm_quantize`.

    quantized : the :class:`Quantized` LayerNorm output (data, amax, data_t, scale_inv; dbias None), or
        from :func:`fusedfp8.block_layernorm_quantize` its :class:`BlockQuantized`.
    mean, rstd : (rows,) float32 per-row statistics of the input viewed as (rows, cols), for the
        backward: ``xhat = (x - mean) * rstd``.
    """

    quantized: Quantized
    mean: Any
    rstd: Any


def check_approximate(approximate, argname: str = "approximate") -> str:
    """``approximate`` if it names a gelu flavour ('tanh' or 'none'); ValueError otherwise."""
    if not isinstance(approximate, str) or approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"{argname} must be 'tanh' or 'none'; got {approximate!r}")
    return approximate


def kernel_op(op: str, approximate: str = "tanh") -> str:
    """The kernels' name of an operation: 'identity', 'gelu_tanh', 'gelu_erf', 'dgelu_tanh', 'dgelu_erf'."""
    return op if op == "identity" else f"{op}_{GELU_APPROXIMATIONS[check_approximate(approximate)]}"


def check_recipe(recipe, argname: str = "recipe", block: bool = False):
    """``recipe`` if it is a :class:`fusedfp8.DelayedScaling` or a :class:`fusedfp8.CurrentScaling`
    (or, with ``block=True``, a :class:`fusedfp8.BlockScaling`); TypeError naming ``argname``
    otherwise. Every caller that keeps per-tensor scales (a ScalingState, the modules and functions
    built on one) takes the default: a BlockScaling there is refused by name rather than read as a
    per-tensor recipe it is not."""
    from .recipe import BlockScaling, TENSOR_RECIPES

    if isinstance(recipe, BlockScaling):
        if block:
            return recipe
        raise TypeError(f"{argname}: a fusedfp8.BlockScaling is not accepted here, which takes a per-tensor recipe "
                        f"(fusedfp8.DelayedScaling or fusedfp8.CurrentScaling, one scale per tensor in a "
                        f"ScalingState); block scaling keeps no state (its scales come from each block's max)")
    if not isinstance(recipe, TENSOR_RECIPES):
        allowed = "a fusedfp8.DelayedScaling, a fusedfp8.CurrentScaling or a fusedfp8.BlockScaling" if block else \
            "a fusedfp8.DelayedScaling or a fusedfp8.CurrentScaling"
        raise TypeError(f"{argname} must be {allowed}; got {type(recipe).__name__}")
    return recipe
