"""JAX integration: the fused kernels inside ``jax.jit`` (buffer_callback on CUDA, exact
jax.numpy elsewhere), straight-through ``custom_vjp`` wrappers, an FP8 dot, and flax modules.

::

    import fusedfp8
    import fusedfp8.jax as f8
    from fusedfp8.jax.flax import Fp8DotGeneral, Fp8MLP

    layer = flax.linen.Dense(1024, dot_general_cls=Fp8DotGeneral)   # a drop-in, state in
    # flax's '_overwrite_with_gradient' collection: TrainState.apply_gradients updates it

Modules: ``primitives`` (quantize, gelu_quantize, dgelu_quantize, update_scales, dequantize:
state in, state out), ``functional`` (``quantize_ste``, ``fp8_dot``, ``fp8_mlp``: custom_vjp),
``numerics`` (the reference numerics in jax.numpy), ``flax`` (imported on demand).

Importing this package registers :class:`fusedfp8.ScalingState` as a pytree (its ``grad``
flags are static metadata), so states pass through ``jax.jit`` and friends.
"""
import jax as _jax

from ..state import STATE_FIELDS as _FIELDS
from ..state import ScalingState as _ScalingState


def _flatten(state):
    return tuple(getattr(state, f) for f in _FIELDS), state.grad


def _unflatten(grad, arrays):
    # no __init__: transformations rebuild pytrees with placeholders that validation would refuse
    obj = object.__new__(_ScalingState)
    obj.__dict__.update(dict(zip(_FIELDS, arrays)), grad=grad)
    return obj


try:
    _jax.tree_util.register_pytree_node(_ScalingState, _flatten, _unflatten)
except ValueError:  # registered already (a reload)
    pass

from .functional import fp8_dot, fp8_mlp, quantize_ste  # noqa: E402
from .primitives import (IMPLS, dequantize, dgelu_quantize, gelu_quantize, quantize, sync_staged,  # noqa: E402
                         update_scales)

__all__ = ["quantize", "gelu_quantize", "dgelu_quantize", "update_scales", "sync_staged", "dequantize",
           "quantize_ste", "fp8_dot", "fp8_mlp", "IMPLS"]
