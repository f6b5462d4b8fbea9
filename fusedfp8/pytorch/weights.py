"""When an FP8 module's weight changed: the FP8 weight cache, the optimizer-step hook, and the
leaves of a weight that the missed-update check watches.

Torch's version counter sees every in-place change made through autograd's view of a tensor
(``copy_`` or ``mul_`` under ``torch.no_grad()``, the for-loop and foreach optimizers,
``load_state_dict``) but not these, which a training loop takes without writing ``.data`` itself:

- the fused optimizers (Adam, AdamW, SGD with ``fused=True``): their kernels write the
  parameters and leave the counter where it was;
- an assignment to ``.data`` (``torch.nn.utils.vector_to_parameters`` makes one per parameter):
  the tensor then views another storage and keeps its counter;
- writes that bypass autograd inside an optimizer step or after one, before the next forward (a
  custom optimizer writing ``p.data``, the broadcasts of ``ZeroRedundancyOptimizer``, the
  averaging of ``PostLocalSGDOptimizer`` after its inner optimizer's step).

Three mechanisms cover them:

1. After every step of every ``torch.optim.Optimizer`` (fused or not, subclasses included:
   torch's global step post-hook), the version counter of each FP8 weight leaf that the
   optimizer holds moves, as a foreach step moves it; the cache then misses at the next forward,
   which reads the weight as every write until then left it, and the missed-update check sees
   the step. Parameters of other layers are left alone.
2. The cache key holds the weight's storage (its identity pinned by a weak reference, so that
   the address cannot come back for another storage while the entry lives) and its layout: an
   assigned ``.data`` misses.
3. Only ``nn.Parameter`` weights are cached: a weight computed at each access (a
   parametrization, ``torch.func.functional_call``) is quantized at every forward.

What stays invisible is a write that bypasses the version counter outside an optimizer step:
an in-place op on ``weight.data``, a collective on a parameter, a write through another tensor
that shares the weight's storage (the vector given to ``vector_to_parameters``), a CUDA graph
replay seen from eager code (see :class:`WeightCache`). After one, call the module's
``clear_fp8_weight()``.
"""
from __future__ import annotations

import weakref
from itertools import chain

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import csrc as _shim

__all__ = ["WeightCache", "CachedFp8Weight", "WeightWatch", "weight_leaves", "signature", "watch_steps"]

# id -> weakref of every leaf of an FP8 module's weight (the tensors an optimizer steps); an entry
# goes when its tensor dies, which is before the id can be given to another object
_WATCHED: dict = {}


def _forget(key: int, ref: weakref.ref) -> None:
    if _WATCHED.get(key) is ref:
        del _WATCHED[key]


def _watch(leaves) -> None:
    """Have every optimizer step that holds one of ``leaves`` move its version counter."""
    for t in leaves:
        key = id(t)
        ref = _WATCHED.get(key)
        if ref is None or ref() is not t:
            _WATCHED[key] = weakref.ref(t, lambda r, k=key: _forget(k, r))


@torch.compiler.disable
def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """Torch's global optimizer step post-hook: the FP8 weights that ``optimizer`` holds may have
    been written without a version bump (fused kernels, ``.data``), so bump it."""
    if not _WATCHED:
        return
    held = set(map(id, chain.from_iterable(g["params"] for g in optimizer.param_groups)))
    refs = [_WATCHED.get(k) for k in held.intersection(_WATCHED)]  # (get: a collection may run in between)
    stepped = [t for t in (r() for r in refs if r is not None) if t is not None]
    if stepped:
        torch.autograd.graph.increment_version(stepped)


_STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def watch_steps(module: nn.Module) -> None:
    """Have every optimizer step that holds a leaf of ``module.weight`` move its version counter
    (mechanism 1 above) without the missed-update check of :class:`WeightWatch`: for a module
    whose FP8 weight cache is its only reason to watch (block scaling: no update to miss)."""
    _watch(weight_leaves(module))


def weight_leaves(module: nn.Module) -> list[Tensor]:
    """The leaf tensors ``module.weight`` is made of: the parameter itself, or a parametrized
    weight's parameters (its originals and those of its parametrizations); none for a weight
    computed elsewhere (``torch.func.functional_call`` given a non-leaf tensor)."""
    if parametrize.is_parametrized(module, "weight"):
        return list(module.parametrizations["weight"].parameters())
    w = module._parameters.get("weight")
    return [w] if w is not None and w.is_leaf else []


def signature(leaves) -> tuple:
    """What tells whether ``leaves`` (tensors, or None for one that died) changed: each one's
    version counter and storage (an assigned ``.data``); an inference tensor has no counter."""
    return tuple(None if t is None else (-1 if t.is_inference() else t._version, t.untyped_storage()._cdata)
                 for t in leaves)


class _GradHook:
    """Post-accumulate-grad hook on a leaf of an FP8 module's weight: calls the module's
    ``_after_backward(leaf)`` (holds the module weakly)."""

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)

    def __call__(self, leaf: Tensor) -> None:
        module = self.module()
        if module is not None:
            module._after_backward(leaf)


def _fresh_watch(pending: bool) -> "WeightWatch":
    watch = WeightWatch()
    watch.pending = pending
    return watch


class WeightWatch:
    """What the missed-update check of one FP8 module remembers: the weight a forward used last
    and its leaves (hooked: their gradients call the module back; watched: optimizer steps move
    their counters), whether a backward ran since the last update (``pending``) and the leaves'
    :func:`signature` then. Copies keep ``pending`` and nothing else: the copy's weight is
    another tensor, seen again by its next forward or by :meth:`see` in its ``__setstate__``."""

    __slots__ = ("seen", "leaves", "pending", "signature")

    def __init__(self):
        self.seen, self.leaves, self.pending, self.signature = None, (), False, ()

    def __reduce__(self):
        return _fresh_watch, (self.pending,)

    def see(self, module: nn.Module, w: Tensor | None = None, rebase: bool = False) -> None:
        """Hook the leaves of the weight ``w`` that a forward of ``module`` uses (the parameter
        itself, or a parametrized weight's parameters; ``w`` None: the module's parameter), again
        after a copy, a new Parameter or a new parametrization. One comparison while the weight
        is the one seen last. ``rebase``: the leaves as they are now are no optimizer step (a
        move, a copy), also where they are the same tensors."""
        if w is None:
            w = module._parameters.get("weight")
        if self.seen is not None and w is not None and self.seen() is w and not rebase:
            return
        leaves = weight_leaves(module)
        if len(self.leaves) != len(leaves) or any(r() is not t for r, t in zip(self.leaves, leaves)):
            for leaf in leaves:
                hooks = leaf._post_accumulate_grad_hooks
                if leaf.requires_grad and (hooks is None or not any(
                        isinstance(h, _GradHook) and h.module() is module for h in hooks.values())):
                    leaf.register_post_accumulate_grad_hook(_GradHook(module))
            _watch(leaves)
            self.leaves = tuple(map(weakref.ref, leaves))
            rebase = True  # other leaves: how they came to be is no optimizer step
        if rebase:
            self.signature = signature(leaves)
        self.seen = None if w is None else weakref.ref(w)

    def at_backward(self, leaf: Tensor) -> tuple | None:
        """The :func:`signature` of the leaves at a backward through ``leaf``, or None where
        ``leaf`` is not one of them (a former weight of the module)."""
        leaves = [r() for r in self.leaves]
        return signature(leaves) if any(t is leaf for t in leaves) else None


def _capture(w: Tensor):
    """0 outside a CUDA graph capture; in one, the id of the capture in progress on the current
    stream of ``w``'s device (nonzero, unique over the process), or None where the torch shim
    cannot say."""
    if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return 0
    lib, _ = _shim.library("torch")
    get = getattr(lib, "capture_id", None)  # (an older build of the shim has none)
    capture = get(torch.cuda.current_stream(w.device).cuda_stream) if get is not None else None
    return capture or None


class CachedFp8Weight:
    """The FP8 weight cache's switches of a module holding a :class:`WeightCache` as ``_wcache``
    (Fp8Linear, Fp8BlockLinear)."""

    @property
    def cache_fp8_weight(self) -> bool:
        """Keep the FP8 weight (and its transpose) between forwards until the weight (or, under a
        per-tensor recipe, its scale) changes (default True): with gradient accumulation the weight
        is quantized once per optimizer step, not once per micro-batch; costs the FP8 copy's memory
        (2 bytes per parameter with the transpose). Every optimizer step, in-place change seen by
        autograd and assignment to ``.data`` is seen (``weights.py``); after an in-place change that
        bypasses autograd outside an optimizer step (``weight.data.mul_(2)``, a collective on the
        weight) call :meth:`clear_fp8_weight`."""
        return self._wcache.enabled

    @cache_fp8_weight.setter
    def cache_fp8_weight(self, on: bool) -> None:
        self._wcache.enabled = bool(on)
        self._wcache.clear()

    def clear_fp8_weight(self) -> None:
        """Drop the cached FP8 weight (the next forward quantizes the weight again)."""
        self._wcache.clear()


def fresh_cache(enabled: bool) -> "WeightCache":
    """An empty cache, on or off."""
    cache = WeightCache()
    cache.enabled = enabled
    return cache


class WeightCache:
    """The FP8 copy of one weight (q, transpose, scale_inv), kept while neither the weight nor its
    scale has changed: with gradient accumulation every micro-batch after the first reuses it
    instead of quantizing and transposing the weight again (one weight quantization per optimizer
    step, as Transformer Engine's ``is_first_microbatch`` but without a flag).

    The key: the weight's version counter (moved by every in-place change autograd sees and, by
    the optimizer-step hook above, by every optimizer step), its storage and layout (an assigned
    ``.data``), and ``epoch``, which every update of the module's scales advances. Only
    ``nn.Parameter`` weights are cached. The amax of the weight is staged by the quantization that
    fills the cache, which is the max over the micro-batches since the weight has not changed.

    Inference mode: an entry made outside it serves forwards inside it; one made inside it is
    quantized outside inference mode (normal tensors), so that it can serve a later training
    forward, which must save it for the backward. A weight or state that is itself an inference
    tensor is not cached.

    In a CUDA graph the key also holds the id of the capture in progress (unique over the process,
    from the driver through the torch shim): a whole accumulation step captured as one graph
    quantizes each weight once (the first micro-batch's quantization is a node of the graph, the
    others read its output on every replay), while a copy filled outside this capture, eagerly or in
    another graph, is never used in it (a replay must quantize the weight it sees). Once a capture
    has quantized the weight, eager forwards no longer use the cache: a replay writes the weight
    (an optimizer step in the graph) with no Python running to say so. Without the shim the cache
    is off during captures. Never used while torch.compile traces. Copies (deepcopy, pickle) get
    an empty cache with the same ``enabled``."""

    __slots__ = ("epoch", "key", "value", "enabled", "storage", "graphed")

    def __init__(self):
        self.epoch, self.key, self.value, self.enabled = 0, None, None, True
        self.storage, self.graphed = None, False

    def clear(self) -> None:
        self.epoch += 1
        self.key = self.value = self.storage = None

    def __reduce__(self):
        return fresh_cache, (self.enabled,)

    def key_of(self, w: Tensor, state: tuple | None, extra: tuple):
        """The key of ``w``'s FP8 copy (quantized through ``state`` = (amax_history, scale,
        scale_inv, updates), or None for block scaling, which has no state; for the call described
        by ``extra``), or None where it must not be cached."""
        if torch.compiler.is_compiling():  # (not used while traced, and nothing written: dynamo would guard
            return None                    # the graph on the written epoch and compile it again next call)
        if not self.enabled or not isinstance(w, nn.Parameter):
            if self.value is not None:
                self.clear()  # (a weight parametrized after it was cached: free the copy)
            return None
        state = state or ()
        if torch.is_inference_mode_enabled() and any(t.is_inference() for t in (w, *state[:3])):
            return None
        capture = _capture(w)
        if capture is None or (capture == 0 and self.graphed):
            return None
        return (w._version, w.untyped_storage()._cdata, w.data_ptr(), w.stride(), w.dtype, w.device,
                tuple(w.shape), *extra, self.epoch, state[1].data_ptr() if state else 0, capture)

    @staticmethod
    def through(cache: "WeightCache | None", key, w: Tensor, make):
        """``make()``'s FP8 copy of ``w``, or the one ``cache`` holds under ``key`` (its
        :meth:`key_of`; None: not cached). A copy made for the cache under inference mode is made
        outside it, so that a later training forward can use (and save) it."""
        if key is None:
            return make()
        if cache.key == key:
            return cache.value
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                out = make()
        else:
            out = make()
        cache.store(key, out, w)
        return out

    def store(self, key: tuple, value: tuple, w: Tensor) -> None:
        self.key, self.value = key, value
        self.storage = StorageWeakRef(w.untyped_storage())  # the key's storage address stays its own
        self.graphed = self.graphed or key[-1] != 0
