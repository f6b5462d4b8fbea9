"""PyTorch integration: custom ops, autograd functions, ``Fp8Linear``, ``Fp8MLP`` (and ``MLP``,
its plain-torch reference).

::

    import fusedfp8
    import fusedfp8.pytorch as fp8

    model = fp8.convert_to_fp8(model, fusedfp8.DelayedScaling())   # nn.Linear -> Fp8Linear
    for x, y in data:
        loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
        fp8.update_scales(model)          # once per optimizer step; forgetting it raises

Modules: ``ops`` (the ``torch.ops.fusedfp8.*`` custom ops), ``functional`` (``quantize_ste``,
``scaled_mm`` and the autograd functions), ``modules`` (``Fp8Linear``, ``Fp8MLP``, ``MLP``),
``convert`` (``convert_to_fp8``, ``update_scales``).
"""
from . import ops
from .convert import PendingScaleUpdate, convert_to_fp8, fp8_modules, update_scales
from .functional import QuantizeSTE, quantize_ste, scaled_mm
from .modules import MLP, Fp8Linear, Fp8MLP, MissedScaleUpdateError, MissedScaleUpdateWarning

__all__ = ["ops", "convert_to_fp8", "fp8_modules", "update_scales", "PendingScaleUpdate", "QuantizeSTE", "quantize_ste", "scaled_mm",
           "Fp8Linear", "Fp8MLP", "MLP", "MissedScaleUpdateError", "MissedScaleUpdateWarning"]
