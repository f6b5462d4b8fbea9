"""fusedfp8.pytorch.block: block scaling as the custom op torch.ops.fusedfp8.block_quantize. On CPU
tensors its bytes are fusedfp8.numerics.block's; torch.library.opcheck holds its schema, its fake
implementation (the shapes torch.compile sees) and its real one together; arguments are refused by
name. On the GPU (marked, skipped here): the kernel through the op, eager and under torch.compile,
byte for byte the same."""
from __future__ import annotations

import pytest
import torch

import fusedfp8
from fusedfp8.pytorch import block as TB
from support.block import CALLS as CASES
from support.block import RECIPE, assert_same, expected, inputs, specials
from support.frameworks import to_torch

@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_op_on_cpu_is_the_numpy_definition(case):
    shape, dtype, recipe, weight, grad, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape) + 4)
    got = TB.block_quantize(to_torch(x), recipe, weight=weight, grad=grad, transpose=transpose, pad_to=pad_to)
    assert_same(got, expected(x, recipe, weight, grad, transpose, pad_to), transpose)
    assert got.data.dtype == getattr(torch, recipe.format_for(grad).dtype_name)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_opcheck_schema_fake_and_real_agree(case):
    shape, dtype, recipe, weight, grad, transpose, pad_to = case
    x = to_torch(inputs(shape, dtype, 1))
    args = (x, recipe.fp8_format, recipe.weight_block[0], recipe.power_of_two_scales, weight, grad, transpose, pad_to)
    torch.library.opcheck(torch.ops.fusedfp8.block_quantize.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_special_blocks():
    x = inputs((384, 512), "bfloat16", 7, specials)
    got = TB.block_quantize(to_torch(x), RECIPE, weight=True, transpose=True)
    assert_same(got, expected(x, RECIPE, True, False, True, 1), True)


def test_bad_arguments_are_refused_by_name():
    x = torch.ones(4, 6)
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.BlockScaling .* got DelayedScaling"):
        TB.block_quantize(x, fusedfp8.DelayedScaling())
    with pytest.raises(TypeError, match=r"^grad must be a bool; got int 0$"):
        TB.block_quantize(x, RECIPE, grad=0)
    with pytest.raises(ValueError, match=r"^pad_to must be a positive int"):
        TB.block_quantize(x, RECIPE, pad_to=0)
    with pytest.raises(TypeError, match=r"^x must be a torch\.Tensor; got numpy\.ndarray"):
        TB.block_quantize(x.numpy(), RECIPE)
    with pytest.raises(TypeError, match=r"^x must be float32, float16 or bfloat16; got int32$"):
        TB.block_quantize(torch.ones(2, 2, dtype=torch.int32), RECIPE)
    with pytest.raises(ValueError, match=r"^x must be contiguous \(row-major\)"):
        TB.block_quantize(x.T, RECIPE)


# ---- the GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_the_op_on_cuda_is_the_numpy_definition(case, compiled):
    shape, dtype, recipe, weight, grad, transpose, pad_to = case
    x = inputs(shape, dtype, sum(shape) + 4)

    def f(v):
        return TB.block_quantize(v, recipe, weight=weight, grad=grad, transpose=transpose, pad_to=pad_to)

    fn = torch.compile(f, fullgraph=True, dynamic=False) if compiled else f
    got = fn(to_torch(x, "cuda"))
    assert got.data.is_cuda
    assert_same(got, expected(x, recipe, weight, grad, transpose, pad_to), transpose)
