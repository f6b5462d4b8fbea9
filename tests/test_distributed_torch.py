"""torch.distributed (gloo, CPU): update_scales(model, group) MAX-reduces the staged amaxes in ONE
all_reduce, so every rank holds bitwise the same scales and histories.

One spawn (``torch.multiprocessing``) per world size (2 and 4) runs every scenario below in the
same processes, because importing torch dominates the cost; the 2-rank processes also try FSDP2
and run scripts/train_ddp.py's main() with torchrun's environment. Each rank writes what it saw
to an .npz file and the tests compare the files. Numpy files, not torch.load, in this process: see the
torch.load skip in test_pytorch.py.

The oracle is a single process: for each step it runs every rank's data shard through a copy
of the model, takes the elementwise max of the staged amaxes (the amaxes of the concatenated
data) and runs the plain single-process update_scales.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import fusedfp8.pytorch as fp8  # noqa: E402
from fusedfp8 import DelayedScaling  # noqa: E402
from fusedfp8.state import STATE_FIELDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
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
        fp8.update_scales(model)
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
            pending = counter.during(fp8.update_scales, model, group, async_op=True)
            weight_step(model, step)  # overlaps the reduction
            pending.wait()
        else:
            weight_step(model, step)
            counter.during(fp8.update_scales, model, group=group)
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
    fp8.update_scales(fresh, dist.group.WORLD)
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
        counter.during(fp8.update_scales, ddp, dist.group.WORLD)
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
            fp8.update_scales(model, dist.group.WORLD)
        out["fsdp2/scale"] = np.concatenate([m.scale.detach().numpy() for m in (model[0].fc1, model[0].fc2, model[1])])
        out["fsdp2/updates"] = np.concatenate([m.updates.detach().numpy() for m in (model[0].fc1, model[0].fc2,
                                                                                    model[1])])
    except Exception as e:  # noqa: BLE001  (reported to the test, which decides)
        out["fsdp2/error"] = np.array(f"{type(e).__name__}: {e}")
        dist.barrier()  # the other ranks may be waiting in a collective of the failed step; resync


def run_train_ddp_script(rank, world, tmp, port):
    """scripts/train_ddp.py's main() in this process, with the environment torchrun would set."""
    import importlib.util

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "scripts" / "train_ddp.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main(["--device", "cpu", "--steps", "3", "--hidden", "32", "--ffn", "64", "--tokens", "16",
                        "--json", os.path.join(tmp, "train_ddp.json")])


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
        np.savez(os.path.join(tmp, f"script{rank}.npz"), script_rc=np.array(rc))


_RESULTS: dict = {}


def _results(world, tmp_path_factory):
    """Spawn ``world`` ranks once per session (killed after 180 s); their .npz files, per rank."""
    if world not in _RESULTS:
        tmp = tmp_path_factory.mktemp(f"world{world}")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.start_processes(worker, args=(world, str(tmp), port), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 180
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the {world} spawned ranks did not finish within 180 s")
        res = [dict(np.load(tmp / f"rank{r}.npz")) for r in range(world)]
        if world == 2:
            for r in range(world):
                res[r].update(np.load(tmp / f"script{r}.npz"))
            res[0]["train_ddp.json"] = (tmp / "train_ddp.json").read_text()
        _RESULTS[world] = res
    return _RESULTS[world]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def runs(request, tmp_path_factory):
    return request.param, _results(request.param, tmp_path_factory)


def _states(res, tag, step):
    prefix = f"{tag}/state/{step}/"
    return {k[len(prefix):]: v for k, v in res.items() if k.startswith(prefix)}


def _assert_bitwise_equal(a: dict, b: dict, what: str):
    assert a.keys() == b.keys() and a, what
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), \
            f"{what}: {k} differs: {a[k]} vs {b[k]}"


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", ["sync", "async"])
def test_every_rank_holds_the_single_process_state_of_the_concatenated_data(runs, tag):
    world, res = runs
    for step in range(STEPS):
        want = {k[len(f"oracle/{step}/"):]: v for k, v in res[0].items() if k.startswith(f"oracle/{step}/")}
        for r in range(world):
            _assert_bitwise_equal(_states(res[r], tag, step), want, f"{tag} rank {r} step {step}")
    last = _states(res[0], tag, STEPS - 1)
    # the update really happened (and a plain local update would not have given this): every
    # tensor advanced, and the ranks' own staged amaxes differed from the reduced ones
    assert all((last[f"{n}/updates"] > 0).all() for n in MODULES)
    assert any(not np.array_equal(res[r][f"{tag}/pre/0"], res[0][f"{tag}/pre/0"]) for r in range(1, world))


@pytest.mark.parametrize("tag", ["sync", "async"])
def test_one_max_all_reduce_of_every_staged_amax_per_step(runs, tag):
    world, res = runs
    n = 3 * len(MODULES)
    for r in range(world):
        for step in range(STEPS):
            assert res[r][f"{tag}/calls/{step}"].tolist() == [f"all_reduce:{n}:{dist.ReduceOp.MAX}"], (r, step)


def test_reduced_amax_is_the_max_over_ranks(runs):
    world, res = runs
    for step in (0, 1, 2):  # finite steps: the staged amax moves to the last history row
        pre = np.stack([res[r][f"sync/pre/{step}"] for r in range(world)])
        last = np.concatenate([res[0][f"sync/state/{step}/{n}/amax_history"][-1] for n in MODULES])
        seen = pre.max(axis=0) > 0
        np.testing.assert_array_equal(last[seen], pre.max(axis=0)[seen])


def test_branch_run_on_one_rank_updates_every_rank(runs):
    world, res = runs
    b = slice(9, 12)  # the branch's three tensors
    for r in range(world - 1):
        for step in BRANCH_STEPS:
            assert not res[r][f"sync/pre/{step}"][b].any()  # this rank staged nothing for it ...
    for r in range(world):
        st = _states(res[r], "sync", BRANCH_STEPS[-1])
        assert st["branch/updates"].tolist() == [2, 2, 2]  # ... and still took its update
        assert (st["branch/scale"] != 1).all()


def test_non_finite_amax_on_one_rank_is_an_overflow_on_every_rank(runs):
    world, res = runs
    for r in range(world):
        before = _states(res[r], "sync", NAN_STEP - 1)
        nan = _states(res[r], "sync", NAN_STEP)
        inf = _states(res[r], "sync", INF_STEP)
        for n in ("mlp.fc1", "mlp.fc2", "head"):
            # NaN enters at rank 1's input: every forward and backward tensor downstream is NaN
            # there (the weights stay finite); inf on rank 0's input makes LayerNorm's output NaN
            assert (nan[f"{n}/overflows"] - before[f"{n}/overflows"]).tolist() == [1, 0, 1], (r, n)
            assert (inf[f"{n}/overflows"] - nan[f"{n}/overflows"]).tolist() == [1, 0, 1], (r, n)
            assert nan[f"{n}/scale"][0] == before[f"{n}/scale"][0]  # the scale is kept
            assert np.isfinite(nan[f"{n}/amax_history"]).all()  # no non-finite value enters the history
    staged_nan = np.stack([res[r][f"sync/pre/{NAN_STEP}"] for r in range(world)])
    assert np.isnan(staged_nan[1]).any() and not np.isnan(staged_nan[0]).any()


def test_checkpoint_saved_on_rank_0_restores_on_every_rank(runs):
    world, res = runs
    saved = _states(res[0], "sync", STEPS - 1)
    for r in range(world):
        loaded = {k[len("ckpt/loaded/"):]: v for k, v in res[r].items() if k.startswith("ckpt/loaded/")}
        _assert_bitwise_equal(loaded, saved, f"rank {r} loaded")
        np.testing.assert_array_equal(res[r]["ckpt/weight"], res[0]["ckpt/weight"])
    after = [{k: v for k, v in res[r].items() if k.startswith("ckpt/after/")} for r in range(world)]
    for r in range(1, world):
        _assert_bitwise_equal(after[r], after[0], f"rank {r} after a step on the restored model")
    assert (after[0]["ckpt/after/head/updates"] == saved["head/updates"] + 1).all()


@pytest.mark.parametrize("tag", ["ddp_nosync", "ddp_nobcast"])
def test_ddp(runs, tag):
    """DDP: default buffer sync with no_sync() accumulation, and broadcast_buffers=False with
    synchronised accumulation; both keep every rank's micro-batch amaxes in the max."""
    world, res = runs
    for step in range(3):
        for r in range(world):
            assert int(res[r][f"{tag}/ncalls/{step}"]) == 1
            for key in ("last", "scale", "weights"):
                np.testing.assert_array_equal(res[r][f"{tag}/{key}/{step}"], res[0][f"{tag}/{key}/{step}"])
        want = np.stack([res[r][f"{tag}/snaps/{step}"] for r in range(world)]).max(axis=(0, 1))
        np.testing.assert_array_equal(res[0][f"{tag}/last/{step}"], want)
        assert (res[0][f"{tag}/scale/{step}"] != 1).all()


def test_fsdp2_cpu(tmp_path_factory):
    res = _results(2, tmp_path_factory)
    assert "fsdp2/error" not in res[0], str(res[0]["fsdp2/error"])
    for r in range(2):
        np.testing.assert_array_equal(res[r]["fsdp2/scale"], res[0]["fsdp2/scale"])
    assert (res[0]["fsdp2/updates"] == 2).all()


def test_group_errors_change_nothing():
    model = Net()
    model(torch.randn(4, 32)).sum().backward()
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="not initialized"):
        fp8.update_scales(model, group=object())
    with pytest.raises(TypeError, match="not both"):
        fp8.update_scales(model, group=object(), process_group=object())
    with pytest.raises(TypeError, match="async_op must be a bool"):
        fp8.update_scales(model, async_op=1)
    _assert_bitwise_equal(snapshot(model), before, "after rejected calls")
    pending = fp8.update_scales(model, async_op=True)  # no group: already done
    assert pending.done and (model.head.updates > 0).all()


def test_train_ddp_script_runs_on_cpu(tmp_path_factory):
    """scripts/train_ddp.py's main() in 2 ranks with torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, LOCAL_RANK), gloo: it trains, times, and finds the ranks' states identical."""
    res = _results(2, tmp_path_factory)
    assert [int(r["script_rc"]) for r in res] == [0, 0]
    rep = json.loads(str(res[0]["train_ddp.json"]))
    assert rep["world_size"] == 2 and rep["backend"] == "gloo" and len(rep["steps"]) == 3
    assert rep["scales_identical_across_ranks"] is True and rep["scales_updated"] is True
    assert rep["weights_identical_across_ranks"] is True
    assert rep["fp8_tensors"] == 6
    assert all(s["amax_allreduce_ms"] > 0 and s["update_scales_ms"] > 0 and s["step_ms"] > 0 for s in rep["steps"])
