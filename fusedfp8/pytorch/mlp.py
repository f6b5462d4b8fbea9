"""``Fp8MLP``: LayerNorm -> Fp8Linear -> gelu -> Fp8Linear, with the LayerNorm and the activation
fused into FP8 (the autograd function :func:`fusedfp8.pytorch.autograd.mlp`). Its state lives in
its two :class:`~fusedfp8.pytorch.Fp8Linear` layers (:mod:`fusedfp8.pytorch.modules`, whose
docstring covers the state, the missed-update check and current scaling across ranks).
"""
from __future__ import annotations

import torch
from torch import nn

from ..recipe import BlockScaling, DelayedScaling
from ..types import check_approximate, check_recipe
from . import autograd as F8
from . import gemm as G
from .module_checks import _FLOATS, _check_input, _check_state_writable, _StrictLoad, check_amax_group
from .modules import Fp8Linear

__all__ = ["Fp8MLP"]

_FUSED_LN_MAX = 16384  # widest row the MLP's fused LayerNorm takes (the kernel's transposed tile fits)


class Fp8MLP(_StrictLoad, nn.Module):
    """LayerNorm -> Fp8Linear -> gelu -> Fp8Linear, with the LayerNorm and the activation fused into FP8.

    The LayerNorm runs inside the quantization of the first GEMM's input (the layernorm_quantize
    kernel: its output is never written in bf16; its backward runs in torch from the saved input,
    mean and rstd). The first GEMM's output z (the pre-activation) goes straight through the gelu + quantize
    (+ transpose) kernel into the second GEMM's input slot: gelu(z) is never written in bf16.
    The backward quantizes the gelu gradient with its transpose and the first bias gradient in
    one dgelu kernel. z is saved for the backward (in the input's dtype); everything else saved
    is FP8.

    Parameters
    ----------
    hidden, ffn : int
        Input/output width and the inner width (fc1: hidden -> ffn, fc2: ffn -> hidden).
    recipe : DelayedScaling or CurrentScaling (a BlockScaling builds
        :class:`~fusedfp8.pytorch.block_layers.Fp8BlockMLP` instead)
    approximate : {'tanh', 'none'}
        The gelu (as ``torch.nn.functional.gelu``).
    bias : bool
    device, dtype, missed_update, gemm : as :class:`Fp8Linear` (``gemm`` is given to fc1 and fc2;
        each runs its own three GEMMs with its own ``gemm`` attribute).
    amax_group : torch.distributed ProcessGroup or None
        CurrentScaling across ranks, as :class:`Fp8Linear`'s (given to fc1 and fc2, which must
        agree): one all_reduce for (LayerNorm(x), w1), one for (gelu(z), w2), one for each of the
        two quantized gradients; 4 per training step.

    Attributes: ``norm`` (nn.LayerNorm), ``fc1``, ``fc2`` (Fp8Linear, owning the states),
    ``fuse_layernorm`` (default True; False runs ``norm`` in torch and quantizes its bf16 output,
    as do a ``norm`` replaced by another module and hidden > 16384).
    Input (..., hidden); output (..., hidden) in the input's dtype. Errors as Fp8Linear.
    """

    def __new__(cls, *args, **kwargs):
        """``Fp8MLP(..., recipe=BlockScaling())`` builds :class:`fusedfp8.pytorch.block_layers.Fp8BlockMLP`."""
        if cls is Fp8MLP and isinstance(kwargs.get("recipe", args[2] if len(args) > 2 else None), BlockScaling):
            from .block_layers import Fp8BlockMLP
            return Fp8BlockMLP(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, hidden: int, ffn: int, recipe: DelayedScaling = DelayedScaling(), *,
                 approximate: str = "tanh", bias: bool = True, device=None, dtype=None,
                 missed_update: str = "raise", gemm: str = "auto", amax_group=None):
        check_approximate(approximate)
        G.check_gemm(gemm)
        if isinstance(check_recipe(recipe, block=True), BlockScaling):  # (a subclass: __new__ did not swap it)
            check_recipe(recipe)
        check_amax_group(amax_group, recipe)
        super().__init__()
        self.approximate = approximate
        self.fuse_layernorm = True
        self.norm = nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.fc1 = Fp8Linear(hidden, ffn, bias, recipe, device, dtype, missed_update=missed_update, gemm=gemm,
                             amax_group=amax_group)
        self.fc2 = Fp8Linear(ffn, hidden, bias, recipe, device, dtype, missed_update=missed_update, gemm=gemm,
                             amax_group=amax_group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # checked here, before the LayerNorm's parameters are copied: a refused load changes nothing
        self.fc1._check_loaded_state(state_dict, prefix + "fc1.")
        self.fc2._check_loaded_state(state_dict, prefix + "fc2.")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.fc1, self.fc2
        if fc1.recipe != fc2.recipe:
            raise ValueError(f"Fp8MLP: fc1 and fc2 must share one recipe; got {fc1.recipe} and {fc2.recipe}")
        if fc1._amax_group != fc2._amax_group:
            raise ValueError(f"Fp8MLP: fc1 and fc2 must share one amax_group; got the groups named "
                             f"{fc1._amax_group!r} and {fc2._amax_group!r}")
        layer = type(self).__name__
        w1, w2 = fc1.weight, fc2.weight  # (once: a parametrized weight is computed at every access)
        _check_input(layer, x, fc1.in_features, w1)
        _check_state_writable(layer, fc1, fc2)
        if w2.dtype not in _FLOATS:
            raise TypeError(f"{layer}: fc2.weight must be float32, float16 or bfloat16; got {w2.dtype}")
        norm = self.norm
        fused = (self.fuse_layernorm and type(norm) is nn.LayerNorm and norm.normalized_shape == (fc1.in_features,)
                 and fc1.in_features <= _FUSED_LN_MAX)
        h = x if fused else norm(x)
        training = torch.is_grad_enabled() and (h.requires_grad or any(
            p.requires_grad for p in (w1, fc1.bias, w2, fc2.bias, *norm.parameters()) if p is not None))
        if not torch.compiler.is_compiling():
            fc1._watch.see(fc1, w1)
            fc2._watch.see(fc2, w2)
        cfg = fc1._kernel_cfg() + fc2._kernel_cfg()[-1:]
        gemms = (fc1._gemm_backend(h), fc2._gemm_backend(h))
        return F8.mlp(h, w1, fc1.bias, w2, fc2.bias, fc1._state(), fc2._state(), cfg,
                      self.approximate, training, (fc1._wcache, fc2._wcache), norm if fused else None, gemms,
                      fc1._amax_group)
