"""``convert_to_fp8``: swapping a model's ``nn.Linear`` modules for :class:`Fp8Linear`."""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..recipe import DelayedScaling
from ..types import check_recipe
from .modules import MISSED_UPDATE_MODES, Fp8Linear

__all__ = ["convert_to_fp8"]


def convert_to_fp8(model: nn.Module, recipe: DelayedScaling = DelayedScaling(),
                   filter_fn: Callable[[str, nn.Linear], bool] | None = None, *,
                   missed_update: str = "raise") -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for an :class:`Fp8Linear`, in place.

    Only modules whose type is exactly ``nn.Linear`` are swapped (subclasses such as
    ``NonDynamicallyQuantizableLinear`` inside ``nn.MultiheadAttention`` are called through
    their weights, not their forward, and are left alone). The new modules take over the
    original Parameter objects (an optimizer built before the conversion keeps working) and
    start with a fresh state on the weight's device.

    Parameters
    ----------
    model : nn.Module
    recipe : DelayedScaling, shared by every converted module
    filter_fn : callable(fqn, linear) -> bool, optional
        Convert only the modules for which it returns True (``fqn`` is the module's name in
        ``model.named_modules()``).
    missed_update : {'raise', 'warn', 'ignore'}, see :class:`Fp8Linear`.

    Returns
    -------
    nn.Module
        ``model`` itself, converted in place; if ``model`` is itself an ``nn.Linear`` (it has no
        parent to swap it in), the new Fp8Linear.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    check_recipe(recipe)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(fqn, module) -> bool or None; got {type(filter_fn).__name__}")
    if missed_update not in MISSED_UPDATE_MODES:
        raise ValueError(f"missed_update must be one of {MISSED_UPDATE_MODES}; got {missed_update!r}")

    def wanted(fqn: str, m: nn.Module) -> bool:
        return type(m) is nn.Linear and (filter_fn is None or bool(filter_fn(fqn, m)))

    if wanted("", model):
        return Fp8Linear.from_linear(model, recipe, missed_update=missed_update)
    swaps = [(fqn, m) for fqn, m in model.named_modules() if fqn and wanted(fqn, m)]
    for fqn, linear in swaps:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Fp8Linear.from_linear(linear, recipe, missed_update=missed_update))
    return model
