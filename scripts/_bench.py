"""What the benchmark scripts share, written once: the clocks (CUDA events, CUDA graph replays,
host blocks), the copy ceiling, SQNR, the profiler's kernel categories, the markdown table, the
plot helpers, the run metadata and the JSON file. The parts of the MLP train-step benchmark
that its torch and jax scripts share (command line, summary, table, plot) are in _bench_mlp.py.

A script run as ``python scripts/<name>.py`` has ``scripts/`` on ``sys.path``, so ``import
_bench`` finds this file. torch and jax are imported where they are used, so a jax script does
not need torch and the other way round.
"""
from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# ---- profiler categories ---------------------------------------------------------------------
KERNEL_CATEGORIES = (  # (category, name substrings), first match wins; everything else is 'other'
    ("fusedfp8", ("quantize_flat", "quantize_tiled", "update_scales", "update_meta", "dequantize_flat")),
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


# ---- the jobs in plain torch (the peers of bench_kernels.py and _bench_current.py) ---------------
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def torch_activation(job: str, x, b):
    """(y in float32, the format's max, the torch FP8 dtype) of a quantize / gelu / dgelu job
    (``job`` starts with the kind; gelu and dgelu in the tanh form, dgelu with x = ``b``)."""
    import torch

    xf = x.float()
    if job.startswith("quantize"):
        return xf, E4M3_MAX, torch.float8_e4m3fn
    if job.startswith("gelu"):
        return torch.nn.functional.gelu(xf, approximate="tanh"), E4M3_MAX, torch.float8_e4m3fn
    if not job.startswith("dgelu"):
        raise ValueError(f"job must start with quantize, gelu or dgelu; got {job!r}")
    bf = b.float()
    u = 0.7978845608028654 * (bf + 0.044715 * bf * bf * bf)
    th = torch.tanh(u)
    g = 0.5 * (1 + th) + 0.5 * bf * (1 - th * th) * 0.7978845608028654 * (1 + 3 * 0.044715 * bf * bf)
    return xf * g, E5M2_MAX, torch.float8_e5m2


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


def mismatch(a, b) -> float:
    """The fraction of the bytes of two tensors (FP8 or uint8, the same shape) that differ."""
    import torch

    return float((a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item())


def allow_recompiles(limit: int = 256) -> None:
    """Lift dynamo's per-code-object cache limit: a peer compiled once per job and size would otherwise
    fall back to eager, silently, past the default limit."""
    import torch

    torch._dynamo.config.cache_size_limit = limit
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = limit


def device_us(fn, inputs: list) -> tuple[float, str]:
    """(us per call, how): :func:`graph_us` where the calls can be captured, else :func:`loop_us`
    (e.g. inductor code that cannot be captured)."""
    import torch

    try:
        return graph_us(fn, inputs), "graph"
    except Exception as e:  # noqa: BLE001
        print(f"  (graph capture failed: {type(e).__name__}; timing a loop instead)", flush=True)
        torch.cuda.synchronize()
        return loop_us(fn, inputs), "loop"


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
    the total (``device_ms_total``: the kernels' and copies' times added up) and the busiest
    kernels; and, from the same trace's Chrome export, :func:`trace_busy`'s figures (the GPU busy
    time per step as the union of the intervals, the kernels per step, the top kernels, the CUDA
    graph launches and their kernels). When the trace misses the kernels (none at all, or none of
    a CUDA graph replay) every figure is None and ``reason`` says why. On a profiler failure
    ``{"error": ...}`` with the figures None (a profiler problem must not lose the timings)."""
    try:
        return _torch_profile(step, clock, steps, warmup)
    except Exception as e:  # noqa: BLE001 - report any profiler failure as text
        error = f"{type(e).__name__}: {e}"
        return {"error": error, **no_profile(f"the profiler failed: {error}")}


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
    import tempfile

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
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        busy = trace_busy(json.loads(path.read_text())["traceEvents"], steps)
    if busy["busy_ms_per_step"] is None:  # the per-category figures miss the same kernels
        cats = top = ranked = None
    return {"device_ms_per_step": cats, "device_ms_total": None if cats is None else sum(cats.values()),
            "top_kernels_ms": top, "all_kernels_ms": ranked, **busy}


GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # the Chrome trace categories of GPU work
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")  # runtime / driver calls replaying a CUDA graph
PROFILE_FIGURES = ("busy_ms_per_step", "span_ms_per_step", "kernels_per_step", "top_kernels", "idle_ms_per_step",
                   "largest_gaps")


def no_profile(reason: str) -> dict:
    """The figures of :func:`trace_busy`, each None, and the ``reason`` there are none."""
    return {**dict.fromkeys(PROFILE_FIGURES), "reason": reason}


def trace_busy(events: list, steps: int, top: int = 12) -> dict:
    """The GPU figures of a torch profiler trace of ``steps`` steps, from its Chrome export's
    ``traceEvents``: ``busy_ms_per_step``, the union of the intervals of every kernel, memcpy and
    memset (on every stream: work overlapping on two streams counts once; the gaps between them
    do not count), per step; ``span_ms_per_step``, the first one's start to the last one's end,
    per step; ``kernels_per_step``; ``top_kernels``, the kernels and copies taking most time
    (name, calls and ms per step); ``graph_launches_per_step`` (cudaGraphLaunch calls) and
    ``graph_kernels_per_step``, the kernels whose correlation id is a graph launch's (CUPTI gives
    a kernel replayed from a CUDA graph the correlation id of the launch). When the trace holds
    no kernel, or graph launches but none of their kernels (a profiler that does not see graph
    replays), the figures are None and ``reason`` says which (``reason`` is None otherwise)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_ACTIVITY]
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    launches = {e.get("args", {}).get("correlation") for e in events
                if e.get("cat") not in GPU_ACTIVITY and str(e.get("name", "")).startswith(GRAPH_LAUNCHES)}
    launches.discard(None)
    from_graphs = sum(1 for e in kernels if e.get("args", {}).get("correlation") in launches)
    out = {"steps": steps, "graph_launches_per_step": len(launches) / steps,
           "graph_kernels_per_step": from_graphs / steps}
    if not kernels:
        return {**out, **no_profile("the trace holds no GPU kernel")}
    if launches and not from_graphs:
        return {**out, **no_profile(f"the trace holds {len(launches)} CUDA graph launches but none of their kernels "
                                    "(this torch's profiler does not see the kernels of a graph replay)")}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?")) for e in gpu)
    idle = idle_gaps(spans, steps)
    span_ms = (max(end for _, end, _ in spans) - spans[0][0]) / 1e3 / steps
    by_name = {}
    for e in gpu:
        k = by_name.setdefault(e.get("name", "?"), [0, 0.0])
        k[0] += 1
        k[1] += float(e.get("dur", 0.0)) / 1e3
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {**out, "busy_ms_per_step": span_ms - idle["idle_ms_per_step"], "span_ms_per_step": span_ms, **idle,
            "kernels_per_step": len(kernels) / steps,
            "top_kernels": [{"name": n[:160], "calls_per_step": c / steps, "ms_per_step": ms / steps}
                            for n, (c, ms) in ranked],
            "reason": None}


def idle_gaps(spans: list, steps: int, top: int = 8) -> dict:
    """Where the GPU waits, from ``spans`` = (start_us, end_us, name) of its work (kernels, copies,
    memsets on any stream), sorted by start: the union of the intervals leaves gaps; each gap is
    put down to the pair (the work that ended last before it, the work that starts after it).
    ``idle_ms_per_step``: the gaps' total per step (between the first start and the last end, so
    the gaps between consecutive steps count: the host's dispatch of the next step);
    ``largest_gaps``: the ``top`` pairs by time, each with its gaps per step and ms per step.
    A kernel that waits on the host inside a step (a callback, a launch the host issues late)
    shows as the pair before it; the step boundary as (the last kernel, the first kernel)."""
    pairs: dict = {}
    hi, last = spans[0][1], spans[0][2]
    idle_us = 0.0
    for start, end, name in spans[1:]:
        if start > hi:
            gap = start - hi
            idle_us += gap
            k = pairs.setdefault((last, name), [0, 0.0])
            k[0] += 1
            k[1] += gap
            hi, last = end, name
        elif end >= hi:
            hi, last = end, name
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    return {"idle_ms_per_step": idle_us / 1e3 / steps,
            "largest_gaps": [{"after": a[:160], "before": b[:160], "gaps_per_step": n / steps,
                              "ms_per_step": us / 1e3 / steps} for (a, b), (n, us) in ranked]}


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


# ---- constants of the train-step benchmarks (the MLP ones, calibrate_policy, bench_policy_mixed) --
SQNR_MIN_DB = 20.0
LR = 1e-3
