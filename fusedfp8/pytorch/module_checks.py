"""What every FP8 module (:class:`~fusedfp8.pytorch.Fp8Linear`, :class:`~fusedfp8.pytorch.Fp8MLP`)
checks before its first kernel or write: the input and weight (dtype, features, device), the
writability of its state buffers, the process group of ``amax_group``, and the ``strict`` of
a ``load_state_dict`` called on the module itself.
"""
from __future__ import annotations

import threading

import torch
from torch import nn

from .amax_ops import check_group

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
MISSED_UPDATE_MODES = ("raise", "warn", "ignore")  # Fp8Linear's missed_update
# torch passes strict=True to every _load_from_state_dict whatever the caller asked; the strict
# of a load_state_dict called on an FP8 module itself is kept here (None: called on a parent,
# where torch's own missing-keys report applies)
_LOAD = threading.local()


def _load_strict() -> bool | None:
    return getattr(_LOAD, "strict", None)


class _StrictLoad:
    """``load_state_dict`` of an FP8 module: remember the caller's ``strict`` for the checks."""

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        outer, _LOAD.strict = _load_strict(), bool(strict)
        try:
            return nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)
        finally:
            _LOAD.strict = outer


def check_block_module_args(missed_update, amax_group) -> None:
    """Fp8Linear's ``missed_update`` and ``amax_group`` under BlockScaling: a valid mode (there is
    no update to miss), and no group (nothing to reduce)."""
    if missed_update not in MISSED_UPDATE_MODES:
        raise ValueError(f"missed_update must be one of {MISSED_UPDATE_MODES}; got {missed_update!r}")
    if amax_group is not None:
        raise ValueError("amax_group is for CurrentScaling (an amax reduced across ranks before every cast); under "
                         "BlockScaling each block's scale comes from its own max, the same on every rank: pass "
                         f"amax_group=None; got {amax_group!r}")


def check_amax_group(amax_group, recipe) -> str | None:
    """The name of the process group ``amax_group`` (None for None), after checking that it can
    carry current scaling across ranks (raises before anything is built or written)."""
    if amax_group is None:
        return None
    check_group(amax_group, "amax_group")
    if not recipe.current:
        raise ValueError(f"amax_group is for CurrentScaling (the amax reduced across ranks before every cast); got "
                         f"{recipe!r}, whose staged amaxes are reduced once per step instead: pass the group to "
                         f"fusedfp8.pytorch.update_model_scales(model, group=...) and leave amax_group=None")
    return amax_group.group_name


def _check_input(layer: str, x: torch.Tensor, features: int, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer}: input must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{layer}: input must be float32, float16 or bfloat16; got {x.dtype}")
    if weight.dtype not in _FLOATS:
        raise TypeError(f"{layer}: weight must be float32, float16 or bfloat16; got {weight.dtype}")
    if x.dim() < 1 or x.shape[-1] != features:
        raise ValueError(f"{layer}: input must have {features} features in its last dimension; got shape "
                         f"{tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"{layer}: input is on {x.device} but the weight is on {weight.device}")


def _check_state_writable(layer: str, *modules: nn.Module) -> None:
    """Refuse, before the first kernel of a forward, state buffers of the Fp8Linear ``modules``
    that the forward could not write (so that no state is left half written): ValueError naming the buffer."""
    if torch.compiler.is_compiling():  # (dynamo cannot trace the inference-mode query; a compiled graph
        return                         # checked its buffers when it was traced eagerly or fails in the op)
    inference = torch.is_inference_mode_enabled()
    for m in modules:
        for name in ("amax_history", "scale", "scale_inv"):
            t = m._buffers[name]
            why = ("requires grad (autograd forbids writing it in place)" if t.requires_grad else
                   "is an inference tensor (made under torch.inference_mode), written outside inference mode"
                   if t.is_inference() and not inference else "")
            if why:
                raise ValueError(f"{layer}: the FP8 state buffer '{name}' {why}; nothing was written")
