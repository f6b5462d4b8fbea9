"""The torch.distributed scenarios of tests/pytorch/test_distributed.py (gloo, CPU): the model,
the per-rank data, the scenarios each rank runs, and the single-process oracle. The ranks run in
processes spawned by tests/run/torch_distributed.py (the 'torch_distributed' background job);
each writes what it saw to an .npz file that the tests compare.

The oracle is a single process: for each step it runs every rank's data shard through a copy
of the model, takes the elementwise max of the staged amaxes (the amaxes of the concatenated
data) and runs the plain single-process update.
"""
from __future__ import annotations

import copy
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fusedfp8.pytorch as fp8
from fusedfp8 import DelayedScaling
from fusedfp8.state import STATE_FIELDS

WORLDS = (2, 4)

ROOT = Path(__file__).resolve().parents[2]  # the repository (scripts/train_ddp.py)
RECIPE = DelayedScaling(amax_history_len=4)
BRANCH_RECIPE = DelayedScaling(amax_history_len=6, amax_compute_algo="most_recent", margin=1)  # a 2nd linked state
STEPS = 5
BRANCH_STEPS = (1, 2)  # the branch module runs on the last rank only, at these steps
NAN_STEP = 3  # rank 1 feeds a NaN at this step
INF_STEP = 4  # rank 0 feeds an inf at this step
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce", "gather", "scatter", "all_to_all_single", "all_reduce_coalesced", "barrier")


class Net(nn.Module):
    """LayerNorm -> Dense -> gelu -> Dense (Fp8MLP), a head, and a branch run on demand. The
    branch has a recipe of its own, so the model has two linked states: their staged rows are
    concatenated into one buffer for the all_reduce (the DDP scenarios cover the single state,
    reduced in place)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.mlp = fp8.Fp8MLP(32, 64, RECIPE)
        self.head = fp8.Fp8Linear(32, 16, recipe=RECIPE)
        self.branch = fp8.convert_to_fp8(nn.Linear(32, 16), BRANCH_RECIPE)

    def forward(self, x, use_branch=False):
        h = self.mlp(x)
        y = self.head(h)
        return y + self.branch(h) if use_branch else y


MODULES = ("mlp.fc1", "mlp.fc2", "head", "branch")


def shard(rank, step, world):
    """Rank ``rank``'s data at ``step``: magnitudes chosen so the max comes from different ranks."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 32, generator=g) * 2.0 ** (((rank * 3 + step * 5) % 7) - 3)
    if step == NAN_STEP and rank == 1:
        x[3, 5] = float("nan")
    if step == INF_STEP and rank == 0:
        x[0, 0] = float("inf")
    return x, (step in BRANCH_STEPS and rank == world - 1)


def train_step(model, x, use_branch):
    (model(x, use_branch) ** 2).mean().backward()
    model.zero_grad(set_to_none=True)


def weight_step(model, step):
    """The same weight change on every rank (no gradients involved), so replicas stay equal."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.75 + 0.125 * step)


def snapshot(model):
    """Every state array of every FP8 module, as numpy, keyed 'module/field'."""
    out = {}
    for name in MODULES:
        m = model.get_submodule(name)
        for f in STATE_FIELDS:
            out[f"{name}/{f}"] = getattr(m, f).detach().numpy().copy()
    return out


def staged(model):
    return np.concatenate([model.get_submodule(n).amax_history[0].detach().numpy() for n in MODULES])


class CollectiveCounter:
    """Counts torch.distributed collectives (and the all_reduce calls' op and size) while active."""

    def __init__(self):
        self.calls, self.active = [], False
        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if self.active:
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                op = kwargs.get("op", args[1] if len(args) > 1 else None)
                self.calls.append((name, None if t is None else t.numel(), str(op)))
            return fn(*args, **kwargs)
        return counted

    def during(self, fn, *args, **kwargs):
        self.active = True
        try:
            return fn(*args, **kwargs)
        finally:
            self.active = False


def oracle(world):
    """Single process, no collectives: per step, the max over all shards of the staged amaxes."""
    model = Net()
    states = []
    for step in range(STEPS):
        rows = []
        for r in range(world):
            replica = copy.deepcopy(model)
            train_step(replica, *shard(r, step, world))
            rows.append(torch.stack([replica.get_submodule(n).amax_history[0] for n in MODULES]))
        amax = torch.stack(rows).amax(dim=0)  # NaN-propagating, as the state machine expects
        for i, n in enumerate(MODULES):
            model.get_submodule(n).amax_history[0] = amax[i]
        weight_step(model, step)
        fp8.update_model_scales(model)
        states.append(snapshot(model))
    return states


def scenario_steps(rank, world, counter, out, tag, async_op):
    """Different data per rank; branch on one rank; NaN on one rank; inf on another."""
    model = Net()
    group = dist.group.WORLD
    for step in range(STEPS):
        train_step(model, *shard(rank, step, world))
        out[f"{tag}/pre/{step}"] = staged(model)
        n_before = len(counter.calls)
        if async_op:
            pending = counter.during(fp8.update_model_scales, model, group, async_op=True)
            weight_step(model, step)  # overlaps the reduction
            pending.wait()
        else:
            weight_step(model, step)
            counter.during(fp8.update_model_scales, model, group=group)
        calls = counter.calls[n_before:]
        out[f"{tag}/calls/{step}"] = np.array([f"{c[0]}:{c[1]}:{c[2]}" for c in calls])
        for k, v in snapshot(model).items():
            out[f"{tag}/state/{step}/{k}"] = v
    return model


def scenario_checkpoint(rank, world, model, tmp, out):
    """Rank 0 saves; every rank loads into a differently initialised model; one more step."""
    path = os.path.join(tmp, "ckpt.pt")
    if rank == 0:
        torch.save(model.state_dict(), path)
    dist.barrier()
    fresh = Net(seed=100 + rank)
    fresh.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    for k, v in snapshot(fresh).items():
        out[f"ckpt/loaded/{k}"] = v
    out["ckpt/weight"] = fresh.head.weight.detach().numpy().copy()
    x, _ = shard(rank, STEPS, world)
    train_step(fresh, x, False)
    out["ckpt/pre"] = staged(fresh)
    fp8.update_model_scales(fresh, dist.group.WORLD)
    for k, v in snapshot(fresh).items():
        out[f"ckpt/after/{k}"] = v


def scenario_ddp(rank, world, counter, out, tag, micro_no_sync, **ddp_kwargs):
    """DDP with a real optimizer and 2 micro-batches per step. ``snaps`` are the staged rows right
    after each micro-batch's backward, before DDP could broadcast anything over them."""
    torch.manual_seed(7)
    model = nn.Sequential(fp8.Fp8MLP(32, 64, RECIPE), fp8.Fp8Linear(32, 16, recipe=RECIPE))
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    names = ("0.fc1", "0.fc2", "1")
    for step in range(3):
        snaps = []
        for k in range(2):
            x, _ = shard(rank, 10 * step + k, world)
            ctx = ddp.no_sync() if (micro_no_sync and k == 0) else torch.enable_grad()
            with ctx:
                (ddp(x) ** 2).mean().backward()
            snaps.append(np.concatenate([model.get_submodule(n).amax_history[0].detach().numpy() for n in names]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_before = len(counter.calls)
        counter.during(fp8.update_model_scales, ddp, dist.group.WORLD)
        out[f"{tag}/ncalls/{step}"] = np.array(len(counter.calls) - n_before)
        out[f"{tag}/snaps/{step}"] = np.stack(snaps)
        out[f"{tag}/last/{step}"] = np.concatenate([model.get_submodule(n).amax_history[-1].detach().numpy()
                                                    for n in names])
        out[f"{tag}/scale/{step}"] = np.concatenate([model.get_submodule(n).scale.detach().numpy() for n in names])
        out[f"{tag}/weights/{step}"] = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])


def scenario_fsdp2(rank, world, out):
    """FSDP2 (fully_shard) on gloo CPU; records the error instead of raising it."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = nn.Sequential(fp8.Fp8MLP(32, 64, RECIPE, missed_update="ignore"),
                          fp8.Fp8Linear(32, 16, recipe=RECIPE, missed_update="ignore"))
    try:
        fully_shard(model[0])
        fully_shard(model[1])
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(2):
            x, _ = shard(rank, step, world)
            (model(x) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            fp8.update_model_scales(model, dist.group.WORLD)
        out["fsdp2/scale"] = np.concatenate([m.scale.detach().numpy() for m in (model[0].fc1, model[0].fc2, model[1])])
        out["fsdp2/updates"] = np.concatenate([m.updates.detach().numpy() for m in (model[0].fc1, model[0].fc2,
                                                                                    model[1])])
    except Exception as e:  # noqa: BLE001  (reported to the test, which decides)
        out["fsdp2/error"] = np.array(f"{type(e).__name__}: {e}")
        dist.barrier()  # the other ranks may be waiting in a collective of the failed step; resync


def run_train_ddp_script(rank, world, tmp, port, extra=(), name="train_ddp.json"):
    """scripts/train_ddp.py's main() in this process, with the environment torchrun would set
    (``extra``: more arguments; ``name``: of the JSON report in ``tmp``)."""
    import importlib.util

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "scripts" / "train_ddp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main(["--device", "cpu", "--steps", "3", "--hidden", "32", "--ffn", "64", "--tokens", "16",
                        "--json", os.path.join(tmp, name), *extra])


def worker(rank, world, tmp, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # a collective that hangs fails instead
    counter = CollectiveCounter()
    out = {}
    t0 = time.perf_counter()
    model = scenario_steps(rank, world, counter, out, "sync", async_op=False)
    scenario_steps(rank, world, counter, out, "async", async_op=True)
    scenario_checkpoint(rank, world, model, tmp, out)
    scenario_ddp(rank, world, counter, out, "ddp_nosync", micro_no_sync=True)
    scenario_ddp(rank, world, counter, out, "ddp_nobcast", micro_no_sync=False, broadcast_buffers=False)
    if rank == 0:
        for step, st in enumerate(oracle(world)):
            for k, v in st.items():
                out[f"oracle/{step}/{k}"] = v
    out["seconds"] = np.array(time.perf_counter() - t0)
    if world == 2:
        scenario_fsdp2(rank, world, out)
    np.savez(os.path.join(tmp, f"rank{rank}.npz"), **out)
    dist.barrier()
    dist.destroy_process_group()
    if world == 2:
        rc = run_train_ddp_script(rank, world, tmp, port)
        rc_block = run_train_ddp_script(rank, world, tmp, port, ("--recipe", "block", "--model", "convert", "--steps",
                                                                 "2"), "train_ddp_block.json")
        np.savez(os.path.join(tmp, f"script{rank}.npz"), script_rc=np.array(rc), block_rc=np.array(rc_block))


def spawn_ranks(fn, args: tuple, nprocs: int, timeout: float, what: str, start_method: str = "spawn") -> None:
    """Run ``fn(rank, *args, port)`` in ``nprocs`` new processes to the end (``port``: a free TCP
    port on 127.0.0.1, for a MASTER_PORT); past ``timeout`` s they are killed and a TimeoutError
    names ``what``. A rank that raises raises here (torch.multiprocessing). ``start_method``
    'spawn' (fresh interpreters: safe from any parent) or 'fork' (the ranks inherit the parent's
    imports: only from a process that started no threads, such as a tests/run/ entry point)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.start_processes(fn, args=(*args, port), nprocs=nprocs, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{what} did not finish within {timeout} s")


def spawn_world(world: int, out: Path, timeout: float = 180) -> None:
    """Run ``world`` ranks to the end; their .npz files land in ``out``. The ranks are forked
    (tests/run/torch_distributed.py calls this from a fresh process that only imported torch and
    fusedfp8): importing them again in each of the six ranks was most of the job's CPU time."""
    spawn_ranks(worker, (world, str(out)), world, timeout, f"the {world} forked ranks", start_method="fork")


def results(world: int, out: Path) -> list[dict]:
    """Each rank's record (dict of numpy arrays), with the script's on world 2."""
    res = [dict(np.load(out / f"rank{r}.npz")) for r in range(world)]
    if world == 2:
        for r in range(world):
            res[r].update(np.load(out / f"script{r}.npz"))
        res[0]["train_ddp.json"] = (out / "train_ddp.json").read_text()
        res[0]["train_ddp_block.json"] = (out / "train_ddp_block.json").read_text()
    return res
