"""``pad_to`` of the JAX quantize primitives on the CPU (issue 19.1): quantize / gelu_quantize /
dgelu_quantize write their codes and transpose padded to multiples of ``pad_to`` (FP8 zeros in
the pad, outside the amax), byte for byte what the host reference ``fusedfp8.quantize(...,
pad_to=)`` writes (impl 'jnp' on the whole grid, 'auto' on a few cases: on the CPU it runs the same
jax.numpy function); the kernel branch (traced beside the jax.numpy one by impl='auto', on the whole
grid) declares the same padded shapes; a bad ``pad_to`` is refused by name before
anything is traced; the weight cache's ``quantize_weight(pad_to=16)``. The GPU kernels against
this path are test_jax_kernels.py (the ragged tests: no pad of FP8 bytes in the compiled HLO)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedfp8
from fusedfp8 import ops
from fusedfp8.jax import functional as F
from fusedfp8.jax import meta as JM
from fusedfp8.jax import primitives as P
from fusedfp8.state import ScalingState
from support import shapes as S

RECIPE = fusedfp8.DelayedScaling(amax_history_len=5)
CPU_IMPLS = ("auto", "jnp")  # what runs on the CPU (the others are the CUDA kernels)
OPS = {  # op: (index of the state, the primitive, the host reference), x-only ops take dy=None
    "identity": (0, lambda dy, x, st, **kw: P.quantize(x, st, 0, RECIPE, **kw),
                 lambda dy, x, slot, **kw: ops.quantize(x, slot, **kw)),
    "gelu": (1, lambda dy, x, st, **kw: P.gelu_quantize(x, st, 1, RECIPE, **kw),
             lambda dy, x, slot, **kw: ops.gelu_quantize(x, slot, **kw)),
    "dgelu": (2, lambda dy, x, st, **kw: P.dgelu_quantize(dy, x, st, 2, RECIPE, dbias=True, **kw),
              lambda dy, x, slot, **kw: ops.dgelu_quantize(dy, x, slot, dbias=True, **kw)),
}


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


_RUNS = {}


def _runs(op, impl, dy, x, pads) -> dict:
    """pad_to -> (Quantized, new state) of a first step under jit, for every pad_to of ``pads`` and
    1 (the unpadded quantization the padded cases are compared with), from ONE jitted program per
    op, impl and input bytes: the pad_to cases draw the same data from the seeded rng, and in one
    program the emulated activation is compiled, and run, once for all of them (a program per
    case compiled it once each: the grid's XLA:CPU compiles were most of this file's time)."""
    key = (op, impl, x.shape, x.tobytes(), dy.tobytes())
    if key not in _RUNS:
        _, prim, _ = OPS[op]
        st = ScalingState.create((False, False, True), RECIPE, like=jnp.zeros(1))
        pads = sorted({1, *pads})
        outs = jax.jit(lambda dy, x, s: [prim(dy, x, s, transpose=True, pad_to=p, impl=impl) for p in pads])(
            jnp.asarray(dy), jnp.asarray(x), st)
        _RUNS[key] = dict(zip(pads, outs))
    return _RUNS[key]


GRID_SHAPES = S.params("ragged-odd-tail-33x17", "aligned-64x128", "ragged-1x1", "ragged-0x16", "ragged-3d-3x5x7")
# impl='auto' on the CPU runs the jax.numpy branch of lax.platform_dependent: the same function as
# impl='jnp'. So the grid computes with 'jnp' only; what 'auto' adds, the CUDA branch traced beside it
# with the same result types, is checked on the whole grid without compiling
# (test_auto_traces_both_branches_with_the_padded_types), and 'auto' computes on these cases:
AUTO_RUNS = {("ragged-odd-tail-33x17", 16), ("ragged-3d-3x5x7", 7), ("aligned-64x128", 1)}


PADS = (1, 16, 7)
GRID = [(shape, pad_to, op) for shape in GRID_SHAPES for pad_to in PADS for op in OPS]


@pytest.mark.parametrize("shape, pad_to, op, impl", [
    pytest.param(shape, pad_to, op, impl, id=f"{shape.id}-{pad_to}-{op}-{impl}") for shape, pad_to, op in GRID
    for impl in CPU_IMPLS if impl == "jnp" or (shape.id, pad_to) in AUTO_RUNS])
def test_padded_quantization_matches_the_host_reference(shape, pad_to, op, impl, rng):
    """A first step (current scaling: the scale from the tensor's own amax) under jit against the
    host reference on a NumPy state: q and q_t padded, dbias (never padded), scale_inv and every
    array of the new state byte for byte; the amax is the unpadded tensor's."""
    shape_id, shape = shape.id, shape.values[0]
    index, _, host = OPS[op]
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    dy = (rng.standard_normal(shape) * 2).astype(np.float32)
    st_np = ScalingState.create((False, False, True), RECIPE)
    runs = _runs(op, impl, dy, x, PADS if impl == "jnp" else [p for s, p in AUTO_RUNS if s == shape_id])
    r, new = runs[pad_to]
    want = host(dy, x, st_np.slot(index, RECIPE), transpose=True, pad_to=pad_to)
    assert r.data.shape == want.data.shape and r.data_t.shape == want.data_t.shape
    np.testing.assert_array_equal(u8(r.data), u8(want.data))
    np.testing.assert_array_equal(u8(r.data_t), u8(want.data_t))
    np.testing.assert_array_equal(np.asarray(r.scale_inv), want.scale_inv)
    if op == "dgelu":
        assert r.dbias.shape == (shape[-1],)
        tol = 1e-5 * float(np.abs(want.dbias).max(initial=0))  # column sums in another order (cancellation)
        np.testing.assert_allclose(np.asarray(r.dbias), want.dbias, rtol=1e-5, atol=tol)
    for name in ("amax_history", "scale", "scale_inv", "updates"):
        np.testing.assert_array_equal(np.asarray(getattr(new, name)), getattr(st_np, name), err_msg=name)
    unpadded = runs[1][0]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    assert float(r.amax) == float(unpadded.amax)
    q2 = u8(r.data).reshape(-1, u8(r.data).shape[-1])  # pad_to 1: x's shape
    np.testing.assert_array_equal(q2[:rows, :cols], u8(unpadded.data).reshape(rows, cols))
    assert not q2[rows:].any() and not q2[:, cols:].any()  # FP8 zeros in the pad


def _kernel_branch_shapes(fn, *args) -> list:
    """The result shapes of the quantize buffer_callback that impl='auto' traces for CUDA beside
    the jax.numpy branch (in the jaxpr on the CPU too)."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name in ("buffer_callback", "ffi_call"):
                found.append([tuple(a.shape) for a in e.params["result_avals"]])
            for p in e.params.values():
                for q in p if isinstance(p, (list, tuple)) else [p]:
                    inner = getattr(q, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("shape, pad_to, op", [pytest.param(*case, id=f"{case[0].id}-{case[1]}-{case[2]}")
                                               for case in GRID])
def test_auto_traces_both_branches_with_the_padded_types(shape, pad_to, op):
    """impl='auto' traced (not compiled) on every case of the grid: lax.platform_dependent takes the
    CUDA branch only if its results have the jax.numpy branch's types, and the quantize call of the
    CUDA branch declares the padded q and q_t of the host reference's shapes."""
    shape = shape.values[0]
    _, prim, _ = OPS[op]
    st = ScalingState.create((False, False, True), RECIPE, like=jnp.zeros(1))
    x = jnp.zeros(shape, jnp.bfloat16)

    def fn(dy, x, st):
        return prim(dy, x, st, transpose=True, pad_to=pad_to, impl="auto")

    r, _ = jax.eval_shape(fn, x, x, st)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    prows, pcols = -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to
    q_shape = tuple(shape) if pad_to == 1 else (prows, pcols)
    assert (r.data.shape, r.data_t.shape) == (q_shape, (pcols, prows))
    (kernel,) = _kernel_branch_shapes(fn, x, x, st)
    assert kernel[:2] == [q_shape, (pcols, prows)]


@pytest.mark.parametrize("pad_to", [1, 16])
def test_abstract_shapes_of_every_branch(pad_to):
    """jax.eval_shape of dgelu_quantize (transpose, dbias) on a (3, 5, 7) input: q is the (15, 7)
    view padded, q_t its transpose, dbias (7,); the CUDA branch's buffer_callback declares the
    same q, q_t, dbias and the dbias workspaces of the padded tiling."""
    st = ScalingState.create((False, False, True), RECIPE, like=jnp.zeros(1))
    x = jax.ShapeDtypeStruct((3, 5, 7), jnp.bfloat16)

    def fn(dy, x, st):
        return P.dgelu_quantize(dy, x, st, 2, RECIPE, transpose=True, dbias=True, pad_to=pad_to)

    r, _ = jax.eval_shape(fn, x, x, st)
    q_shape = (3, 5, 7) if pad_to == 1 else (16, 16)
    t_shape = (7, 15) if pad_to == 1 else (16, 16)
    assert (r.data.shape, r.data_t.shape, r.dbias.shape) == (q_shape, t_shape, (7,))
    assert r.data.dtype == jnp.float8_e5m2 or r.data.dtype == jnp.float8_e4m3fn
    from fusedfp8 import launch

    part, counters = launch.dbias_workspace(15, 7, pad_to)
    (kernel,) = _kernel_branch_shapes(fn, jnp.zeros((3, 5, 7), jnp.bfloat16), jnp.zeros((3, 5, 7), jnp.bfloat16), st)
    assert kernel[:5] == [q_shape, t_shape, (7,), (part[0] * part[1],), (counters,)]


BAD_PAD_TO = [0, -16, True, 1.5, "16", None]


@pytest.mark.parametrize("pad_to", BAD_PAD_TO, ids=repr)
@pytest.mark.parametrize("op", list(OPS))
def test_a_bad_pad_to_is_refused_by_name_before_anything_runs(op, pad_to, monkeypatch):
    _, prim, _ = OPS[op]
    st = ScalingState.create((False, False, True), RECIPE, like=jnp.zeros(1))
    traced = []
    monkeypatch.setattr(P, "_run", lambda *a: traced.append(a))  # nothing may be traced or run
    with pytest.raises(ValueError, match=r"pad_to must be a positive int \(1: no padding; 16: what FP8 GEMMs "
                                         r"need\); got " + repr(pad_to).replace(".", r"\.")):
        prim(jnp.ones((4, 4)), jnp.ones((4, 4)), st, pad_to=pad_to)
    assert not traced


# ---- the weight cache: quantize_weight(pad_to=16) -------------------------------------------------
@pytest.mark.parametrize("mkn", [(30, 20, 36), (32, 24, 48), (32, 32, 48)], ids=str)
def test_quantize_weight_pad_to_16_is_the_padded_copy_and_fp8_dot_gives_the_same_bytes(mkn, rng):
    m, k, n = mkn
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.1, jnp.bfloat16)
    meta = JM.fresh_meta(RECIPE)
    q1, q16 = jax.jit(lambda w, meta: [F.quantize_weight(w, meta, RECIPE, pad_to=p) for p in (1, 16)])(w, meta)
    pk, pn = -(-k // 16) * 16, -(-n // 16) * 16
    assert q16.data.shape == (pk, pn) and q16.data_t.shape == (pn, pk)
    np.testing.assert_array_equal(u8(q16.data)[:k, :n], u8(q1.data))
    np.testing.assert_array_equal(u8(q16.data_t)[:n, :k], u8(q1.data_t))
    assert not u8(q16.data)[k:].any() and not u8(q16.data)[:, n:].any() and not u8(q16.data_t)[n:].any()
    assert float(q16.amax) == float(q1.amax) and float(q16.scale_inv[0]) == float(q1.scale_inv[0])

    def grads(x, w, meta, q):
        def loss(x, w, meta):
            return (F.fp8_dot(x, w, meta, RECIPE, fp8_weight=q).astype(jnp.float32) ** 2).sum()

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, meta)

    # the three in one program: one compile (three took most of this test's time)
    want, *got = jax.jit(lambda x, w, meta, qs: [grads(x, w, meta, q) for q in (None, *qs)])(x, w, meta, (q1, q16))
    for g in got:
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want)):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(u8(np.asarray(a).reshape(-1)), u8(np.asarray(b).reshape(-1)))


def test_quantize_weight_refuses_a_bad_pad_to_and_fp8_dot_a_badly_padded_copy(rng):
    w, meta = jnp.asarray(rng.standard_normal((24, 48)), jnp.bfloat16), JM.fresh_meta(RECIPE)
    for bad in (8, 32):
        with pytest.raises(ValueError, match=rf"pad_to must be 1 or 16 \(the padding of fp8_dot's GEMM operands\); "
                                             rf"got {bad}"):
            F.quantize_weight(w, meta, RECIPE, pad_to=bad)
    with pytest.raises(ValueError, match="pad_to must be a positive int"):
        F.quantize_weight(w, meta, RECIPE, pad_to=0)
    q = F.quantize_weight(w, meta, RECIPE, pad_to=16)
    bad = q._replace(data=jnp.pad(q.data, ((0, 16), (0, 0))))
    with pytest.raises(ValueError, match=r"fp8_weight\.data must be float8_e4m3fn of shape \(24, 48\) .*; got "
                                         r"float8_e4m3fn \(48, 48\) \(padded, from quantize_weight\(pad_to=16\): "
                                         r"\(32, 48\)\)"):
        F.fp8_dot(jnp.ones((8, 24), jnp.bfloat16), w, meta, RECIPE, fp8_weight=bad)
