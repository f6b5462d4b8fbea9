"""The FP8 linear layer (``fp8_dot``, ``custom_vjp``), its weight cache, the straight-through
fake quantization (``custom_jvp``) and the FP8 GEMM, over the primitives; :mod:`fusedfp8.jax.mlp`
builds the fused MLP block on the same helpers.

Meta. The functions that keep delayed-scaling state across training steps take it as a
``meta`` (:mod:`fusedfp8.jax.meta`: the state's arrays as float32, the form in which the flax
modules store it). Their VJP with respect to the meta is *the new meta* (flax's "overwrite with gradient"
convention): ``flax.training.train_state.TrainState.apply_gradients`` stores it as the next
step's state. The new meta is the old one after ``update_scales`` (which turns the previous
step's staged amaxes into scales, a no-op on a fresh meta) with this step's amaxes staged in row
0. Deferring the update to the next forward makes a meta that is reused several times in one
step (``nn.scan``, shared layers) combine correctly when its cotangents are accumulated with
max (flax's ``fp32_max_grad`` dtype): the uses differ in row 0 only.

The meta is not a parameter: one that an optimizer updated (:func:`fusedfp8.jax.meta.corrupted`)
is refused at its first use in a step, with ValueError where its values are concrete and, under
``jax.jit``, with an output of NaN.

GEMM layouts. Every FP8 GEMM is ``lax.dot_general`` over two operands whose contracting
dimension is the last one (cuBLASLt's "TN"), fed with the transposed copies that the fused
quantize kernels write in the same pass, so XLA adds no transposes. With x (M, K), w (K, N)
and the output gradient g (M, N):

    forward  y  = x @ w     = dot(x_q (M, K),   w_t_q (N, K))
    dgrad    dx = g @ w.T   = dot(g_q (M, N),   w_q (K, N))
    wgrad    dw = x.T @ g   = dot(x_t_q (K, M), g_t_q (N, M))

each one :func:`fusedfp8.jax.gemm.fp8_gemm`: on CUDA one ``cublasLtMatmul`` called by the shim's
XLA FFI handler (``fusedfp8_fp8_gemm``), the scales in its epilogue and the output written in
its final dtype; elsewhere (and for impl 'jnp' / 'callback') ``dot_general(...,
preferred_element_type=float32) * (scale_inv_a * scale_inv_b)``, which XLA's GEMM rewriter
turns into its own ``__cublas$lt$matmul$f8`` call (float32 out, then a conversion kernel).
Forward tensors use the recipe's forward format (E4M3), gradients E5M2 under 'hybrid'. Only FP8
tensors are saved for the backward (and the MLP's pre-activation; with its LayerNorm fused, the
block's input and the per-row mean and rstd).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..recipe import BlockScaling, DelayedScaling
from ..state import ScalingState
from ..types import GEMM_MULTIPLE, Quantized, check_pad_to, check_recipe, gemm_pad_to
from . import gemm as G
from . import primitives as P
from .block import block_quantize
from .block_dot import block_dot
from .meta import (LINEAR_GRAD, combine, decode, float_counters, meta_to_state, refuse_corrupted, refusing,
                   state_to_meta)
from .meta import check_meta as _check_meta

__all__ = ["quantize_ste", "quantize_weight", "fp8_dot", "fp8_dot_use", "gemm"]

# ---- straight-through fake quantization ------------------------------------------------------
@jax.custom_jvp
def _straight_through(x, y):
    return y


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    return primals[1], tangents[0]


def quantize_ste(x, state: ScalingState, index: int, recipe: DelayedScaling, *,
                 impl: str = "auto") -> tuple[jax.Array, ScalingState]:
    """``dequantize(quantize(x))`` in x's dtype through tensor ``index`` of ``state``, with the
    identity as its derivative. Returns (the fake-quantized x, the new state)."""
    r, new = P.quantize(lax.stop_gradient(x), state, index, recipe, impl=impl)
    return _straight_through(x, P.dequantize(r.data, r.scale_inv, x.dtype)), new


# ---- the FP8 GEMM ----------------------------------------------------------------------------
def gemm(a, b, scale_inv_a, scale_inv_b, out_dtype, *, fast_accum: bool = False, impl: str = "auto", shape=None,
         bias=None):
    """``out_dtype((a @ b.T) * scale_inv_a * scale_inv_b (+ bias))`` for FP8 a (M, K), b (N, K), cut to
    ``shape`` (m, n) when given: :func:`fusedfp8.jax.gemm.fp8_gemm` (cuBLASLt through the shim's
    FFI handler on CUDA, XLA's dot elsewhere and for impl 'jnp' / 'callback').

    ``fast_accum``: cuBLASLt's FP8 fast accumulation (partial sums never promoted) or the split
    accumulator. As in Transformer Engine and torch's path, the forward GEMMs are fast by default
    (``forward_fast_accum`` of :func:`fp8_dot` / :func:`fp8_mlp`) and the gradients, summed over
    many more terms, split.
    """
    return G.fp8_gemm(a, b, scale_inv_a, scale_inv_b, out_dtype, shape=shape, fast_accum=fast_accum, bias=bias,
                      impl=impl)


class _Cfg(NamedTuple):
    recipe: DelayedScaling
    impl: str
    out_dtype: str
    axis_name: str | tuple | None = None
    forward_fast_accum: bool = True
    first: bool = True  # the first use of the meta in this step: decode it and advance it once


@jax.custom_jvp
def _first_order(x):
    """``x``; a tangent reaching it raises. It wraps the operands of the forward and the cotangent
    of the backward: only a second derivative (the outer differentiation of a gradient) gives
    them a tangent, and the FP8 backward (GEMMs of saved FP8 tensors, behind stop_gradient) has
    no derivative of its own, so without this it would silently be 0."""
    return x


@_first_order.defjvp
def _first_order_jvp(primals, tangents):
    raise TypeError("fusedfp8.jax: second derivatives through fp8_dot / fp8_mlp (and the flax modules built on "
                    "them) are not supported: their backward runs FP8 GEMMs on saved FP8 tensors. Differentiate "
                    "twice through a high-precision path (lax.dot_general) instead")


def _advance(meta, cfg, grad=LINEAR_GRAD) -> tuple[ScalingState, tuple | None]:
    """(the state a use quantizes with, its counters as float32 or None): the first use decodes
    the stored meta and advances it once (the previous step's staged amaxes become scales);
    later uses of the same step continue from the previous use's output meta. Under
    CurrentScaling across devices the staged amaxes are global already (:func:`_sync`), so
    closing the step needs no collective. Delayed scaling on one device takes
    :func:`fusedfp8.jax.primitives.update_meta` (one kernel on CUDA for what is otherwise a
    decode, two conversions, the update and two conversions back); the float32 counters it
    returns (or a later use's own) go to :func:`state_to_meta`."""
    if not cfg.first:
        return meta_to_state(meta, grad), float_counters(meta)
    if not _refused_here(cfg):
        return P.update_meta(meta, cfg.recipe, grad, impl=cfg.impl)
    st = meta_to_state(decode(meta), grad)
    return P.update_scales(st, cfg.recipe, axis_name=None if _across(cfg) else cfg.axis_name, impl=cfg.impl), None


def _refused_here(cfg) -> bool:
    """Whether a first use advances its stored meta without
    :func:`fusedfp8.jax.primitives.update_meta` (CurrentScaling, or an ``axis_name``), so that the
    forward itself refuses a corrupted one (:func:`refusing`); update_meta refuses in its own
    launch (NaN scales)."""
    return cfg.first and (cfg.recipe.current or cfg.axis_name is not None)


def _across(cfg) -> bool:
    """CurrentScaling across the devices of ``cfg.axis_name``: every quantization takes the amax
    of the tensor over the devices (:func:`_sync`)."""
    return cfg.recipe.current and cfg.axis_name is not None


def _sync(st: ScalingState, amaxes: list, cfg):
    """(state, recipe to cast with): with CurrentScaling across devices, ``amaxes`` ([(index,
    local amax)] of one tensor group) reduced in ONE ``lax.pmax`` and staged with the scales of
    the global amaxes (:func:`fusedfp8.jax.primitives.sync_current`), and the recipe that casts
    with those scales; otherwise ``st`` and ``cfg.recipe`` as they are (no amax computed)."""
    if not _across(cfg):
        return st, cfg.recipe
    return P.sync_current(st, [(i, a()) for i, a in amaxes], cfg.axis_name, cfg.recipe), P.given_scale(cfg.recipe)


def _weight_amax(w, fp8_weight, impl: str):
    """A thunk: the local amax of the weight, or that of its FP8 copy (reduced when it was made)."""
    return (lambda: fp8_weight.amax) if fp8_weight is not None else (lambda: P.amax(w, impl=impl))


def _padded(a, pad: int):
    """A 2-D FP8 operand with zeros appended to multiples of ``pad`` (cuBLASLt's FP8 GEMMs need K
    a multiple of 16; XLA's GEMM rewriter needs every dimension so, else it falls back to a GEMM
    in high precision). The quantize kernels write the operands padded themselves (``pad_to``);
    this copies only a cached weight of ragged shape made without ``pad_to``, and is the
    identity on one that is padded already."""
    if pad == 1 or not any(d % pad for d in a.shape):
        return a
    return jnp.pad(a, [(0, -d % pad) for d in a.shape])


def _weight(w, fp8_weight, st: ScalingState, recipe: DelayedScaling, impl: str, pad: int):
    """(the FP8 weight with its transpose, both padded to multiples of ``pad``, the state after
    it): ``w`` quantized into column 1 of ``st`` (written padded by the kernel), or
    ``fp8_weight`` (from :func:`quantize_weight`) reused, its amax staged as the quantization
    would have staged it."""
    if fp8_weight is None:
        return P.quantize(w, st, 1, recipe, transpose=True, pad_to=pad, impl=impl)
    q = fp8_weight._replace(data=_padded(fp8_weight.data, pad), data_t=_padded(fp8_weight.data_t, pad))
    return q, P.stage_amax(st, 1, fp8_weight.amax, recipe)


def _dot_fwd(x, w, meta, fp8_weight, cfg: _Cfg, training: bool = True):
    x, w = _first_order(x), _first_order(w)
    (m, k), n = x.shape, w.shape[1]
    pad = gemm_pad_to(m, k, n)
    st, fc = _advance(meta, cfg)
    st, rec = _sync(st, [(0, lambda: P.amax(x, impl=cfg.impl)), (1, _weight_amax(w, fp8_weight, cfg.impl))], cfg)
    # ragged: the operands come out of the quantize kernels padded (pad_to), no copy
    rx, st = P.quantize(x, st, 0, rec, transpose=training, pad_to=pad, impl=cfg.impl)
    rw, st = _weight(w, fp8_weight, st, rec, cfg.impl, pad)
    sx = refusing(rx.scale_inv, (meta,) if _refused_here(cfg) else ())  # NaN out where the stored meta is corrupted
    y = gemm(rx.data, rw.data_t, sx, rw.scale_inv, cfg.out_dtype, fast_accum=cfg.forward_fast_accum, impl=cfg.impl,
             shape=(m, n))
    dtypes = (jnp.zeros((0, m, k), x.dtype), jnp.zeros((0, k, n), w.dtype))  # dtypes and real shapes
    res = (rx.data_t, rw.data, rx.scale_inv, rw.scale_inv, st, fc, dtypes, fp8_weight)
    return (y, state_to_meta(st, fc)), res


def _zeros_like(tree):
    """Zero cotangents for ``tree`` (a reused FP8 weight: an input of the custom_vjp without a
    derivative; nothing reads them, and XLA drops them)."""
    return jax.tree.map(jnp.zeros_like, tree)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dot(x, w, meta, fp8_weight, cfg: _Cfg):
    """(x @ w, the meta after this use). The VJP with respect to ``meta`` is the new meta of the
    step: this use's (with the gradient's amax staged) merged with what later uses of the same
    meta handed back through the output meta's cotangent (:func:`fusedfp8.jax.meta.combine`)."""
    return _dot_fwd(x, w, meta, fp8_weight, cfg, training=False)[0]


def _dot_bwd(cfg: _Cfg, res, cts):
    g, later = cts
    g = _first_order(g)
    x_t, w_q, sx, sw, st, fc, (xz, wz), fp8_weight = res
    (_, m, k), n = xz.shape, wz.shape[2]
    pad = gemm_pad_to(m, k, n)  # as the forward padded
    st, rec = _sync(st, [(2, lambda: P.amax(g, impl=cfg.impl))], cfg)
    rg, st = P.quantize(g, st, 2, rec, transpose=True, pad_to=pad, impl=cfg.impl)
    dx = gemm(rg.data, w_q, rg.scale_inv, sw, xz.dtype, impl=cfg.impl, shape=(m, k))
    dw = gemm(x_t, rg.data_t, sx, rg.scale_inv, wz.dtype, impl=cfg.impl, shape=(k, n))
    return dx, dw, combine(later, state_to_meta(st, fc)), _zeros_like(fp8_weight)


_dot.defvjp(_dot_fwd, _dot_bwd)
_dot_call = P.compiled_when_eager(4)(_dot)


def _check_operand(a, argname: str):
    a = jnp.asarray(a)
    if a.dtype.name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"{argname} must be float32, float16 or bfloat16; got {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{argname} must be 2-D; got shape {a.shape}")
    return a


def _check_fp8_weight(q, w, recipe: DelayedScaling, argname: str):
    """``q`` if it is the FP8 copy of a weight shaped like ``w`` (a :class:`Quantized` from
    :func:`quantize_weight`: data (K, N) and data_t (N, K) in the recipe's forward format,
    float32 amax and (1,) scale_inv); TypeError / ValueError naming ``argname`` otherwise."""
    if q is None:
        return None
    if not isinstance(q, Quantized) or q.data_t is None or q.scale_inv is None:
        raise TypeError(f"{argname} must be None or the Quantized that fusedfp8.jax.quantize_weight returned (data, "
                        f"data_t, amax, scale_inv); got {type(q).__name__}")
    fp8 = recipe.format_for(False).dtype_name
    (k, n), (pk, pn) = w.shape, (-(-d // GEMM_MULTIPLE) * GEMM_MULTIPLE for d in w.shape)
    want = {"data": ((k, n), fp8), "data_t": ((n, k), fp8), "amax": ((), "float32"), "scale_inv": ((1,), "float32")}
    padded = {"data": (pk, pn), "data_t": (pn, pk)}  # quantize_weight(pad_to=16) of a ragged weight
    for name, (shape, dtype) in want.items():
        a = jnp.asarray(getattr(q, name))
        if a.shape not in (shape, padded.get(name, shape)) or a.dtype.name != dtype:
            also = f" (padded, from quantize_weight(pad_to=16): {padded[name]})" if name in padded else ""
            raise ValueError(f"{argname}.{name} must be {dtype} of shape {shape} (the FP8 copy of a ({k}, {n}) weight "
                             f"under this recipe); got {a.dtype} {a.shape}{also}")
    return Quantized(*(None if a is None else jnp.asarray(a) for a in q))


def quantize_weight(w, meta, recipe: DelayedScaling = DelayedScaling(), *, axis_name=None, impl: str = "auto",
                    pad_to: int = 1):
    """The FP8 copy of the weight ``w`` (K, N) with its transpose, for the ``fp8_weight=``
    argument of :func:`fp8_dot` (and ``fp8_weights=`` of :func:`fp8_mlp`): the weight cache for
    gradient accumulation, explicit in JAX. Make it once per optimizer step, from the step's
    weight and stored ``meta``, and pass it to every micro-batch of that step: they skip the
    weight's quantization and transpose (one read of the weight per step instead of one per
    micro-batch) and otherwise compute what they compute without it, byte for byte: the meta is
    advanced and the input and gradient quantized as before, and the weight's amax is staged
    into each micro-batch's new meta as its quantization would have staged it (so the amaxes of
    the micro-batches still combine by max, and the delayed-scaling rule is unchanged).

    It quantizes ``w`` as the first use of ``meta`` in a step would: ``meta`` advanced by
    :func:`fusedfp8.jax.update_scales` (with ``axis_name``), then tensor 1 (the weight) with
    ``transpose=True``. The result is a :class:`fusedfp8.Quantized` (``data`` (K, N) and
    ``data_t`` (N, K) in the forward FP8 format, ``amax``, ``scale_inv`` (1,)); it carries no
    derivative. A copy made from another step's weight or meta is not detected: the GEMMs then
    use that weight. ``axis_name``, ``impl``: as :func:`fp8_dot`.

    ``pad_to``: 1 (the default: ``data`` (K, N), ``data_t`` (N, K)) or 16: K and N rounded up
    to multiples of 16 (``data`` (K', N'), ``data_t`` (N', K')), FP8 zeros in the pad, written so
    by the quantize kernel: the GEMM operands of a ragged weight as :func:`fp8_dot` takes them,
    where the unpadded copy is padded again (one copy of the FP8 weight) in every use. The same
    for a weight whose K and N are multiples of 16.

    Under a :class:`fusedfp8.BlockScaling` recipe (``meta`` and ``axis_name`` None: no state) the
    weight's block quantization with its transpose (:func:`fusedfp8.jax.block.block_quantize` with
    ``weight=True``: a :class:`fusedfp8.types.BlockQuantized`), for :func:`fp8_dot` /
    :func:`fusedfp8.jax.block_dot.block_dot` and :func:`fp8_mlp` under that recipe.
    """
    w = _check_operand(w, "w")
    if check_pad_to(pad_to) not in (1, GEMM_MULTIPLE):
        raise ValueError(f"pad_to must be 1 or {GEMM_MULTIPLE} (the padding of fp8_dot's GEMM operands); "
                         f"got {pad_to!r}")
    if isinstance(recipe, BlockScaling):
        _check_block_call(meta, axis_name)
        return block_quantize(w, recipe, weight=True, transpose=True, impl=impl,
                              pad_to=gemm_pad_to(*w.shape) if pad_to != 1 else 1)
    check_recipe(recipe)
    meta = _check_meta(meta, 3, recipe)
    refuse_corrupted(meta)
    cfg = _Cfg(recipe, P._check_impl(impl), w.dtype.name, P._check_axis_name(axis_name))
    w, *meta = P._as_varying_as((w, *meta), (w, *meta))
    return _quantize_weight_call(w, tuple(meta), cfg, gemm_pad_to(*w.shape) if pad_to != 1 else 1)


@P.compiled_when_eager(2, 3)
def _quantize_weight_call(w, meta, cfg: _Cfg, pad_to: int) -> Quantized:
    w = lax.stop_gradient(w)
    st, rec = _sync(_advance(meta, cfg)[0], [(1, lambda: P.amax(w, impl=cfg.impl))], cfg)
    rw, _ = P.quantize(w, st, 1, rec, transpose=True, pad_to=pad_to, impl=cfg.impl)
    return rw


def _check_block_call(meta, axis_name) -> None:
    """The state arguments under BlockScaling, which keeps no state: both None."""
    for name, v in (("meta", meta), ("axis_name", axis_name)):
        if v is not None:
            raise ValueError(f"{name} must be None under BlockScaling (no state: each block's scale is its own max, "
                             f"the same on every device); got {type(v).__name__}")


def fp8_dot(x, w, meta, recipe: DelayedScaling = DelayedScaling(), *, out_dtype=None, axis_name=None,
            impl: str = "auto", forward_fast_accum: bool = True, fp8_weight=None):
    return fp8_dot_use(x, w, meta, recipe, out_dtype=out_dtype, axis_name=axis_name, impl=impl,
                       forward_fast_accum=forward_fast_accum, fp8_weight=fp8_weight)[0]


def fp8_dot_use(x, w, meta, recipe: DelayedScaling = DelayedScaling(), *, out_dtype=None, axis_name=None,
                impl: str = "auto", forward_fast_accum: bool = True, first: bool = True, fp8_weight=None):
    """``x @ w`` with FP8 GEMMs and delayed scaling (forward and both backward GEMMs); under a
    :class:`fusedfp8.BlockScaling` recipe :func:`fusedfp8.jax.block_dot.block_dot` (``meta`` and
    ``axis_name`` None: no state; ``fp8_weight`` the block :func:`quantize_weight`; the second
    result of :func:`fp8_dot_use` None).

    Parameters
    ----------
    x : (M, K) float32 / float16 / bfloat16;  w : (K, N), same choice of dtypes
    meta : the float32 meta of 3 tensors (input, weight, output gradient); see the module
        docstring. Its VJP is the new meta.
    recipe : DelayedScaling (history length must match the meta)
    out_dtype : the output dtype (x's by default)
    axis_name : None, or the mesh axis name(s) (inside ``shard_map``) over which the previous
        step's staged amaxes are MAX-reduced before the update (one ``lax.pmax``), so every
        device quantizes with the same scales; see :func:`fusedfp8.jax.primitives.sync_staged`.
        Under :class:`fusedfp8.CurrentScaling` the amaxes of the quantizations themselves are
        reduced instead, before each cast: one ``lax.pmax`` for (x, w) in the forward and one
        for the output gradient in the backward (:func:`fusedfp8.jax.primitives.sync_current`;
        :func:`fp8_mlp`: (LayerNorm(h) or h, w1), (gelu(z), w2), dy, the gelu gradient), so every
        device casts with the scale of the global amax, as one device would cast the whole batch
    impl : backend of the quantize primitives (:data:`fusedfp8.jax.IMPLS`)
    forward_fast_accum : the forward GEMM with cuBLASLt's fast accumulation (the gradient GEMMs
        always use the split accumulator)
    fp8_weight : None, or :func:`quantize_weight` of this ``w`` and ``meta`` in this step: the
        GEMMs use it instead of quantizing ``w`` again (the weight cache for gradient
        accumulation); the results, gradients and new meta are the same

    Returns
    -------
    (M, N) array of ``out_dtype``; dx in x's dtype and dw in w's dtype under differentiation.

    :func:`fp8_dot_use` is the same with two more things, for a meta used several times in one
    step (the flax modules use it): ``first`` (False: ``meta`` is the output meta of the previous
    use, already advanced this step) and a second result, the output meta of this use, which the
    next use takes as its ``meta``; the VJP then max-accumulates the staged amaxes of all uses
    into the one new meta of the first use.
    """
    if isinstance(recipe, BlockScaling):
        _check_block_call(meta, axis_name)
        return block_dot(x, w, recipe, out_dtype=out_dtype, impl=impl, fp8_weight=fp8_weight), None
    x, w = _check_operand(x, "x"), _check_operand(w, "w")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x (M, K) and w (K, N) must agree on K; got {x.shape} and {w.shape}")
    check_recipe(recipe, block=True)
    meta = _check_meta(meta, 3, recipe)
    if first:
        refuse_corrupted(meta)
    out_name = jnp.dtype(out_dtype or x.dtype).name
    if out_name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16; got {out_name}")
    cfg = _Cfg(recipe, P._check_impl(impl), out_name, P._check_axis_name(axis_name), bool(forward_fast_accum),
               bool(first))
    fp8_weight = _check_fp8_weight(fp8_weight, w, recipe, "fp8_weight")
    x, w, *meta = P._as_varying_as((x, w, *meta), (x, w, *meta))
    return _dot_call(x, w, tuple(meta), fp8_weight, cfg)
