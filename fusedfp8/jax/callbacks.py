"""The CUDA backends of the JAX primitives. Both run the launch plans of :mod:`fusedfp8.launch` on
XLA's own buffers and stream:

- ``'ffi'``: a custom call to ``fusedfp8_launch``, the XLA FFI handler of the compiled shim
  (fusedfp8/csrc/xla_ffi.cc), with the plans of every local GPU as attributes (their kernels named
  by stable id: the same program in every process, which JAX's persistent cache finds). Nothing of Python
  runs when the program executes, and the handler is declared command-buffer compatible, so XLA
  records its launches into CUDA graphs.
- ``'callback'``: ``jax.experimental.buffer_callback`` callbacks that run the same plans with the
  Python executor (:func:`fusedfp8.launch.execute`) on ``ctx.stream``; with
  ``command_buffer_compatible=True`` XLA records their launches into its command buffer, but runs
  the callback again whenever the buffers it records move.

A primitive hands :func:`run` its plans, the result shapes, its operands, where each plan slot's
buffer comes from (``("in", k)``, ``("out", k)`` or None for a null pointer; written by slot name
and put in slot order by the family's slots, ``launch.QUANTIZE_SLOTS.arrange(sources, None)``) and
the operand -> result aliases of the state. Plans are made (and kernels compiled) at trace time
for every local GPU, never inside a stream capture; a callback depends on nothing but its buffers
(the first-step decision is made on the device from ``updates``).
"""
from __future__ import annotations

import functools

import numpy as np

from .. import csrc as _shim
from .. import launch

TARGET = "fusedfp8_launch"  # the XLA FFI custom call target (platform CUDA)
_F32 = 4  # bytes of a float32 / int32 state entry


def _ptr(buf) -> int:
    return int(buf.__cuda_array_interface__["data"][0]) if _size(buf) else 0


def _size(buf) -> int:
    return int(np.prod(buf.shape)) if buf.shape else 1


def gpu_devices() -> list[int]:
    """CUDA ordinals of jax's local GPUs (empty without a GPU backend)."""
    import jax

    try:
        devs = jax.local_devices(backend="gpu")
    except RuntimeError:
        return []
    return [int(getattr(d, "local_hardware_id", d.id)) for d in devs]


# ---- plans -----------------------------------------------------------------------------------
def quantize_plans(dtype: str, fmt: str, op: str, rows: int, cols: int, transpose: bool, dbias: bool, first: bool,
                   margin_factor: float, offset: int, pad_to: int = 1) -> dict:
    """CUDA ordinal -> :func:`fusedfp8.launch.quantize_plan` for every local GPU (compiles the module)."""
    return {dev: launch.quantize_plan(dev, dtype, fmt, op, rows, cols, transpose, dbias, first, margin_factor, offset,
                                      pad_to) for dev in gpu_devices()}


def layernorm_plans(dtype: str, param: str, fmt: str, rows: int, cols: int, transpose: bool, first: bool, eps: float,
                    margin_factor: float, offset: int, pad_to: int) -> dict:
    """CUDA ordinal -> :func:`fusedfp8.launch.layernorm_plan` for every local GPU (compiles the module)."""
    return {dev: launch.layernorm_plan(dev, dtype, param, fmt, rows, cols, transpose, first, eps, margin_factor,
                                       offset, pad_to) for dev in gpu_devices()}


def update_plans(n: int, L: int, margin_factor: float, algo_max: bool, meta: bool = False) -> dict:
    return {dev: launch.update_plan(dev, n, L, margin_factor, algo_max, meta) for dev in gpu_devices()}


# ---- the XLA FFI backend ---------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def ffi_target() -> tuple[bool, str]:
    """(ok, why): the compiled shim is loaded (built on first use) and its handler registered with
    jax as the CUDA custom call target :data:`TARGET`."""
    lib, why = _shim.library("xla")
    if lib is None:
        return False, why
    import jax

    try:
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ff8_xla_launch), platform="CUDA")
    except Exception as e:  # noqa: BLE001 - say why and keep the callback path
        return False, f"registering the XLA FFI target failed ({type(e).__name__}: {e})"
    return True, why


def encode_plans(plans: dict) -> tuple[np.ndarray, np.ndarray, str]:
    """(plans, offsets, names) attributes: the encoded plans one after the other, where each CUDA
    ordinal's starts (-1: none), and the kernel names (the same for every device)."""
    if not plans:
        return np.zeros(1, np.int64), np.full(1, -1, np.int64), ""
    offsets = np.full(max(plans) + 1, -1, np.int64)
    parts, names, at = [], None, 0
    for dev in sorted(plans):
        data, names = plans[dev].encode()
        offsets[dev] = at
        parts.append(data)
        at += len(data)
    return np.concatenate(parts), offsets, names


def _slot_codes(sources) -> np.ndarray:
    return np.array([-1 if s is None else s[1] if s[0] == "in" else -(s[1] + 2) for s in sources], np.int64)


def _run_ffi(plans: dict, shapes, args, sources, aliases: dict):
    import jax

    table, offsets, names = encode_plans(plans)
    pairs = np.array([k for pair in sorted(aliases.items()) for k in pair], np.int64)
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="sequential", input_output_aliases=aliases)
    return call(*args, plans=table, offsets=offsets, slots=_slot_codes(sources), aliases=pairs, names=names)


# ---- the buffer_callback backend -------------------------------------------------------------
def _same_or_copy(dst, src, stream: int) -> None:
    """XLA hands the aliased output the input's buffer; copy the input over if it did not."""
    d, s = _ptr(dst), _ptr(src)
    if d != s and d:
        import cupy

        cupy.cuda.runtime.memcpyAsync(d, s, _size(src) * _F32, cupy.cuda.runtime.memcpyDeviceToDevice, stream)


def plan_callback(plans: dict, sources, aliases: dict):
    """The buffer_callback body that runs ``plans`` (CUDA ordinal -> Plan) on the buffers."""

    def callback(ctx, outs, *ins):
        stream = int(ctx.stream)
        for i, o in aliases.items():
            _same_or_copy(outs[o], ins[i], stream)
        dev = launch.current_device()
        plan = plans.get(dev)
        if plan is None:
            raise RuntimeError(f"fusedfp8.jax: no launch plan for CUDA device {dev} (plans are made at trace time "
                               f"for jax's local GPUs {sorted(plans)})")
        ptrs = [0 if s is None else _ptr(ins[s[1]] if s[0] == "in" else outs[s[1]]) for s in sources]
        launch.execute(plan, ptrs, stream)

    return callback


def run(backend: str, plans: dict, shapes, args, sources, aliases: dict):
    """The results of running ``plans`` on ``args`` through ``backend`` ('ffi' or 'callback').
    ``sources``: one per plan slot, ``("in", k)``, ``("out", k)`` or None; ``aliases``: operand ->
    result index of the state buffers (updated in place)."""
    if backend == "ffi":
        return list(_run_ffi(plans, shapes, args, sources, aliases))
    from jax.experimental.buffer_callback import buffer_callback

    cb = plan_callback(plans, sources, aliases)
    return list(buffer_callback(cb, shapes, vmap_method="sequential", input_output_aliases=aliases,
                                command_buffer_compatible=True)(*args))
