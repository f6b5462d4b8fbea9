"""``convert_to_fp8``: swapping a model's ``nn.Linear`` modules for :class:`Fp8Linear`, all of them
or those that a policy predicts faster in FP8 (``policy='auto'``, see :mod:`fusedfp8.policy`)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..policy import ConversionReport, Decision, check_dims, check_mode, check_policy, find_table
from ..recipe import BlockScaling, DelayedScaling
from ..types import check_recipe
from .gemm import check_gemm
from .module_checks import check_amax_group, check_block_module_args
from .modules import MISSED_UPDATE_MODES, Fp8Linear

__all__ = ["convert_to_fp8", "plan_fp8_conversion"]

REPORT_ATTR = "fp8_conversion_report"


def _check_plan_args(model, filter_fn, policy, tokens, policy_table, mode) -> tuple[str, str | None]:
    """(policy, mode): the policy as 'all' or 'auto', the mode ('eager' where None) with 'auto'."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be callable(fqn, module) -> bool or None; got {type(filter_fn).__name__}")
    policy = check_policy(policy)
    if policy == "auto" and tokens is None:
        raise ValueError("tokens is required with policy='auto': the number of rows each linear layer sees per step "
                         "(batch x sequence length per micro-batch, per rank); got None")
    if tokens is not None:
        try:
            check_dims(tokens, 1, 1)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (the rows each linear layer sees per step)") from None
    for arg, value in (("policy_table", policy_table), ("mode", mode)):
        if value is not None and policy != "auto":
            raise ValueError(f"{arg} is only read by policy='auto'; got policy={policy!r}")
    if policy != "auto":
        return policy, None
    return policy, "eager" if mode is None else check_mode(mode)


def _device_name(weight: torch.Tensor) -> str | None:
    """The CUDA name of the GPU a layer runs on: its weight's, else the current one (a model
    converted on the CPU or the meta device and moved later), else None."""
    if weight.device.type == "cuda":
        return torch.cuda.get_device_name(weight.device)
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _plan(model: nn.Module, filter_fn, policy: str, tokens, policy_table, mode) -> ConversionReport:
    candidates = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear]
    tables, decisions = {}, []
    for fqn, m in candidates:
        if filter_fn is not None and not filter_fn(fqn, m):
            decisions.append(Decision(fqn, tokens, m.in_features, m.out_features, False, "filter_fn returned False"))
        elif policy == "all":
            decisions.append(Decision(fqn, tokens, m.in_features, m.out_features, True, "policy='all'"))
        else:
            name = None if policy_table is not None else _device_name(m.weight)
            if name not in tables:
                tables[name] = find_table(name, policy_table)
            decisions.append(tables[name].decide(tokens, m.in_features, m.out_features, name=fqn, mode=mode))
    used = "; ".join(t.describe() for t in tables.values())
    return ConversionReport(policy, tokens, used, tuple(decisions), mode)


def plan_fp8_conversion(model: nn.Module, filter_fn: Callable[[str, nn.Linear], bool] | None = None, *,
                        policy: str | None = None, tokens: int | None = None, policy_table=None,
                        mode: str | None = None) -> ConversionReport:
    """What :func:`convert_to_fp8` with these arguments would convert, and why, without changing
    ``model``: a :class:`fusedfp8.policy.ConversionReport` (``print()`` it for a table)."""
    policy, mode = _check_plan_args(model, filter_fn, policy, tokens, policy_table, mode)
    return _plan(model, filter_fn, policy, tokens, policy_table, mode)


def convert_to_fp8(model: nn.Module, recipe: DelayedScaling = DelayedScaling(),
                   filter_fn: Callable[[str, nn.Linear], bool] | None = None, *,
                   missed_update: str = "raise", policy: str | None = None, tokens: int | None = None,
                   policy_table=None, mode: str | None = None, gemm: str = "auto", amax_group=None) -> nn.Module:
    """Swap the ``nn.Linear`` modules of ``model`` for :class:`Fp8Linear`, in place: every one, or
    those that ``filter_fn`` and ``policy`` select.

    Only modules whose type is exactly ``nn.Linear`` are swapped (subclasses such as
    ``NonDynamicallyQuantizableLinear`` inside ``nn.MultiheadAttention`` are called through
    their weights, not their forward, and are left alone). The new modules take over the
    original Parameter objects (an optimizer built before the conversion keeps working) and
    start with a fresh state on the weight's device.

    Parameters
    ----------
    model : nn.Module
    recipe : DelayedScaling, CurrentScaling or BlockScaling, shared by every converted module (a
        BlockScaling makes stateless :class:`~fusedfp8.pytorch.block_layers.Fp8BlockLinear` modules)
    filter_fn : callable(fqn, linear) -> bool, optional
        Convert only the modules for which it returns True (``fqn`` is the module's name in
        ``model.named_modules()``). It is asked first; ``policy`` decides among the rest.
    missed_update : {'raise', 'warn', 'ignore'}, see :class:`Fp8Linear`.
    gemm : {'auto', 'cublaslt', 'scaled_mm'}, the FP8 GEMM on CUDA of every converted module, see
        :class:`Fp8Linear` and :mod:`fusedfp8.pytorch.gemm`.
    amax_group : torch.distributed ProcessGroup or None
        CurrentScaling only: every converted module reduces its amaxes over this group before each
        cast (see :class:`Fp8Linear`); with DelayedScaling pass the group to ``update_model_scales``.
    policy : {None, 'all', 'auto'}
        None or 'all': convert every module (that ``filter_fn`` accepts). 'auto': convert a
        module only where FP8 is predicted faster than bf16 for its (tokens, in_features,
        out_features), from the GPU's calibration table (see :mod:`fusedfp8.policy`); the others
        stay ``nn.Linear``.
    tokens : int, required with policy='auto'
        The rows each linear layer sees per step (batch x sequence length of one micro-batch on
        one rank), which the module cannot know.
    policy_table : fusedfp8.policy.PolicyTable or path, optional (policy='auto' only)
        The calibration table; by default ``$FUSEDFP8_POLICY_TABLE``, else the table shipped for
        the GPU the weights are on (or the current GPU, for a model still on the CPU).
    mode : {None, 'eager', 'graphed', 'compiled'} (policy='auto' only)
        How the model's train steps will run, which decides how much the host's launch time
        counts: 'eager' (None: the default, a plain PyTorch loop), 'graphed' (the step captured
        in a CUDA graph and replayed: ``torch.cuda.graphs``, ``torch.cuda.make_graphed_callables``)
        or 'compiled' (``torch.compile``; decided from the graphed figures, an approximation: see
        :mod:`fusedfp8.policy`). Under graphs FP8 wins on smaller layers than eagerly, so a graphed
        or compiled model must say so.

    Returns
    -------
    nn.Module
        ``model`` itself, converted in place; if ``model`` is itself an ``nn.Linear`` (it has no
        parent to swap it in), the new Fp8Linear (or ``model``, if it stays in high precision).
        Its attribute ``fp8_conversion_report`` holds the :class:`fusedfp8.policy.ConversionReport`:
        per ``nn.Linear``, whether it was converted, why, and with ``policy='auto'`` the mode,
        the predicted fp8 and bf16 times and where they come from (the table and which of its
        measured modes; ``print()`` it for a table).
        Nothing is logged.

    Raises
    ------
    TypeError, ValueError
        A bad argument (named in the message), raised before any module is swapped.
    fusedfp8.policy.MissingTableError
        policy='auto' without a calibration table for the GPU (``python -m fusedfp8 bench
        --calibrate`` measures one), or :class:`fusedfp8.policy.MissingModeError` when the table
        lacks the mode's measurements (a table of eager steps only, with mode='graphed' or
        'compiled'); raised before any module is swapped.
    """
    policy, mode = _check_plan_args(model, filter_fn, policy, tokens, policy_table, mode)
    check_recipe(recipe, block=True)
    if missed_update not in MISSED_UPDATE_MODES:
        raise ValueError(f"missed_update must be one of {MISSED_UPDATE_MODES}; got {missed_update!r}")
    check_gemm(gemm)
    if isinstance(recipe, BlockScaling):
        check_block_module_args(missed_update, amax_group)
    else:
        check_amax_group(amax_group, recipe)
    report = _plan(model, filter_fn, policy, tokens, policy_table, mode)
    converted = set(report.converted)
    if type(model) is nn.Linear:
        out = Fp8Linear.from_linear(model, recipe, missed_update=missed_update, gemm=gemm,
                                                         amax_group=amax_group) if "" in converted else model
        setattr(out, REPORT_ATTR, report)
        return out
    for fqn in report.converted:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child), recipe, missed_update=missed_update,
                                                               gemm=gemm, amax_group=amax_group))
    setattr(model, REPORT_ATTR, report)
    return model
