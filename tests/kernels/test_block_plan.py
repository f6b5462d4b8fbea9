"""The launch plan of block_quantize (fusedfp8.launch.plans.build_block_quantize_plan), built from
made-up kernel references (no GPU): the amax zeroed first, one launch of the block shape's kernel
with the parameters the kernel declares (checked against SIGNATURES when built), the grid of one
resident wave over the padded shape's 128 x 128 tiles, null q_t / scale_inv_t without the
transpose, nothing launched for an empty input; the ops' modules (gelu, dgelu with b) and the
dbias plans (the counters zeroed, the workspaces of 128-column strips). tests/kernels/test_launch_shim.py runs the same
plans through the C++ packer and against the cubin's parameter sizes; tests/kernels/
test_block_kernels.py runs them on the GPU."""
from __future__ import annotations

import pytest

from fusedfp8.launch import format as P
from fusedfp8.launch import kernels as K
from fusedfp8.launch import plans as PL

KEY = K.ModuleKey("block_quantize", "float16", "e5m2", "identity")
SMS = 132


def refs(per_sm: int = 3, key=KEY) -> dict:
    return {role: PL.KernelRef(0x7F00 + i, expr, role, per_sm, 100 + i)
            for i, (role, expr) in enumerate(K.name_expressions(key).items())}


def params(step: P.Launch) -> list:
    """The launch's parameters as (kind, value): slot names for pointers, numbers for immediates."""
    s = PL.BLOCK_SLOTS
    return [("ptr", s[t.a]) if t.kind == P.PTR else ("null",) if t.kind == P.NULL else ("imm", t.a)
            for t in step.params]


@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("transpose", [False, True], ids=["q", "q+q_t"])
def test_the_plan_zeroes_the_amax_then_launches_the_blocks_kernel(block, transpose):
    r = refs()
    plan = PL.build_block_quantize_plan(r, SMS, 300, 260, block, transpose, True, 16)
    memset, launch = plan.steps
    assert memset == P.Memset(PL.BLOCK_SLOTS.amax, 4)
    (variant,) = launch.variants
    assert variant.func == r[PL.block_role(block)].func and launch.block == 256 and not launch.coop
    assert variant.grid == 3 * 3  # (304 x 272 padded: 3 x 3 tiles of 128)
    t = [("ptr", "q_t"), ("ptr", "scale_inv_t")] if transpose else [("null",), ("null",)]
    assert params(launch) == [("ptr", "x"), ("ptr", "b"), ("ptr", "q"), ("ptr", "scale_inv"), *t, ("ptr", "amax"),
                              *[("null",)] * 7, ("imm", 300), ("imm", 260), ("imm", 304), ("imm", 272), ("imm", 1)]
    assert launch.layout == PL.signature(PL.block_role(block)) == "@PPPPPPPPPPPPPPqqqqi"


def test_the_grid_is_one_resident_wave_and_pow2_is_a_flag():
    plan = PL.build_block_quantize_plan(refs(per_sm=2), SMS, 8192, 8192, (1, 128), False, False, 1)
    launch = plan.steps[1]
    assert launch.variants[0].grid == 2 * SMS < 64 * 64  # grid-stride over the rest
    assert params(launch)[-1] == ("imm", 0)
    assert PL.build_block_quantize_plan(refs(), SMS, 1, 1).steps[1].variants[0].grid == 1


@pytest.mark.parametrize("rows, cols", [(0, 130), (5, 0), (0, 0)])
def test_an_empty_input_only_zeroes_the_amax(rows, cols):
    plan = PL.build_block_quantize_plan(refs(), SMS, rows, cols, (128, 128), True, True, 16)
    assert plan.steps == (P.Memset(PL.BLOCK_SLOTS.amax, 4),)


def test_the_roles_are_the_block_shapes():
    assert PL.block_role((1, 128)) == "block_1x128" and PL.block_role((128, 128)) == "block_128x128"
    assert PL.block_role((1, 128), dbias=True) == "block_1x128_dbias"
    assert set(K.name_expressions(KEY)) == {"block_1x128", "block_128x128", "block_1x128_dbias",
                                            "block_1x128_ln_float32", "block_1x128_ln_float16",
                                            "block_1x128_ln_bfloat16"}
    for op in ("gelu_tanh", "gelu_erf", "dgelu_tanh", "dgelu_erf"):  # activations and gradients: 1x128 only
        assert set(K.name_expressions(K.ModuleKey("block_quantize", "float16", "e5m2", op))) == {"block_1x128"}
    assert PL.block_of("block_1x128") == PL.BLOCK_THREADS == 256
    with pytest.raises(KeyError):
        PL.block_role((128, 1))


@pytest.mark.parametrize("op", ["identity", "dgelu_erf"])
def test_dbias_zeroes_the_counters_then_passes_the_workspaces(op):
    key = K.ModuleKey("block_quantize", "bfloat16", "e5m2", op)
    r = refs(key=key)
    plan = PL.build_block_quantize_plan(r, SMS, 300, 260, (1, 128), True, False, 16, True, op)
    amax, counters, launch = plan.steps
    assert amax == P.Memset(PL.BLOCK_SLOTS.amax, 4)
    # 272 padded columns: 3 strips of 128; partial: one row per 128-row tile of the 304 padded rows
    assert counters == P.Memset(PL.BLOCK_SLOTS.counters, 4 * 3)
    assert PL.block_dbias_workspace(300, 260, 16) == ((3, 260), 3)
    assert launch.variants[0].func == r["block_1x128_dbias" if op == "identity" else "block_1x128"].func
    assert params(launch)[7:10] == [("ptr", "dbias"), ("ptr", "partial"), ("ptr", "counters")]


def test_dbias_of_an_input_without_rows_is_a_memset_of_zeros():
    plan = PL.build_block_quantize_plan(refs(), SMS, 0, 130, (1, 128), False, False, 1, True)
    assert plan.steps == (P.Memset(PL.BLOCK_SLOTS.amax, 4), P.Memset(PL.BLOCK_SLOTS.dbias, 4 * 130))


@pytest.mark.parametrize("op, block, dbias, match", [
    ("gelu_tanh", (128, 128), False, "takes 1x128 blocks"),
    ("dgelu_tanh", (128, 128), True, "takes 1x128 blocks"),
    ("gelu_erf", (1, 128), True, "dbias goes with a gradient")])
def test_the_plan_refuses_what_the_kernel_has_no_instantiation_for(op, block, dbias, match):
    key = K.ModuleKey("block_quantize", "bfloat16", "e4m3", op)
    with pytest.raises(ValueError, match=match):
        PL.build_block_quantize_plan(refs(key=key), SMS, 256, 256, block, False, False, 1, dbias, op)


def test_a_gelu_plan_launches_its_modules_kernel_with_b_left_null_by_the_caller():
    key = K.ModuleKey("block_quantize", "float32", "e4m3", "gelu_tanh")
    r = refs(key=key)
    (_, launch) = PL.build_block_quantize_plan(r, SMS, 256, 512, (1, 128), True, False, 1, False, "gelu_tanh").steps
    assert launch.variants[0].name == "block_quantize<float, 0, false, 1>"
    assert params(launch)[1] == ("ptr", "b")  # (a slot the caller leaves out is null)


def ln_refs(per_sm: int = 3) -> dict:
    ln = K.name_expressions(K.ModuleKey("layernorm_quantize", "bfloat16", "e4m3", param="float16"))
    stats = PL.KernelRef(0x7E00, ln["layernorm_stats"], "layernorm_stats", per_sm, 99)
    return {**refs(per_sm, K.ModuleKey("block_quantize", "bfloat16", "e4m3", "identity")), "layernorm_stats": stats}


@pytest.mark.parametrize("transpose", [False, True], ids=["q", "q+q_t"])
def test_the_layernorm_plan_launches_the_statistics_then_the_blocks_of_y(transpose):
    """LayerNorm fused with 1x128 blocks: the amax zeroed; the layernorm kernel's statistics
    instantiation over the rows (its block and threads per row the reference's row layout: 4096
    columns, 128 threads a row, 2 rows a block of 256), writing mean and rstd; then block_quantize's
    LayerNorm instantiation for the parameters' dtype over the padded tiles, reading them."""
    r = ln_refs()
    plan = PL.build_block_layernorm_plan(r, SMS, 300, 4096, "float16", transpose, True, 16, 1e-3)
    memset, stats, blocks = plan.steps
    assert memset == P.Memset(PL.BLOCK_SLOTS.amax, 4)
    assert stats.variants[0].name == "layernorm_quantize<__nv_bfloat16, __half, 0, false, false, true>"
    assert stats.block == 256 and stats.variants[0].grid == 150  # (300 rows, 2 a block; under 3 x 132)
    sp = [("ptr", PL.BLOCK_SLOTS[t.a]) if t.kind == P.PTR else ("null",) if t.kind == P.NULL else (t.kind, t.a)
          for t in stats.params]
    assert sp[:13] == [("ptr", "x"), *[("null",)] * 4, ("ptr", "mean"), ("ptr", "rstd"), *[("null",)] * 6]
    assert [t.a for t in stats.params[13:17]] == [300, 4096, 128, 0] and stats.params[-2].kind == P.F32
    assert stats.layout == PL.signature("layernorm_stats")
    assert blocks.variants[0].func == r["block_1x128_ln_float16"].func
    assert blocks.variants[0].name == "block_quantize<__nv_bfloat16, 0, false, 0, false, __half, true>"
    t = [("ptr", "q_t"), ("ptr", "scale_inv_t")] if transpose else [("null",), ("null",)]
    assert params(blocks) == [("ptr", "x"), ("null",), ("ptr", "q"), ("ptr", "scale_inv"), *t, ("ptr", "amax"),
                              *[("null",)] * 3, ("ptr", "mean"), ("ptr", "rstd"), ("ptr", "weight"), ("ptr", "bias"),
                              ("imm", 300), ("imm", 4096), ("imm", 304), ("imm", 4096), ("imm", 1)]
    assert blocks.variants[0].grid == 3 * 32  # (304 x 4096: 3 x 32 tiles of 128)


def test_the_layernorm_plan_of_no_rows_only_zeroes_the_amax():
    assert PL.build_block_layernorm_plan(ln_refs(), SMS, 0, 1024, "float32").steps == (P.Memset(PL.BLOCK_SLOTS.amax, 4),)
