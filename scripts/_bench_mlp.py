"""The parts of the MLP train-step benchmark that bench_mlp_torch.py and bench_mlp_jax.py share:
the command line (``--recipes``: scripts/_bench_recipes.py), the summary, the markdown table and
the plot. The clocks, SQNR, tables and JSON of every benchmark script are in _bench.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import numpy as np

import _bench
import _bench_recipes

SHAPES = [(4096, 16384, 8192), (1024, 4096, 2048)]  # hidden, ffn, tokens
LOSS_TOLERANCE = 0.02  # mean loss of the last 10 steps against bf16's


def mlp_arguments(doc: str, framework: str, modes: list[str], argv=None):
    """The command line of an MLP benchmark script: (args, shapes, modes). ``--framework`` is
    accepted for the command lines of the former bench_mlp.py (one value: this script's)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=[framework], default=framework,
                    help=f"the framework to benchmark (this script: {framework})")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                    help="hidden x ffn x tokens, comma separated")
    ap.add_argument("--modes", default=None, help=f"comma separated, from {modes}")
    ap.add_argument("--steps", type=int, default=100, help="training steps of the loss curve")
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks (the median is reported)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the per-kernel profile and GPU busy time (torch: of 5 steps of every mode; jax: of "
                         "10 jitted steps)")
    ap.add_argument("--device", default="cuda", help="'cuda' (the benchmark) or 'cpu' (a smoke test of the script)")
    _bench_recipes.add_argument(ap)
    if framework == "torch":
        ap.add_argument("--torch-gemm", choices=["auto", "cublaslt", "scaled_mm"], default="auto",
                        help="the FP8 layers' gemm= (fusedfp8.pytorch.gemm): the shim's cuBLASLt GEMM, "
                             "torch._scaled_mm, or the first where the shim can be had (default)")
    if framework == "jax":
        ap.add_argument("--jax-forward-accum", choices=["fast", "split"], default="fast",
                        help="cuBLASLt accumulation of the forward FP8 GEMMs (gradients: always split)")
        ap.add_argument("--jax-init", choices=["f32", "bf16"], default="f32",
                        help="run flax's initializers in float32 and round to bf16 (default), or in bf16 itself")
    args = ap.parse_args(argv)
    chosen = (args.modes or ",".join(modes)).split(",")
    bad = [m for m in chosen if m not in modes]
    if bad:
        ap.error(f"--modes: unknown {bad}; choose from {modes}")
    shapes = _bench.parse_sizes(args.shapes, 3, "--shapes", ap.error)
    args.recipes = _bench_recipes.parse(args.recipes, ap.error)
    for name in ("steps", "block", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    return args, shapes, chosen, ap


def summarize(shape, res: dict, steps: int, targets: dict, recipes=("delayed",)) -> None:
    """``res['summary']``: like-for-like speed-ups, the best FP8 mode against the best bf16 mode
    (``best``) and against the best of bf16 eager / compiled / jit (``issue_baseline``: bf16
    without CUDA graphs, the baseline of the speed targets) with the shape's target speed-up,
    the mean loss of the last 10 steps of every FP8 mode against the bf16 reference, and
    graphed / compiled loss curves against their eager twin. ``best`` and ``issue_baseline`` are of the DelayedScaling modes;
    the modes of the other ``recipes`` (``fp8_eager@current``, ...) get theirs from
    :func:`_bench_recipes.summarize`."""
    modes = res["modes"]
    ms = {m: r["step_ms"] for m, r in modes.items()}
    bf16 = {m: t for m, t in ms.items() if m.startswith("bf16")}
    every_f8 = {m: t for m, t in ms.items() if m.startswith("fp8")}
    f8 = {m: t for m, t in every_f8.items() if _bench_recipes.TAG not in m}

    def twin_of(m):
        twin = "bf16_" + m.split(_bench_recipes.TAG)[0].split("_")[1]
        return twin if twin in bf16 else ("bf16_jit" if "bf16_jit" in bf16 else None)

    s = {}
    for m, t in every_f8.items():  # like for like
        twin = "bf16_" + m.split(_bench_recipes.TAG)[0].split("_")[1]
        if twin in bf16:
            s[f"{m}_vs_{twin}"] = bf16[twin] / t
    tgt = targets.get(tuple(shape))
    for key, base in (("best", bf16), ("issue_baseline", {m: t for m, t in bf16.items() if m != "bf16_graphed"})):
        if base and f8:
            best_b, best_f = min(base, key=base.get), min(f8, key=f8.get)
            s[key] = {"bf16": best_b, "fp8": best_f, "speedup": base[best_b] / f8[best_f]}
            if tgt is not None:
                s[key].update(target=tgt, met=s[key]["speedup"] >= tgt)
    tail = slice(max(0, steps - 10), steps)
    ref_mode = next((m for m in ("bf16_eager", "bf16_compiled", "bf16_graphed", "bf16_jit") if m in modes), None)
    if ref_mode is not None:
        ref_tail = statistics.fmean(modes[ref_mode]["loss"][tail])
        s["loss_tail_reference"] = {"mode": ref_mode, "mean": ref_tail, "steps": [tail.start + 1, tail.stop]}
        for m in [*every_f8, *(m for m in modes if m.startswith("flax"))]:
            rel = statistics.fmean(modes[m]["loss"][tail]) / ref_tail - 1
            s[f"{m}_loss_tail_rel"] = rel
            s[f"{m}_loss_within_2pct"] = abs(rel) <= LOSS_TOLERANCE
    for kind in ("bf16", "fp8"):
        eager = modes.get(f"{kind}_eager")
        for how in ("compiled", "reduceoverhead", "graphed"):
            other = modes.get(f"{kind}_{how}")
            if eager and other:
                s[f"{kind}_{how}_vs_eager_max_rel_loss_diff"] = _bench_recipes.max_rel_diff(eager["loss"],
                                                                                            other["loss"])
    if "bf16_jit" in ms:
        for m, t in ms.items():
            if m != "bf16_jit":
                s[f"{m}_vs_bf16_jit"] = ms["bf16_jit"] / t
    res["summary"] = s
    _bench_recipes.summarize(res, list(recipes), twin_of)


def _cell(row: dict) -> str:
    """A mode's step time, and the GPU busy time of its profile where it has one."""
    busy = (row.get("profile") or {}).get("busy_ms_per_step")
    return f"{row['step_ms']:.3f} ms" + ("" if busy is None else f" (busy {busy:.3f})")


def print_mlp_table(results: list, all_modes: list[str]) -> None:
    header = (["shape (hidden/ffn/tokens)", *all_modes, "best FP8 / best bf16", "best FP8 / best bf16 eager+compiled",
               "loss 91-100 vs bf16"])
    rows = []
    for res in results:
        sh, s = res["shape"], res["summary"]
        cells = [_cell(res["modes"][m]) if m in res["modes"] else "-" for m in all_modes]
        sp = [f"{b['speedup']:.2f}x ({b['fp8']} / {b['bf16']})" if b else "-"
              for b in (s.get("best"), s.get("issue_baseline"))]
        loss = ", ".join(f"{k.split('_loss')[0]} {v:+.2%}" for k, v in s.items() if k.endswith("_loss_tail_rel"))
        rows.append([f"{sh['hidden']}/{sh['ffn']}/{sh['tokens']}", *cells, sp[0], sp[1], loss or "-"])
    if any("recipes" in res["summary"] for res in results):  # --recipes with more than delayed
        header.append(_bench_recipes.TABLE_HEADER)
        for row, res in zip(rows, results):
            row.append(_bench_recipes.table_cell(res["summary"]))
    _bench.print_table(header, rows)


def plot_mlp(results: list, path: Path, meta: dict) -> None:
    """Per shape: the median step time of every mode (bars), the loss curves, and every FP8 or
    flax-FP8 mode's loss divided by the bf16 reference's per step (the curves overlap on a log
    axis; the ratio shows how far apart they are)."""
    plt = _bench.pyplot()
    if plt is None:
        return
    n = len(results)
    fig, axes = plt.subplots(3, n, figsize=(6 * n, 11), squeeze=False)
    for j, res in enumerate(results):
        sh, modes = res["shape"], list(res["modes"])
        ax = axes[0][j]
        vals = [res["modes"][m]["step_ms"] for m in modes]
        ax.bar(range(len(modes)), vals, color=["tab:gray" if m.startswith("bf16") else "tab:orange" for m in modes])
        ax.set_xticks(range(len(modes)), modes, rotation=30, ha="right")
        ax.set_ylabel("ms / train step (median)")
        best = res["summary"].get("best")
        ax.set_title(f"hidden {sh['hidden']} / ffn {sh['ffn']} / {sh['tokens']} tokens"
                     + (f"\nbest FP8 / best bf16: {best['speedup']:.2f}x" if best else ""))
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        color = {m: f"C{i}" for i, m in enumerate(modes)}  # one colour per mode in both loss panels
        ax = axes[1][j]
        for m in modes:
            bf = m.startswith("bf16")
            ax.plot(res["modes"][m]["loss"], label=m, color=color[m], lw=2 if bf else 1.2, ls="--" if bf else "-")
        ax.set_yscale("log")
        ax.set_ylabel("MSE loss")
        ax.legend(fontsize=8)
        ax = axes[2][j]
        ref = res["summary"].get("loss_tail_reference", {}).get("mode")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhspan(1 - LOSS_TOLERANCE, 1 + LOSS_TOLERANCE, color="tab:green", alpha=0.12, lw=0)
        if ref is not None:
            base = np.asarray(res["modes"][ref]["loss"], np.float64)
            for m in modes:
                if not m.startswith("bf16"):
                    ax.plot(np.asarray(res["modes"][m]["loss"], np.float64) / base, label=f"{m} / {ref}",
                            color=color[m], lw=1.2)
            ax.legend(fontsize=8)
        ax.set_ylabel("loss / bf16 loss")
        for ax in axes[1][j], axes[2][j]:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    fw = meta.get("framework", "torch")
    fig.suptitle(f"fusedfp8 MLP train step, {fw} {meta[fw]}, {meta['device']}")
    _bench.save_figure(fig, path, dpi=120)
