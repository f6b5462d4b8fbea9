"""fusedfp8.block_layernorm_quantize (fusedfp8/block.py): LayerNorm fused with 1x128 block
quantization, against its NumPy definition (fusedfp8.numerics.block.block_layernorm_quantize) byte
for byte: q, q_t and both scale arrays in cuBLASLt's layout, the amax, mean and rstd (the canonical
NaN) -- on the host for numpy, torch and jax CPU arrays, and on the GPU (marked) the two launches
of the plan (the layernorm kernel's statistics instantiation, then block_quantize's LayerNorm
instantiation) for torch, cupy and jax GPU arrays: every input and parameter dtype, rows one warp
and several warps wide (the statistics' summation layouts), wider than the kernel's register cache,
ragged and padded shapes, no weight / no bias, rows of NaN, inf and constants, and bad arguments
refused by name before anything is allocated."""
from __future__ import annotations

import numpy as np
import pytest

import fusedfp8
from fusedfp8.numerics import block as B
from support.block import assert_same
from support.frameworks import HOST_FRAMEWORKS, assert_type, np_dtype, to_fw, to_np

HYBRID = fusedfp8.BlockScaling(fp8_format="hybrid", power_of_two_scales=False)
E4M3 = fusedfp8.BlockScaling()
# (shape, x dtype, parameter dtype, weight?, bias?, recipe, transpose, pad_to)
CASES = {
    "300x260-bf16-bf16-t": ((300, 260), "bfloat16", "bfloat16", True, True, E4M3, True, 1),
    "129x1030-f32-none-bias-t-pad16": ((129, 1030), "float32", "float32", False, True, HYBRID, True, 16),
    "3x5x4096-f16-f32-t": ((3, 5, 4096), "float16", "float32", True, True, HYBRID, True, 1),
    "64x20000-bf16-f16-weight": ((64, 20000), "bfloat16", "float16", True, False, E4M3, False, 1),
    "1x1-f32-t": ((1, 1), "float32", "float32", True, True, E4M3, True, 1),
    "0x130-bf16-t-pad16": ((0, 130), "bfloat16", "bfloat16", True, True, E4M3, True, 16),
}


def _inputs(shape, dtype, pdtype, weight, bias, seed):
    """Rows at their own offsets and spreads (with a NaN, an inf and a constant row where there are rows)."""
    g = np.random.default_rng(seed)
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    x = g.standard_normal((rows, cols)) * np.exp2(g.integers(-6, 6, (rows, 1))) + g.standard_normal((rows, 1)) * 4
    if rows >= 4:
        x[1, cols // 2], x[2, 0], x[3] = np.nan, np.inf, -1.5
    w = g.uniform(0.5, 2, cols).astype(np.float32).astype(np_dtype(pdtype)) if weight else None
    b = g.uniform(-1, 1, cols).astype(np.float32).astype(np_dtype(pdtype)) if bias else None
    return x.astype(np.float32).astype(np_dtype(dtype)).reshape(shape), w, b


def _check(got, x, w, b, recipe, transpose, pad_to):
    want, mean, rstd = B.block_layernorm_quantize(x, w, b, 1e-5, recipe.format_for(False), recipe.power_of_two_scales,
                                                  transpose, pad_to)
    assert_same(got.quantized, want, transpose)
    assert got.quantized.dbias is None
    for g, w_ in ((got.mean, mean), (got.rstd, rstd)):
        assert np.array_equal(to_np(g).view(np.uint32), w_.view(np.uint32))


@pytest.mark.parametrize("fw", HOST_FRAMEWORKS)
@pytest.mark.parametrize("case", [CASES["300x260-bf16-bf16-t"], CASES["129x1030-f32-none-bias-t-pad16"]],
                         ids=["300x260-bf16-bf16-t", "129x1030-f32-none-bias-t-pad16"])
def test_the_host_path_is_the_numpy_definition(fw, case):
    shape, dtype, pdtype, weight, bias, recipe, transpose, pad_to = case
    x, w, b = _inputs(shape, dtype, pdtype, weight, bias, sum(shape))
    got = fusedfp8.block_layernorm_quantize(to_fw(x, fw), *(None if p is None else to_fw(p, fw) for p in (w, b)), 1e-5,
                                            recipe, transpose=transpose, pad_to=pad_to)
    _check(got, x, w, b, recipe, transpose, pad_to)
    assert_type(got.quantized.data, fw, recipe.format_for(False).dtype_name, got.quantized.data.shape)
    assert_type(got.mean, fw, "float32", (int(np.prod(shape[:-1])),))
    assert "block_layernorm_quantize" in fusedfp8.__all__


BAD = [
    (dict(x=np.ones((4, 0), np.float32)), ValueError, r"^x: LayerNorm normalises over the last dimension"),
    (dict(weight=np.ones(5, np.float32)), ValueError, r"^weight must have shape \(8,\)"),
    (dict(bias=np.ones(8, np.int32)), TypeError, r"^bias must be float32, float16 or bfloat16; got int32$"),
    (dict(weight=np.ones(8, np.float32), bias=np.ones(8, np.float16)), TypeError,
     r"^weight and bias must have the same dtype; got float32 and float16$"),
    (dict(eps=-1.0), ValueError, r"^eps must be a finite number >= 0"),
    (dict(recipe=fusedfp8.DelayedScaling()), TypeError, r"^recipe must be a fusedfp8.BlockScaling"),
    (dict(transpose=1), TypeError, r"^transpose must be a bool; got int 1$"),
    (dict(pad_to=0), ValueError, r"^pad_to must be a positive int"),
    (dict(x=np.ones((4, 8), np.int8)), TypeError, r"^x must be float32, float16 or bfloat16; got int8$"),
]


@pytest.mark.parametrize("kwargs, exc, match", BAD, ids=[f"{next(iter(k))}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_arguments_are_refused_by_name(kwargs, exc, match):
    args = dict(x=np.ones((4, 8), np.float32), weight=None, bias=None, eps=1e-5, recipe=E4M3, transpose=False,
                pad_to=1)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fusedfp8.block_layernorm_quantize(args["x"], args["weight"], args["bias"], args["eps"], args["recipe"],
                                          transpose=args["transpose"], pad_to=args["pad_to"])


# ---- the GPU: the two launches of the plan ---------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fw", ["torch", "cupy", pytest.param("jax", marks=pytest.mark.jax_gpu)])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_kernels_are_the_numpy_definition(fw, case):
    shape, dtype, pdtype, weight, bias, recipe, transpose, pad_to = case
    x, w, b = _inputs(shape, dtype, pdtype, weight, bias, sum(shape) + 1)
    got = fusedfp8.block_layernorm_quantize(to_fw(x, fw, "cuda"),
                                            *(None if p is None else to_fw(p, fw, "cuda") for p in (w, b)), 1e-5,
                                            recipe, transpose=transpose, pad_to=pad_to)
    _check(got, x, w, b, recipe, transpose, pad_to)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cols", [1024, 4096, 16384, 20000, 100])
def test_every_row_layout_and_dtype_on_large_shapes(dtype, cols):
    """2048 rows (a grid-stride over the tiles) at the widths of one, four and sixteen warps a row,
    past the register cache, and under one warp's chunks; x misaligned by one element (the element
    loads of both kernels)."""
    import torch

    x, w, b = _inputs((2048, cols), dtype, "bfloat16", True, True, cols)
    buf = torch.empty(x.size + 1, dtype=getattr(torch, dtype), device="cuda")
    xt = buf[1:].view(x.shape)
    xt.copy_(to_fw(x, "torch", "cuda"))
    got = fusedfp8.block_layernorm_quantize(xt, to_fw(w, "torch", "cuda"), to_fw(b, "torch", "cuda"), 1e-5, HYBRID,
                                            transpose=True)
    _check(got, x, w, b, HYBRID, True, 1)
