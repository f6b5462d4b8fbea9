"""The FP8 linear layer under block scaling (:class:`fusedfp8.BlockScaling`): :func:`block_dot`,
``x @ w`` with the forward and both gradient GEMMs in FP8 (``custom_vjp``), which
:func:`fusedfp8.jax.fp8_dot` and the flax ``Fp8DotGeneral`` run for that recipe.

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
from ..types import check_recipe, gemm_pad_to
from . import gemm as G
from . import primitives as P
from .block import block_quantize

__all__ = ["block_dot"]


class _Cfg(NamedTuple):
    recipe: BlockScaling
    out_name: str
    impl: str


def _quantize(t, cfg: _Cfg, pad: int, **role):
    return block_quantize(t, cfg.recipe, transpose=True, pad_to=pad, impl=cfg.impl, **role)


def _forward(x, w, cfg: _Cfg):
    (m, k), n = x.shape, w.shape[1]
    pad = gemm_pad_to(m, k, n)
    qx = _quantize(x, cfg, pad)
    qw = _quantize(w, cfg, pad, weight=True)
    side = cfg.recipe.weight_block[0]
    y = G.fp8_block_gemm(qx.data, qw.data_t, qx.scale_inv, qw.scale_inv_t, 1, side, cfg.out_name, impl=cfg.impl)
    return y[:m, :n], (qx.data_t, qx.scale_inv_t, qw.data, qw.scale_inv)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _block_dot(x, w, cfg: _Cfg):
    return _forward(x, w, cfg)[0]


def _fwd(x, w, cfg: _Cfg):
    y, saved = _forward(x, w, cfg)
    # (empty arrays carry dx's and dw's dtypes and K, which the padded operands do not)
    return y, (saved, jnp.zeros((0, x.shape[1]), x.dtype), jnp.zeros((0,), w.dtype))


def _bwd(cfg: _Cfg, res, g):
    (x_t, x_ts, w_q, w_s), x0, w0 = res
    (m, n), k = g.shape, x0.shape[1]
    pad = gemm_pad_to(m, k, n)
    qg = _quantize(g, cfg, pad, grad=True)
    side = cfg.recipe.weight_block[0]
    dx = G.fp8_block_gemm(qg.data, w_q, qg.scale_inv, w_s, 1, side, x0.dtype, impl=cfg.impl)[:m, :k]
    dw = G.fp8_block_gemm(x_t, qg.data_t, x_ts, qg.scale_inv_t, 1, 1, w0.dtype, impl=cfg.impl)[:k, :n]
    return dx, dw


_block_dot.defvjp(_fwd, _bwd)


def block_dot(x, w, recipe: BlockScaling = BlockScaling(), *, out_dtype=None, impl: str = "auto"):
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

    Raises
    ------
    TypeError, ValueError
        On a recipe that is not a BlockScaling, an operand of the wrong dtype or rank, K that
        disagrees, or a bad ``out_dtype`` / ``impl``, naming the argument, before anything runs.
    """
    check_recipe(recipe, block=True)
    if not isinstance(recipe, BlockScaling):
        raise TypeError(f"recipe must be a fusedfp8.BlockScaling; got {type(recipe).__name__} (fp8_dot takes the "
                        "per-tensor recipes with a meta)")
    x, w = jnp.asarray(x), jnp.asarray(w)
    for name, a in (("x", x), ("w", w)):
        if a.dtype.name not in ("float32", "float16", "bfloat16"):
            raise TypeError(f"{name} must be float32, float16 or bfloat16; got {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{name} must be 2-D; got shape {a.shape}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x (M, K) and w (K, N) must agree on K; got {x.shape} and {w.shape}")
    out_name = jnp.dtype(out_dtype or x.dtype).name
    if out_name not in ("float32", "float16", "bfloat16"):
        raise TypeError(f"out_dtype must be float32, float16 or bfloat16; got {out_name}")
    return _block_dot(x, w, _Cfg(recipe, out_name, P._check_impl(impl)))
