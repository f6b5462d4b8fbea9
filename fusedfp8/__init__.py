"""fusedfp8: fused FP8 quantize + amax (+ transpose, + gelu) kernels with delayed scaling.

See README.md for the contract and usage. The framework-agnostic API lives in
:mod:`fusedfp8.ops`; torch glue in :mod:`fusedfp8.pytorch`, JAX glue in :mod:`fusedfp8.jax`.
"""
from .formats import E4M3, E5M2, FORMATS, HYBRID, Format, get_format
from .ops import dequantize, dgelu_quantize, gelu_quantize, quantize, update_scales
from .recipe import DelayedScaling
from .reference import Quantized
from .state import ScalingState, Slot, slot

__version__ = "0.1.0"

__all__ = ["E4M3", "E5M2", "FORMATS", "HYBRID", "Format", "get_format", "DelayedScaling", "ScalingState", "Slot",
           "slot", "Quantized", "quantize", "gelu_quantize", "dgelu_quantize", "dequantize", "update_scales"]
