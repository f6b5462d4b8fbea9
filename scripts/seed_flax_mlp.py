"""The flax reproducer of openxla/xla#7432 (FP8 slower than bf16 in a small MLP), as a user runs it.

LayerNorm -> DenseGeneral(ffn) -> gelu -> DenseGeneral(hidden) in bf16 (flax's default float32
parameters), optax Adam in a ``TrainState``, the step jitted with explicit shardings on a
one-device mesh (the reproducer's pjit), NO buffer donation and no special flags. The only thing
that changes between the modes is ``dot_general_cls``:

- ``bf16``: none (flax's own dot_general);
- ``flax_fp8``: ``flax.linen.Fp8DotGeneralOp``;
- ``fusedfp8``: ``fusedfp8.jax.flax.Fp8DotGeneral`` (its kernels through the compiled XLA FFI
  launcher where it is built, the default);
- ``fusedfp8_callback``: the same with ``impl='callback'`` (the Python buffer_callback launcher);
and ``fusedfp8_mlp`` replaces the whole block by ``fusedfp8.jax.flax.Fp8MLP`` (same layers, the
activation fused into FP8). The fusedfp8 modes take ``DelayedScaling()``; with ``--recipes
delayed,current`` each also runs with ``recipe=CurrentScaling()`` (``fusedfp8@current``, ...;
scripts/_bench_recipes.py), nothing else changed. Every row says its ``recipe`` (None for bf16,
'flax' for flax_fp8); a current row also has ``speedup_vs_delayed`` (its delayed twin's ms / its ms).

The reproducer's own source is not in this repository (nor reachable from it); this is a faithful
re-statement of its structure from the issue text (model, optimizer, TrainState, pjit, no
donation, batch 4 x sequence 512 at hidden 1024 / ffn 4096; batch 16 at hidden 4096 / ffn 16384).

Per mode: the loss of the first and the last step (every FP8 mode checked against bf16 on the
same batch first: relative difference of the first loss), the median wall time per step over
blocks of steps (host clock around a block, one block_until_ready at its end: what a user sees),
and the GPU busy time per step from a CUPTI trace (``jax.profiler``), so wall / busy says how
host-bound the step is. JSON to ``--out``.

    python scripts/seed_flax_mlp.py --out out            # both shapes, every mode
    python scripts/seed_flax_mlp.py --shapes 1024x4096x2048 --modes bf16,fusedfp8 --out out
    python scripts/seed_flax_mlp.py --shapes 1024x4096x2048 --modes bf16,fusedfp8 --recipes delayed,current --out out
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _bench
import _bench_recipes as recipes
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench_mlp_jax import kernel_profile
from fusedfp8.jax.flax import Fp8DotGeneral, Fp8MLP

MODES = ["bf16", "flax_fp8", "fusedfp8", "fusedfp8_callback", "fusedfp8_mlp"]
SHAPES = [(1024, 4096, 2048), (4096, 16384, 8192)]  # hidden, ffn, tokens (= batch x 512)
SEQ = 512


class MLP(nn.Module):
    """The reproducer's block."""

    hidden: int
    ffn: int
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm(dtype=jnp.bfloat16)(x)
        x = nn.DenseGeneral(self.ffn, dtype=jnp.bfloat16, dot_general_cls=self.dot_general_cls)(x)
        x = nn.gelu(x)
        return nn.DenseGeneral(self.hidden, dtype=jnp.bfloat16, dot_general_cls=self.dot_general_cls)(x)


def takes_recipe(mode: str) -> bool:
    return mode.startswith("fusedfp8")


def make_model(mode: str, hidden: int, ffn: int):
    """The model of ``mode`` (``fusedfp8@current``: the fusedfp8 mode under CurrentScaling)."""
    base, recipe = recipes.split(mode)
    r = recipes.RECIPES[recipe]
    if base == "fusedfp8_mlp":
        return Fp8MLP(ffn, recipe=r, dtype=jnp.bfloat16)
    cls = {"bf16": None, "flax_fp8": nn.Fp8DotGeneralOp, "fusedfp8": functools.partial(Fp8DotGeneral, recipe=r),
           "fusedfp8_callback": functools.partial(Fp8DotGeneral, impl="callback", recipe=r)}[base]
    return MLP(hidden, ffn, cls)


def program(mode: str, hidden: int, ffn: int, tokens: int):
    """The reproducer's program for ``mode``: (the jitted step, the TrainState, x, y)."""
    model = make_model(mode, hidden, ffn)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (tokens // SEQ, SEQ, hidden), jnp.bfloat16)
    y = jax.random.normal(ky, (tokens // SEQ, SEQ, hidden), jnp.bfloat16)
    variables = model.init(kp, x)
    if recipes.split(mode)[0] == "fusedfp8_mlp":  # the same initial weights as the other modes (its layers have other names)
        base = MLP(hidden, ffn).init(kp, x)["params"]
        names = {"norm": "LayerNorm_0", "fc1": "DenseGeneral_0", "fc2": "DenseGeneral_1"}
        variables = {**variables, "params": {k: base[v] for k, v in names.items()}}
    state = TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3))

    def train_step(state, x, y):
        def loss_fn(params):
            out = state.apply_fn(params, x)
            return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    step = jax.jit(train_step, in_shardings=(replicated, batch, batch), out_shardings=(replicated, replicated))
    return step, state, x, y


def run_mode(mode: str, shape, args) -> dict:
    hidden, ffn, tokens = shape
    step, state, x, y = program(mode, hidden, ffn, tokens)
    t0 = time.perf_counter()
    losses = []
    for _ in range(args.steps):
        state, loss = step(state, x, y)
        losses.append(loss)
    losses = [float(v) for v in jax.device_get(losses)]
    compile_and_run_s = time.perf_counter() - t0

    def one():
        nonlocal state
        state, loss = step(state, x, y)
        return loss

    times = _bench.host_block_ms(one, args.block, args.reps, jax.block_until_ready)
    row = {"mode": mode, "recipe": recipes.row_recipe(mode, takes_recipe), "loss_first": losses[0], "loss_last": losses[-1], "step_ms": statistics.median(times),
           "step_ms_all": times, "compile_and_first_steps_s": compile_and_run_s}
    if jax.devices()[0].platform == "gpu" and not args.no_profile:
        try:
            _, row["profile"] = kernel_profile(lambda s, a, b: step(s, a, b), state, x, y)
            row["wall_over_busy"] = row["step_ms"] / row["profile"]["busy_ms_per_step"]
        except Exception as e:  # noqa: BLE001 - a diagnostic: the wall time stands without it
            row["profile"] = {"error": f"{type(e).__name__}: {e}"}
    p = row.get("profile", {})
    busy = f", GPU busy {p['busy_ms_per_step']:.3f} ms ({p['kernels_per_step']:.0f} kernels)" if "busy_ms_per_step" in p else ""
    print(f"[{hidden}x{ffn}x{tokens}] {mode:<21} {row['step_ms']:8.3f} ms/step{busy}  loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f}", flush=True)
    if p.get("largest_gaps"):
        gaps = "; ".join(f"{1e3 * g['ms_per_step']:.1f} us x{g['gaps_per_step']:g} {g['after'][:40]} -> {g['before'][:40]}"
                         for g in p["largest_gaps"][:3])
        print(f"    GPU idle {p['idle_ms_per_step']:.3f} ms/step between kernels; largest: {gaps}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                    help="hidden x ffn x tokens, comma-separated (tokens a multiple of 512)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    ap.add_argument("--steps", type=int, default=10, help="steps before timing (compile, warm-up, loss)")
    ap.add_argument("--block", type=int, default=20, help="steps per timed block")
    ap.add_argument("--reps", type=int, default=5, help="timed blocks (the median is reported)")
    ap.add_argument("--no-profile", action="store_true", help="skip the CUPTI trace")
    ap.add_argument("--out", type=Path, default=Path("out"))
    recipes.add_argument(ap)
    args = ap.parse_args(argv)
    shapes = _bench.parse_sizes(args.shapes, 3, "--shapes", ap.error)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; expected some of {MODES}")
    args.recipes = recipes.parse(args.recipes, ap.error)
    modes = recipes.expand(modes, args.recipes, takes_recipe)
    if any(t % SEQ for _, _, t in shapes):
        ap.error(f"--shapes: tokens must be a multiple of {SEQ} (batch x sequence {SEQ})")
    results = []
    for shape in shapes:
        rows = {m: run_mode(m, shape, args) for m in modes}
        base = rows.get("bf16")
        for m, r in rows.items():
            if base is not None:
                r["speedup_vs_bf16"] = base["step_ms"] / r["step_ms"]
                r["first_loss_vs_bf16"] = r["loss_first"] / base["loss_first"] - 1
            delayed = rows.get(recipes.split(m)[0]) if recipes.TAG in m else None
            if delayed is not None:
                r["speedup_vs_delayed"] = delayed["step_ms"] / r["step_ms"]
        results.append({"shape": list(shape), "modes": rows})
    args.out.mkdir(parents=True, exist_ok=True)
    meta = _bench.run_meta(script="seed_flax_mlp.py", **recipes.meta(args.recipes))
    _bench.write_json(args.out / "seed_flax_mlp.json", meta, results)
    header = ["hidden/ffn/tokens", "mode", "ms/step", "GPU busy ms", "wall/busy", "vs bf16", "first loss vs bf16"]
    current = len(args.recipes) > 1  # a column for the current rows against their delayed twins
    table = []
    for res in results:
        for m, r in res["modes"].items():
            p = r.get("profile", {})
            table.append(["x".join(map(str, res["shape"])), m, f"{r['step_ms']:.3f}",
                          f"{p['busy_ms_per_step']:.3f}" if "busy_ms_per_step" in p else "-",
                          f"{r['wall_over_busy']:.2f}" if "wall_over_busy" in r else "-",
                          f"{r.get('speedup_vs_bf16', float('nan')):.2f}x",
                          f"{100 * r.get('first_loss_vs_bf16', float('nan')):+.2f}%"]
                         + ([f"{r['speedup_vs_delayed']:.2f}x" if "speedup_vs_delayed" in r else "-"] if current else []))
    header += ["vs delayed"] if current else []
    _bench.print_table(header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
