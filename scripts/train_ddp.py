"""Data-parallel training of the MLP of docs/design.md (LayerNorm -> Linear -> gelu -> Linear) with
fusedfp8 FP8 and DDP, one process per GPU, launched with torchrun.

Every rank trains on its own batches of the regression task of fusedfp8.demo.task (the demo's and
the benchmarks' task: one teacher, rank r takes batches 4r .. 4r+3, cycled); DDP averages the gradients, and
``fusedfp8.pytorch.update_model_scales(model, group)`` MAX-reduces the staged amaxes of every FP8 tensor
in ONE all_reduce per step, so all ranks quantize with the same scales. At the end the script
gathers every rank's scales and histories and checks they are bitwise identical (and reports
whether the weights are).

Recipes (``--recipe``): ``delayed`` (the default, as above) or ``current``: CurrentScaling with
``amax_group=WORLD``, every activation, weight and gradient quantized with the scale of its amax
MAX-reduced over the ranks before the cast (one all_reduce per tensor group, 4 per Fp8MLP step and
2 per Fp8Linear, on the critical path); ``update_model_scales(model)`` then only closes the step,
with no collective of its own (the staged amaxes are global already); ``block``: BlockScaling (a
scale per 1x128 block of activations and gradients, per 128x128 block of weights, from the block's
own max in the pass that casts it): no state, so no amax collective and no scale update at all;
DDP's gradient all-reduce is the only collective, and the check is that the weights stay identical.

Models (``--model``): ``fp8mlp`` (fusedfp8.pytorch.Fp8MLP: gelu fused into the quantization),
``convert`` (fusedfp8.demo.task.TorchMLP converted with convert_to_fp8: two Fp8Linear, gelu in
torch), ``bf16`` (TorchMLP, no FP8: the baseline; no scale update).

Per step it reports (rank 0, wall clock, the device synchronised around each timed region):
``step_ms`` the whole step (forward, backward with DDP's gradient all-reduce, Adam, the scale
update); ``update_scales_ms`` the update_scales call inside it (the amax all_reduce plus the fused
update; null with ``--overlap``, where the all_reduce is started after the backward with
``async_op=True`` and finished after ``optimizer.step()``, so it overlaps the optimizer);
``amax_allreduce_ms`` a MAX all_reduce of a buffer of the same size as the staged amaxes, timed on
its own after the step (the collective alone; null without FP8 state: bf16, block). Medians skip the
first ``--warmup`` steps.

Usage:
  GPUs (NCCL):   torchrun --nproc_per_node 2 scripts/train_ddp.py --steps 50 --json ddp.json [--overlap]
  CPU (gloo):    torchrun --nproc_per_node 2 scripts/train_ddp.py --device cpu --steps 3 \
                     --hidden 32 --ffn 64 --tokens 16 --json ddp_cpu.json
Defaults: hidden 4096, ffn 16384, 8192 tokens per rank, bf16 parameters on CUDA (float32 on CPU),
DelayedScaling() (hybrid, history 1024, 'max'). Exits 1 if the ranks' FP8 states differ, or never updated
(under --recipe current: if some scale was never written; under --recipe block: if the ranks' weights
differ).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.demo.task import Task, TorchMLP

MODELS = ("fp8mlp", "convert", "bf16")
RECIPES = ("delayed", "current", "block")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=MODELS, default="fp8mlp")
    p.add_argument("--recipe", choices=RECIPES, default="delayed",
                   help="delayed: DelayedScaling, amaxes reduced once per step by update_model_scales; current: "
                        "CurrentScaling with amax_group=WORLD, every amax reduced before its cast; block: "
                        "BlockScaling, no state and no amax collective")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="parameter dtype (bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the medians")
    p.add_argument("--history", type=int, default=1024, help="amax_history_len")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--overlap", action="store_true",
                   help="start the amax all_reduce right after the backward (async_op=True) and finish the update "
                        "after optimizer.step(), so the collective overlaps the optimizer")
    p.add_argument("--json", type=Path, default=None, help="write the report here (rank 0)")
    args = p.parse_args(argv)
    for name in ("hidden", "ffn", "tokens", "steps", "history"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible; use --device cpu")
    return args


def build(args, device, dtype, group=None):
    """The model; under ``--recipe current`` its FP8 modules reduce every amax over ``group``."""
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    name = getattr(args, "recipe", "delayed")
    current = name == "current"
    recipe = (fusedfp8.CurrentScaling() if current else fusedfp8.BlockScaling() if name == "block"
              else fusedfp8.DelayedScaling(amax_history_len=args.history))
    amax_group = group if current else None
    if args.model == "fp8mlp":
        model = fp8.Fp8MLP(args.hidden, args.ffn, recipe, amax_group=amax_group)
    else:
        model = TorchMLP(args.hidden, args.ffn)  # the plain-torch twin: --model bf16, or converted
        if args.model == "convert":
            fp8.convert_to_fp8(model, recipe, amax_group=amax_group)
    return model.to(device=device, dtype=dtype)


def wrap_ddp(model, device):
    """DDP without per-forward buffer broadcasts: the FP8 state buffers are kept in step by
    update_scales' all_reduce, not by copying rank 0's (see fusedfp8.pytorch.update_model_scales)."""
    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters:
        kwargs["forward_sync_buffers"] = False  # torch >= 2.13
    else:
        kwargs["broadcast_buffers"] = False
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fp8_state_vector(model, device) -> torch.Tensor:
    """Every FP8 state array of ``model`` (scales, histories, counters) as one float32 vector."""
    parts = [torch.zeros(0, device=device)]
    for m in fp8.fp8_modules(model):
        parts += [m.amax_history.reshape(-1), m.scale, m.scale_inv, m.overflows.float(), m.updates.float()]
    return torch.cat(parts)


def identical_across_ranks(vec: torch.Tensor, group) -> bool:
    """Whether every rank holds bitwise the same ``vec`` (float32)."""
    every = [torch.empty_like(vec) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, vec, group=group)
    return all(torch.equal(e.view(torch.int32), every[0].view(torch.int32)) for e in every)


def rank_agreement(model, device, group, current: bool) -> dict:
    """What the ranks of ``group`` must agree on after training (collective: every rank calls it):
    ``scales_identical_across_ranks`` (every FP8 state array of ``model`` bitwise the same on every
    rank), ``weights_identical_across_ranks`` (every parameter) and ``scales_updated``: every FP8
    module's scales written, by a quantization under CurrentScaling (``current``: scale != 1; its
    update counters stay 0), by update_scales otherwise (updates > 0); False without FP8 modules;
    None for block-scaled modules (they have no scales to keep)."""
    weights = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    if any(isinstance(m, fp8.Fp8BlockLinear) for m in model.modules()):
        return {"scales_identical_across_ranks": None, "scales_updated": None,
                "weights_identical_across_ranks": identical_across_ranks(weights, group)}
    mods = fp8.fp8_modules(model)
    if current:
        updated = all(bool((m.scale != 1).all()) for m in mods)
    else:
        updated = all(bool((m.updates > 0).all()) for m in mods)
    return {"scales_identical_across_ranks": identical_across_ranks(fp8_state_vector(model, device), group),
            "weights_identical_across_ranks": identical_across_ranks(weights, group),
            "scales_updated": bool(mods) and updated}


def finish(report: dict, path: Path | None, rank: int) -> None:
    """Rank 0 writes ``report`` to ``path`` (if given); then every rank leaves the process group,
    after a barrier (rank 0 hosts the store: no rank leaves while another still needs it)."""
    if rank == 0 and path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    group = dist.group.WORLD

    model = build(args, device, dtype, group)
    current = args.recipe == "current"
    update_group = None if current else group  # current scaling: the step's close needs no collective
    fp8_mods = fp8.fp8_modules(model)
    ddp = wrap_ddp(model, device)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)

    # one teacher; each rank its own batches (4 per rank, cycled)
    task = Task(args.hidden, args.tokens)
    batches = [tuple(t.to(dtype) for t in task.torch_batch(4 * rank + i, device)) for i in range(4)]
    staged = torch.zeros(3 * len(fp8_mods) or 1, device=device)  # the size update_scales reduces

    steps = []
    for step in range(args.steps):
        x, y = batches[step % len(batches)]
        sync(device)
        t0 = time.perf_counter()
        loss = F.mse_loss(ddp(x).float(), y.float())
        loss.backward()
        update_ms = None
        if fp8_mods and args.overlap:  # not timed on its own: it overlaps the optimizer
            pending = fp8.update_model_scales(model, update_group, async_op=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            pending.wait()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if fp8_mods and not args.overlap:
            sync(device)
            t1 = time.perf_counter()
            fp8.update_model_scales(model, update_group)
            sync(device)
            update_ms = (time.perf_counter() - t1) * 1e3
        sync(device)
        step_ms = (time.perf_counter() - t0) * 1e3
        allreduce_ms = None  # (no FP8 state: nothing of that size is ever reduced)
        if fp8_mods:
            sync(device)
            t2 = time.perf_counter()
            dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=group)
            sync(device)
            allreduce_ms = (time.perf_counter() - t2) * 1e3
        lossv = loss.detach().clone()
        dist.all_reduce(lossv, group=group)
        steps.append({"step": step, "loss": lossv.item() / world, "step_ms": step_ms,
                      "update_scales_ms": update_ms, "amax_allreduce_ms": allreduce_ms})
        if rank == 0:
            upd = "-" if not fp8_mods else "overlapped" if update_ms is None else f"{update_ms:7.3f} ms"
            red = "-" if allreduce_ms is None else f"{allreduce_ms:7.3f} ms"
            print(f"step {step:4d}  loss {steps[-1]['loss']:.5f}  step {step_ms:8.3f} ms  update_scales {upd}  "
                  f"amax all_reduce {red}", flush=True)

    agreement = rank_agreement(model, device, group, current)
    block = args.recipe == "block" and args.model != "bf16"
    identical = agreement["weights_identical_across_ranks" if block else "scales_identical_across_ranks"]

    timed = steps[args.warmup:] or steps
    report = {
        "script": "scripts/train_ddp.py", "argv": sys.argv[1:], "model": args.model,
        "hidden": args.hidden, "ffn": args.ffn, "tokens_per_rank": args.tokens, "dtype": str(dtype),
        "recipe": args.recipe, "amax_history_len": args.history if args.recipe == "delayed" else None, "world_size": world, "backend": backend, "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "fusedfp8": getattr(fusedfp8, "__version__", None),
        "fp8_tensors": 3 * len(fp8_mods),
        "block_scaled_linears": sum(isinstance(m, fp8.Fp8BlockLinear) for m in model.modules()),
        "median_step_ms": statistics.median(s["step_ms"] for s in timed),
        "overlap": args.overlap,
        "median_update_scales_ms": (None if args.overlap or not fp8_mods
                                    else statistics.median(s["update_scales_ms"] for s in timed)),
        "median_amax_allreduce_ms": (statistics.median(s["amax_allreduce_ms"] for s in timed) if fp8_mods
                                     else None),
        **agreement, "steps": steps,
    }
    if rank == 0:
        upd, red = report["median_update_scales_ms"], report["median_amax_allreduce_ms"]
        print(f"median step {report['median_step_ms']:.3f} ms, update_scales "
              f"{'-' if upd is None else f'{upd:.3f} ms'}, amax all_reduce "
              f"{'-' if red is None else f'{red:.3f} ms'}; {'weights' if block else 'states'} identical "
              f"across {world} ranks: {identical}", flush=True)
    finish(report, args.json, rank)
    return 0 if identical and (block or agreement["scales_updated"] or args.model == "bf16") else 1


if __name__ == "__main__":
    sys.exit(main())
