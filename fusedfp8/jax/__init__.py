"""JAX integration: the fused kernels inside ``jax.jit`` (on CUDA through XLA callbacks on
XLA's buffers and stream, elsewhere exact jax.numpy), differentiable FP8 building blocks, and
flax modules.

::

    import fusedfp8
    from fusedfp8.jax.flax import Fp8DotGeneral, Fp8MLP

    layer = flax.linen.Dense(1024, dot_general_cls=Fp8DotGeneral)   # a drop-in, state in
    # flax's '_overwrite_with_gradient' collection: TrainState.apply_gradients updates it

The face: ``update_scales`` (the contract of :func:`fusedfp8.update_scales`, traceable, with an
optional mesh ``axis_name``), ``sync_staged``, ``fp8_dot`` and ``fp8_mlp`` (FP8 GEMMs with
delayed scaling, ``custom_vjp``; also under block scaling: ``block_dot``, ``block_mlp``),
``quantize_weight`` (their weight cache for gradient
accumulation), ``quantize_ste`` and ``IMPLS``. Submodules: ``primitives``
(the traceable quantize / gelu_quantize / dgelu_quantize / dequantize, state in, state out, on
the backends of ``jnp_backend`` and ``cuda_backend``),
``meta`` (the float32 form of a state that the flax modules carry), ``block`` (block scaling:
``block_quantize``, traceable, no state), ``flax`` (imported on demand: it needs flax).

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
    for name, value in zip(_FIELDS, arrays):
        object.__setattr__(obj, name, value)
    object.__setattr__(obj, "grad", grad)
    object.__setattr__(obj, "on_update", None)
    return obj


try:
    _jax.tree_util.register_pytree_node(_ScalingState, _flatten, _unflatten)
except ValueError:  # registered already (a reload)
    pass

from .functional import block_dot, block_mlp, fp8_dot, fp8_mlp, quantize_ste, quantize_weight  # noqa: E402
from .primitives import IMPLS, sync_staged, update_scales  # noqa: E402

__all__ = ["update_scales", "sync_staged", "fp8_dot", "block_dot", "fp8_mlp", "block_mlp", "quantize_weight", "quantize_ste",
           "IMPLS"]
