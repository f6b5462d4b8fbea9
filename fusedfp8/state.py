"""Delayed-scaling state and its update rule, written once over an array namespace.

The rule below runs unchanged on numpy, cupy, torch and jax.numpy arrays; the CUDA kernel in
``cuda_src/update_scales.cu`` is tested byte for byte against it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import _logging
from ._interop import framework_of
from .formats import Format
from .recipe import DelayedScaling

FLT_MAX = float(np.finfo(np.float32).max)
STATE_FIELDS = ("amax_history", "scale", "scale_inv", "overflows", "updates")


# --------------------------------------------------------------------------------------------
# Array namespaces: numpy, cupy and jax.numpy speak the numpy API; torch gets a thin adapter.
# --------------------------------------------------------------------------------------------
class _TorchNamespace:
    def __init__(self):
        import torch

        self.torch = torch
        self.float32, self.int32 = torch.float32, torch.int32

    def asarray(self, value, dtype, like):
        return self.torch.as_tensor(value, dtype=dtype, device=like.device)

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def isfinite(self, a):
        return self.torch.isfinite(a)

    def isinf(self, a):
        return self.torch.isinf(a)

    def abs(self, a):
        return self.torch.abs(a)

    def amax(self, a, axis):
        return self.torch.amax(a, dim=axis)

    def concatenate(self, arrays, axis):
        return self.torch.cat(arrays, dim=axis)

    def zeros_like(self, a):
        return self.torch.zeros_like(a)

    def astype(self, a, dtype):
        return a.to(dtype)

    def bits(self, a):
        return a.view(self.torch.int32)


class _NumpyLikeNamespace:
    def __init__(self, module):
        self.m = module
        self.float32, self.int32 = module.float32, module.int32

    def asarray(self, value, dtype, like):
        if self.m.__name__ == "cupy":
            with self.m.cuda.Device(like.device):
                return self.m.asarray(value, dtype=dtype)
        if self.m.__name__ == "jax.numpy":
            import jax

            arr = self.m.asarray(value, dtype=dtype)
            devices = getattr(like, "devices", None)
            if devices is not None and not isinstance(like, jax.core.Tracer):
                arr = jax.device_put(arr, next(iter(like.devices())))
            return arr
        return self.m.asarray(value, dtype=dtype)

    def __getattr__(self, name):
        if name == "div_rn" and self.m.__name__ == "jax.numpy":
            from .jax.numerics import div_rn

            return div_rn
        return getattr(self.m, name)

    def amax(self, a, axis):
        return self.m.max(a, axis=axis)

    def astype(self, a, dtype):
        return a.astype(dtype)

    def bits(self, a):
        if self.m.__name__ == "jax.numpy":
            import jax

            return jax.lax.bitcast_convert_type(a, self.m.int32)
        return a.view(self.m.int32)


def namespace(a):
    """The array namespace that operates on ``a``."""
    fw = framework_of(a)
    if fw == "torch":
        return _TorchNamespace()
    if fw == "jax":
        import jax.numpy as jnp

        return _NumpyLikeNamespace(jnp)
    if fw == "cupy":
        import cupy

        return _NumpyLikeNamespace(cupy)
    return _NumpyLikeNamespace(np)


# --------------------------------------------------------------------------------------------
# The rule.
# --------------------------------------------------------------------------------------------
def compute_scale(xp, amax, fmt_max, margin_factor):
    """``(fmt_max / amax) / margin_factor`` in fp32, FLT_MAX where that is inf. ``amax`` > 0."""
    div = _divide(xp)
    with np.errstate(over="ignore", divide="ignore"):
        s = div(div(fmt_max, amax), margin_factor)
    return xp.where(xp.isinf(s), xp.asarray(FLT_MAX, xp.float32, s), s)


def _divide(xp):
    """The namespace's IEEE float32 division: its ``div_rn`` where its ``/`` is not IEEE (jax:
    XLA:GPU's ``div.full.f32`` is up to 2 ulp off, XLA:CPU flushes denormal quotients)."""
    return getattr(xp, "div_rn", None) or (lambda a, b: a / b)


def update_rule(xp, amax_history, scale, overflows, updates, fmt_max, margin_factor, algo):
    """One step of delayed scaling for every tensor (column) at once; returns the new arrays.

    Per column, with ``a = amax_history[0]`` (the staged amax of this step):
      a NaN/inf -> overflow: scale kept, overflows += 1, slot cleared, no roll;
      a == 0    -> (+0 or -0) not quantized this step: nothing changes;
      otherwise -> amax = max |history| or |a|; scale = fmt_max / amax / 2**margin (FLT_MAX if
                   inf); the column rolls by -1 (a moves to the last row); slot cleared.
    scale_inv = 1 / scale always. Returns (amax_history, scale, scale_inv, overflows, updates).
    """
    a = amax_history[0]
    finite = xp.isfinite(a)
    # "|a| > 0" is "any bit but the sign set" (-0 is 0: not quantized): compared as bits, so
    # that a backend which treats denormals as zero (XLA on CPU) still sees a denormal amax.
    seen = finite & ((xp.bits(a) & 0x7FFFFFFF) != 0)
    amax = xp.amax(xp.abs(amax_history), axis=0) if algo == "max" else xp.abs(a)
    one = xp.asarray(1.0, xp.float32, a)
    s = compute_scale(xp, xp.where(seen, amax, one), fmt_max, margin_factor)
    new_scale = xp.where(seen, s, scale)
    past = amax_history[1:]
    if amax_history.shape[0] > 1:
        rolled = xp.concatenate([amax_history[2:], a[None]], axis=0)
        past = xp.where(seen[None], rolled, past)
    new_history = xp.concatenate([xp.zeros_like(a)[None], past], axis=0)
    new_scale_inv = _divide(xp)(one, new_scale)
    new_overflows = overflows + xp.astype(~finite, xp.int32)
    new_updates = updates + xp.astype(seen, xp.int32)
    return new_history, new_scale, new_scale_inv, new_overflows, new_updates


# --------------------------------------------------------------------------------------------
# The state.
# --------------------------------------------------------------------------------------------
def _dtype_name(a) -> str:
    return str(a.dtype).replace("torch.", "")


@dataclass
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

    All arrays belong to one framework and one device. A fresh state (:meth:`create`) has a
    zero history, scale 1, scale_inv 1 and zero counters.
    """

    amax_history: Any
    scale: Any
    scale_inv: Any
    overflows: Any
    updates: Any
    grad: tuple = ()

    def __post_init__(self):
        self.grad = tuple(bool(g) for g in self.grad)
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
        recipe : DelayedScaling
            Gives the history length.
        like : array, optional
            The state is allocated with this array's framework and device (numpy by default).
        """
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"recipe must be a fusedfp8.DelayedScaling; got {type(recipe).__name__}")
        if isinstance(grad, (int, np.integer)) and not isinstance(grad, bool):
            if grad < 1:
                raise ValueError(f"grad: the number of tensors must be >= 1; got {grad}")
            grad = (False,) * int(grad)
        grad = tuple(bool(g) for g in grad)
        if not grad:
            raise ValueError("grad: a state needs at least one tensor; got an empty sequence")
        n, L = len(grad), recipe.amax_history_len
        xp = namespace(like if like is not None else np.zeros(0))
        like = like if like is not None else np.zeros(0)
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
        if recipe is not None and not isinstance(recipe, DelayedScaling):
            raise TypeError(f"recipe must be a fusedfp8.DelayedScaling; got {type(recipe).__name__}")
        n = len(self.grad)
        expect = {"amax_history": (2, "float32"), "scale": (1, "float32"), "scale_inv": (1, "float32"),
                  "overflows": (1, "int32"), "updates": (1, "int32")}
        fw = None
        for name, (ndim, dtype) in expect.items():
            a = getattr(self, name)
            if not hasattr(a, "shape") or not hasattr(a, "dtype"):
                raise TypeError(f"ScalingState.{name} must be an array; got {type(a).__name__}")
            this_fw = framework_of(a)
            if fw is None:
                fw = this_fw
            elif this_fw != fw:
                raise TypeError(f"ScalingState.{name} is a {this_fw} array but amax_history is a {fw} array; "
                                "all state arrays must belong to one framework")
            if len(a.shape) != ndim:
                raise ValueError(f"ScalingState.{name} must be {ndim}-D; got shape {tuple(a.shape)}")
            if _dtype_name(a) != dtype:
                raise TypeError(f"ScalingState.{name} must be {dtype}; got {_dtype_name(a)}")
            cols = a.shape[-1]
            if n and cols != n:
                raise ValueError(f"ScalingState.{name} has {cols} tensors (last dim) but grad has {n}")
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
        i = self._check_index(index)
        self.validate(recipe)
        return recipe.format_for(self.grad[i])

    def _check_index(self, index) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"index must be an int; got {type(index).__name__}")
        if not 0 <= index < len(self.grad):
            raise IndexError(f"index must be in [0, {len(self.grad)}); got {index}")
        return int(index)

    def host_flags(self) -> tuple[np.ndarray, np.ndarray]:
        """Host-side (fresh, pending) flags of the first-step mirror; see :class:`Slot`."""
        if "_host_fresh" not in self.__dict__:
            self.__dict__["_host_fresh"] = np.ones(len(self.grad), bool)
            self.__dict__["_host_pending"] = np.zeros(len(self.grad), bool)
        return self.__dict__["_host_fresh"], self.__dict__["_host_pending"]

    def mark_updated(self) -> None:
        """After an update: tensors quantized since the last one are past their first step."""
        fresh, pending = self.host_flags()
        fresh[pending] = False
        pending[:] = False

    def slot(self, index: int, recipe: DelayedScaling) -> "Slot":
        """The :class:`Slot` of tensor ``index`` (see :func:`slot`)."""
        return slot(self, index, recipe)

    def replace(self, **arrays) -> "ScalingState":
        return dataclasses.replace(self, **arrays)

    def copy(self) -> "ScalingState":
        def cp(a):
            return a.clone() if framework_of(a) == "torch" else a.copy()

        return self.replace(**{f: cp(a) for f, a in self.arrays().items()})

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
        if recipe is not None:
            self.validate(recipe)
        return _logging.format_table(_logging.state_rows(self, recipe, names))


def apply_update(state: ScalingState, recipe: DelayedScaling) -> ScalingState:
    """The update rule on ``state`` through its own array namespace (no custom kernel).

    Mutable arrays (numpy, torch, cupy) are updated in place and the same state is returned;
    jax arrays are immutable, so a new state is returned. Callers always use the return value.
    """
    state.validate(recipe)
    for name in STATE_FIELDS:  # refuse before computing, so that no array is half written
        a = getattr(state, name)
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"ScalingState.{name} is a read-only numpy array; the update writes the state in place")
    xp = namespace(state.amax_history)
    fmt_max = xp.asarray(state.fmt_max(recipe), xp.float32, state.amax_history)
    margin = xp.asarray(recipe.margin_factor, xp.float32, state.amax_history)
    new = update_rule(xp, state.amax_history, state.scale, state.overflows, state.updates,
                      fmt_max, margin, recipe.amax_compute_algo)
    if framework_of(state.amax_history) == "jax":
        return state.replace(**dict(zip(STATE_FIELDS, new)))
    for name, value in zip(STATE_FIELDS, new):
        getattr(state, name)[...] = value
    return state


class Slot(NamedTuple):
    """One tensor's view into a state: what a state-aware quantization reads and writes.

    For numpy/torch/cupy states the arrays are 1-element views sharing the state's memory.
    ``host_fresh`` / ``host_pending`` are 1-element views of host-side numpy flags kept on the
    state object: an eager caller skips the first-step pre-pass once the host knows the tensor
    has been through an update (the device flag ``updates`` still decides on the device).
    """

    scale: Any         # (1,) float32
    scale_inv: Any     # (1,) float32, written when the first step uses current scaling
    amax: Any          # (1,) float32, row 0 of the history: max-accumulated
    updates: Any       # (1,) int32, read: 0 means first step
    fmt: Format
    margin_factor: float
    current_first: bool  # recipe.first_step == 'current'
    host_fresh: np.ndarray    # (1,) bool view: may still be on its first step
    host_pending: np.ndarray  # (1,) bool view: quantized since the last update


def slot(state: ScalingState, index: int, recipe: DelayedScaling) -> Slot:
    """The :class:`Slot` of tensor ``index`` of ``state`` under ``recipe``."""
    i = state._check_index(index)
    state.validate(recipe)
    flags = state.host_flags()
    return Slot(state.scale[i:i + 1], state.scale_inv[i:i + 1], state.amax_history[0, i:i + 1],
                state.updates[i:i + 1], recipe.format_for(state.grad[i]), recipe.margin_factor,
                recipe.first_step == "current", flags[0][i:i + 1], flags[1][i:i + 1])
