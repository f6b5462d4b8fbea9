"""The scaling recipes: frozen, validated dataclasses.

:class:`DelayedScaling` derives each scale from past amaxes; :class:`CurrentScaling` from the
tensor's own amax, on the same kernels (the first-step path of delayed scaling, on every step).
Both keep one scale per tensor in a :class:`~fusedfp8.state.ScalingState`. :class:`BlockScaling`
keeps no state: every block of 1x128 (activations, gradients) or 128x128 elements (weights) takes
its scale from its own max, in the pass that casts it (:mod:`fusedfp8.numerics.block`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .formats import E4M3, E5M2, RECIPE_FORMATS, Format, find_format

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
MAX_MARGIN = 64  # 2**margin stays exact and every scale normal for amaxes below 2**62
FIRST_STEPS = ("current", "unit")


CURRENT_HISTORY_LEN = 2  # a CurrentScaling state: row 0 stages this step's amax, row 1 keeps the last one


def _choice(name: str, value, allowed, owner: str = "DelayedScaling") -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, one of {allowed}; got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {allowed}; got {value!r}")


def _fp8_format(value, owner: str) -> str:
    """The canonical name ('hybrid' or 'e4m3') of a recipe's ``fp8_format``: either in any case,
    and 'e4m3' in any spelling of the format that ``fmt`` arguments take (:func:`fusedfp8.formats.get_format`)."""
    allowed = tuple(RECIPE_FORMATS)
    if isinstance(value, str) and value.lower() in RECIPE_FORMATS:
        return value.lower()
    fmt = find_format(value)
    if fmt is E4M3:
        return "e4m3"
    if not isinstance(value, str) and fmt is not E5M2:
        raise TypeError(f"{owner}.fp8_format must be a str, one of {allowed}; got {type(value).__name__}")
    why = "; E5M2 for every tensor is no recipe ('hybrid' takes it for the gradients)" if fmt is E5M2 else ""
    raise ValueError(f"{owner}.fp8_format must be one of {allowed}; got {value!r}{why}")


def _check_margin(margin, owner: str) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"{owner}.margin must be a number >= 0; got {type(margin).__name__}")
    if not math.isfinite(margin) or margin < 0:
        raise ValueError(f"{owner}.margin must be a finite number >= 0; got {margin!r}")
    if margin > MAX_MARGIN:
        raise ValueError(f"{owner}.margin must be in [0, {MAX_MARGIN}] (scale = fmt_max / amax / "
                         f"2**margin; a larger margin underflows the scale); got {margin!r}")


class _Recipe:
    """What every recipe derives from its ``fp8_format`` field."""

    def format_for(self, grad: bool) -> Format:
        """The FP8 format of a forward tensor (``grad=False``) or of a gradient."""
        return RECIPE_FORMATS[self.fp8_format][1 if grad else 0]


class _TensorRecipe(_Recipe):
    """What the per-tensor recipes derive from their ``margin`` field."""

    @property
    def margin_factor(self) -> float:
        """``2**margin`` as the float32 divisor of the scale formula and the update rule."""
        return float(2.0 ** self.margin)


@dataclass(frozen=True)
class DelayedScaling(_TensorRecipe):
    """How scales are derived from past amaxes.

    Parameters
    ----------
    margin : int or float, 0 <= margin <= 64
        ``scale = (fmt_max / amax) / 2**margin``. Bounded so that ``2**margin`` is a finite float32
        and the scale cannot underflow to 0 (from margin 128 on it would: scale 0, scale_inv inf).
    amax_history_len : int, >= 1
        Rows of the amax history (row 0 is the staging slot of the current step).
    amax_compute_algo : {'max', 'most_recent'}
        'max' takes the max over the whole history, 'most_recent' the staged amax.
    fp8_format : {'hybrid', 'e4m3'}
        'hybrid': E4M3 for forward tensors, E5M2 for gradients; 'e4m3': E4M3 for both. Any case;
        'e4m3' in any spelling a ``fmt`` argument takes ('float8_e4m3fn', ``torch.float8_e4m3fn``,
        ...). The field holds the canonical lowercase name.
    first_step : {'current', 'unit'}
        How a tensor that has never completed an update is quantized: with a scale from its own
        current amax ('current', one extra read on that step only) or with scale 1 ('unit').

    Raises
    ------
    TypeError, ValueError
        On a field of the wrong type or value; the message names the field.
    """

    margin: float = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: str = "hybrid"
    first_step: str = "current"

    current = False  # not a field: whether the recipe is current scaling (CurrentScaling)

    def __post_init__(self):
        _check_margin(self.margin, "DelayedScaling")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise TypeError(
                f"DelayedScaling.amax_history_len must be an int >= 1; got {type(self.amax_history_len).__name__}")
        if self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be >= 1; got {self.amax_history_len}")
        _choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        object.__setattr__(self, "fp8_format", _fp8_format(self.fp8_format, "DelayedScaling"))
        _choice("first_step", self.first_step, FIRST_STEPS)


@dataclass(frozen=True)
class CurrentScaling(_TensorRecipe):
    """Current scaling: every quantization takes its scale from the amax of the tensor's own values.

    ``scale = (fmt_max / amax) / 2**margin`` (FLT_MAX where that is inf, i.e. a tiny amax); an amax
    of 0 or a non-finite one keeps the state's scale (1 until a finite amax has been seen) and a
    non-finite one counts as an overflow. It runs the first-step path of :class:`DelayedScaling`
    on every step (the state's ``updates`` stay 0, so every step is a first step): on a GPU ONE
    cooperative launch per tensor that computes the amax, waits at a grid-wide barrier and casts
    (cuda_src/current_quantize.cu), bit-identical to an amax pre-pass followed by the cast
    (layernorm_quantize still takes the two launches). The state keeps no history: row 0 stages
    the step's amax, row 1 holds the last one (:data:`CURRENT_HISTORY_LEN` rows); ``update_scales`` closes the
    step (:func:`fusedfp8.numerics.scaling.close_step`) and never changes a scale.

    Parameters
    ----------
    fp8_format : {'hybrid', 'e4m3'}
        'hybrid': E4M3 for forward tensors, E5M2 for gradients; 'e4m3': E4M3 for both. Any case;
        'e4m3' in any spelling a ``fmt`` argument takes ('float8_e4m3fn', ``torch.float8_e4m3fn``,
        ...). The field holds the canonical lowercase name.
    margin : int or float, 0 <= margin <= 64
        As :class:`DelayedScaling`'s.

    Raises
    ------
    TypeError, ValueError
        On a field of the wrong type or value; the message names the field.
    """

    fp8_format: str = "hybrid"
    margin: float = 0

    # what the state, the kernels and the front ends read of a recipe (not fields)
    current = True
    amax_history_len = CURRENT_HISTORY_LEN
    amax_compute_algo = "most_recent"
    first_step = "current"

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _fp8_format(self.fp8_format, "CurrentScaling"))
        _check_margin(self.margin, "CurrentScaling")


BLOCK = (1, 128)  # the block of activations and gradients: 128 consecutive elements of a row
WEIGHT_BLOCKS = ((128, 128), (1, 128))  # a weight's: a 128x128 tile, or rows of 128 as the others


def _block(name: str, value, allowed) -> tuple:
    """``value`` as a tuple of two ints if it is one of ``allowed``; TypeError / ValueError naming
    BlockScaling.``name``, the allowed blocks and the value otherwise."""
    shown = " or ".join(str(b) for b in allowed)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2 or any(
            isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in value):
        raise TypeError(f"BlockScaling.{name} must be a pair of ints, {shown}; got {value!r}")
    block = (int(value[0]), int(value[1]))
    if block not in allowed:
        why = ("; cuBLASLt's block-scaled FP8 GEMM takes 1x128 and 128x128 blocks, and at most one operand "
               "of 128x128 (the weight)") if name == "block" else "; cuBLASLt's block-scaled FP8 GEMM takes no other"
        raise ValueError(f"BlockScaling.{name} must be {shown}; got {value!r}{why}")
    return block


@dataclass(frozen=True)
class BlockScaling(_Recipe):
    """Block scaling (DeepSeek-V3's recipe; Transformer Engine's ``Float8BlockScaling``): a scale per
    block of elements, from the block's own max, computed in the pass that casts it. No amax
    history, no :class:`~fusedfp8.state.ScalingState`, nothing to synchronise across devices.

    Activations and gradients (viewed as 2-D, rows x cols) take one scale per ``block`` of 1x128:
    128 consecutive elements of a row (the GEMM's K axis); their transposed copies (the operands of
    the weight-gradient GEMM, whose K is the rows) take their own 1x128 scales along the other axis.
    Weights take one per ``weight_block``: a 128x128 tile, the same for the weight and its transpose.
    Per block, with ``amax`` the max |x| over the block (float32, exact): ``scale = fmt_max / amax``,
    rounded down to a power of two when ``power_of_two_scales``; a block whose amax is 0 or not
    finite takes scale 1 (its NaN stays NaN, its inf saturates). The exact rule and the layout of
    the scales (the one cuBLASLt's VEC128_32F / BLK128x128_32F scale modes read) are in
    :mod:`fusedfp8.numerics.block` and docs/design.md.

    Parameters
    ----------
    block : (1, 128)
        The block of activations and gradients; cuBLASLt offers no other (a 128x128 activation
        would make the weight-gradient GEMM 128x128 by 128x128, which it does not run).
    weight_block : (128, 128) or (1, 128)
        The block of weights.
    fp8_format : {'e4m3', 'hybrid'}
        'e4m3' (the default, as Transformer Engine's block recipe and DeepSeek-V3: with a scale per
        block, gradients need no E5M2 range): E4M3 for every tensor; 'hybrid': E5M2 for gradients.
        The spellings :class:`DelayedScaling` takes.
    power_of_two_scales : bool
        Round every scale down to a power of two (the default, as Transformer Engine's block recipe:
        ``x * scale`` and ``q * scale_inv`` are then exact, and the rounded-down scale cannot
        overflow the block's max); False keeps ``fmt_max / amax`` as it rounds.

    Raises
    ------
    TypeError, ValueError
        On a field of the wrong type or value; the message names the field.
    """

    block: tuple = BLOCK
    weight_block: tuple = (128, 128)
    fp8_format: str = "e4m3"
    power_of_two_scales: bool = True

    def __post_init__(self):
        object.__setattr__(self, "block", _block("block", self.block, (BLOCK,)))
        object.__setattr__(self, "weight_block", _block("weight_block", self.weight_block, WEIGHT_BLOCKS))
        object.__setattr__(self, "fp8_format", _fp8_format(self.fp8_format, "BlockScaling"))
        if not isinstance(self.power_of_two_scales, (bool, np.bool_)):
            raise TypeError(f"BlockScaling.power_of_two_scales must be a bool; got "
                            f"{type(self.power_of_two_scales).__name__} {self.power_of_two_scales!r}")
        object.__setattr__(self, "power_of_two_scales", bool(self.power_of_two_scales))

    def block_for(self, weight: bool) -> tuple:
        """The block of a weight (``weight=True``) or of an activation or gradient."""
        return self.weight_block if weight else self.block


TENSOR_RECIPES = (DelayedScaling, CurrentScaling)  # the recipes of a ScalingState: one scale per tensor
RECIPES = (DelayedScaling, CurrentScaling, BlockScaling)
