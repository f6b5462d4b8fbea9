"""fusedfp8: fused FP8 quantize + amax (+ transpose, + gelu) kernels with delayed or current scaling.

The face of the package (framework-agnostic, eager): the formats, the recipes
:class:`DelayedScaling` and :class:`CurrentScaling` (and :class:`BlockScaling`, whose numerics live
in :mod:`fusedfp8.numerics.block` and which :func:`block_quantize`, :func:`block_gelu_quantize`,
:func:`block_dgelu_quantize` and :func:`block_layernorm_quantize` take; the other functions and
the modules take the per-tensor recipes and refuse it by name), :class:`ScalingState` (and its per-tensor
:class:`Slot`), :class:`Quantized`, and the six functions ``quantize``, ``gelu_quantize``,
``dgelu_quantize``, ``layernorm_quantize``, ``dequantize`` and ``update_scales``. Framework glue
lives in :mod:`fusedfp8.pytorch` (modules, autograd, the model-level ``update_model_scales``) and
:mod:`fusedfp8.jax` (the same functions traceable inside ``jax.jit``, and flax modules).
README.md lists what each exports.
"""
from .block import block_dgelu_quantize, block_gelu_quantize, block_layernorm_quantize, block_quantize
from .formats import E4M3, E5M2, Format
from .ops import dequantize, dgelu_quantize, gelu_quantize, layernorm_quantize, quantize, update_scales
from .recipe import BlockScaling, CurrentScaling, DelayedScaling
from .state import ScalingState, Slot
from .types import LayerNormQuantized, Quantized

__version__ = "0.1.0"

__all__ = ["E4M3", "E5M2", "Format", "DelayedScaling", "CurrentScaling", "BlockScaling", "ScalingState", "Slot",
           "Quantized", "LayerNormQuantized", "quantize", "gelu_quantize", "dgelu_quantize", "layernorm_quantize", "dequantize",
           "update_scales", "block_quantize", "block_gelu_quantize", "block_dgelu_quantize",
           "block_layernorm_quantize"]
