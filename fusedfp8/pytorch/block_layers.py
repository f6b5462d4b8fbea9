"""The FP8 linear under block scaling (:class:`fusedfp8.BlockScaling`): :func:`block_linear` and
the module :class:`Fp8BlockLinear`, which ``Fp8Linear(..., recipe=BlockScaling())``,
``Fp8Linear.from_linear`` and ``convert_to_fp8`` build for that recipe; and :class:`Fp8BlockMLP`,
which ``Fp8MLP(..., recipe=BlockScaling())`` builds.

Block scaling keeps no state: every quantization takes the scales of its own blocks' maxes in
the pass that casts it (the block_quantize kernel, :mod:`fusedfp8.pytorch.block`), so there is
no amax history, no update per optimizer step and nothing to synchronise across ranks. With x
(M, K), the weight w (N, K) and the output gradient g (M, N), every GEMM operand K-contiguous:

    forward  y  = x @ w.T   x_q (M, K) 1x128        x  w_q   (N, K) weight_block
    dgrad    dx = g @ w     g_q (M, N) 1x128        x  w_t_q (K, N) weight_block (transposed)
    wgrad    dw = g.T @ x   g_t_q (N, M) 1x128      x  x_t_q (K, M) 1x128

(:func:`fusedfp8.pytorch.gemm.block_scaled_mm`; the transposed copies come from the same pass as
the data, 1x128 ones with their own scales along the other axis). The forward saves only the
FP8 transposes and their scales. Every GEMM dimension is padded to a multiple of 16 where one is
not (the kernels write the zero pad in the same pass; the results are sliced back), the tokens
included, so that each 1x128 scale array's rows are exactly the operand's (no pad columns for
``torch._scaled_mm``'s blockwise checks). The three GEMMs take the split accumulator, the only
one cuBLASLt offers with block scales. On the CPU the same calls run the NumPy definition of the
bytes and a float32 product of the dequantized operands.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..recipe import BlockScaling
from ..types import check_approximate, check_recipe, gemm_pad_to
from . import gemm as G
from .autograd import _layernorm_backward
from .block import block_layernorm_quantize_op, block_quantize_op
from .module_checks import _check_input, check_block_module_args
from .weights import CachedFp8Weight, WeightCache, watch_steps

__all__ = ["Fp8BlockLinear", "Fp8BlockMLP", "block_linear", "quantized_weight", "BlockLinearConfig", "BlockMLPConfig"]


@dataclass(frozen=True)
class BlockLinearConfig:
    """Everything but the tensors of one block-scaled linear (:class:`_BlockLinearFn`)."""

    fp8_format: str  # the recipe's: 'e4m3' or 'hybrid'
    weight_side: int  # the weight block's rows: 128 (128x128) or 1 (1x128)
    pow2: bool  # power-of-two scales
    need_dgrad: bool  # the forward writes the weight's transpose (for dx)
    need_wgrad: bool  # the forward writes the input's transpose (for dw)
    pad: int  # every operand padded to multiples of it
    gemm: str  # the CUDA GEMM backend (block_scaled_mm's)

    @staticmethod
    def of(recipe: BlockScaling, need_dgrad: bool, need_wgrad: bool, pad: int, gemm: str) -> "BlockLinearConfig":
        return BlockLinearConfig(recipe.fp8_format, recipe.weight_block[0], recipe.power_of_two_scales, need_dgrad,
                                 need_wgrad, pad, gemm)


def _quantize(t: Tensor, cfg: BlockLinearConfig, *, weight: bool = False, grad: bool = False,
              transpose: bool = False, op: str = "identity", b: Tensor | None = None, approximate: str = "tanh",
              dbias: bool = False) -> tuple:
    """(q, scale_inv, q_t, scale_inv_t, dbias) of ``op`` of the 2-D ``t`` (q_t / scale_inv_t empty
    without ``transpose``, dbias without ``dbias``): one block_quantize kernel."""
    q, s, q_t, s_t, _, db = block_quantize_op(t, cfg.fp8_format, cfg.weight_side, cfg.pow2, weight, grad, transpose,
                                              cfg.pad, op, b, approximate, dbias)
    return q, s, q_t, s_t, db


def _padded_bias(bias: Tensor | None, n: int) -> Tensor | None:
    """The bias of the GEMM's epilogue over ``n`` (padded) output columns: zeros in the pad."""
    return bias if bias is None or bias.shape[0] == n else torch.nn.functional.pad(bias, (0, n - bias.shape[0]))


def _unpad(t: Tensor, rows: int, cols: int) -> Tensor:
    return t if tuple(t.shape) == (rows, cols) else t[:rows, :cols]


class _BlockLinearFn(torch.autograd.Function):
    """y = x @ w.T + b, block-scaled; ``apply(x, weight, bias, w_q, w_s, w_t, w_ts, cfg)``: the
    weight quantized by :func:`quantized_weight` (``w_t`` / ``w_ts`` empty without
    ``cfg.need_dgrad``) and a :class:`BlockLinearConfig`."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_q, w_s, w_t, w_ts, cfg: BlockLinearConfig):
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).contiguous()
        (m, k), n = x2.shape, weight.shape[0]
        x_q, x_s, x_t, x_ts, _ = _quantize(x2, cfg, transpose=cfg.need_wgrad)
        y = G.block_scaled_mm(x_q, w_q, x_s, w_s, 1, cfg.weight_side, _padded_bias(bias, w_q.shape[0]), x.dtype,
                              cfg.gemm)
        y = _unpad(y, m, n)
        ctx.save_for_backward(x_t, x_ts, w_t, w_ts)
        ctx.cfg, ctx.dims = cfg, (m, k, n)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x_t, x_ts, w_t, w_ts = ctx.saved_tensors
        cfg: BlockLinearConfig = ctx.cfg
        m, k, n = ctx.dims
        g2 = grad.reshape(m, n).contiguous()
        dx = dw = db = None
        need_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        if cfg.need_dgrad or cfg.need_wgrad:  # (the bias gradient from the same pass: the column sums)
            g_q, g_s, g_t, g_ts, db = _quantize(g2, cfg, grad=True, transpose=cfg.need_wgrad, dbias=need_db)
            if cfg.need_dgrad:
                dx = G.block_scaled_mm(g_q, w_t, g_s, w_ts, 1, cfg.weight_side, None, ctx.x_dtype, cfg.gemm)
                dx = _unpad(dx, m, k).reshape(ctx.x_shape)
            if cfg.need_wgrad:
                dw = _unpad(G.block_scaled_mm(g_t, x_t, g_ts, x_ts, 1, 1, None, ctx.w_dtype, cfg.gemm), n,
                            k).contiguous()
        elif need_db:
            db = g2.sum(0, dtype=torch.float32)
        return dx, dw, db.to(ctx.bias_dtype) if need_db else None, None, None, None, None, None


@dataclass(frozen=True)
class BlockMLPConfig:
    """Everything but the tensors of one block-scaled MLP (:class:`_BlockMLPFn`): each linear's
    config and the gelu."""

    fc1: BlockLinearConfig  # need_dgrad: the input's gradient; need_wgrad: w1's
    fc2: BlockLinearConfig  # need_dgrad: anything before fc2 needs a gradient (the gelu's backward runs)
    approximate: str
    ln_eps: float | None = None  # a float: the input is x, and LayerNorm(x) is fused into its quantization


class _BlockMLPFn(torch.autograd.Function):
    """``fc2(gelu(fc1(h)))`` block-scaled, with the gelu fused into the quantization of fc2's input
    (block_gelu_quantize: gelu(z) is never written in 16 or 32 bits) and its backward, with fc1's
    bias gradient, into the quantization of fc1's output gradient (block_dgelu_quantize with dbias);
    fc2's bias gradient comes from the quantization of the output gradient. ``apply(h, ln_w, ln_b,
    w1, b1, w2, b2, w1_q, w1_s, w1_t, w1_ts, w2_q, w2_s, w2_t, w2_ts, cfg)``: the weights quantized
    by :func:`quantized_weight` and a :class:`BlockMLPConfig`. Saved: z (the pre-activation, in h's
    dtype) and FP8 operands.

    With ``cfg.ln_eps`` (not None) h is the block's input x, and LayerNorm(x) (weight ``ln_w``, bias
    ``ln_b``, either None) comes quantized from block_layernorm_quantize with its transpose and the
    rows' mean and rstd (LayerNorm(x) is never written in 16 or 32 bits); the LayerNorm's backward
    runs in torch from the saved x, mean and rstd, as :class:`fusedfp8.pytorch.Fp8MLP`'s."""

    @staticmethod
    def forward(ctx, h, ln_w, ln_b, w1, b1, w2, b2, w1_q, w1_s, w1_t, w1_ts, w2_q, w2_s, w2_t, w2_ts,
                cfg: BlockMLPConfig):
        c1, c2 = cfg.fc1, cfg.fc2
        h2 = h.reshape(math.prod(h.shape[:-1]), h.shape[-1]).contiguous()
        (m, k), f, n = h2.shape, w1.shape[0], w2.shape[0]
        ln_saved = ()
        if cfg.ln_eps is None:
            h_q, h_s, h_t, h_ts, _ = _quantize(h2, c1, transpose=c1.need_wgrad)
        else:
            h_q, h_s, h_t, h_ts, _, mean, rstd = block_layernorm_quantize_op(
                h2, ln_w, ln_b, cfg.ln_eps, c1.fp8_format, c1.pow2, c1.need_wgrad, c1.pad)
            ln_saved = (h2, mean, rstd, ln_w, ln_b) if c1.need_dgrad else ()
        z = G.block_scaled_mm(h_q, w1_q, h_s, w1_s, 1, c1.weight_side, _padded_bias(b1, w1_q.shape[0]), h.dtype,
                              c1.gemm)
        z = _unpad(z, m, f).contiguous()  # (the pad rows hold b1: gelu quantizes z's own rows, padded with zeros)
        a_q, a_s, a_t, a_ts, _ = _quantize(z, c2, transpose=c2.need_wgrad, op="gelu", approximate=cfg.approximate)
        y = G.block_scaled_mm(a_q, w2_q, a_s, w2_s, 1, c2.weight_side, _padded_bias(b2, w2_q.shape[0]), h.dtype,
                              c2.gemm)
        ctx.save_for_backward(h_t, h_ts, z if c2.need_dgrad else None, a_t, a_ts, w1_t, w1_ts, w2_t, w2_ts, *ln_saved)
        ctx.ln = bool(ln_saved)
        ctx.cfg, ctx.dims = cfg, (m, k, f, n)
        ctx.h_shape, ctx.h_dtype = h.shape, h.dtype
        ctx.dtypes = (w1.dtype, None if b1 is None else b1.dtype, w2.dtype, None if b2 is None else b2.dtype)
        return _unpad(y, m, n).reshape(*h.shape[:-1], n)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        h_t, h_ts, z, a_t, a_ts, w1_t, w1_ts, w2_t, w2_ts, *ln_saved = ctx.saved_tensors
        cfg: BlockMLPConfig = ctx.cfg
        c1, c2 = cfg.fc1, cfg.fc2
        m, k, f, n = ctx.dims
        w1_dt, b1_dt, w2_dt, b2_dt = ctx.dtypes
        need_db1 = b1_dt is not None and ctx.needs_input_grad[4]
        need_db2 = b2_dt is not None and ctx.needs_input_grad[6]
        g2 = grad.reshape(m, n).contiguous()
        dh = dw1 = db1 = dw2 = db2 = dlw = dlb = None
        if c2.need_dgrad or c2.need_wgrad:
            g_q, g_s, g_t, g_ts, db2 = _quantize(g2, c2, grad=True, transpose=c2.need_wgrad, dbias=need_db2)
            if c2.need_wgrad:
                dw2 = _unpad(G.block_scaled_mm(g_t, a_t, g_ts, a_ts, 1, 1, None, w2_dt, c2.gemm), n, f).contiguous()
            if c2.need_dgrad:
                da = G.block_scaled_mm(g_q, w2_t, g_s, w2_ts, 1, c2.weight_side, None, ctx.h_dtype, c2.gemm)
                da = _unpad(da, m, f).contiguous()
                gz_q, gz_s, gz_t, gz_ts, db1 = _quantize(da, c1, grad=True, transpose=c1.need_wgrad, op="dgelu", b=z,
                                                         approximate=cfg.approximate, dbias=need_db1)
                if c1.need_dgrad:
                    dh = G.block_scaled_mm(gz_q, w1_t, gz_s, w1_ts, 1, c1.weight_side, None, ctx.h_dtype, c1.gemm)
                    dh = _unpad(dh, m, k)
                    if ctx.ln:  # the GEMM's dh is the LayerNorm output's gradient: through its backward to x
                        dh, dlw, dlb = _layernorm_backward(dh.contiguous(), *ln_saved, ctx.needs_input_grad[1:3])
                    dh = dh.reshape(ctx.h_shape)
                if c1.need_wgrad:
                    dw1 = _unpad(G.block_scaled_mm(gz_t, h_t, gz_ts, h_ts, 1, 1, None, w1_dt, c1.gemm), f,
                                 k).contiguous()
        elif need_db2:
            db2 = g2.sum(0, dtype=torch.float32)
        return (dh, dlw, dlb, dw1, db1.to(b1_dt) if need_db1 else None, dw2, db2.to(b2_dt) if need_db2 else None,
                *(None,) * 9)


def quantized_weight(w: Tensor, cfg: BlockLinearConfig, cache: WeightCache | None) -> tuple:
    """(w_q, w_s, w_t, w_ts) of the weight (the transpose only with ``cfg.need_dgrad``), from
    ``cache`` when it holds this weight quantized for this call
    (:class:`fusedfp8.pytorch.weights.WeightCache`: the weight's version, storage and layout;
    block scaling has no scale epoch)."""
    key = None if cache is None else cache.key_of(
        w, None, ("block", cfg.fp8_format, cfg.weight_side, cfg.pow2, cfg.need_dgrad, cfg.pad))
    return WeightCache.through(cache, key, w, lambda: _quantize(w.detach().contiguous(), cfg, weight=True,
                                                                transpose=cfg.need_dgrad)[:4])


def block_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: BlockScaling, *, gemm: str = "auto") -> Tensor:
    """``x @ weight.T + bias`` with the three GEMMs in FP8 under block scaling (see the module
    docstring), differentiable once in ``x``, ``weight`` and ``bias``.

    Parameters
    ----------
    x : (..., K) float32 / float16 / bfloat16; the output has its dtype
    weight : (N, K) float32 / float16 / bfloat16 (dw in its dtype)
    bias : (N,) or None
    recipe : fusedfp8.BlockScaling
    gemm : {'auto', 'cublaslt', 'scaled_mm'}, the CUDA GEMM (:mod:`fusedfp8.pytorch.gemm`)

    Raises
    ------
    TypeError, ValueError
        On a recipe that is not a BlockScaling, a bad ``gemm``, input or weight (named), before
        anything runs.
    """
    check_recipe(recipe, block=True)
    if not isinstance(recipe, BlockScaling):
        raise TypeError(f"recipe must be a fusedfp8.BlockScaling; got {type(recipe).__name__} (Fp8Linear takes the "
                        "per-tensor recipes)")
    G.check_gemm(gemm)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D torch.Tensor (out_features, in_features); got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    _check_input("block_linear", x, weight.shape[1], weight)
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be None or a tensor of shape ({weight.shape[0]},); got "
                         f"{getattr(bias, 'shape', type(bias).__name__)}")
    return _run(x, weight, bias, recipe, G.backend_for(gemm, x))


def _run(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: BlockScaling, backend: str,
           cache: WeightCache | None = None) -> Tensor:
    enabled = torch.is_grad_enabled()
    need_dgrad, need_wgrad = enabled and x.requires_grad, enabled and weight.requires_grad
    m = math.prod(x.shape[:-1])
    pad = gemm_pad_to(m, x.shape[-1], weight.shape[0])  # the tokens too: see the module docstring
    cfg = BlockLinearConfig.of(recipe, need_dgrad, need_wgrad, pad, backend)
    return _BlockLinearFn.apply(x, weight, bias, *quantized_weight(weight, cfg, cache), cfg)


class Fp8BlockLinear(CachedFp8Weight, G.GemmChoice, nn.Linear):
    """``nn.Linear`` with its three GEMMs in FP8 under block scaling (a drop-in replacement; what
    ``Fp8Linear(..., recipe=BlockScaling())`` builds).

    Forward: the input (1x128 blocks, with its transpose for the weight gradient) and the weight
    (``recipe.weight_block``, with its transpose for the input gradient) are each quantized in
    one pass, and one block-scaled FP8 GEMM computes ``x @ w.T + b``; the backward quantizes the
    output gradient with its transpose in one pass and runs both gradient GEMMs in FP8. The FP8
    weight is kept until the weight changes (:attr:`cache_fp8_weight`). No state:
    nothing to update per optimizer step (``update_model_scales`` skips the module), and its
    ``state_dict`` is an ``nn.Linear``'s.

    Parameters
    ----------
    in_features, out_features : int
    bias : bool
    recipe : fusedfp8.BlockScaling
    device, dtype : as for ``nn.Linear``
    gemm : {'auto', 'cublaslt', 'scaled_mm'}
        The FP8 GEMM on CUDA (:mod:`fusedfp8.pytorch.gemm`; also a settable attribute).
    missed_update, amax_group
        Fp8Linear's arguments, taken so that the two build alike: ``missed_update`` is checked and
        has nothing to watch (no update to miss); ``amax_group`` must be None (no amax to reduce:
        each block's scale is its own max, the same on every rank).

    Raises
    ------
    TypeError, ValueError
        At construction, on a recipe that is not a BlockScaling, a bad ``gemm`` or
        ``missed_update``, or an ``amax_group``; in forward
        (before anything runs), on a non-float input or weight, a wrong feature count, or input
        and weight on different devices.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: BlockScaling = BlockScaling(), device=None, dtype=None, *, gemm: str = "auto",
                 missed_update: str = "raise", amax_group=None):
        check_recipe(recipe, block=True)
        if not isinstance(recipe, BlockScaling):
            raise TypeError(f"recipe must be a fusedfp8.BlockScaling; got {type(recipe).__name__} (Fp8Linear takes "
                            "the per-tensor recipes)")
        G.check_gemm(gemm)
        check_block_module_args(missed_update, amax_group)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._recipe = recipe
        self.gemm = gemm
        self._wcache = WeightCache()  # the FP8 weight between its changes (gradient accumulation)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: BlockScaling = BlockScaling(), *, gemm: str = "auto",
                    missed_update: str = "raise", amax_group=None) -> "Fp8BlockLinear":
        """An Fp8BlockLinear that takes over ``linear``'s Parameter objects (not copies)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear; got {type(linear).__name__}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                      dtype=linear.weight.dtype, gemm=gemm, missed_update=missed_update, amax_group=amax_group)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    @property
    def recipe(self) -> BlockScaling:
        return self._recipe

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._wcache.clear()  # (a move or a dtype change: another weight)
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._wcache.clear()

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        _check_input(type(self).__name__, x, self.in_features, w)
        if not torch.compiler.is_compiling():
            watch_steps(self)  # (optimizer steps move the weight's version: the cache then misses)
        return _run(x, w, self.bias, self._recipe, self._gemm_backend(x), self._wcache)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self._recipe}, gemm={self.gemm!r}"


class Fp8BlockMLP(nn.Module):
    """LayerNorm -> Fp8BlockLinear -> gelu -> Fp8BlockLinear: :class:`~fusedfp8.pytorch.Fp8MLP`
    under block scaling (what ``Fp8MLP(..., recipe=BlockScaling())`` builds), with its parameter
    names (``norm``, ``fc1``, ``fc2``), so state dicts carry over between the two and a plain
    torch MLP of those names.

    The gelu is fused (:class:`_BlockMLPFn`): fc1's output z goes through one block_gelu_quantize
    kernel into fc2's input slot (gelu(z) is never written in 16 or 32 bits), and the backward
    quantizes the gelu gradient with its transpose and fc1's bias gradient in one
    block_dgelu_quantize kernel; fc2's bias gradient comes with the output gradient's
    quantization. The LayerNorm is fused into the quantization of fc1's input
    (:func:`fusedfp8.block_layernorm_quantize`: the rows' statistics, then LayerNorm(x) cast tile by
    tile with its own blocks' scales, never written in 16 or 32 bits); its backward runs in torch
    from the saved x, mean and rstd. ``fuse_layernorm = False``, or a ``norm`` replaced by another
    module, runs ``norm`` in torch and block-quantizes its output.

    Parameters as :class:`~fusedfp8.pytorch.Fp8MLP`: ``hidden``, ``ffn``, ``recipe`` (a
    BlockScaling), ``approximate``, ``bias``, ``device``, ``dtype``, ``gemm``; ``missed_update``
    and ``amax_group`` as :class:`Fp8BlockLinear`'s.
    """

    def __init__(self, hidden: int, ffn: int, recipe: BlockScaling = BlockScaling(), *,
                 approximate: str = "tanh", bias: bool = True, device=None, dtype=None,
                 missed_update: str = "raise", gemm: str = "auto", amax_group=None):
        check_approximate(approximate)
        super().__init__()
        self.approximate = approximate
        self.fuse_layernorm = True
        self.norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.fc1 = Fp8BlockLinear(hidden, ffn, bias, recipe, device, dtype, gemm=gemm, missed_update=missed_update,
                                  amax_group=amax_group)
        self.fc2 = Fp8BlockLinear(ffn, hidden, bias, recipe, device, dtype, gemm=gemm, missed_update=missed_update,
                                  amax_group=amax_group)

    @property
    def recipe(self) -> BlockScaling:
        return self.fc1.recipe

    def forward(self, x: Tensor) -> Tensor:
        fc1, fc2 = self.fc1, self.fc2
        if fc1.recipe != fc2.recipe:
            raise ValueError(f"{type(self).__name__}: fc1 and fc2 must share one recipe; got {fc1.recipe} and "
                             f"{fc2.recipe}")
        w1, w2 = fc1.weight, fc2.weight  # (once: a parametrized weight is computed at every access)
        _check_input(type(self).__name__, x, fc1.in_features, w1)
        if tuple(w2.shape) != (fc1.in_features, fc1.out_features):
            raise ValueError(f"{type(self).__name__}: fc2.weight must have shape {(fc1.in_features, fc1.out_features)} "
                             f"(hidden, ffn); got {tuple(w2.shape)}")
        norm = self.norm
        fused = self.fuse_layernorm and type(norm) is nn.LayerNorm and norm.normalized_shape == (fc1.in_features,)
        ln_w, ln_b = (norm.weight, norm.bias) if fused else (None, None)
        h = x if fused else norm(x)
        if not torch.compiler.is_compiling():
            watch_steps(fc1)
            watch_steps(fc2)
        enabled = torch.is_grad_enabled()
        b1, b2 = fc1.bias, fc2.bias
        h_grad = enabled and any(t is not None and t.requires_grad for t in (h, ln_w, ln_b))
        upstream = h_grad or (enabled and (w1.requires_grad or (b1 is not None and b1.requires_grad)))
        pad = gemm_pad_to(math.prod(h.shape[:-1]), fc1.in_features, fc1.out_features)
        c1 = BlockLinearConfig.of(fc1.recipe, h_grad, enabled and w1.requires_grad, pad, fc1._gemm_backend(h))
        c2 = BlockLinearConfig.of(fc2.recipe, upstream, enabled and w2.requires_grad, pad, fc2._gemm_backend(h))
        cfg = BlockMLPConfig(c1, c2, self.approximate, float(norm.eps) if fused else None)
        return _BlockMLPFn.apply(h, ln_w, ln_b, w1, b1, w2, b2, *quantized_weight(w1, c1, fc1._wcache),
                                 *quantized_weight(w2, c2, fc2._wcache), cfg)
