"""torch._scaled_mm against the shim's cuBLASLt FP8 GEMM (torch.ops.fusedfp8.fp8_gemm_lt) on the GPU:
per GEMM of the MLP train step, and the CUDA-graphed step of Fp8MLP(gemm=g) against bf16.

Per shape (``hidden x ffn x tokens``; default 1024x4096x2048 and 4096x16384x8192):
1. the GEMMs as the torch layers call them (fusedfp8/pytorch/autograd.py, a bf16 model): fc1 and
   fc2 forward with their bias (fast accumulation), the same without a bias, and the dgrad and wgrad
   of each (split accumulator); a (M, K) and b (N, K) FP8 (E4M3 forward, E5M2 gradients), bf16
   output. Each is checked first: random operands (no zeros), scales 0.5 and 2**-5, a bias of
   16 N(0, 1); every backend within the output's rounding plus an accumulation allowance of a
   float64 reference (and the reference not zero; see check()); a GEMM failing it is not timed. Then
   timed: ``--calls`` calls captured in one CUDA graph per backend, CUDA events around a replay,
   ``--reps`` replays alternating between the backends, the median GPU time per call (no host
   time). The shim's GEMM runs with torch's cuBLASLt workspace size (fusedfp8.pytorch.gemm sets
   it where torch tells it). With ``--kernels`` (default) a profiler pass names the GPU kernels of
   one call of each backend: the same kernel name means cuBLASLt's heuristic gave both the same
   algorithm.
2. the train step of scripts/bench_mlp_torch.py (LayerNorm -> Linear -> gelu -> Linear, MSE, Adam,
   the FP8 scale update) captured in one CUDA graph after 3 warm-up steps, for bf16 and for
   Fp8MLP with gemm in (scaled_mm, cublaslt); first the FP8 output and gradients against bf16
   (SQNR >= 20 dB, bench_mlp_torch's check), then ``--block`` steps per timing, ``--reps`` timings
   alternating between the models, the median ms per step.

Writes DIR/gemm_backends.json (``--out``, default .) and prints a table. Exit 1 when a check fails.
Usage (repository root, GPU): PYTHONPATH=$PWD python scripts/gemm_backends.py --out /tmp/gb
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import _bench
import bench_mlp_torch as bench
import fusedfp8
from fusedfp8 import csrc
from fusedfp8.demo.task import BENCH_NOISE, Task, torch_initial_weights
from fusedfp8.pytorch import gemm as G

SHAPES = "1024x4096x2048,4096x16384x8192"
E4, E5, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
SCALES = (0.5, 2.0 ** -5)


def _gemm(name, m, n, k, ta, tb, bias, fast) -> dict:
    return dict(name=name, m=m, n=n, k=k, ta=ta, tb=tb, bias=bias, fast=fast)


def gemms(hidden: int, ffn: int, tokens: int) -> list[dict]:
    """The MLP step's GEMMs in the op's terms, out (m, n) = a (m, k) @ b (n, k).T, as autograd calls
    them: forward x_q @ w_q.T, dgrad g_q @ w_t_q.T, wgrad g_t_q @ x_t_q.T (E5M2 gradients)."""
    T, H, F = tokens, hidden, ffn
    return [_gemm("fc1.fwd+bias", T, F, H, E4, E4, True, True), _gemm("fc1.fwd", T, F, H, E4, E4, False, True),
            _gemm("fc2.fwd+bias", T, H, F, E4, E4, True, True), _gemm("fc2.fwd", T, H, F, E4, E4, False, True),
            _gemm("fc2.dgrad", T, F, H, E5, E4, False, False), _gemm("fc2.wgrad", H, F, T, E5, E4, False, False),
            _gemm("fc1.dgrad", T, H, F, E5, E4, False, False), _gemm("fc1.wgrad", F, H, T, E5, E4, False, False)]


def operands(c: dict, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def fp8(rows, cols, dtype):  # N(0, 1) + 1/8 away from 0: no zero after the cast
        x = torch.randn(rows, cols, generator=gen, device="cuda")
        return (x + torch.sign(x) * 0.125).to(dtype)

    a, b = fp8(c["m"], c["k"], c["ta"]), fp8(c["n"], c["k"], c["tb"])
    sa, sb = (torch.tensor([s], device="cuda") for s in SCALES)
    bias = (torch.randn(c["n"], generator=gen, device="cuda") * 16).to(BF16) if c["bias"] else None
    return a, b, sa, sb, bias


def backends(c: dict) -> dict:
    op = torch.ops.fusedfp8.fp8_gemm_lt.default
    fast = c["fast"]
    return {"scaled_mm": lambda a, b, sa, sb, bias: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias,
                                                                       out_dtype=BF16, use_fast_accum=fast),
            "cublaslt": lambda a, b, sa, sb, bias: op(a, b, sa, sb, BF16, fast, bias)}


def check(c: dict, args: tuple, fns: dict) -> dict:
    """{backend: worst err / bound} against float64, bound = 2**-8 |ref| + acc (|a|@|b| scale + |bias|):
    acc 2**-9 for the split accumulator (tests/kernels/test_torch_gemm_op.py), a loose 2**-5 for
    fast accumulation (no promotion: its error grows with K; the check is for layouts, scales and
    the bias, which the bias of 16 N(0, 1) makes far larger than the bound)."""
    a, b, sa, sb, bias = args
    a64, b64 = a.double(), b.double()
    scale = SCALES[0] * SCALES[1]
    ref, absref = (a64 @ b64.T) * scale, (a64.abs() @ b64.abs().T) * scale
    if bias is not None:
        ref, absref = ref + bias.double(), absref + bias.double().abs()
    if not bool((ref != 0).any()):
        raise AssertionError(f"{c['name']}: the float64 reference is all zeros")
    bound = 2.0 ** -8 * ref.abs() + (2.0 ** -5 if c["fast"] else 2.0 ** -9) * absref + 1e-30
    worst = {}
    for name, fn in fns.items():
        got = fn(*args)
        if tuple(got.shape) != (c["m"], c["n"]) or got.dtype != BF16:
            raise AssertionError(f"{c['name']} {name}: got {tuple(got.shape)} {got.dtype}")
        worst[name] = float(((got.double() - ref).abs() / bound).max())
    del ref, absref, a64, b64
    return worst


def capture(fn, args: tuple, calls: int):
    """A CUDA graph of ``calls`` calls of fn(*args) (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def alternate(fns: dict, per: int, reps: int, clock: _bench.Clock) -> dict:
    """{name: median of ``reps`` timings of fns[name]() / per}, the names taking turns."""
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(clock.ms(fn) / per)
    return {name: statistics.median(t) for name, t in times.items()}


def kernel_names(fns: dict, args: tuple) -> dict:
    """{backend: [GPU kernels of one call]} from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    names = {}
    for name, fn in fns.items():
        fn(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
        names[name] = sorted(key for key, _, _ in _bench.device_events(prof))
    return names


def gemm_part(shape, args, clock) -> list[dict]:
    rows = []
    for i, c in enumerate(gemms(*shape)):
        ops = operands(c, seed=i)
        fns = backends(c)
        worst = check(c, ops, fns)
        if max(worst.values()) > 1.0:
            print(f"  CHECK FAILED {c['name']}: beyond the accumulation bound (err / bound {worst})", flush=True)
            rows.append({"gemm": c["name"], "failed": "beyond the accumulation bound", "err_over_bound": worst})
            continue
        graphs = {name: capture(fn, ops, args.calls) for name, fn in fns.items()}
        us = {name: t * 1e3 for name, t in alternate({n: g.replay for n, g in graphs.items()}, args.calls,
                                                      args.reps, clock).items()}
        del graphs
        row = {"gemm": c["name"], "m": c["m"], "n": c["n"], "k": c["k"], "a": str(c["ta"]), "b": str(c["tb"]),
               "bias": c["bias"], "fast_accum": c["fast"], "us": us, "err_over_bound": worst,
               "tflops": {n: 2 * c["m"] * c["n"] * c["k"] / (t * 1e-6) / 1e12 for n, t in us.items()}}
        if args.kernels:
            row["kernels"] = kernel_names(fns, ops)
        rows.append(row)
        print(f"  {c['name']:<13} {c['m']:>6}x{c['n']:<6}x{c['k']:<6} " +
              "  ".join(f"{n} {t:8.1f} us" for n, t in us.items()) +
              (f"  same kernel: {row['kernels']['scaled_mm'] == row['kernels']['cublaslt']}" if args.kernels else ""),
              flush=True)
        torch.cuda.empty_cache()
    return rows


def step_part(shape, args, clock) -> dict:
    hidden, ffn, tokens = shape
    task = Task(hidden, tokens, noise=BENCH_NOISE)
    weights = torch_initial_weights(hidden, ffn, 0, torch.device("cuda"))
    x, y = task.torch_batch(0, torch.device("cuda"))
    checks = {g: bench.check_correctness(hidden, ffn, weights, x, y, torch.device("cuda"), g)
              for g in ("scaled_mm", "cublaslt")}
    for g, res in checks.items():
        if not res["ok"]:
            raise AssertionError(f"Fp8MLP gemm={g} against bf16: SQNR below {_bench.SQNR_MIN_DB} dB: {res['sqnr_db']}")
    runners = {"bf16": bench.Runner("bf16_graphed", hidden, ffn, weights, x, y, torch.device("cuda")),
               **{f"fp8_{g}": bench.Runner("fp8_graphed", hidden, ffn, weights, x, y, torch.device("cuda"), g)
                  for g in ("scaled_mm", "cublaslt")}}
    losses = {}
    for name, r in runners.items():
        losses[name] = [float(r.step()) for _ in range(bench.GRAPH_WARMUP + 2)]  # warm-up, capture, replays
        if not all(map(lambda v: v == v and abs(v) != float("inf"), losses[name])):
            raise AssertionError(f"{name}: a non-finite loss {losses[name]}")

    def block(r):
        return lambda: [r.step() for _ in range(args.block)]

    ms = alternate({name: block(r) for name, r in runners.items()}, args.block, args.reps, clock)
    for r in runners.values():
        r.close()
    torch.cuda.empty_cache()
    print("  graphed step: " + "  ".join(f"{n} {t:.3f} ms" for n, t in ms.items()), flush=True)
    return {"ms_per_step": ms, "sqnr_db": {g: res["sqnr_db"] for g, res in checks.items()}, "first_losses": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder of gemm_backends.json")
    ap.add_argument("--shapes", default=SHAPES, help="HIDDENxFFNxTOKENS[,...]")
    ap.add_argument("--calls", type=int, default=10, help="GEMM calls per captured graph")
    ap.add_argument("--reps", type=int, default=7, help="timings per backend (median)")
    ap.add_argument("--block", type=int, default=10, help="graphed steps per timing")
    ap.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                    help="name each backend's GPU kernels (torch profiler)")
    ap.add_argument("--no-step", action="store_true", help="GEMMs only")
    args = ap.parse_args(argv)
    shapes = _bench.parse_sizes(args.shapes, 3, "--shapes", ap.error)
    if not torch.cuda.is_available():
        ap.error("no CUDA device: this script times GPU kernels")
    t0 = time.perf_counter()
    lib, why = csrc.library("torch")  # builds the shim where it is not cached (~20 s), before any timing
    if lib is None:
        ap.error(f"the torch shim is not available: {why}")
    build_s = time.perf_counter() - t0
    G.backend("cublaslt")  # decides the layers' backend now: sets the shim's workspace to torch's
    how = G.gemm_path("cublaslt")[1]
    print(f"gemm='cublaslt': {how}\ntorch's cuBLASLt workspace: {G.torch_lt_workspace()} bytes; "
          f"the shim's: {lib.gemm_workspace()} bytes", flush=True)
    clock = _bench.Clock("cuda")
    results, ok = [], True
    for shape in shapes:
        print(f"[{'x'.join(map(str, shape))}] (hidden x ffn x tokens)", flush=True)
        res = {"shape": dict(zip(("hidden", "ffn", "tokens"), shape))}
        try:
            res["gemms"] = gemm_part(shape, args, clock)
            ok = ok and not any("failed" in r for r in res["gemms"])
            if not args.no_step:
                res["step"] = step_part(shape, args, clock)
        except AssertionError as e:
            print(f"  CHECK FAILED: {e}", flush=True)
            res["failed"], ok = str(e), False
        results.append(res)
    meta = _bench.run_meta(device=torch.cuda.get_device_name(), torch=torch.__version__, fusedfp8=fusedfp8.__version__,
                           shim=how, shim_workspace_bytes=lib.gemm_workspace(),
                           torch_lt_workspace_bytes=G.torch_lt_workspace(), calls=args.calls, reps=args.reps,
                           block=args.block, build_s=build_s, wall_s=time.perf_counter() - t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _bench.write_json(out / "gemm_backends.json", meta, results)
    rows = []
    for res in results:
        tag = "x".join(str(v) for v in res["shape"].values())
        for r in res.get("gemms", []):
            if "failed" in r:
                rows.append([tag, r["gemm"], "FAILED", "FAILED", ""])
                continue
            us = r["us"]
            rows.append([tag, r["gemm"], f"{us['scaled_mm']:.1f}", f"{us['cublaslt']:.1f}",
                         f"{us['cublaslt'] / us['scaled_mm']:.3f}"])
        if "step" in res:
            s = res["step"]["ms_per_step"]
            rows.append([tag, f"graphed step, ms (bf16 {s['bf16']:.3f})", f"{s['fp8_scaled_mm']:.3f}",
                         f"{s['fp8_cublaslt']:.3f}", f"{s['fp8_cublaslt'] / s['fp8_scaled_mm']:.3f}"])
    _bench.print_table(["shape", "GEMM (us per call)", "scaled_mm", "cublaslt", "lt / sm"], rows)
    print(f"wall {time.perf_counter() - t0:.1f} s (shim ready after {build_s:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
