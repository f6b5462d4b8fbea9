"""Autograd functions over the custom ops: the FP8 linear and the fused LayerNorm-free MLP core
(Linear -> gelu -> Linear). The straight-through quantizer is :mod:`fusedfp8.pytorch.ste`; the
GEMM they call, :func:`fusedfp8.pytorch.gemm.scaled_mm`.

GEMM layouts. ``torch._scaled_mm(a, b)`` wants ``a`` (M, K) row-major and ``b`` (K, N)
column-major; the ``.t()`` of a row-major (N, K) tensor is a column-major (K, N) one. With the
input x (M, K), the weight w (N, K) and the output gradient g (M, N), each quantized once with
its transpose (``x_t`` (K, M), ``w_t`` (K, N), ``g_t`` (N, M)):

    forward  y  = x @ w.T   = _scaled_mm(x_q,   w_q.t())      (M, K) x (K, N)
    dgrad    dx = g @ w     = _scaled_mm(g_q,   w_t_q.t())    (M, N) x (N, K)
    wgrad    dw = g.T @ x   = _scaled_mm(g_t_q, x_t_q.t())    (N, M) x (M, K)

so the forward saves only ``x_t_q``, ``w_t_q`` and their ``scale_inv``, never the bf16 input or
weight.

Any shape. cuBLASLt's FP8 GEMMs need every dimension a multiple of 16. When one is not (a last
batch of 1000 tokens, a vocabulary of 50257), every operand of the layer is quantized with
``pad_to=16``: the quantize kernels write it (and its transpose) into a buffer rounded up to
multiples of 16 with zeros in the pad, in the same pass, so the GEMMs run on the padded operands
(the zeros add exact zeros to every sum) and their results are sliced back. Token counts
(rows) slice for free (a contiguous view); ragged feature dimensions cost a slice, a copy of
the MLP's pre-activation and a padded bias. The CPU emulation runs the same padded path. Their backwards are FP8 GEMMs of saved FP8 tensors, not differentiable again: they are
``once_differentiable`` (a second derivative, e.g. a gradient penalty, raises instead of being
silently wrong). Every ``scale_inv`` handed to a GEMM is the one the quantize kernel wrote into a (1,)
buffer of its own: 16-byte aligned as cuBLASLt requires (column views of the state are not),
and frozen for the backward (the state moves on at the next update). The forward GEMM uses
fast accumulation, the backward GEMMs (long reductions over tokens) the precise one, as
Transformer Engine and torchao do. On CUDA the GEMMs run ``torch._scaled_mm`` or the shim's
``fusedfp8::fp8_gemm_lt`` (the layer's ``gemm``, :mod:`fusedfp8.pytorch.gemm`; the same operands
either way: the op takes (M, K) and (N, K), i.e. ``a`` and ``b.t()`` of the calls above). On the CPU the same calls run through
:func:`~fusedfp8.pytorch.gemm.scaled_mm`'s float32 emulation of ``_scaled_mm`` on the exact FP8 values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..formats import get_format
from ..types import gemm_pad_to
from . import amax_ops
from . import custom_ops as fops
from .gemm import scaled_mm
from .weights import WeightCache

__all__ = ["linear", "mlp", "quantized_weight", "reduce_current", "LinearConfig", "MLPConfig"]


# ---- the configurations of the autograd functions (frozen: hashable, constants under torch.compile) --


@dataclass(frozen=True)
class LinearConfig:
    """Everything but the tensors of one FP8 linear (:class:`_LinearFn`)."""

    col: int  # the state column of the input; the weight's is col + 1, the output gradient's col + 2
    fwd_fmt: str  # the input's and the weight's format
    grad_fmt: str  # the output gradient's
    margin_factor: float
    current_first: bool  # a tensor's first step quantizes with its own amax (False: the state's scale)
    need_dgrad: bool  # the forward writes the weight's transpose (for dx)
    need_wgrad: bool  # the forward writes the input's transpose (for dw)
    pad: int  # every operand padded to multiples of it (gemm_pad_to)
    gemm: str  # the CUDA GEMM backend (scaled_mm's)
    amax_group: str | None = None  # the process group (its name) of CurrentScaling across ranks


@dataclass(frozen=True)
class MLPConfig:
    """Everything but the tensors of the fused MLP core (:class:`_MLPFn`)."""

    c1: int  # fc1's state columns: h, w1, dz = c1, c1 + 1, c1 + 2
    c2: int  # fc2's: gelu(z), w2, dy = c2, c2 + 1, c2 + 2
    fwd_fmt: str
    grad_fmt: str
    margin_factor: float
    current_first1: bool  # fc1's tensors' first steps quantize with their own amax
    current_first2: bool  # fc2's
    approximate: str  # the gelu: 'tanh' or 'none'
    training: bool  # a backward follows: the forward writes the transposes and saves for it
    pad: int  # every operand padded to multiples of it (gemm_pad_to)
    ln_eps: float | None  # not None: the input is LayerNorm's, fused into h's quantization
    gemms: tuple  # the CUDA GEMM backends of fc1's and fc2's GEMMs
    amax_group: str | None = None  # the process group (its name) of CurrentScaling across ranks


def _unpad(t: Tensor, rows: int, cols: int) -> Tensor:
    """The (rows, cols) corner of a padded GEMM result (a view; contiguous when only rows were padded)."""
    return t if tuple(t.shape) == (rows, cols) else t[:rows, :cols]


def _padded_bias(bias: Tensor | None, n: int) -> Tensor | None:
    return bias if bias is None or bias.shape[0] == n else torch.nn.functional.pad(bias, (0, n - bias.shape[0]))


def _as_2d(t: Tensor) -> Tensor:
    """``t`` as (prod(shape[:-1]), shape[-1]) (also when a dimension is 0, where -1 is ambiguous)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _bias_grad(g2: Tensor, bias_dtype: torch.dtype) -> Tensor:
    return g2.sum(0, dtype=torch.float32).to(bias_dtype)


# ---- FP8 linear ------------------------------------------------------------------------------
def _quantize(x: Tensor, state: tuple, index: int, fmt: str, margin_factor: float, current_first: bool,
              transpose: bool, pad_to: int = 1) -> tuple[Tensor, Tensor | None, Tensor]:
    """(q, q_t or None, scale_inv) of tensor ``index``, with the transpose only when asked."""
    if transpose:
        return fops.call(fops.quantize_t, x, *state, index, fmt, margin_factor, current_first, pad_to)
    q, si = fops.call(fops.quantize, x, *state, index, fmt, margin_factor, current_first, pad_to)
    return q, None, si


def _amax(x: Tensor, b: Tensor | None = None, op: str = "identity", approximate: str = "tanh") -> Tensor:
    """(2,) float32, the amax of ``op(x, b)`` in element 0 (:func:`fusedfp8.pytorch.amax_ops.amax`)."""
    return fops.call(amax_ops.amax, x.detach().contiguous(), None if b is None else b.detach().contiguous(), op,
                     approximate)


def reduce_current(amaxes: list, state: tuple, col: int, fmt: str, margin_factor: float, group: str) -> None:
    """CurrentScaling across the ranks of process group ``group`` (its name) for the tensors of
    columns ``col .. col + len(amaxes) - 1`` of ``state`` (amax_history, scale, scale_inv, ...):
    their local amaxes (:func:`_amax`) MAX-reduced in ONE all_reduce, then staged with their
    current scales (:func:`fusedfp8.pytorch.amax_ops.reduce_current_scales`); the tensors are
    then quantized with ``current_first=False`` (the scale given)."""
    fops.call(amax_ops.reduce_current_scales, torch.stack(amaxes), state[0], state[1], state[2], col,
              get_format(fmt).max, margin_factor, group)


class _LinearFn(torch.autograd.Function):
    """y = x @ w.T + b with x (tensor 0) and w (tensor 1) in E4M3-style forward format, the
    output gradient (tensor 2) in the gradient format; see the module docstring for layouts.

    ``apply(x, weight, bias, w_q, w_t, w_si, amax_history, scale, scale_inv, updates, cfg)``: the
    weight quantized by :func:`quantized_weight` (``w_t`` None without ``cfg.need_dgrad``), the
    module's state and a :class:`LinearConfig`. With ``cfg.amax_group`` the output gradient's amax
    is reduced across the ranks before its cast (:func:`reduce_current`; ``cfg.current_first`` is
    then False).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, w_q, w_t, w_si, amax_history, scale, scale_inv, updates, cfg: LinearConfig):
        state = (amax_history, scale, scale_inv, updates)
        x2 = _as_2d(x).contiguous()
        (m, k), n = x2.shape, weight.shape[0]
        x_q, x_t, x_si = _quantize(x2, state, cfg.col, cfg.fwd_fmt, cfg.margin_factor, cfg.current_first,
                                   cfg.need_wgrad, cfg.pad)
        y = scaled_mm(x_q, w_q.t(), x_si, w_si, _padded_bias(bias, w_q.shape[0]), x.dtype, True, cfg.gemm)
        y = _unpad(y, m, n)
        ctx.save_for_backward(x_t, w_t, x_si, w_si)
        ctx.state, ctx.cfg, ctx.dims = state, cfg, (m, k, n)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x_t, w_t, x_si, w_si = ctx.saved_tensors
        cfg: LinearConfig = ctx.cfg
        g2 = _as_2d(grad).contiguous()
        dx = dw = db = None
        if x_t is not None or w_t is not None:
            m, k, n = ctx.dims
            col = cfg.col + 2
            if cfg.amax_group is not None:
                reduce_current([_amax(g2)], ctx.state, col, cfg.grad_fmt, cfg.margin_factor, cfg.amax_group)
            g_q, g_t, g_si = fops.call(fops.quantize_t, g2, *ctx.state, col, cfg.grad_fmt, cfg.margin_factor,
                                       cfg.current_first, cfg.pad)
            if w_t is not None:
                dx = _unpad(scaled_mm(g_q, w_t.t(), g_si, w_si, None, ctx.x_dtype, False, cfg.gemm), m,
                            k).reshape(ctx.x_shape)
            if x_t is not None:
                dw = _unpad(scaled_mm(g_t, x_t.t(), g_si, x_si, None, ctx.w_dtype, False, cfg.gemm), n, k).contiguous()
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = _bias_grad(g2, ctx.bias_dtype)
        return (dx, dw, db) + (None,) * 8


def quantized_weight(w: Tensor, state: tuple, col: int, fmt: str, margin_factor: float, current_first: bool,
                     transpose: bool, pad: int, cache: WeightCache | None):
    """(w_q, w_t or None, scale_inv) of the weight in column ``col``, from ``cache`` when it holds
    this weight at this scale epoch (:class:`fusedfp8.pytorch.weights.WeightCache`)."""
    key = None if cache is None else cache.key_of(w, state, (col, transpose, pad))
    return WeightCache.through(cache, key, w, lambda: _quantize(w.detach().contiguous(), state, col, fmt, margin_factor,
                                                               current_first, transpose, pad))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, state: tuple, cfg: tuple, need_dgrad: bool,
           need_wgrad: bool, cache: WeightCache | None = None, gemm: str = "scaled_mm",
           amax_group: str | None = None) -> Tensor:
    """The FP8 linear: ``state`` = (amax_history, scale, scale_inv, updates, col) with columns
    col, col + 1, col + 2 = (input, weight, output gradient); ``cfg`` = (fwd_fmt, grad_fmt, margin_factor, current_first);
    ``gemm`` the CUDA backend of its three GEMMs (:func:`scaled_mm`'s); ``amax_group``: None, or the
    name of the process group of CurrentScaling across ranks (one all_reduce for the input and
    the weight before their casts, one for the output gradient in the backward).
    Inputs are checked by the caller (:class:`fusedfp8.pytorch.Fp8Linear`)."""
    *st, col = state
    fwd_fmt, grad_fmt, mf, cf = cfg
    if amax_group is not None:
        reduce_current([_amax(x), _amax(weight)], st, col, fwd_fmt, mf, amax_group)
        cf = False
    m = math.prod(x.shape[:-1])
    pad = gemm_pad_to(x.shape[-1], weight.shape[0], *((m,) if need_wgrad else ()))  # tokens: a K only in wgrad
    w_q, w_t, w_si = quantized_weight(weight, tuple(st), col + 1, fwd_fmt, mf, cf, need_dgrad, pad, cache)
    return _LinearFn.apply(x, weight, bias, w_q, w_t, w_si, *st, LinearConfig(
        col, fwd_fmt, grad_fmt, mf, cf, need_dgrad, need_wgrad, pad, gemm, amax_group))


# ---- fused MLP core: Linear -> gelu -> Linear ------------------------------------------------
class _MLPFn(torch.autograd.Function):
    """y = fc2(gelu(fc1(h))), with the activation quantized straight from the fc1 GEMM's output
    by the gelu+quantize+transpose kernel, and the backward's gelu gradient quantized with its
    transpose and the fc1 bias gradient by the dgelu+quantize+transpose+dbias kernel.

    fc1 (ffn, hidden) state columns: h, w1, dz. fc2 (hidden, ffn) state columns: a = gelu(z),
    w2, dy. Saved: h_t_q, w1_t_q, the pre-activation z (bf16: the gelu backward needs it),
    a_t_q, w2_t_q and the scale_inv their quantize ops returned.

    ``apply(h, ln_w, ln_b, w1, b1, w2, b2, w1_q, w1_t, w1_si, w2_q, w2_t, w2_si, hist1, scale1,
    scale_inv1, updates1, hist2, scale2, scale_inv2, updates2, cfg, w2_cache)``: the weights
    quantized by :func:`quantized_weight`, fc1's and fc2's states (fc2's None when both columns
    are in one linked state: dynamo refuses a tensor given twice), an :class:`MLPConfig`, and
    fc2's :class:`WeightCache` (or None), a holder this forward may fill, not configuration.

    With ``cfg.ln_eps`` (not None) the input is the MLP block's input x, and h = LayerNorm(x)
    (weight ``ln_w``, bias ``ln_b``) comes quantized from the layernorm_quantize kernel with its
    transpose and the per-row mean and rstd: h is never written in bf16. The LayerNorm backward
    runs in torch from the saved x, mean and rstd (``native_layer_norm_backward`` on CUDA).

    ``cfg.amax_group`` (CurrentScaling across ranks, see :func:`reduce_current`): the name of the
    process group over which the amaxes of gelu(z) and w2 are reduced (one all_reduce) before
    their casts, here, since z exists only now: fc2's weight is then quantized in here (``w2_q``,
    ``w2_t``, ``w2_si`` None; from ``w2_cache`` where it holds it), and in the backward those of
    dy and of the gelu gradient, one all_reduce each. h and w1 were reduced by :func:`mlp`.
    """

    @staticmethod
    def forward(ctx, h, ln_w, ln_b, w1, b1, w2, b2, w1_q, w1_t, w1_si, w2_q, w2_t, w2_si, hist1, scale1, scale_inv1,
                updates1, hist2, scale2, scale_inv2, updates2, cfg: MLPConfig, w2_cache=None):
        st1 = (hist1, scale1, scale_inv1, updates1)
        st2 = st1 if hist2 is None else (hist2, scale2, scale_inv2, updates2)
        fmt, mf, c1, c2, pad = cfg.fwd_fmt, cfg.margin_factor, cfg.c1, cfg.c2, cfg.pad
        h2 = _as_2d(h).contiguous()
        (m, hid), ffn, out = h2.shape, w1.shape[0], w2.shape[0]
        ln_saved = ()
        if cfg.ln_eps is None:
            h_q, h_t, h_si = _quantize(h2, st1, c1, fmt, mf, cfg.current_first1, cfg.training, pad)
        else:
            h_q, h_t, h_si, mean, rstd = fops.call(fops.layernorm_quantize, h2, ln_w, ln_b, cfg.ln_eps, *st1, c1, fmt,
                                                   mf, cfg.current_first1, cfg.training, pad)
            h_t = h_t if cfg.training else None
            ln_saved = (h2, mean, rstd, ln_w, ln_b)
        z = scaled_mm(h_q, w1_q.t(), h_si, w1_si, _padded_bias(b1, w1_q.shape[0]), h.dtype, True, cfg.gemms[0])
        z = _unpad(z, m, ffn).contiguous()  # the pad of z holds the bias: not an input of the activation
        if cfg.amax_group is not None:  # gelu(z) and w2: one all_reduce, then their casts with the scales given
            reduce_current([_amax(z, None, "gelu", cfg.approximate), _amax(w2)], st2, c2, fmt, mf, cfg.amax_group)
            w2_q, w2_t, w2_si = quantized_weight(w2, st2, c2 + 1, fmt, mf, cfg.current_first2, cfg.training, pad,
                                                 w2_cache)
        if cfg.training:
            a_q, a_t, a_si = fops.call(fops.gelu_quantize_t, z, *st2, c2, fmt, mf, cfg.current_first2,
                                       cfg.approximate, pad)
        else:
            (a_q, a_si), a_t = fops.call(fops.gelu_quantize, z, *st2, c2, fmt, mf, cfg.current_first2,
                                         cfg.approximate, pad), None
        y = _unpad(scaled_mm(a_q, w2_q.t(), a_si, w2_si, _padded_bias(b2, w2_q.shape[0]), h.dtype, True,
                             cfg.gemms[1]), m, out)
        if cfg.training:
            ctx.save_for_backward(h_t, w1_t, z, a_t, w2_t, h_si, w1_si, a_si, w2_si, *ln_saved)
            ctx.ln = cfg.ln_eps is not None, ln_w is not None, ln_b is not None
            ctx.states, ctx.cfg = (st1, st2), cfg
            ctx.dims = (m, hid, ffn, out)
            ctx.meta = (h.shape, h.dtype, w1.dtype, w2.dtype, None if b1 is None else b1.dtype,
                        None if b2 is None else b2.dtype)
        return y.reshape(*h.shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        h_t, w1_t, z, a_t, w2_t, h_si, w1_si, a_si, w2_si, *ln_saved = ctx.saved_tensors
        st1, st2 = ctx.states
        cfg: MLPConfig = ctx.cfg
        fmt, mf, approximate, pad, group = cfg.grad_fmt, cfg.margin_factor, cfg.approximate, cfg.pad, cfg.amax_group
        h_shape, h_dtype, w1_dtype, w2_dtype, b1_dtype, b2_dtype = ctx.meta
        gy = _as_2d(grad).contiguous()
        m, hid, ffn, out = ctx.dims
        if group is not None:
            reduce_current([_amax(gy)], st2, cfg.c2 + 2, fmt, mf, group)
        gy_q, gy_t, gy_si = fops.call(fops.quantize_t, gy, *st2, cfg.c2 + 2, fmt, mf, cfg.current_first2, pad)
        g1, g2 = cfg.gemms
        da = _unpad(scaled_mm(gy_q, w2_t.t(), gy_si, w2_si, None, z.dtype, False, g2), m, ffn).contiguous()
        dw2 = _unpad(scaled_mm(gy_t, a_t.t(), gy_si, a_si, None, w2_dtype, False, g2), out, ffn).contiguous()
        db2 = _bias_grad(gy, b2_dtype) if b2_dtype is not None else None
        if group is not None:
            reduce_current([_amax(da, z, "dgelu", approximate)], st1, cfg.c1 + 2, fmt, mf, group)
        dz_q, dz_t, db1, dz_si = fops.call(fops.dgelu_quantize_t, da, z, *st1, cfg.c1 + 2, fmt, mf,
                                           cfg.current_first1, approximate, b1_dtype is not None, pad)
        dh = _unpad(scaled_mm(dz_q, w1_t.t(), dz_si, w1_si, None, h_dtype, False, g1), m, hid)
        dw1 = _unpad(scaled_mm(dz_t, h_t.t(), dz_si, h_si, None, w1_dtype, False, g1), ffn, hid).contiguous()
        db1 = db1.to(b1_dtype) if b1_dtype is not None else None
        dlw = dlb = None
        if ctx.ln[0]:
            dh, dlw, dlb = _layernorm_backward(dh.contiguous(), *ln_saved[:3], ln_saved[3] if ctx.ln[1] else None,
                                               ln_saved[-1] if ctx.ln[2] else None, ctx.needs_input_grad[1:3])
        return (dh.reshape(h_shape), dlw, dlb, dw1, db1, dw2, db2) + (None,) * 16


def _layernorm_backward(dh: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, w: Tensor | None, b: Tensor | None,
                        need: tuple) -> tuple:
    """(dx, dweight, dbias) of LayerNorm(x) from its saved (rows,) float32 mean and rstd."""
    if x.is_cuda:  # torch's kernel takes float32 statistics for a bf16 / fp16 input on CUDA
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dh, x, [x.shape[-1]], mean.view(-1, 1), rstd.view(-1, 1), w, b,
            [True, w is not None and need[0], b is not None and need[1]])
        return dx, dw, db
    g, xhat = dh.float(), (x.float() - mean[:, None]) * rstd[:, None]
    dw = (g * xhat).sum(0).to(w.dtype) if w is not None and need[0] else None
    db = g.sum(0).to(b.dtype) if b is not None and need[1] else None
    if w is not None:
        g = g * w.float()
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw, db


def mlp(h: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, state1: tuple, state2: tuple,
        cfg: tuple, approximate: str, training: bool, caches: tuple = (None, None), norm=None,
        gemms: tuple = ("scaled_mm", "scaled_mm"), amax_group: str | None = None) -> Tensor:
    """fc2(gelu(fc1(h))) in FP8 with the fused activation kernels; ``state1``/``state2`` as in
    :func:`linear` (with their columns), ``cfg`` = (fwd_fmt, grad_fmt, margin_factor, current_first1, current_first2);
    ``training`` = a backward will follow (the forward then also writes the transposes);
    ``caches``: the :class:`WeightCache` of fc1 and fc2 (or None); ``norm``: an ``nn.LayerNorm``
    whose output h is (then ``h`` is its input, and the LayerNorm runs fused with the quantization
    of h); ``gemms``: the CUDA GEMM backends of fc1's and fc2's GEMMs (:func:`scaled_mm`'s);
    ``amax_group``: None, or the name of the process group of CurrentScaling across ranks (one
    all_reduce per GEMM's operand pair in the forward, (h, w1) here and (gelu(z), w2) in
    :class:`_MLPFn`, and one per quantized gradient in the backward: 4 per training step)."""
    fwd_fmt, grad_fmt, mf, cf1, cf2 = cfg
    m = math.prod(h.shape[:-1])
    pad = gemm_pad_to(h.shape[-1], w1.shape[0], w2.shape[0], *((m,) if training else ()))
    w2_cache = None
    if amax_group is not None:
        h2 = _as_2d(h)
        ah = _amax(h2) if norm is None else fops.call(
            amax_ops.layernorm_amax, h2.detach().contiguous(), *(None if p is None else p.detach() for p in (
                norm.weight, norm.bias)), float(norm.eps))
        reduce_current([ah, _amax(w1)], state1[:4], state1[4], fwd_fmt, mf, amax_group)
        cf1 = cf2 = False
        w2_cache = None if torch.compiler.is_compiling() else caches[1]
    w1q = quantized_weight(w1, tuple(state1[:4]), state1[4] + 1, fwd_fmt, mf, cf1, training, pad, caches[0])
    w2q = (None, None, None) if amax_group is not None else quantized_weight(
        w2, tuple(state2[:4]), state2[4] + 1, fwd_fmt, mf, cf2, training, pad, caches[1])
    st2 = tuple(state2[:4])
    if all(a is b for a, b in zip(state1[:4], st2)):  # both columns of one linked state:
        st2 = (None,) * 4  # passed once (dynamo refuses a tensor given twice)
    ln_w, ln_b, ln_eps = (None, None, None) if norm is None else (norm.weight, norm.bias, float(norm.eps))
    config = MLPConfig(state1[4], state2[4], fwd_fmt, grad_fmt, mf, cf1, cf2, approximate, training, pad, ln_eps,
                       tuple(gemms), amax_group)
    return _MLPFn.apply(h, ln_w, ln_b, w1, b1, w2, b2, *w1q, *w2q, *state1[:4], *st2, config, w2_cache)
