"""The FP8 recipes of the MLP train-step benchmarks: ``--recipes delayed,current`` (and ``unit``,
``block``).

Every FP8 mode of bench_mlp_torch.py, bench_mlp_jax.py and seed_flax_mlp.py runs once per recipe
in the same run, beside bf16, from the same initial weights on the same data. A mode under
``DelayedScaling()`` keeps its name (``fp8_graphed``: a run of the default ``--recipes delayed``
tags nothing); under ``CurrentScaling()`` it is tagged
``fp8_graphed@current``. Every row of the JSON says its recipe (``'delayed'``, ``'current'``,
``None`` for bf16, ``'flax'`` for flax's own ``Fp8DotGeneralOp``, which has its own delayed
scaling and takes no fusedfp8 recipe).

The step is the same for both recipes. Under CurrentScaling the scale update changes no scale
but still closes the step (overflow count, last amax kept, staging row cleared): torch's
``update_model_scales`` stays in the step (without it the next backward raises
MissedScaleUpdateError), and the flax modules close the previous step at the start of their
forward, their state travelling through ``'_overwrite_with_gradient'`` as under DelayedScaling.
:func:`state_check` shows the state machine did what its recipe says.
"""
from __future__ import annotations

import numpy as np

import fusedfp8

# 'unit': DelayedScaling(first_step='unit'), whose first step quantizes with scale 1 (no first-step
# amax pass): its quantizations need no cooperative launch (the first step's grid-wide amax), so a
# CUDA-graphed step holds plain kernel nodes only.
# 'block': BlockScaling() (1x128 / 128x128 blocks, E4M3, power-of-two scales): no state at all.
RECIPES = {"delayed": fusedfp8.DelayedScaling(), "current": fusedfp8.CurrentScaling(),
           "unit": fusedfp8.DelayedScaling(first_step="unit"), "block": fusedfp8.BlockScaling()}
TAG = "@"


def add_argument(ap) -> None:
    ap.add_argument("--recipes", default="delayed",
                    help=f"comma separated, from {list(RECIPES)}: every FP8 mode runs once per recipe in the same "
                         f"run (a mode under current scaling is named e.g. fp8_graphed{TAG}current)")


def parse(text: str, error) -> list[str]:
    """``'delayed,current'`` -> ['delayed', 'current']; ``error(message)`` (an ArgumentParser's) on
    anything else."""
    names = [r for r in text.split(",") if r]
    bad = [r for r in names if r not in RECIPES]
    if not names or bad or len(set(names)) != len(names):
        error(f"--recipes: comma separated names from {list(RECIPES)}, each once; got {text!r}")
    return names


def tagged(name: str, recipe: str) -> str:
    """``name`` for ``recipe``: unchanged under 'delayed', ``name@current`` otherwise."""
    return name if recipe == "delayed" else f"{name}{TAG}{recipe}"


def split(mode: str) -> tuple[str, str]:
    """``'fp8_graphed@current'`` -> ('fp8_graphed', 'current'); an untagged mode -> (mode, 'delayed')."""
    base, _, recipe = mode.partition(TAG)
    return base, recipe or "delayed"


def expand(modes: list[str], recipes: list[str], takes_recipe) -> list[str]:
    """Every mode for which ``takes_recipe(mode)`` once per recipe, the others once, in order."""
    return [tagged(m, r) for m in modes for r in (recipes if takes_recipe(m) else ["delayed"])]


def row_recipe(mode: str, takes_recipe) -> str | None:
    """The recipe of a mode's row: 'delayed' / 'current' for a fusedfp8 FP8 mode, None for bf16
    and 'flax' for flax's own FP8 op."""
    base, recipe = split(mode)
    if takes_recipe(base):
        return recipe
    return "flax" if base.startswith("flax") else None


def meta(recipes: list[str]) -> dict:
    """The run's recipes for the JSON meta: ``recipe`` (as before: the str of the recipe, or of
    each, joined) and ``recipes`` (name -> str)."""
    return {"recipe": ", ".join(str(RECIPES[r]) for r in recipes), "recipes": {r: str(RECIPES[r]) for r in recipes}}


def summarize(res: dict, recipes: list[str], bf16_twin) -> None:
    """Add to ``res['summary']``, for every FP8 mode under a recipe other than delayed (``m`` its
    delayed name, ``t = m@current``): ``{t}_vs_{m}`` (delayed ms / current ms: the speed-up of
    current scaling over delayed, < 1 when current is slower), ``best@current`` (the fastest
    current mode against the best bf16 mode), and ``recipes``: per FP8 mode the ms of each recipe,
    its bf16 twin (``bf16_twin(m)``) and the ratios current/bf16 (``current_vs_bf16``,
    bf16 ms / current ms) and current/delayed (``current_vs_delayed``). The like-for-like
    ``{t}_vs_{twin}`` and the loss of the last steps against bf16's (``{t}_loss_tail_rel``,
    ``{t}_loss_within_2pct``) are made by _bench_mlp.summarize."""
    modes, s = res["modes"], res["summary"]
    if all(TAG not in m for m in modes):
        return  # delayed scaling only: no per-recipe summary
    ms = {m: r["step_ms"] for m, r in modes.items()}
    bf16 = {m: t for m, t in ms.items() if m.startswith("bf16")}
    table = {}
    for mode, t in ms.items():
        base, recipe = split(mode)
        if not base.startswith("fp8"):
            continue
        entry = table.setdefault(base, {})
        entry[f"{recipe}_ms"] = t
        twin = bf16_twin(base)
        if twin in bf16:
            entry.update(bf16_mode=twin, bf16_ms=bf16[twin])
            entry[f"{recipe}_vs_bf16"] = bf16[twin] / t
        if recipe != "delayed" and base in ms:
            entry[f"{recipe}_vs_delayed"] = ms[base] / t
            s[f"{mode}_vs_{base}"] = ms[base] / t
    for recipe in recipes:
        if recipe == "delayed":
            continue
        f8 = {m: t for m, t in ms.items() if m.startswith("fp8") and split(m)[1] == recipe}
        if bf16 and f8:
            best_b, best_f = min(bf16, key=bf16.get), min(f8, key=f8.get)
            s[tagged("best", recipe)] = {"bf16": best_b, "fp8": best_f, "speedup": bf16[best_b] / f8[best_f]}
        for how in ("compiled", "reduceoverhead", "graphed"):
            eager, other = modes.get(tagged("fp8_eager", recipe)), modes.get(tagged(f"fp8_{how}", recipe))
            if eager and other:
                s[f"{tagged(f'fp8_{how}', recipe)}_vs_eager_max_rel_loss_diff"] = max_rel_diff(eager["loss"],
                                                                                             other["loss"])
    if table:
        s["recipes"] = table


TABLE_HEADER = "other recipes: FP8 vs bf16 twin / vs delayed (speed-ups)"


def table_cell(summary: dict) -> str:
    """The markdown cell of :data:`TABLE_HEADER`: per FP8 mode and recipe other than delayed,
    bf16 ms / its ms and delayed ms / its ms."""
    cells = []
    for base, e in summary.get("recipes", {}).items():
        for recipe in RECIPES:
            if recipe != "delayed" and f"{recipe}_ms" in e:
                vs_bf16 = f"{e[recipe + '_vs_bf16']:.2f}x" if f"{recipe}_vs_bf16" in e else "-"
                vs_delayed = f"{e[recipe + '_vs_delayed']:.2f}x" if f"{recipe}_vs_delayed" in e else "-"
                cells.append(f"{tagged(base, recipe)} {vs_bf16} / {vs_delayed}")
    best = {r: summary[tagged("best", r)] for r in RECIPES if r != "delayed" and tagged("best", r) in summary}
    cells += [f"best {r} {b['speedup']:.2f}x ({b['fp8']} / {b['bf16']})" for r, b in best.items()]
    return ", ".join(cells) or "-"


def max_rel_diff(a, b) -> float:
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b))


def state_check(states: list[dict], recipe: str, closed: int) -> dict:
    """Whether the FP8 state machine did what ``recipe`` says, from host copies of one model's
    states (each a dict of numpy arrays: ``amax_history`` (L, n), ``scale`` and ``updates`` (n,),
    and ``writes`` (n,) for a flax meta) after ``closed`` completed updates (torch: one per step;
    flax: the update runs at the start of the next forward, so one less than the steps): the
    history has the recipe's rows, the scales are positive and finite, a flax meta's marker is 1
    (no zeroed or summed state); under 'delayed' every tensor's ``updates`` counter is
    ``closed`` (every tensor is seen every step), under 'current' it is 0 and, once a step was
    closed, row 1 holds a positive last amax."""
    if recipe == "block":  # no state: the model must hold none
        return {"recipe": recipe, "history_rows": [], "updates": [], "expected_updates": 0, "ok": not states}
    want_rows = RECIPES[recipe].amax_history_len
    counts = sorted({int(u) for st in states for u in np.asarray(st["updates"]).ravel()})
    rows = sorted({np.asarray(st["amax_history"]).shape[0] for st in states})
    scales = np.asarray([v for st in states for v in np.asarray(st["scale"], np.float64).ravel()])
    ok = bool(states) and rows == [want_rows] and bool(np.all(np.isfinite(scales) & (scales > 0)))
    ok = ok and all(np.all(np.asarray(st["writes"]) == 1) for st in states if "writes" in st)
    if recipe == "current":
        last = np.asarray([v for st in states for v in np.asarray(st["amax_history"])[1]])
        ok = ok and counts == [0] and (closed == 0 or bool(np.all(last > 0)))
    else:
        ok = ok and counts == [closed]
    return {"recipe": recipe, "history_rows": rows, "updates": counts,
            "expected_updates": 0 if recipe == "current" else closed, "ok": ok}
