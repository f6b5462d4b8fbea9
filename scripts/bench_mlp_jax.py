"""Train-step benchmark of docs/design.md's MLP in JAX: LayerNorm -> Dense -> gelu(tanh) -> Dense,
MSE loss on the regression task of fusedfp8.demo.task, optax Adam; bf16 against FP8 in the same run.

Modes (``--modes``): ``bf16_jit`` (fusedfp8.demo.task.FlaxMLP, bf16), ``flax_fp8`` (the same with
flax's own ``nn.Fp8DotGeneralOp`` as ``dot_general_cls``) and ``fp8_fused``
(fusedfp8.jax.flax.Fp8MLP, ``impl='auto'``: its kernels launched by the compiled XLA FFI handler
where it is built, recorded into XLA's command buffers) / ``fp8_fused_callback`` (the same through
the Python buffer_callback launcher). Every mode starts from the same bf16 parameters
(``--jax-init``). The whole train step (forward, loss, backward, optax Adam, the FP8 state
through TrainState.apply_gradients) is one jitted function with donated state. The
fp8_fused modes run under ``DelayedScaling()``; with ``--recipes delayed,current`` each also runs
under ``CurrentScaling()`` in the same run (``fp8_fused@current``, ...; scripts/_bench_recipes.py;
each row's ``recipe`` says which, ``'flax'`` for flax_fp8, whose op has its own delayed scaling).
The step is the same under both: the modules close the previous step at the start of their
forward and their state travels through ``'_overwrite_with_gradient'`` either way.

Per shape: correctness first (output and parameter gradients of every FP8 mode against bf16 on
one batch, SQNR >= 20 dB); then per mode ``--steps`` steps on a fresh batch each (the loss
curve), a check of the fused modes' FP8 state after them (``fp8_state``: delayed, every
``updates`` counter at steps - 1; current, 0 and the last amax kept), then timing: a block of ``--block`` steps is dispatched and only its last loss is
waited for, ``--reps`` blocks, median per step. Each mode also reports ``kernels_per_step``, the
HLO instructions of the compiled step that launch GPU work (fusions, custom calls -- a fusedfp8
callback is 1-2 launches, a cuBLAS GEMM one --, copies, ...), and the FP8 GEMMs in it. On the GPU
each mode is also traced for 10 steps (``jax.profiler``, CUPTI; ``--no-profile`` skips it):
device time per step by kernel category, GPU busy time against the traced span, the top
kernels; and the FP8 step is broken down into its fusedfp8 ops (per recipe: ``breakdown``,
``breakdown@current``), its FP8 GEMMs and the bf16 GEMMs they replace.

Targets checked here (the first design's; docs/design.md has the current ones): fp8_fused >= 1.30x
bf16 at 4096/16384/8192 and >= 1.0x at 1024/4096/2048; mean loss of steps 91-100 within 2% of
bf16's; with ``--recipes delayed,current`` also each current mode against bf16_jit and against its
delayed twin (summary ``recipes``, ``best@current``). Writes DIR/bench_mlp_jax.json and
DIR/bench_mlp_jax.png; exits 1 when a correctness or FP8 state check fails.

Usage:
  python scripts/bench_mlp_jax.py [--out DIR] [--shapes ...] [--modes bf16_jit,flax_fp8,fp8_fused]
         [--recipes delayed,current] [--steps 100] [--block 10] [--reps 7] [--no-profile]
         [--jax-forward-accum fast|split] [--jax-init f32|bf16]
  CPU smoke test of the script itself (tiny shapes): --device cpu --shapes 32x64x48
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax import lax

import _bench
import _bench_mlp
import _bench_recipes as recipes
import fusedfp8
import fusedfp8.jax as fjax
from fusedfp8.demo.task import BENCH_NOISE, FlaxMLP, Task, flax_initial_params, flax_variables
from fusedfp8.jax import functional as FJ
from fusedfp8.jax import primitives as P
from fusedfp8.jax.flax import OVERWRITE_WITH_GRADIENT, Fp8MLP

MODES = ["bf16_jit", "flax_fp8", "fp8_fused", "fp8_fused_callback"]
TARGET_SPEEDUP = {(4096, 16384, 8192): 1.30, (1024, 4096, 2048): 1.0}
LINEAR_GRAD = (False, False, True)  # an FP8 linear's tensors: input, weight, output gradient
_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][a-z0-9\-]*)\(", re.M)
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
                "partition-id", "replica-id", "call", "conditional", "while", "async-start", "async-done",
                "copy-done", "iota"}


def count_kernels(hlo: str) -> dict:
    """Instructions of a compiled HLO module that launch GPU work, outside fusion bodies and
    command-buffer wrappers' bookkeeping: fusions, custom calls (cuBLAS, fusedfp8 callbacks),
    copies, ... Also the FP8 cuBLASLt GEMMs (XLA's and the shim's fusedfp8_fp8_gemm) and the
    fusedfp8 callbacks on their own."""
    comps = re.split(r"\n(?=(?:ENTRY )?%?[\w.\-]+ [(\[{])", hlo)
    fused = set(re.findall(r"fusion\(.*?calls=%?([\w.\-]+)", hlo))
    total = 0
    for comp in comps:
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", comp.strip())
        if name is None or name.group(1) in fused:
            continue
        total += sum(1 for op in _HLO_INSTR.findall(comp) if op not in _NOT_KERNELS)
    ours = len(re.findall(r'custom_call_target="fusedfp8_fp8_gemm', hlo))  # the shim's cuBLASLt FP8 GEMM
    return {"kernels_per_step": total, "fp8_gemms": hlo.count('"__cublas$lt$matmul$f8"') + ours,
            "gemms": len(re.findall(r'custom_call_target="__cublas\$', hlo)) + ours,
            "fusedfp8_callbacks": len(re.findall(r'custom_call_target="xla_buffer_python_gpu_callback', hlo))}


def takes_recipe(mode: str) -> bool:
    return mode.startswith("fp8_fused")


def make_models(ffn: int, forward_fast_accum: bool, recipe_names=("delayed",)) -> dict:
    """Every mode's model; the fp8_fused ones once per recipe (``fp8_fused@current``, ...)."""
    bf16 = {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16}
    models = {"bf16_jit": FlaxMLP(ffn, **bf16), "flax_fp8": FlaxMLP(ffn, dot_general_cls=nn.Fp8DotGeneralOp, **bf16)}
    for r in recipe_names:
        fused = {"recipe": recipes.RECIPES[r], "param_dtype": jnp.bfloat16, "forward_fast_accum": forward_fast_accum}
        for mode, impl in (("fp8_fused", "auto"), ("fp8_fused_callback", "callback")):
            models[recipes.tagged(mode, r)] = Fp8MLP(ffn, impl=impl, **fused)
    return models


def fp8_states(variables) -> list[dict]:
    """Host copies of every FP8 meta (a dict with 'updates') in the '_overwrite_with_gradient'
    collection of ``variables``."""
    found = []

    def walk(tree):
        if isinstance(tree, dict) or hasattr(tree, "items"):
            if "updates" in tree:
                found.append({k: np.asarray(v) for k, v in jax.device_get(dict(tree)).items()})
            else:
                for v in tree.values():
                    walk(v)

    walk(variables.get(OVERWRITE_WITH_GRADIENT, {}))
    return found


def loss_and_output(model, params, x, y):
    out = model.apply(params, x)
    return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2), out


def loss_fn(model, x, y):
    return lambda params: loss_and_output(model, params, x, y)[0]


def check_correctness(models: dict, params, hidden: int, x, y) -> dict:
    """Same weights, same batch: output and parameter gradients of each FP8 model against bf16."""
    def out_and_grads(mode):
        v = flax_variables(models[mode], params, hidden)
        # the output as the loss's aux: one program for both
        grads, out = jax.jit(jax.grad(lambda v, x, y: loss_and_output(models[mode], v, x, y), has_aux=True))(v, x, y)
        grads = grads["params"]
        flat = {"/".join(str(getattr(k, "key", k)) for k in path): g
                for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
        return {"output": out, **flat}

    want = out_and_grads("bf16_jit")
    res = {}
    for mode in models:
        if mode != "bf16_jit":
            got = out_and_grads(mode)
            res[mode] = {k: _bench.sqnr_db(w, got[k]) for k, w in want.items()}
    return {"sqnr_db": res, "ok": all(v >= _bench.SQNR_MIN_DB for r in res.values() for v in r.values())}


def breakdown(hidden: int, ffn: int, tokens: int, device, block: int, reps: int, forward_fast_accum: bool,
              recipe: str = "delayed") -> dict:
    """Where an FP8 step's time goes, device-timed piece by piece (median ms of ``reps`` blocks of
    ``block`` calls): the fusedfp8 ops of one train step (2 updates, 6 quantizes: the calls of
    fusedfp8.jax.fp8_mlp), its 6 FP8 GEMMs (forward as ``--jax-forward-accum``, gradients split
    accumulation) and the 6 bf16 GEMMs of the bf16 step, on random data; ``recipe``: a name of
    _bench_recipes.RECIPES."""
    r = recipes.RECIPES[recipe]
    ks = jax.random.split(jax.random.key(1), 5)
    with jax.default_device(device):
        h = jax.random.normal(ks[0], (tokens, hidden), jnp.bfloat16)
        w1 = jax.random.normal(ks[1], (hidden, ffn), jnp.bfloat16) * 0.02
        w2 = jax.random.normal(ks[2], (ffn, hidden), jnp.bfloat16) * 0.02
        z = jax.random.normal(ks[3], (tokens, ffn), jnp.bfloat16)
        g = jax.random.normal(ks[4], (tokens, hidden), jnp.bfloat16) * 1e-3
        st1 = fusedfp8.ScalingState.create(LINEAR_GRAD, r, like=h)
        st2 = fusedfp8.ScalingState.create(LINEAR_GRAD, r, like=h)

    @jax.jit
    def fp8_ops(h, w1, w2, z, g, st1, st2):
        st1, st2 = fjax.update_scales(st1, r), fjax.update_scales(st2, r)
        rh, st1 = P.quantize(h, st1, 0, r, transpose=True)
        rw1, st1 = P.quantize(w1, st1, 1, r, transpose=True)
        ra, st2 = P.gelu_quantize(z, st2, 0, r, approximate="tanh", transpose=True)
        rw2, st2 = P.quantize(w2, st2, 1, r, transpose=True)
        rg, st2 = P.quantize(g, st2, 2, r, transpose=True)
        rdz, st1 = P.dgelu_quantize(z, z, st1, 2, r, approximate="tanh", transpose=True, dbias=True)
        return (rh, rw1, ra, rw2, rg, rdz), st1, st2

    @jax.jit
    def fp8_gemms(q):
        rh, rw1, ra, rw2, rg, rdz = q
        G, fwd = FJ.gemm, forward_fast_accum
        return (G(rh.data, rw1.data_t, rh.scale_inv, rw1.scale_inv, jnp.bfloat16, fast_accum=fwd),
                G(ra.data, rw2.data_t, ra.scale_inv, rw2.scale_inv, jnp.bfloat16, fast_accum=fwd),
                G(rg.data, rw2.data, rg.scale_inv, rw2.scale_inv, jnp.bfloat16),
                G(ra.data_t, rg.data_t, ra.scale_inv, rg.scale_inv, jnp.bfloat16),
                G(rdz.data, rw1.data, rdz.scale_inv, rw1.scale_inv, jnp.bfloat16),
                G(rh.data_t, rdz.data_t, rh.scale_inv, rdz.scale_inv, jnp.bfloat16))

    @jax.jit
    def bf16_gemms(h, w1, w2, z, g):
        def mm(a, b, ca, cb):
            return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=jnp.float32
                                   ).astype(jnp.bfloat16)
        return (mm(h, w1, 1, 0), mm(z, w2, 1, 0), mm(g, w2, 1, 1), mm(z, g, 0, 0), mm(z, w1, 1, 1), mm(h, z, 0, 0))

    def median_ms(fn, *a):
        jax.block_until_ready(fn(*a))  # compile and warm up
        return statistics.median(_bench.host_block_ms(lambda: fn(*a), block, reps, jax.block_until_ready))

    q = fp8_ops(h, w1, w2, z, g, st1, st2)[0]
    return {"fusedfp8_ops_ms": median_ms(fp8_ops, h, w1, w2, z, g, st1, st2),
            "fp8_gemms_ms": median_ms(fp8_gemms, q), "bf16_gemms_ms": median_ms(bf16_gemms, h, w1, w2, z, g)}


def kernel_profile(step, state, x, y, nsteps: int = 10):
    """The GPU kernels of ``nsteps`` train steps under ``jax.profiler.trace`` (CUPTI), read back
    with ``jax.profiler.ProfileData``: device time per step by category (_bench.KERNEL_CATEGORIES;
    XLA's own fusions fall in 'other'), the span from the first kernel's start to the last one's
    end per step (so busy / span says how much of the step the GPU idled), where it idled
    (_bench.idle_gaps: the gaps between kernels, by the kernels around them, the step boundary
    included), and the kernels taking most time. Returns (the new state, the profile dict)."""
    from jax.profiler import ProfileData

    state, loss = step(state, x, y)
    jax.block_until_ready(loss)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(nsteps):
                state, loss = step(state, x, y)
            jax.block_until_ready(loss)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return state, {"error": "the trace wrote no .xplane.pb"}
        data = ProfileData.from_file(files[0])
        by_name, lines, t_lo, t_hi, spans = {}, {}, math.inf, -math.inf, []
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                evs = list(line.events)
                lines[f"{plane.name}|{line.name}"] = len(evs)
                if not line.name.lower().startswith("stream"):
                    continue  # 'XLA Ops' / 'XLA Modules' repeat the stream's kernels at op level
                for e in evs:
                    k = by_name.setdefault(e.name, [0, 0.0])
                    k[0] += 1
                    k[1] += e.duration_ns / 1e6
                    t_lo, t_hi = min(t_lo, e.start_ns), max(t_hi, e.start_ns + e.duration_ns)
                    spans.append((e.start_ns / 1e3, (e.start_ns + e.duration_ns) / 1e3, e.name))
    cats = _bench.empty_categories()
    for name, (_, ms) in by_name.items():
        cats[_bench.kernel_category(name)] += ms / nsteps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])  # every kernel (a step holds under a hundred)
    return state, {"steps": nsteps, "device_ms_per_step": cats, "busy_ms_per_step": sum(cats.values()),
                   "span_ms_per_step": (t_hi - t_lo) / 1e6 / nsteps if by_name else 0.0,
                   "kernels_per_step": sum(n for n, _ in by_name.values()) / nsteps,
                   "top_kernels": [{"name": n[:160], "calls_per_step": c / nsteps, "ms_per_step": ms / nsteps}
                                   for n, (c, ms) in top],
                   **(_bench.idle_gaps(sorted(spans), nsteps) if spans else {}), "trace_lines": lines}


def run_mode(mode: str, model, params, shape, task: Task, args, device) -> dict:
    t0 = time.perf_counter()
    hidden, ffn, tokens = shape
    x, y = task.jax_batch(0, device)
    state = TrainState.create(apply_fn=model.apply, params=flax_variables(model, params, hidden),
                              tx=optax.adam(_bench.LR))

    def step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn(model, x, y))(state.params)
        return state.apply_gradients(grads=grads), loss

    # the compiled executable is what runs: calling the jitted function after lower().compile()
    # compiles the step again (the jit's own cache does not hold the ahead-of-time compile)
    step = jax.jit(step, donate_argnums=0).lower(state, x, y).compile()
    row = count_kernels(step.as_text())
    losses = []
    for i in range(args.steps):  # a fresh batch every step (see fusedfp8.demo.task)
        state, loss = step(state, *task.jax_batch(i, device))
        losses.append(loss)
    losses = [float(v) for v in jax.device_get(losses)]
    base, recipe = recipes.split(mode)
    if takes_recipe(base):  # the update runs at the start of the next forward: steps - 1 closed
        row["fp8_state"] = recipes.state_check(fp8_states(state.params), recipe, args.steps - 1)

    def timed_step():
        nonlocal state
        state, loss = step(state, x, y)
        return loss

    jax.block_until_ready(state)
    times = _bench.host_block_ms(timed_step, args.block, args.reps, jax.block_until_ready)
    row.update(recipe=recipes.row_recipe(mode, takes_recipe), loss=losses, step_ms=statistics.median(times),
               step_ms_all=times, wall_s=time.perf_counter() - t0)
    tag = f"[{hidden}x{ffn}x{tokens}] {mode:<27}"
    if device.platform == "gpu" and not args.no_profile:
        try:
            state, row["profile"] = kernel_profile(step, state, x, y)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the timing above stands without it
            row["profile"] = {"error": f"{type(e).__name__}: {e}"}
        p = row["profile"]
        print(f"{tag} profile " + (p["error"] if "error" in p else
              f"busy {p['busy_ms_per_step']:.3f} of span {p['span_ms_per_step']:.3f} ms/step, "
              f"{p['kernels_per_step']:.0f} kernels: "
              + "  ".join(f"{k} {v:.3f}" for k, v in p["device_ms_per_step"].items())), flush=True)
    stats = getattr(device, "memory_stats", lambda: None)()
    if stats and "peak_bytes_in_use" in stats:
        row["peak_mem_gib"] = stats["peak_bytes_in_use"] / 2**30
    print(f"{tag} {row['step_ms']:8.3f} ms/step  loss {losses[0]:.4f} -> {losses[-1]:.4f}  kernels/step "
          f"{row['kernels_per_step']} (FP8 GEMMs {row['fp8_gemms']}, fusedfp8 callbacks {row['fusedfp8_callbacks']})"
          f"  ({row['wall_s']:.0f} s)" + (f"  fp8 state ok={row['fp8_state']['ok']} updates {row['fp8_state']['updates']}"
                                          if "fp8_state" in row else ""), flush=True)
    return row


def run_shape(shape, modes, args, device) -> dict:
    hidden, ffn, tokens = shape
    task = Task(hidden, tokens, noise=BENCH_NOISE)
    x, y = task.jax_batch(0, device)
    models = make_models(ffn, args.jax_forward_accum == "fast", args.recipes)
    params = jax.device_put(flax_initial_params(hidden, ffn, 0, args.jax_init), device)
    res = {"shape": {"hidden": hidden, "ffn": ffn, "tokens": tokens}, "modes": {}}
    res["correctness"] = check_correctness({m: models[m] for m in ["bf16_jit", *modes]}, params, hidden, x, y)
    print(f"[{hidden}x{ffn}x{tokens}] correctness ok={res['correctness']['ok']} "
          + " ".join(f"{m}:{k}={v:.1f}dB" for m, r in res["correctness"]["sqnr_db"].items() for k, v in r.items()),
          flush=True)
    for mode in modes:
        res["modes"][mode] = run_mode(mode, models[mode], params, shape, task, args, device)
    for r in args.recipes:
        if device.platform == "gpu" and recipes.tagged("fp8_fused", r) in modes:
            key = recipes.tagged("breakdown", r)
            res[key] = breakdown(hidden, ffn, tokens, device, args.block, args.reps, args.jax_forward_accum == "fast", r)
            print(f"[{hidden}x{ffn}x{tokens}] {key} " + "  ".join(f"{k} {v:.3f}" for k, v in res[key].items()),
                  flush=True)
    _bench_mlp.summarize(shape, res, args.steps, TARGET_SPEEDUP, args.recipes)
    return res


def main(argv=None) -> int:
    args, shapes, modes, ap = _bench_mlp.mlp_arguments(__doc__, "jax", MODES, argv)
    plat = "gpu" if args.device == "cuda" else args.device
    try:
        device = jax.devices(plat)[0]
    except RuntimeError:
        print(f"no jax {plat} device: run on the GPU machine, or --device cpu for a smoke test", file=sys.stderr)
        return 2
    if plat != "gpu":
        gpu_only = ("fp8_fused_callback",)
        if any(m in modes for m in gpu_only) and args.modes:
            ap.error(f"{gpu_only} launch the CUDA kernels: they need --device cuda")
        modes = [m for m in modes if m not in gpu_only]
    modes = recipes.expand(modes, args.recipes, takes_recipe)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with jax.default_device(device):
        results = [run_shape(s, modes, args, device) for s in shapes]
    meta = _bench.run_meta(
        framework="jax", device=getattr(device, "device_kind", str(device)), jax=jax.__version__,
        flax=flax.__version__, fusedfp8=fusedfp8.__version__, **recipes.meta(args.recipes), lr=_bench.LR,
        forward_accum=args.jax_forward_accum, init=args.jax_init,
        task={"noise": BENCH_NOISE, "fresh_batch_per_step": True}, wall_s=time.perf_counter() - t0)
    _bench.write_json(out / "bench_mlp_jax.json", meta, results)
    _bench_mlp.plot_mlp(results, out / "bench_mlp_jax.png", meta)
    _bench_mlp.print_mlp_table(results, recipes.expand(MODES, args.recipes, takes_recipe))
    for res in results:
        print(json.dumps({"shape": res["shape"], "summary": res["summary"],
                          "kernels_per_step": {m: r["kernels_per_step"] for m, r in res["modes"].items()}}))
    states_ok = all(row["fp8_state"]["ok"] for r in results for row in r["modes"].values() if "fp8_state" in row)
    return 0 if states_ok and all(r["correctness"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
