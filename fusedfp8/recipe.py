"""The delayed-scaling recipe: a frozen, validated dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .formats import RECIPE_FORMATS, Format

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
MAX_MARGIN = 64  # 2**margin stays exact and every scale normal for amaxes below 2**62
FIRST_STEPS = ("current", "unit")


def _choice(name: str, value, allowed) -> None:
    if not isinstance(value, str):
        raise TypeError(f"DelayedScaling.{name} must be a str, one of {allowed}; got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"DelayedScaling.{name} must be one of {allowed}; got {value!r}")


@dataclass(frozen=True)
class DelayedScaling:
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
        'hybrid': E4M3 for forward tensors, E5M2 for gradients; 'e4m3': E4M3 for both.
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

    def __post_init__(self):
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)):
            raise TypeError(f"DelayedScaling.margin must be a number >= 0; got {type(self.margin).__name__}")
        if not math.isfinite(self.margin) or self.margin < 0:
            raise ValueError(f"DelayedScaling.margin must be a finite number >= 0; got {self.margin!r}")
        if self.margin > MAX_MARGIN:
            raise ValueError(f"DelayedScaling.margin must be in [0, {MAX_MARGIN}] (scale = fmt_max / amax / "
                             f"2**margin; a larger margin underflows the scale); got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int):
            raise TypeError(
                f"DelayedScaling.amax_history_len must be an int >= 1; got {type(self.amax_history_len).__name__}")
        if self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be >= 1; got {self.amax_history_len}")
        _choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _choice("fp8_format", self.fp8_format, tuple(RECIPE_FORMATS))
        _choice("first_step", self.first_step, FIRST_STEPS)

    def format_for(self, grad: bool) -> Format:
        """The FP8 format of a forward tensor (``grad=False``) or of a gradient."""
        return RECIPE_FORMATS[self.fp8_format][1 if grad else 0]

    @property
    def margin_factor(self) -> float:
        """``2**margin`` as the float32 divisor the update rule uses."""
        return float(2.0 ** self.margin)
