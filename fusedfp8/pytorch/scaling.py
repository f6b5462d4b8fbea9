"""Model-level scaling: linking the FP8 modules' states, ``update_model_scales`` (one launch per
step for the whole model), ``PendingScaleUpdate``, and the cross-rank MAX of the staged amaxes.

One launch for the whole model. Every Fp8Linear owns its state as buffers (so ``state_dict``,
``load_state_dict`` and ``.to()`` work module by module), but the update needs one state for all
of them to update every tensor in a single kernel launch. :func:`update_model_scales` therefore
links the modules of a model: it concatenates their buffers into one model-level
:class:`~fusedfp8.ScalingState` (history (L, 3k), vectors (3k,)) and replaces each module's
buffers by views (columns) of it. From then on the modules quantize into the shared arrays and
``fusedfp8.update_scales`` updates all of them at once: one launch per distinct (recipe,
device), which is one launch for a model with one recipe on one GPU.

The links are checked on every call by identity (each module's buffer objects must still be
the views handed out), which costs no device work. A ``.to()`` (new buffer objects), a
``deepcopy`` or pickle (the copy drops the link), a new module, or linking a sub-model on its
own breaks them, and the next call links again (one concatenation, outside any hot path; do
the first update before capturing a CUDA graph). ``load_state_dict`` copies into the views, so
it keeps them. ``state_dict()`` holds each module's views; ``torch.save`` stores their shared
storage once.

Several ranks. With data (or tensor, or sequence) parallelism every rank must quantize with the
same scales, so before the update the staged amaxes (row 0 of every linked state) are
MAX-reduced over the process group in ONE ``all_reduce`` per device holding FP8 state. A model
whose FP8 modules share one recipe and one device has ONE model-level state whose row 0 is a
contiguous (n,) view, reduced in place; several linked states on one device are concatenated
into one buffer first and copied back afterwards.

Non-finite amaxes. The update rule treats NaN and inf alike (an overflow: scale kept, slot
cleared), so NaN is sent as +inf. A MAX over +inf is +inf whatever the order, so a non-finite
amax on any rank is an overflow on every rank. A NaN itself could not be trusted to survive the
reduction: gloo's MAX keeps or drops it depending on which rank holds it (measured with torch
2.13: ``max(NaN on rank 0, 1.0) = NaN`` but ``max(1.0, NaN on rank 1) = 1.0``), and NCCL does
not specify what its MAX does with NaN. The mapping is the only change it makes to the staged
values, and it changes no result: the rank that saw the NaN would have counted an overflow
either way. A rank whose module did not run this step staged 0 for it; it still takes part in
the collective and afterwards holds the same state as the ranks that ran it.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from .. import ops
from ..recipe import DelayedScaling
from ..state import STATE_FIELDS, ScalingState
from .amax_ops import check_group
from .block_layers import Fp8BlockLinear
from .modules import GRAD, Fp8Linear

__all__ = ["update_model_scales", "fp8_modules", "PendingScaleUpdate"]


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
        with torch.no_grad(), torch.inference_mode(False):  # (linked in inference mode, training must write them)
            arrays = {name: torch.cat([getattr(m, name) for m in modules], dim=-1) for name in STATE_FIELDS}
        self.state = ScalingState(**arrays, grad=GRAD * len(modules))
        self.members = []
        self.arrays = tuple(arrays[name] for name in ("amax_history", "scale", "scale_inv", "updates"))
        for j, m in enumerate(modules):
            views = {name: a[..., j * n:(j + 1) * n] for name, a in arrays.items()}
            m._buffers.update(views)
            m._group = self
            m._link = (views, self.arrays, j * n)
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


class PendingScaleUpdate:
    """The second half of ``update_scales(model, group, async_op=True)``: the all_reduce of
    the staged amaxes is in flight; :meth:`wait` finishes it and runs the fused update.

    Until ``wait()`` returns, the FP8 modules of the model must not run (a forward or backward
    would stage into the row being reduced) and their states must not be replaced or moved.
    """

    def __init__(self, modules, groups, reductions):
        self._modules, self._groups, self._reductions = modules, groups, reductions

    @property
    def done(self) -> bool:
        """True once :meth:`wait` has run (the scales are updated)."""
        return self._groups is None

    @torch.compiler.disable
    def wait(self) -> None:
        """Wait for the reduction (on NCCL the current stream waits, the host does not), then
        update the scales in one launch per linked state. Calling it again does nothing."""
        if self._groups is None:
            return
        for r in self._reductions:
            r.wait()
        for group in self._groups:
            ops.update_scales(group.state, group.recipe)
        for m in self._modules:
            m._watch.see(m)
            m._after_update()
        self._groups = self._modules = self._reductions = None


@torch.compiler.disable
def update_model_scales(model: nn.Module, group=None, *, async_op: bool = False):
    """Turn this step's staged amaxes into next step's scales, for every FP8 module of ``model``.

    Call once per optimizer step (after ``optimizer.step()``; with gradient accumulation, after
    the last micro-batch). Every :class:`Fp8Linear` (also inside :class:`Fp8MLP`) is updated by
    the rule of :func:`fusedfp8.numerics.scaling.update_rule` in one kernel launch per distinct (recipe,
    device) of the modules (see the module docstring for how their states are linked). No host
    synchronisation; capturable in a CUDA graph once a first call has linked the states.
    Runs eagerly (``torch.compiler.disable``): call it outside compiled regions.

    Parameters
    ----------
    model : nn.Module
        The model, or its DDP / FSDP2 wrapper (the FP8 modules are found inside).
    group : torch.distributed ProcessGroup, optional
        Every rank that trains a replica or a shard of the model: ``torch.distributed.group.WORLD``
        for plain data parallelism. The staged amaxes (row 0 of the linked histories) are
        MAX-reduced over it in ONE ``all_reduce`` (per device holding FP8 state; one in the usual
        one-GPU-per-rank setup) before the update, so every rank computes bitwise the same
        scales and histories. A non-finite amax on any rank is an overflow on every rank (NaN
        is sent as +inf; see ``fusedfp8.pytorch.distributed``). Every rank of the group must
        call this with the same group and the same FP8 modules in the same order, including a
        rank on which some module did not run this step (it contributes 0 for it). ``None``
        (the default) updates from this process's amaxes only, with no communication.
    async_op : bool
        With a group: launch the all_reduce and return a :class:`PendingScaleUpdate` at once;
        its ``wait()`` finishes the reduction and runs the update. This lets the reduction
        overlap other work, e.g. ``pending = update_scales(model, group, async_op=True)`` right
        after the backward, then ``optimizer.step()``, then ``pending.wait()``. The modules must
        not run in between.

    Returns
    -------
    None, or a :class:`PendingScaleUpdate` when ``async_op`` is True (without a group it is
    already done).

    With DDP: each forward that DDP runs with ``forward_sync_buffers`` (formerly
    ``broadcast_buffers``) on copies rank 0's buffers, the staged amaxes included, to every
    rank. That is harmless with one forward per optimizer step and with gradient accumulation
    under ``no_sync()`` (DDP does not broadcast before the later micro-batches), but several
    synchronised forwards per step would lose the other ranks' amaxes staged so far: pass
    ``forward_sync_buffers=False`` (``broadcast_buffers=False`` before torch 2.13) then.

    With FSDP2 (``fully_shard``): the FP8 states are buffers, which FSDP2 leaves unsharded, and
    the forward quantizes the all-gathered weight, so the reduction is the same as under DDP.
    Tested on CPU (gloo, 2 ranks: identical scales on every rank); untested on several GPUs. The
    missed-update check sees two weights (the unsharded one and FSDP2's sharded one), so it raises
    wrongly: build the modules with ``missed_update='ignore'`` under FSDP2.

    Raises
    ------
    TypeError
        If ``model`` is not an nn.Module, or ``group`` is not a ProcessGroup.
    ValueError
        If ``model`` holds no FP8 module (an update that would silently do nothing), unless
        :func:`convert_to_fp8` left every layer of it in high precision (its ``filter_fn`` or
        ``policy='auto'`` kept them all) or its FP8 layers are block-scaled (stateless): then
        there is nothing to update and the call does nothing.
    RuntimeError
        If a group is given but torch.distributed is not initialized.
    """
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be a bool; got {type(async_op).__name__}")
    modules = fp8_modules(model)
    if group is not None:
        check_group(group, "group")
    if not modules and any(getattr(m, "fp8_conversion_report", None) is not None or isinstance(m, Fp8BlockLinear)
                           for m in model.modules()):
        # convert_to_fp8 kept every layer in high precision (its filter_fn or policy), or the FP8
        # layers are block-scaled (no state): nothing to do
        done = PendingScaleUpdate([], None, [])
        return done if async_op else None
    if not modules:
        raise ValueError(f"model: {type(model).__name__} holds no Fp8Linear / Fp8MLP module, so there are no scales to "
                         "update; convert it first with fusedfp8.pytorch.convert_to_fp8(model)")
    groups = _groups(modules)
    reductions = []
    if group is not None:
        reductions = reduce_staged_amaxes([g.state.amax_history for g in groups], group, async_op)
    pending = PendingScaleUpdate(modules, groups, reductions)
    if async_op:
        if group is None:
            pending.wait()
        return pending
    pending.wait()
    return None


# ---- the cross-rank MAX of the staged amaxes ----------------------------------------------
class _Reduction:
    """One in-flight (or finished) all_reduce over the staged rows of some linked states."""

    def __init__(self, rows: list[torch.Tensor], group, async_op: bool):
        if len(rows) == 1:
            self.buffer = rows[0]  # row 0 of a contiguous (L, n) history: reduced in place
            self.rows = []
        else:
            self.buffer = torch.cat(rows)
            self.rows = rows
        self.buffer.nan_to_num_(nan=float("inf"), posinf=float("inf"))
        self.work = dist.all_reduce(self.buffer, op=dist.ReduceOp.MAX, group=group, async_op=async_op)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()  # on NCCL: the current stream waits; the host does not
            self.work = None
        start = 0
        for row in self.rows:
            row.copy_(self.buffer[start:start + row.numel()])
            start += row.numel()
        self.rows = []


def reduce_staged_amaxes(histories: list[torch.Tensor], group, async_op: bool = False) -> list[_Reduction]:
    """MAX-reduce row 0 of each (L, n) history over ``group``: one all_reduce per device.

    Returns the reductions; call ``wait()`` on each before the histories are read (a no-op
    beyond the scatter back when ``async_op`` is False).
    """
    by_device: dict = {}
    for h in histories:
        by_device.setdefault(h.device, []).append(h[0])
    return [_Reduction(rows, group, async_op) for rows in by_device.values()]
