"""Where the host time of one fusedfp8.quantize call from torch goes (1024x1024 bf16).

Prints the per-call wall time, the cost of the pieces it is made of, and a cProfile table.
Usage: python scripts/profile_host.py
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from fusedfp8 import _cuda, ops  # noqa: E402
from fusedfp8 import _interop as io  # noqa: E402


def per_call(fn, n=3000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) * 1e6 / n
    torch.cuda.synchronize()
    return dt


def main():
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.ones(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    call = lambda: ops.quantize(x, s, "e4m3", amax=amax)  # noqa: E731
    print(f"ops.quantize: {per_call(call):.1f} us/call")
    kern = _cuda.kernels(_cuda.ModuleKey("quantize", "bfloat16", "e4m3", "identity"), 0)["flat_vec1_store1"]
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    stream = io.stream_ptr(io.describe(x, "x"))
    args = (x.data_ptr(), 0, q.data_ptr(), s.data_ptr(), amax.data_ptr(), 0, 0, 0, x.numel(), 1.0)
    grid = _cuda.flat_grid(kern, x.numel(), 0)
    print(f"bare driver launch: {per_call(lambda: kern(grid, 256, stream, *args)):.1f} us")
    print(f"stream_ptr: {per_call(lambda: io.stream_ptr(io.describe(x, 'x'))):.1f} us")
    print(f"torch.empty fp8: {per_call(lambda: x.new_empty(x.shape, dtype=torch.float8_e4m3fn)):.1f} us")
    print(f"describe: {per_call(lambda: io.describe(x, 'x')):.1f} us")
    print(f"torch x.abs().max() (a 2-kernel torch op, for scale): {per_call(lambda: x.abs().max()):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
