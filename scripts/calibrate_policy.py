"""The calibration table of ``convert_to_fp8(policy='auto')`` (see fusedfp8/policy.py): for a grid
of (tokens, in_features, out_features), one linear layer's forward + backward in bf16 against
FP8, timed on this GPU in each execution mode that the table holds: eager and CUDA-graphed.

One step, per layer and grid point: the weight, bias and input gradients are reset (as
``zero_grad(set_to_none=True)``), forward, ``backward(dy)`` (input gradient and weight gradient),
and for FP8 ``fusedfp8.pytorch.update_model_scales`` once, as a real step would. bf16 is
``nn.Linear(in, out, bias=True)`` in bfloat16; FP8 is ``fusedfp8.pytorch.Fp8Linear`` converted
from a copy of it (``DelayedScaling()``), its quantizations (input, weight, output gradient,
each with its transpose) and its scale update included. The input and the output gradient are
fresh ``randn`` bf16 tensors per grid point.

Modes (``--modes``, default both on a GPU):
- ``eager``: the steps run eagerly, as a plain ``convert_to_fp8`` user runs them, so a layer whose
  step is bound by the host's launch time is timed as such (grid ``--tokens`` x ``--features``);
- ``graphed``: the step is captured in a CUDA graph (``_bench.GraphedStep``: GRAPH_WARMUP eager
  steps on a side stream, then the capture) and replayed, which removes nearly all host time;
  policy='auto' with mode='graphed' and mode='compiled' (torch.compile, jax.jit: an
  approximation, no compiled step is timed) decides from it. Its grid (``--graphed-tokens`` x
  ``--graphed-features``) is coarser by default: without launch costs the times are smooth in
  the sizes, and the prediction interpolates between grid points.

Per grid point, in this order:
1. correctness: one eager step of each from the same weights and data; the SQNR of the FP8
   output, input gradient and weight gradient against bf16's must be >= 20 dB, else the run
   aborts and writes nothing (computed on the device: a host copy of the large outputs would
   cost seconds);
2. eager timing, bf16 then FP8: ``--warmup`` steps, then ``--reps`` blocks of ``--calls``
   back-to-back steps between CUDA events; the median per step;
3. graphed, bf16 then FP8: capture; the output and both gradients are filled with NaN and one
   replay must rewrite them to within 20 dB of the eager bf16 step's (so a graph that replays
   nothing, or the wrong buffers, aborts the run); then ``--warmup`` replays and the timing as in 2.

Writes the table (fusedfp8.policy.PolicyTable's JSON, format /2: device, date, versions, how it
was measured, and per mode its points with ``bf16_ms``, ``fp8_ms``, every block's time and the
SQNRs; a mode not measured is written as missing) to ``--out`` (a .json path, or a folder for
``policy_<gpu>.json``) and says how to use it. Refuses to run without a GPU with FP8 GEMMs;
``--device cpu`` is a smoke test of the script (eager only, tiny grid, ``time.perf_counter``, not
a measurement), ``--dry-run`` lists the grids and measures nothing. ``--budget-s`` aborts
(nothing written) once the run has taken longer.

Usage:
  python scripts/calibrate_policy.py --out DIR_OR_FILE [--modes eager,graphed]
         [--tokens 512,1024,2048,4096,8192] [--features 256,512,1024,2048,4096,8192,16384]
         [--graphed-tokens 512,2048,8192] [--graphed-features 256,512,1024,2048,4096,8192,16384]
         [--warmup 3] [--calls 5] [--reps 7] [--budget-s 180]
  python -m fusedfp8 bench --calibrate [--out DIR] runs it.
  CPU smoke test: --device cpu --tokens 16,32 --features 16,32 --warmup 1 --calls 1 --reps 1
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import _bench
import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.pytorch import cpp_path
from fusedfp8 import launch
from fusedfp8.policy import MEASURED_AS, MODES, TABLE_ENV, TABLE_MODES, PolicyTable, table_file_name

TOKENS = (512, 1024, 2048, 4096, 8192)
FEATURES = (256, 512, 1024, 2048, 4096, 8192, 16384)  # in_features and out_features alike
GRAPHED_TOKENS = (512, 2048, 8192)
GRAPHED_FEATURES = FEATURES
GRAPH_WARMUP = 3  # eager steps on a side stream before the capture (the first-step path, the allocator)
RECIPE = fusedfp8.DelayedScaling()
BUDGET_S = 180.0
MEASURE = {
    "eager": "one step of one linear layer: forward, backward (input and weight gradients), and for fp8 "
             "update_model_scales; bf16 nn.Linear(bias=True) in bfloat16 against fusedfp8 Fp8Linear (its "
             "quantizations included), eager; median ms over blocks of back-to-back steps",
    "graphed": "the same step captured in one CUDA graph per layer and point (after 3 eager steps on a side "
               "stream) and replayed; median ms over blocks of back-to-back replays. Stands in for compiled "
               "steps (torch.compile, jax.jit) too: an approximation",
}


# an absolute path (not a ratio such as 'bf16 / fp8' or a unit such as 'GB/s'), its last component kept
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])(?:/[^\s/'\"]+)*/([^\s/'\"]+)")


def portable(text: str) -> str:
    """``text`` with every absolute path cut to its last component: the table is shipped, and holds
    no path of the machine that measured it."""
    return _ABSOLUTE_PATH.sub(r"\1", text)


def _int_list(ap, flag: str, text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        ap.error(f"--{flag} must be positive ints joined by ','; got {text!r}")
    return values


def arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"),
                    help="the table's path (.json), or a folder for policy_<gpu>.json (default $OUT or ./out)")
    ap.add_argument("--modes", default=None,
                    help=f"comma separated, from {list(TABLE_MODES)} (default: both; eager with --device cpu)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="the eager grid's token counts")
    ap.add_argument("--features", default=",".join(map(str, FEATURES)),
                    help="the eager grid's in_features and out_features (every pair), comma separated")
    ap.add_argument("--graphed-tokens", default=",".join(map(str, GRAPHED_TOKENS)),
                    help="the graphed grid's token counts")
    ap.add_argument("--graphed-features", default=",".join(map(str, GRAPHED_FEATURES)),
                    help="the graphed grid's in_features and out_features")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (replays) before the timing, per layer")
    ap.add_argument("--calls", type=int, default=5, help="back-to-back steps per timed block")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks per layer (the median is kept)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"abort, writing nothing, once the run has taken longer (default {BUDGET_S:.0f}; 0: no limit)")
    ap.add_argument("--device", default="cuda", help="'cuda' (the measurement) or 'cpu' (a smoke test of the script)")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the grids and where the table would go; measure nothing")
    args = ap.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device must be 'cuda' or 'cpu'; got {args.device!r}")
    modes = args.modes.split(",") if args.modes else (["eager"] if args.device == "cpu" else list(TABLE_MODES))
    bad = [m for m in modes if m not in TABLE_MODES]
    if bad or not modes:
        ap.error(f"--modes must be a comma separated subset of {list(TABLE_MODES)}; got {args.modes!r}")
    if args.device == "cpu" and "graphed" in modes:
        ap.error("--modes graphed needs a CUDA device (CUDA graphs); the CPU smoke test times eager steps only")
    grids = {}
    for mode, prefix in (("eager", ""), ("graphed", "graphed-")):
        if mode in modes:
            grids[mode] = tuple(_int_list(ap, f"{prefix}{flag}", getattr(args, f"{prefix}{flag}".replace("-", "_")))
                                for flag in ("tokens", "features"))
    for name in ("warmup", "calls", "reps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name} must be >= {0 if name == 'warmup' else 1}; got {getattr(args, name)}")
    return args, grids, ap


def out_path(out: str, device_name: str) -> Path:
    """``out`` itself if it names a .json file, else ``out/policy_<gpu>.json``."""
    p = Path(out)
    return p if p.suffix == ".json" else p / table_file_name(device_name)


def sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    """As _bench.sqnr_db, computed on the tensors' device in float64 (no host copy); NaN where
    ``got`` holds a NaN."""
    w, g = want.double(), got.double()
    noise = float((w - g).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(w.pow(2).sum()) / noise)


def sqnr_ok(sq: dict) -> bool:
    """Every SQNR at or above the floor (a NaN is not)."""
    return all(v >= _bench.SQNR_MIN_DB for v in sq.values())


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

    def results(self, y: torch.Tensor) -> dict:
        return {"output": y.detach(), "input_grad": self.x.grad, "weight_grad": self.module.weight.grad}

    def timed_ms(self, step, clock: _bench.Clock, warmup: int, calls: int, reps: int) -> list[float]:
        for _ in range(warmup):
            step()
        clock.sync()
        return clock.per_call_ms(step, calls, reps)


def _record(point: dict, times: dict) -> dict:
    for kind, t in times.items():
        point[f"{kind}_ms"] = statistics.median(t)
        point[f"{kind}_ms_all"] = t
    point["speedup"] = point["bf16_ms"] / point["fp8_ms"]
    return point


def graphed_ms(layers: dict, want: dict, args, clock: _bench.Clock) -> tuple[dict, dict]:
    """Per layer ('bf16', 'fp8'): capture its step, check one replay against ``want`` (the eager
    bf16 step's results; the graph's buffers are filled with NaN first), then time the replays.
    Returns (times, SQNRs); the times are empty where a check failed."""
    times, checks = {}, {}
    for kind, layer in layers.items():
        graph = _bench.GraphedStep(layer.step, GRAPH_WARMUP)
        for _ in range(GRAPH_WARMUP + 1):  # eager steps, then the capture and its first replay
            graph()
        got = layer.results(graph.out)
        for t in got.values():
            t.fill_(float("nan"))
        graph()
        checks[kind] = {k: sqnr_db(want[k], got[k]) for k in want}
        if not sqnr_ok(checks[kind]):
            return {}, checks
        times[kind] = layer.timed_ms(graph, clock, args.warmup, args.calls, args.reps)
        del graph, got
    return times, checks


def measure(tokens: int, in_f: int, out_f: int, bf16: nn.Linear, f8: fp8.Fp8Linear, modes: list, args, device,
            clock: _bench.Clock) -> dict:
    """One grid point in ``modes``: the correctness check, then the timings. Returns {mode: point};
    a point without ``fp8_ms`` failed its check."""
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
    layers = {"bf16": Layer(bf16, x, dy), "fp8": Layer(f8, x, dy)}
    want = {k: v.detach().clone() for k, v in layers["bf16"].results(layers["bf16"].step()).items()}
    got = layers["fp8"].results(layers["fp8"].step())
    sq = {k: sqnr_db(want[k], got[k]) for k in want}
    del got
    base = {"tokens": tokens, "in_features": in_f, "out_features": out_f, "sqnr_db": sq}
    if not sqnr_ok(sq):
        return {modes[0]: base}
    out = {}
    if "eager" in modes:
        out["eager"] = _record(dict(base), {kind: layer.timed_ms(layer.step, clock, args.warmup, args.calls, args.reps)
                                            for kind, layer in layers.items()})
    if "graphed" in modes:
        times, checks = graphed_ms(layers, want, args, clock)
        point = {**base, "graph_check_sqnr_db": checks}
        out["graphed"] = _record(point, times) if times else point
    return out


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _in(grid: tuple, t: int, i: int, o: int) -> bool:
    return t in grid[0] and i in grid[1] and o in grid[1]


def _describe(grids: dict) -> str:
    return "; ".join(f"{m}: tokens {g[0]} x in_features {g[1]} x out_features {g[1]} = "
                     f"{len(g[0]) * len(g[1]) ** 2} points" for m, g in grids.items())


def run(grids: dict, args, device, clock: _bench.Clock) -> tuple[dict, float] | None:
    """Measure every grid; ({mode: points}, seconds), or None after an abort (said why)."""
    feats = sorted({f for g in grids.values() for f in g[1]})
    tokens = sorted({t for g in grids.values() for t in g[0]})
    n = sum(len(g[0]) * len(g[1]) ** 2 for g in grids.values())
    points, done, t0 = {m: [] for m in grids}, 0, time.perf_counter()
    torch.manual_seed(0)
    for in_f in feats:
        for out_f in feats:  # one pair of layers per (in, out), every token count through it
            if not any(in_f in g[1] and out_f in g[1] for g in grids.values()):
                continue
            bf16 = nn.Linear(in_f, out_f, device=device, dtype=torch.bfloat16)
            f8 = fp8.convert_to_fp8(copy.deepcopy(bf16), RECIPE)
            for t in tokens:
                modes = [m for m, g in grids.items() if _in(g, t, in_f, out_f)]
                if not modes:
                    continue
                for mode, p in measure(t, in_f, out_f, bf16, f8, modes, args, device, clock).items():
                    elapsed = time.perf_counter() - t0
                    checks = p.get("graph_check_sqnr_db", {"fp8 against bf16": p["sqnr_db"]})
                    sq = "; ".join(f"{k}: " + " ".join(f"{n} {v:.1f}" for n, v in c.items()) for k, c in checks.items())
                    if "fp8_ms" not in p:
                        print(f"ABORT at {mode} tokens {t}, in {in_f}, out {out_f}: SQNR below {_bench.SQNR_MIN_DB} dB "
                              f"({sq}); nothing written", flush=True)
                        return None
                    points[mode].append(p)
                    done += 1
                    print(f"[{done:>3}/{n}] {mode:<7} {t:>5} x {in_f:>5} -> {out_f:>5}  bf16 {p['bf16_ms']:8.4f} ms  "
                          f"fp8 {p['fp8_ms']:8.4f} ms  {p['speedup']:5.2f}x  SQNR dB {sq}  ({elapsed:.0f} s)",
                          flush=True)
                if args.budget_s and elapsed > args.budget_s:
                    print(f"ABORT: {elapsed:.0f} s > --budget-s {args.budget_s:.0f} after {done} of {n} points; "
                          "nothing written. Fewer --tokens / --features, --graphed-* or --reps shorten the run",
                          flush=True)
                    return None
            del bf16, f8
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the graphs' memory pools
    return points, time.perf_counter() - t0


def make_table(name: str, grids: dict, points: dict, args, wall: float, device) -> PolicyTable:
    """The table of a run: its measured modes' points, the others written as missing."""
    meta = _bench.run_meta(
        clock="CUDA events" if device.type == "cuda" else "time.perf_counter (CPU smoke test: not a measurement)",
        smoke_test=device.type != "cuda", recipe=str(RECIPE), warmup=args.warmup, calls=args.calls, reps=args.reps,
        sqnr_min_db=_bench.SQNR_MIN_DB, launch_path=" / ".join(cpp_path.launch_path()), wall_s=wall)
    meta = {k: portable(v) if isinstance(v, str) else v for k, v in meta.items()}  # the command, the shim's path
    date = meta.pop("date")
    versions = {"fusedfp8": fusedfp8.__version__, "torch": torch.__version__, "cuda": torch.version.cuda}
    modes = {m: {"points": points[m], "meta": {"measure": MEASURE[m], "tokens": list(grids[m][0]),
                                               "features": list(grids[m][1])}} if m in grids else
             {"missing": f"not measured: calibrate_policy.py --modes {','.join(grids)}"} for m in TABLE_MODES}
    return PolicyTable(name, modes, date=date, versions=versions, meta=meta)


def main(argv=None) -> int:
    args, grids, ap = arguments(argv)
    device = torch.device(args.device)
    if args.dry_run:
        where = args.out if Path(args.out).suffix == ".json" else os.path.join(args.out, "policy_<gpu>.json")
        print(f"grids: {_describe(grids)}; {args.warmup} warm-up steps, {args.reps} blocks of {args.calls} steps per "
              "layer and point")
        print(f"would write {where} (dry run: nothing measured)")
        return 0
    if device.type == "cuda":
        ok, reason = launch.probe(need_fp8_gemm=True)
        if not ok:
            ap.error(f"the calibration times FP8 GEMMs on the GPU, and this machine has none usable: {reason}. "
                     "(--device cpu runs a smoke test of the script, not a measurement)")
    name = device_name(device)
    path = out_path(args.out, name)
    print(f"calibrating on {name}: {_describe(grids)}; table -> {path}", flush=True)
    measured = run(grids, args, device, _bench.Clock(device))
    if measured is None:
        return 1
    points, wall = measured
    table = make_table(name, grids, points, args, wall, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)
    PolicyTable.load(path)  # what convert_to_fp8 will read
    rows = [[m, f"{p['tokens']}", f"{p['in_features']}", f"{p['out_features']}", f"{p['bf16_ms']:.4f}",
             f"{p['fp8_ms']:.4f}", f"{p['speedup']:.2f}x"] for m in grids for p in points[m]]
    _bench.print_table(["mode", "tokens", "in", "out", "bf16 ms", "fp8 ms", "bf16 / fp8"], rows)
    print()
    for m in grids:
        print(f"{m}: FP8 faster at {sum(p['speedup'] > 1 for p in points[m])} of {len(points[m])} points")
    print(f"{wall:.0f} s in all ({', '.join(grids)})")
    usable = [m for m in MODES if MEASURED_AS[m] in grids]
    print(f"use it: fusedfp8.pytorch.convert_to_fp8(model, policy='auto', tokens=N, "
          f"mode={' | '.join(map(repr, usable))}, policy_table='{path}'), or export {TABLE_ENV}={path}"
          + (f"; copied to fusedfp8/data/{table_file_name(name)}, it is found by the GPU's name"
             if device.type == "cuda" else ""))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
