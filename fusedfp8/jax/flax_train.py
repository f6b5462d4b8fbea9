"""The FP8 state across flax train steps: :class:`TrainState` (flax's, keeping the state of a
module that got no gradient), :func:`keep_unwritten` (the same for a hand-written step) and
:func:`accumulate_gradients` (micro-batches whose new states combine by max). Each FP8 module's
state is a mapping in the ``'_overwrite_with_gradient'`` collection, recognised by its
``writes`` marker (:mod:`fusedfp8.jax.meta`); reached as ``fusedfp8.jax.flax.<name>``."""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax.training import train_state

from .meta import META_FIELDS as STATE_VARIABLES
from .meta import combine, per_column

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def _merge_states(old, new, merge):
    """``new`` with every FP8 module's state (a mapping holding ``writes`` and ``amax_history``,
    :mod:`fusedfp8.jax.meta`) replaced by ``merge(old's, new's)``; any nesting of mappings."""
    if isinstance(new, Mapping):
        if "writes" in new and "amax_history" in new:
            items = merge(old, new)
        else:
            items = {k: _merge_states(old[k], v, merge) for k, v in new.items()}
        return type(new)(items) if isinstance(new, dict) else new.copy(items)
    return new


def _keep(old, new) -> dict:
    keep = jnp.asarray(new["writes"]) == 0
    return {k: jnp.where(per_column(keep, k), old[k], v) for k, v in new.items()}


def keep_unwritten(old, new):
    """The ``'_overwrite_with_gradient'`` collection to store after a step: ``new`` (the step's
    gradients of that collection: every FP8 module's new state), except for the modules whose
    gradient is zero (their output got no cotangent this step: stop_gradient, an unused head, an
    untaken branch), which keep their ``old`` state unchanged. Any nesting of mappings; a module's
    state is recognised by its ``writes`` marker (:mod:`fusedfp8.jax.meta`)."""
    return _merge_states(old, new, _keep)


def _combine(total, new) -> dict:
    merged = combine(tuple(new[k] for k in STATE_VARIABLES), tuple(total[k] for k in STATE_VARIABLES))
    return dict(zip(STATE_VARIABLES, merged))


def accumulate_gradients(total, grads, weight=1.0):
    """The gradients of one more micro-batch added to ``total`` (gradient accumulation):
    ``total + weight * grads`` in every collection but ``'_overwrite_with_gradient'``, whose
    "gradient" is each FP8 module's new state: there the states are combined as one step's uses
    of a module are (:func:`fusedfp8.jax.meta.combine`: the staged amaxes max-accumulated, the
    rest from ``grads``; a module that got no gradient in a micro-batch adds nothing). Summing
    the states instead (``jax.tree.map(jnp.add, ...)``, or averaging them) would make every FP8
    module start over from a fresh state at the next step (a sum) or stage the mean amax (an
    average).

    Start from ``jax.tree.map(jnp.zeros_like, grads_or_params)``; pass ``weight=1 / k`` for the
    mean over k micro-batches. Works inside ``jax.jit`` and ``lax.scan``; the result goes to
    :meth:`TrainState.apply_gradients` as one step's gradients."""
    out = {}
    for col, g in grads.items():
        if col == OVERWRITE_WITH_GRADIENT:
            out[col] = _merge_states(total[col], g, _combine)
        else:
            out[col] = jax.tree.map(lambda t, a: t + weight * a, total[col], g)
    return type(grads)(out) if isinstance(grads, dict) else grads.copy(out)



class TrainState(train_state.TrainState):
    """flax's ``TrainState`` whose ``apply_gradients`` keeps the FP8 state of a module that got
    no gradient in the step (:func:`keep_unwritten`) instead of overwriting it with zeros. The
    one change from flax's class; use it wherever the FP8 modules' outputs may go unused or sit
    under ``stop_gradient``. (With flax's own class such a module starts over from a fresh state
    at its next step: never a zero or a doubled one.)"""

    def apply_gradients(self, *, grads, **kwargs):
        new = super().apply_gradients(grads=grads, **kwargs)
        if OVERWRITE_WITH_GRADIENT not in grads:
            return new
        kept = keep_unwritten(self.params[OVERWRITE_WITH_GRADIENT], grads[OVERWRITE_WITH_GRADIENT])
        params = {**new.params, OVERWRITE_WITH_GRADIENT: kept}
        return new.replace(params=params if isinstance(new.params, dict) else type(new.params)(params))
