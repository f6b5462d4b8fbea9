"""fusedfp8.block_quantize (fusedfp8/block.py): the recipe picks the block and the format (a weight's
block, a gradient's format), the host path is fusedfp8.numerics.block.block_quantize byte for byte
for numpy, torch and jax CPU arrays, results come back in the caller's framework, and every bad
argument is refused by name before anything is allocated. On the GPU (marked, skipped here): the
kernel through the launch plan, for torch, cupy and jax GPU arrays, byte for byte the same, on
ragged and padded shapes, with blocks of zeros, NaN, inf, denormals and tiny maxima."""
from __future__ import annotations

import numpy as np
import pytest

import fusedfp8
from fusedfp8 import block as api
from support.block import CALLS as CASES
from support.block import RECIPE, assert_same, expected, inputs, specials
from support.frameworks import HOST_FRAMEWORKS, assert_type, to_fw, to_np

def test_the_face_exports_it():
    assert fusedfp8.block_quantize is api.block_quantize
    assert "block_quantize" in fusedfp8.__all__


@pytest.mark.parametrize("fw", HOST_FRAMEWORKS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_host_path_is_the_numpy_definition(fw, case):
    shape, dtype, recipe, weight, grad, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape) + 1)
    got = fusedfp8.block_quantize(to_fw(x, fw), recipe, weight=weight, grad=grad, transpose=transpose, pad_to=pad_to)
    want = expected(x, recipe, weight, grad, transpose, pad_to)
    assert_same(got, want, transpose)
    fmt = recipe.format_for(grad).dtype_name
    assert_type(got.data, fw, fmt, want.data.shape)
    assert_type(got.scale_inv, fw, "float32", want.scale_inv.shape)
    assert_type(got.amax, fw, "float32", (1,))
    if transpose:
        assert_type(got.data_t, fw, fmt, want.data_t.shape)
        assert_type(got.scale_inv_t, fw, "float32", want.scale_inv_t.shape)


def test_the_recipe_decides_the_block_the_format_and_the_rounding():
    x = inputs((256, 256), "float32", 3)
    hybrid = fusedfp8.BlockScaling(fp8_format="hybrid")
    assert fusedfp8.block_quantize(x, hybrid, grad=True).data.dtype.name == "float8_e5m2"
    assert fusedfp8.block_quantize(x, hybrid).data.dtype.name == "float8_e4m3fn"
    assert fusedfp8.block_quantize(x, RECIPE, grad=True).data.dtype.name == "float8_e4m3fn"  # 'e4m3': every tensor
    assert fusedfp8.block_quantize(x, RECIPE).scale_inv.shape == (2, 256)  # 1x128: (K blocks, rows)
    assert fusedfp8.block_quantize(x, RECIPE, weight=True).scale_inv.shape == (2, 4)  # 128x128, pad4
    s = fusedfp8.block_quantize(x, RECIPE).scale_inv
    assert np.all(np.frexp(s)[0] == 0.5)  # powers of two
    exact = fusedfp8.block_quantize(x, fusedfp8.BlockScaling(power_of_two_scales=False)).scale_inv
    assert not np.all(np.frexp(exact)[0] == 0.5)


def test_a_nan_and_an_inf_reach_the_amax_and_their_blocks_take_scale_one():
    x = inputs((384, 512), "bfloat16", 7, specials)
    for fw in HOST_FRAMEWORKS:
        got = fusedfp8.block_quantize(to_fw(x, fw), RECIPE, transpose=True)
        assert_same(got, expected(x, RECIPE, False, False, True, 1), True)
        assert np.isnan(to_np(got.amax)[0])


# ---- bad arguments ---------------------------------------------------------------------------------
BAD = [
    (dict(recipe=fusedfp8.DelayedScaling()), TypeError,
     r"^recipe must be a fusedfp8\.BlockScaling \(a scale per block of each tensor\); got DelayedScaling"),
    (dict(recipe=fusedfp8.CurrentScaling()), TypeError,
     r"^recipe must be a fusedfp8\.BlockScaling .* got CurrentScaling"),
    (dict(recipe="e4m3"), TypeError,
     r"^recipe must be a fusedfp8\.DelayedScaling, .* or a fusedfp8\.BlockScaling; got str"),
    (dict(weight=1), TypeError, r"^weight must be a bool; got int 1$"),
    (dict(grad="yes"), TypeError, r"^grad must be a bool; got str 'yes'$"),
    (dict(transpose=None), TypeError, r"^transpose must be a bool; got NoneType None$"),
    (dict(weight=True, grad=True), ValueError, r"^weight and grad: a weight is a forward tensor"),
    (dict(pad_to=0), ValueError, r"^pad_to must be a positive int"),
    (dict(pad_to=True), ValueError, r"^pad_to must be a positive int"),
]


@pytest.mark.parametrize("fw", HOST_FRAMEWORKS)
@pytest.mark.parametrize("kwargs, exc, match", BAD, ids=[f"{next(iter(k))}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_arguments_are_refused_by_name(fw, kwargs, exc, match):
    base = np.arange(24, dtype=np.float32).reshape(4, 6) - 9
    x = to_fw(base, fw)
    kwargs = {"recipe": RECIPE, **kwargs}
    with pytest.raises(exc, match=match):
        fusedfp8.block_quantize(x, **kwargs)
    assert to_np(x).tobytes() == base.tobytes()  # (it writes nothing in place: the input is untouched)


@pytest.mark.parametrize("fw", HOST_FRAMEWORKS)
def test_bad_inputs_are_refused_by_name(fw):
    with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16; got int32$"):
        fusedfp8.block_quantize(to_fw(np.ones((2, 3), np.int32), fw), RECIPE)
    with pytest.raises(ValueError, match=r"^x: block scaling needs an input of at least 1 dimension .* got a scalar$"):
        fusedfp8.block_quantize(to_fw(np.array(2.0, np.float32), fw), RECIPE)
    if fw != "jax":  # (jax arrays have no strided views)
        t = to_fw(np.ones((4, 6), np.float32), fw).T
        with pytest.raises(ValueError, match=r"^x must be contiguous \(row-major\); got a non-contiguous view"):
            fusedfp8.block_quantize(t, RECIPE)


def test_a_non_array_is_refused_by_name():
    with pytest.raises(TypeError, match=r"^x: expected a numpy, torch, jax or cupy array; got builtins\.list$"):
        fusedfp8.block_quantize([[1.0, 2.0]], RECIPE)


# ---- the GPU: the kernel through the launch plan -------------------------------------------------------
GPU_FRAMEWORKS = ["torch", "cupy", pytest.param("jax", marks=pytest.mark.jax_gpu)]


@pytest.mark.gpu
@pytest.mark.parametrize("fw", GPU_FRAMEWORKS)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_kernel_is_the_numpy_definition(fw, case):
    shape, dtype, recipe, weight, grad, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape) + 1)
    got = fusedfp8.block_quantize(to_fw(x, fw, "cuda"), recipe, weight=weight, grad=grad, transpose=transpose,
                                  pad_to=pad_to)
    assert_same(got, expected(x, recipe, weight, grad, transpose, pad_to), transpose)
    if fw == "torch":
        import torch

        assert got.data.is_cuda and got.data.dtype == getattr(torch, recipe.format_for(grad).dtype_name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("weight", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_the_kernel_on_special_blocks_and_large_shapes(dtype, weight, pow2):
    """Zero, NaN, inf, denormal and tiny blocks; a shape of more tiles than one resident wave
    (grid-stride) with ragged edges; called twice, so that the amax is zeroed by the plan and not
    accumulated across calls."""
    import torch

    recipe = fusedfp8.BlockScaling(power_of_two_scales=pow2)
    for x in (inputs((384, 512), dtype, 7, specials), inputs((3000, 4100), dtype, 9)):
        for _ in range(2):
            got = fusedfp8.block_quantize(to_fw(x, "torch", "cuda"), recipe, weight=weight, transpose=True)
            assert_same(got, expected(x, recipe, weight, False, True, 1), True)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_the_kernel_runs_on_the_callers_stream():
    import torch

    x = inputs((1024, 1024), "bfloat16", 4)
    xt = to_fw(x, "torch", "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = fusedfp8.block_quantize(xt, RECIPE, transpose=True)
    s.synchronize()
    assert_same(got, expected(x, RECIPE, False, False, True, 1), True)
