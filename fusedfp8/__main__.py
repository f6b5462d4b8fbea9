"""``python -m fusedfp8 info [--compile]``: versions, the GPU probe's verdict, the kernel cache.

(``demo`` and ``bench`` arrive with the torch and JAX integrations.)
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time


def _version(name: str) -> str:
    try:
        return getattr(importlib.import_module(name), "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - report any import failure as text
        return f"not available ({type(e).__name__})"


def info(compile_all: bool) -> int:
    from . import __version__, _cuda

    print(f"fusedfp8  {__version__}")
    print(f"python    {platform.python_version()}")
    for name in ("numpy", "ml_dtypes", "torch", "jax", "flax", "cupy"):
        print(f"{name:<10}{_version(name)}")
    ok, reason = _cuda.probe()
    print(f"GPU       {'usable' if ok else 'not usable'}: {reason}")
    if ok:
        import cupy

        print(f"device    {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"sources   {_cuda.source_dir()}")
    cache = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    print(f"kernel cache (CuPy) {cache}")
    if compile_all:
        if not ok:
            print("--compile needs a usable GPU (the kernels are compiled and loaded on it)")
            return 1
        keys = _cuda.all_module_keys()
        t0 = time.perf_counter()
        for i, key in enumerate(keys, 1):
            _cuda.kernels(key, 0)
            print(f"\rcompiled {i}/{len(keys)} modules", end="", flush=True)
        print(f"\ncompiled every kernel instantiation in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusedfp8", description="fusedfp8 command line")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="versions, GPU capability, kernel cache")
    p_info.add_argument("--compile", action="store_true",
                        help="compile every kernel instantiation now, so the first training step does not pay for NVRTC")
    args = ap.parse_args(argv)
    if args.cmd == "info":
        return info(args.compile)
    return 2


if __name__ == "__main__":
    sys.exit(main())
