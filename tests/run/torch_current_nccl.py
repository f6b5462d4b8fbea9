"""CurrentScaling across ranks (``amax_group``) on several GPUs over NCCL: correctness and the cost
of the per-tensor-group all_reduce. Launch one process per GPU:

    torchrun --nproc_per_node 2 tests/run/torch_current_nccl.py --json $OUT/current_nccl.json

The model is fusedfp8.pytorch.Fp8MLP (LayerNorm -> Linear -> gelu -> Linear, bf16 parameters,
DDP with the gradient all-reduce) trained with Adam on the regression task of
fusedfp8.demo.task, each rank on its own batches. Three variants, built from the same seed:

  current_group  CurrentScaling(), amax_group=WORLD: every amax MAX-reduced across the ranks
                 before its cast, one all_reduce per tensor group: (LayerNorm(x), w1),
                 (gelu(z), w2), dy, the gelu gradient: 4 per step, on the critical path
  current_self   CurrentScaling(), amax_group = a group of this rank alone: the same amax-only
                 passes and given-scale casts as current_group, the collectives over one rank:
                 current_group - current_self is the price of the cross-rank collectives
  current_local  CurrentScaling() without a group: each rank its own amaxes (the ranks' scales
                 differ), the one-launch current kernels: current_self - current_local is the
                 price of the separate amax pass and cast
  delayed        DelayedScaling(), update_model_scales(model, group): one all_reduce per step

Each variant trains ``--steps`` steps after ``--warmup`` untimed ones; every step is timed with
CUDA events on the current stream (forward, backward with DDP's all-reduce, Adam, the scale update),
and the medians go to the JSON report with the differences current_group - current_local (all
of it), current_group - current_self (the 4 cross-rank collectives) and current_self -
current_local (the amax-only passes and given-scale casts), and the latency of one small
all_reduce ((2, 2) float32, MAX) timed alone. After training, current_group must hold bitwise the same weights
and FP8 states on every rank (and has written every scale); the script exits 1 otherwise.
``--device cpu`` runs the same on gloo with wall-clock timers (a check of the script, no figure):

    torchrun --nproc_per_node 2 tests/run/torch_current_nccl.py --device cpu --hidden 32 --ffn 64 \\
        --tokens 16 --steps 2 --warmup 1
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import fusedfp8  # noqa: E402
import fusedfp8.pytorch as fp8  # noqa: E402
from fusedfp8.pytorch import cpp_path  # noqa: E402
from fusedfp8.demo.task import Task  # noqa: E402

VARIANTS = ("current_group", "current_self", "current_local", "delayed")
COLLECTIVES_PER_STEP = 4  # Fp8MLP: (LayerNorm(x), w1), (gelu(z), w2), dy, the gelu gradient


def _train_ddp():
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "scripts" / "train_ddp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--json", type=Path, default=None, help="the report (rank 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return p.parse_args(argv)


class Timer:
    """Milliseconds of a region: CUDA events on the current stream, the wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def build(variant: str, args, device, group, own):
    torch.manual_seed(0)
    if variant == "delayed":
        recipe, amax_group = fusedfp8.DelayedScaling(), None
    else:
        recipe = fusedfp8.CurrentScaling()
        amax_group = {"current_group": group, "current_self": own, "current_local": None}[variant]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return fp8.Fp8MLP(args.hidden, args.ffn, recipe, amax_group=amax_group).to(device=device, dtype=dtype)


def run_variant(variant: str, args, device, group, own, batches, td):
    model = build(variant, args, device, group, own)
    ddp = td.wrap_ddp(model, device)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    update_group = group if variant == "delayed" else None
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        x, y = batches[step % len(batches)]
        with Timer(device) as t:
            loss = F.mse_loss(ddp(x).float(), y.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            fp8.update_model_scales(model, update_group)
        if step >= args.warmup:
            times.append(t.ms)
        losses.append(loss.item())
    out = {"median_step_ms": statistics.median(times), "step_ms": times, "losses": losses,
           "loss_finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses))}
    if variant == "current_group":  # (collective: every rank runs this variant)
        out.update(td.rank_agreement(model, device, group, current=True))
    del ddp, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def allreduce_latency_ms(device, group, n: int = 200) -> float:
    """The median of ``n`` MAX all_reduces of a (2, 2) float32 buffer (one tensor group's amaxes)."""
    buf = torch.zeros((2, 2), device=device)
    times = []
    for i in range(n + 20):
        with Timer(device) as t:
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
        if i >= 20:
            times.append(t.ms)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    group = dist.group.WORLD
    own = [dist.new_group([r]) for r in range(world)][rank]  # (every rank creates every group)
    td = _train_ddp()
    task = Task(args.hidden, args.tokens)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [tuple(t.to(dtype) for t in task.torch_batch(4 * rank + i, device)) for i in range(4)]
    report = {"script": "tests/run/torch_current_nccl.py", "argv": sys.argv[1:], "world_size": world,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "backend": dist.get_backend(group), "torch": torch.__version__,
              "hidden": args.hidden, "ffn": args.ffn, "tokens_per_rank": args.tokens, "steps": args.steps,
              "warmup": args.warmup, "collectives_per_step": COLLECTIVES_PER_STEP,
              "launch_path": cpp_path.launch_path()[0]}
    for v in VARIANTS:
        report[v] = run_variant(v, args, device, group, own, batches, td)
        if rank == 0:
            print(f"{v}: median step {report[v]['median_step_ms']:.3f} ms", flush=True)
    report["allreduce_2x2_latency_ms"] = allreduce_latency_ms(device, group)
    g, loc = report["current_group"], report["current_local"]
    report["group_minus_local_ms"] = g["median_step_ms"] - loc["median_step_ms"]
    report["group_minus_local_per_collective_ms"] = report["group_minus_local_ms"] / COLLECTIVES_PER_STEP
    report["group_minus_self_ms"] = g["median_step_ms"] - report["current_self"]["median_step_ms"]  # collectives
    report["self_minus_local_ms"] = report["current_self"]["median_step_ms"] - loc["median_step_ms"]  # amax passes
    ok = (g["scales_identical_across_ranks"] and g["weights_identical_across_ranks"] and g["scales_updated"]
          and all(report[v]["loss_finite"] for v in VARIANTS))
    report["ok"] = bool(ok)
    if rank == 0:
        print(f"current_group - current_local: {report['group_minus_local_ms']:.3f} ms per step "
              f"({COLLECTIVES_PER_STEP} collectives: {report['group_minus_self_ms']:.3f} ms, the amax passes: "
              f"{report['self_minus_local_ms']:.3f} ms); one (2, 2) all_reduce alone: "
              f"{report['allreduce_2x2_latency_ms']:.3f} ms; identical across {world} ranks: "
              f"states {g['scales_identical_across_ranks']}, weights {g['weights_identical_across_ranks']}", flush=True)
    td.finish(report, args.json, rank)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
