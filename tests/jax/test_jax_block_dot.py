"""The block-scaled FP8 linear in JAX: fusedfp8.jax.block_dot (custom_vjp), fp8_dot and flax's
Fp8DotGeneral under a BlockScaling recipe, and the block-scaled GEMM fusedfp8.jax.gemm.fp8_block_gemm.

On the CPU the forward and both gradients are held against the NumPy definition: each operand
block-quantized by fusedfp8.numerics.block (the bytes the kernels write; w (K, N) is the torch
weight's transpose, so the 128x128 tiles and the 1x128 copies are the same ones), dequantized and
multiplied in float64. The lowering for CUDA is read without a GPU: three block-scaled FFI GEMMs
in the gradient, the block quantizations as FFI launches, no dot_general. On the GPU (marked): the
same against the definition within the split accumulator's allowance."""
from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedfp8
from fusedfp8.jax import functional as F
from fusedfp8.jax import gemm as G
from fusedfp8.numerics import block as B
from support.block import inputs
from support.shim import built as built_shim

RECIPES = {
    "default": fusedfp8.BlockScaling(),
    "1x128w-hybrid-exact": fusedfp8.BlockScaling(weight_block=(1, 128), fp8_format="hybrid",
                                                 power_of_two_scales=False),
}
SHAPES = {"aligned-256x384x128": (256, 384, 128), "ragged-17x300x200": (17, 300, 200),
          "ragged-130x48x49": (130, 48, 49)}
CASES = [("aligned-256x384x128", "default"), ("ragged-17x300x200", "default"),
         ("ragged-17x300x200", "1x128w-hybrid-exact"), ("ragged-130x48x49", "1x128w-hybrid-exact")]


def _deq(data, s, block) -> np.ndarray:
    return B.block_dequantize(np.asarray(data), np.asarray(s), block).astype(np.float64)


def _reference(x, w, g, recipe) -> dict:
    """{name: (float64 value, sum of |products|)} of y = x @ w, dx, dw from the NumPy definition
    (w (K, N): its transposed copy (N, K) is the forward's operand)."""
    fwd, grd, wb = recipe.format_for(False), recipe.format_for(True), recipe.weight_block
    p2 = recipe.power_of_two_scales
    qx = B.block_quantize(x, fwd, (1, 128), p2, True)
    qw = B.block_quantize(w, fwd, wb, p2, True)
    qg = B.block_quantize(g, grd, (1, 128), p2, True)
    pairs = {"y": (_deq(qx.data, qx.scale_inv, (1, 128)), _deq(qw.data_t, qw.scale_inv_t, wb)),
             "dx": (_deq(qg.data, qg.scale_inv, (1, 128)), _deq(qw.data, qw.scale_inv, wb)),
             "dw": (_deq(qx.data_t, qx.scale_inv_t, (1, 128)), _deq(qg.data_t, qg.scale_inv_t, (1, 128)))}
    return {k: (a @ c.T, np.abs(a) @ np.abs(c).T) for k, (a, c) in pairs.items()}


def _close(got, want, scale, what, rtol=1e-5):
    err = np.abs(np.asarray(got, np.float64) - want)
    bad = err > rtol * scale + 1e-30
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {float((err / (scale + 1e-30)).max()):.3g}"


def _operands(shape):
    m, k, n = shape
    return (inputs((m, k), "float32", m + k), inputs((k, n), "float32", n + 1) * np.float32(0.05),
            inputs((m, n), "float32", k + n + 2))


@pytest.mark.parametrize("shape, recipe", [(SHAPES[s], RECIPES[r]) for s, r in CASES], ids=[f"{s}-{r}" for s, r in CASES])
def test_forward_and_gradients_are_the_block_definition(shape, recipe):
    x, w, g = _operands(shape)

    def run(a, b, ct):  # one program: the forward and its VJP
        y, vjp = jax.vjp(lambda a, b: F.block_dot(a, b, recipe), a, b)
        return (y, *vjp(ct))

    y, dx, dw = jax.jit(run)(x, w, g)
    ref = _reference(x, w, g, recipe)
    for got, name in ((y, "y"), (dx, "dx"), (dw, "dw")):
        _close(got, *ref[name], name)
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32


def test_fp8_dot_hands_a_block_recipe_to_block_dot(monkeypatch):
    """fp8_dot(x, w, None, BlockScaling()) is block_dot(x, w, recipe) with its out_dtype and impl;
    fp8_dot_use's second result (the next meta) is None."""
    from fusedfp8.jax import dot as D

    seen = []
    monkeypatch.setattr(D, "block_dot", lambda *a, **k: seen.append((a, k)) or "y")
    r = fusedfp8.BlockScaling(fp8_format="hybrid")
    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    assert F.fp8_dot(x, w, None, r, out_dtype=jnp.bfloat16, impl="jnp") == "y"
    assert F.fp8_dot_use(x, w, None, r) == ("y", None)
    assert seen[0] == ((x, w, r), {"out_dtype": jnp.bfloat16, "impl": "jnp", "fp8_weight": None})


def test_jitted_flax_dense_is_block_dot():
    """nn.Dense(dot_general_cls=Fp8DotGeneral(recipe=BlockScaling)) on a 4-D input gives block_dot's
    bytes, jitted, the value and the kernel's gradient; it declares no state variables."""
    import flax.linen as nn

    from fusedfp8.jax.flax import Fp8DotGeneral

    r = fusedfp8.BlockScaling()
    x, w, _ = _operands((2 * 3 * 5, 130, 48))
    dense = nn.Dense(48, use_bias=False, dot_general_cls=partial(Fp8DotGeneral, recipe=r))
    x4 = jnp.asarray(x).reshape(2, 3, 5, 130)
    assert set(jax.eval_shape(dense.init, jax.random.PRNGKey(0), x4)) == {"params"}

    def both(b):  # one program
        return [jax.value_and_grad(lambda b: (f(b) ** 2).sum())(b)
                for f in (lambda b: F.block_dot(jnp.asarray(x), b, r),
                          lambda b: dense.apply({"params": {"kernel": b}}, x4).reshape(30, 48))]

    want, got = jax.jit(both)(w)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bf16_operands_give_bf16_results():
    x, w, _ = _operands((32, 256, 64))
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)

    def run(a, b):
        y, vjp = jax.vjp(lambda a, b: F.block_dot(a, b), a, b)
        return (y, *vjp(jnp.ones_like(y)))

    y, dx, dw = jax.eval_shape(run, xb, wb)  # (the dtypes: nothing compiled)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    assert jax.eval_shape(lambda a, b: F.block_dot(a, b, out_dtype=jnp.float32), xb, wb).dtype == jnp.float32


@pytest.mark.parametrize("call, error, message", [
    (lambda x, w: F.block_dot(x, w, fusedfp8.DelayedScaling()), TypeError, "recipe must be a fusedfp8.BlockScaling"),
    (lambda x, w: F.block_dot(x.astype(jnp.int32), w), TypeError, "x must be float32, float16 or bfloat16"),
    (lambda x, w: F.block_dot(x[0], w), ValueError, "x must be 2-D"),
    (lambda x, w: F.block_dot(x, w[:-1]), ValueError, "must agree on K"),
    (lambda x, w: F.block_dot(x, w, out_dtype=jnp.int8), TypeError, "out_dtype must be"),
    (lambda x, w: F.fp8_dot(x, w, {"scale": 1}, fusedfp8.BlockScaling()), ValueError, "meta must be None under"),
    (lambda x, w: F.fp8_dot(x, w, None, fusedfp8.BlockScaling(), axis_name="d"), ValueError,
     "axis_name must be None under"),
], ids=["recipe", "x-int", "x-1d", "k", "out-dtype", "meta", "axis_name"])
def test_bad_arguments_are_refused_by_name(call, error, message):
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    with pytest.raises(error, match=message):
        call(x, w)


# ---- the block-scaled GEMM --------------------------------------------------------------------------
def _quantized(rows, k, block, fmt="e4m3", seed=0):
    x = inputs((rows, k), "float32", seed)
    return B.block_quantize(x, fmt, (block, 128), True)


@pytest.mark.parametrize("blocks", [(1, 128), (128, 1), (1, 1)], ids=["1x128-128x128", "128x128-1x128", "1x128-1x128"])
def test_the_gemm_emulation_reads_the_scale_layout(blocks):
    qa, qb = _quantized(48, 300, blocks[0], seed=1), _quantized(40, 300, blocks[1], "e5m2", seed=2)
    bias = jnp.linspace(-1, 1, 40, dtype=jnp.float32)
    y = G.fp8_block_gemm(jnp.asarray(qa.data), jnp.asarray(qb.data), qa.scale_inv, qb.scale_inv, *blocks,
                         jnp.float32, bias=bias)
    a, c = _deq(qa.data, qa.scale_inv, (blocks[0], 128)), _deq(qb.data, qb.scale_inv, (blocks[1], 128))
    _close(y, a @ c.T + np.asarray(bias, np.float64), np.abs(a) @ np.abs(c).T + 1, "y")


@pytest.mark.parametrize("blocks", [(1, 128), (128, 1), (1, 1)], ids=["1x128-128x128", "128x128-1x128", "1x128-1x128"])
def test_a_ragged_gemm_padded_to_16_keeps_its_product(blocks):
    """The CUDA GEMM's operands for a ragged (M, N, K) = (130, 40, 300): padded to multiples of 16
    with FP8 zeros, the scale arrays those of the padded shapes (1x128: 1s in the new columns), the
    bias with zeros; the emulated product of the padded operands, sliced, is the unpadded one's."""
    from fusedfp8.numerics.block import scale_shape

    qa, qb = _quantized(130, 300, blocks[0], seed=3), _quantized(40, 300, blocks[1], "e5m2", seed=4)
    bias = jnp.linspace(-1, 1, 40, dtype=jnp.float32)
    pa, pb, psa, psb, pbias = G._padded_block_operands(jnp.asarray(qa.data), jnp.asarray(qb.data), qa.scale_inv,
                                                       qb.scale_inv, *blocks, bias)
    assert pa.shape == (144, 304) and pb.shape == (48, 304) and pbias.shape == (48,)
    assert psa.shape == scale_shape(144, 304, (blocks[0], 128)) and psb.shape == scale_shape(48, 304, (blocks[1], 128))
    assert not np.asarray(pa[130:]).view(np.uint8).any() and not np.asarray(pb[:, 300:]).view(np.uint8).any()
    y = G.fp8_block_gemm(pa, pb, psa, psb, *blocks, jnp.float32, bias=pbias, impl="jnp")[:130, :40]
    a, c = _deq(qa.data, qa.scale_inv, (blocks[0], 128)), _deq(qb.data, qb.scale_inv, (blocks[1], 128))
    _close(y, a @ c.T + np.asarray(bias, np.float64), np.abs(a) @ np.abs(c).T + 1, "y")


@pytest.mark.parametrize("change, error, message", [
    (dict(blocks=(128, 128)), ValueError, "not both 128"),
    (dict(blocks=(1, 64)), ValueError, "a_block and b_block must be 1"),
    (dict(sa=np.ones((3, 4), np.float32)), ValueError, r"scale_inv_a must be a float32 array of shape \(3, 48\)"),
    (dict(sb=np.ones((1, 1), np.float64)), ValueError, "scale_inv_b must be a float32 array"),
    (dict(a=np.ones((48, 300), np.float32)), TypeError, "a must be a 2-D float8"),
    (dict(out=jnp.int8), TypeError, "out_dtype must be one of"),
    (dict(bias=jnp.ones(41, jnp.float32)), ValueError, r"bias must be None or a \(40,\) float32 array"),
], ids=["both-128", "block-64", "scale-a", "scale-b-dtype", "a-f32", "out", "bias"])
def test_the_gemm_refuses_bad_arguments_by_name(change, error, message):
    qa, qb = _quantized(48, 300, 1), _quantized(40, 300, 128)
    args = dict(a=jnp.asarray(qa.data), b=jnp.asarray(qb.data), sa=qa.scale_inv, sb=qb.scale_inv, blocks=(1, 128),
                out=jnp.float32, bias=None)
    args.update(change)
    with pytest.raises(error, match=message):
        G.fp8_block_gemm(args["a"], args["b"], args["sa"], args["sb"], *args["blocks"], args["out"],
                         bias=args["bias"])


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lowering for CUDA without a GPU: the FFI launcher and the block GEMM's trace-time decisions forced."""
    from fusedfp8.jax import primitives as JP

    built_shim("xla")
    monkeypatch.setattr(JP, "_auto_backend", lambda: "ffi")
    monkeypatch.setattr(G, "_has_gpu", lambda: True)
    monkeypatch.setattr(G, "_block_ready", lambda: (True, "forced"))
    monkeypatch.setattr(G, "_prepared", lambda code: "")


def test_on_cuda_the_gradient_lowers_to_three_block_gemms(cuda_lowering):
    """block_dot's forward and both gradients lowered for CUDA (read without a GPU; the trace-time
    decisions forced): three calls of fusedfp8_fp8_gemm_block with their block modes, the
    quantizations as fusedfp8_launch calls, no dot_general; on the CPU no custom call at all."""
    r = fusedfp8.BlockScaling()
    x, w = jnp.ones((300, 260), jnp.bfloat16), jnp.ones((260, 200), jnp.bfloat16)
    loss = jax.grad(lambda a, b: (F.block_dot(a, b, r).astype(jnp.float32) ** 2).sum(), argnums=(0, 1))
    text = jax.jit(loss).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "@fusedfp8_fp8_gemm_block" in ln]
    assert len(calls) == 3, calls
    modes = sorted(tuple(int(v) for v in re.search(r"a_block = (\d+) : i64, b_block = (\d+)", c).groups())
                   for c in calls)
    assert modes == [(1, 1), (1, 128), (1, 128)], modes  # wgrad 1x128 x 1x128; forward and dgrad x 128x128
    assert "dot_general" not in text and text.count("@fusedfp8_launch") == 3
    cpu = jax.jit(loss).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "custom_call" not in cpu


@pytest.mark.parametrize("missing", ["shim", "cublaslt-algorithm"])
def test_a_gpu_host_without_the_block_gemm_still_runs_the_cpu_program(monkeypatch, missing):
    """On a GPU host where the block-scaled GEMM cannot be had (no shim, or cuBLASLt without the
    algorithm: a GPU other than Hopper), the gradient program lowered for the CPU runs the
    emulation (the CUDA branch, which platform_dependent traces too, no longer raises at trace
    time); the CUDA branch holds a host callback in place of each of the three GEMMs, and that
    callback raises the reason when it runs."""
    from fusedfp8.jax import primitives as JP

    monkeypatch.setattr(JP, "_auto_backend", lambda: "ffi")
    monkeypatch.setattr(G, "_has_gpu", lambda: True)
    if missing == "shim":
        monkeypatch.setattr(G, "_block_ready", lambda: (False, "the shim is not in use: pretended"))
        why = "needs the compiled shim's cuBLASLt GEMM, which is not available: the shim is not in use: pretended"
    else:
        monkeypatch.setattr(G, "_block_ready", lambda: (True, "forced"))
        monkeypatch.setattr(G, "_prepared", lambda code: "cuBLASLt has no algorithm (pretended)")
        why = "cannot run: cuBLASLt has no algorithm (pretended)"
    r = fusedfp8.BlockScaling()
    x = jnp.asarray(inputs((40, 260), "float32", 5))
    w = jnp.asarray(inputs((260, 72), "float32", 6) * np.float32(0.05))

    def loss(a, b, impl="auto"):
        return (F.block_dot(a, b, r, impl=impl) ** 2).sum()

    got = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(lowering_platforms=("cpu",)).compile()(x, w)
    want = jax.jit(jax.grad(partial(loss, impl="jnp"), argnums=(0, 1)))(x, w)
    for g, e in zip(got, want):
        assert np.array_equal(np.asarray(g), np.asarray(e))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))  # (a host callback cannot be lowered for
    assert jaxpr.count("pure_callback") == 3 and "gemm_block" not in jaxpr  # CUDA on a host without a GPU)
    with pytest.raises(Exception, match=re.escape(why)):  # the callback's error, as XLA passes it on
        jax.block_until_ready(jax.jit(lambda s: G._fails_when_run(f"fusedfp8: {why}", (2, 3), "bfloat16", s))(
            jnp.ones((1, 3), jnp.float32)))


def test_flax_fp8_mlp_under_block_scaling_is_block_mlp_with_the_layernorm_fused():
    """flax Fp8MLP(recipe=BlockScaling()): nn.LayerNorm's and nn.Dense's parameter names, no state
    variables, bit for bit block_mlp with the LayerNorm fused (its scale and bias as ln_weight /
    ln_bias), and with fuse_layernorm=False nn.LayerNorm -> block_mlp (one jitted program)."""
    import flax.linen as nn

    from fusedfp8.jax.flax import Fp8MLP

    r = fusedfp8.BlockScaling(weight_block=(1, 128))
    m = Fp8MLP(ffn=260, recipe=r, dtype=jnp.bfloat16)
    unfused = Fp8MLP(ffn=260, recipe=r, dtype=jnp.bfloat16, fuse_layernorm=False)
    x = jnp.asarray(inputs((21, 130), "float32", 4), jnp.bfloat16).reshape(3, 7, 130)
    shapes = jax.eval_shape(m.init, jax.random.PRNGKey(0), x)
    assert set(shapes) == {"params"} and set(shapes["params"]) == {"norm", "fc1", "fc2"}
    assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(
        jax.eval_shape(unfused.init, jax.random.PRNGKey(0), x))
    rng = np.random.default_rng(5)  # values for those parameters (nothing compiled for an init)
    v = jax.tree_util.tree_map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.1 + (s.shape == (130,)),
                                                     s.dtype), shapes)

    def both(p):
        q, bf = p["params"], jnp.bfloat16
        weights = (q["fc1"]["kernel"], q["fc1"]["bias"].astype(bf), q["fc2"]["kernel"], q["fc2"]["bias"].astype(bf))
        want = F.block_mlp(x.reshape(21, 130), *weights, r, out_dtype=bf, ln_weight=q["norm"]["scale"],
                           ln_bias=q["norm"]["bias"], ln_eps=1e-6)
        h = nn.LayerNorm(epsilon=1e-6, dtype=jnp.bfloat16).apply({"params": q["norm"]}, x).reshape(21, 130)
        want_unfused = F.block_mlp(h, *weights, r, out_dtype=bf)
        return m.apply(p, x), want.reshape(3, 7, 130), unfused.apply(p, x), want_unfused.reshape(3, 7, 130)

    got, want, got_unfused, want_unfused = jax.jit(both)(v)
    assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got), np.asarray(want))
    assert np.array_equal(np.asarray(got_unfused), np.asarray(want_unfused))
    with pytest.raises(ValueError, match="Fp8MLP.axis_name must be None under BlockScaling"):
        Fp8MLP(ffn=260, recipe=r, axis_name="d").init(jax.random.PRNGKey(0), x)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _definition_gelu(z, approximate):
    """gelu and its backward as the kernels compute them (float32, the jax.numpy twin of the
    NumPy definition, bit for bit)."""
    from fusedfp8.numerics.block_jnp import activation

    return activation("gelu", z, None, approximate)


def _dg_fwd(z, approximate):
    return _definition_gelu(z, approximate), z


def _dg_bwd(approximate, z, g):
    from fusedfp8.numerics.block_jnp import activation

    return (activation("dgelu", g, z, approximate),)


_definition_gelu.defvjp(_dg_fwd, _dg_bwd)


def test_block_mlp_is_its_composition_with_the_gelu_fused(shape=(17, 300, 200), approximate="tanh"):
    """block_mlp in float32: bit for bit block_dot -> + b1 -> the kernels' gelu -> block_dot -> + b2,
    the output and the gradients of h, w1 and w2; the bias gradients (the kernels' column sums)
    within float32 rounding of the composition's. fp8_mlp under BlockScaling with ln_eps (the
    LayerNorm fused into the quantization of h) is block_mlp on the kernels' LayerNorm of h (the
    jax.numpy twin's float32 y), output and weight gradients bit for bit, and the gradients of x
    and of the LayerNorm's parameters are the LayerNorm's backward of that h-gradient. One jitted
    program, on a ragged shape (every GEMM dimension padded); both gelus' bytes:
    test_block_fused_ops.py."""
    from fusedfp8.jax.layernorm import layernorm_backward
    from fusedfp8.numerics.jnp_layernorm import layernorm_f32

    m, k, f = shape
    r = fusedfp8.BlockScaling(fp8_format="hybrid")
    h = jnp.asarray(inputs((m, k), "float32", 1))
    w1 = jnp.asarray(inputs((k, f), "float32", 2) * np.float32(0.05))
    w2 = jnp.asarray(inputs((f, k), "float32", 3) * np.float32(0.05))
    b1, b2 = jnp.linspace(-1, 1, f, dtype=jnp.float32), jnp.linspace(-0.5, 0.5, k, dtype=jnp.float32)
    lw, lb = jnp.linspace(0.5, 1.5, k, dtype=jnp.float32), jnp.full((k,), 0.25, jnp.float32)

    def composition(h, w1, b1, w2, b2):
        z = F.block_dot(h, w1, r) + b1
        return F.block_dot(_definition_gelu(z, approximate), w2, r) + b2

    def fused(h, w1, b1, w2, b2):
        return F.block_mlp(h, w1, b1, w2, b2, r, approximate=approximate)

    def with_ln(h, w1, b1, w2, b2, lw, lb):
        return F.fp8_mlp(h, w1, b1, w2, b2, None, None, r, approximate=approximate, ln_weight=lw, ln_bias=lb,
                         ln_eps=1e-5)

    def with_y(fn, *args):
        return jax.value_and_grad(lambda *a: (((y := fn(*a)) ** 2).sum() / 2, y), argnums=tuple(range(len(args))),
                                  has_aux=True)(*args)

    def program(h, w1, b1, w2, b2, lw, lb):
        hn, mean, rstd = layernorm_f32(h, lw, lb, 1e-5)
        (_, y_n), g_n = with_y(fused, hn, w1, b1, w2, b2)
        return (with_y(fused, h, w1, b1, w2, b2), with_y(composition, h, w1, b1, w2, b2),
                with_y(with_ln, h, w1, b1, w2, b2, lw, lb), (y_n, g_n, layernorm_backward(g_n[0], h, mean, rstd, lw, lb)))

    ((lg, yg), gg), ((lw_, yw), gw), ((_, y_ln), g_ln), (y_n, g_n, ln_bwd) = jax.jit(program)(h, w1, b1, w2, b2, lw, lb)
    assert np.array_equal(np.asarray(yg), np.asarray(yw)) and float(lg) == float(lw_)
    for name, a, b in zip(("dh", "dw1", "db1", "dw2", "db2"), gg, gw):
        a, b = np.asarray(a), np.asarray(b)
        if name.startswith("db"):
            assert np.allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max())), name
        else:
            assert np.array_equal(a, b), name
    assert np.array_equal(np.asarray(y_ln), np.asarray(y_n))
    for name, a, b in zip(("dx", "dw1", "db1", "dw2", "db2", "dln_w", "dln_b"), g_ln, (ln_bwd[0], *g_n[1:], *ln_bwd[1:])):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name


def test_fp8_mlp_under_block_scaling_without_layernorm_is_block_mlp():
    """fp8_mlp's block route without ln_eps traces to block_mlp's program, forward and gradients (the
    same jaxpr; the values: test_block_mlp_is_its_composition_with_the_gelu_fused, through the
    LayerNorm form)."""
    r = fusedfp8.BlockScaling(fp8_format="hybrid")
    ops = (jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.zeros(16), jnp.ones((16, 8)), jnp.zeros(8))

    def program(mlp):
        return jax.make_jaxpr(jax.value_and_grad(lambda *a: mlp(*a).sum(), argnums=(0, 1, 2, 3, 4)))(*ops)

    routed = program(lambda *a: F.fp8_mlp(*a, None, None, r, approximate="none"))
    direct = program(lambda *a: F.block_mlp(*a, r, approximate="none"))
    other = program(lambda *a: F.block_mlp(*a, fusedfp8.BlockScaling(), approximate="none"))
    assert str(routed) == str(direct) and str(direct) != str(other)  # (the gradients' format shows)


def test_block_mlp_refuses_bad_arguments_by_name():
    r = fusedfp8.BlockScaling()
    h, w1, w2 = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16, 8))
    b1, b2 = jnp.zeros(16), jnp.zeros(8)
    with pytest.raises(ValueError, match=r"^shapes do not chain"):
        F.block_mlp(h, w1, b1, jnp.ones((15, 8)), b2, r)
    with pytest.raises(ValueError, match=r"^b1 must have shape \(16,\)"):
        F.block_mlp(h, w1, jnp.zeros(15), w2, b2, r)
    with pytest.raises(ValueError, match=r"^approximate must be"):
        F.block_mlp(h, w1, b1, w2, b2, r, approximate="fast")
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.BlockScaling"):
        F.block_mlp(h, w1, b1, w2, b2, fusedfp8.DelayedScaling())
    with pytest.raises(TypeError, match=r"^w2 must be float32, float16 or bfloat16; got int32"):
        F.block_mlp(h, w1, b1, w2.astype(jnp.int32), b2, r)
    with pytest.raises(ValueError, match=r"^meta1 must be None under BlockScaling"):
        F.fp8_mlp(h, w1, b1, w2, b2, (jnp.zeros(3),), None, r)


def test_on_cuda_the_block_mlp_gradient_lowers_to_six_block_gemms_and_six_launches(cuda_lowering):
    """block_mlp's forward and gradients lowered for CUDA (read without a GPU): six block-scaled GEMM
    calls (the two forward ones with the bias epilogue), six fusedfp8_launch calls (h, w1, w2, the
    fused gelu; the output gradient with dbias, the fused dgelu with dbias), no dot_general and no
    XLA reduction for a bias gradient."""
    r = fusedfp8.BlockScaling()
    h, w1, w2 = jnp.ones((300, 260), jnp.bfloat16), jnp.ones((260, 512), jnp.bfloat16), jnp.ones((512, 260))
    b1, b2 = jnp.zeros(512, jnp.bfloat16), jnp.zeros(260, jnp.bfloat16)
    loss = jax.grad(lambda *a: (F.block_mlp(*a, r).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2, 3, 4))
    text = jax.jit(loss).trace(h, w1, b1, w2, b2).lower(lowering_platforms=("cuda",)).as_text()
    gemms = [ln for ln in text.splitlines() if "@fusedfp8_fp8_gemm_block" in ln]
    assert len(gemms) == 6 and sum("@fusedfp8_fp8_gemm_block_bias" in c for c in gemms) == 2, gemms
    assert "dot_general" not in text and text.count("@fusedfp8_launch") == 6
    assert "stablehlo.tanh" not in text and "erf" not in text.replace("@fusedfp8", "")


# ---- the weight cache (quantize_weight under BlockScaling) ----------------------------------------------
def _same_up_to_rounding(got, want, rtol=2.0 ** -20):
    """Every leaf of ``got`` within ``rtol`` of the largest magnitude of ``want``'s (float32 sums in
    another order), and of the same shape and dtype."""
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.abs(a.astype(np.float64) - b).max() <= rtol * max(float(np.abs(b).max()), 1e-30)



@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_the_weight_cache_is_the_weights_block_quantization(recipe):
    """quantize_weight(w, None, BlockScaling) is block_quantize(w, weight=True, transpose=True), with
    pad_to=16 the padded one, and a cached copy padded later (padded_weight: the GEMMs' operands)
    the same bytes and scales as the padded one, for both weight blocks."""
    from fusedfp8.jax import block as JB
    from fusedfp8.jax.block_dot import padded_weight

    w = jnp.asarray(_operands((17, 300, 200))[1])
    q, q16 = F.quantize_weight(w, None, recipe), F.quantize_weight(w, None, recipe, pad_to=16)
    for got, want in ((q, JB.block_quantize(w, recipe, weight=True, transpose=True)),
                      (q16, JB.block_quantize(w, recipe, weight=True, transpose=True, pad_to=16)),
                      (padded_weight(q, recipe, 16), q16)):
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or np.array_equal(np.asarray(a), np.asarray(b)))


def test_the_weight_cache_gives_the_same_results_and_gradients():
    """fp8_dot with a cached weight (an unpadded copy of a ragged one: padded in the call, which gives
    the padded copy's bytes: the test above), and block_mlp with a pair of them (aligned weights that 20 tokens pad), give the outputs and gradients of quantizing
    the weights in the call: the same FP8 operands, so within the float32 rounding of the CPU's
    emulated GEMM (XLA's dot sums a program's operands in its own order). One jitted program."""
    recipe = RECIPES["1x128w-hybrid-exact"]
    x, w, _ = _operands((17, 300, 200))
    h = jnp.asarray(inputs((20, 256), "float32", 8))
    w1, w2 = (jnp.asarray(inputs(sh, "float32", i) * np.float32(0.05)) for i, sh in ((9, (256, 384)), (10, (384, 256))))
    b1, b2 = jnp.zeros(384), jnp.zeros(256)

    def program(x, w, h, w1, b1, w2, b2):
        def dot(fw):
            return jax.value_and_grad(lambda a, b: (F.fp8_dot(a, b, None, recipe, fp8_weight=fw) ** 2).sum(),
                                      argnums=(0, 1))(x, w)

        def mlp(fws):
            return jax.value_and_grad(lambda *a: (F.block_mlp(*a, recipe, fp8_weights=fws) ** 2).sum(),
                                      argnums=(0, 1, 2, 3, 4))(h, w1, b1, w2, b2)

        qs = (F.quantize_weight(w1, None, recipe), F.quantize_weight(w2, None, recipe))
        return dot(None), dot(F.quantize_weight(w, None, recipe)), mlp(None), mlp(qs)

    want, got, want_mlp, got_mlp = jax.jit(program)(jnp.asarray(x), jnp.asarray(w), h, w1, b1, w2, b2)
    _same_up_to_rounding(got, want)
    _same_up_to_rounding(got_mlp, want_mlp)


def test_flax_quantize_weights_under_block_scaling():
    """flax.quantize_weights under BlockScaling: each linear's block-quantized weight in the
    'fp8_weights' collection (an Fp8DotGeneral Dense's and Fp8MLP's two), the weight's block
    quantization; applied with it, Fp8MLP gives the same output and gradients (within the emulated
    GEMM's float32 rounding) and the Dense the same output."""
    import flax.linen as nn

    from fusedfp8.jax import block as JB
    from fusedfp8.jax.flax import FP8_WEIGHTS, Fp8DotGeneral, Fp8MLP, quantize_weights

    r = fusedfp8.BlockScaling()
    mlp, dense = Fp8MLP(ffn=256, recipe=r), nn.Dense(130, dot_general_cls=partial(Fp8DotGeneral, recipe=r))
    x = jnp.asarray(inputs((24, 128), "float32", 11))
    rng = np.random.default_rng(6)

    def values(m):
        return jax.tree_util.tree_map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.05, s.dtype),
                                      jax.eval_shape(m.init, jax.random.PRNGKey(0), x))

    vm, vd = values(mlp), values(dense)

    def program(vm, vd):
        cm, cd = quantize_weights(mlp.apply, vm, x), quantize_weights(dense.apply, vd, x)
        loss = jax.value_and_grad(lambda p, c: (mlp.apply({**p, **c}, x) ** 2).sum())
        return (cm, cd, loss(vm, {}), loss(vm, {FP8_WEIGHTS: cm}), dense.apply(vd, x),
                dense.apply({**vd, FP8_WEIGHTS: cd}, x))

    cm, cd, want, got, want_d, got_d = jax.jit(program)(vm, vd)
    assert set(cm) == {"fc1", "fc2"} and set(cm["fc1"]) == {"data", "scale_inv", "data_t", "scale_inv_t"}
    (cd,) = jax.tree_util.tree_leaves(cd, is_leaf=lambda d: isinstance(d, dict) and "data" in d)  # (its dot's scope)
    q = JB.block_quantize(vd["params"]["kernel"], r, weight=True, transpose=True)
    for name in ("data", "scale_inv", "data_t", "scale_inv_t"):
        assert np.array_equal(np.asarray(cd[name]), np.asarray(getattr(q, name))), name
    _same_up_to_rounding(got, want)
    _same_up_to_rounding(got_d, want_d)


def test_a_wrong_cached_weight_is_refused_by_name():
    r = fusedfp8.BlockScaling()
    x, w = jnp.ones((16, 256)), jnp.ones((256, 128))
    q = F.quantize_weight(w, None, r)
    with pytest.raises(TypeError, match=r"^fp8_weight must be None or the BlockQuantized"):
        F.fp8_dot(x, w, None, r, fp8_weight=tuple(q))
    with pytest.raises(ValueError, match=r"^fp8_weight\.data must have shape \(256, 128\)"):
        F.block_dot(x, w, r, fp8_weight=F.quantize_weight(jnp.ones((256, 144)), None, r))
    with pytest.raises(ValueError, match=r"^fp8_weight\.scale_inv must be float32 of shape \(2, 4\)"):
        F.block_dot(x, w, r, fp8_weight=F.quantize_weight(w, None, fusedfp8.BlockScaling(weight_block=(1, 128))))
    with pytest.raises(ValueError, match=r"^fp8_weight\.data must be float8_e4m3fn"):
        F.block_dot(x, w, r, fp8_weight=q._replace(data=q.data.astype(jnp.float8_e5m2)))
    with pytest.raises(ValueError, match=r"^meta must be None under BlockScaling"):
        F.quantize_weight(w, (jnp.zeros(3),), r)


# ---- on the GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.jax_gpu
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
@pytest.mark.parametrize("shape", [(2048, 1024, 4096), (1000, 300, 200), (16, 128, 16)], ids=str)
def test_cuda_block_dot_is_the_block_definition(shape, recipe):
    x, w, g = _operands(shape)
    dev = jax.devices("gpu")[0]
    xd, wd, gd = (jax.device_put(a, dev) for a in (x, w, g))
    y, vjp = jax.vjp(jax.jit(lambda a, b: F.block_dot(a, b, recipe)), xd, wd)
    dx, dw = vjp(gd)
    ref = _reference(x, w, g, recipe)
    for got, name in ((y, "y"), (dx, "dx"), (dw, "dw")):
        _close(got, *ref[name], name, rtol=2.0 ** -9)  # the split accumulator's allowance


@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.jax_gpu
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("blocks", [(1, 128), (128, 1), (1, 1)], ids=["1x128-128x128", "128x128-1x128", "1x128-1x128"])
def test_cuda_gemm_of_ragged_operands_is_the_definition(blocks):
    """fp8_block_gemm on the GPU with M, N, K = 130, 40, 300 (the operands padded to 16 inside, the
    result sliced) and a bias, against the float64 product of the dequantized operands."""
    qa, qb = _quantized(130, 300, blocks[0], seed=3), _quantized(40, 300, blocks[1], "e5m2", seed=4)
    dev = jax.devices("gpu")[0]
    a, b, sa, sb = (jax.device_put(jnp.asarray(v), dev) for v in (qa.data, qb.data, qa.scale_inv, qb.scale_inv))
    bias = jax.device_put(jnp.linspace(-1, 1, 40, dtype=jnp.bfloat16), dev)
    y = jax.jit(lambda *o: G.fp8_block_gemm(*o, *blocks, jnp.bfloat16, bias=bias))(a, b, sa, sb)
    assert y.shape == (130, 40) and y.dtype == jnp.bfloat16
    da, dc = _deq(qa.data, qa.scale_inv, (blocks[0], 128)), _deq(qb.data, qb.scale_inv, (blocks[1], 128))
    want = da @ dc.T + np.asarray(bias, np.float64)
    _close(y, want, np.abs(da) @ np.abs(dc).T + 1, "y", rtol=2.0 ** -7)  # the split accumulator, bf16 out


@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.jax_gpu
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_block_mlp_is_the_emulated_one(dtype):
    """block_mlp on CUDA (the fused gelu / dgelu+dbias kernels, the shim's block GEMMs) against
    impl='jnp' (the jax.numpy twins, the emulated GEMMs): the output and every gradient within
    2**-6 of their largest magnitude."""
    r = fusedfp8.BlockScaling()
    m, k, f = 1200, 320, 1000
    ops = [jnp.asarray(inputs(s, "float32", i) * np.float32(sc), dtype)
           for i, (s, sc) in enumerate((((m, k), 1.0), ((k, f), 0.05), ((f,), 0.5), ((f, k), 0.05), ((k,), 0.5)))]

    def grads(impl, dev):
        args = [jax.device_put(a, dev) for a in ops]
        fn = jax.jit(jax.value_and_grad(
            lambda *a: (F.block_mlp(*a, r, impl=impl).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2, 3, 4)))
        y = jax.jit(lambda *a: F.block_mlp(*a, r, impl=impl))(*args)
        return [np.asarray(v, np.float32) for v in (y, *fn(*args)[1])]

    got, want = grads("auto", jax.devices("gpu")[0]), grads("jnp", jax.devices("cpu")[0])
    for name, a, b in zip(("y", "dh", "dw1", "db1", "dw2", "db2"), got, want):
        err = float(np.abs(a - b).max() / np.abs(b).max())
        assert err < 2.0 ** -6, (name, err)

