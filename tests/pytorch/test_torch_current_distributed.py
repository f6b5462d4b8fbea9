"""CurrentScaling across ranks in torch (``amax_group``), gloo on the CPU, 2 processes forked once
by the 'torch_distributed' background job (tests/run/torch_distributed.py, the ranks'
code in tests/support/torch_current_distributed.py): every amax MAX-reduced before its cast, one
all_reduce per tensor group, every rank bitwise the same scales and the FP8 bytes of a single
process quantizing the concatenated batch; NaN on one rank is an overflow on both.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.state import STATE_FIELDS
from support import torch_current_distributed as D

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


ON_JOB = pytest.mark.background("torch_distributed")  # the tests that read the ranks' records


@pytest.fixture(scope="module")
def res(background):
    return D.results(background.result("torch_distributed").check().out / "current")


def _equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _group(r: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)}


@ON_JOB
def test_quantized_bytes_and_scales_equal_the_single_process_cast_of_the_concatenated_tensor(res):
    for name in ("x", "gelu", "dgelu"):
        rows = [res[r][f"q/{name}"] for r in range(D.WORLD)]
        assert _equal(np.concatenate(rows), res[0][f"oracle/q/{name}"]), name
    for r in range(D.WORLD):
        assert _equal(res[r]["q/scale_inv"], res[0]["oracle/q/scale_inv"]), r
        for f in STATE_FIELDS:
            assert _equal(res[r][f"q/state/{f}"], res[0][f"oracle/q/state/{f}"]), (r, f)
    # the ranks' own amaxes differ (rank 1's x is twice as large): a local scale would differ
    assert res[0]["q/x"].tobytes() != res[1]["q/x"].tobytes()


@ON_JOB
def test_training_step_equals_the_single_process_step_on_the_concatenated_batch(res):
    want = _group(res[0], "oracle/staged/")
    for r in range(D.WORLD):
        got = _group(res[r], "train/staged/0/")
        assert got.keys() == want.keys() and got
        for k in want:
            assert _equal(got[k], want[k]), (r, k, got[k], want[k])
    for name in ("y", "dx"):  # this rank's rows of the oracle's output and input gradient
        got = np.concatenate([res[r][f"train/{name}/0"] for r in range(D.WORLD)])
        assert _equal(got, res[0][f"oracle/{name}"]), name


@ON_JOB
def test_every_rank_holds_the_same_scales_and_weights_every_step(res):
    for step in range(D.STEPS):
        a, b = _group(res[0], f"train/state/{step}/"), _group(res[1], f"train/state/{step}/")
        assert a.keys() == b.keys() and a
        for k in a:
            assert _equal(a[k], b[k]), (step, k, a[k], b[k])
        assert _equal(res[0][f"train/weights/{step}"], res[1][f"train/weights/{step}"]), step
    # the scales moved with the data (current scaling), and the last amax row holds global amaxes
    s = [res[0][f"train/state/{step}/head/scale"] for step in range(2)]
    assert not np.array_equal(s[0], s[1])


@ON_JOB
def test_nan_on_one_rank_is_an_overflow_on_every_rank(res):
    before = D.NAN_STEP - 1
    for r in range(D.WORLD):
        for n in D.MODULES:
            prev = res[r][f"train/state/{before}/{n}/overflows"]
            now = res[r][f"train/state/{D.NAN_STEP}/{n}/overflows"]
            assert (prev == 0).all() and (now[0] == 1), (r, n, prev, now)  # the input of every layer saw it
            assert _equal(now, res[0][f"train/state/{D.NAN_STEP}/{n}/overflows"])
            # a non-finite amax keeps the scale: the previous step's, on both ranks
            assert _equal(res[r][f"train/state/{D.NAN_STEP}/{n}/scale"][:1],
                          res[r][f"train/state/{before}/{n}/scale"][:1]), (r, n)


@ON_JOB
def test_one_all_reduce_per_tensor_group(res):
    # Fp8MLP: (LayerNorm(x), w1), (gelu(z), w2), dy, dgelu; the head: (x, w), its output gradient
    want = ["(2, 2):ReduceOp.MAX"] * 2 + ["(2, 2):ReduceOp.MAX", "(1, 2):ReduceOp.MAX", "(1, 2):ReduceOp.MAX",
                                          "(1, 2):ReduceOp.MAX"]
    for r in range(D.WORLD):
        for step in range(D.STEPS):
            calls = [c.replace("RedOpType.", "ReduceOp.") for c in res[r][f"train/calls/{step}"].tolist()]
            assert sorted(calls) == sorted(want), (r, step, calls)
            assert len(calls) == 6


@ON_JOB
def test_a_group_of_one_rank_equals_no_group(res):
    # ragged (padded GEMMs), LayerNorm fused and not, 3-D bf16 input, e4m3 gradients, margin 2
    for r in range(D.WORLD):
        cases = _group(res[r], "self/")
        assert len(cases) == 3 and all(bool(v) for v in cases.values()), (r, cases)


@ON_JOB
def test_amax_group_with_delayed_scaling_is_refused(res):
    for name in ("linear", "mlp", "convert", "setter"):
        msg = str(res[0][f"bad/{name}"])
        assert msg.startswith("ValueError:") and "update_model_scales" in msg and "CurrentScaling" in msg, (name, msg)
    assert bool(res[0]["bad/copy_group"])  # a deep copy keeps the group


@pytest.mark.parametrize("bad", ["world", 0, object(), "uninitialized"])
def test_amax_group_of_the_wrong_type_or_uninitialized_is_refused(bad):
    r = fusedfp8.CurrentScaling()
    if bad == "uninitialized":  # a real group, but no init_process_group in this process
        assert not dist.is_initialized()
        bad, err, match = dist.ProcessGroup(0, 1), RuntimeError, "amax_group: torch.distributed is not initialized; "
    else:
        err = TypeError
        match = f"amax_group must be a torch.distributed.ProcessGroup .* or None; got {type(bad).__name__}$"
    for make in (lambda: fp8.Fp8Linear(4, 4, recipe=r, amax_group=bad), lambda: fp8.Fp8MLP(4, 8, r, amax_group=bad),
                 lambda: fp8.convert_to_fp8(torch.nn.Linear(4, 4), r, amax_group=bad)):
        with pytest.raises(err, match=match):
            make()


def test_amax_op_is_the_amax_the_quantization_stages():
    from fusedfp8.pytorch import amax_ops

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 24, generator=g, dtype=torch.bfloat16) * 3
    z = torch.randn(5, 24, generator=g, dtype=torch.bfloat16)
    w, b = torch.randn(24, generator=g), torch.randn(24, generator=g)
    from fusedfp8 import ops
    want = [ops.quantize(x, 1.0).amax, ops.gelu_quantize(z, 1.0, approximate="none").amax,
            ops.dgelu_quantize(x, z, 1.0).amax, ops.layernorm_quantize(x, w, b, 1e-5, 1.0).quantized.amax]
    got = [amax_ops.amax(x, None, "identity", "tanh"), amax_ops.amax(z, None, "gelu", "none"),
           amax_ops.amax(x, z, "dgelu", "tanh"), amax_ops.layernorm_amax(x, w, b, 1e-5)]
    for a, e in zip(got, want):
        assert a.shape == (2,) and a[1] == 0 and a[0] == e[0] and a[0] > 0
    with pytest.raises(ValueError, match="b is the dgelu's second input"):
        amax_ops.amax(x, None, "dgelu", "tanh")
    with pytest.raises(TypeError, match="x must be float32"):
        amax_ops.amax(x.int(), None, "identity", "tanh")


@ON_JOB
def test_ranks_took_little_time(res):
    assert float(res[0]["seconds"]) < 30


@ON_JOB
def test_train_ddp_script_with_current_scaling(res):
    # scripts/train_ddp.py --recipe current: DDP, amax_group=WORLD, identical FP8 states on both ranks
    assert [int(r["script_rc"]) for r in res] == [0] * D.WORLD


# ---- GPU ---------------------------------------------------------------------------------------
AMAX_CASES = [(shape, dtype, op) for shape in [(0, 32), (1, 1), (7, 33), (256, 1024), (1000, 1030)]
              for dtype in (torch.bfloat16, torch.float32) for op in ("identity", "gelu", "dgelu")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,op", AMAX_CASES)
def test_amax_kernel_equals_the_reference_and_the_quantize_kernel(shape, dtype, op):
    from fusedfp8 import ops
    from fusedfp8.pytorch import amax_ops

    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    x = torch.randn(shape, generator=g).to(dtype) * 5
    z = torch.randn(shape, generator=g).to(dtype)
    b = z if op == "dgelu" else None
    got = amax_ops.amax(x.cuda(), None if b is None else b.cuda(), op, "tanh").cpu()
    cpu = amax_ops.amax(x, b, op, "tanh")  # the reference
    fn = {"identity": lambda t: ops.quantize(t, 1.0), "gelu": lambda t: ops.gelu_quantize(t, 1.0),
          "dgelu": lambda t: ops.dgelu_quantize(t, z.cuda(), 1.0)}[op]
    staged = fn(x.cuda()).amax.cpu()  # what the quantize kernel stages
    assert got.view(torch.int32).tolist() == cpu.view(torch.int32).tolist(), (got, cpu)
    assert got[0].view(torch.int32) == staged[0].view(torch.int32) and got[1] == 0
    off = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(shape)  # not 16-byte aligned
    off.copy_(x.cuda())
    if op != "dgelu":
        assert amax_ops.amax(off, None, op, "tanh").cpu().view(torch.int32).tolist() == cpu.view(torch.int32).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 64), (3, 40), (300, 1024)])
def test_layernorm_amax_kernel_equals_the_reference(shape):
    from fusedfp8.pytorch import amax_ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=g).to(torch.bfloat16) * 3 + 1
    w, b = torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g)
    got = amax_ops.layernorm_amax(x.cuda(), w.cuda(), b.cuda(), 1e-5).cpu()
    want = amax_ops.layernorm_amax(x, w, b, 1e-5)
    assert got.view(torch.int32).tolist() == want.view(torch.int32).tolist(), (got, want)


@pytest.mark.gpu
@pytest.mark.fp8_gemm
def test_one_nccl_rank_equals_the_plain_current_scaling_run(tmp_path):
    if not dist.is_nccl_available():
        pytest.skip("torch has no NCCL")
    res = D.spawn_nccl1(tmp_path)
    for mode in ("eager", "compiled"):
        plain, group = _group(res, f"{mode}/plain/"), _group(res, f"{mode}/group/")
        assert plain.keys() == group.keys() and len(plain) > 10
        for k in plain:
            assert _equal(plain[k], group[k]), (mode, k)
        assert np.isfinite(plain[f"y/{D.STEPS - 1}"]).all()
