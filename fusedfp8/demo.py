"""``python -m fusedfp8 demo``: train the MLP of DESIGN.md with FP8 delayed scaling next to bf16.

The model is LayerNorm -> Linear(hidden, ffn) -> gelu(tanh) -> Linear(ffn, hidden), trained with
Adam (lr 1e-3) on a fixed regression task (x ~ N(0, 1), y = a random teacher MLP of x scaled to
unit variance, MSE loss), twice from the same bf16 weights and data: once in plain bf16, once
with fusedfp8's FP8 path (``fusedfp8.pytorch.Fp8MLP``: both GEMMs in FP8, gelu fused into the
quantization, ``update_scales`` once per step). It reports, per model, the median step time,
the speed-up of FP8 over bf16, the losses and the overflow count, and draws the loss curves
and, for every FP8 tensor, its amax and its scale over the steps.

Where it runs. With a CUDA GPU, CuPy and FP8 support (the capability probe says so), on the
GPU at the shape of DESIGN.md (hidden 4096, ffn 16384, 8192 tokens). Otherwise on the CPU
through the reference path at a small shape: the FP8 numerics are then emulated bit-exactly in
NumPy and the GEMMs run in float32 (jax: in jax.numpy, with XLA's FP8 GEMMs in software), so
the CPU step times say nothing about FP8 speed; the loss curves and the scaling state are the
real thing.

Timing. Every step is timed (CUDA events around it on the GPU, ``time.perf_counter`` on the
CPU) and the median over the steps after the first three is reported. The FP8 step includes
two small device copies that record the staged amaxes and the new scales for the plot. On the
CPU, torch runs single-threaded during the demo (with more threads, torch's idle OpenMP workers
spin against NumPy's reference kernels and slow the FP8 emulation several-fold).

JAX (``--framework jax``). The same task and outputs with flax: a bf16 reference built from
``flax.linen`` LayerNorm / Dense and ``fusedfp8.jax.flax.Fp8MLP`` (identical parameter names,
so both start from the same bf16 weights), trained with ``optax.adam`` in a flax ``TrainState``
by one jitted step each (compiled before the timed steps), timed per step with
``time.perf_counter`` around the step and ``jax.block_until_ready``. The jax modules defer
``update_scales`` to the next forward; to plot the scale after each step as the torch runner
does, the step also applies the update to a copy of the FP8 state (the trained state is left
as the modules keep it). On the CPU the FP8 numerics run in jax.numpy, compiled by XLA: the
default CPU shape runs in about 15 s on two cores, a third of it compiling the FP8 step.

Frameworks plug in through :data:`FRAMEWORKS`: a function ``train(config, device, progress)``
returning ``{'bf16': Curve, 'fp8': Curve}``. Library use::

    from fusedfp8.demo import DemoConfig, run_demo
    result = run_demo(DemoConfig(steps=20, out="demo_out"))
    print(result.table())
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import _cuda, _logging
from .recipe import DelayedScaling

GPU_SHAPE = (4096, 16384, 8192)  # hidden, ffn, tokens: the MLP of DESIGN.md
CPU_SHAPE = (64, 256, 512)
WARMUP_STEPS = 3  # excluded from the median step time
LOSS_TAIL = 10  # the final loss is also given as the mean of the last 10 steps
TENSOR_ROLES = ("input", "weight", "grad_output")  # an Fp8Linear's state, in order
DEVICES = ("auto", "cuda", "cpu")


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
            raise ValueError(f"framework must be one of {tuple(FRAMEWORKS)}; got {self.framework!r}")
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
        if not isinstance(self.recipe, DelayedScaling):
            raise TypeError(f"recipe must be a fusedfp8.DelayedScaling; got {type(self.recipe).__name__}")

    def shape_for(self, device: str) -> tuple[int, int, int]:
        default = GPU_SHAPE if device == "cuda" else CPU_SHAPE
        return tuple(d if v is None else v for v, d in zip((self.hidden, self.ffn, self.tokens), default))


@dataclass
class Curve:
    """One trained model: per-step losses and times; for FP8 also the per-tensor trace.

    ``amax`` (steps, n) is each tensor's staged amax of the step (what ``update_scales`` saw: NaN
    or inf is an overflow), ``scale`` (steps, n) its scale after that step's update,
    ``overflows`` (n,) the final counts, ``state_table`` :meth:`ScalingState.summary` text.
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


@dataclass
class DemoResult:
    """What :func:`run_demo` measured and wrote (``files``: name -> path)."""

    config: DemoConfig
    device: str  # 'cuda' or 'cpu'
    device_name: str
    device_reason: str  # why this device (the probe's verdict)
    shape: tuple
    curves: dict
    meta: dict
    files: dict = field(default_factory=dict)

    def rows(self) -> list[dict]:
        base = self.curves["bf16"].median_ms()
        out = []
        for name, c in self.curves.items():
            out.append({
                "model": name,
                "step time (median)": f"{c.median_ms():.3f} ms",
                "speed-up vs bf16": f"{base / c.median_ms():.2f}x"
                                    + (" (FP8 emulated)" if self.device == "cpu" and name == "fp8" else ""),
                "loss, first step": f"{c.loss[0]:.4f}",
                "final loss": f"{c.loss[-1]:.4f}",
                f"mean loss, last {min(LOSS_TAIL, len(c.loss))} steps": f"{c.tail_loss():.4f}",
                "overflows": "-" if c.overflows is None else str(int(np.sum(c.overflows))),
            })
        return out

    def notes(self) -> list[str]:
        h, f, t = self.shape
        r = self.config.recipe
        lines = [f"{self.config.framework}, {self.device} ({self.device_name}): hidden {h}, ffn {f}, {t} tokens, "
                 f"{self.config.steps} steps, Adam lr {self.config.lr}, seed {self.config.seed}",
                 f"recipe: margin={r.margin}, amax_history_len={r.amax_history_len}, "
                 f"amax_compute_algo={r.amax_compute_algo!r}, fp8_format={r.fp8_format!r}, "
                 f"first_step={r.first_step!r}",
                 f"device choice: {self.device_reason}"]
        rel = self.curves["fp8"].tail_loss() / self.curves["bf16"].tail_loss() - 1
        lines.append(f"FP8 mean loss of the last {min(LOSS_TAIL, self.config.steps)} steps: {rel:+.2%} of bf16's")
        if self.device == "cpu":
            how = ("FP8 is emulated bit-exactly in NumPy and the GEMMs run in float32"
                   if self.config.framework == "torch"
                   else "FP8 quantization is emulated bit-exactly in jax.numpy and XLA runs the FP8 GEMMs in software")
            lines.append(f"CPU reference path: {how}, so these step times are not an FP8 speed measurement; "
                         "run on an FP8 GPU for that")
        return lines

    def table(self) -> str:
        """The summary as a markdown table followed by the notes."""
        rows = self.rows()
        cols = list(rows[0])
        out = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
        out += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
        return "\n".join(out + [""] + [f"- {n}" for n in self.notes()])


# ---- device choice ---------------------------------------------------------------------------
def choose_device(requested: str) -> tuple[str, str]:
    """('cuda' | 'cpu', reason). 'auto' takes the GPU when the probe accepts it; an explicit
    'cuda' that the probe refuses raises :class:`DemoError` with the probe's reason."""
    ok, reason = _cuda.probe(0, need_fp8_gemm=True)
    if requested == "cpu":
        return "cpu", "--device cpu"
    if requested == "cuda" and not ok:
        raise DemoError(f"--device cuda: the GPU cannot run fusedfp8's FP8 path: {reason}")
    if ok:
        return "cuda", reason
    return "cpu", f"CPU reference path, because: {reason}"


# ---- progress ----------------------------------------------------------------------------------
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


# ---- torch -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _torch_threads(device: str):
    import torch

    if device != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _torch_data(hidden: int, tokens: int, seed: int, device):
    """x ~ N(0, 1) and y = a fixed random teacher MLP of x, scaled to unit variance; bf16."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g, device=device)
    w1 = torch.randn(hidden, hidden, generator=g, device=device) / math.sqrt(hidden)
    w2 = torch.randn(hidden, hidden, generator=g, device=device) / math.sqrt(hidden)
    y = torch.tanh(x @ w1) @ w2
    y = y / y.std()
    return x.to(torch.bfloat16), y.to(torch.bfloat16)


def _torch_models(hidden: int, ffn: int, recipe: DelayedScaling, seed: int, device):
    """The bf16 reference and the Fp8MLP, with identical bf16 weights."""
    import torch

    import fusedfp8.pytorch as fp8

    torch.manual_seed(seed)
    with torch.device(device):
        bf16 = fp8.MLP(hidden, ffn).to(torch.bfloat16)
        f8 = fp8.Fp8MLP(hidden, ffn, recipe).to(torch.bfloat16)  # the FP8 state stays float32
    params = dict(f8.named_parameters())
    if set(params) != {n for n, _ in bf16.named_parameters()}:
        raise RuntimeError(f"demo: Fp8MLP's parameters {sorted(params)} differ from the bf16 model's")
    with torch.no_grad():
        for name, p in bf16.named_parameters():
            params[name].copy_(p)
    return bf16, f8


def _torch_train(config: DemoConfig, device: str, bar) -> dict:
    import torch

    import fusedfp8.pytorch as fp8
    from .state import ScalingState

    hidden, ffn, tokens = config.shape_for(device)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    x, y = _torch_data(hidden, tokens, config.seed, dev)
    curves = {}
    with _torch_threads(device):
        models = _torch_models(hidden, ffn, config.recipe, config.seed, dev)
        for name, model in zip(("bf16", "fp8"), models):
            bar.set_description(f"{name} ({device})")
            opt = torch.optim.Adam(model.parameters(), lr=config.lr, fused=cuda)
            mods = [(n, m) for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)]
            k = 3 * len(mods)
            losses = torch.empty(config.steps, device=dev)
            amax = torch.empty(config.steps, k, device=dev)
            scale = torch.empty(config.steps, k, device=dev)
            if cuda:
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(config.steps)]
            host_ms = []
            for i in range(config.steps):
                if cuda:
                    events[i][0].record()
                else:
                    t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = (model(x).float() - y.float()).pow(2).mean()
                loss.backward()
                opt.step()
                if mods:
                    amax[i] = torch.cat([m.amax_history[0] for _, m in mods])
                    fp8.update_model_scales(model)
                    scale[i] = torch.cat([m.scale for _, m in mods])
                losses[i] = loss.detach()
                if cuda:
                    events[i][1].record()
                else:
                    host_ms.append((time.perf_counter() - t0) * 1e3)
                    bar.set_postfix_str(f"loss {float(loss.detach()):.4f}")
                bar.update(1)
            if cuda:
                torch.cuda.synchronize()
                host_ms = [a.elapsed_time(b) for a, b in events]
            curve = Curve(loss=losses.cpu().numpy(), step_ms=np.array(host_ms))
            bar.set_postfix_str(f"loss {curve.loss[-1]:.4f}")
            if mods:
                names = [f"{n}.{role}" for n, _ in mods for role in TENSOR_ROLES]
                curve.tensors = names
                curve.amax, curve.scale = amax.cpu().numpy(), scale.cpu().numpy()
                rows = []
                for n, m in mods:
                    st: ScalingState = m.fp8_state
                    rows += _logging.state_rows(st, config.recipe, [f"{n}.{role}" for role in TENSOR_ROLES])
                curve.overflows = np.array([r["overflows"] for r in rows])
                curve.state_table = _logging.format_table(rows)
            curves[name] = curve
            del model, opt
            if cuda:
                torch.cuda.empty_cache()
    return curves


def _torch_meta(device: str) -> dict:
    import torch

    meta = {"torch": torch.__version__}
    if device == "cuda":
        meta["device_name"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
    else:
        meta["device_name"] = platform.processor() or platform.machine() or "cpu"
        meta["torch_threads"] = 1
    return meta


# ---- jax ---------------------------------------------------------------------------------------
def _jax_device(device: str):
    """The jax device for 'cuda' / 'cpu'; DemoError when jax has no GPU backend."""
    import jax

    plat = "gpu" if device == "cuda" else "cpu"
    try:
        return jax.devices(plat)[0]
    except RuntimeError as e:
        raise DemoError(f"--framework jax on {device}: jax has no {plat} backend ({e}); install a CUDA build of "
                        "jax or pass --device cpu") from None


def _jax_data(hidden: int, tokens: int, seed: int, dev):
    """As :func:`_torch_data` (x ~ N(0, 1), y = a fixed random teacher MLP of x at unit variance,
    bf16): drawn with NumPy, the teacher evaluated on ``dev`` in float32."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed + 1)
    x, w1, w2 = (jax.device_put(rng.standard_normal(s, np.float32), dev)
                 for s in ((tokens, hidden), (hidden, hidden), (hidden, hidden)))
    hp = jax.lax.Precision.HIGHEST
    y = jnp.matmul(jnp.tanh(jnp.matmul(x, w1 / math.sqrt(hidden), precision=hp)), w2 / math.sqrt(hidden), precision=hp)
    return x.astype(jnp.bfloat16), (y / jnp.std(y)).astype(jnp.bfloat16)


def _jax_models(hidden: int, ffn: int, recipe: DelayedScaling):
    """The bf16 reference (flax LayerNorm / Dense, named as Fp8MLP's parameters) and the Fp8MLP."""
    import flax.linen as nn
    import jax.numpy as jnp

    from fusedfp8.jax.flax import Fp8MLP

    class BF16MLP(nn.Module):
        param_dtype: jnp.dtype = jnp.bfloat16

        @nn.compact
        def __call__(self, x):
            kw = dict(dtype=jnp.bfloat16, param_dtype=self.param_dtype)
            h = nn.LayerNorm(name="norm", **kw)(x)
            h = nn.gelu(nn.Dense(ffn, name="fc1", **kw)(h), approximate=True)
            return nn.Dense(hidden, name="fc2", **kw)(h)

    return BF16MLP(), Fp8MLP(ffn, recipe=recipe, param_dtype=jnp.bfloat16)


def _jax_fresh_variables(model, init_params, x, recipe: DelayedScaling) -> dict:
    """``model``'s variables with copies of the shared bf16 parameters (its own buffers: the step
    donates them) and a fresh FP8 state, laid out as ``model.init`` would (checked against
    ``jax.eval_shape`` of it: the real init would run the FP8 forward once more, ~1 s on a CPU)."""
    import jax
    import jax.numpy as jnp

    from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT, STATE_VARIABLES
    from fusedfp8.jax.functional import fresh_meta

    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    if set(shapes) - {"params", OVERWRITE_WITH_GRADIENT}:
        raise RuntimeError(f"demo: unexpected variable collections {sorted(shapes)}")
    variables = {"params": jax.tree.map(jnp.copy, init_params)}
    if OVERWRITE_WITH_GRADIENT in shapes:
        # fresh_meta shares one zeros array between the counters: copies, as the step donates them
        variables[OVERWRITE_WITH_GRADIENT] = {m: dict(zip(STATE_VARIABLES, map(jnp.copy, fresh_meta(recipe))))
                                              for m in shapes[OVERWRITE_WITH_GRADIENT]}
    got = jax.tree.map(lambda a: (a.shape, a.dtype), variables)
    want = jax.tree.map(lambda a: (a.shape, a.dtype), dict(shapes))
    if got != want:
        raise RuntimeError(f"demo: the jax {type(model).__name__}'s variables differ from the bf16 parameters "
                           f"plus a fresh FP8 state: {want} != {got}")
    return variables


def _jax_train(config: DemoConfig, device: str, bar) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training.train_state import TrainState

    import fusedfp8.jax as fjax
    from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT, STATE_VARIABLES
    from fusedfp8.jax.functional import meta_to_state

    dev = _jax_device(device)
    hidden, ffn, tokens = config.shape_for(device)
    recipe = config.recipe
    curves = {}
    with jax.default_device(dev):
        x, y = _jax_data(hidden, tokens, config.seed, dev)
        models = _jax_models(hidden, ffn, recipe)
        key = jax.random.key(config.seed)
        # flax's initializers in float32, rounded to bf16 (as torch's bf16 models are made): run in
        # bf16 they give each kernel 128 distinct values whose E4M3 rounding errors do not average
        # out (the FP8 step-0 loss was 2.6% above bf16's on the H200; scripts/bench_mlp.py --jax-init)
        init_f32 = jax.jit(models[0].clone(param_dtype=jnp.float32).init)(key, x)["params"]  # eager: op by op
        init_params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), init_f32)
        for name, model in zip(("bf16", "fp8"), models):
            bar.set_description(f"{name} ({device}, jax)")
            variables = _jax_fresh_variables(model, init_params, x, recipe)
            fp8_mods = sorted(variables.get(OVERWRITE_WITH_GRADIENT, {}))  # ['fc1', 'fc2']
            state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(config.lr))

            def metas(params):
                """Each FP8 module's meta (after a step: the scales it used, its amaxes staged in row 0)."""
                return [tuple(params[OVERWRITE_WITH_GRADIENT][m][v] for v in STATE_VARIABLES) for m in fp8_mods]

            def updated(params):
                """Each FP8 module's ScalingState after update_scales, which turns the staged amaxes
                into the next step's scales. The jax modules defer the update to the next forward;
                the demo applies it to a copy, to read the scales as torch's demo step does."""
                return [fjax.update_scales(meta_to_state(m), recipe) for m in metas(params)]

            def step(state, x, y):
                def loss_fn(params):
                    out = model.apply(params, x)
                    return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

                loss, grads = jax.value_and_grad(loss_fn)(state.params)
                state = state.apply_gradients(grads=grads)  # stores the new FP8 metas
                if not fp8_mods:
                    return state, loss, None, None
                amax = jnp.concatenate([m[0][0] for m in metas(state.params)])
                return state, loss, amax, jnp.concatenate([s.scale for s in updated(state.params)])

            bar.set_postfix_str("compiling")
            step = jax.jit(step, donate_argnums=0).lower(state, x, y).compile()  # outside the timed steps
            losses, amaxes, scales, step_ms = [], [], [], []
            for i in range(config.steps):
                t0 = time.perf_counter()
                state, loss, amax, scale = step(state, x, y)
                jax.block_until_ready(loss)  # device-side completion of the whole step
                jax.block_until_ready(state)
                step_ms.append((time.perf_counter() - t0) * 1e3)
                losses.append(loss)
                amaxes.append(amax)
                scales.append(scale)
                if device == "cpu":
                    bar.set_postfix_str(f"loss {float(loss):.4f}")
                bar.update(1)
            curve = Curve(loss=np.asarray(jax.device_get(losses), np.float32), step_ms=np.array(step_ms))
            bar.set_postfix_str(f"loss {curve.loss[-1]:.4f}")
            if fp8_mods:
                curve.tensors = [f"{m}.{role}" for m in fp8_mods for role in TENSOR_ROLES]
                curve.amax = np.asarray(jax.device_get(amaxes), np.float32)
                curve.scale = np.asarray(jax.device_get(scales), np.float32)
                rows = []
                for m, st in zip(fp8_mods, jax.jit(updated)(state.params)):
                    rows += _logging.state_rows(st, recipe, [f"{m}.{role}" for role in TENSOR_ROLES])
                curve.overflows = np.array([r["overflows"] for r in rows])
                curve.state_table = _logging.format_table(rows)
            curves[name] = curve
            del state, step
    return curves


def _jax_meta(device: str) -> dict:
    import flax
    import jax
    import optax

    dev = _jax_device(device)
    meta = {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "jax_backend": dev.platform}
    meta["device_name"] = (dev.device_kind if device == "cuda"
                           else platform.processor() or platform.machine() or "cpu")
    return meta


# name -> (train(config, device, bar) -> {'bf16': Curve, 'fp8': Curve}, meta(device) -> dict)
FRAMEWORKS: dict[str, tuple[Callable, Callable]] = {
    "torch": (_torch_train, _torch_meta),
    "jax": (_jax_train, _jax_meta),
}


# ---- output ------------------------------------------------------------------------------------
def plot(result: DemoResult, path: Path) -> None:
    """Loss curves of bf16 and FP8; amax and scale of every FP8 tensor over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    steps = np.arange(1, result.config.steps + 1)
    ax = axes[0]
    for name, c in result.curves.items():
        ax.plot(steps, c.loss, label=f"{name} (median {c.median_ms():.2f} ms/step)",
                ls="--" if name == "bf16" else "-", lw=2 if name == "bf16" else 1.3)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_title("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    f8 = result.curves["fp8"]
    for ax, values, what in ((axes[1], f8.amax, "amax (staged, per step)"), (axes[2], f8.scale, "scale (after the update)")):
        for j, name in enumerate(f8.tensors):
            v = values[:, j]
            finite = np.isfinite(v) & (v > 0)
            line, = ax.plot(steps[finite], v[finite], label=name, lw=1.2)
            bad = ~np.isfinite(v)
            if bad.any():  # overflows: mark them at the top of the axis
                ax.plot(steps[bad], np.full(bad.sum(), np.nanmax(np.where(finite, v, np.nan)) if finite.any() else 1.0),
                        "x", color=line.get_color(), ms=8)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(what + ("; x = overflow" if np.any(~np.isfinite(f8.amax)) else ""))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    h, f, t = result.shape
    speed = (f"FP8 {result.curves['bf16'].median_ms() / f8.median_ms():.2f}x bf16" if result.device == "cuda"
             else "CPU reference path (FP8 emulated: step times are not a speed measurement)")
    fig.suptitle(f"fusedfp8 demo: {result.config.framework}, {result.device_name}, hidden {h} / ffn {f} / {t} tokens, "
                 + speed)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(result: DemoResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "demo_summary.md"
    text = "# fusedfp8 demo\n\n" + result.table() + "\n\n## FP8 scaling state after the last step\n\n```\n"
    text += result.curves["fp8"].state_table + "\n```\n"
    summary.write_text(text)
    result.files["summary"] = str(summary)
    data = {
        "config": {**{k: v for k, v in dataclasses.asdict(result.config).items() if k != "recipe"},
                   "recipe": dataclasses.asdict(result.config.recipe)},
        "device": result.device, "shape": list(result.shape), "meta": result.meta,
        "curves": {name: {"loss": c.loss.tolist(), "step_ms": c.step_ms.tolist(), "median_step_ms": c.median_ms(),
                          "tensors": c.tensors,
                          "amax": None if c.amax is None else [[_json_float(v) for v in r] for r in c.amax],
                          "scale": None if c.scale is None else c.scale.tolist(),
                          "overflows": None if c.overflows is None else c.overflows.tolist()}
                   for name, c in result.curves.items()},
    }
    path = out / "demo.json"
    path.write_text(json.dumps(data, indent=1))
    result.files["json"] = str(path)
    if result.config.plot:
        png = out / "demo.png"
        plot(result, png)
        result.files["png"] = str(png)


def _json_float(v) -> float | str:
    v = float(v)
    return v if math.isfinite(v) else str(v)  # JSON has no NaN / inf


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
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        extra = "demo" if config.framework == "torch" else "demo,jax"
        raise DemoError(f"python -m fusedfp8 demo needs {', '.join(missing)}: pip install 'fusedfp8[{extra}]' "
                        "(or pass --no-plot / --no-progress to do without matplotlib / tqdm)")


def run_demo(config: DemoConfig = DemoConfig(), echo: Callable[[str], None] | None = print) -> DemoResult:
    """Train bf16 and FP8, write ``demo_summary.md``, ``demo.json`` and ``demo.png`` to
    ``config.out`` and return the :class:`DemoResult`.

    ``echo`` receives the human-readable lines (None: silent).

    Raises
    ------
    DemoError
        A package is missing, ``device='cuda'`` on a machine whose GPU the probe refuses, or
        jax without a GPU backend on such a machine.
    """
    say = echo or (lambda s: None)
    device, reason = choose_device(config.device)
    _check_packages(config)
    train, meta_of = FRAMEWORKS[config.framework]
    shape = config.shape_for(device)
    say(f"fusedfp8 demo: {config.framework} on {device} ({reason}); hidden {shape[0]}, ffn {shape[1]}, "
        f"{shape[2]} tokens, {config.steps} steps each for bf16 and FP8")
    t0 = time.perf_counter()
    bar = _progress_bar(2 * config.steps, config.progress)
    try:
        curves = train(config, device, bar)
    finally:
        bar.close()
    meta = {**meta_of(device), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "train_wall_s": time.perf_counter() - t0}
    from . import __version__

    meta["fusedfp8"] = __version__
    result = DemoResult(config, device, meta["device_name"], reason, shape, curves, meta)
    _write(result, Path(config.out))
    say("")
    say(result.table())
    say("")
    say("FP8 scaling state after the last step (ScalingState.summary):")
    say(curves["fp8"].state_table)
    say("")
    say("wrote " + ", ".join(result.files.values()))
    return result
