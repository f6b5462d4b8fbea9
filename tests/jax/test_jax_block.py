"""fusedfp8.jax.block.block_quantize: traceable block scaling. On the CPU (impl 'auto' and 'jnp') its
jax.numpy twin, byte for byte fusedfp8.numerics.block's, eager and under jit and vmap; the recipe
and every argument checked by name at trace time; on CUDA it lowers to ONE call of the
fusedfp8_launch FFI handler with the block plan's slots (the lowering is read here without a GPU).
On the GPU (marked, skipped here): the kernel through the FFI handler and through the callback,
byte for byte the NumPy definition, on ragged and padded shapes and special blocks."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedfp8
from fusedfp8.jax import block as JB
from support.block import CALLS as CASES
from support.block import RECIPE, assert_same, expected, inputs, specials
from support.shim import built as built_shim

@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_cpu_path_is_the_numpy_definition(case):
    shape, dtype, recipe, weight, grad, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape) + 3)
    got = JB.block_quantize(jnp.asarray(x), recipe, weight=weight, grad=grad, transpose=transpose, pad_to=pad_to)
    assert_same(got, expected(x, recipe, weight, grad, transpose, pad_to), transpose)
    fp8 = jnp.dtype(recipe.format_for(grad).dtype_name)
    assert got.data.dtype == fp8 and got.amax.shape == (1,) and got.scale_inv.dtype == jnp.float32
    assert (got.data_t.dtype == fp8) if transpose else got.data_t is None


def test_under_jit_and_vmap_the_same_bytes():
    x = inputs((4, 130, 200), "bfloat16", 5, None)

    @jax.jit
    def f(v):
        return JB.block_quantize(v * 1, RECIPE, transpose=True, impl="jnp")

    assert_same(f(jnp.asarray(x)), expected(x, RECIPE, False, False, True, 1), True)
    batched = jax.vmap(lambda v: JB.block_quantize(v, RECIPE, weight=True))(jnp.asarray(x))
    for i in range(x.shape[0]):  # each example quantized on its own, with its own scales and amax
        one = jax.tree.map(lambda a: a[i], batched)
        assert_same(one, expected(x[i], RECIPE, True, False, False, 1), False)


def test_special_blocks_reach_the_amax():
    x = inputs((384, 512), "float32", 7, specials)
    got = JB.block_quantize(x, RECIPE, transpose=True)  # (a numpy input is taken as a jax array)
    assert_same(got, expected(x, RECIPE, False, False, True, 1), True)
    assert np.isnan(np.asarray(got.amax)[0])


def test_bad_arguments_are_refused_by_name():
    x = jnp.ones((4, 6), jnp.float32)
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.BlockScaling .* got DelayedScaling"):
        JB.block_quantize(x, fusedfp8.DelayedScaling())
    with pytest.raises(TypeError, match=r"^transpose must be a bool; got int 1$"):
        JB.block_quantize(x, RECIPE, transpose=1)
    with pytest.raises(ValueError, match=r"^weight and grad: a weight is a forward tensor"):
        JB.block_quantize(x, RECIPE, weight=True, grad=True)
    with pytest.raises(ValueError, match=r"^pad_to must be a positive int"):
        JB.block_quantize(x, RECIPE, pad_to=-16)
    with pytest.raises(ValueError, match=r"^impl must be one of \('auto', 'jnp', 'ffi', 'callback'\); got 'cuda'$"):
        JB.block_quantize(x, RECIPE, impl="cuda")
    with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16; got int32$"):
        JB.block_quantize(jnp.ones((2, 2), jnp.int32), RECIPE)
    with pytest.raises(ValueError, match=r"^x: block scaling needs an input of at least 1 dimension"):
        JB.block_quantize(jnp.float32(1), RECIPE)
    with pytest.raises(TypeError, match=r"^x: fusedfp8\.jax needs jax \(or numpy\) arrays; got a torch array"):
        JB.block_quantize(pytest.importorskip("torch").ones(2, 2), RECIPE)


def test_on_cuda_it_lowers_to_one_ffi_call_with_the_block_slots(monkeypatch):
    from fusedfp8.jax import callbacks as C
    from fusedfp8.jax import primitives as JP

    built_shim("xla")
    ok, why = C.ffi_target()
    assert ok, why
    monkeypatch.setattr(JP, "_auto_backend", lambda: "ffi")

    def f(x, w):
        return JB.block_quantize(x, RECIPE, transpose=True), JB.block_quantize(w, RECIPE, weight=True, pad_to=16)

    x, w = jnp.ones((48, 260), jnp.bfloat16), jnp.ones((40, 30), jnp.float32)
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls) == 2 and all("@fusedfp8_launch" in c for c in calls)
    # BLOCK_SLOTS (x, b, q, scale_inv, q_t, scale_inv_t, amax, dbias, partial, counters, mean, rstd, weight, bias):
    # x -> arg 0; q, scale_inv, q_t, scale_inv_t, amax -> results 0..4; b, the dbias and the LayerNorm slots null
    assert "slots = dense<[0, -1, -2, -3, -4, -5, -6, -1, -1, -1, -1, -1, -1, -1]>" in calls[0]
    assert "output_operand_alias" not in calls[0]
    # q's 1x128 scales (3 K blocks, 48 rows), q_t's (one K block of 48, 260 rows)
    assert "tensor<3x48xf32>" in calls[0] and "tensor<260x48xui8>" in calls[0] and "tensor<1x260xf32>" in calls[0]
    # no q_t: its slots null; q padded to 48 x 32, its 128x128 scales (1, pad4(1))
    assert "slots = dense<[0, -1, -2, -3, -1, -1, -4, -1, -1, -1, -1, -1, -1, -1]>" in calls[1]
    assert "tensor<48x32xui8>" in calls[1] and "tensor<1x4xf32>" in calls[1]
    cpu = jax.jit(f).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "fusedfp8_launch" not in cpu  # jax.numpy there


# ---- the GPU: the kernel through both backends --------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.jax_gpu
@pytest.mark.parametrize("impl", ["ffi", "callback", "auto"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_kernel_paths_are_the_numpy_definition(impl, case):
    shape, dtype, recipe, weight, grad, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape) + 3)
    xg = jax.device_put(jnp.asarray(x), jax.devices("gpu")[0])
    f = jax.jit(lambda v: JB.block_quantize(v, recipe, weight=weight, grad=grad, transpose=transpose, pad_to=pad_to,
                                            impl=impl))
    for _ in range(2):  # (the amax is zeroed by the plan, not accumulated across calls)
        assert_same(f(xg), expected(x, recipe, weight, grad, transpose, pad_to), transpose)


@pytest.mark.gpu
@pytest.mark.jax_gpu
@pytest.mark.parametrize("impl", ["ffi", "callback"])
@pytest.mark.parametrize("weight", [False, True], ids=["1x128", "128x128"])
def test_the_kernel_paths_on_special_blocks_and_a_large_shape(impl, weight):
    for x in (inputs((384, 512), "bfloat16", 7, specials), inputs((3000, 4100), "float16", 9)):
        xg = jax.device_put(jnp.asarray(x), jax.devices("gpu")[0])
        got = JB.block_quantize(xg, RECIPE, weight=weight, transpose=True, impl=impl)
        assert_same(got, expected(x, RECIPE, weight, False, True, 1), True)


# ---- LayerNorm fused with 1x128 blocks -----------------------------------------------------------------
def test_block_layernorm_quantize_lowers_to_one_ffi_call_on_cuda_and_is_the_definition_on_the_cpu(monkeypatch):
    """On CUDA one fusedfp8_launch call whose slots bind x, weight and bias (arguments 0..2) and q,
    scale_inv, q_t, scale_inv_t, amax, mean, rstd (results 0..6); on the CPU the jax.numpy twin, under
    jit byte for byte the NumPy definition (the float16 parameters widened exactly)."""
    from fusedfp8.jax import callbacks as C
    from fusedfp8.jax import primitives as JP
    from fusedfp8.numerics import block as B

    built_shim("xla")
    ok, why = C.ffi_target()
    assert ok, why
    monkeypatch.setattr(JP, "_auto_backend", lambda: "ffi")

    def f(x, w, b):
        return JB.block_layernorm_quantize(x, w, b, 1e-5, RECIPE, transpose=True, pad_to=16)

    g = np.random.default_rng(4)
    x = (g.standard_normal((48, 260)) * 3 + 1).astype(np.float32)
    w, b = g.uniform(0.5, 2, 260).astype(np.float16), g.uniform(-1, 1, 260).astype(np.float16)
    text = jax.jit(f).trace(x, w, b).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls) == 1 and "@fusedfp8_launch" in calls[0]
    assert "slots = dense<[0, -1, -2, -3, -4, -5, -6, -1, -1, -1, -7, -8, 1, 2]>" in calls[0]
    got = jax.jit(f)(x, w, b)
    want, mean, rstd = B.block_layernorm_quantize(x, w, b, 1e-5, "e4m3", True, True, 16)
    assert_same(got.quantized, want, True)
    assert np.array_equal(np.asarray(got.mean), mean) and np.array_equal(np.asarray(got.rstd), rstd)
    with pytest.raises(ValueError, match=r"^weight must have shape \(260,\)"):
        JB.block_layernorm_quantize(x, w[:5], None, 1e-5, RECIPE)


@pytest.mark.gpu
@pytest.mark.jax_gpu
@pytest.mark.parametrize("impl", ["ffi", "callback"])
@pytest.mark.parametrize("shape, pad_to", [((300, 4096), 1), ((129, 1030), 16)], ids=["300x4096", "129x1030-pad16"])
def test_block_layernorm_kernel_paths_are_the_numpy_definition(impl, shape, pad_to):
    from fusedfp8.numerics import block as B

    g = np.random.default_rng(shape[1])
    x = (g.standard_normal(shape) * 2 + 0.5).astype(jnp.bfloat16)
    w, b = g.uniform(0.5, 2, shape[1]).astype(np.float32), g.uniform(-1, 1, shape[1]).astype(np.float32)
    dev = jax.devices("gpu")[0]
    f = jax.jit(lambda x, w, b: JB.block_layernorm_quantize(x, w, b, 1e-5, RECIPE, transpose=True, pad_to=pad_to,
                                                            impl=impl))
    got = f(*(jax.device_put(jnp.asarray(a), dev) for a in (x, w, b)))
    want, mean, rstd = B.block_layernorm_quantize(np.asarray(x), w, b, 1e-5, "e4m3", True, True, pad_to)
    assert_same(got.quantized, want, True)
    assert np.array_equal(np.asarray(got.mean), mean) and np.array_equal(np.asarray(got.rstd), rstd)
