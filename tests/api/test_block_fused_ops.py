"""The fused ops of block scaling (fusedfp8/block.py): block_gelu_quantize (y = gelu(x)),
block_dgelu_quantize (y = dy * gelu'(x), with dbias) and block_quantize's dbias, on every face (the
framework-agnostic functions, fusedfp8.jax.block's, fusedfp8.pytorch.block's custom op): the bytes
and scales are the NumPy definition's (fusedfp8.numerics.block with ``op``), which is the block
quantization of reference.activation's float32 y; dbias is y's column sums within float32
rounding of the float64 oracle; every bad argument is refused by name. On the GPU (marked): the
kernel through the launch plan, for torch, cupy and jax arrays, on ragged, padded and special
inputs, dbias deterministic (the same bits on every call)."""
from __future__ import annotations

import numpy as np
import pytest

import fusedfp8
from fusedfp8.numerics import block as B
from fusedfp8.numerics import reference as ref
from support.block import RECIPE, assert_same, inputs, specials
from support.frameworks import HOST_FRAMEWORKS, to_fw, to_np

HYBRID = fusedfp8.BlockScaling(fp8_format="hybrid", power_of_two_scales=False)
# (shape, dtype, recipe, transpose, pad_to): ragged along both axes, 3-D, one row, empty
CASES = {
    "300x260-bf16-t": ((300, 260), "bfloat16", RECIPE, True, 1),
    "129x127-f32-t-pad16": ((129, 127), "float32", HYBRID, True, 16),
    "3x5x130-f16-hybrid": ((3, 5, 130), "float16", HYBRID, False, 1),
    "1x300-bf16-t-pad16": ((1, 300), "bfloat16", RECIPE, True, 16),
    "0x130-f32-t-pad16": ((0, 130), "float32", RECIPE, True, 16),
}
APPROX = ["tanh", "none"]
# the host path is the NumPy definition for every framework's CPU arrays: both gelus once, each framework once
HOST_RUNS = [("numpy", "tanh"), ("numpy", "none"), ("torch", "tanh"), ("jax", "none")]


def gelu_want(x, recipe, approximate, transpose, pad_to):
    return B.block_quantize(x, recipe.format_for(False), (1, 128), recipe.power_of_two_scales, transpose, pad_to,
                            "gelu", None, approximate)


def dgelu_want(dy, x, recipe, approximate, transpose, pad_to, dbias):
    return B.block_quantize(dy, recipe.format_for(True), (1, 128), recipe.power_of_two_scales, transpose, pad_to,
                            "dgelu", x, approximate, dbias)


def assert_dbias(got, y: np.ndarray) -> None:
    """``got`` (cols,) float32 is the column sums of the float32 ``y`` (2-D view) within float32
    rounding: 2**-18 of each column's sum of |y| (a sum of a few hundred terms in a fixed tree),
    NaN where the column holds a NaN (or infinities of both signs)."""
    y2 = ref.as_2d(y, "y").astype(np.float64)
    g = np.asarray(to_np(got), np.float32)
    assert g.shape == (y2.shape[1],), g.shape
    want = y2.sum(axis=0)
    with np.errstate(invalid="ignore"):
        bound = 2.0 ** -18 * np.abs(y2).sum(axis=0) + 1e-37
        ok = (np.isnan(want) & np.isnan(g)) | (np.isinf(want) & (g == want)) | (np.abs(g - want) <= bound)
    assert ok.all(), (np.argwhere(~ok)[:3], g[~ok][:3], want[~ok][:3])


def test_the_face_exports_them():
    from fusedfp8 import block as api

    assert fusedfp8.block_gelu_quantize is api.block_gelu_quantize
    assert fusedfp8.block_dgelu_quantize is api.block_dgelu_quantize
    assert {"block_gelu_quantize", "block_dgelu_quantize"} <= set(fusedfp8.__all__)


def test_the_definition_is_the_block_quantization_of_the_activation():
    x, dy = inputs((300, 260), "bfloat16", 1), inputs((300, 260), "bfloat16", 2)
    for approximate in APPROX:
        y = ref.activation("gelu", x, None, approximate)
        assert_same(gelu_want(x, RECIPE, approximate, True, 16), B.block_quantize(y, "e4m3", (1, 128), True, True, 16),
                    True)
        g = ref.activation("dgelu", dy, x, approximate)
        want = dgelu_want(dy, x, HYBRID, approximate, True, 16, True)
        assert_same(want, B.block_quantize(g, "e5m2", (1, 128), False, True, 16), True)
        assert np.array_equal(want.dbias, ref.column_sums(g))


# ---- every face on the CPU: the host path (numpy, torch, jax) and the jax.numpy twin -------------------------
@pytest.mark.parametrize("fw, approximate", HOST_RUNS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_gelu_is_the_definition(fw, approximate, case):
    shape, dtype, recipe, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape))
    got = fusedfp8.block_gelu_quantize(to_fw(x, fw), recipe, approximate=approximate, transpose=transpose,
                                       pad_to=pad_to)
    assert_same(got, gelu_want(x, recipe, approximate, transpose, pad_to), transpose)
    assert got.dbias is None


@pytest.mark.parametrize("fw, approximate", HOST_RUNS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_dgelu_and_its_dbias_are_the_definition(fw, approximate, case):
    shape, dtype, recipe, transpose, pad_to = case
    x, dy = inputs(shape, dtype, sum(shape)), inputs(shape, dtype, sum(shape) + 1)
    got = fusedfp8.block_dgelu_quantize(to_fw(dy, fw), to_fw(x, fw), recipe, approximate=approximate,
                                        transpose=transpose, dbias=True, pad_to=pad_to)
    want = dgelu_want(dy, x, recipe, approximate, transpose, pad_to, True)
    assert_same(got, want, transpose)
    assert np.array_equal(np.asarray(to_np(got.dbias)), want.dbias)
    assert fusedfp8.block_dgelu_quantize(to_fw(dy, fw), to_fw(x, fw), recipe).dbias is None


@pytest.mark.parametrize("fw", HOST_FRAMEWORKS)
def test_a_plain_gradients_dbias(fw):
    g = inputs((300, 260), "bfloat16", 3)
    got = fusedfp8.block_quantize(to_fw(g, fw), HYBRID, grad=True, transpose=True, dbias=True, pad_to=16)
    want = B.block_quantize(g, "e5m2", (1, 128), False, True, 16, dbias=True)
    assert_same(got, want, True)
    assert_dbias(got.dbias, g.astype(np.float32))


@pytest.mark.parametrize("op, case", [("gelu", CASES["129x127-f32-t-pad16"]), ("dgelu", CASES["300x260-bf16-t"]),
                                      ("identity", CASES["3x5x130-f16-hybrid"])], ids=["gelu", "dgelu", "identity"])
def test_the_jax_functions_jitted_are_the_definition(op, case):
    """fusedfp8.jax.block's functions under jax.jit (the jax.numpy twin on the CPU): the same bytes
    and scales; dbias within float32 rounding."""
    import jax
    import jax.numpy as jnp

    from fusedfp8.jax import block as JB

    shape, dtype, recipe, transpose, pad_to = case
    x, dy = inputs(shape, dtype, 5), inputs(shape, dtype, 6)
    if op == "gelu":
        got = jax.jit(lambda a: JB.block_gelu_quantize(a, recipe, approximate="none", transpose=transpose,
                                                       pad_to=pad_to))(jnp.asarray(x))
        want = gelu_want(x, recipe, "none", transpose, pad_to)
    elif op == "dgelu":
        got = jax.jit(lambda d, a: JB.block_dgelu_quantize(d, a, recipe, transpose=transpose, dbias=True,
                                                           pad_to=pad_to))(jnp.asarray(dy), jnp.asarray(x))
        want = dgelu_want(dy, x, recipe, "tanh", transpose, pad_to, True)
    else:
        got = jax.jit(lambda d: JB.block_quantize(d, recipe, grad=True, transpose=transpose, dbias=True,
                                                  pad_to=pad_to))(jnp.asarray(dy))
        want = B.block_quantize(dy, recipe.format_for(True), (1, 128), recipe.power_of_two_scales, transpose, pad_to,
                                dbias=True)
    assert_same(got, want, transpose)
    if op != "gelu":
        y = ref.activation(op, dy, x if op == "dgelu" else None)
        assert_dbias(got.dbias, y)


def test_the_torch_custom_op_is_the_definition_and_compiles():
    import torch

    from fusedfp8.pytorch import block as TB

    x, dy = inputs((300, 260), "bfloat16", 7), inputs((300, 260), "bfloat16", 8)
    xt, dyt = to_fw(x, "torch"), to_fw(dy, "torch")
    assert_same(TB.block_gelu_quantize(xt, RECIPE, transpose=True), gelu_want(x, RECIPE, "tanh", True, 1), True)
    want = dgelu_want(dy, x, HYBRID, "none", True, 16, True)

    def f(a, b):
        return TB.block_dgelu_quantize(a, b, HYBRID, approximate="none", transpose=True, dbias=True, pad_to=16)

    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        got = fn(dyt, xt)
        assert_same(got, want, True)
        assert np.array_equal(got.dbias.numpy(), want.dbias)
    got = TB.block_quantize(dyt, HYBRID, grad=True, dbias=True)
    assert got.data_t is None and got.dbias.shape == (260,)


# ---- bad arguments: refused by name, before anything is written -------------------------------------------
@pytest.mark.parametrize("face", ["agnostic", "torch", "jax"])
def test_bad_arguments_are_refused_by_name(face):
    import jax.numpy as jnp
    import torch

    from fusedfp8.jax import block as JB
    from fusedfp8.pytorch import block as TB

    mod, conv = {"agnostic": (fusedfp8, np.asarray), "torch": (TB, torch.as_tensor), "jax": (JB, jnp.asarray)}[face]
    x = conv(np.ones((4, 256), np.float32))
    with pytest.raises(ValueError, match=r"^approximate must be"):
        mod.block_gelu_quantize(x, RECIPE, approximate="sigmoid")
    with pytest.raises(TypeError, match=r"^dbias must be a bool; got int 1$"):
        mod.block_dgelu_quantize(x, x, RECIPE, dbias=1)
    with pytest.raises(ValueError, match=r"^dbias: the column sums of a gradient go with 1x128 blocks"):
        mod.block_quantize(x, RECIPE, weight=True, dbias=True)
    with pytest.raises(ValueError, match=r"dy and x must have the same shape"):
        mod.block_dgelu_quantize(x, conv(np.ones((4, 128), np.float32)), RECIPE)
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.BlockScaling"):
        mod.block_gelu_quantize(x, fusedfp8.DelayedScaling())
    with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16; got int32$"):
        mod.block_dgelu_quantize(x, conv(np.ones((4, 256), np.int32)), RECIPE)
    with pytest.raises(TypeError, match=r"^dy must be float32, float16 or bfloat16; got int32$"):
        mod.block_dgelu_quantize(conv(np.ones((4, 256), np.int32)), x, RECIPE)


def test_the_custom_op_refuses_what_no_kernel_computes():
    """torch.ops.fusedfp8.block_quantize called directly: an unknown op, an op or dbias with a weight's
    128x128 blocks, gelu with dbias, each refused by name before anything runs."""
    import torch

    from fusedfp8.pytorch import block as TB

    x = torch.ones(4, 256)
    with pytest.raises(ValueError, match=r"^op must be one of \('identity', 'gelu', 'dgelu'\); got 'relu'"):
        TB.block_quantize_op(x, "e4m3", 128, True, False, False, False, 1, "relu")
    with pytest.raises(ValueError, match=r"^op='gelu': an activation or its gradient go with 1x128 blocks"):
        TB.block_quantize_op(x, "e4m3", 128, True, True, False, False, 1, "gelu")
    with pytest.raises(ValueError, match=r"^dbias goes with a gradient"):
        TB.block_quantize_op(x, "e4m3", 128, True, False, False, False, 1, "gelu", None, "tanh", True)


def test_dy_and_x_of_different_dtypes_are_refused():
    x = np.ones((4, 256), np.float32)
    with pytest.raises(TypeError, match=r"^dy and x must have the same dtype; got float32 and float16$"):
        fusedfp8.block_dgelu_quantize(x, x.astype(np.float16), RECIPE)


# ---- the GPU: the kernel through the launch plan -------------------------------------------------------------
GPU_FRAMEWORKS = ["torch", "cupy", pytest.param("jax", marks=pytest.mark.jax_gpu)]


@pytest.mark.gpu
@pytest.mark.parametrize("fw", GPU_FRAMEWORKS)
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_kernels_are_the_definition(fw, approximate, case):
    shape, dtype, recipe, transpose, pad_to = case
    x, dy = inputs(shape, dtype, sum(shape)), inputs(shape, dtype, sum(shape) + 1)
    got = fusedfp8.block_gelu_quantize(to_fw(x, fw, "cuda"), recipe, approximate=approximate, transpose=transpose,
                                       pad_to=pad_to)
    assert_same(got, gelu_want(x, recipe, approximate, transpose, pad_to), transpose)
    got = fusedfp8.block_dgelu_quantize(to_fw(dy, fw, "cuda"), to_fw(x, fw, "cuda"), recipe, approximate=approximate,
                                        transpose=transpose, dbias=True, pad_to=pad_to)
    want = dgelu_want(dy, x, recipe, approximate, transpose, pad_to, True)
    assert_same(got, want, transpose)
    assert_dbias(got.dbias, ref.activation("dgelu", dy, x, approximate))
    got = fusedfp8.block_quantize(to_fw(dy, fw, "cuda"), recipe, grad=True, transpose=transpose, dbias=True,
                                  pad_to=pad_to)
    assert_same(got, B.block_quantize(dy, recipe.format_for(True), (1, 128), recipe.power_of_two_scales, transpose,
                                      pad_to), transpose)
    assert_dbias(got.dbias, dy.astype(np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("approximate", APPROX)
def test_the_kernels_on_special_values_and_large_shapes_with_deterministic_dbias(dtype, approximate):
    """NaN, inf, zero, denormal and tiny blocks through gelu and dgelu; a shape of more tiles than one
    resident wave, ragged; each call twice: the same bytes and the same dbias bits (the plan zeroes
    the counters and the amax; the sums' order is the tiles', not the grid's)."""
    import torch

    for shape, special in (((384, 512), specials), ((3000, 4100), None)):
        x, dy = inputs(shape, dtype, 11, special), inputs(shape, dtype, 12)
        xt, dyt = to_fw(x, "torch", "cuda"), to_fw(dy, "torch", "cuda")
        want_g = gelu_want(x, HYBRID, approximate, True, 1)
        want_d = dgelu_want(dy, x, HYBRID, approximate, True, 1, True)
        first = None
        for _ in range(2):
            assert_same(fusedfp8.block_gelu_quantize(xt, HYBRID, approximate=approximate, transpose=True), want_g,
                        True)
            got = fusedfp8.block_dgelu_quantize(dyt, xt, HYBRID, approximate=approximate, transpose=True, dbias=True)
            assert_same(got, want_d, True)
            bits = got.dbias.cpu().numpy().view(np.uint32)
            assert first is None or np.array_equal(bits, first)
            first = bits
        assert_dbias(got.dbias.cpu(), ref.activation("dgelu", dy, x, approximate))
    torch.cuda.synchronize()
