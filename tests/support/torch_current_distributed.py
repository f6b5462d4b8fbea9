"""The ranks of tests/pytorch/test_torch_current_distributed.py: CurrentScaling across ranks
(``amax_group``) on gloo, CPU, 2 processes forked once by tests/run/torch_distributed.py (the
'torch_distributed' background job). Each rank writes what it
saw to an .npz file; the tests compare the ranks with each other and with the single-process
oracle (rank 0, after the distributed part): the same model without a group, run on the
concatenated batch, whose amaxes are the global ones.
"""
from __future__ import annotations

import copy
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.pytorch import custom_ops as fops
from fusedfp8.pytorch.autograd import _amax, reduce_current
from fusedfp8.state import STATE_FIELDS, ScalingState
from support.torch_distributed import run_train_ddp_script, spawn_ranks

WORLD = 2
RECIPE = fusedfp8.CurrentScaling(margin=1)
STEPS = 3
NAN_STEP = 2  # rank 1 feeds a NaN at this step
MODULES = ("mlp.fc1", "mlp.fc2", "head")


class Net(nn.Module):
    """Fp8MLP (LayerNorm fused) and an Fp8Linear head, every amax reduced over ``group``."""

    def __init__(self, group, recipe=RECIPE):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = fp8.Fp8MLP(32, 64, recipe, missed_update="ignore", amax_group=group)
        self.head = fp8.Fp8Linear(32, 16, recipe=recipe, missed_update="ignore", amax_group=group)

    def forward(self, x):
        return self.head(self.mlp(x))


def shard(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s rows at ``step``: magnitudes chosen so that the max comes from either rank."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 32, generator=g) * 2.0 ** (((rank * 3 + step * 5) % 5) - 2)
    if step == NAN_STEP and rank == 1:
        x[3, 5] = float("nan")
    return x


def states(model) -> dict:
    return {f"{n}/{f}": getattr(model.get_submodule(n), f).detach().numpy().copy() for n in MODULES
            for f in STATE_FIELDS}


class Counter:
    """Counts the all_reduce calls (shape of the buffer) while installed."""

    def __init__(self):
        self.calls, self.orig = [], dist.all_reduce

    def __enter__(self):
        def counted(t, *a, **k):
            self.calls.append((tuple(t.shape), str(k.get("op", a[0] if a else None))))
            return self.orig(t, *a, **k)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.orig


def first_step(model, x):
    """Forward and backward of one step: (y, dx), the states staged by it."""
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y.float() ** 2).sum().backward()
    return y.detach(), x.grad.detach()


def scenario_training(rank, out):
    model = Net(dist.group.WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x = shard(rank, step)
        with Counter() as c:
            y, dx = first_step(model, x)
        out[f"train/calls/{step}"] = np.array([f"{s}:{op}" for s, op in c.calls])
        out[f"train/y/{step}"], out[f"train/dx/{step}"] = y.numpy(), dx.numpy()
        for k, v in states(model).items():
            out[f"train/staged/{step}/{k}"] = v
        for p in model.parameters():  # data parallel: the mean of the ranks' gradients (a + b: exact, symmetric)
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8.update_model_scales(model)  # current scaling: closes the step (no collective needed)
        for k, v in states(model).items():
            out[f"train/state/{step}/{k}"] = v
        out[f"train/weights/{step}"] = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])


def scenario_quantize(rank, out):
    """The op level: x (and gelu(x), and dgelu) quantized with the scale of the global amax."""
    x = shard(rank, 1) * (1.0 + rank)
    z = shard(rank, 0)
    st = ScalingState.create((False, False, True), RECIPE, like=torch.empty(0))
    reduce_current([_amax(x), _amax(z, None, "gelu", "tanh")], (st.amax_history, st.scale, st.scale_inv), 0,
                   "e4m3", RECIPE.margin_factor, dist.group.WORLD.group_name)
    q, si = fops.call(fops.quantize, x, st.amax_history, st.scale, st.scale_inv, st.updates, 0, "e4m3",
                      RECIPE.margin_factor, False)
    qa, sia = fops.call(fops.gelu_quantize, z, st.amax_history, st.scale, st.scale_inv, st.updates, 1, "e4m3",
                        RECIPE.margin_factor, False, "tanh")
    reduce_current([_amax(x, z, "dgelu", "tanh")], (st.amax_history, st.scale, st.scale_inv), 2, "e5m2",
                   RECIPE.margin_factor, dist.group.WORLD.group_name)
    qd, _, _, sid = fops.call(fops.dgelu_quantize_t, x, z, st.amax_history, st.scale, st.scale_inv, st.updates, 2,
                              "e5m2", RECIPE.margin_factor, False, "tanh", False)
    out.update({"q/x": q.view(torch.uint8).numpy(), "q/gelu": qa.view(torch.uint8).numpy(),
                "q/dgelu": qd.view(torch.uint8).numpy(), "q/scale_inv": torch.cat([si, sia, sid]).numpy()})
    out.update({f"q/state/{f}": getattr(st, f).numpy() for f in STATE_FIELDS})


def scenario_one_rank_group(rank, out):
    """amax_group = a group of this rank alone equals no group, byte for byte: ragged shapes (the
    padded GEMM path), the LayerNorm fused and not, a 3-D bf16 input, e4m3 gradients and a margin,
    two steps with their updates. Records, per case, whether every output, state and gradient
    matched."""
    own = [dist.new_group([r]) for r in range(WORLD)][rank]  # (every rank creates every group)
    recipe = fusedfp8.CurrentScaling(fp8_format="e4m3", margin=2)
    for hid, ffn, fuse in ((20, 40, True), (32, 64, False), (20, 40, False)):
        pair = []
        for group in (None, own):
            torch.manual_seed(rank)
            mlp = fp8.Fp8MLP(hid, ffn, recipe, approximate="none", missed_update="ignore", amax_group=group)
            mlp.fuse_layernorm = fuse
            pair.append(nn.Sequential(mlp, fp8.Fp8Linear(hid, 24, recipe=recipe, missed_update="ignore",
                                                         amax_group=group)))
        same = True
        for step in range(2):
            x = torch.randn(3, 7, hid, generator=torch.Generator().manual_seed(10 * step + rank)).to(torch.bfloat16)
            ys = [m(x) for m in pair]
            for y in ys:
                (y.float() ** 2).sum().backward()
            same &= torch.equal(ys[0], ys[1])
            a, b = pair
            same &= all(torch.equal(t, b.state_dict()[n]) for n, t in a.state_dict().items())
            same &= all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
            for m in pair:
                fp8.update_model_scales(m)
                m.zero_grad(set_to_none=True)
        out[f"self/{hid}x{ffn}/{'fused' if fuse else 'unfused'}"] = np.array(bool(same))


def scenario_bad_input(rank, out):
    """The refusals that need an initialized group (recorded, not raised)."""
    delayed = fusedfp8.DelayedScaling()
    cases = {"linear": lambda: fp8.Fp8Linear(4, 4, recipe=delayed, amax_group=dist.group.WORLD),
             "mlp": lambda: fp8.Fp8MLP(4, 8, delayed, amax_group=dist.group.WORLD),
             "convert": lambda: fp8.convert_to_fp8(nn.Sequential(nn.Linear(4, 4)), delayed,
                                                   amax_group=dist.group.WORLD),
             "setter": lambda: setattr(fp8.Fp8Linear(4, 4, recipe=delayed), "amax_group", dist.group.WORLD)}
    for name, fn in cases.items():
        try:
            fn()
            out[f"bad/{name}"] = np.array("no error")
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out[f"bad/{name}"] = np.array(f"{type(e).__name__}: {e}")
    m = fp8.Fp8Linear(4, 4, recipe=RECIPE, amax_group=dist.group.WORLD)
    c = copy.deepcopy(m)
    out["bad/copy_group"] = np.array(c.amax_group is dist.group.WORLD or
                                     c.amax_group.group_name == dist.group.WORLD.group_name)


def oracle(out):
    """The single process: the same model, no group, the concatenated batch (the global amax)."""
    model = Net(None)
    x = torch.cat([shard(r, 0) for r in range(WORLD)])
    y, dx = first_step(model, x)
    out["oracle/y"], out["oracle/dx"] = y.numpy(), dx.numpy()
    out.update({f"oracle/staged/{k}": v for k, v in states(model).items()})
    xq = torch.cat([shard(r, 1) * (1.0 + r) for r in range(WORLD)])
    zq = torch.cat([shard(r, 0) for r in range(WORLD)])
    st = ScalingState.create((False, False, True), RECIPE, like=torch.empty(0))
    mf = RECIPE.margin_factor
    q, si = fops.call(fops.quantize, xq, st.amax_history, st.scale, st.scale_inv, st.updates, 0, "e4m3", mf, True)
    qa, sia = fops.call(fops.gelu_quantize, zq, st.amax_history, st.scale, st.scale_inv, st.updates, 1, "e4m3", mf,
                        True, "tanh")
    qd, _, _, sid = fops.call(fops.dgelu_quantize_t, xq, zq, st.amax_history, st.scale, st.scale_inv, st.updates, 2,
                              "e5m2", mf, True, "tanh", False)
    out.update({"oracle/q/x": q.view(torch.uint8).numpy(), "oracle/q/gelu": qa.view(torch.uint8).numpy(),
                "oracle/q/dgelu": qd.view(torch.uint8).numpy(),
                "oracle/q/scale_inv": torch.cat([si, sia, sid]).numpy()})
    out.update({f"oracle/q/state/{f}": getattr(st, f).numpy() for f in STATE_FIELDS})


def run_train_ddp_current(rank, tmp, port):
    """scripts/train_ddp.py --recipe current (CurrentScaling, amax_group=WORLD) in this process, with
    the environment torchrun would set; its exit code (0: identical states on the ranks)."""
    return run_train_ddp_script(rank, WORLD, tmp, port, ("--recipe", "current", "--steps", "2"),
                                "train_ddp_current.json")


def worker(rank, tmp, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))  # a collective that hangs fails instead
    out = {}
    t0 = time.perf_counter()
    scenario_training(rank, out)
    scenario_quantize(rank, out)
    scenario_one_rank_group(rank, out)
    scenario_bad_input(rank, out)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        oracle(out)
    out["seconds"] = np.array(time.perf_counter() - t0)
    out["script_rc"] = np.array(run_train_ddp_current(rank, tmp, port))
    np.savez(os.path.join(tmp, f"rank{rank}.npz"), **out)


def spawn(out: Path, timeout: float = 120, start_method: str = "spawn") -> list[dict]:
    """Run the WORLD ranks to the end (``start_method`` as in support.torch_distributed.spawn_ranks:
    tests/run/torch_distributed.py forks them); each rank's record (:func:`results`)."""
    spawn_ranks(worker, (str(out),), WORLD, timeout, f"the {WORLD} {start_method}ed ranks", start_method)
    return results(out)


def results(out: Path) -> list[dict]:
    """Each rank's record (dict of numpy arrays) that :func:`spawn` left in ``out``."""
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(WORLD)]


# ---- one NCCL rank on a GPU (a gpu test): the group path equals the plain CurrentScaling run ----
def nccl_worker(rank, tmp, port):
    """World size 1 over NCCL: Net with amax_group=WORLD and without, eager and torch.compile'd,
    a few SGD steps on CUDA; records every state, output and weight of both."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=120))
    out = {}
    for compiled in (False, True):
        for tag, group in (("plain", None), ("group", dist.group.WORLD)):
            model = Net(group).cuda().to(torch.bfloat16)
            run = torch.compile(model) if compiled else model
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            key = f"{'compiled' if compiled else 'eager'}/{tag}"
            for step in range(STEPS):
                x = torch.cat([shard(r, step) for r in range(WORLD)]).cuda().to(torch.bfloat16)
                x = torch.nan_to_num(x)  # (rank 1's NaN step is the gloo test's)
                y = run(x)
                (y.float() ** 2).sum().backward()
                out[f"{key}/y/{step}"] = y.detach().float().cpu().numpy()
                opt.step()
                opt.zero_grad(set_to_none=True)
                fp8.update_model_scales(model)
                for k, v in {f"{n}/{f}": getattr(model.get_submodule(n), f) for n in MODULES
                             for f in STATE_FIELDS}.items():
                    out[f"{key}/state/{step}/{k}"] = v.detach().cpu().numpy()
                out[f"{key}/weights/{step}"] = np.concatenate(
                    [p.detach().float().cpu().numpy().ravel() for p in model.parameters()])
    torch.cuda.synchronize()
    dist.destroy_process_group()
    np.savez(os.path.join(tmp, "nccl1.npz"), **out)


def spawn_nccl1(out: Path, timeout: float = 300) -> dict:
    spawn_ranks(nccl_worker, (str(out),), 1, timeout, "the NCCL rank")
    return dict(np.load(out / "nccl1.npz"))
