"""The calibration table of ``convert_to_fp8(policy='auto')`` (see fusedfp8/policy.py): for a grid
of (tokens, in_features, out_features), one linear layer's forward + backward in bf16 against
FP8, timed on this GPU.

One step, per layer and grid point: the weight, bias and input gradients are reset (as
``zero_grad(set_to_none=True)``), forward, ``backward(dy)`` (input gradient and weight gradient),
and for FP8 ``fusedfp8.pytorch.update_model_scales`` once, as a real step would. bf16 is
``nn.Linear(in, out, bias=True)`` in bfloat16; FP8 is ``fusedfp8.pytorch.Fp8Linear`` converted
from a copy of it (``DelayedScaling()``), its quantizations (input, weight, output gradient,
each with its transpose) and its scale update included. The input and the output gradient are
fresh ``randn`` bf16 tensors per grid point.

Per grid point, in this order:
1. correctness: one step of each from the same weights and data; the SQNR of the FP8 output,
   input gradient and weight gradient against bf16's must be >= 20 dB, else the run aborts and
   writes nothing (computed on the device: a host copy of the large outputs would cost seconds);
2. timing, bf16 then FP8: ``--warmup`` steps, then ``--reps`` blocks of ``--calls`` back-to-back
   steps between CUDA events; the median per step. The steps run eagerly, as ``convert_to_fp8``
   users run them, so a layer whose step is bound by the host's launch time is timed as such.

Writes the table (fusedfp8.policy.PolicyTable's JSON: device, date, versions, how it was
measured, and per point ``bf16_ms``, ``fp8_ms`` with every block's time and the SQNRs) to
``--out`` (a .json path, or a folder for ``policy_<gpu>.json``) and says how to use it. Refuses
to run without a GPU with FP8 GEMMs; ``--device cpu`` is a smoke test of the script (tiny grid,
``time.perf_counter``, not a measurement), ``--dry-run`` lists the grid and measures nothing.
``--budget-s`` aborts (nothing written) once the run has taken longer.

Usage:
  python scripts/calibrate_policy.py --out DIR_OR_FILE [--tokens 512,1024,2048,4096,8192]
         [--features 256,512,1024,2048,4096,8192,16384] [--warmup 3] [--calls 5] [--reps 7] [--budget-s 230]
  python -m fusedfp8 bench --calibrate [--out DIR] runs it.
  CPU smoke test: --device cpu --tokens 16,32 --features 16,32 --warmup 1 --calls 1 --reps 1
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import _bench
import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8 import _cuda
from fusedfp8.policy import TABLE_ENV, PolicyTable, table_file_name

TOKENS = (512, 1024, 2048, 4096, 8192)
FEATURES = (256, 512, 1024, 2048, 4096, 8192, 16384)  # in_features and out_features alike
RECIPE = fusedfp8.DelayedScaling()
BUDGET_S = 230.0


def arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"),
                    help="the table's path (.json), or a folder for policy_<gpu>.json (default $OUT or ./out)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="the grid's token counts, comma separated")
    ap.add_argument("--features", default=",".join(map(str, FEATURES)),
                    help="the grid's in_features and out_features (every pair), comma separated")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before the timing, per layer")
    ap.add_argument("--calls", type=int, default=5, help="back-to-back steps per timed block")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks per layer (the median is kept)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"abort, writing nothing, once the run has taken longer (default {BUDGET_S:.0f}; 0: no limit)")
    ap.add_argument("--device", default="cuda", help="'cuda' (the measurement) or 'cpu' (a smoke test of the script)")
    ap.add_argument("--dry-run", action="store_true", help="list the grid and where the table would go; measure nothing")
    args = ap.parse_args(argv)
    grid = {}
    for flag in ("tokens", "features"):
        try:
            values = sorted({int(v) for v in getattr(args, flag).split(",")})
        except ValueError:
            ap.error(f"--{flag} must be positive ints joined by ','; got {getattr(args, flag)!r}")
        if not values or values[0] < 1:
            ap.error(f"--{flag} must be positive ints joined by ','; got {getattr(args, flag)!r}")
        grid[flag] = values
    for name in ("warmup", "calls", "reps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name} must be >= {0 if name == 'warmup' else 1}; got {getattr(args, name)}")
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device must be 'cuda' or 'cpu'; got {args.device!r}")
    return args, grid["tokens"], grid["features"], ap


def out_path(out: str, device_name: str) -> Path:
    """``out`` itself if it names a .json file, else ``out/policy_<gpu>.json``."""
    p = Path(out)
    return p if p.suffix == ".json" else p / table_file_name(device_name)


def sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    """As _bench.sqnr_db, computed on the tensors' device in float64 (no host copy)."""
    w, g = want.double(), got.double()
    noise = float((w - g).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(w.pow(2).sum()) / noise)


class Layer:
    """One layer of the grid (bf16 or FP8) with its input, output gradient and a ``step()``."""

    def __init__(self, module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
        self.module, self.fp8 = module, isinstance(module, fp8.Fp8Linear)
        self.x, self.dy = x.detach().clone().requires_grad_(), dy

    def step(self) -> torch.Tensor:
        m = self.module
        m.weight.grad = m.bias.grad = self.x.grad = None  # zero_grad(set_to_none=True)
        y = m(self.x)
        y.backward(self.dy)
        if self.fp8:
            fp8.update_model_scales(m)
        return y

    def timed_ms(self, clock: _bench.Clock, warmup: int, calls: int, reps: int) -> list[float]:
        for _ in range(warmup):
            self.step()
        clock.sync()
        return clock.per_call_ms(self.step, calls, reps)


def measure(tokens: int, in_f: int, out_f: int, bf16: nn.Linear, f8: fp8.Fp8Linear, args, device,
            clock: _bench.Clock) -> dict:
    """One grid point: the correctness check, then both timings."""
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
    a, b = Layer(bf16, x, dy), Layer(f8, x, dy)
    ya, yb = a.step().detach(), b.step().detach()
    sq = {"output": sqnr_db(ya, yb), "input_grad": sqnr_db(a.x.grad, b.x.grad),
          "weight_grad": sqnr_db(bf16.weight.grad, f8.weight.grad)}
    del ya, yb
    point = {"tokens": tokens, "in_features": in_f, "out_features": out_f, "sqnr_db": sq}
    if min(sq.values()) < _bench.SQNR_MIN_DB:
        return point
    times = {kind: layer.timed_ms(clock, args.warmup, args.calls, args.reps) for kind, layer in (("bf16", a), ("fp8", b))}
    for kind, t in times.items():
        point[f"{kind}_ms"] = statistics.median(t)
        point[f"{kind}_ms_all"] = t
    point["speedup"] = point["bf16_ms"] / point["fp8_ms"]
    return point


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv=None) -> int:
    args, tokens, features, ap = arguments(argv)
    device = torch.device(args.device)
    pairs = [(i, o) for i in features for o in features]
    n = len(tokens) * len(pairs)
    if args.dry_run:
        where = args.out if Path(args.out).suffix == ".json" else os.path.join(args.out, "policy_<gpu>.json")
        print(f"grid: tokens {tokens} x in_features {features} x out_features {features} = {n} points; "
              f"{args.warmup} warm-up steps, {args.reps} blocks of {args.calls} steps per layer and point")
        print(f"would write {where} (dry run: nothing measured)")
        return 0
    if device.type == "cuda":
        ok, reason = _cuda.probe(need_fp8_gemm=True)
        if not ok:
            ap.error(f"the calibration times FP8 GEMMs on the GPU, and this machine has none usable: {reason}. "
                     "(--device cpu runs a smoke test of the script, not a measurement)")
    name = device_name(device)
    path = out_path(args.out, name)
    clock = _bench.Clock(device)
    print(f"calibrating on {name}: {n} points (tokens {tokens} x in/out {features}); table -> {path}", flush=True)
    t0 = time.perf_counter()
    points = []
    torch.manual_seed(0)
    for in_f, out_f in pairs:  # one pair of layers per (in, out), every token count through it
        bf16 = nn.Linear(in_f, out_f, device=device, dtype=torch.bfloat16)
        f8 = fp8.convert_to_fp8(copy.deepcopy(bf16), RECIPE)
        for t in tokens:
            p = measure(t, in_f, out_f, bf16, f8, args, device, clock)
            elapsed = time.perf_counter() - t0
            sq = " ".join(f"{k} {v:.1f}" for k, v in p["sqnr_db"].items())
            if "fp8_ms" not in p:
                print(f"ABORT at tokens {t}, in {in_f}, out {out_f}: the FP8 layer's SQNR against bf16 (dB: {sq}) is "
                      f"below {_bench.SQNR_MIN_DB} dB; nothing written", flush=True)
                return 1
            points.append(p)
            print(f"[{len(points):>3}/{n}] {t:>5} x {in_f:>5} -> {out_f:>5}  bf16 {p['bf16_ms']:8.4f} ms  "
                  f"fp8 {p['fp8_ms']:8.4f} ms  {p['speedup']:5.2f}x  SQNR dB {sq}  ({elapsed:.0f} s)", flush=True)
            if args.budget_s and elapsed > args.budget_s:
                print(f"ABORT: {elapsed:.0f} s > --budget-s {args.budget_s:.0f} after {len(points)} of {n} points; "
                      "nothing written. Fewer --tokens / --features or --reps shorten the run", flush=True)
                return 1
        del bf16, f8
    wall = time.perf_counter() - t0
    meta = _bench.run_meta(
        measure="one step of one linear layer: forward, backward (input and weight gradients), and for fp8 "
                "update_model_scales; bf16 nn.Linear(bias=True) in bfloat16 against fusedfp8 Fp8Linear (its "
                "quantizations included), eager; median ms over blocks of back-to-back steps",
        clock="CUDA events" if device.type == "cuda" else "time.perf_counter (CPU smoke test: not a measurement)",
        smoke_test=device.type != "cuda", recipe=str(RECIPE), warmup=args.warmup, calls=args.calls, reps=args.reps,
        sqnr_min_db=_bench.SQNR_MIN_DB, launch_path=" / ".join(fp8.custom_ops.launch_path()), wall_s=wall)
    date = meta.pop("date")
    versions = {"fusedfp8": fusedfp8.__version__, "torch": torch.__version__, "cuda": torch.version.cuda}
    table = PolicyTable(name, points, date=date, versions=versions, meta=meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)
    PolicyTable.load(path)  # what convert_to_fp8 will read
    rows = [[f"{p['tokens']}", f"{p['in_features']}", f"{p['out_features']}", f"{p['bf16_ms']:.4f}",
             f"{p['fp8_ms']:.4f}", f"{p['speedup']:.2f}x"] for p in points]
    _bench.print_table(["tokens", "in", "out", "bf16 ms", "fp8 ms", "bf16 / fp8"], rows)
    faster = sum(p["speedup"] > 1 for p in points)
    print(f"\nFP8 faster at {faster} of {len(points)} points; {wall:.0f} s")
    print(f"use it: fusedfp8.pytorch.convert_to_fp8(model, policy='auto', tokens=N, policy_table='{path}'), or "
          f"export {TABLE_ENV}={path}" + (f"; copied to fusedfp8/data/{table_file_name(name)}, it is found by the "
                                          "GPU's name" if device.type == "cuda" else ""))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
