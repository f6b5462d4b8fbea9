"""``Fp8Linear`` (a drop-in for ``nn.Linear``): its state, the missed-update check and the
forward. ``Fp8MLP`` (LayerNorm -> Linear -> gelu -> Linear with the fused activation kernels,
:mod:`fusedfp8.pytorch.mlp`) holds two of them, so what follows holds for it as well.

State. Each :class:`Fp8Linear` owns the delayed-scaling state of its three tensors
``[input, weight, output gradient]`` (``grad = (False, False, True)``) as registered buffers
``amax_history`` (L, 3), ``scale``, ``scale_inv`` (3,) float32 and ``overflows``, ``updates``
(3,) int32, so ``state_dict()`` / ``load_state_dict()`` round-trip it bit for bit and ``.to()``
moves it (a dtype conversion such as ``.bfloat16()`` leaves it float32). ``module.fp8_state``
wraps the buffers in a :class:`fusedfp8.ScalingState` view.

One update per optimizer step. :func:`fusedfp8.pytorch.update_model_scales` turns the staged amaxes
into new scales for every FP8 module of a model in one launch (see ``scaling.py``). Forgetting
it is detected: each module watches, from a hook that runs when its weight's gradient has been
accumulated, whether its weight was modified in place (an optimizer step: the weight's version
counter moved; after a fused optimizer's step, which leaves it alone, torch's optimizer step
hook moves it, see ``weights.py``) since its previous backward without an update in between; it
then raises :class:`MissedScaleUpdateError` (``missed_update='raise'``, the default), warns with
:class:`MissedScaleUpdateWarning` (``'warn'``) or stays silent (``'ignore'``). Gradient
accumulation (several backwards, one step) is not a missed update. The hook is Python run by
the autograd engine, so it works in eager mode and under torch.compile (whose compiled
backward still accumulates into ``.grad`` through the engine); it cannot see inside a CUDA
graph replay (nothing of Python runs there: the capture and the eager warm-up steps are
checked) nor a module whose weight is frozen. A missed update is reported at the backward of
the step after the one that missed it.

Parametrized weights (``torch.nn.utils.parametrize``: ``weight_norm``, ``orthogonal``, a custom
``register_parametrization``) and weights computed elsewhere (``torch.func.functional_call``):
the forward quantizes the weight it gets (the gradient flows back through the parametrization),
with no FP8 weight cache (the weight is a new tensor at every access), and the missed-update
check watches the weight's leaves: the parametrization's parameters.

Inference mode. A forward under ``torch.inference_mode()`` is an evaluation forward as under
``torch.no_grad()``: it stages the amaxes of its input and weight (max-accumulated into row 0,
which the next update takes in), writes the scale of a tensor on its first step (from the
staged amax, as every forward does) and nothing else of the state. The FP8 weight it caches is
made outside inference mode, so that training forwards can use it (and save it for their
backward).

First step. With ``first_step='current'`` every tensor decides on the device, from its own
``updates`` entry, whether it is on its first step (then it is quantized with the scale of its
own current amax): a tensor whose first amax was 0 (a zero-initialised weight) or non-finite
stays on its first step until an update sees a real amax. Forward passes also stage amaxes in
eval mode and under ``torch.no_grad()``.

Current scaling. With a :class:`fusedfp8.CurrentScaling` recipe every step is a first step (the
``updates`` stay 0, the history has 2 rows: the staged and the last amax); the update, still
once per optimizer step, only closes the step (overflows counted, the last amax kept, the
staging row cleared), so the missed-update check applies as well: without it the staged amax
of the next step would start from this one's.

Current scaling across ranks. With ``amax_group`` (a torch.distributed ProcessGroup; CurrentScaling
only) every quantization of an activation, a weight or a gradient takes the amax of the tensor
over all ranks of the group: its local amax (an amax-only pass), ONE ``all_reduce(MAX)`` per
tensor group (a GEMM's input and weight together; each gradient alone), then the cast with the
scale of the global amax (:func:`fusedfp8.pytorch.autograd.reduce_current`). Every rank then
holds bitwise the same scales and casts its rows as one process would cast the concatenated
batch. The collective sits on the critical path of every GEMM (a scale cannot be known before
the amax): 2 per Fp8Linear and 4 per Fp8MLP training step (see docs/distributed.md).
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn

from ..recipe import BlockScaling, CurrentScaling, DelayedScaling
from ..state import STATE_FIELDS, ScalingState
from ..types import check_recipe
from . import autograd as F8
from . import gemm as G
from . import weights as W
from .module_checks import (MISSED_UPDATE_MODES, _check_input, _check_state_writable, _load_strict, _StrictLoad,
                            check_amax_group)

__all__ = ["Fp8Linear", "MissedScaleUpdateError", "MissedScaleUpdateWarning"]

GRAD = (False, False, True)  # tensors of an Fp8Linear's state: input, weight, output gradient




class MissedScaleUpdateError(RuntimeError):
    """An FP8 module went through an optimizer step without ``update_scales``."""


class MissedScaleUpdateWarning(UserWarning):
    """As :class:`MissedScaleUpdateError`, with ``missed_update='warn'``."""


class _UpdateHook:
    """``ScalingState.on_update`` of an Fp8Linear's ``fp8_state`` (holds the module weakly)."""

    def __init__(self, module: "Fp8Linear"):
        self.module = weakref.ref(module)

    def __call__(self) -> None:
        module = self.module()
        if module is not None:
            module._after_update()


class Fp8Linear(_StrictLoad, W.CachedFp8Weight, G.GemmChoice, nn.Linear):
    """``nn.Linear`` with FP8 GEMMs and delayed scaling (a drop-in replacement).

    Forward: the input and the weight are quantized (the forward format of the recipe, E4M3)
    each with its transpose in one fused kernel, their amaxes staged into the state, and an FP8
    GEMM (``gemm``: the shim's cuBLASLt GEMM or ``torch._scaled_mm``) computes ``x @ w.T + b``.
    Backward: the output gradient is quantized (E5M2 under 'hybrid') with its transpose in one
    kernel and both backward GEMMs run in FP8 on the transposed copies the forward produced;
    only FP8 tensors are saved for the backward. The bias gradient is ``grad.sum(0)``.

    On CPU the same module runs the reference numerics: the quantization is bit-exact and the
    GEMMs are float32 products of the exact FP8 values (any shape is accepted there).

    Parameters
    ----------
    in_features, out_features : int
    bias : bool
    recipe : DelayedScaling or CurrentScaling (a BlockScaling builds the stateless
        :class:`~fusedfp8.pytorch.block_layers.Fp8BlockLinear` instead)
    device, dtype : as for ``nn.Linear`` (the parameters; the state is always float32/int32).
    missed_update : {'raise', 'warn', 'ignore'}
        What happens when the module goes through an optimizer step without
        :func:`fusedfp8.pytorch.update_model_scales` (see the module docstring).
    gemm : {'auto', 'cublaslt', 'scaled_mm'}
        The FP8 GEMM on CUDA (:mod:`fusedfp8.pytorch.gemm`; also a settable attribute): the shim's
        ``fusedfp8::fp8_gemm_lt``, ``torch._scaled_mm``, or 'auto' (the first where the shim can be
        had). They differ only by float32 accumulation order. The CPU emulates either.
    amax_group : torch.distributed ProcessGroup or None
        CurrentScaling only: the ranks over which every amax is MAX-reduced before its cast (see
        the module docstring; 1 all_reduce in the forward, 1 in the backward). Every rank of the
        group must run the module the same number of times. Also a settable attribute.

    Input: (..., in_features), float32 / float16 / bfloat16; output (..., out_features) in the
    input's dtype; weight and bias of any of those dtypes (e.g. float32 master weights).

    Raises
    ------
    TypeError
        At construction, on a recipe that is not a DelayedScaling or a CurrentScaling or an amax_group that
        is not a ProcessGroup; in forward
        (before anything runs or is written), on a non-float input or weight.
    ValueError
        At construction, on a bad ``missed_update`` or ``gemm``, or an ``amax_group`` with DelayedScaling; in forward, on a wrong feature
        count, input and weight on different devices, or (CUDA only) a GEMM dimension that is not a multiple
        of 16: in_features, out_features, and the number of tokens when the weight gradient is
        needed (padding is left to the caller: it would copy the input). On load, on a state
        whose history length differs from the recipe's, or (CurrentScaling) with completed updates.
    RuntimeError
        In a CUDA forward (before any write), with ``gemm='cublaslt'`` where the shim cannot be had.
    MissedScaleUpdateError
        In backward, see ``missed_update``.
    """

    def __new__(cls, *args, **kwargs):
        """``Fp8Linear(..., recipe=BlockScaling())`` builds the block-scaled module,
        :class:`fusedfp8.pytorch.block_layers.Fp8BlockLinear` (no state: nothing of this class applies)."""
        if cls is Fp8Linear and isinstance(kwargs.get("recipe", args[3] if len(args) > 3 else None), BlockScaling):
            from .block_layers import Fp8BlockLinear
            return Fp8BlockLinear(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: DelayedScaling = DelayedScaling(), device=None, dtype=None, *,
                 missed_update: str = "raise", gemm: str = "auto", amax_group=None):
        if isinstance(check_recipe(recipe, block=True), BlockScaling):  # (a subclass: __new__ did not swap it)
            check_recipe(recipe)  # refused by name: this class keeps per-tensor state
        if missed_update not in MISSED_UPDATE_MODES:
            raise ValueError(f"missed_update must be one of {MISSED_UPDATE_MODES}; got {missed_update!r}")
        G.check_gemm(gemm)
        group_name = check_amax_group(amax_group, recipe)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._amax_group = group_name  # the name: a module stays deep-copyable and picklable
        self.gemm = gemm
        self._recipe = recipe
        self.missed_update = missed_update
        self._cfg = (recipe.format_for(False).name, recipe.format_for(True).name, recipe.margin_factor)
        self._init_state(self.weight.device)
        self._group = None  # the model-level state this module's buffers are views of (convert.py)
        self._link = None  # (views handed out, the model-level arrays, this module's first column)
        self._wcache = W.WeightCache()  # the FP8 weight between its changes (gradient accumulation)
        self._watch.see(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: DelayedScaling = DelayedScaling(), *,
                    missed_update: str = "raise", gemm: str = "auto", amax_group=None) -> "Fp8Linear":
        """An Fp8Linear that takes over ``linear``'s Parameter objects (not copies: an optimizer
        built before the conversion keeps working) with a fresh state on their device (under a
        BlockScaling recipe the stateless :class:`~fusedfp8.pytorch.block_layers.Fp8BlockLinear`)."""
        if cls is Fp8Linear and isinstance(recipe, BlockScaling):
            from .block_layers import Fp8BlockLinear
            return Fp8BlockLinear.from_linear(linear, recipe, missed_update=missed_update, gemm=gemm,
                                              amax_group=amax_group)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear; got {type(linear).__name__}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                      dtype=linear.weight.dtype, missed_update=missed_update, gemm=gemm, amax_group=amax_group)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_state(linear.weight.device)
        new._watch.see(new)
        new.train(linear.training)
        return new

    # -- state ---------------------------------------------------------------------------------
    def _init_state(self, device) -> None:
        fresh = ScalingState.create(GRAD, self._recipe, like=torch.empty(0, device=device))
        for name in STATE_FIELDS:
            self.register_buffer(name, getattr(fresh, name))
        self._watch = W.WeightWatch()  # the weight's leaves, hooked for the missed-update check

    @property
    def recipe(self) -> DelayedScaling | CurrentScaling:
        return self._recipe

    @property
    def amax_group(self):
        """The ProcessGroup of current scaling across ranks, or None (see the class docstring)."""
        if self._amax_group is None:
            return None
        import torch.distributed as dist
        return dist.distributed_c10d._resolve_process_group(self._amax_group)

    @amax_group.setter
    def amax_group(self, group) -> None:
        self._amax_group = check_amax_group(group, self._recipe)

    @property
    def fp8_state(self) -> ScalingState:
        """The buffers as a :class:`fusedfp8.ScalingState` (views: writes go to the module; an
        update through ``fusedfp8.update_scales`` counts as this module's update)."""
        return ScalingState(*(getattr(self, name) for name in STATE_FIELDS), grad=GRAD,
                            on_update=_UpdateHook(self))

    def _state(self) -> tuple:
        """(amax_history, scale, scale_inv, updates, column of tensor 0) for the kernels.

        Linked (see convert.py), the kernels get the model-level arrays and this module's column
        in them, not the module's views: views of one base passed as separate inputs of a
        compiled graph were written back into each other's columns by inductor (torch 2.11,
        H200: wrong scales and NaN gradients), while one base tensor mutated by several ops is
        ordinary input mutation."""
        link = self._link
        if link is not None and self._group is not None and all(
                self._buffers[k] is v for k, v in link[0].items()):
            return (*link[1], link[2])
        return self.amax_history, self.scale, self.scale_inv, self.updates, 0

    def _kernel_cfg(self) -> tuple:
        return (*self._cfg, self._recipe.first_step == "current")

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.cuda()`` move the state; a dtype conversion leaves it float32/int32."""
        before = {name: self._buffers[name] for name in STATE_FIELDS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        self._watch.see(self, rebase=True)  # a move is not an optimizer step
        self._wcache.clear()
        return self

    def _check_loaded_state(self, state_dict, prefix: str) -> None:
        """Refuse, before anything is copied, a state dict whose FP8 state cannot be this module's
        (and, in a strict load called on the FP8 module itself, one that has no FP8 state)."""
        key = prefix + "amax_history"
        hist = state_dict.get(key)
        want = (self._recipe.amax_history_len, len(GRAD))
        if hist is not None and tuple(hist.shape) != want:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: '{key}' has shape {tuple(hist.shape)} but this module's "
                f"recipe has amax_history_len={want[0]}, so the state must be {want}; build the module with "
                f"DelayedScaling(amax_history_len={hist.shape[0]}) to load this state")
        updates = state_dict.get(prefix + "updates")
        if self._recipe.current and updates is not None and bool((updates != 0).any()):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: '{prefix}updates' is {updates.tolist()}, but under "
                f"CurrentScaling every step is a first step (updates all 0); this state was saved under "
                f"DelayedScaling: build the module with that recipe to load it")
        missing = [prefix + name for name in STATE_FIELDS if prefix + name not in state_dict]
        if missing and _load_strict():
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state dict has no FP8 state {missing} (one of a plain "
                "nn.Linear?); nothing was loaded. Pass strict=False to load the weights and keep the current FP8 "
                "state")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._check_loaded_state(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._watch.pending = False
        self._wcache.clear()

    def __getstate__(self):
        state = super().__getstate__()
        state["_group"] = None  # copies and pickles get their own state; update_scales links them again
        state["_link"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        for name in STATE_FIELDS:  # a linked module's buffers are column views of its group's arrays;
            buf = self._buffers.get(name)  # the copy is unlinked, so each becomes a tensor of its own
            if buf is not None and not buf.is_contiguous():  # (the kernels take contiguous state only)
                self._buffers[name] = buf.contiguous()
        self.__dict__.setdefault("_amax_group", None)  # pickled before amax_group existed
        if "_watch" not in self.__dict__:  # pickled before the watch and this cache existed
            self._watch = W.WeightWatch()
            self._watch.pending = self.__dict__.pop("_pending", False)
            self.__dict__.pop("_pending_version", None)
            self._wcache = W.fresh_cache(self._wcache.enabled)
        self._watch.see(self, rebase=True)  # a copy's weight is a new tensor: its version counter starts
        # over, and a copy is not an optimizer step

    # -- missed-update detection ---------------------------------------------------------------
    def _after_backward(self, leaf: torch.Tensor) -> None:
        """A backward accumulated the gradient of ``leaf`` (one of the weight's leaves)."""
        watch = self._watch
        now = watch.at_backward(leaf)
        if now is None:
            return
        if watch.pending and now != watch.signature and self.missed_update != "ignore":
            msg = (f"{type(self).__name__}({self.in_features}, {self.out_features}): its weight was updated (an "
                   "optimizer step) since its previous backward, but fusedfp8.pytorch.update_model_scales(model) was not "
                   "called in between, so its FP8 scales did not advance. Call update_model_scales(model) once per "
                   "optimizer step (after optimizer.step()); missed_update='warn' or 'ignore' changes this check.")
            if self.missed_update == "raise":
                raise MissedScaleUpdateError(msg)
            warnings.warn(msg, MissedScaleUpdateWarning, stacklevel=2)
        watch.pending, watch.signature = True, now

    def _after_update(self) -> None:
        """Called by every update of this module's state: the backward since the last update is
        accounted for; the scales moved, so the cached FP8 weight is stale."""
        self._watch.pending = False
        self._wcache.clear()

    # -- forward -------------------------------------------------------------------------------
    def _need_grads(self, x: torch.Tensor, w: torch.Tensor) -> tuple[bool, bool]:
        enabled = torch.is_grad_enabled()
        return enabled and x.requires_grad, enabled and w.requires_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = type(self).__name__
        w = self.weight  # (once: a parametrized weight is computed at every access)
        _check_input(layer, x, self.in_features, w)
        _check_state_writable(layer, self)
        need_dgrad, need_wgrad = self._need_grads(x, w)
        if not torch.compiler.is_compiling():
            self._watch.see(self, w)
        return F8.linear(x, w, self.bias, self._state(), self._kernel_cfg(), need_dgrad, need_wgrad,
                         self._wcache, self._gemm_backend(x), self._amax_group)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self._recipe}, gemm={self.gemm!r}"
