"""Where the host time goes: of one fusedfp8.quantize call from torch (``quantize``), and of each
FP8 GEMM backend of the torch layers (``gemm``).

quantize (1024x1024 bf16): the per-call wall time (pipelined calls, as bench_kernels.py's host
cost; the design's target is 10 us), the cost of the pieces it is made of (the launch interface
alone, describing the array, the stream lookup, the output allocation), and a cProfile table of
2000 calls.

gemm: for each backend of fusedfp8.pytorch.gemm ('scaled_mm': torch._scaled_mm, 'cublaslt': the
shim's fusedfp8::fp8_gemm_lt), the host microseconds per GEMM call as the layers make it
(gemm.scaled_mm: the forward with fast accumulation and a bias, the dgrad and the wgrad
without) and of the bare op; ends with one JSON line of these figures.
Usage: python scripts/profile_host.py [--part quantize|gemm|all]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys

import torch

import _bench
import fusedfp8
from fusedfp8 import launch
from fusedfp8 import _interop as io


def per_call_us(fn) -> float:
    return _bench.host_us_per_call(fn, calls=3000, reps=1, sync=torch.cuda.synchronize)


def quantize_part() -> None:
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.ones(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    call = lambda: fusedfp8.quantize(x, s, "e4m3", amax=amax)  # noqa: E731
    print(f"fusedfp8.quantize: {per_call_us(call):.1f} us/call")
    device, stream = x.device.index, io.stream_ptr(io.describe(x, "x"))

    def on_pointers():
        launch.quantize(device, stream, {"x": x.data_ptr(), "q": q.data_ptr(), "scale": s.data_ptr(),
                                         "amax": amax.data_ptr()},
                        dtype="bfloat16", fmt="e4m3", op="identity", rows=1024, cols=1024)

    print(f"launch interface (launch.quantize on raw pointers): {per_call_us(on_pointers):.1f} us")
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


def _gemm_calls(hidden: int, ffn: int, tokens: int, backend: str) -> dict:
    """The fc1 GEMMs of the MLP as gemm.scaled_mm makes them with ``backend``: name -> call."""
    from fusedfp8.pytorch import gemm as G

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    q = lambda *s, t=e4: torch.randn(*s, device="cuda").to(t)  # noqa: E731
    x, w, g = q(tokens, hidden), q(ffn, hidden), q(tokens, ffn, t=e5)
    w_t, g_t, x_t = q(hidden, ffn), q(ffn, tokens, t=e5), q(hidden, tokens)
    s = torch.full((1,), 0.5, device="cuda")
    bias = torch.zeros(ffn, device="cuda", dtype=torch.bfloat16)
    bf = torch.bfloat16
    return {
        "forward (fast accum, bias)": lambda: G.scaled_mm(x, w.t(), s, s, bias, bf, True, backend),
        "forward (fast accum)": lambda: G.scaled_mm(x, w.t(), s, s, None, bf, True, backend),
        "dgrad": lambda: G.scaled_mm(g, w_t.t(), s, s, None, bf, False, backend),
        "wgrad": lambda: G.scaled_mm(g_t, x_t.t(), s, s, None, bf, False, backend),
        "bare op": (lambda: torch._scaled_mm(x, w.t(), scale_a=s, scale_b=s, out_dtype=bf, use_fast_accum=True))
        if backend == "scaled_mm" else (lambda: torch.ops.fusedfp8.fp8_gemm_lt.default(x, w, s, s, bf, True)),
    }


def gemm_part() -> dict:
    """Host microseconds per GEMM call of each backend, on 256x256x256 operands: pipelined calls
    take max(host, device) time, and a GEMM this small keeps them host-bound."""
    import fusedfp8.pytorch as fp8
    from fusedfp8.pytorch import gemm as G

    out = {}
    print(f"\n== FP8 GEMM backends: {fp8.gemm_path('auto')}")
    for backend in ("scaled_mm", "cublaslt"):
        G.backend(backend)  # loads the shim (defines the op) for 'cublaslt'; raises where it cannot
        for name, call in _gemm_calls(256, 256, 256, backend).items():
            us = per_call_us(call)
            out[f"{backend}: {name}"] = us
            print(f"  {backend:<9} {name:<28} {us:7.1f} us/call (host, pipelined)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["quantize", "gemm", "all"], default="all")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_host.py needs a CUDA GPU that runs the fused kernels (this machine has none)", file=sys.stderr)
        return 2
    if args.part in ("quantize", "all"):
        quantize_part()
    if args.part in ("gemm", "all"):
        print(json.dumps({"per_gemm_host_us": gemm_part()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
