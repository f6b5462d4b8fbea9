"""Train-step benchmark of the MLP of docs/design.md in torch: LayerNorm -> Linear -> gelu(tanh) ->
Linear, MSE loss on the regression task of fusedfp8.demo.task, Adam; bf16 against fusedfp8 FP8
in the same run.

Modes (``--modes``): ``bf16_eager`` (fusedfp8.demo.task.TorchMLP), ``bf16_compiled``
(torch.compile of forward + loss), ``bf16_reduceoverhead`` (the same with
``mode='reduce-overhead'``: inductor replays forward and backward from CUDA graphs; the
optimizer and the scale update stay eager), ``bf16_graphed`` (the whole step in one CUDA graph),
``fp8_eager`` (fusedfp8.pytorch.Fp8MLP), ``fp8_compiled``, ``fp8_reduceoverhead``, ``fp8_graphed``. A step is:
zero_grad, forward, loss, backward, ``Adam(fused=True, capturable=True).step()`` and, for FP8,
``fusedfp8.pytorch.update_model_scales``; graphed modes capture exactly that after three eager
warm-up steps (the capture runs nothing; the warm-up steps count in the loss curve). Parameters
are bf16 in every mode, from the same initial weights; the FP8 recipe is ``DelayedScaling()``
(hybrid E4M3/E5M2, history 1024, 'max'), and with ``--recipes delayed,current`` every FP8 mode
also runs under ``CurrentScaling()`` in the same run, named ``fp8_eager@current`` etc.
(scripts/_bench_recipes.py; each row's ``recipe`` says which). The step is the same under both:
``update_model_scales`` changes no scale under current scaling but closes the step.

Per shape (``hidden x ffn x tokens``), in this order:
1. correctness: one forward/backward of the bf16 and the FP8 model (per recipe) from the same
   weights on the same batch; SQNR of the output and of every parameter gradient must be >= 20 dB;
2. per mode: ``--steps`` training steps on a fresh batch each (the loss curve; graphed and
   compiled curves are also compared with their eager twin), a check of the FP8 state after
   them (``fp8_state``: under delayed scaling every tensor's ``updates`` counter equals the
   steps, under current scaling it stays 0 and the last amax is kept), then timing: CUDA events
   around blocks of ``--block`` steps on one batch, ``--reps`` blocks, median per step;
3. per mode, eager, compiled and CUDA-graphed alike, a torch profiler trace of 5 more steps
   (``profile``; ``--no-profile`` skips it): the GPU busy time per step beside the step time
   (``busy_ms_per_step``: the union of the kernels' and copies' intervals, so ``wall_over_busy``
   = step_ms / busy says how much of the step the GPU idled: host overhead), ``kernels_per_step``,
   ``top_kernels``, and the device time per kernel category (GEMM, fusedfp8 kernels, LayerNorm,
   Adam, other). The kernels of a CUDA graph replay carry the correlation id of its
   cudaGraphLaunch in the trace (``graph_launches_per_step``, ``graph_kernels_per_step``); a
   trace with graph launches but none of their kernels, or with no kernel, gives None with the
   ``reason``, as does the CPU ('no GPU') and ``--no-profile``.

Targets checked here (the first design's; docs/design.md has the current ones): fusedfp8 >= 1.40x
bf16 at 4096/16384/8192 and >= 1.0x at 1024/4096/2048 (graphs allowed); mean loss of steps 91-100
within 2% of bf16's. Reported both as the best FP8 mode against the best bf16 mode (``best``,
bf16_graphed included) and against the best of bf16 eager / compiled (``issue_baseline``: bf16
without CUDA graphs, the baseline of the targets); with ``--recipes delayed,current`` also each
current mode against its bf16 twin and its delayed twin (summary ``recipes``, ``best@current``)
and its loss of the last steps against bf16's. Writes DIR/bench_mlp_torch.json and DIR/bench_mlp_torch.png; exits 1 when a
correctness or FP8 state check fails.

Usage:
  python scripts/bench_mlp_torch.py [--out DIR] [--shapes 4096x16384x8192,1024x4096x2048]
         [--modes bf16_eager,fp8_graphed,...] [--recipes delayed,current] [--steps 100] [--block 10]
         [--reps 7] [--no-profile]
  quick: --shapes 1024x4096x2048 --modes bf16_eager,fp8_eager,fp8_graphed --steps 20 --reps 3
  CPU smoke test of the script itself (tiny shapes, no events / graphs): --device cpu --shapes 32x64x48
  FP8 GEMM of the fp8 modes: --torch-gemm auto|cublaslt|scaled_mm (the layers' gemm=; run the
  script once per value to compare the shim's cuBLASLt GEMM with torch._scaled_mm)
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import _bench
import _bench_mlp
import _bench_recipes as recipes
import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.demo.task import BENCH_NOISE, Task, torch_initial_weights, torch_model

MODES = ["bf16_eager", "bf16_compiled", "bf16_reduceoverhead", "bf16_graphed", "fp8_eager", "fp8_compiled",
         "fp8_reduceoverhead", "fp8_graphed"]
TARGET_SPEEDUP = {(4096, 16384, 8192): 1.40, (1024, 4096, 2048): 1.0}
GRAPH_WARMUP = 3
PROFILE_STEPS = 5


def takes_recipe(mode: str) -> bool:
    return mode.startswith("fp8")


def mse(out, target):
    return (out.float() - target.float()).pow(2).mean()


def model_of(kind: str, hidden: int, ffn: int, weights: dict, device, gemm: str = "auto", recipe: str = "delayed"):
    """torch_model under ``recipe`` (a name of _bench_recipes.RECIPES), with ``gemm`` as every FP8
    layer's GEMM backend."""
    model = torch_model(kind, hidden, ffn, weights, recipes.RECIPES[recipe], device)
    for m in fp8.fp8_modules(model) if kind == "fp8" else ():
        m.gemm = gemm
    return model


class Runner:
    """One mode on one shape: a model, its optimizer, and a ``step()`` returning the loss tensor."""

    def __init__(self, mode: str, hidden: int, ffn: int, weights: dict, x, y, device, gemm: str = "auto"):
        self.mode, self.device = mode, device
        base, self.recipe = recipes.split(mode)
        self.kind, self.how = base.split("_")
        self.model = model_of(self.kind, hidden, ffn, weights, device, gemm, self.recipe)
        fused = device.type == "cuda"
        self.opt = torch.optim.Adam(self.model.parameters(), lr=_bench.LR, fused=fused, capturable=fused)
        self.x, self.y = x, y
        self.forward = lambda a, b: mse(self.model(a), b)
        self.graphed = None
        self.steps_done = 0

    def eager_step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward(self.x, self.y)
        loss.backward()
        self.opt.step()
        if self.kind == "fp8":  # under CurrentScaling too: it closes the step (see _bench_recipes)
            fp8.update_model_scales(self.model)
        return loss

    def state_check(self) -> dict:
        """_bench_recipes.state_check of the FP8 layers' states after ``steps_done`` steps."""
        states = [{name: getattr(m, name).detach().cpu().numpy() for name in ("amax_history", "scale", "updates")}
                  for m in fp8.fp8_modules(self.model)]
        return recipes.state_check(states, self.recipe, self.steps_done)

    def step(self):
        """One real training step (the first calls warm up / compile / capture as the mode needs)."""
        self.steps_done += 1
        if self.how == "eager":
            return self.eager_step()
        if self.how in ("compiled", "reduceoverhead"):
            if self.steps_done == 1 + (2 if self.kind == "fp8" else 0):
                # FP8: two eager steps first link the states and settle the first-step flag, so
                # the compiled graph is built once
                mode = "reduce-overhead" if self.how == "reduceoverhead" else None
                self.forward = torch.compile(lambda a, b: mse(self.model(a), b), fullgraph=True, dynamic=False,
                                             mode=mode)
            return self.eager_step()
        if self.graphed is None:
            self.graphed = _bench.GraphedStep(self.eager_step, GRAPH_WARMUP)
        return self.graphed()

    def close(self):
        self.graphed = None
        del self.model, self.opt


def check_correctness(hidden, ffn, weights, x, y, device, gemm: str = "auto", recipe_names=("delayed",)) -> dict:
    """Same weights, same batch: FP8 output and gradients against bf16, SQNR in dB, per recipe
    (``sqnr_db``, ``sqnr_db@current``)."""
    grads = {}
    for kind, recipe in [("bf16", "delayed"), *(("fp8", r) for r in recipe_names)]:
        model = model_of(kind, hidden, ffn, weights, device, gemm, recipe)
        out = model(x)
        mse(out, y).backward()
        grads[recipes.tagged(kind, recipe)] = {"output": out.detach(),
                                               **{n: p.grad for n, p in model.named_parameters()}}
        del model
    res = {recipes.tagged("sqnr_db", r): {name: _bench.sqnr_db(want, grads[recipes.tagged("fp8", r)][name])
                                         for name, want in grads["bf16"].items()} for r in recipe_names}
    return {**res, "ok": all(v >= _bench.SQNR_MIN_DB for sq in res.values() for v in sq.values())}


def profile_steps(runner: Runner, clock: _bench.Clock, device, skip: bool) -> dict:
    """The torch profiler's trace of PROFILE_STEPS more steps of the mode as timed (eager,
    compiled or CUDA-graph replays), after one untraced: _bench.torch_profile, with the GPU busy
    time per step (``busy_ms_per_step``: the union of the kernels' and copies' intervals),
    ``kernels_per_step``, ``top_kernels`` and the device time per kernel category. Its figures are
    None with the ``reason`` on the CPU ('no GPU'), with ``--no-profile``, and where the trace
    misses the kernels of a graph replay."""
    if device.type != "cuda":
        return _bench.no_profile("no GPU")
    if skip:
        return _bench.no_profile("--no-profile")
    return _bench.torch_profile(runner.step, clock, steps=PROFILE_STEPS, warmup=1)


def run_shape(shape, modes, args, device, clock) -> dict:
    hidden, ffn, tokens = shape
    task = Task(hidden, tokens, noise=BENCH_NOISE)
    weights = torch_initial_weights(hidden, ffn, 0, device)
    x, y = task.torch_batch(0, device)
    res = {"shape": {"hidden": hidden, "ffn": ffn, "tokens": tokens}, "modes": {}}
    res["correctness"] = check_correctness(hidden, ffn, weights, x, y, device, args.torch_gemm, args.recipes)
    print(f"[{hidden}x{ffn}x{tokens}] correctness ok={res['correctness']['ok']} "
          + " ".join(f"{k}{tag[len('sqnr_db'):]}={v:.1f}dB" for tag, sq in res["correctness"].items() if tag != "ok"
                     for k, v in sq.items()), flush=True)
    for mode in modes:
        t0 = time.perf_counter()
        torch._dynamo.reset()
        runner = Runner(mode, hidden, ffn, weights, x, y, device, args.torch_gemm)
        losses = torch.empty(args.steps, device=device)
        for i in range(args.steps):
            xi, yi = task.torch_batch(i, device)  # a fresh batch into the step's inputs
            x.copy_(xi)
            y.copy_(yi)
            losses[i] = runner.step().detach()
        clock.sync()
        state = runner.state_check() if runner.kind == "fp8" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = clock.per_call_ms(runner.step, args.block, args.reps)
        row = {"recipe": recipes.row_recipe(mode, takes_recipe), "loss": losses.tolist(),
               "step_ms": statistics.median(times), "step_ms_all": times, "wall_s": time.perf_counter() - t0}
        if state is not None:
            row["fp8_state"] = state
        if device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["profile"] = profile_steps(runner, clock, device, args.no_profile)
        busy = row["profile"]["busy_ms_per_step"]
        row["wall_over_busy"] = None if busy is None else row["step_ms"] / busy
        runner.close()
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
        res["modes"][mode] = row
        p = row["profile"]
        on_gpu = (f"GPU busy {busy:.3f} ms ({p['kernels_per_step']:.0f} kernels)" if busy is not None
                  else f"GPU busy - ({p['reason']})")
        print(f"[{hidden}x{ffn}x{tokens}] {mode:<22} {row['step_ms']:8.3f} ms/step, {on_gpu}  "
              f"loss {row['loss'][0]:.4f} -> {row['loss'][-1]:.4f}  ({row['wall_s']:.0f} s)"
              + (f"  fp8 state ok={state['ok']} updates {state['updates']}" if state else ""), flush=True)
    _bench_mlp.summarize(shape, res, args.steps, TARGET_SPEEDUP, args.recipes)
    return res


def main(argv=None) -> int:
    args, shapes, modes, ap = _bench_mlp.mlp_arguments(__doc__, "torch", MODES, argv)
    modes = recipes.expand(modes, args.recipes, takes_recipe)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run on the GPU machine, or --device cpu for a smoke test of the script")
    if device.type != "cuda" and any(m.endswith("graphed") for m in modes):
        ap.error("graphed modes need a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = _bench.Clock(device)
    print(f"fp8 GEMM: gemm={args.torch_gemm!r} -> {fp8.gemm_path(args.torch_gemm)}", flush=True)
    t0 = time.perf_counter()
    results = [run_shape(s, modes, args, device, clock) for s in shapes]
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    meta = _bench.run_meta(
        framework="torch", device=name, torch=torch.__version__, fusedfp8=fusedfp8.__version__,
        **recipes.meta(args.recipes),
        fp8_gemm={"gemm": args.torch_gemm, "cuda_backend": list(fp8.gemm_path(args.torch_gemm))},
        lr=_bench.LR, task={"noise": BENCH_NOISE, "fresh_batch_per_step": True}, wall_s=time.perf_counter() - t0)
    _bench.write_json(out / "bench_mlp_torch.json", meta, results)
    _bench_mlp.plot_mlp(results, out / "bench_mlp_torch.png", meta)
    _bench_mlp.print_mlp_table(results, recipes.expand(MODES, args.recipes, takes_recipe))
    for res in results:
        print(json.dumps({"shape": res["shape"], "summary": res["summary"]}))
    states_ok = all(row["fp8_state"]["ok"] for r in results for row in r["modes"].values() if "fp8_state" in row)
    return 0 if states_ok and all(r["correctness"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
