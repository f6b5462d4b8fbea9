"""torch.distributed (gloo, CPU): update_model_scales(model, group) MAX-reduces the staged amaxes in
ONE all_reduce, so every rank holds bitwise the same scales and histories.

The ranks run every scenario of tests/support/torch_distributed.py in processes spawned once per
world size (2 and 4) by tests/run/torch_distributed.py (the 'torch_distributed' background job,
beside the other tests); the 2-rank processes also try FSDP2 and run scripts/train_ddp.py's
main() with torchrun's environment. Each rank writes what it saw to an .npz file and the tests
compare the files against each other and against the single-process oracle.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fusedfp8.pytorch as fp8
from support.torch_distributed import BRANCH_STEPS, INF_STEP, MODULES, NAN_STEP, STEPS, Net, results, snapshot

pytestmark = [pytest.mark.background("torch_distributed"), pytest.mark.slow]


@pytest.fixture(scope="module")
def job(background):
    return background.result("torch_distributed").check().out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def runs(request, job):
    return request.param, results(request.param, job / f"world{request.param}")


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


def test_fsdp2_cpu(job):
    res = results(2, job / "world2")
    assert "fsdp2/error" not in res[0], str(res[0]["fsdp2/error"])
    for r in range(2):
        np.testing.assert_array_equal(res[r]["fsdp2/scale"], res[0]["fsdp2/scale"])
    assert (res[0]["fsdp2/updates"] == 2).all()


def test_group_errors_change_nothing():
    model = Net()
    model(torch.randn(4, 32)).sum().backward()
    before = snapshot(model)
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup .* or None; got object"):
        fp8.update_model_scales(model, group=object())
    assert not dist.is_initialized()  # a real group, but no init_process_group in this process
    with pytest.raises(RuntimeError, match="group: torch.distributed is not initialized; .* pass group=None"):
        fp8.update_model_scales(model, group=dist.ProcessGroup(0, 1))
    with pytest.raises(TypeError, match="process_group"):  # the 0.1 alias is gone: group= only
        fp8.update_model_scales(model, process_group=object())
    with pytest.raises(TypeError, match="async_op must be a bool"):
        fp8.update_model_scales(model, async_op=1)
    _assert_bitwise_equal(snapshot(model), before, "after rejected calls")
    pending = fp8.update_model_scales(model, async_op=True)  # no group: already done
    assert pending.done and (model.head.updates > 0).all()


def test_train_ddp_script_runs_on_cpu(job):
    """scripts/train_ddp.py's main() in 2 ranks with torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, LOCAL_RANK), gloo: it trains, times, and finds the ranks' states identical."""
    res = results(2, job / "world2")
    assert [int(r["script_rc"]) for r in res] == [0, 0]
    rep = json.loads(str(res[0]["train_ddp.json"]))
    assert rep["world_size"] == 2 and rep["backend"] == "gloo" and len(rep["steps"]) == 3
    assert rep["scales_identical_across_ranks"] is True and rep["scales_updated"] is True
    assert rep["weights_identical_across_ranks"] is True
    assert rep["fp8_tensors"] == 6
    assert all(s["amax_allreduce_ms"] > 0 and s["update_scales_ms"] > 0 and s["step_ms"] > 0 for s in rep["steps"])


def test_train_ddp_script_with_block_scaling(job):
    """scripts/train_ddp.py --recipe block --model convert (two Fp8BlockLinear) in 2 ranks: no FP8
    state, so no amax collective and no scale update; DDP keeps the weights bitwise identical."""
    res = results(2, job / "world2")
    assert [int(r["block_rc"]) for r in res] == [0, 0]
    rep = json.loads(str(res[0]["train_ddp_block.json"]))
    assert rep["recipe"] == "block" and rep["model"] == "convert" and len(rep["steps"]) == 2
    assert rep["block_scaled_linears"] == 2 and rep["fp8_tensors"] == 0
    assert rep["weights_identical_across_ranks"] is True and rep["scales_identical_across_ranks"] is None
    assert all(s["amax_allreduce_ms"] is None and s["update_scales_ms"] is None and s["step_ms"] > 0
               for s in rep["steps"])
    assert all(math.isfinite(s["loss"]) for s in rep["steps"])
