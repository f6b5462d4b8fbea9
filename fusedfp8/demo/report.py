"""What the demo shows: :class:`DemoResult` (the summary table and its notes), the JSON of every
curve, and the plot.

Files written to the output folder: ``demo_summary.md`` (the table, the notes and the final FP8
scaling state), ``demo.json`` (config, device, versions, every curve) and ``demo.png`` (loss
curves; the FP8/bf16 loss ratio per step with the loss check; amax and scale of every FP8 tensor per
step).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import LOSS_TAIL, DemoConfig

# the loss check (the benchmarks' too): FP8's mean loss of the last LOSS_TAIL steps within 2% of bf16's
RATIO_BAND = 0.02


@dataclass
class DemoResult:
    """What :func:`fusedfp8.demo.run_demo` measured and wrote (``files``: name -> path)."""

    config: DemoConfig
    device: str  # 'cuda' or 'cpu'
    device_name: str
    device_reason: str  # why this device (the probe's verdict)
    shape: tuple
    curves: dict
    meta: dict
    files: dict = field(default_factory=dict)

    def rows(self) -> list[dict]:
        base = self.curves["bf16"].median_ms()
        out = []
        for name, c in self.curves.items():
            out.append({
                "model": name,
                "step time (median)": f"{c.median_ms():.3f} ms",
                "speed-up vs bf16": f"{base / c.median_ms():.2f}x"
                                    + (" (FP8 emulated)" if self.device == "cpu" and name == "fp8" else ""),
                "loss, first step": f"{c.loss[0]:.4f}",
                "final loss": f"{c.loss[-1]:.4f}",
                f"mean loss, last {min(LOSS_TAIL, len(c.loss))} steps": f"{c.tail_loss():.4f}",
                "overflows": "-" if c.overflows is None else str(int(np.sum(c.overflows))),
            })
        return out

    def notes(self) -> list[str]:
        h, f, t = self.shape
        r = self.config.recipe
        lines = [f"{self.config.framework}, {self.device} ({self.device_name}): hidden {h}, ffn {f}, {t} tokens, "
                 f"{self.config.steps} steps, Adam lr {self.config.lr}, seed {self.config.seed}",
                 f"recipe: margin={r.margin}, amax_history_len={r.amax_history_len}, "
                 f"amax_compute_algo={r.amax_compute_algo!r}, fp8_format={r.fp8_format!r}, "
                 f"first_step={r.first_step!r}",
                 f"device choice: {self.device_reason}"]
        rel = tail_ratio(self) - 1
        lines.append(f"FP8 mean loss of the last {min(LOSS_TAIL, self.config.steps)} steps: {rel:+.2%} of bf16's "
                     f"({_verdict(rel)} the {RATIO_BAND:.0%} of the loss check)")
        if self.device == "cpu":
            how = ("FP8 is emulated bit-exactly in NumPy and the GEMMs run in float32"
                   if self.config.framework == "torch"
                   else "FP8 quantization is emulated bit-exactly in jax.numpy and XLA runs the FP8 GEMMs in software")
            lines.append(f"CPU reference path: {how}, so these step times are not an FP8 speed measurement; "
                         "run on an FP8 GPU for that")
        return lines

    def table(self) -> str:
        """The summary as a markdown table followed by the notes."""
        rows = self.rows()
        cols = list(rows[0])
        out = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
        out += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
        return "\n".join(out + [""] + [f"- {n}" for n in self.notes()])


def loss_ratio(result: DemoResult) -> np.ndarray:
    """FP8 loss / bf16 loss at every step."""
    return result.curves["fp8"].loss.astype(np.float64) / result.curves["bf16"].loss.astype(np.float64)


def tail_ratio(result: DemoResult) -> float:
    """What the loss check compares: FP8's mean loss of the last :data:`LOSS_TAIL` steps over bf16's."""
    return result.curves["fp8"].tail_loss() / result.curves["bf16"].tail_loss()


def _verdict(rel: float) -> str:
    return "within" if abs(rel) <= RATIO_BAND else "outside"


def plot(result: DemoResult, path: Path) -> None:
    """Draw :func:`figure` into the PNG ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(result: DemoResult):
    """Four panels: the loss curves of bf16 and FP8; their ratio per step (the curves overlap on
    a log axis, the ratio shows how far apart they are) with the loss check; amax and scale of
    every FP8 tensor. A matplotlib Figure (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9.5))
    (ax_loss, ax_ratio), (ax_amax, ax_scale) = axes
    steps = np.arange(1, result.config.steps + 1)
    for name, c in result.curves.items():
        ax_loss.plot(steps, c.loss, label=f"{name} (median {c.median_ms():.2f} ms/step)",
                     ls="--" if name == "bf16" else "-", lw=2 if name == "bf16" else 1.3)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("MSE loss")
    ax_loss.set_title("loss")
    ax_loss.legend(fontsize=8)

    # the loss check as drawn: a band over the steps it averages, and the mean it compares
    ratio, tail_r = loss_ratio(result), tail_ratio(result)
    tail = min(LOSS_TAIL, len(ratio))
    x0, x1 = steps[-tail] - 0.5, steps[-1] + 0.5
    ax_ratio.fill_between([x0, x1], 1 - RATIO_BAND, 1 + RATIO_BAND, color="tab:green", alpha=0.2, lw=0,
                          label=f"the loss check: FP8's mean loss of the last {tail} steps within "
                                f"{RATIO_BAND:.0%} of bf16's")
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.plot(steps, ratio, color="tab:orange", lw=1.3, marker="." if len(steps) <= 50 else None,
                  label="FP8 / bf16 loss, per step")
    ax_ratio.hlines(tail_r, x0, x1, color="black", lw=2.5,
                    label=f"FP8 / bf16 mean loss of the last {tail} steps: {tail_r:.4f} "
                          f"({tail_r - 1:+.2%}, {_verdict(tail_r - 1)} the check)")
    lo, hi = min(float(np.min(ratio)), tail_r, 1.0), max(float(np.max(ratio)), tail_r, 1.0)
    pad = max(0.1 * (hi - lo), 1e-3)
    ax_ratio.set_ylim(lo - pad, hi + pad)  # the data decides the scale, the band shades what is visible of it
    ax_ratio.set_ylabel("FP8 loss / bf16 loss")
    ax_ratio.set_title("FP8 / bf16 loss ratio per step (same weights, same data)")
    ax_ratio.legend(fontsize=8)

    f8 = result.curves["fp8"]
    overflowed = np.any(~np.isfinite(f8.amax))
    for ax, values, what in ((ax_amax, f8.amax, "amax (staged, per step)"),
                             (ax_scale, f8.scale, "scale (after the update)")):
        for j, name in enumerate(f8.tensors):
            v = values[:, j]
            finite = np.isfinite(v) & (v > 0)
            line, = ax.plot(steps[finite], v[finite], label=name, lw=1.2)
            bad = ~np.isfinite(v)
            if bad.any():  # overflows: mark them at the top of the axis
                top = np.nanmax(np.where(finite, v, np.nan)) if finite.any() else 1.0
                ax.plot(steps[bad], np.full(bad.sum(), top), "x", color=line.get_color(), ms=8)
        ax.set_yscale("log")
        ax.set_title(what + ("; x = overflow" if overflowed else ""))
        ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    h, f, t = result.shape
    speed = (f"FP8 {result.curves['bf16'].median_ms() / f8.median_ms():.2f}x bf16" if result.device == "cuda"
             else "CPU reference path (FP8 emulated: step times are not a speed measurement)")
    fig.suptitle(f"fusedfp8 demo: {result.config.framework}, {result.device_name}, hidden {h} / ffn {f} / {t} tokens, "
                 + speed)
    fig.tight_layout()
    return fig


def _json_float(v) -> float | str:
    v = float(v)
    return v if math.isfinite(v) else str(v)  # JSON has no NaN / inf


def to_json(result: DemoResult) -> dict:
    """Config, device, versions and every curve (non-finite amaxes as the strings 'nan' / 'inf')."""
    config = dataclasses.asdict(result.config)
    config["recipe"] = dataclasses.asdict(result.config.recipe)
    return {
        "config": config,
        "device": result.device, "shape": list(result.shape), "meta": result.meta,
        "curves": {name: {"loss": c.loss.tolist(), "step_ms": c.step_ms.tolist(), "median_step_ms": c.median_ms(),
                          "tensors": c.tensors,
                          "amax": None if c.amax is None else [[_json_float(v) for v in r] for r in c.amax],
                          "scale": None if c.scale is None else c.scale.tolist(),
                          "overflows": None if c.overflows is None else c.overflows.tolist()}
                   for name, c in result.curves.items()},
        "fp8_over_bf16_loss": loss_ratio(result).tolist(),
    }


def write(result: DemoResult, out: Path) -> None:
    """Write demo_summary.md, demo.json and (``config.plot``) demo.png to ``out``; record them in
    ``result.files``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "demo_summary.md"
    text = "# fusedfp8 demo\n\n" + result.table() + "\n\n## FP8 scaling state after the last step\n\n```\n"
    text += result.curves["fp8"].state_table + "\n```\n"
    summary.write_text(text)
    result.files["summary"] = str(summary)
    path = out / "demo.json"
    path.write_text(json.dumps(to_json(result), indent=1))
    result.files["json"] = str(path)
    if result.config.plot:
        png = out / "demo.png"
        plot(result, png)
        result.files["png"] = str(png)
