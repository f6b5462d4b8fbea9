"""``ScalingState``: the delayed-scaling state of ``n`` tensors, and ``Slot``, one tensor's view
into it.

The rule that advances a state lives in :mod:`fusedfp8.numerics.scaling`; this module holds the
state object only (its fields, construction, checks, copies) and the plain application of the
rule through the state's own array namespace (:func:`apply_update`), which the CPU paths use.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import _interop as io
from .formats import Format
from .numerics.scaling import close_step, update_rule
from .recipe import DelayedScaling
from .types import check_recipe

STATE_FIELDS = ("amax_history", "scale", "scale_inv", "overflows", "updates")
_EXPECT = {"amax_history": (2, "float32"), "scale": (1, "float32"), "scale_inv": (1, "float32"),
           "overflows": (1, "int32"), "updates": (1, "int32")}


def _check_grad(grad) -> tuple:
    """``grad`` as a non-empty tuple of bools (one per tensor); TypeError / ValueError otherwise."""
    if isinstance(grad, (str, bytes)) or not isinstance(grad, (tuple, list)):
        raise TypeError(f"grad must be a sequence of bool, one per tensor (True for a gradient); got "
                        f"{type(grad).__name__}")
    bad = [g for g in grad if not isinstance(g, (bool, np.bool_))]
    if bad:
        raise TypeError(f"grad must hold bools (True for a gradient); got {bad[0]!r} ({type(bad[0]).__name__})")
    if not grad:
        raise ValueError("grad: a state needs at least one tensor; got an empty sequence")
    return tuple(bool(g) for g in grad)


@dataclass(slots=True)
class ScalingState:
    """Delayed-scaling state for ``n`` tensors.

    Attributes
    ----------
    amax_history : (L, n) float32
        Row 0 is the staging slot that quantization max-accumulates into; rows 1..L-1 are past
        steps, newest last.
    scale : (n,) float32
        Multiplies before the cast: ``q = fp8(x * scale)``.
    scale_inv : (n,) float32
        ``1 / scale``; dequantizes, and is what the GEMM consumes.
    overflows : (n,) int32
        Count of non-finite amaxes seen by the update.
    updates : (n,) int32
        Count of completed updates; 0 means the tensor has no past amax yet (the first-step
        flag that the kernels read on the device).
    grad : tuple of bool, length n
        Which tensors are gradients (E5M2 under the 'hybrid' recipe). Static metadata.
    on_update : callable or None
        Called with no argument after :func:`fusedfp8.update_scales` has updated this state in
        place (set by the owner of the arrays, e.g. ``Fp8Linear.fp8_state``, so that an update
        made through the generic function counts as the module's update). Not part of the
        arrays: :meth:`replace` keeps it, :meth:`copy` (new arrays, which the owner does not
        hold) does not; a jax pytree carries it as None.

    All arrays belong to one framework and one device. A fresh state (:meth:`create`) has a
    zero history, scale 1, scale_inv 1 and zero counters. These seven fields are the whole
    state object.
    """

    amax_history: Any
    scale: Any
    scale_inv: Any
    overflows: Any
    updates: Any
    grad: tuple
    on_update: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        self.grad = _check_grad(self.grad)
        self.validate()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, grad: int | Sequence[bool], recipe: DelayedScaling, like=None) -> "ScalingState":
        """A fresh state.

        Parameters
        ----------
        grad : int or sequence of bool
            Either the number of (forward) tensors, or one flag per tensor saying whether it is
            a gradient.
        recipe : DelayedScaling or CurrentScaling
            Gives the history length (2 rows under CurrentScaling: the staged and the last amax).
        like : array, optional
            The state is allocated with this array's framework and device (numpy by default).
        """
        check_recipe(recipe)
        if isinstance(grad, (int, np.integer)) and not isinstance(grad, (bool, np.bool_)):
            if grad < 1:
                raise ValueError(f"grad: the number of tensors must be >= 1; got {grad}")
            grad = (False,) * int(grad)
        grad = _check_grad(grad)
        n, L = len(grad), recipe.amax_history_len
        like = like if like is not None else np.zeros(0, np.float32)
        xp = io.namespace(like)
        return cls(
            amax_history=xp.asarray(np.zeros((L, n), np.float32), xp.float32, like),
            scale=xp.asarray(np.ones(n, np.float32), xp.float32, like),
            scale_inv=xp.asarray(np.ones(n, np.float32), xp.float32, like),
            overflows=xp.asarray(np.zeros(n, np.int32), xp.int32, like),
            updates=xp.asarray(np.zeros(n, np.int32), xp.int32, like),
            grad=grad,
        )

    # -- checks ------------------------------------------------------------------------------
    @property
    def num_tensors(self) -> int:
        return len(self.grad)

    @property
    def history_len(self) -> int:
        return int(self.amax_history.shape[0])

    def arrays(self) -> dict:
        return {f: getattr(self, f) for f in STATE_FIELDS}

    def validate(self, recipe: DelayedScaling | None = None) -> None:
        """Raise ValueError/TypeError naming the field if shapes, dtypes or frameworks disagree."""
        if recipe is not None:
            check_recipe(recipe)
        n = len(self.grad)
        fw = None
        for name, (ndim, dtype) in _EXPECT.items():
            a = getattr(self, name)
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise TypeError(f"ScalingState.{name} must be an array; got {type(a).__name__}")
            this_fw = io.framework_of(a)
            if fw is None:
                fw = this_fw
            elif this_fw != fw:
                raise TypeError(f"ScalingState.{name} is a {this_fw} array but amax_history is a {fw} array; "
                                "all state arrays must belong to one framework")
            if len(a.shape) != ndim:
                raise ValueError(f"ScalingState.{name} must be {ndim}-D; got shape {tuple(a.shape)}")
            if io.dtype_name(a) != dtype:
                raise TypeError(f"ScalingState.{name} must be {dtype}; got {io.dtype_name(a)}")
            if a.shape[-1] != n:
                raise ValueError(f"ScalingState.{name} has {a.shape[-1]} tensors (last dim) but grad has {n}")
        if self.amax_history.shape[0] < 1:
            raise ValueError("ScalingState.amax_history must have at least 1 row")
        if recipe is not None and recipe.amax_history_len != self.amax_history.shape[0]:
            raise ValueError(
                f"ScalingState.amax_history has {self.amax_history.shape[0]} rows but the recipe's "
                f"amax_history_len is {recipe.amax_history_len}")

    def fmt_max(self, recipe: DelayedScaling) -> np.ndarray:
        """(n,) float32 numpy array: the max of each tensor's format under ``recipe``."""
        return np.array([recipe.format_for(g).max for g in self.grad], np.float32)

    def format_of(self, index: int, recipe: DelayedScaling) -> Format:
        """The format of tensor ``index`` under ``recipe`` (checked against this state)."""
        i = self.check_index(index)
        self.validate(recipe)
        return recipe.format_for(self.grad[i])

    def check_index(self, index) -> int:
        """``index`` as an int in [0, n); TypeError / IndexError naming it otherwise."""
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"index must be an int; got {type(index).__name__}")
        if not 0 <= index < len(self.grad):
            raise IndexError(f"index must be in [0, {len(self.grad)}); got {index}")
        return int(index)

    def slot(self, index: int, recipe: DelayedScaling) -> "Slot":
        """The :class:`Slot` of tensor ``index`` under ``recipe``: what a state-aware
        quantization (``fusedfp8.quantize(x, state.slot(i, recipe))``) reads and writes."""
        i = self.check_index(index)
        self.validate(recipe)
        return Slot(self.scale[i:i + 1], self.scale_inv[i:i + 1], self.amax_history[0, i:i + 1],
                    self.updates[i:i + 1], recipe.format_for(self.grad[i]), recipe.margin_factor,
                    recipe.first_step == "current")

    def replace(self, **arrays) -> "ScalingState":
        return dataclasses.replace(self, **arrays)

    def copy(self) -> "ScalingState":
        """A state with copies of the arrays (and no ``on_update``: its owner does not hold them)."""
        return self.replace(**{f: io.copy(a) for f, a in self.arrays().items()}, on_update=None)

    def summary(self, recipe: DelayedScaling | None = None, names: Sequence[str] | None = None) -> str:
        """A plain-text table of every tensor's scale, amaxes and overflow count.

        This reads the state from the device (one copy of each array, so it synchronises with
        the device): call it between steps when you want to look, never inside a hot loop.
        Reading it also logs, as a WARNING on ``logging.getLogger("fusedfp8")``, every tensor
        whose overflow count grew since the previous read of the same ``overflows`` array (jax
        states are new arrays after each update, so their totals are logged at each read).

        Parameters
        ----------
        recipe : DelayedScaling, optional
            Fills the ``format`` column (E4M3 / E5M2 per tensor); '-' without it.
        names : sequence of str, optional
            One name per tensor (default: the indices).

        Returns
        -------
        str
            One line per tensor with the columns ``tensor``, ``role`` (forward / gradient),
            ``format``, ``scale``, ``scale_inv``, ``amax (last)`` (the newest amax in the
            history, '-' before the first update), ``amax (history max)``, ``staged amax``
            (row 0: what this step has quantized so far), ``overflows`` and ``updates``
            (completed updates).

        Raises
        ------
        ValueError
            If ``names`` does not have one entry per tensor.
        """
        from . import report

        if recipe is not None:
            self.validate(recipe)
        return report.format_table(report.state_rows(self, recipe, names))


def apply_update(state: ScalingState, recipe: DelayedScaling) -> ScalingState:
    """The update rule on ``state`` through its own array namespace (no custom kernel); under a
    :class:`~fusedfp8.recipe.CurrentScaling` recipe the step close of
    :func:`~fusedfp8.numerics.scaling.close_step`.

    Mutable arrays (numpy, torch, cupy) are updated in place and the same state is returned;
    jax arrays are immutable, so a new state is returned. Callers always use the return value.
    """
    state.validate(recipe)
    for name in STATE_FIELDS:  # refuse before computing, so that no array is half written
        a = getattr(state, name)
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"ScalingState.{name} is a read-only numpy array; the update writes the state in place")
    xp = io.namespace(state.amax_history)
    if recipe.current:
        new = close_step(xp, state.amax_history, state.scale, state.scale_inv, state.overflows, state.updates)
    else:
        fmt_max = xp.asarray(state.fmt_max(recipe), xp.float32, state.amax_history)
        margin = xp.asarray(recipe.margin_factor, xp.float32, state.amax_history)
        new = update_rule(xp, state.amax_history, state.scale, state.overflows, state.updates,
                          fmt_max, margin, recipe.amax_compute_algo)
    if not io.is_mutable(state.amax_history):
        return state.replace(**dict(zip(STATE_FIELDS, new)))
    for name, value in zip(STATE_FIELDS, new):
        getattr(state, name)[...] = value
    return state


class Slot(NamedTuple):
    """One tensor's view into a :class:`ScalingState` (from :meth:`ScalingState.slot`): the
    arrays are 1-element views sharing the state's memory (numpy, torch, cupy)."""

    scale: Any          # (1,) float32: multiplies before the cast; written on a current-scaled first step
    scale_inv: Any      # (1,) float32: 1 / scale, written with it
    amax: Any           # (1,) float32: row 0 of the history, max-accumulated
    updates: Any        # (1,) int32: read; 0 means the tensor's first step
    fmt: Format         # the tensor's FP8 format under the recipe
    margin_factor: float  # 2**margin, for the first-step scale
    current_first: bool   # recipe.first_step == 'current'
