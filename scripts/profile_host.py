"""Where the host time of one fusedfp8.quantize call from torch goes (1024x1024 bf16).

Prints the per-call wall time (pipelined calls, as bench_kernels.py's host cost), the cost of the
pieces it is made of (the launch interface alone, describing the array, the stream lookup, the
output allocation), and a cProfile table of 2000 calls.
Usage: python scripts/profile_host.py
"""
from __future__ import annotations

import cProfile
import pstats
import sys

import torch

import _bench
import fusedfp8
from fusedfp8 import _cuda
from fusedfp8 import _interop as io


def per_call_us(fn) -> float:
    return _bench.host_us_per_call(fn, calls=3000, reps=1, sync=torch.cuda.synchronize)


def main() -> int:
    if not torch.cuda.is_available():
        print("profile_host.py needs a CUDA GPU that runs the fused kernels (this machine has none)", file=sys.stderr)
        return 2
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.ones(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    call = lambda: fusedfp8.quantize(x, s, "e4m3", amax=amax)  # noqa: E731
    print(f"fusedfp8.quantize: {per_call_us(call):.1f} us/call")
    device, stream = x.device.index, io.stream_ptr(io.describe(x, "x"))

    def launch():
        _cuda.launch_quantize(device, stream, dtype="bfloat16", fmt="e4m3", op="identity", x=x.data_ptr(), b=0,
                              q=q.data_ptr(), scale=s.data_ptr(), amax=amax.data_ptr(), rows=1024, cols=1024)

    print(f"launch interface (_cuda.launch_quantize on raw pointers): {per_call_us(launch):.1f} us")
    print(f"stream_ptr: {per_call_us(lambda: io.stream_ptr(io.describe(x, 'x'))):.1f} us")
    print(f"torch.empty fp8: {per_call_us(lambda: x.new_empty(x.shape, dtype=torch.float8_e4m3fn)):.1f} us")
    print(f"describe: {per_call_us(lambda: io.describe(x, 'x')):.1f} us")
    print(f"torch x.abs().max() (a 2-kernel torch op, for scale): {per_call_us(lambda: x.abs().max()):.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
