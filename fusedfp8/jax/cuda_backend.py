"""The CUDA backends of the JAX primitives (:mod:`fusedfp8.jax.primitives`): which one
``impl='auto'`` takes (:func:`launch_path` says which and why), and what each primitive hands
:func:`fusedfp8.jax.callbacks.run` (its plans, result shapes, operands, buffer slots and the
state's aliases).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import csrc as _shim
from .. import launch
from ..recipe import DelayedScaling
from ..state import STATE_FIELDS
from ..types import kernel_op
from . import callbacks
from .jnp_backend import _QCfg, _rows_cols

__all__ = ["launch_path"]

def _auto_backend() -> str:
    """The CUDA backend of impl='auto': 'ffi' where the shim is available (compiled on first use),
    else 'callback'. Without a GPU the CUDA branch never runs, and nothing is built for it."""
    return "ffi" if _shim.default_on()[0] and callbacks.gpu_devices() and callbacks.ffi_target()[0] else "callback"


def launch_path() -> tuple[str, str]:
    """(backend, why) of impl='auto' on CUDA, without building anything: 'ffi' (the XLA FFI
    handler of the compiled shim) or 'callback' (Python buffer_callbacks)."""
    on, why = _shim.default_on()
    if not on:
        return "callback", why
    if callbacks.ffi_target.cache_info().currsize:  # decided in this process already
        ok, why = callbacks.ffi_target()
        return ("ffi", why) if ok else ("callback", why)
    ready, why = _shim.status("xla")
    if ready is None:
        return "ffi", f"from the first CUDA trace on ({why})"
    return ("ffi", why) if ready else ("callback", why)


# ---- each primitive's launch: its plans, result shapes, operands, slots and aliases ---------------
def _quantize_kernel(cfg: _QCfg, backend: str, x, b, hist, scale, scale_inv, updates):
    rows, cols = _rows_cols(x.shape)
    prows, pcols = launch.padded(rows, cols, cfg.pad_to)
    plans = callbacks.quantize_plans(x.dtype.name, cfg.fmt.name, kernel_op(cfg.op, cfg.approximate), rows, cols,
                                     cfg.transpose, cfg.dbias, cfg.current_first, cfg.margin_factor, 4 * cfg.index,
                                     cfg.pad_to)
    u8 = jnp.uint8
    shapes = [jax.ShapeDtypeStruct(x.shape if cfg.pad_to == 1 else (prows, pcols), u8)]
    if cfg.transpose:
        shapes.append(jax.ShapeDtypeStruct((pcols, prows), u8))
    if cfg.dbias:
        part_shape, n_counters = launch.dbias_workspace(rows, cols, cfg.pad_to)
        shapes += [jax.ShapeDtypeStruct((cols,), jnp.float32),
                   jax.ShapeDtypeStruct((part_shape[0] * part_shape[1],), jnp.float32),
                   jax.ShapeDtypeStruct((n_counters,), jnp.int32)]
    shapes.append(jax.ShapeDtypeStruct((1,), jnp.float32))
    shapes += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (hist, scale, scale_inv)]
    has_b = b is not None
    ins = (x, b, hist, scale, scale_inv, updates) if has_b else (x, hist, scale, scale_inv, updates)
    first_state = 2 if has_b else 1
    n_out = len(shapes)
    aliases = {first_state + k: n_out - 3 + k for k in range(3)}  # hist, scale, scale_inv: updated in place
    at_t, at_db = 1, 1 + cfg.transpose

    def out(k):
        return ("out", k)

    si_used, hist_o, scale_o, scale_inv_o = (out(k) for k in range(n_out - 4, n_out))
    # the amax is staged in row 0 of the history; the state's scale is read, and written on a first step
    sources = {"x": ("in", 0), "q": out(0), "scale": scale_o, "amax": hist_o, "scale_out": scale_o,
               "scale_inv_out": scale_inv_o, "scale_inv_used": si_used, "updates": ("in", first_state + 3)}
    if has_b:
        sources["b"] = ("in", 1)
    if cfg.transpose:
        sources["q_t"] = out(at_t)
    if cfg.dbias:
        sources.update(dbias=out(at_db), partial=out(at_db + 1), counters=out(at_db + 2))
    outs = callbacks.run(backend, plans, shapes, ins, launch.QUANTIZE_SLOTS.arrange(sources, None), aliases)
    if cfg.dbias:
        del outs[at_db + 1:at_db + 3]  # the workspaces (partial, counters) follow dbias
    return tuple(outs)


def _update_kernel(recipe: DelayedScaling, backend: str, hist, scale, scale_inv, overflows, updates, fmt_max):
    L, n = hist.shape
    plans = callbacks.update_plans(n, L, float(recipe.margin_factor), recipe.amax_compute_algo == "max")
    arrays = (hist, scale, scale_inv, overflows, updates)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    sources = {**{f: ("out", k) for k, f in enumerate(STATE_FIELDS)}, "fmt_max": ("in", len(arrays))}
    return tuple(callbacks.run(backend, plans, shapes, (*arrays, fmt_max), launch.UPDATE_SLOTS.arrange(sources, None),
                               {k: k for k in range(len(arrays))}))


def _meta_update_kernel(recipe: DelayedScaling, backend: str, hist, scale, scale_inv, ovf_f, upd_f, writes, fmt_max):
    L, n = hist.shape
    plans = callbacks.update_plans(n, L, float(recipe.margin_factor), recipe.amax_compute_algo == "max", True)
    f32, i32 = (jax.ShapeDtypeStruct((n,), t) for t in (jnp.float32, jnp.int32))
    shapes = [jax.ShapeDtypeStruct(hist.shape, jnp.float32), f32, f32, i32, i32, f32, f32]
    # the meta in (its scale_inv is not read), every result written whole: out of place, so XLA copies no
    # parameter for the kernel to update
    ins = {"amax_history": hist, "scale": scale, "overflows_f": ovf_f, "updates_f": upd_f, "writes": writes,
           "fmt_max": fmt_max}
    results = ("amax_history_out", "scale_out", "scale_inv_out", "overflows", "updates", "overflows_f_out",
               "updates_f_out")
    sources = {**{name: ("in", k) for k, name in enumerate(ins)},
               **{name: ("out", k) for k, name in enumerate(results)}}
    return tuple(callbacks.run(backend, plans, shapes, tuple(ins.values()),
                               launch.META_UPDATE_SLOTS.arrange(sources, None), {}))


def _amax_kernel(op: str, approximate: str, backend: str, x, b):
    plans = {dev: launch.amax_plan(dev, x.dtype.name, kernel_op(op, approximate), math.prod(x.shape))
             for dev in callbacks.gpu_devices()}
    shapes = [jax.ShapeDtypeStruct((2,), jnp.float32)]
    # the amax buffer comes in (aliased to the result, as the state buffers of the other kernels:
    # the backends' common form) and the plan zeroes it first
    ins = ((x,) if b is None else (x, b)) + (jnp.zeros((2,), jnp.float32),)
    # nothing but x, b and the amax (a (2,) buffer: the amax, the zeroed flag)
    sources = {"x": ("in", 0), "amax": ("out", 0)} | ({} if b is None else {"b": ("in", 1)})
    return (callbacks.run(backend, plans, shapes, ins, launch.QUANTIZE_SLOTS.arrange(sources, None),
                          {len(ins) - 1: 0})[0][0],)
