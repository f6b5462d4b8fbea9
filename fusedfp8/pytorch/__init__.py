"""PyTorch integration: ``Fp8Linear`` (a drop-in for ``nn.Linear``), ``Fp8MLP`` (LayerNorm ->
Linear -> gelu -> Linear with the activation fused into FP8), ``convert_to_fp8`` and the
once-per-step ``update_model_scales``.

::

    import fusedfp8
    import fusedfp8.pytorch as fp8

    model = fp8.convert_to_fp8(model, fusedfp8.DelayedScaling())   # nn.Linear -> Fp8Linear
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
        fp8.update_model_scales(model)    # once per optimizer step; forgetting it raises

Modules: ``custom_ops`` and ``amax_ops`` (the ``torch.ops.fusedfp8.*`` custom ops), ``op_plans`` (a
call's checked launch plan), ``cpp_path`` (the ops' C++ implementation: ``use_cpp``,
``launch_path``), ``autograd`` (the FP8 linear's and MLP's autograd functions), ``ste``
(``quantize_ste``), ``block`` (block scaling: ``block_quantize`` and its custom op), ``block_layers``
(the block-scaled layers: ``block_linear``, ``Fp8BlockLinear`` and ``Fp8BlockMLP``, which
``Fp8Linear`` and ``Fp8MLP`` build for a ``BlockScaling`` recipe), ``modules``
(``Fp8Linear``), ``mlp`` (``Fp8MLP``), ``module_checks`` (the modules' input, state and load
checks), ``scaling`` (model-level state linking, ``update_model_scales``, the amax all-reduce),
``convert`` (``convert_to_fp8`` and ``plan_fp8_conversion``: every ``nn.Linear``, or with
``policy='auto'`` those predicted faster in FP8, see :mod:`fusedfp8.policy`), ``gemm`` (the layers'
FP8 GEMM ``scaled_mm`` and its ``gemm=`` choice on CUDA: the shim's cuBLASLt GEMM or
``torch._scaled_mm``).
"""
from . import amax_ops, block, custom_ops  # noqa: F401  (register torch.ops.fusedfp8.*)
from .block_layers import Fp8BlockLinear, Fp8BlockMLP, block_linear
from .convert import convert_to_fp8, plan_fp8_conversion
from .gemm import gemm_path
from .mlp import Fp8MLP
from .modules import Fp8Linear, MissedScaleUpdateError, MissedScaleUpdateWarning
from .scaling import PendingScaleUpdate, fp8_modules, update_model_scales
from .ste import quantize_ste

__all__ = ["Fp8Linear", "Fp8BlockLinear", "block_linear", "Fp8MLP", "Fp8BlockMLP", "convert_to_fp8",
           "plan_fp8_conversion", "update_model_scales", "PendingScaleUpdate",
           "fp8_modules", "MissedScaleUpdateError", "MissedScaleUpdateWarning", "quantize_ste", "gemm_path"]
