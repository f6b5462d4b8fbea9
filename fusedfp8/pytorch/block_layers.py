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
from .block import block_quantize_op
from .module_checks import _check_input, check_block_module_args
from .weights import CachedFp8Weight, WeightCache, watch_steps

__all__ = ["Fp8BlockLinear", "Fp8BlockMLP", "block_linear", "quantized_weight", "BlockLinearConfig"]


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
              transpose: bool = False) -> tuple:
    """(q, scale_inv, q_t, scale_inv_t) of the 2-D ``t`` (q_t / scale_inv_t empty without ``transpose``)."""
    q, s, q_t, s_t, _, _ = block_quantize_op(t, cfg.fp8_format, cfg.weight_side, cfg.pow2, weight, grad, transpose,
                                             cfg.pad)
    return q, s, q_t, s_t


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
        x_q, x_s, x_t, x_ts = _quantize(x2, cfg, transpose=cfg.need_wgrad)
        b = bias if bias is None or bias.shape[0] == w_q.shape[0] else \
            torch.nn.functional.pad(bias, (0, w_q.shape[0] - bias.shape[0]))
        y = G.block_scaled_mm(x_q, w_q, x_s, w_s, 1, cfg.weight_side, b, x.dtype, cfg.gemm)
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
        if cfg.need_dgrad or cfg.need_wgrad:
            g_q, g_s, g_t, g_ts = _quantize(g2, cfg, grad=True, transpose=cfg.need_wgrad)
            if cfg.need_dgrad:
                dx = G.block_scaled_mm(g_q, w_t, g_s, w_ts, 1, cfg.weight_side, None, ctx.x_dtype, cfg.gemm)
                dx = _unpad(dx, m, k).reshape(ctx.x_shape)
            if cfg.need_wgrad:
                dw = _unpad(G.block_scaled_mm(g_t, x_t, g_ts, x_ts, 1, 1, None, ctx.w_dtype, cfg.gemm), n,
                            k).contiguous()
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None


def quantized_weight(w: Tensor, cfg: BlockLinearConfig, cache: WeightCache | None) -> tuple:
    """(w_q, w_s, w_t, w_ts) of the weight (the transpose only with ``cfg.need_dgrad``), from
    ``cache`` when it holds this weight quantized for this call
    (:class:`fusedfp8.pytorch.weights.WeightCache`: the weight's version, storage and layout;
    block scaling has no scale epoch)."""
    key = None if cache is None else cache.key_of(
        w, None, ("block", cfg.fp8_format, cfg.weight_side, cfg.pow2, cfg.need_dgrad, cfg.pad))
    return WeightCache.through(cache, key, w,
                               lambda: _quantize(w.detach().contiguous(), cfg, weight=True, transpose=cfg.need_dgrad))


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

    The LayerNorm and the gelu run in torch between the two block-scaled linears (their outputs
    written in the input's dtype, then block-quantized in one pass each); the fused LayerNorm and
    gelu kernels of the per-tensor Fp8MLP take one scale per tensor.

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
        self.norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.fc1 = Fp8BlockLinear(hidden, ffn, bias, recipe, device, dtype, gemm=gemm, missed_update=missed_update,
                                  amax_group=amax_group)
        self.fc2 = Fp8BlockLinear(ffn, hidden, bias, recipe, device, dtype, gemm=gemm, missed_update=missed_update,
                                  amax_group=amax_group)

    @property
    def recipe(self) -> BlockScaling:
        return self.fc1.recipe

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)), approximate=self.approximate))
