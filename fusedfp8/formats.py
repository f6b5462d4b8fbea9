"""The one table of FP8 formats, and the recipe-level pairings.

Every dispatch on a format goes through :func:`get_format`; an unknown name gets one error
that lists the allowed values.
"""
from __future__ import annotations

from typing import NamedTuple

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
        import ml_dtypes  # a second to import: only where numpy arrays of FP8 are made

        return np.dtype(getattr(ml_dtypes, self.dtype_name))


E4M3 = Format("e4m3", 448.0, 4, 3, False, "float8_e4m3fn", 0x7F)
E5M2 = Format("e5m2", 57344.0, 5, 2, True, "float8_e5m2", 0x7F)

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2)}
# every lowercase spelling a user may have: the short names, ml_dtypes' suffix ('e4m3fn') and the
# dtype names. Not 'float8_e4m3': that is ml_dtypes' IEEE-style E4M3 (max 240, has inf), another encoding.
_SPELLINGS: dict[str, Format] = {**FORMATS, "e4m3fn": E4M3, **{f.dtype_name: f for f in (E4M3, E5M2)}}

# Recipe-level pairings: (format of forward tensors, format of gradients).
HYBRID = (E4M3, E5M2)
RECIPE_FORMATS: dict[str, tuple[Format, Format]] = {"hybrid": HYBRID, "e4m3": (E4M3, E4M3)}


def _spelled(fmt) -> str | None:
    """The lowercase name ``fmt`` spells: a str, or a dtype object named by its dtype name, read
    without importing its framework (numpy / ml_dtypes dtypes and scalar types, ``jnp.float8_*``,
    ``torch.float8_*``); None for anything else."""
    if isinstance(fmt, str):
        return fmt.lower()
    if isinstance(fmt, np.dtype):
        return fmt.name
    if isinstance(fmt, type):
        dt = getattr(fmt, "dtype", None)  # jax.numpy's scalar types carry their numpy dtype
        if isinstance(dt, np.dtype):
            return dt.name
        return np.dtype(fmt).name if issubclass(fmt, np.generic) else None
    if type(fmt).__module__ == "torch" and type(fmt).__name__ == "dtype":  # str(): 'torch.float8_e4m3fn'
        return str(fmt).removeprefix("torch.")
    return None


def find_format(fmt) -> Format | None:
    """The :class:`Format` that ``fmt`` names (any spelling :func:`get_format` takes), or None."""
    if isinstance(fmt, Format):
        return fmt
    return _SPELLINGS.get(_spelled(fmt))


def get_format(fmt, argname: str = "fmt") -> Format:
    """Return the :class:`Format` that ``fmt`` names: 'e4m3' / 'e5m2', 'e4m3fn', the dtype names
    'float8_e4m3fn' / 'float8_e5m2' (any case), those dtypes as objects (numpy / ml_dtypes, torch,
    jax.numpy), or a Format itself.

    Raises
    ------
    ValueError
        If ``fmt`` names no supported FP8 format; the message lists the allowed names.
    """
    found = find_format(fmt)
    if found is not None:
        return found
    allowed = ", ".join(repr(n) for n in _SPELLINGS)
    raise ValueError(f"{argname}: unsupported FP8 format {fmt!r}; expected one of {allowed} (any case), the "
                     f"float8_e4m3fn / float8_e5m2 dtype of numpy, torch or jax.numpy, or a fusedfp8.Format")
