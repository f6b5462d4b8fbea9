"""What the demo trains and where: :class:`DemoConfig`, the device choice, and :class:`Curve`,
what a runner hands back for one trained model."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from .. import launch
from ..recipe import DelayedScaling

GPU_SHAPE = (4096, 16384, 8192)  # hidden, ffn, tokens: the MLP of docs/design.md
CPU_SHAPE = (64, 256, 512)
WARMUP_STEPS = 3  # excluded from the median step time
LOSS_TAIL = 10  # the final loss is also given as the mean of the last 10 steps
TENSOR_ROLES = ("input", "weight", "grad_output")  # an FP8 linear's state, in order
DEVICES = ("auto", "cuda", "cpu")
FRAMEWORKS = ("torch", "jax")  # each has a runner module: fusedfp8.demo.<name>_runner


class DemoError(RuntimeError):
    """The demo cannot run as asked (missing package, no usable GPU)."""


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains and where.

    Parameters
    ----------
    framework : {'torch', 'jax'}
    device : {'auto', 'cuda', 'cpu'}
        'auto': the GPU when the capability probe accepts it (CUDA, CuPy, FP8), else the CPU.
    hidden, ffn, tokens : int or None
        The shape; None takes the default of the device (GPU 4096/16384/8192, CPU 64/256/512).
    steps : int >= 1
    lr : float > 0, Adam's learning rate
    seed : int, for the weights and the data
    recipe : DelayedScaling
    out : str, the output folder (created)
    plot : bool, write demo.png (needs matplotlib)
    progress : bool, show a tqdm progress bar (needs tqdm)
    """

    framework: str = "torch"
    device: str = "auto"
    hidden: int | None = None
    ffn: int | None = None
    tokens: int | None = None
    steps: int = 100
    lr: float = 1e-3
    seed: int = 0
    recipe: DelayedScaling = DelayedScaling()
    out: str = "fusedfp8_demo"
    plot: bool = True
    progress: bool = True

    def __post_init__(self):
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {FRAMEWORKS}; got {self.framework!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}; got {self.device!r}")
        for name in ("hidden", "ffn", "tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 (or None for the device default); got {v!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an int >= 1; got {self.steps!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0; got {self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an int; got {self.seed!r}")
        if not isinstance(self.recipe, DelayedScaling):
            raise TypeError(f"recipe must be a fusedfp8.DelayedScaling; got {type(self.recipe).__name__}")

    def shape_for(self, device: str) -> tuple[int, int, int]:
        default = GPU_SHAPE if device == "cuda" else CPU_SHAPE
        return tuple(d if v is None else v for v, d in zip((self.hidden, self.ffn, self.tokens), default))


def choose_device(requested: str) -> tuple[str, str]:
    """('cuda' | 'cpu', reason). 'auto' takes the GPU when the probe accepts it; an explicit
    'cuda' that the probe refuses raises :class:`DemoError` with the probe's reason."""
    ok, reason = launch.probe(0, need_fp8_gemm=True)
    if requested == "cpu":
        return "cpu", "--device cpu"
    if requested == "cuda" and not ok:
        raise DemoError(f"--device cuda: the GPU cannot run fusedfp8's FP8 path: {reason}")
    if ok:
        return "cuda", reason
    return "cpu", f"CPU reference path, because: {reason}"


@dataclass
class Curve:
    """One trained model: per-step losses and times; for FP8 also the per-tensor trace.

    ``amax`` (steps, n) is each tensor's staged amax of the step (what the scale update saw:
    NaN or inf is an overflow), ``scale`` (steps, n) its scale after that step's update,
    ``overflows`` (n,) the final counts, ``state_table`` the :meth:`ScalingState.summary` text
    of every FP8 tensor after the last step.
    """

    loss: np.ndarray
    step_ms: np.ndarray
    tensors: list = field(default_factory=list)
    amax: np.ndarray | None = None
    scale: np.ndarray | None = None
    overflows: np.ndarray | None = None
    state_table: str = ""

    def median_ms(self) -> float:
        t = self.step_ms[WARMUP_STEPS:] if len(self.step_ms) > WARMUP_STEPS else self.step_ms[-1:]
        return float(statistics.median(t))

    def tail_loss(self) -> float:
        return float(np.mean(self.loss[-LOSS_TAIL:]))


def tensor_names(modules) -> list[str]:
    """``'<module>.<role>'`` for every FP8 tensor of the named FP8 linears ``modules``, in state order."""
    return [f"{m}.{role}" for m in modules for role in TENSOR_ROLES]


def joined_state(states, concat):
    """One :class:`fusedfp8.ScalingState` holding the tensors of ``states`` side by side (for one
    summary table); ``concat`` joins a list of arrays along their last axis."""
    from .. import ScalingState

    fields = states[0].arrays()
    return ScalingState(**{f: concat([s.arrays()[f] for s in states]) for f in fields},
                        grad=tuple(g for s in states for g in s.grad))
