"""``python -m fusedfp8 info | demo | bench``.

- ``info [--compile]``: versions, the GPU and its compute capability, the capability probe's
  verdict and reason, where the kernel sources and the kernel cache live; ``--compile`` builds
  every kernel instantiation now (progress bar, time taken).
- ``demo``: trains the MLP of docs/design.md in bf16 and in FP8 (see :mod:`fusedfp8.demo`); writes
  ``./fusedfp8_demo/`` by default.
- ``bench``: runs ``scripts/bench_kernels.py``, ``bench_mlp_torch.py`` and ``bench_mlp_jax.py`` of a
  source checkout and collects their JSON, PNG and logs in one folder (``./fusedfp8_bench/`` by
  default) with a markdown summary (see :mod:`fusedfp8.demo.bench`). ``bench --calibrate``
  measures the table of ``convert_to_fp8(policy='auto')`` on this GPU instead
  (``scripts/calibrate_policy.py``) and says how to use it.

``demo`` and ``bench`` say in their last line where they wrote.

Each subcommand's ``--help`` explains its flags.
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from pathlib import Path

# ---- info ------------------------------------------------------------------------------------
PACKAGES = ("numpy", "ml_dtypes", "torch", "jax", "jaxlib", "flax", "cupy", "tqdm", "matplotlib")


def _version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - report any import failure as text
        return f"not available ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})".replace(": )", ")")
    return str(getattr(mod, "__version__", "installed"))


def kernel_cache_dir() -> str:
    """CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def _gpu_lines() -> list[str]:
    """The GPUs as CuPy sees them, else as torch sees them, else why none is visible."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        out = []
        for i in range(n):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            out.append(f"cuda:{i} {props['name'].decode()}, compute capability {props['major']}.{props['minor']}")
        return out or ["none (CuPy sees no CUDA device)"]
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - no driver / no device
        return [f"none ({type(e).__name__}: {e})"]
    try:
        import torch

        if torch.cuda.is_available():
            return [f"cuda:{i} {torch.cuda.get_device_name(i)}, compute capability "
                    f"{'.'.join(map(str, torch.cuda.get_device_capability(i)))} (seen by torch; CuPy is missing)"
                    for i in range(torch.cuda.device_count())]
        return ["none (torch sees no CUDA device)"]
    except ImportError:
        return ["unknown (neither CuPy nor torch is installed)"]


def info(compile_all: bool, progress: bool = True) -> int:
    from . import __version__, launch

    print(f"{'fusedfp8':<18}{__version__} ({Path(__file__).resolve().parent})")
    print(f"{'python':<18}{platform.python_version()} ({sys.executable})")
    for name in PACKAGES:
        print(f"{name:<18}{_version(name)}")
    for line in _gpu_lines():
        print(f"{'GPU':<18}{line}")
    ok, reason = launch.probe()
    gemm_ok, gemm_reason = launch.probe(need_fp8_gemm=True)
    print(f"{'fused kernels':<18}{'usable' if ok else 'not usable'}: {reason}")
    print(f"{'FP8 GEMMs':<18}{'usable' if gemm_ok else 'not usable'}: {gemm_reason}")
    block_ok, block_reason = launch.probe(need_block_gemm=True)
    print(f"{'block FP8 GEMMs':<18}{'usable' if block_ok else 'not usable'}: {block_reason}")
    if not ok:
        print(f"{'':<18}CPU arrays run the bit-exact NumPy reference instead")
    try:
        print(f"{'kernel sources':<18}{launch.source_dir()}")
    except FileNotFoundError as e:
        print(f"{'kernel sources':<18}MISSING: {e}")
    print(f"{'kernel cache':<18}{kernel_cache_dir()} (CuPy's disk cache; CUPY_CACHE_DIR moves it)")
    includes = launch.cuda_include_dirs()
    print(f"{'cuda_fp8.h':<18}{', '.join(includes) if includes else 'not found (pip install nvidia-cuda-runtime)'}")
    # which code launches the kernels on CUDA (fusedfp8/csrc: the compiled shim, or Python), and why
    for label, module in (("JAX launch", "fusedfp8.jax.cuda_backend"), ("torch launch", "fusedfp8.pytorch.cpp_path")):
        try:
            path, why = importlib.import_module(module).launch_path()
        except ImportError as e:
            print(f"{label:<18}not available ({type(e).__name__}: {e})")
            continue
        print(f"{label:<18}{path}: {why}" + ("" if ok else " [no usable GPU here: CPU arrays take the CPU path]"))
    try:
        from .jax.gemm import block_gemm_path, gemm_path

        path, why = gemm_path()
        print(f"{'JAX FP8 GEMM':<18}{path}: {why}")
        path, why = block_gemm_path()
        print(f"{'JAX block GEMM':<18}{path}: {why}")
    except ImportError as e:
        print(f"{'JAX FP8 GEMM':<18}not available ({type(e).__name__}: {e})")
    try:
        from .pytorch.gemm import block_gemm_path as torch_block_path
        from .pytorch.gemm import gemm_path as torch_gemm_path

        path, why = torch_gemm_path("auto")
        print(f"{'torch FP8 GEMM':<18}{path} (gemm='auto'): {why}")
        path, why = torch_block_path("auto")
        print(f"{'torch block GEMM':<18}{path} (gemm='auto'): {why}")
    except ImportError as e:
        print(f"{'torch FP8 GEMM':<18}not available ({type(e).__name__}: {e})")
    if compile_all:
        return compile_kernels(ok, reason, progress)
    return 0


def compile_kernels(ok: bool, reason: str, progress: bool) -> int:
    """Build every kernel module on GPU 0 now (loads from CuPy's disk cache when warm)."""
    from . import launch

    if not ok:
        print(f"--compile needs a usable GPU (the kernels are compiled for and loaded on it): {reason}")
        return 1
    keys = launch.all_module_keys()
    t0 = time.perf_counter()
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(keys, desc="compiling kernels", unit="module")
        except ImportError:
            pass
    for i, key in enumerate(bar if bar is not None else keys, 1):
        launch.compile_module(key, 0)
        if bar is None:
            print(f"\rcompiled {i}/{len(keys)} modules", end="", flush=True)
    if bar is None:
        print()
    print(f"compiled {len(keys)} kernel modules (every instantiation) in {time.perf_counter() - t0:.1f} s")
    return 0


# ---- demo ------------------------------------------------------------------------------------
def _demo_parser(sub) -> None:
    from .demo import CPU_SHAPE, GPU_SHAPE
    from .recipe import AMAX_COMPUTE_ALGOS, FIRST_STEPS
    from .formats import RECIPE_FORMATS

    p = sub.add_parser(
        "demo", help="train the MLP of docs/design.md in bf16 and FP8, print a table, draw the curves",
        description="Trains LayerNorm -> Linear -> gelu -> Linear with FP8 delayed scaling next to bf16 from the "
                    "same weights and data, then prints a summary table (step time, speed-up, losses, overflows) "
                    "and writes demo_summary.md, demo.json and demo.png (loss curves, the FP8/bf16 loss ratio per "
                    "step, amax and scale of every FP8 tensor) to --out. On a GPU with FP8 support it runs there; "
                    "otherwise on the CPU reference path (bit-exact FP8 emulation; its step times are not a speed "
                    "measurement).")
    p.add_argument("--framework", choices=["torch", "jax"], default="torch",
                   help="which integration trains the model (default torch)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto (default): the GPU when the capability probe accepts it, else the CPU")
    p.add_argument("--steps", type=int, default=100, help="training steps for each model (default 100)")
    p.add_argument("--hidden", type=int, default=None,
                   help=f"model width (default {GPU_SHAPE[0]} on the GPU, {CPU_SHAPE[0]} on the CPU)")
    p.add_argument("--ffn", type=int, default=None,
                   help=f"inner width (default {GPU_SHAPE[1]} on the GPU, {CPU_SHAPE[1]} on the CPU)")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"batch rows (default {GPU_SHAPE[2]} on the GPU, {CPU_SHAPE[2]} on the CPU)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    g = p.add_argument_group("recipe (fusedfp8.DelayedScaling fields)")
    g.add_argument("--margin", type=float, default=0, help="scale = fmt_max / amax / 2**margin (default 0)")
    g.add_argument("--amax-history-len", type=int, default=1024, help="rows of the amax history (default 1024)")
    g.add_argument("--amax-compute-algo", choices=AMAX_COMPUTE_ALGOS, default="max",
                   help="max over the history, or the most recent amax (default max)")
    g.add_argument("--fp8-format", choices=tuple(RECIPE_FORMATS), default="hybrid",
                   help="hybrid: E4M3 forward, E5M2 gradients; e4m3: E4M3 for both (default hybrid)")
    g.add_argument("--first-step", choices=FIRST_STEPS, default="current",
                   help="a tensor's first quantization: from its own amax (current) or with scale 1 (unit)")
    p.add_argument("--out", default="fusedfp8_demo", help="output folder (default ./fusedfp8_demo)")
    p.add_argument("--no-plot", action="store_true", help="do not write demo.png (no matplotlib needed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (no tqdm needed)")


def demo(args) -> int:
    from .demo import DemoConfig, DemoError, run_demo
    from .recipe import DelayedScaling

    margin = int(args.margin) if float(args.margin).is_integer() else args.margin
    try:
        recipe = DelayedScaling(margin=margin, amax_history_len=args.amax_history_len,
                                amax_compute_algo=args.amax_compute_algo, fp8_format=args.fp8_format,
                                first_step=args.first_step)
        config = DemoConfig(framework=args.framework, device=args.device, hidden=args.hidden, ffn=args.ffn,
                            tokens=args.tokens, steps=args.steps, lr=args.lr, seed=args.seed, recipe=recipe,
                            out=args.out, plot=not args.no_plot, progress=not args.no_progress)
    except (TypeError, ValueError) as e:
        print(f"python -m fusedfp8 demo: error: {e}", file=sys.stderr)
        return 2
    try:
        run_demo(config)
    except DemoError as e:
        print(f"python -m fusedfp8 demo: error: {e}", file=sys.stderr)
        return 1
    return 0


# ---- bench ---------------------------------------------------------------------------------
def _bench_parser(sub) -> None:
    from .demo.bench import BENCHMARKS

    p = sub.add_parser(
        "bench", help="run scripts/bench_kernels.py, bench_mlp_torch.py and bench_mlp_jax.py, collect the results",
        description="Runs the benchmark scripts of a source checkout (they are not installed with the package) and "
                    "collects their JSON, PNG and logs in --out with a markdown summary (summary.md). Without a "
                    "usable GPU the benchmarks are skipped with the reason (--tiny runs CPU smoke tests of the MLP "
                    "benchmark scripts). Every command is printed, skipped ones too.")
    p.add_argument("--out", default="fusedfp8_bench", help="output folder (default ./fusedfp8_bench)")
    p.add_argument("--dry-run", action="store_true", help="print every command and write the summary, run nothing")
    p.add_argument("--tiny", action="store_true",
                   help="tiny sizes (a quick check that the scripts run, not a measurement)")
    p.add_argument("--only", type=lambda v: v.split(","), default=None, metavar="NAME[,NAME]",
                   help=f"run only these benchmarks, from {', '.join(BENCHMARKS)}")
    p.add_argument("--calibrate", action="store_true",
                   help="instead of the benchmarks, measure the calibration table of convert_to_fp8(policy='auto') on "
                        "this GPU, eager and CUDA-graphed steps (scripts/calibrate_policy.py; meant to take under "
                        "90 s on an H200) and write it to --out")


def bench(args) -> int:
    from .demo.bench import BENCHMARKS, run_bench, run_calibrate

    if args.calibrate:
        if args.only is not None:
            print("python -m fusedfp8 bench: error: --only selects benchmarks; --calibrate runs none of them",
                  file=sys.stderr)
            return 2
        return run_calibrate(args.out, dry_run=args.dry_run, tiny=args.tiny)
    unknown = sorted(set(args.only or ()) - set(BENCHMARKS))
    if unknown:
        print(f"python -m fusedfp8 bench: error: --only: unknown {unknown}; choose from {', '.join(BENCHMARKS)}",
              file=sys.stderr)
        return 2
    return run_bench(args.out, dry_run=args.dry_run, tiny=args.tiny, only=args.only)


# ---- entry -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusedfp8", description="fusedfp8 command line")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="versions, GPU capability, probe verdict, kernel cache",
                            description="Print versions, the GPU and its compute capability, the capability probe's "
                                        "verdict and reason, and where the kernel sources and cache live.")
    p_info.add_argument("--compile", action="store_true",
                        help="compile every kernel instantiation now, so the first training step does not pay for NVRTC")
    p_info.add_argument("--no-progress", action="store_true", help="no progress bar for --compile")
    _demo_parser(sub)
    _bench_parser(sub)
    args = ap.parse_args(argv)
    if args.cmd == "info":
        return info(args.compile, progress=not args.no_progress)
    if args.cmd == "demo":
        return demo(args)
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
