"""``python -m fusedfp8 demo``: train docs/design.md's MLP with FP8 delayed scaling next to bf16.

The model is LayerNorm -> Linear(hidden, ffn) -> gelu(tanh) -> Linear(ffn, hidden), trained with
Adam (lr 1e-3) on a fixed regression task (:mod:`fusedfp8.demo.task`: x ~ N(0, 1), y = a random
teacher MLP of x at unit variance, MSE loss), twice from the same bf16 weights and data: once in
plain bf16, once with fusedfp8's FP8 path (both GEMMs in FP8, gelu fused into the quantization,
the scales updated once per step). It reports, per model, the median step time, the speed-up of
FP8 over bf16, the losses and the overflow count, and draws the loss curves, their ratio per step
and, for every FP8 tensor, its amax and its scale over the steps.

Where it runs. With a CUDA GPU, CuPy and FP8 support (the capability probe says so), on the
GPU at the shape of docs/design.md (hidden 4096, ffn 16384, 8192 tokens). Otherwise on the CPU
through the reference path at a small shape: the FP8 numerics are then emulated bit-exactly
(torch: in NumPy, the GEMMs in float32; jax: in jax.numpy, with XLA's FP8 GEMMs in software), so
the CPU step times say nothing about FP8 speed; the loss curves and the scaling state are the
real thing. The median step time leaves out the first three steps.

The package: :mod:`~fusedfp8.demo.config` (:class:`DemoConfig`, the device choice,
:class:`Curve`), :mod:`~fusedfp8.demo.task` (the data and the bf16 twins, shared with the
benchmarks in ``scripts/``), one runner per framework (:mod:`~fusedfp8.demo.torch_runner`,
:mod:`~fusedfp8.demo.jax_runner`: ``train(config, device, bar)`` returning
``{'bf16': Curve, 'fp8': Curve}`` and ``meta(device)``), :mod:`~fusedfp8.demo.report` (the
table, the JSON, the plot) and :mod:`~fusedfp8.demo.bench` (``python -m fusedfp8 bench``).

Library use::

    from fusedfp8.demo import DemoConfig, run_demo
    result = run_demo(DemoConfig(steps=20, out="demo_out"))
    print(result.table())
"""
from __future__ import annotations

import importlib
import platform
import time
from pathlib import Path
from typing import Callable

from .config import (CPU_SHAPE, DEVICES, FRAMEWORKS, GPU_SHAPE, LOSS_TAIL, TENSOR_ROLES, WARMUP_STEPS, Curve,
                     DemoConfig, DemoError, choose_device)
from .report import DemoResult, plot

__all__ = ["run_demo", "DemoConfig", "DemoResult", "DemoError", "Curve", "choose_device", "plot", "CPU_SHAPE",
           "GPU_SHAPE", "DEVICES", "FRAMEWORKS", "LOSS_TAIL", "TENSOR_ROLES", "WARMUP_STEPS"]


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, text):
        pass

    def set_postfix_str(self, text):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True)


def _check_packages(config: DemoConfig) -> None:
    need = []
    if config.progress:
        need.append("tqdm")
    if config.plot:
        need.append("matplotlib")
    need += ["torch"] if config.framework == "torch" else ["jax", "flax", "optax"]
    missing = []
    for name in need:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        extra = "demo" if config.framework == "torch" else "demo,jax"
        raise DemoError(f"python -m fusedfp8 demo needs {', '.join(missing)}: pip install 'fusedfp8[{extra}]' "
                        "(or pass --no-plot / --no-progress to do without matplotlib / tqdm)")


def run_demo(config: DemoConfig = DemoConfig(), echo: Callable[[str], None] | None = print) -> DemoResult:
    """Train bf16 and FP8, write ``demo_summary.md``, ``demo.json`` and ``demo.png`` to
    ``config.out`` and return the :class:`DemoResult`.

    ``echo`` receives the human-readable lines (None: silent); the last one says where the
    files went.

    Raises
    ------
    DemoError
        A package is missing, ``device='cuda'`` on a machine whose GPU the probe refuses, or
        jax without a GPU backend on such a machine.
    """
    from .. import __version__
    from . import report

    say = echo or (lambda s: None)
    device, reason = choose_device(config.device)
    _check_packages(config)
    runner = importlib.import_module(f"{__name__}.{config.framework}_runner")
    shape = config.shape_for(device)
    say(f"fusedfp8 demo: {config.framework} on {device} ({reason}); hidden {shape[0]}, ffn {shape[1]}, "
        f"{shape[2]} tokens, {config.steps} steps each for bf16 and FP8")
    t0 = time.perf_counter()
    bar = _progress_bar(2 * config.steps, config.progress)
    try:
        curves = runner.train(config, device, bar)
    finally:
        bar.close()
    meta = {**runner.meta(device), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "train_wall_s": time.perf_counter() - t0, "fusedfp8": __version__}
    result = DemoResult(config, device, meta["device_name"], reason, shape, curves, meta)
    out = Path(config.out).resolve()
    report.write(result, out)
    say("")
    say(result.table())
    say("")
    say("FP8 scaling state after the last step (ScalingState.summary):")
    say(curves["fp8"].state_table)
    say("")
    say(f"wrote {', '.join(Path(f).name for f in result.files.values())} to {out}/")
    return result
