"""The FP8 linear layer under block scaling (:class:`fusedfp8.BlockScaling`): :func:`block_dot`,
``x @ w`` with the forward and both gradient GEMMs in FP8 (``custom_vjp``), which
:func:`fusedfp8.jax.fp8_dot` and the flax ``Fp8DotGeneral`` run for that recipe; and
:func:`block_mlp`, ``gelu(h @ w1 + b1) @ w2 + b2`` with the gelu fused into the quantizations,
which :func:`fusedfp8.jax.fp8_mlp` and the flax ``Fp8MLP`` run for it.

Block scaling keeps no state: each quantization takes the scales of its own blocks' maxes in the
pass that casts it (:func:`fusedfp8.jax.block.block_quantize`), so there is no meta to carry,
update or synchronise across devices. With x (M, K), w (K, N) and the output gradient g (M, N),
every GEMM operand K-contiguous (:func:`fusedfp8.jax.gemm.fp8_block_gemm`):

    forward  y  = x @ w     x_q (M, K) 1x128       x  w_t_q (N, K) weight block
    dgrad    dx = g @ w.T   g_q (M, N) 1x128       x  w_q   (K, N) weight block
    wgrad    dw = x.T @ g   x_t_q (K, M) 1x128     x  g_t_q (N, M) 1x128

Each tensor and its transpose come from one pass (1x128 copies with their own scales along the
other axis; a 128x128 weight's tiles are their own transpose). Where a dimension is not a multiple
of 16 every operand is quantized with ``pad_to=16`` (the zero pad written in the same pass) and the
results are sliced. Only the FP8 transposes and their scales are saved for the backward. The three
GEMMs use the split accumulator, the only one cuBLASLt offers with block scales. On CUDA the GEMMs
are the shim's cuBLASLt block-scaled GEMM; elsewhere (and for ``impl='jnp'``) the float32 product
of the dequantized operands.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..recipe import BlockScaling
from ..types import BlockQuantized, check_approximate, check_recipe, gemm_pad_to
from . import gemm as G
from . import primitives as P
from .block import block_dgelu_quantize, block_gelu_quantize, block_layernorm_quantize, block_quantize
from .layernorm import check_mlp_layernorm, layernorm_backward

__all__ = ["block_dot", "block_mlp", "padded_weight", "check_fp8_weight"]


class _Cfg(NamedTuple):
    recipe: BlockScaling
    out_name: str
    impl: str


def _quantize(t, cfg: _Cfg, pad: int, **role):
    return block_quantize(t, cfg.recipe, transpose=True, pad_to=pad, impl=cfg.impl, **role)


def _pad_to(a, shape, value):
    return a if a.shape == tuple(shape) else jnp.pad(a, [(0, t - d) for d, t in zip(a.shape, shape)],
                                                       constant_values=value)


def padded_weight(q: BlockQuantized, recipe: BlockScaling, pad: int) -> BlockQuantized:
    """A weight's block quantization (K, N) with its transpose as the operands of GEMMs padded to
    multiples of ``pad``: zeros appended to the data, and the scales those of the zero-padded
    weight (a zero block's scale_inv is 1; padding to 16 never adds a 128-block along an axis,
    only rows of a 1x128 layout). The identity on a weight padded already (quantize_weight with
    ``pad_to=16``, or K and N multiples of ``pad``)."""
    from ..numerics.block import scale_shape

    (k, n), block = q.data.shape, (recipe.weight_block[0], 128)
    pk, pn = -(-k // pad) * pad, -(-n // pad) * pad
    return q._replace(data=_pad_to(q.data, (pk, pn), 0), data_t=_pad_to(q.data_t, (pn, pk), 0),
                      scale_inv=_pad_to(q.scale_inv, scale_shape(pk, pn, block), 1.0),
                      scale_inv_t=_pad_to(q.scale_inv_t, scale_shape(pn, pk, block), 1.0))


def check_fp8_weight(q, w, recipe: BlockScaling, argname: str):
    """``q`` if it is the block quantization of a weight shaped like ``w`` (K, N), as
    :func:`fusedfp8.jax.quantize_weight` makes it under ``recipe`` (a :class:`BlockQuantized`:
    data (K, N) and data_t (N, K), or both padded to multiples of 16, in the forward format, the
    scales of ``recipe.weight_block`` in their layout); TypeError / ValueError naming ``argname``."""
    from ..numerics.block import scale_shape

    if q is None:
        return None
    if not isinstance(q, BlockQuantized) or q.data_t is None or q.scale_inv_t is None:
        raise TypeError(f"{argname} must be None or the BlockQuantized that fusedfp8.jax.quantize_weight returned under "
                        f"BlockScaling (data, scale_inv, data_t, scale_inv_t); got {type(q).__name__}")
    fp8, block = recipe.format_for(False).dtype_name, (recipe.weight_block[0], 128)
    (k, n) = w.shape
    data = jnp.asarray(q.data)
    pk, pn = data.shape if data.ndim == 2 else (k, n)
    if (pk, pn) not in ((k, n), (-(-k // 16) * 16, -(-n // 16) * 16)):
        raise ValueError(f"{argname}.data must have shape {(k, n)} (or padded to multiples of 16) for a ({k}, {n}) "
                         f"weight; got {data.shape}")
    want = {"data": ((pk, pn), fp8), "data_t": ((pn, pk), fp8), "scale_inv": (scale_shape(pk, pn, block), "float32"),
            "scale_inv_t": (scale_shape(pn, pk, block), "float32")}
    for name, (shape, dtype) in want.items():
        a = jnp.asarray(getattr(q, name))
        if a.shape != shape or a.dtype.name != dtype:
            raise ValueError(f"{argname}.{name} must be {dtype} of shape {shape} (the FP8 copy of a ({k}, {n}) weight "
                             f"under this recipe); got {a.dtype} {a.shape}")
    return BlockQuantized(*(None if a is None else jnp.asarray(a) for a in q))


def _forward(x, w, fp8_weight, cfg: _Cfg):
    (m, k), n = x.shape, w.shape[1]
    pad = gemm_pad_to(m, k, n)
    qx = _quantize(x, cfg, pad)
    qw = _quantize(w, cfg, pad, weight=True) if fp8_weight is None else padded_weight(fp8_weight, cfg.recipe, pad)
    side = cfg.recipe.weight_block[0]
    y = G.fp8_block_gemm(qx.data, qw.data_t, qx.scale_inv, qw.scale_inv_t, 1, side, cfg.out_name, impl=cfg.impl)
    return y[:m, :n], (qx.data_t, qx.scale_inv_t, qw.data, qw.scale_inv)


def _zeros_like(tree):
    """Zero cotangents for a reused FP8 weight (an input without a derivative; XLA drops them)."""
    return jax.tree.map(jnp.zeros_like, tree)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_dot(x, w, fp8_weight, cfg: _Cfg):
    return _forward(x, w, fp8_weight, cfg)[0]


def _fwd(x, w, fp8_weight, cfg: _Cfg):
    y, saved = _forward(x, w, fp8_weight, cfg)
    # (empty arrays carry dx's and dw's dtypes and K, which the padded operands do not)
    return y, (saved, jnp.zeros((0, x.shape[1]), x.dtype), jnp.zeros((0,), w.dtype), fp8_weight)


def _bwd(cfg: _Cfg, res, g):
    (x_t, x_ts, w_q, w_s), x0, w0, fp8_weight = res
    (m, n), k = g.shape, x0.shape[1]
    pad = gemm_pad_to(m, k, n)
    qg = _quantize(g, cfg, pad, grad=True)
    side = cfg.recipe.weight_block[0]
    dx = G.fp8_block_gemm(qg.data, w_q, qg.scale_inv, w_s, 1, side, x0.dtype, impl=cfg.impl)[:m, :k]
    dw = G.fp8_block_gemm(x_t, qg.data_t, x_ts, qg.scale_inv_t, 1, 1, w0.dtype, impl=cfg.impl)[:k, :n]
    return dx, dw, _zeros_like(fp8_weight)


_block_dot.defvjp(_fwd, _bwd)


def _check_call(recipe, operands: dict, out_dtype, impl: str) -> tuple:
    """(the operands as 2-D float arrays, the output dtype's name, impl) of block_dot / block_mlp,
    checked by name."""
    check_recipe(recipe, block=True)
    if not isinstance(recipe, BlockScaling):
        raise TypeError(f"recipe must be a fusedfp8.BlockScaling; got {type(recipe).__name__} (fp8_dot and fp8_mlp "
                        "take the per-tensor recipes with a meta)")
    out = {}
    for name, a in operands.items():
        a = out[name] = jnp.asarray(a)
        if a.dtype.name not in ("float32", "float16", "bfloat16"):
            raise TypeError(f"{name} must be float32, float16 or bfloat16; got {a.dtype}")
        if a.ndim != (1 if name.startswith("b") else 2):
            raise ValueError(f"{name} must be {1 if name.startswith('b') else 2}-D; got shape {a.shape}")
    first = next(iter(out.values()))
    out_name = jnp.dtype(out_dtype or first.dtype).name
    if out_name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16; got {out_name}")
    return out, out_name, P._check_impl(impl)


def block_dot(x, w, recipe: BlockScaling = BlockScaling(), *, out_dtype=None, impl: str = "auto", fp8_weight=None):
    """``x @ w`` with FP8 GEMMs under block scaling (forward and both gradients; see the module
    docstring), differentiable once.

    Parameters
    ----------
    x : (M, K) float32 / float16 / bfloat16;  w : (K, N), same choice of dtypes
    recipe : fusedfp8.BlockScaling
    out_dtype : the output dtype (x's by default); dx comes in x's dtype, dw in w's
    impl : backend of the quantizations and the GEMMs (:data:`fusedfp8.jax.IMPLS`): on CUDA 'auto'
        runs the block_quantize kernel and the shim's block-scaled cuBLASLt GEMM (an error where
        the shim is missing: there is no other block-scaled FP8 GEMM), 'callback' the kernel
        through a buffer callback and the same GEMM; 'jnp' the jax.numpy twin of the kernel and
        the float32 emulation of the GEMM
    fp8_weight : None, or :func:`fusedfp8.jax.quantize_weight` of this ``w`` under ``recipe``: the
        GEMMs use it instead of quantizing ``w`` again (the weight cache for gradient
        accumulation: one quantization of the weight per optimizer step): the same FP8 operands,
        so the same results and gradients (on the CPU within the emulated GEMM's float32
        rounding, which XLA orders per program)

    Raises
    ------
    TypeError, ValueError
        On a recipe that is not a BlockScaling, an operand of the wrong dtype or rank, K that
        disagrees, or a bad ``out_dtype`` / ``impl``, naming the argument, before anything runs.
    """
    ops, out_name, impl = _check_call(recipe, {"x": x, "w": w}, out_dtype, impl)
    x, w = ops["x"], ops["w"]
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x (M, K) and w (K, N) must agree on K; got {x.shape} and {w.shape}")
    return _block_dot(x, w, check_fp8_weight(fp8_weight, w, recipe, "fp8_weight"), _Cfg(recipe, out_name, impl))


# ---- the MLP: gelu(h @ w1 + b1) @ w2 + b2 --------------------------------------------------------------------
class _MlpCfg(NamedTuple):
    recipe: BlockScaling
    approximate: str
    out_name: str
    impl: str
    ln_eps: float | None = None  # a float: h is the block's input x, LayerNorm(x) fused into its quantization


def _bias_for(b, n: int, dtype: str):
    """The GEMM epilogue's bias over ``n`` (padded) output columns, in the output's dtype."""
    b = b.astype(dtype)
    return b if b.shape[0] == n else jnp.pad(b, (0, n - b.shape[0]))


def _mlp_forward(h, w1, b1, w2, b2, ln, fp8_weights, cfg: _MlpCfg):
    (m, k), f, n = h.shape, w1.shape[1], w2.shape[1]
    pad = gemm_pad_to(m, k, f, n)
    c = _Cfg(cfg.recipe, cfg.out_name, cfg.impl)
    side = cfg.recipe.weight_block[0]
    ln_saved = None
    if cfg.ln_eps is None:
        qh = _quantize(h, c, pad)
    else:  # LayerNorm(h) straight to FP8 with its transpose, and the rows' statistics for the backward
        r = block_layernorm_quantize(h, *ln, cfg.ln_eps, cfg.recipe, transpose=True, pad_to=pad, impl=cfg.impl)
        qh, ln_saved = r.quantized, (h, r.mean, r.rstd, *ln)
    if fp8_weights is None:
        qw1, qw2 = _quantize(w1, c, pad, weight=True), _quantize(w2, c, pad, weight=True)
    else:
        qw1, qw2 = (padded_weight(q, cfg.recipe, pad) for q in fp8_weights)
    z = G.fp8_block_gemm(qh.data, qw1.data_t, qh.scale_inv, qw1.scale_inv_t, 1, side, cfg.out_name,
                         bias=_bias_for(b1, qw1.data_t.shape[0], cfg.out_name), impl=cfg.impl)[:m, :f]
    # gelu(z) straight to FP8 with its transpose (z's own rows and columns, zero-padded by the kernel)
    qa = block_gelu_quantize(z, cfg.recipe, approximate=cfg.approximate, transpose=True, pad_to=pad, impl=cfg.impl)
    y = G.fp8_block_gemm(qa.data, qw2.data_t, qa.scale_inv, qw2.scale_inv_t, 1, side, cfg.out_name,
                         bias=_bias_for(b2, qw2.data_t.shape[0], cfg.out_name), impl=cfg.impl)[:m, :n]
    return y, (qh.data_t, qh.scale_inv_t, qw1.data, qw1.scale_inv, z, qa.data_t, qa.scale_inv_t, qw2.data,
               qw2.scale_inv), ln_saved


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _block_mlp(h, w1, b1, w2, b2, ln, fp8_weights, cfg: _MlpCfg):
    return _mlp_forward(h, w1, b1, w2, b2, ln, fp8_weights, cfg)[0]


def _mlp_fwd(h, w1, b1, w2, b2, ln, fp8_weights, cfg: _MlpCfg):
    y, saved, ln_saved = _mlp_forward(h, w1, b1, w2, b2, ln, fp8_weights, cfg)
    # (empty arrays carry the gradients' dtypes and H, which the padded operands do not)
    dtypes = tuple(jnp.zeros((0,), a.dtype) for a in (w1, b1, w2, b2))
    return y, (saved, jnp.zeros((0, h.shape[1]), h.dtype), dtypes, fp8_weights, ln_saved)


def _mlp_bwd(cfg: _MlpCfg, res, g):
    (h_t, h_ts, w1_q, w1_s, z, a_t, a_ts, w2_q, w2_s), h0, (w10, b10, w20, b20), fp8_weights, ln_saved = res
    (m, n), k, f = g.shape, h0.shape[1], z.shape[1]
    pad = gemm_pad_to(m, k, f, n)
    r, side, impl = cfg.recipe, cfg.recipe.weight_block[0], cfg.impl
    qg = block_quantize(g, r, grad=True, transpose=True, dbias=True, pad_to=pad, impl=impl)  # with b2's gradient
    dw2 = G.fp8_block_gemm(a_t, qg.data_t, a_ts, qg.scale_inv_t, 1, 1, w20.dtype, impl=impl)[:f, :n]
    da = G.fp8_block_gemm(qg.data, w2_q, qg.scale_inv, w2_s, 1, side, z.dtype, impl=impl)[:m, :f]
    # the gelu's backward straight to FP8 with its transpose and b1's gradient
    qz = block_dgelu_quantize(da, z, r, approximate=cfg.approximate, transpose=True, dbias=True, pad_to=pad,
                              impl=impl)
    dh = G.fp8_block_gemm(qz.data, w1_q, qz.scale_inv, w1_s, 1, side, h0.dtype, impl=impl)[:m, :k]
    dw1 = G.fp8_block_gemm(h_t, qz.data_t, h_ts, qz.scale_inv_t, 1, 1, w10.dtype, impl=impl)[:k, :f]
    dln = None
    if ln_saved is not None:  # the GEMM's dh is the LayerNorm output's gradient: through its backward to x
        dh, *dln = layernorm_backward(dh, *ln_saved)
        dln = tuple(dln)
    return (dh, dw1, qz.dbias.astype(b10.dtype), dw2, qg.dbias.astype(b20.dtype), dln,
            _zeros_like(fp8_weights))


_block_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def check_mlp_shapes(h, w1, b1, w2, b2) -> None:
    """The MLP's operands chain: h (M, H), w1 (H, F), b1 (F,), w2 (F, N), b2 (N,) (every MLP's check)."""
    if h.shape[1] != w1.shape[0] or w1.shape[1] != w2.shape[0]:
        raise ValueError(f"shapes do not chain: h {h.shape}, w1 {w1.shape}, w2 {w2.shape}")
    if b1.shape != (w1.shape[1],) or b2.shape != (w2.shape[1],):
        raise ValueError(f"b1 must have shape {(w1.shape[1],)} and b2 {(w2.shape[1],)}; got {b1.shape}, {b2.shape}")


def check_fp8_weight_pair(fp8_weights, w1, w2, recipe, check_one):
    """None, or (fc1's, fc2's) cached weights, each checked by ``check_one(q, w, recipe, argname)``
    (the recipe's own check: per tensor or block)."""
    if fp8_weights is None:
        return None
    if not isinstance(fp8_weights, (tuple, list)) or len(fp8_weights) != 2:
        raise TypeError(f"fp8_weights must be None or a pair (fc1's, fc2's) of quantize_weight results; got "
                        f"{type(fp8_weights).__name__}")
    return (check_one(fp8_weights[0], w1, recipe, "fp8_weights[0]"),
            check_one(fp8_weights[1], w2, recipe, "fp8_weights[1]"))


def block_mlp(h, w1, b1, w2, b2, recipe: BlockScaling = BlockScaling(), *, approximate: str = "tanh",
              out_dtype=None, impl: str = "auto", fp8_weights=None, ln_weight=None, ln_bias=None,
              ln_eps: float | None = None):
    """``gelu(h @ w1 + b1) @ w2 + b2`` with FP8 GEMMs under block scaling, differentiable once.

    The linears are :func:`block_dot`'s, their biases added in the GEMMs' epilogue; the gelu is
    fused: the first GEMM's output z goes through one block_gelu_quantize kernel into the second
    GEMM's input (gelu(z) is never written in 16 or 32 bits), and the backward quantizes the
    gelu gradient with its transpose and b1's gradient in one block_dgelu_quantize kernel (b2's
    comes with the output gradient's quantization). z is saved in ``out_dtype``; everything else
    saved is FP8.

    Parameters
    ----------
    h : (M, H); w1 : (H, F), b1 : (F,); w2 : (F, N), b2 : (N,); float32 / float16 / bfloat16
    recipe : fusedfp8.BlockScaling
    approximate : 'tanh' or 'none' (the gelu, as ``jax.nn.gelu(approximate=...)`` True / False)
    out_dtype : the dtype of z and of the output (h's by default); the gradients come in their
        operands' dtypes
    impl : as :func:`block_dot`
    fp8_weights : None, or ``(quantize_weight(w1, None, recipe), quantize_weight(w2, None,
        recipe))`` of this step, reused as :func:`block_dot`'s ``fp8_weight``
    ln_eps : None, or a number >= 0: the block is ``LayerNorm -> Linear -> gelu -> Linear``, h is
        its input x, and LayerNorm(x) (weight ``ln_weight``, bias ``ln_bias``: (H,) arrays of one
        float dtype, or None) goes straight to FP8 with its transpose
        (:func:`fusedfp8.jax.block.block_layernorm_quantize`: never written in 16 or 32 bits); x
        and the rows' mean and rstd are saved, and the LayerNorm's backward runs in JAX (float32)

    Raises
    ------
    TypeError, ValueError
        As :func:`block_dot`, and on shapes that do not chain or biases of the wrong shape.
    """
    ops, out_name, impl = _check_call(recipe, {"h": h, "w1": w1, "w2": w2, "b1": b1, "b2": b2}, out_dtype, impl)
    h, w1, b1, w2, b2 = (ops[k] for k in ("h", "w1", "b1", "w2", "b2"))
    check_mlp_shapes(h, w1, b1, w2, b2)
    fp8_weights = check_fp8_weight_pair(fp8_weights, w1, w2, recipe, check_fp8_weight)
    ln_eps, ln = check_mlp_layernorm(ln_weight, ln_bias, ln_eps, h.shape[1])
    return _block_mlp(h, w1, b1, w2, b2, ln, fp8_weights,
                      _MlpCfg(recipe, check_approximate(approximate), out_name, impl, ln_eps))
