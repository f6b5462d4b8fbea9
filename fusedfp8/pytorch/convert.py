"""Swapping ``nn.Linear`` for :class:`Fp8Linear`, and the once-per-step scale update.

One launch for the whole model. Every Fp8Linear owns its state as buffers (so ``state_dict``,
``load_state_dict`` and ``.to()`` work module by module), but :func:`update_scales` needs one
state for all of them to update every tensor in a single kernel launch. It therefore links
the modules of a model: it concatenates their buffers into one model-level
:class:`~fusedfp8.ScalingState` (history (L, 3k), vectors (3k,)) and replaces each module's
buffers by views (columns) of it. From then on the modules quantize into the shared arrays and
``ops.update_scales`` updates all of them at once: one launch per distinct (recipe, device),
which is one launch for a model with one recipe on one GPU.

The links are checked on every call by identity (each module's buffer objects must still be
the views handed out), which costs no device work. A ``.to()`` (new buffer objects), a
``deepcopy`` or pickle (the copy drops the link), a new module, or linking a sub-model on its
own breaks them, and the next call links again (one concatenation, outside any hot path; do
the first update before capturing a CUDA graph). ``load_state_dict`` copies into the views, so
it keeps them. ``state_dict()`` holds each module's views; ``torch.save`` stores their shared
storage once.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from .. import ops
from ..recipe import DelayedScaling
from ..state import STATE_FIELDS, ScalingState
from .modules import GRAD, MISSED_UPDATE_MODES, Fp8Linear

__all__ = ["convert_to_fp8", "update_scales", "fp8_modules"]


def fp8_modules(model: nn.Module) -> list[Fp8Linear]:
    """Every :class:`Fp8Linear` in ``model`` (itself included), each once, in module order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, Fp8Linear) and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


class _StateGroup:
    """A model-level state over k modules sharing a recipe and a device, and their views."""

    def __init__(self, modules: list[Fp8Linear], recipe: DelayedScaling):
        self.recipe = recipe
        n = len(GRAD)
        with torch.no_grad():
            arrays = {name: torch.cat([getattr(m, name) for m in modules], dim=-1) for name in STATE_FIELDS}
        self.state = ScalingState(**arrays, grad=GRAD * len(modules))
        self.members = []
        for j, m in enumerate(modules):
            views = {name: a[..., j * n:(j + 1) * n] for name, a in arrays.items()}
            m._buffers.update(views)
            m._group = self
            self.members.append((weakref.ref(m), views))

    def intact(self) -> bool:
        for ref, views in self.members:
            m = ref()
            if m is None or m._group is not self or any(m._buffers[k] is not v for k, v in views.items()):
                return False
        return True

    def module_ids(self) -> set[int]:
        return {id(ref()) for ref, _ in self.members}


def _groups(modules: list[Fp8Linear]) -> list[_StateGroup]:
    """The intact groups covering exactly ``modules``, or new ones (linking the modules)."""
    groups = {id(m._group): m._group for m in modules if m._group is not None}
    if (all(m._group is not None for m in modules) and all(g.intact() for g in groups.values())
            and set().union(*(g.module_ids() for g in groups.values())) == {id(m) for m in modules}):
        return list(groups.values())
    by_key: dict = {}
    for m in modules:
        by_key.setdefault((m.recipe, m.amax_history.device), []).append(m)
    return [_StateGroup(ms, recipe) for (recipe, _), ms in by_key.items()]


@torch.compiler.disable
def update_scales(model: nn.Module, process_group=None) -> None:
    """Turn this step's staged amaxes into next step's scales, for every FP8 module of ``model``.

    Call once per optimizer step (after ``optimizer.step()``; with gradient accumulation, after
    the last micro-batch). Every :class:`Fp8Linear` (also inside :class:`Fp8MLP`) is updated by
    the rule of :func:`fusedfp8.state.update_rule` in one kernel launch per distinct (recipe,
    device) of the modules (see the module docstring for how their states are linked). No host
    synchronisation; capturable in a CUDA graph once a first call has linked the states.
    Runs eagerly (``torch.compiler.disable``): call it outside compiled regions.

    Parameters
    ----------
    model : nn.Module
    process_group : torch.distributed ProcessGroup, optional
        With data parallelism: the staged amaxes (row 0 of the linked history) are MAX-reduced
        over this group in one ``all_reduce`` per linked state before the update, so every rank
        computes the same scales. A NaN is sent as +inf, so that a non-finite amax on any rank
        is an overflow on every rank. (With DDP, also pass ``broadcast_buffers=False``: its
        per-forward broadcast would overwrite the staged amaxes of the other ranks.)

    Raises
    ------
    TypeError
        If ``model`` is not an nn.Module.
    ValueError
        If ``model`` holds no FP8 module (an update that would silently do nothing).
    """
    modules = fp8_modules(model)
    if not modules:
        raise ValueError(f"model: {type(model).__name__} holds no Fp8Linear / Fp8MLP module, so there are no scales to "
                         "update; convert it first with fusedfp8.pytorch.convert_to_fp8(model)")
    for group in _groups(modules):
        if process_group is not None:
            staged = group.state.amax_history[0]
            staged.nan_to_num_(nan=float("inf"), posinf=float("inf"))
            torch.distributed.all_reduce(staged, op=torch.distributed.ReduceOp.MAX, group=process_group)
        ops.update_scales(group.state, group.recipe)
    for m in modules:
        m._ensure_hook()
        m._after_update()


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
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"recipe must be a fusedfp8.DelayedScaling; got {type(recipe).__name__}")
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
