"""The fused kernels as traceable JAX functions, state in and state out.

Every function here works inside ``jax.jit``, ``jax.grad`` (through the ``custom_vjp`` wrappers
of :mod:`fusedfp8.jax.functional`) and ``jax.vmap``, on any backend. The backend is chosen when
XLA lowers the computation (``lax.platform_dependent``): on CUDA the fused kernels run on XLA's
own buffers and stream (:mod:`fusedfp8.jax.cuda_backend` over :mod:`fusedfp8.jax.callbacks`);
everywhere else the same numerics run as ``jax.numpy`` (:mod:`fusedfp8.jax.jnp_backend` over
:mod:`fusedfp8.numerics.jnp`), byte for byte the reference's. This module holds the checks, the
choice of backend per call and the public functions.

``layernorm_quantize`` (LayerNorm fused with the quantization) is :mod:`fusedfp8.jax.layernorm`,
written on the same checks, dispatch and staging (it imports this module, not the reverse).

``impl`` picks the backend explicitly: ``'auto'`` (the default, as above; on CUDA the ``'ffi'``
path where the compiled shim is available, else ``'callback'``:
:func:`fusedfp8.jax.cuda_backend.launch_path` says which and why), ``'jnp'`` (jax.numpy on
every backend), ``'ffi'`` (the kernels through the XLA FFI handler of the compiled launch shim:
no Python when the program runs, recorded into XLA's command buffers) or ``'callback'`` (the kernels launched by a Python ``buffer_callback``, recorded
into XLA's command buffers, which re-run the callback when XLA's buffers move). All CUDA backends
run the same launch plans and give the same bytes.

State. A :class:`fusedfp8.ScalingState` of jax arrays is a pytree here (registered by
``fusedfp8.jax``); functions take one and return the updated one. Quantizing tensor ``index``
max-accumulates its amax into ``amax_history[0, index]`` and, on the tensor's first step with
``first_step='current'`` (decided from ``updates[index] == 0`` on the device), writes the
current scale into ``scale`` / ``scale_inv``. FP8 data comes back as ``jnp.float8_e4m3fn`` /
``float8_e5m2`` (declared as uint8 by the callback, then bitcast: no copy).

vmap. Mapping a primitive over a batch axis quantizes each example on its own, with its own
amax and its own staged state: the jax.numpy path vectorises, the kernel path loops over the
batch (``vmap_method='sequential'``). A batched state must then be reduced by the caller.

Several devices. Inside ``shard_map`` (or ``pmap``), ``update_scales(..., axis_name=...)``
MAX-reduces the staged amaxes (row 0 of the history) over the named mesh axis with one
``lax.pmax`` before the rule, so every device computes the same scales from the same amaxes; a
non-finite amax on any device is an overflow on all of them (:func:`sync_staged`). Between the
quantizations of a step and that update, row 0 holds each device's own amaxes: carry the state
as a per-device (device-varying) value, not as a replicated one. With ``first_step='current'``
a tensor's first scale comes from each device's own amax (no collective in the quantization),
so the devices agree from the first update on; ``first_step='unit'`` makes them agree from the
start. Under :class:`fusedfp8.CurrentScaling` the functional front ends (``fp8_dot``, ``fp8_mlp``)
take ``axis_name`` to the quantizations themselves: each tensor's local amax (:func:`amax`, an
amax-only kernel launch on CUDA), ONE ``lax.pmax`` per tensor group (:func:`sync_current`),
then the cast with the scale of the global amax (:func:`given_scale`). Under plain ``jax.jit`` on
sharded inputs (no named axis) the amax of a sharded tensor is already global: XLA inserts the
reduction itself.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _interop as io
from .. import launch
from ..numerics import jnp as jn
from ..numerics.scaling import close_step
from ..recipe import DelayedScaling
from ..state import STATE_FIELDS, ScalingState
from ..types import FLOAT_INPUTS, Quantized, check_approximate, check_pad_to, check_recipe
from . import callbacks
from .cuda_backend import _amax_kernel, _auto_backend, _meta_update_kernel, _quantize_kernel, _update_kernel
from .jnp_backend import _activation, _meta_update_jnp, _QCfg, _quantize_jnp, _stage_jnp, _update_jnp

__all__ = ["quantize", "gelu_quantize", "dgelu_quantize", "stage_amax", "update_scales", "sync_staged", "dequantize",
           "amax", "sync_current", "given_scale", "IMPLS"]

IMPLS = ("auto", "jnp", "ffi", "callback")
_CUDA_IMPLS = ("ffi", "callback")


def compiled_when_eager(*static_argnums: int):
    """Decorator: ``fn`` runs as one compiled program (``jax.jit``, the ``static_argnums`` as
    static arguments) when none of its arguments is traced, and inline in the caller's trace
    otherwise. Op by op, the jax.numpy numerics dispatch thousands of small XLA programs: flax's
    ``model.init`` of the README's model, not under ``jax.jit``, took 20 s on a 2-core CPU."""

    def wrap(fn):
        jitted = jax.jit(fn, static_argnums=static_argnums)

        @functools.wraps(fn)
        def call(*args):
            traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(args))
            return fn(*args) if traced else jitted(*args)

        return call

    return wrap


# ---- checks ----------------------------------------------------------------------------------
def _check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if impl in _CUDA_IMPLS:
        ok, reason = launch.probe()
        if ok and not callbacks.gpu_devices():
            ok, reason = False, "jax has no CUDA backend (install jax[cuda13])"
        if not ok:
            raise ValueError(f"impl={impl!r} runs the CUDA kernels, which cannot run here: {reason}. Use impl='auto' "
                             "(the kernels on CUDA, jax.numpy elsewhere) or impl='jnp'")
        if impl == "ffi":
            ok, reason = callbacks.ffi_target()
            if not ok:
                raise ValueError(f"impl='ffi' needs the compiled launch shim, which is not available: {reason}. Use "
                                 "impl='callback' (the same kernels through a Python callback) or impl='auto'")
    return impl


def _check_state(state, recipe) -> ScalingState:
    """``state`` with jax arrays (a numpy state, what ScalingState.create makes without ``like=``,
    is converted); TypeError for anything else."""
    if not isinstance(state, ScalingState):
        raise TypeError(f"state must be a fusedfp8.ScalingState (of jax arrays); got {type(state).__name__}")
    check_recipe(recipe)
    state = state.replace(**{f: io.as_jax(getattr(state, f), f"state.{f}") for f in STATE_FIELDS})
    state.validate(recipe)
    return state


def _check_x(x, argname: str, need_2d: bool):
    x = jnp.asarray(x)
    if x.dtype.name not in FLOAT_INPUTS:
        raise TypeError(f"{argname} must be float32, float16 or bfloat16; got {x.dtype}")
    if need_2d and x.ndim < 1:
        raise ValueError(f"{argname}: transpose / dbias need an input of at least 1 dimension; got a scalar")
    return x


def _vma(a) -> frozenset:
    """The mesh axes that ``a`` varies over inside ``shard_map`` (empty outside)."""
    mat = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _as_varying_as(outs, args):
    """``outs`` marked device-varying over every mesh axis that some of ``args`` vary over
    (inside ``shard_map``): a callback's results carry no such type, the jnp branch's do."""
    vma = frozenset().union(*(_vma(a) for a in args))
    if not vma:
        return outs
    return tuple(lax.pcast(o, tuple(sorted(vma - _vma(o))), to="varying")
                 if vma - _vma(o) else o for o in outs)


def _dispatch(impl: str, jnp_fn, kernel_fn, *args):
    """``jnp_fn(*args)`` or ``kernel_fn(backend, *args)`` as ``impl`` says."""
    jnp_fn = jn.shares_one_zero(jnp_fn)  # one hiding zero for the whole jax.numpy branch
    if impl == "jnp":
        return jnp_fn(*args)
    if impl in _CUDA_IMPLS:
        return _as_varying_as(kernel_fn(impl, *args), args)
    return lax.platform_dependent(*args, cuda=lambda *a: _as_varying_as(kernel_fn(_auto_backend(), *a), a),
                                  default=jnp_fn)


@compiled_when_eager(0, 4)
def _run(cfg: _QCfg, x, b, state: ScalingState, impl: str) -> tuple[Quantized, ScalingState]:
    # the primitives carry no derivative (the custom_vjp wrappers of dot.py and mlp.py define it)
    x, b, state = lax.stop_gradient((x, b, state))
    args = (x, b, state.amax_history, state.scale, state.scale_inv, state.updates)
    if b is None:  # platform_dependent passes arrays only
        outs = _dispatch(impl, lambda *a: _quantize_jnp(cfg, a[0], None, *a[1:]),
                         lambda be, *a: _quantize_kernel(cfg, be, a[0], None, *a[1:]), x, *args[2:])
    else:
        outs = _dispatch(impl, lambda *a: _quantize_jnp(cfg, *a), lambda be, *a: _quantize_kernel(cfg, be, *a),
                         *args)
    outs = list(outs)
    fp8 = jnp.dtype(cfg.fmt.dtype_name)
    q = lax.bitcast_convert_type(outs.pop(0), fp8)
    q_t = lax.bitcast_convert_type(outs.pop(0), fp8) if cfg.transpose else None
    db = outs.pop(0) if cfg.dbias else None
    si_used, hist, scale, scale_inv = outs
    new = state.replace(amax_history=hist, scale=scale, scale_inv=scale_inv)
    return Quantized(q, hist[0, cfg.index], q_t, db, si_used), new


def _cfg(op, approximate, state, index, recipe, transpose, dbias, pad_to=1) -> _QCfg:
    i = state.check_index(index)
    return _QCfg(op, approximate, i, state.format_of(i, recipe), bool(transpose), bool(dbias),
                 float(recipe.margin_factor), recipe.first_step == "current", check_pad_to(pad_to))


# ---- public functions ------------------------------------------------------------------------
def quantize(x, state: ScalingState, index: int, recipe: DelayedScaling, *, transpose: bool = False,
             dbias: bool = False, pad_to: int = 1, impl: str = "auto") -> tuple[Quantized, ScalingState]:
    """Quantize ``x`` with tensor ``index`` of ``state`` (one fused pass: cast, amax, transpose,
    and for a gradient the bias gradient).

    Parameters
    ----------
    x : float32 / float16 / bfloat16 array, any shape
    state : ScalingState of jax arrays; recipe : DelayedScaling (the format is
        ``recipe.format_for(state.grad[index])``)
    transpose : also return the quantized transpose of x viewed as (prod(shape[:-1]), shape[-1])
    dbias : also return the column sums of that view in float32 (a gradient's bias gradient), from
        the same read (the tiled kernel's deterministic order on CUDA)
    pad_to : 1 (``data`` has x's shape), or ``data`` is that (rows, cols) view rounded up to
        multiples of ``pad_to`` (``data_t`` its transpose), FP8 zeros in the pad, outside the amax:
        the operands of an FP8 GEMM of ragged shape, written padded by the same kernel (no copy)
    impl : see the module docstring

    Returns
    -------
    (Quantized, ScalingState)
        ``data`` (x's shape or padded as above, jnp float8), ``amax`` (the staged slot after this call, a float32
        scalar), ``data_t`` or None, ``dbias`` ((cols,) float32) or None, ``scale_inv`` ((1,)
        float32, 1 / the scale used: the GEMM operand scale), and the new state.
    """
    _check_impl(impl)
    state = _check_state(state, recipe)
    cfg = _cfg("identity", "tanh", state, index, recipe, transpose, dbias, pad_to)
    return _run(cfg, _check_x(x, "x", transpose or dbias), None, state, impl)


def gelu_quantize(x, state: ScalingState, index: int, recipe: DelayedScaling, *, approximate: str = "tanh",
                  transpose: bool = False, pad_to: int = 1, impl: str = "auto") -> tuple[Quantized, ScalingState]:
    """``gelu(x)`` in float32 (``approximate`` 'tanh' or 'none', as ``jax.nn.gelu``), quantized as
    :func:`quantize` does (``pad_to`` as there); the amax is of gelu(x)."""
    _check_impl(impl)
    state = _check_state(state, recipe)
    cfg = _cfg("gelu", check_approximate(approximate), state, index, recipe, transpose, False, pad_to)
    return _run(cfg, _check_x(x, "x", transpose), None, state, impl)


def dgelu_quantize(dy, x, state: ScalingState, index: int, recipe: DelayedScaling, *, approximate: str = "tanh",
                   transpose: bool = False, dbias: bool = False, pad_to: int = 1,
                   impl: str = "auto") -> tuple[Quantized, ScalingState]:
    """The gelu backward ``dx = dy * gelu'(x)`` (float32), quantized; amax of dx; with ``dbias``
    also the (N,) float32 column sums of the unquantized dx over its (M, N) view (never
    padded); ``pad_to`` as :func:`quantize`."""
    _check_impl(impl)
    state = _check_state(state, recipe)
    cfg = _cfg("dgelu", check_approximate(approximate), state, index, recipe, transpose, dbias, pad_to)
    dy = _check_x(dy, "dy", transpose or dbias)
    x = _check_x(x, "x", transpose or dbias)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"dy and x must have the same shape and dtype; got {dy.shape} {dy.dtype} and "
                         f"{x.shape} {x.dtype}")
    return _run(cfg, dy, x, state, impl)


def dequantize(q, scale_inv, dtype=jnp.float32):
    """``dtype(float32(q) * scale_inv)`` (plain XLA: it fuses into whatever consumes it)."""
    q = jnp.asarray(q)
    if q.dtype.name not in ("float8_e4m3fn", "float8_e5m2"):
        raise TypeError(f"q must be a float8_e4m3fn / float8_e5m2 array; got {q.dtype}")
    return jn.mul(q.astype(jnp.float32), jnp.reshape(scale_inv, ())).astype(dtype)


def stage_amax(state: ScalingState, index: int, amax, recipe: DelayedScaling) -> ScalingState:
    """The state after :func:`quantize` of a tensor whose amax is ``amax``, without the data: the
    amax max-accumulated into ``amax_history[0, index]`` and, on the tensor's first step under
    ``first_step='current'``, the current scale from that slot written to ``scale`` /
    ``scale_inv``: the state effect of the quantization, byte for byte (a few scalar operations in
    jax.numpy on every backend). It stages the amax of an FP8 copy made earlier in the step (the
    weight cache of :func:`fusedfp8.jax.fp8_dot`), whose data is reused instead of quantized again."""
    state = _check_state(state, recipe)
    cfg = _cfg("identity", "tanh", state, index, recipe, False, False)
    amax = jnp.asarray(amax)
    if amax.shape not in ((), (1,)) or amax.dtype != jnp.float32:
        raise ValueError(f"amax must be a float32 scalar; got {amax.dtype} {amax.shape}")
    args = lax.stop_gradient((amax.reshape(()), state.amax_history, state.scale, state.scale_inv, state.updates))
    _, _, hist, scale, scale_inv = jn.shares_one_zero(functools.partial(_stage_jnp, cfg))(*args)
    return state.replace(amax_history=hist, scale=scale, scale_inv=scale_inv)


# ---- the first use of a flax meta in a step: decoded, updated, counters converted, one launch ----
def update_meta(meta, recipe: DelayedScaling, grad: tuple, *, impl: str = "auto"):
    """The first use of a flax meta (:mod:`fusedfp8.jax.meta`) in a step: ``meta`` decoded
    (:func:`~fusedfp8.jax.meta.decode`), turned into a state (int32 counters) and updated
    (:func:`update_scales`), as ``update_scales(meta_to_state(decode(meta), grad), recipe)``,
    byte for byte; and refused where the meta is :func:`~fusedfp8.jax.meta.corrupted` (an
    optimizer updated it as a parameter): then the state's scales are NaN, so that the step's
    casts and GEMM outputs are NaN (under ``jax.jit`` the refusal cannot raise), and its int32
    update counts at least 1 (no quantization takes a first-step scale instead). Returns (the state, its counters as float32 (overflows, updates)): the output
    meta takes them (:func:`~fusedfp8.jax.meta.state_to_meta`) instead of converting. On CUDA
    that is ONE kernel launch (update_meta) where XLA would run the decoding and each conversion
    as kernels of their own. Delayed scaling on one device (no ``axis_name``): the callers take
    :func:`update_scales` otherwise."""
    _check_impl(impl)
    check_recipe(recipe)
    if recipe.current:
        raise ValueError("update_meta: delayed scaling only (CurrentScaling closes the step with update_scales)")
    meta = tuple(lax.stop_gradient(jnp.asarray(m)) for m in meta)
    fmt_max = jnp.asarray(np.array([recipe.format_for(g).max for g in grad], np.float32))
    new = _dispatch(impl, lambda *a: _meta_update_jnp(recipe, tuple(grad), *a),
                    lambda be, *a: _meta_update_kernel(recipe, be, *a), *meta, fmt_max)
    return ScalingState(**dict(zip(STATE_FIELDS, new[:5])), grad=tuple(grad)), (new[5], new[6])


# ---- amax only, and current scaling across devices --------------------------------------------


@compiled_when_eager(0, 1, 4)
def _run_amax(op: str, approximate: str, x, b, impl: str):
    cfg = _QCfg(op, approximate, 0, None, False, False, 1.0, False)

    def jnp_fn(x, *b):
        y = _activation(cfg, x, b[0] if b else None)
        return (jn.amax(jn.computed_once(y) if op != "identity" else y),)

    args = (x,) if b is None else (x, b)
    return _dispatch(impl, jnp_fn, lambda be, *a: _amax_kernel(op, approximate, be, a[0], a[1] if len(a) > 1 else None),
                     *lax.stop_gradient(args))[0]


def amax(x, b=None, *, op: str = "identity", approximate: str = "tanh", impl: str = "auto"):
    """``max |op(x, b)|`` as a float32 scalar, without a cast: the amax that :func:`quantize`
    (op 'identity'), :func:`gelu_quantize` ('gelu') or :func:`dgelu_quantize` ('dgelu': ``x`` is
    dy, ``b`` the gelu's input) stages, bit for bit; on CUDA the quantize kernels' first-step
    pre-pass alone (:func:`fusedfp8.launch.amax_plan`: a memset and one launch), elsewhere
    jax.numpy."""
    _check_impl(impl)
    if op not in ("identity", "gelu", "dgelu"):
        raise ValueError(f"op must be 'identity', 'gelu' or 'dgelu'; got {op!r}")
    x = _check_x(x, "x", False)
    if (b is not None) != (op == "dgelu"):
        raise ValueError(f"b is the dgelu's second input: given exactly for op 'dgelu'; got op {op!r}")
    if b is not None:
        b = _check_x(b, "b", False)
        if b.shape != x.shape or b.dtype != x.dtype:
            raise ValueError(f"b must match x's shape and dtype; got {b.shape} {b.dtype} and {x.shape} {x.dtype}")
    return _run_amax(op, check_approximate(approximate), x, b, impl)


def _pmax_amaxes(a, axis_name):
    """The elementwise max over ``axis_name`` of the amaxes ``a`` (>= 0 or non-finite), in ONE
    ``lax.pmax``: reduced as the int32 bit patterns of their magnitudes, which order as the
    floats do (exact for denormals, which XLA:CPU's float max may flush, and independent of
    how the collective treats NaN); a non-finite amax goes in as +inf, so a NaN or inf on any
    device is +inf (an overflow) on every device."""
    b = jnp.where(jnp.isfinite(a), jn.bits(a) & jn._MAG, jn._INF_BITS)
    return jn.from_bits(lax.pmax(b, axis_name))


def given_scale(recipe):
    """The recipe that casts with the state's scale as it stands (``first_step='unit'``, no
    current first step) in ``recipe``'s formats and history length: the cast after
    :func:`sync_current` has written the scale of the global amax."""
    return DelayedScaling(margin=recipe.margin, amax_history_len=recipe.amax_history_len,
                          amax_compute_algo=recipe.amax_compute_algo, fp8_format=recipe.fp8_format, first_step="unit")


def sync_current(state: ScalingState, amaxes: list, axis_name, recipe) -> ScalingState:
    """CurrentScaling across the devices of mesh axis ``axis_name``: ``amaxes`` = [(index, local
    amax)] of some tensors of ``state``, MAX-reduced in ONE ``lax.pmax`` (:func:`_pmax_amaxes`),
    each then staged with its current scale as the tensor's quantization would stage it
    (:func:`stage_amax`). Quantize the tensors next with :func:`given_scale` of the recipe: every
    device casts with the scale of the global amax, as one device would cast the concatenated
    tensors. Call inside ``shard_map``."""
    idx = [i for i, _ in amaxes]
    a = _pmax_amaxes(jnp.stack([jnp.reshape(v, ()).astype(jnp.float32) for _, v in amaxes]), axis_name)
    for j, i in enumerate(idx):
        state = stage_amax(state, i, a[j], recipe)
    return state


def _check_axis_name(axis_name):
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if isinstance(axis_name, (tuple, list)) and axis_name and all(isinstance(a, str) for a in axis_name):
        return tuple(axis_name)
    raise TypeError(f"axis_name must be None, a mesh axis name (str) or a non-empty tuple of them; got {axis_name!r}")


def sync_staged(states, axis_name) -> list:
    """``states`` (a sequence of ScalingState) with row 0 of every amax history MAX-reduced
    over the mesh axis ``axis_name`` (str or tuple of str), with ONE ``lax.pmax`` for all of
    them; call inside ``shard_map`` / ``pmap``. Rows 1.. and the other arrays are untouched.

    The staged amaxes (>= 0, or non-finite) are reduced by :func:`_pmax_amaxes`: a NaN or inf on
    any device is an overflow on every device.
    """
    axis_name = _check_axis_name(axis_name)
    states = list(states)
    if axis_name is None or not states:
        return states
    rows = [s.amax_history[0] for s in states]
    a = _pmax_amaxes(jnp.concatenate(rows) if len(rows) > 1 else rows[0], axis_name)
    out, at = [], 0
    for s, r in zip(states, rows):
        out.append(s.replace(amax_history=s.amax_history.at[0].set(a[at:at + r.shape[0]])))
        at += r.shape[0]
    return out


def update_scales(state: ScalingState, recipe: DelayedScaling, *, axis_name=None,
                  impl: str = "auto") -> ScalingState:
    """Turn the staged amaxes into the next step's scales for every tensor of ``state`` (one
    kernel launch on CUDA; the rule of :func:`fusedfp8.numerics.scaling.update_rule`). Returns the new
    state. Under :class:`fusedfp8.CurrentScaling` it closes the step instead
    (:func:`fusedfp8.numerics.scaling.close_step`: no scale changes).

    ``axis_name`` (str or tuple of str, inside ``shard_map`` / ``pmap``): first MAX-reduce the
    staged amaxes over that mesh axis (:func:`sync_staged`: one ``lax.pmax`` for the whole
    state, non-finite -> overflow on every device), so every device ends with identical scales
    and histories."""
    _check_impl(impl)
    return _update(_check_state(state, recipe), recipe, _check_axis_name(axis_name), impl)


@compiled_when_eager(1, 2, 3)
def _update(state: ScalingState, recipe: DelayedScaling, axis_name, impl: str) -> ScalingState:
    (state,) = sync_staged([state], axis_name)
    arrays = (state.amax_history, state.scale, state.scale_inv, state.overflows, state.updates)
    if recipe.current:  # a few scalar selects per tensor: jax.numpy on every backend (XLA fuses them)
        return state.replace(**dict(zip(STATE_FIELDS, close_step(jn.JnpNamespace(), *arrays))))
    fmt_max = jnp.asarray(state.fmt_max(recipe))
    new = _dispatch(impl, lambda *a: _update_jnp(recipe, *a), lambda be, *a: _update_kernel(recipe, be, *a),
                    *arrays, fmt_max)
    return state.replace(**dict(zip(STATE_FIELDS, new)))
