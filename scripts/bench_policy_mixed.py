"""Train step of a model of mixed layer sizes in bf16, with every linear layer in FP8, and with
``convert_to_fp8(policy='auto', mode=...)``: checks a policy table against a whole model
(docs/policy.md). A model converted with policy='auto' for the way it runs should be no slower
than bf16 and no slower than converting every layer.

The model (``MixedModel``): ``--blocks`` residual MLP blocks of width ``--small`` (x + fc2(gelu(
fc1(LayerNorm(x)))), ffn ``--ffn-mult`` x the width), a linear ``up`` to ``--large``, as many
blocks of width ``--large``, a linear ``down`` back to ``--small``; every linear is a plain
``nn.Linear`` with bias, bf16 parameters. One step: ``zero_grad(set_to_none=True)``, forward on
``--tokens`` rows, MSE against a fixed target, backward, ``Adam(fused=True, capturable=True)
.step()`` and ``fusedfp8.pytorch.update_model_scales`` for both FP8 models (the auto model takes
it even where the policy kept every layer in bf16).

Models, from the same initial weights: ``bf16``; ``fp8_all`` (``convert_to_fp8(model)``: every
nn.Linear); ``fp8_auto`` (``convert_to_fp8(model, policy='auto', tokens=--tokens, mode=<how it
runs>, policy_table=--policy-table)``: the eager modes use the model converted with
mode='eager', the graphed ones the model converted with mode='graphed'; without
``--policy-table`` the table that convert_to_fp8 finds: $FUSEDFP8_POLICY_TABLE, else the one
shipped for this GPU, which must hold graphed measurements for the graphed modes). Each runs
eager and CUDA-graphed (the whole step captured after three eager warm-up steps on a side stream,
as bench_mlp_torch.py does): modes ``<model>_<eager|graphed>``.

In this order:
1. correctness: one forward / backward of each model on the same batch; the SQNR of the output
   and of every parameter gradient of fp8_all and of each fp8_auto model against bf16 must be
   >= SQNR_MIN_DB (15 dB: see there), else exit 1 before any timing;
2. per mode: ``--warmup`` steps, then ``--reps`` blocks of ``--block`` back-to-back steps between
   CUDA events; the median per step (``step_ms``), every block (``step_ms_all``); then as many
   blocks timed on the host's clock, each ended by a synchronize: the wall time per step
   (``wall_ms``, ``wall_ms_all``: what a user waits, launch time and the last sync included);
3. per mode (``--no-profile`` skips it): a torch profiler trace of 3 steps: GPU busy time per
   step (``profile.device_ms_total``: kernels and copies only, ``_bench.device_events`` leaves
   out the optimizer's ``record_function`` annotation) and per kernel category.

The JSON (DIR/bench_policy_mixed.json) holds per mode the times, the profile and the peak
memory; what the policy converted for each way of running (``conversion``: {eager, graphed}: the
report's mode, rows and its table, as ``print(model.fp8_conversion_report)`` shows it); and
``summary``: per way of running (eager, graphed) the ratios bf16 / mode and fp8_all / mode (above
1: the mode is faster), and whether auto is no slower than bf16 and than fp8_all
(``auto_not_slower_<how>``, within ``TOLERANCE`` of their median step time: 1%); the same on the
wall times (keys ending in ``_wall``).

Usage:
  python scripts/bench_policy_mixed.py [--out DIR] [--policy-table PATH] [--tokens 2048]
         [--small 1024] [--large 4096] [--ffn-mult 4] [--blocks 2] [--modes bf16_eager,...]
         [--warmup 3] [--block 10] [--reps 7] [--no-profile]
  CPU smoke test of the script itself (tiny shapes, the CPU reference path, time.perf_counter:
  not a measurement; a table is required): --device cpu --policy-table PATH --tokens 64
         --small 16 --large 64 --blocks 1
"""
from __future__ import annotations

import argparse
import copy
import os
import platform
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
from fusedfp8.policy import MissingTableError

MODELS = ("bf16", "fp8_all", "fp8_auto")
HOWS = ("eager", "graphed")
MODES = [f"{m}_{h}" for h in HOWS for m in MODELS]
RECIPE = fusedfp8.DelayedScaling()
GRAPH_WARMUP = 3
TOLERANCE = 0.01  # auto counts as no slower within 1% of the other's median step time
# The correctness floor. Lower than the MLP benchmarks' 20 dB: here the loss is an MSE against a
# random target, and the weight gradients of every FP8 layer (E5M2 output gradients, 2 mantissa
# bits) measure 18.5-21 dB against bf16 on the CPU reference at widths 16 to 1024; a broken layer
# measures near 0 dB.
SQNR_MIN_DB = 15.0


class Block(nn.Module):
    """x + fc2(gelu(fc1(LayerNorm(x))))."""

    def __init__(self, width: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, ffn), nn.Linear(ffn, width)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class MixedModel(nn.Module):
    """``blocks`` blocks of width ``small``, ``up`` to ``large``, ``blocks`` blocks of width
    ``large``, ``down`` to ``small``."""

    def __init__(self, small: int, large: int, ffn_mult: int, blocks: int):
        super().__init__()
        self.small = nn.Sequential(*(Block(small, ffn_mult * small) for _ in range(blocks)))
        self.up = nn.Linear(small, large)
        self.large = nn.Sequential(*(Block(large, ffn_mult * large) for _ in range(blocks)))
        self.down = nn.Linear(large, small)

    def forward(self, x):
        return self.down(self.large(self.up(self.small(x))))


def mse(out, target):
    return (out.float() - target.float()).pow(2).mean()


class Runner:
    """One mode: a model, its optimizer, and ``step()`` (eager, or a CUDA graph of the eager step
    captured after GRAPH_WARMUP eager steps on a side stream)."""

    def __init__(self, mode: str, model: nn.Module, x, y, device):
        self.kind, self.how = mode.rsplit("_", 1)
        self.model, self.x, self.y = model, x, y
        fused = device.type == "cuda"
        self.opt = torch.optim.Adam(model.parameters(), lr=_bench.LR, fused=fused, capturable=fused)
        self.graphed = _bench.GraphedStep(self.eager_step, GRAPH_WARMUP) if self.how == "graphed" else None

    def eager_step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = mse(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        if self.kind != "bf16":
            fp8.update_model_scales(self.model)
        return loss

    def step(self):
        return self.eager_step() if self.how == "eager" else self.graphed()

    def close(self):
        self.graphed = None
        del self.model, self.opt


def arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default $OUT or ./out)")
    ap.add_argument("--policy-table", default=None,
                    help="the calibration table of policy='auto' (default: the one convert_to_fp8 finds: "
                         "$FUSEDFP8_POLICY_TABLE, else the table shipped for this GPU)")
    ap.add_argument("--tokens", type=int, default=2048, help="rows per step")
    ap.add_argument("--small", type=int, default=1024, help="width of the small blocks")
    ap.add_argument("--large", type=int, default=4096, help="width of the large blocks")
    ap.add_argument("--ffn-mult", type=int, default=4, help="a block's ffn width / its width")
    ap.add_argument("--blocks", type=int, default=2, help="blocks of each width")
    ap.add_argument("--modes", default=None,
                    help=f"comma separated, from {MODES} (default: all; the eager ones with --device cpu)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode before the timing")
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks (the median is reported)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiler trace of each mode")
    ap.add_argument("--device", default="cuda", help="'cuda' (the benchmark) or 'cpu' (a smoke test of the script)")
    args = ap.parse_args(argv)
    eager = [m for m in MODES if m.endswith("_eager")]
    modes = args.modes.split(",") if args.modes else (eager if args.device == "cpu" else MODES)
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {MODES}")
    for name in ("tokens", "small", "large", "ffn_mult", "blocks", "block", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0; got {args.warmup}")
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device must be 'cuda' or 'cpu'; got {args.device!r}")
    if args.device == "cpu" and any(m.endswith("_graphed") for m in modes):
        ap.error("graphed modes need a CUDA device; with --device cpu choose eager modes (--modes)")
    if args.device == "cpu" and args.policy_table is None:
        ap.error("--device cpu needs --policy-table (no table is measured for a CPU)")
    if args.policy_table is not None and not Path(args.policy_table).is_file():
        ap.error(f"--policy-table must name a file; got {args.policy_table!r}")
    return args, modes, ap


def model_key(mode: str) -> str:
    """The model a mode runs: 'fp8_auto_graphed' -> the auto model converted with mode='graphed'."""
    kind, how = mode.rsplit("_", 1)
    return f"fp8_auto_{how}" if kind == "fp8_auto" else kind


def build_models(args, device, modes: list) -> dict:
    """bf16, fp8_all and an fp8_auto model per way of running among ``modes`` (converted with that
    mode), from the same initial weights (bf16 parameters, the FP8 states float32)."""
    torch.manual_seed(0)
    base = MixedModel(args.small, args.large, args.ffn_mult, args.blocks).to(device=device, dtype=torch.bfloat16)
    models = {"bf16": base, "fp8_all": fp8.convert_to_fp8(copy.deepcopy(base), RECIPE)}
    for key in dict.fromkeys(model_key(m) for m in modes if m.startswith("fp8_auto_")):
        models[key] = fp8.convert_to_fp8(copy.deepcopy(base), RECIPE, policy="auto", tokens=args.tokens,
                                         policy_table=args.policy_table, mode=key.rsplit("_", 1)[1])
    return models


def conversion(report) -> dict:
    """A ConversionReport as JSON."""
    return {"mode": report.mode, "table": report.table, "converted": report.converted, "kept": report.kept,
            "text": str(report), "rows": [dict(zip(("name", "in_features", "out_features", "decision", "fp8_ms",
                                                    "bf16_ms", "source"), r)) for r in report.rows()]}


def time_mode(mode: str, model: nn.Module, x, y, args, device, clock: _bench.Clock) -> dict:
    """Warm-up, the CUDA-event timing, the wall-clock timing and the profile of one mode."""
    t0 = time.perf_counter()
    runner = Runner(mode, copy.deepcopy(model), x, y, device)
    for _ in range(max(args.warmup, GRAPH_WARMUP + 1 if runner.how == "graphed" else 0)):
        runner.step()
    clock.sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = clock.per_call_ms(runner.step, args.block, args.reps)
    wall = _bench.host_block_ms(runner.step, args.block, args.reps, wait=lambda _: clock.sync())
    row = {"step_ms": statistics.median(times), "step_ms_all": times, "wall_ms": statistics.median(wall),
           "wall_ms_all": wall}
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if not args.no_profile:
            row["profile"] = _bench.torch_profile(runner.step, clock)
    row["wall_s"] = time.perf_counter() - t0
    runner.close()
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def check_correctness(models: dict, x, y) -> dict:
    """Same weights, same batch: each FP8 model's output and gradients against bf16's, SQNR in dB."""
    got = {}
    for kind, model in models.items():
        model = copy.deepcopy(model)  # the timed models keep a fresh FP8 state
        out = model(x)
        mse(out, y).backward()
        got[kind] = {"output": out.detach(), **{n: p.grad for n, p in model.named_parameters()}}
        del model
    res = {kind: {name: _bench.sqnr_db(want, got[kind][name]) for name, want in got["bf16"].items()}
           for kind in models if kind != "bf16"}
    worst = {kind: min(v.values()) for kind, v in res.items()}
    return {"sqnr_db": res, "worst_db": worst, "floor_db": SQNR_MIN_DB,
            "ok": all(w >= SQNR_MIN_DB for w in worst.values())}


def summarize(modes: dict) -> dict:
    """Per way of running, the ratios and verdicts on the CUDA-event step times, and the same on
    the wall times (keys ending in '_wall')."""
    s = {"tolerance": TOLERANCE}
    for how in HOWS:
        for clock, suffix in (("step_ms", ""), ("wall_ms", "_wall")):
            ms = {k: modes[f"{k}_{how}"][clock] for k in MODELS if f"{k}_{how}" in modes}
            for kind, t in ms.items():
                if kind != "bf16" and "bf16" in ms:
                    s[f"{kind}_{how}_vs_bf16{suffix}"] = ms["bf16"] / t
                if kind == "fp8_auto" and "fp8_all" in ms:
                    s[f"fp8_auto_{how}_vs_fp8_all{suffix}"] = ms["fp8_all"] / t
            if len(ms) == 3:
                s[f"auto_not_slower_{how}{suffix}"] = {k: ms["fp8_auto"] <= ms[k] * (1 + TOLERANCE)
                                                       for k in ("bf16", "fp8_all")}
    return s


def main(argv=None) -> int:
    args, modes, ap = arguments(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        ok, reason = launch.probe(need_fp8_gemm=True)
        if not ok:
            ap.error(f"the benchmark times FP8 GEMMs on the GPU, and this machine has none usable: {reason} "
                     "(--device cpu runs a smoke test of the script)")
    try:
        models = build_models(args, device, modes)
    except MissingTableError as e:  # MissingModeError too: a table without graphed measurements
        ap.error(f"policy='auto' cannot decide: {e}")
    reports = {k.rsplit("_", 1)[1]: m.fp8_conversion_report for k, m in models.items() if k.startswith("fp8_auto_")}
    for report in reports.values():
        print(report, end="\n\n", flush=True)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, args.small, device=device, dtype=torch.bfloat16, generator=g)
    y = torch.randn(args.tokens, args.small, device=device, dtype=torch.bfloat16, generator=g)
    correctness = check_correctness(models, x, y)
    print("correctness: worst SQNR against bf16 "
          + ", ".join(f"{k} {v:.1f} dB" for k, v in correctness["worst_db"].items()) + f"; ok={correctness['ok']}",
          flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    meta = _bench.run_meta(
        device=name, torch=torch.__version__, fusedfp8=fusedfp8.__version__, recipe=str(RECIPE), lr=_bench.LR,
        model={"small": args.small, "large": args.large, "ffn_mult": args.ffn_mult, "blocks": args.blocks},
        tokens=args.tokens, clock="CUDA events" if device.type == "cuda" else "time.perf_counter (CPU smoke test)",
        wall_clock="time.perf_counter around blocks of steps, each block ended by a synchronize",
        smoke_test=device.type != "cuda", launch_path=" / ".join(cpp_path.launch_path()))
    result = {"conversion": {how: conversion(r) for how, r in reports.items()}, "correctness": correctness,
              "modes": {}}
    if not correctness["ok"]:
        print("FAILED: an FP8 model is below the SQNR floor; nothing timed")
        _bench.write_json(out / "bench_policy_mixed.json", meta, [result])
        return 1
    clock = _bench.Clock(device)
    for mode in modes:
        row = result["modes"][mode] = time_mode(mode, models[model_key(mode)], x, y, args, device, clock)
        busy = row.get("profile", {}).get("device_ms_total")
        print(f"{mode:<18} {row['step_ms']:9.3f} ms/step  wall {row['wall_ms']:9.3f} ms/step"
              + (f"  GPU busy {busy:.3f} ms" if busy else "") + f"  ({row['wall_s']:.0f} s)", flush=True)
    result["summary"] = summarize(result["modes"])
    _bench.write_json(out / "bench_policy_mixed.json", meta, [result])
    rows = []
    for mode, row in result["modes"].items():
        kind, how = mode.rsplit("_", 1)
        s = result["summary"]
        busy = row.get("profile", {}).get("device_ms_total")
        rows.append([mode, f"{row['step_ms']:.3f}", f"{row['wall_ms']:.3f}", "-" if busy is None else f"{busy:.3f}",
                     f"{s[f'{kind}_{how}_vs_bf16']:.2f}x" if f"{kind}_{how}_vs_bf16" in s else "-",
                     f"{s[f'fp8_auto_{how}_vs_fp8_all']:.2f}x" if kind == "fp8_auto" and
                     f"fp8_auto_{how}_vs_fp8_all" in s else "-"])
    _bench.print_table(["mode", "step ms (median)", "wall ms", "GPU busy ms", "bf16 / mode", "fp8_all / mode"], rows)
    print()
    for how, report in reports.items():
        print(f"policy='auto', mode={how!r} converted {len(report.converted)} of {len(report.decisions)} linear "
              f"layers: {', '.join(report.converted) or 'none'}")
    for how in HOWS:
        for suffix, clock in (("", "step time"), ("_wall", "wall time")):
            verdict = result["summary"].get(f"auto_not_slower_{how}{suffix}")
            if verdict is not None:
                print(f"{how}, {clock}: auto no slower than bf16: {verdict['bf16']}, than fp8_all: "
                      f"{verdict['fp8_all']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
