"""What the benchmark scripts share, written once: the clocks (CUDA events, CUDA graph replays,
host blocks), the copy ceiling, SQNR, the profiler's kernel categories, the markdown table, the
plot helpers, the run metadata and the JSON file; and the parts of the MLP train-step
benchmark that its torch and jax scripts share (command line, summary, table, plot).

A script run as ``python scripts/<name>.py`` has ``scripts/`` on ``sys.path``, so ``import
_bench`` finds this file. torch and jax are imported where they are used, so a jax script does
not need torch and the other way round.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import _bench_recipes

# ---- profiler categories ---------------------------------------------------------------------
KERNEL_CATEGORIES = (  # (category, name substrings), first match wins; everything else is 'other'
    ("fusedfp8", ("quantize_flat", "quantize_tiled", "update_scales", "dequantize_flat")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "sm80", "scaled_mm")),
    ("layernorm", ("layer_norm", "layernorm")),
    ("adam", ("adam",)),
)


def kernel_category(name: str) -> str:
    """The :data:`KERNEL_CATEGORIES` entry of a GPU kernel's name, or 'other'."""
    low = name.lower()
    return next((c for c, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def empty_categories() -> dict:
    return {**{c: 0.0 for c, _ in KERNEL_CATEGORIES}, "other": 0.0}


# ---- clocks ----------------------------------------------------------------------------------
class Clock:
    """Time of a callable on ``device``: CUDA events around it on a GPU (device time, read after
    the end event completes), ``time.perf_counter`` on the CPU (smoke tests of the scripts)."""

    def __init__(self, device="cuda"):
        self.cuda = str(device).startswith("cuda")

    def ms(self, fn) -> float:
        """Milliseconds of one call of ``fn``."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import torch

        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def per_call_ms(self, fn, calls: int, reps: int) -> list[float]:
        """``reps`` timings of ``calls`` back-to-back calls of ``fn``, each divided by ``calls``."""
        def block():
            for _ in range(calls):
                fn()

        return [self.ms(block) / calls for _ in range(reps)]

    def sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()


def graph_us(fn, inputs: list, reps: int = 7) -> float:
    """Capture ``fn(*args)`` for every ``args`` of ``inputs`` in one CUDA graph; the median
    microseconds per call over ``reps`` replays (CUDA events)."""
    import torch

    for args in inputs:  # warm-up (compiles, allocator)
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for args in inputs:
            fn(*args)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for args in inputs:
                fn(*args)
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    clock = Clock("cuda")
    us = statistics.median(clock.ms(g.replay) * 1e3 / len(inputs) for _ in range(reps))
    del g
    return us


class GraphedStep:
    """A train step replayed from a CUDA graph: the first ``warmup`` calls run ``eager_step()`` on
    a side stream (allocator and first-step state settle; they are real steps), the next one
    captures it (the capture runs nothing) and replays it, and every later call replays the
    graph. Returns what the step returned (the captured output, the same tensor at every replay)."""

    def __init__(self, eager_step, warmup: int = 3):
        self.eager_step, self.warmup, self.calls = eager_step, warmup, 0
        self.graph = self.out = self.side = None

    def __call__(self):
        import torch

        self.calls += 1
        if self.calls <= self.warmup:
            if self.side is None:
                self.side = torch.cuda.Stream()
            self.side.wait_stream(torch.cuda.current_stream())  # inputs copied in on it
            with torch.cuda.stream(self.side):
                out = self.eager_step()
            # the caller reads the result on the current stream: it must wait for the side stream
            # (reading it unordered gave a 0.0 first loss at 4096/16384/8192)
            torch.cuda.current_stream().wait_stream(self.side)
            return out
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.eager_step()
        self.graph.replay()
        return self.out


def loop_us(fn, inputs: list, reps: int = 7) -> float:
    """As :func:`graph_us` without a graph (for calls that cannot be captured): CUDA events
    around a loop over the inputs."""
    import torch

    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()

    def loop():
        for args in inputs:
            fn(*args)

    clock = Clock("cuda")
    return statistics.median(clock.ms(loop) * 1e3 / len(inputs) for _ in range(reps))


def host_block_ms(call, calls: int, reps: int, wait=lambda out: None) -> list[float]:
    """``reps`` host timings of ``calls`` back-to-back ``call()`` followed by ``wait(last
    result)`` (e.g. ``jax.block_until_ready``), each divided by ``calls``: device time for
    asynchronously dispatched work when the host keeps ahead of the device."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = call()
        wait(r)
        out.append((time.perf_counter() - t0) * 1e3 / calls)
    return out


def host_us_per_call(fn, calls: int = 3000, reps: int = 5, sync=lambda: None, warmup: int = 100) -> float:
    """Median host microseconds of one call of ``fn`` when calls are pipelined (no sync between
    them; ``sync()`` after each block)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
        sync()
    return statistics.median(samples)


def copy_ceiling_tbps() -> float:
    """The device-to-device copy bandwidth in TB/s (bytes read + bytes written): the better of a
    2 GiB float32 ``copy_`` timed with CUDA events (median of 10) and the same copy replayed from
    a CUDA graph."""
    import torch

    n = 1 << 29  # float32 elements: 2 GiB each way
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    clock = Clock("cuda")
    eager_us = statistics.median(clock.ms(lambda: dst.copy_(src)) * 1e3 for _ in range(10))
    us = min(eager_us, graph_us(lambda: dst.copy_(src), [()] * 3))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 4 * n / (us * 1e-6) / 1e12


def torch_profile(step, clock: Clock, steps: int = 3, warmup: int = 2) -> dict:
    """Device time per kernel category (:data:`KERNEL_CATEGORIES`) of one call of ``step``, in ms,
    averaged over ``steps`` calls traced by the torch profiler after ``warmup`` untraced ones, with
    the total (the GPU busy time of a step) and the busiest kernels; or ``{"error": ...}`` (a
    profiler problem must not lose the timings)."""
    try:
        return _torch_profile(step, clock, steps, warmup)
    except Exception as e:  # noqa: BLE001 - report any profiler failure as text
        return {"error": f"{type(e).__name__}: {e}"}


def device_events(prof):
    """(name, device ms in total, calls) of every kernel and copy in a finished torch profile. A
    ``record_function`` range (the optimizer's "Optimizer.step#Adam.step") also shows on the GPU
    timeline as a user annotation spanning kernels already counted: it is left out."""
    import torch

    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
            continue
        ms = evt.self_device_time_total / 1e3
        if ms > 0:
            yield evt.key, ms, evt.count


def _torch_profile(step, clock: Clock, steps: int, warmup: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    clock.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        clock.sync()
    cats = empty_categories()
    kernels = {}
    for key, ms, _ in device_events(prof):
        ms /= steps
        cats[kernel_category(key)] += ms
        kernels[key[:120]] = kernels.get(key[:120], 0.0) + ms
    ranked = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
    top = dict(list(ranked.items())[:12])
    return {"device_ms_per_step": cats, "device_ms_total": sum(cats.values()), "top_kernels_ms": top,
            "all_kernels_ms": ranked}


# ---- numbers ---------------------------------------------------------------------------------
def _float64(a) -> np.ndarray:
    if hasattr(a, "detach"):  # torch: bf16 and device tensors go through float64 on the host
        return a.detach().double().cpu().numpy()
    return np.asarray(a, np.float64)


def sqnr_db(want, got) -> float:
    """Signal-to-quantization-noise ratio of ``got`` against ``want`` in dB (inf when equal);
    torch tensors, jax or numpy arrays."""
    w, g = _float64(want), _float64(got)
    noise = float(((w - g) ** 2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float((w * w).sum()) / noise)


def parse_sizes(text: str, dims: int, flag: str, error) -> list[tuple[int, ...]]:
    """``'4096x16384x8192,1024x4096x2048'`` -> [(4096, 16384, 8192), ...]; ``error(message)``
    (an ArgumentParser's) on anything else."""
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        error(f"{flag} must be like {'x'.join(['4096'] * dims)}[,...]; got {text!r}")
    if any(len(s) != dims or min(s) < 1 for s in sizes):
        error(f"{flag}: each entry is {dims} positive sizes joined by 'x'; got {text!r}")
    return sizes


# ---- output ----------------------------------------------------------------------------------
def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A markdown table on stdout (``python -m fusedfp8 bench`` collects the lines that start with '|')."""
    print("\n| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}")


def run_meta(**fields) -> dict:
    """``fields`` plus the date, the python version and the command line of this run."""
    return {**fields, "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])}


def write_json(path: Path, meta: dict, results: list) -> None:
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"wrote {path}")


# ---- the MLP train-step benchmark (bench_mlp_torch.py, bench_mlp_jax.py) --------------------
SHAPES = [(4096, 16384, 8192), (1024, 4096, 2048)]  # hidden, ffn, tokens
LOSS_TOLERANCE = 0.02  # mean loss of the last 10 steps against bf16's
SQNR_MIN_DB = 20.0
LR = 1e-3


def mlp_arguments(doc: str, framework: str, modes: list[str], argv=None):
    """The command line of an MLP benchmark script: (args, shapes, modes). ``--framework`` is
    accepted for the command lines of the former bench_mlp.py (one value: this script's)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=[framework], default=framework,
                    help=f"the framework to benchmark (this script: {framework})")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                    help="hidden x ffn x tokens, comma separated")
    ap.add_argument("--modes", default=None, help=f"comma separated, from {modes}")
    ap.add_argument("--steps", type=int, default=100, help="training steps of the loss curve")
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks (the median is reported)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the per-kernel profile (torch: of the eager steps; jax: of 10 jitted steps)")
    ap.add_argument("--device", default="cuda", help="'cuda' (the benchmark) or 'cpu' (a smoke test of the script)")
    _bench_recipes.add_argument(ap)
    if framework == "torch":
        ap.add_argument("--torch-gemm", choices=["auto", "cublaslt", "scaled_mm"], default="auto",
                        help="the FP8 layers' gemm= (fusedfp8.pytorch.gemm): the shim's cuBLASLt GEMM, "
                             "torch._scaled_mm, or the first where the shim can be had (default)")
    if framework == "jax":
        ap.add_argument("--jax-forward-accum", choices=["fast", "split"], default="fast",
                        help="cuBLASLt accumulation of the forward FP8 GEMMs (gradients: always split)")
        ap.add_argument("--jax-init", choices=["f32", "bf16"], default="f32",
                        help="run flax's initializers in float32 and round to bf16 (default), or in bf16 itself")
    args = ap.parse_args(argv)
    chosen = (args.modes or ",".join(modes)).split(",")
    bad = [m for m in chosen if m not in modes]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {modes}")
    shapes = parse_sizes(args.shapes, 3, "--shapes", ap.error)
    args.recipes = _bench_recipes.parse(args.recipes, ap.error)
    for name in ("steps", "block", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    return args, shapes, chosen, ap


def summarize(shape, res: dict, steps: int, targets: dict, recipes=("delayed",)) -> None:
    """``res['summary']``: like-for-like speed-ups, the best FP8 mode against the best bf16 mode
    (``best``) and against the best of bf16 eager / compiled / jit (``issue_baseline``, the
    baselines the issue names) with the shape's target speed-up, the mean loss of the last 10
    steps of every FP8 mode against the bf16 reference, and graphed / compiled loss curves
    against their eager twin. ``best`` and ``issue_baseline`` are of the DelayedScaling modes;
    the modes of the other ``recipes`` (``fp8_eager@current``, ...) get theirs from
    :func:`_bench_recipes.summarize`."""
    modes = res["modes"]
    ms = {m: r["step_ms"] for m, r in modes.items()}
    bf16 = {m: t for m, t in ms.items() if m.startswith("bf16")}
    every_f8 = {m: t for m, t in ms.items() if m.startswith("fp8")}
    f8 = {m: t for m, t in every_f8.items() if _bench_recipes.TAG not in m}

    def twin_of(m):
        twin = "bf16_" + m.split(_bench_recipes.TAG)[0].split("_")[1]
        return twin if twin in bf16 else ("bf16_jit" if "bf16_jit" in bf16 else None)

    s = {}
    for m, t in every_f8.items():  # like for like
        twin = "bf16_" + m.split(_bench_recipes.TAG)[0].split("_")[1]
        if twin in bf16:
            s[f"{m}_vs_{twin}"] = bf16[twin] / t
    tgt = targets.get(tuple(shape))
    for key, base in (("best", bf16), ("issue_baseline", {m: t for m, t in bf16.items() if m != "bf16_graphed"})):
        if base and f8:
            best_b, best_f = min(base, key=base.get), min(f8, key=f8.get)
            s[key] = {"bf16": best_b, "fp8": best_f, "speedup": base[best_b] / f8[best_f]}
            if tgt is not None:
                s[key].update(target=tgt, met=s[key]["speedup"] >= tgt)
    tail = slice(max(0, steps - 10), steps)
    ref_mode = next((m for m in ("bf16_eager", "bf16_compiled", "bf16_graphed", "bf16_jit") if m in modes), None)
    if ref_mode is not None:
        ref_tail = statistics.fmean(modes[ref_mode]["loss"][tail])
        s["loss_tail_reference"] = {"mode": ref_mode, "mean": ref_tail, "steps": [tail.start + 1, tail.stop]}
        for m in [*every_f8, *(m for m in modes if m.startswith("flax"))]:
            rel = statistics.fmean(modes[m]["loss"][tail]) / ref_tail - 1
            s[f"{m}_loss_tail_rel"] = rel
            s[f"{m}_loss_within_2pct"] = abs(rel) <= LOSS_TOLERANCE
    for kind in ("bf16", "fp8"):
        eager = modes.get(f"{kind}_eager")
        for how in ("compiled", "reduceoverhead", "graphed"):
            other = modes.get(f"{kind}_{how}")
            if eager and other:
                s[f"{kind}_{how}_vs_eager_max_rel_loss_diff"] = _bench_recipes.max_rel_diff(eager["loss"],
                                                                                            other["loss"])
    if "bf16_jit" in ms:
        for m, t in ms.items():
            if m != "bf16_jit":
                s[f"{m}_vs_bf16_jit"] = ms["bf16_jit"] / t
    res["summary"] = s
    _bench_recipes.summarize(res, list(recipes), twin_of)


def print_mlp_table(results: list, all_modes: list[str]) -> None:
    header = (["shape (hidden/ffn/tokens)", *all_modes, "best FP8 / best bf16", "best FP8 / best bf16 eager+compiled",
               "loss 91-100 vs bf16"])
    rows = []
    for res in results:
        sh, s = res["shape"], res["summary"]
        cells = [f"{res['modes'][m]['step_ms']:.3f} ms" if m in res["modes"] else "-" for m in all_modes]
        sp = [f"{b['speedup']:.2f}x ({b['fp8']} / {b['bf16']})" if b else "-"
              for b in (s.get("best"), s.get("issue_baseline"))]
        loss = ", ".join(f"{k.split('_loss')[0]} {v:+.2%}" for k, v in s.items() if k.endswith("_loss_tail_rel"))
        rows.append([f"{sh['hidden']}/{sh['ffn']}/{sh['tokens']}", *cells, sp[0], sp[1], loss or "-"])
    if any("recipes" in res["summary"] for res in results):  # --recipes with more than delayed
        header.append(_bench_recipes.TABLE_HEADER)
        for row, res in zip(rows, results):
            row.append(_bench_recipes.table_cell(res["summary"]))
    print_table(header, rows)


def plot_mlp(results: list, path: Path, meta: dict) -> None:
    """Per shape: the median step time of every mode (bars), the loss curves, and every FP8 or
    flax-FP8 mode's loss divided by the bf16 reference's per step (the curves overlap on a log
    axis; the ratio shows how far apart they are)."""
    plt = pyplot()
    if plt is None:
        return
    n = len(results)
    fig, axes = plt.subplots(3, n, figsize=(6 * n, 11), squeeze=False)
    for j, res in enumerate(results):
        sh, modes = res["shape"], list(res["modes"])
        ax = axes[0][j]
        vals = [res["modes"][m]["step_ms"] for m in modes]
        ax.bar(range(len(modes)), vals, color=["tab:gray" if m.startswith("bf16") else "tab:orange" for m in modes])
        ax.set_xticks(range(len(modes)), modes, rotation=30, ha="right")
        ax.set_ylabel("ms / train step (median)")
        best = res["summary"].get("best")
        ax.set_title(f"hidden {sh['hidden']} / ffn {sh['ffn']} / {sh['tokens']} tokens"
                     + (f"\nbest FP8 / best bf16: {best['speedup']:.2f}x" if best else ""))
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        color = {m: f"C{i}" for i, m in enumerate(modes)}  # one colour per mode in both loss panels
        ax = axes[1][j]
        for m in modes:
            bf = m.startswith("bf16")
            ax.plot(res["modes"][m]["loss"], label=m, color=color[m], lw=2 if bf else 1.2, ls="--" if bf else "-")
        ax.set_yscale("log")
        ax.set_ylabel("MSE loss")
        ax.legend(fontsize=8)
        ax = axes[2][j]
        ref = res["summary"].get("loss_tail_reference", {}).get("mode")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhspan(1 - LOSS_TOLERANCE, 1 + LOSS_TOLERANCE, color="tab:green", alpha=0.12, lw=0)
        if ref is not None:
            base = np.asarray(res["modes"][ref]["loss"], np.float64)
            for m in modes:
                if not m.startswith("bf16"):
                    ax.plot(np.asarray(res["modes"][m]["loss"], np.float64) / base, label=f"{m} / {ref}",
                            color=color[m], lw=1.2)
            ax.legend(fontsize=8)
        ax.set_ylabel("loss / bf16 loss")
        for ax in axes[1][j], axes[2][j]:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    fw = meta.get("framework", "torch")
    fig.suptitle(f"fusedfp8 MLP train step, {fw} {meta[fw]}, {meta['device']}")
    save_figure(fig, path, dpi=120)
