"""Current scaling in ONE launch (cuda_src/current_quantize.cu). On the GPU, byte for byte: the
one-launch kernels (the amax, a grid-wide barrier, the cast) against the two-pass path (an amax
pre-pass launch, then the cast) and against the NumPy reference, for every op x format x dtype,
shapes small to larger than what the grid holds in registers, ragged, padded, transposed, with
dbias; the state's slot holding 0, -0, a larger amax or NaN before the call; NaN / inf / zero / tiny
inputs; a step that is not a first step (the kernel is then the delayed one); one kernel launch per
tensor (torch profiler); inside a CUDA graph. The plan side (the cooperative step, its encoding and
the shim's packing) is tested without a GPU in test_launch_shim.py."""
from __future__ import annotations

import numpy as np
import pytest

from fusedfp8 import launch
from fusedfp8.formats import get_format
from fusedfp8.numerics import reference as ref
from support.frameworks import np_dtype, to_np, to_torch

pytestmark = pytest.mark.gpu

OPS = [("identity", "tanh"), ("gelu", "tanh"), ("gelu", "none"), ("dgelu", "tanh"), ("dgelu", "none")]
DTYPES = ("float32", "bfloat16", "float16")
SMALL = [(33, 48), (1, 1), (7, 13), (303, 300), (16, 16 * 97 + 5),  # (odd tails: no 16-element vector fits)
         (271, 200)]  # (16-byte loads but for the last 8 columns: a thread row that ends mid-vector)
LARGE = [(2048, 4096), (3000, 4100)]  # more than the grid holds in registers: the rest is read again
PARTLY = [(4096, 4096), (4097, 4104)]  # larger still; the ragged one with edge tiles read element by element
f32 = np.float32


def inputs(shape, dtype, seed, special=None):
    g = np.random.default_rng(seed)
    x = (g.standard_normal(shape) * np.exp2(g.integers(-8, 8, (shape[0], 1)))).astype(f32)
    if special is not None:
        special(x)
    return x.astype(np_dtype(dtype))


def run(x, b, op, approximate, fmt, transpose=False, dbias=False, pad_to=1, coop=True, slot=0.0, updates=0,
        scale=1.0, margin_factor=1.0):
    """One launch.quantize with a state slot on torch CUDA tensors; every output as numpy."""
    import torch

    xt = to_torch(x, "cuda")
    bt = to_torch(b, "cuda") if b is not None else None
    rows, cols = x.shape
    prows, pcols = launch.padded(rows, cols, pad_to)
    dev = xt.device
    q = torch.full((prows, pcols), 0xA5, dtype=torch.uint8, device=dev)  # (a kernel that skips a byte shows)
    q_t = torch.full((pcols, prows), 0xA5, dtype=torch.uint8, device=dev) if transpose else None
    st = {"scale": torch.tensor([scale], dtype=torch.float32, device=dev),
          "amax": torch.tensor([slot], dtype=torch.float32, device=dev),
          "scale_inv": torch.tensor([1.0 / scale], dtype=torch.float32, device=dev),
          "updates": torch.tensor([updates], dtype=torch.int32, device=dev)}
    siu = torch.empty(1, dtype=torch.float32, device=dev)
    db = part = cnt = None
    if dbias:
        shape, n_cnt = launch.dbias_workspace(rows, cols, pad_to)
        db = torch.empty(cols, dtype=torch.float32, device=dev)
        part = torch.empty(shape, dtype=torch.float32, device=dev)
        cnt = torch.empty(n_cnt, dtype=torch.int32, device=dev)
    p = (lambda a: a.data_ptr() if a is not None else 0)
    buffers = dict(x=xt.data_ptr(), b=p(bt), q=q.data_ptr(), scale=p(st["scale"]), amax=p(st["amax"]), q_t=p(q_t),
                   dbias=p(db), partial=p(part), counters=p(cnt), scale_inv_used=siu.data_ptr(),
                   updates=p(st["updates"]), scale_out=p(st["scale"]), scale_inv_out=p(st["scale_inv"]))
    launch.quantize(dev.index, torch.cuda.current_stream(dev).cuda_stream, buffers, dtype=str(xt.dtype)[6:], fmt=fmt,
                    op=_cuda_op(op, approximate), rows=rows, cols=cols, first=True, margin_factor=margin_factor,
                    pad_to=pad_to, coop=coop)
    torch.cuda.synchronize()
    out = {"q": q.cpu().numpy(), "q_t": q_t.cpu().numpy() if q_t is not None else None,
           "dbias": db.cpu().numpy() if db is not None else None, "scale_inv_used": siu.cpu().numpy()}
    out.update({k: v.cpu().numpy() for k, v in st.items()})
    return out


def _cuda_op(op, approximate):
    from fusedfp8.types import kernel_op

    return kernel_op(op, approximate)


def want(x, b, op, approximate, fmt, transpose=False, pad_to=1, slot=0.0, scale=1.0, margin_factor=1.0):
    """The reference: the slot max-accumulates amax(y) (-0 counts as 0, NaN wins), the scale is the
    current scale of the slot's value (the state's scale where that is 0 or non-finite)."""
    y = ref.activation(op, x, b, approximate)
    a = ref.amax(y)
    acc = f32(np.nan) if np.isnan(a) or np.isnan(slot) else max(f32(abs(f32(slot))), a)
    s = ref.current_scale(acc, fmt, margin_factor, f32(scale))
    res = ref.finish(y, a, s, fmt, transpose)
    rows, cols = x.shape
    prows, pcols = launch.padded(rows, cols, pad_to)
    q = ref.pad2d(res.data.reshape(rows, cols), prows, pcols).view(np.uint8)
    q_t = ref.pad2d(res.data_t, pcols, prows).view(np.uint8) if transpose else None
    with np.errstate(divide="ignore"):
        return {"q": q, "q_t": q_t, "amax": np.array([acc], f32), "scale": np.array([s], f32),
                "scale_inv": np.array([f32(1) / s], f32), "scale_inv_used": np.array([f32(1) / s], f32)}


def assert_same(got, exp, keys=("q", "q_t", "amax", "scale", "scale_inv", "scale_inv_used", "dbias")):
    for k in keys:
        if k in exp and k in got and exp[k] is not None:
            g, w = np.asarray(got[k]), np.asarray(exp[k])
            assert g.shape == w.shape, (k, g.shape, w.shape)
            gb, wb = g.view(np.uint8 if g.itemsize == 1 else np.uint32), w.view(np.uint8 if w.itemsize == 1 else np.uint32)
            bad = np.flatnonzero(gb.reshape(-1) != wb.reshape(-1))
            assert bad.size == 0, f"{k}: {bad.size} elements differ, first at {bad[0]}: {gb.reshape(-1)[bad[0]]:#x} " \
                                  f"vs {wb.reshape(-1)[bad[0]]:#x}"


def case_inputs(op, shape, dtype, seed=0, special=None):
    x = inputs(shape, dtype, seed, special)
    b = inputs(shape, dtype, seed + 1) if op == "dgelu" else None
    return x, b


# ---- the sweep against the reference and the two-pass path ------------------------------------------
@pytest.mark.parametrize("op, approximate", OPS, ids=[f"{o}-{a}" for o, a in OPS])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "x".join(map(str, s)))
def test_one_launch_is_the_reference_byte_for_byte(op, approximate, fmt, dtype, shape):
    x, b = case_inputs(op, shape, dtype, seed=sum(shape))
    for transpose, pad_to in ((False, 1), (True, 1), (True, 16), (False, 16)):
        got = run(x, b, op, approximate, fmt, transpose=transpose, pad_to=pad_to, slot=0.0, margin_factor=2.0)
        assert_same(got, want(x, b, op, approximate, fmt, transpose, pad_to, margin_factor=2.0))
        assert_same(got, run(x, b, op, approximate, fmt, transpose=transpose, pad_to=pad_to, coop=False,
                             margin_factor=2.0))
    if op == "dgelu":  # dbias: the tiled kernel's column sums, the same bits as the two-pass path
        for transpose in (False, True):
            got = run(x, b, op, approximate, fmt, transpose=transpose, dbias=True)
            two = run(x, b, op, approximate, fmt, transpose=transpose, dbias=True, coop=False)
            assert_same(got, two)
            assert_same(got, want(x, b, op, approximate, fmt, transpose))
            sums = ref.column_sums(ref.activation(op, x, b, approximate))  # (float32 summation order: as test_kernels)
            np.testing.assert_allclose(got["dbias"], sums, rtol=2e-5,
                                       atol=1e-5 * float(np.nanmax(np.abs(sums), initial=1.0)))


@pytest.mark.slow
@pytest.mark.parametrize("op, approximate", OPS, ids=[f"{o}-{a}" for o, a in OPS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "x".join(map(str, s)))
def test_larger_than_the_registers_hold_is_the_two_pass_path_byte_for_byte(op, approximate, dtype, shape):
    """(The two-pass path is the reference's byte for byte: tests/kernels/test_kernels.py.)"""
    x, b = case_inputs(op, shape, dtype, seed=3)
    fmt = "e5m2" if op == "dgelu" else "e4m3"
    for transpose, dbias in ((False, False), (True, False), (True, op == "dgelu")):
        got = run(x, b, op, approximate, fmt, transpose=transpose, dbias=dbias)
        assert_same(got, run(x, b, op, approximate, fmt, transpose=transpose, dbias=dbias, coop=False))
    a = ref.amax(ref.activation(op, x, b, approximate))  # and the amax / scale are the reference's
    assert_same(got, {"amax": np.array([a], f32), "scale": np.array([ref.current_scale(a, fmt, 1.0, f32(1))], f32)})


@pytest.mark.slow
@pytest.mark.parametrize("op, approximate", [OPS[0], OPS[1], OPS[3]], ids=["identity", "gelu", "dgelu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PARTLY, ids=lambda s: "x".join(map(str, s)))
def test_large_and_ragged_is_the_two_pass_path_byte_for_byte(op, approximate, dtype, shape):
    """Most of a block's share read twice, and the ragged shape's edge tiles (read element by element):
    the two-pass path's bytes and the reference's amax."""
    x, b = case_inputs(op, shape, dtype, seed=11, special=lambda v: v.reshape(-1).__setitem__(v.size - 40, -77.0))
    fmt = "e5m2" if op == "dgelu" else "e4m3"
    for transpose, dbias in ((False, False), (True, op == "dgelu")):
        got = run(x, b, op, approximate, fmt, transpose=transpose, dbias=dbias)
        assert_same(got, run(x, b, op, approximate, fmt, transpose=transpose, dbias=dbias, coop=False))
    a = ref.amax(ref.activation(op, x, b, approximate))
    assert_same(got, {"amax": np.array([a], f32), "scale": np.array([ref.current_scale(a, fmt, 1.0, f32(1))], f32)})


# ---- the slot, special values, a step that is not a first step -----------------------------------------
SPECIAL = {
    "zeros": lambda x: x.fill(0),
    "tiny": lambda x: (x.fill(0), x.reshape(-1).__setitem__(5, 1e-40)),
    "nan": lambda x: x.reshape(-1).__setitem__(x.size // 2, np.nan),
    "inf": lambda x: x.reshape(-1).__setitem__(x.size - 1, -np.inf),
    "nan-and-inf": lambda x: (x.reshape(-1).__setitem__(0, np.inf), x.reshape(-1).__setitem__(x.size - 3, np.nan)),
    "huge": lambda x: x.reshape(-1).__setitem__(7, 3e38),
}


SLOTS = {"slot0": 0.0, "slot-0": -0.0, "slot-larger": 1e6, "slot-nan": np.nan}
# (1536, 4096) flat and (4096, 2048) tiled: more vectors than threads and more tiles than blocks, so the
# special values at the end are in what a block streams, not in what it keeps in registers
SPECIAL_CASES = ([(sp, "slot0", shape, t) for sp in SPECIAL for shape, t in [((1536, 4096), False), ((4096, 2048), True)]]
                 + [(sp, slot, (300, 77), t) for sp in SPECIAL for slot in SLOTS for t in (False, True)])


@pytest.mark.parametrize("special, slot, shape, transpose", SPECIAL_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}-{'t' if c[3] else 'n'}" for c in SPECIAL_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_inputs_and_slots(special, slot, shape, transpose, dtype):
    slot = SLOTS[slot]
    if dtype != "float32" and special == "huge":
        pytest.skip("3e38 is not a float16 / bfloat16 value's neighbour")
    x, _ = case_inputs("identity", shape, dtype, seed=5, special=SPECIAL[special])
    for fmt in ("e4m3", "e5m2"):
        got = run(x, None, "identity", "tanh", fmt, transpose=transpose, slot=slot, scale=0.5)
        assert_same(got, want(x, None, "identity", "tanh", fmt, transpose, slot=slot, scale=0.5))
        assert_same(got, run(x, None, "identity", "tanh", fmt, transpose=transpose, slot=slot, scale=0.5, coop=False))


@pytest.mark.parametrize("shape", [(512, 1000), (2048, 4096)], ids=["small", "large"])
@pytest.mark.parametrize("transpose", [False, True])
def test_a_step_that_is_not_a_first_step_uses_the_states_scale(transpose, shape):
    """updates != 0: no barrier, the state's scale, the amax max-accumulated at the end, the state's
    scale untouched (the delayed recipe's steps after its first)."""
    x, _ = case_inputs("identity", shape, "bfloat16", seed=9)
    got = run(x, None, "identity", "tanh", "e4m3", transpose=transpose, slot=2.0, updates=3, scale=0.25)
    res = ref.quantize(x, f32(0.25), "e4m3", transpose)
    assert (got["q"] == res.data.view(np.uint8)).all()
    if transpose:
        assert (got["q_t"] == res.data_t.view(np.uint8)).all()
    assert got["amax"][0] == max(f32(2.0), ref.amax(x)) and got["scale"][0] == f32(0.25)
    assert_same(got, run(x, None, "identity", "tanh", "e4m3", transpose=transpose, slot=2.0, updates=3, scale=0.25,
                         coop=False))


# ---- one launch, CUDA graphs, the front ends ---------------------------------------------------------
def _kernels(fn):
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()  # compile, plan
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


@pytest.mark.parametrize("transpose", [False, True])
def test_one_kernel_per_tensor(transpose):
    import torch

    import fusedfp8 as ff

    recipe = ff.CurrentScaling()
    state = ff.ScalingState.create(1, recipe, like=torch.empty(0, device="cuda"))
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    names = _kernels(lambda: ff.quantize(x, state.slot(0, recipe), transpose=transpose))
    assert len(names) == 1 and "GridAmax" in names[0], names  # (the default one-launch kernels)
    delayed = ff.DelayedScaling()
    dstate = ff.ScalingState.create(1, delayed, like=torch.empty(0, device="cuda"))
    names = _kernels(lambda: ff.quantize(x, dstate.slot(0, delayed), transpose=transpose))
    assert len(names) == 1, names  # the delayed recipe's first-step path is the same one launch
    from fusedfp8.pytorch import custom_ops as fops  # the torch op (the C++ shim's plan when it is built)

    op = fops.quantize_t if transpose else fops.quantize
    args = (state.amax_history, state.scale, state.scale_inv, state.updates, 0, "e4m3", 1.0, True)
    names = _kernels(lambda: fops.call(op, x, *args))
    assert len(names) == 1 and "GridAmax" in names[0], names


def test_torch_ops_eager_graphed_and_the_python_path_agree():
    """The torch custom op (the C++ shim's plan, cooperative step) inside a CUDA graph, against eager
    fusedfp8.quantize on a copy of the state: the same bytes, the same state."""
    import torch

    import fusedfp8 as ff
    from fusedfp8.pytorch import custom_ops as fops

    recipe = ff.CurrentScaling()
    like = torch.empty(0, device="cuda")
    x = torch.randn(1024, 3000, device="cuda", dtype=torch.bfloat16) * 3
    s1 = ff.ScalingState.create(1, recipe, like=like)
    s2 = ff.ScalingState.create(1, recipe, like=like)
    args = (s1.amax_history, s1.scale, s1.scale_inv, s1.updates, 0, "e4m3", 1.0, True)
    fops.call(fops.quantize_t, x, *args, 1)  # warm up (plan, compile)
    torch.cuda.synchronize()
    s1.amax_history.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):  # (as the other graph tests)
        q, q_t, si = fops.call(fops.quantize_t, x, *args, 1)
    for step in range(3):
        x.mul_(2.0 if step else 1.0)
        s1.amax_history.zero_()
        s2.amax_history.zero_()
        g.replay()
        e = ff.quantize(x, s2.slot(0, recipe), transpose=True)
        torch.cuda.synchronize()
        assert (to_np(q).view(np.uint8) == to_np(e.data).view(np.uint8)).all()
        assert (to_np(q_t).view(np.uint8) == to_np(e.data_t).view(np.uint8)).all()
        for f in ("amax_history", "scale", "scale_inv"):
            assert (to_np(getattr(s1, f)).view(np.uint32) == to_np(getattr(s2, f)).view(np.uint32)).all(), f
        a = ref.amax(to_np(x))
        assert to_np(s1.scale)[0] == ref.current_scale(a, get_format("e4m3"), 1.0, f32(1))


@pytest.mark.jax_gpu
@pytest.mark.parametrize("impl", ["ffi", "callback"])
def test_jax_primitive_in_jit_is_the_reference(impl):
    """The JAX primitive (FFI: the shim's cooperative step; callback: the Python executor's) inside
    jax.jit: the reference's bytes and state, a NaN step keeping the scale."""
    import jax
    import jax.numpy as jnp

    import fusedfp8 as ff
    from fusedfp8.jax import primitives as JP

    recipe = ff.CurrentScaling()
    gpu = jax.devices("gpu")[0]
    st = ff.ScalingState.create(1, recipe, like=jax.device_put(jnp.zeros(1), gpu))
    step = jax.jit(lambda x, st: JP.quantize(x, JP.update_scales(st, recipe, impl=impl), 0, recipe, transpose=True,
                                             impl=impl))
    scale = f32(1)
    for k, mag in enumerate([1.0, 1e3, 1e-4]):
        xn = (np.random.default_rng(k).standard_normal((777, 1024)) * mag).astype(np.float32)
        if k == 2:
            xn[5, 5] = np.nan
        q, st = step(jax.device_put(jnp.asarray(xn), gpu), st)
        scale = ref.current_scale(ref.amax(xn), "e4m3", 1.0, scale)
        w = ref.quantize(xn, scale, "e4m3", True)
        assert (to_np(q.data).view(np.uint8) == w.data.view(np.uint8)).all()
        assert (to_np(q.data_t).view(np.uint8) == w.data_t.view(np.uint8)).all()
        assert to_np(st.scale).view(np.uint32)[0] == np.array([scale], f32).view(np.uint32)[0]
