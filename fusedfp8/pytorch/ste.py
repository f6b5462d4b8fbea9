"""The straight-through quantizer: ``quantize_ste`` (fake quantization through a state slot, the
incoming gradient passed through unchanged), its autograd function and its frozen config.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..recipe import DelayedScaling
from ..state import ScalingState
from . import custom_ops as fops

__all__ = ["QuantizeSTE", "QuantizeConfig", "quantize_ste"]

@dataclass(frozen=True)
class QuantizeConfig:
    """How :class:`QuantizeSTE` quantizes: tensor ``index`` of the state, in ``fmt`` ('e4m3' or
    'e5m2'), ``margin_factor`` = 2**margin, a first step with current scaling when ``current_first``."""

    index: int
    fmt: str
    margin_factor: float
    current_first: bool


class QuantizeSTE(torch.autograd.Function):
    """Fake quantization with a straight-through gradient.

    Forward: ``dequantize(quantize(x))`` in x's dtype, through a state slot (the amax of x goes
    into the state, the scale comes from it). Backward: the incoming gradient, unchanged.
    ``apply(x, amax_history, scale, scale_inv, updates, cfg)``: the state's tensors (as
    :func:`fusedfp8.pytorch.custom_ops.quantize` takes them) and a :class:`QuantizeConfig`; most
    callers use :func:`quantize_ste`.
    """

    @staticmethod
    def forward(ctx, x, amax_history, scale, scale_inv, updates, cfg: QuantizeConfig):
        q, q_si = fops.call(fops.quantize, x.contiguous(), amax_history, scale, scale_inv, updates, cfg.index, cfg.fmt,
                            cfg.margin_factor, cfg.current_first)
        return fops.call(fops.dequantize, q, q_si, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None, None


def quantize_ste(x: Tensor, state: ScalingState, index: int, recipe: DelayedScaling) -> Tensor:
    """Fake-quantize ``x`` through tensor ``index`` of ``state``, straight-through gradient.

    Parameters
    ----------
    x : tensor, float32 / float16 / bfloat16, any shape
    state : ScalingState of torch tensors on x's device
    index : int, the tensor's column in the state
    recipe : DelayedScaling or CurrentScaling; gives the format (``state.grad[index]`` picks E4M3 or
        E5M2) and margin.

    Returns
    -------
    Tensor of x's shape and dtype: ``dequantize(fp8(x * scale))``; its gradient w.r.t. x is the
    identity. The amax of x is max-accumulated into ``state.amax_history[0, index]``.

    Raises
    ------
    TypeError, IndexError, ValueError
        On a bad index, dtype or device (nothing is written).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor; got {type(x).__name__} (fusedfp8.ops.quantize takes any array)")
    cfg = QuantizeConfig(index, state.format_of(index, recipe).name, recipe.margin_factor,
                         recipe.first_step == "current")
    return QuantizeSTE.apply(x, state.amax_history, state.scale, state.scale_inv, state.updates, cfg)
