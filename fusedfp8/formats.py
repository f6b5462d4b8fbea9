"""The one table of FP8 formats, and the recipe-level pairings.

Every dispatch on a format goes through :func:`get_format`; an unknown name gets one error
that lists the allowed values.
"""
from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np


class Format(NamedTuple):
    """One FP8 encoding.

    name: short name used everywhere in the library ('e4m3' or 'e5m2').
    max: largest finite magnitude.
    exponent_bits, mantissa_bits: the bit layout (sign bit not counted).
    has_inf: whether the encoding has infinities (E5M2 does, E4M3-fn does not).
    dtype_name: the name of the dtype in ml_dtypes, torch and jax.numpy.
    nan_bits: the canonical NaN byte that quantization writes for a NaN input.
    """

    name: str
    max: float
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool
    dtype_name: str
    nan_bits: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(getattr(ml_dtypes, self.dtype_name))


E4M3 = Format("e4m3", 448.0, 4, 3, False, "float8_e4m3fn", 0x7F)
E5M2 = Format("e5m2", 57344.0, 5, 2, True, "float8_e5m2", 0x7F)

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2)}
_ALIASES = {f.dtype_name: f for f in (E4M3, E5M2)}

# Recipe-level pairings: (format of forward tensors, format of gradients).
HYBRID = (E4M3, E5M2)
RECIPE_FORMATS: dict[str, tuple[Format, Format]] = {"hybrid": HYBRID, "e4m3": (E4M3, E4M3)}


def get_format(fmt: str | Format, argname: str = "fmt") -> Format:
    """Return the :class:`Format` for a name ('e4m3', 'e5m2', or the dtype name) or a Format.

    Raises
    ------
    ValueError
        If ``fmt`` names no supported FP8 format; the message lists the allowed names.
    """
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        found = FORMATS.get(fmt.lower()) or _ALIASES.get(fmt.lower())
        if found is not None:
            return found
    allowed = ", ".join(repr(n) for n in (*FORMATS, *_ALIASES))
    raise ValueError(f"{argname}: unsupported FP8 format {fmt!r}; expected one of {allowed}")
