"""fusedfp8::fp8_gemm_lt, the shim's cuBLASLt FP8 GEMM (fusedfp8/csrc/gemm.h) as a torch op
(fusedfp8/csrc/torch_gemm.h; defined when the torch shim loads; the torch layers' gemm='cublaslt'): its schema,
Meta kernel and argument checks on the CPU; on the GPU its values against a float64 reference and
torch._scaled_mm, under a CUDA graph and torch.compile."""
from __future__ import annotations

import numpy as np
import pytest

from support.shim import built as built_shim

torch = pytest.importorskip("torch")

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E4, E4), (E4, E5), (E5, E4)]
PAIR_IDS = ["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"]


@pytest.fixture(scope="module")
def op():
    built_shim("torch")  # loading it defines the op
    return torch.ops.fusedfp8.fp8_gemm_lt


def _meta(m, n, k, ta=E4, tb=E4):
    return (torch.empty(m, k, dtype=ta, device="meta"), torch.empty(n, k, dtype=tb, device="meta"),
            torch.empty(1, device="meta"), torch.empty(1, device="meta"))


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32])
def test_meta_kernel_gives_the_output_shape_and_dtype(op, out):
    y = op(*_meta(17, 48, 64), out)
    assert y.shape == (17, 48) and y.dtype == out and y.device.type == "meta"


@pytest.mark.parametrize("args, message", [
    (lambda: _meta(32, 48, 40), "multiples of 16"),
    (lambda: _meta(32, 40, 48), "output row stride must be a multiple of 16 elements; got 40"),
    (lambda: _meta(32, 48, 64, E5, E5), "no float8_e5m2 x float8_e5m2 GEMM"),
    (lambda: (*_meta(32, 48, 64)[:2], torch.empty(2, device="meta"), torch.empty(1, device="meta")),
     "scale_inv_a and scale_inv_b must be float32 tensors of one element"),
    (lambda: (torch.empty(32, 64, dtype=E4, device="meta"), torch.empty(48, 32, dtype=E4, device="meta"),
              *_meta(1, 1, 1)[2:]), "must agree on K"),
    (lambda: (torch.empty(32, 64, dtype=torch.bfloat16, device="meta"), *_meta(32, 48, 64)[1:]),
     "operands must be float8_e4m3fn or float8_e5m2"),
], ids=["ragged-k", "ragged-n", "e5m2xe5m2", "scale-shape", "k-mismatch", "a-bf16"])
def test_bad_arguments_are_refused_before_anything_runs(op, args, message):
    with pytest.raises(RuntimeError, match=message):
        op(*args(), torch.bfloat16)


def test_schema_takes_an_optional_bias_last():
    """Old callers (six arguments, positional or by name) are unchanged: bias comes last, default None."""
    built_shim("torch")
    args = torch.ops.fusedfp8.fp8_gemm_lt.default._schema.arguments
    assert [a.name for a in args] == ["a", "b", "scale_inv_a", "scale_inv_b", "out_dtype", "fast_accum", "bias"]
    assert args[-1].default_value is None and str(args[-1].type) == "Optional[Tensor]"


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_meta_kernel_with_a_bias(op, out, how):
    a, b, sa, sb = _meta(17, 48, 64, E4, E5)
    bias = torch.empty(48, dtype=out, device="meta")
    y = op(a, b, sa, sb, out, True, bias) if how == "positional" else op(a, b, sa, sb, out, fast_accum=True, bias=bias)
    assert y.shape == (17, 48) and y.dtype == out and y.device.type == "meta"
    assert op(a, b, sa, sb, out, bias=None).shape == (17, 48)


@pytest.mark.parametrize("bias, out, message", [
    (lambda: torch.empty(48, device="meta"), torch.bfloat16, "bias must have out_dtype.*got a Float bias"),
    (lambda: torch.empty(48, dtype=torch.bfloat16, device="meta"), torch.float32,
     "bias must have out_dtype, which must then be bfloat16 or float16"),
    (lambda: torch.empty(48, dtype=torch.float16, device="meta"), torch.bfloat16, "got a Half bias"),
    (lambda: torch.empty(64, dtype=torch.bfloat16, device="meta"), torch.bfloat16,
     r"bias must be 1-D of N = b.size\(0\) = 48 elements; got shape \[64\]"),
    (lambda: torch.empty(1, 48, dtype=torch.bfloat16, device="meta"), torch.bfloat16, "bias must be 1-D"),
    (lambda: torch.empty(48, dtype=torch.bfloat16), torch.bfloat16, "bias must be on the operands' device"),
], ids=["f32-bias", "f32-out", "f16-bias-bf16-out", "length", "2-d", "device"])
def test_a_bad_bias_is_refused_naming_it(op, bias, out, message):
    with pytest.raises(RuntimeError, match=message):
        op(*_meta(32, 48, 64), out, False, bias())


def test_the_workspace_is_settable_and_checked():
    """gemm_set_workspace returns the previous size (32 MiB to begin with, unless the layers set
    torch's); a negative size is refused naming the argument."""
    lib = built_shim("torch")
    before = lib.gemm_workspace()
    try:
        assert lib.gemm_set_workspace(1 << 20) == before and lib.gemm_workspace() == 1 << 20
        with pytest.raises(ValueError, match="bytes must be in 0 .. 2\\*\\*32; got -1"):
            lib.gemm_set_workspace(-1)
        assert lib.gemm_workspace() == 1 << 20
    finally:
        lib.gemm_set_workspace(before)


# ---- fp8_gemm_lt_block: the same GEMM with a scale per block (BlockScaling) ----------------------
def _block_scales(rows, k, block, device="meta"):
    from fusedfp8.numerics.block import scale_shape
    return torch.empty(scale_shape(rows, k, (block, 128)), device=device)


def _meta_block(m, n, k, a_block=1, b_block=128, ta=E4, tb=E4):
    return (torch.empty(m, k, dtype=ta, device="meta"), torch.empty(n, k, dtype=tb, device="meta"),
            _block_scales(m, k, a_block), _block_scales(n, k, b_block), a_block, b_block)


@pytest.mark.parametrize("blocks", [(1, 128), (128, 1), (1, 1)], ids=["1x128-128x128", "128x128-1x128", "1x128-1x128"])
def test_block_meta_kernel_gives_the_output_shape_and_dtype(blocks):
    built_shim("torch")
    op = torch.ops.fusedfp8.fp8_gemm_lt_block
    y = op(*_meta_block(48, 32, 400, *blocks), torch.bfloat16)
    assert y.shape == (48, 32) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    bias = torch.empty(32, dtype=torch.float16, device="meta")
    assert op(*_meta_block(48, 32, 400, *blocks), torch.float16, bias).shape == (48, 32)


@pytest.mark.parametrize("args, message", [
    (lambda: _meta_block(48, 32, 400, 128, 128), "no 128x128 x 128x128 block-scaled GEMM"),
    (lambda: (*_meta_block(48, 32, 400)[:4], 1, 64), "a_block and b_block must be 1 .* or 128"),
    (lambda: (*_meta_block(48, 32, 400)[:2], _block_scales(48, 384, 1), *_meta_block(48, 32, 400)[3:]),
     r"scale_inv_a must be a contiguous float32 tensor of 192 elements \(the 1x128 block scales of a \(48, 400\)"),
    (lambda: (*_meta_block(48, 32, 400)[:3], torch.empty(1, device="meta"), 1, 128),
     "scale_inv_b must be a contiguous float32 tensor of 4 elements"),
    (lambda: (*_meta_block(48, 32, 400)[:2], _block_scales(48, 400, 1).t(), *_meta_block(48, 32, 400)[3:]),
     "scale_inv_a must be a contiguous"),
    (lambda: _meta_block(48, 32, 40), "multiples of 16"),
    (lambda: _meta_block(48, 32, 400, ta=E5, tb=E5), "no float8_e5m2 x float8_e5m2 GEMM"),
], ids=["both-128x128", "block-64", "scale-a-size", "scale-b-size", "scale-a-strided", "ragged-k", "e5m2xe5m2"])
def test_block_bad_arguments_are_refused_before_anything_runs(args, message):
    built_shim("torch")
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fusedfp8.fp8_gemm_lt_block(*args(), torch.bfloat16)


def test_block_schema():
    built_shim("torch")
    args = torch.ops.fusedfp8.fp8_gemm_lt_block.default._schema.arguments
    assert [a.name for a in args] == ["a", "b", "scale_inv_a", "scale_inv_b", "a_block", "b_block", "out_dtype",
                                      "bias"]
    assert args[-1].default_value is None


@pytest.mark.parametrize("block", [False, True], ids=["per-tensor", "block"])
def test_meta_kernels_take_symbolic_sizes_under_compile(block):
    """torch.compile with dynamic shapes hands the Meta kernels symbolic sizes (a second token count
    recompiles so by default): they give the output's shape there instead of failing on the size
    checks (which the CUDA kernel runs on the real call)."""
    built_shim("torch")

    def gemm(a, b, sa, sb):
        if block:
            return torch.ops.fusedfp8.fp8_gemm_lt_block(a, b, sa, sb, 1, 128, torch.bfloat16)
        return torch.ops.fusedfp8.fp8_gemm_lt(a, b, sa, sb, torch.bfloat16)

    compiled = torch.compile(gemm, dynamic=True, backend="eager", fullgraph=True)
    for m in (48, 64):
        args = _meta_block(m, 32, 256)[:4] if block else _meta(m, 32, 256)
        y = compiled(*args)
        assert y.shape == (m, 32) and y.dtype == torch.bfloat16


def test_no_cpu_kernel(op):
    a, b = torch.zeros(16, 16, dtype=E4), torch.zeros(16, 16, dtype=E4)
    with pytest.raises(NotImplementedError, match="fp8_gemm_lt"):
        op(a, b, torch.ones(1), torch.ones(1), torch.bfloat16)


# ---- on the GPU -----------------------------------------------------------------------------------
def _operands(m, n, k, ta, tb, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 2).to(ta)
    b = (torch.randn(n, k, generator=g) * 2).to(tb)
    return a.cuda(), b.cuda()


def _reference(a, b, sa, sb, bias=None):
    a64, b64 = a.cpu().double().numpy(), b.cpu().double().numpy()
    ref, absref = (a64 @ b64.T) * sa * sb, (np.abs(a64) @ np.abs(b64).T) * sa * sb
    if bias is None:
        return ref, absref
    v = bias.cpu().double().numpy()
    return ref + v, absref + np.abs(v)


def _within_accumulation(got, ref, absref, out, fast=False):
    """The output's rounding plus the float32 accumulation allowance of tests/jax/test_jax_gemm.py
    (split accumulator 2**-9; fast accumulation 2**-7, as tests/pytorch/test_gemm_backend.py)."""
    eps = 2.0 ** -8 if out in (torch.bfloat16, torch.float16) else 2.0 ** -23
    err = np.abs(got.double().cpu().numpy() - ref)
    bound = eps * np.abs(ref) + (2.0 ** -7 if fast else 2.0 ** -9) * absref + 1e-30
    return float((err / bound).max())


@pytest.mark.gpu
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("mnk", [(2048, 4096, 1024), (1000, 80, 48), (17, 64, 32)], ids=str)
def test_fp8_gemm_lt_matches_float64_and_scaled_mm(op, mnk, pair, out):
    """Within the output's rounding plus float32 accumulation error of a float64 reference (the
    split accumulator), as torch._scaled_mm on the same operands is."""
    m, n, k = mnk
    a, b = _operands(m, n, k, *pair)
    sa, sb = 0.5, 2.0 ** -5
    s = (torch.tensor([sa], device="cuda"), torch.tensor([sb], device="cuda"))
    ref, absref = _reference(a, b, sa, sb)
    for name, got in (("fp8_gemm_lt", op(a, b, *s, out)),
                      ("_scaled_mm", torch._scaled_mm(a, b.t(), scale_a=s[0], scale_b=s[1], out_dtype=out))):
        assert got.shape == (m, n) and got.dtype == out, name
        assert _within_accumulation(got, ref, absref, out) <= 1.0, name


@pytest.mark.gpu
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("fast", [False, True], ids=["split", "fast"])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("mnk", [(2048, 4096, 1024), (1000, 80, 48), (17, 64, 32)], ids=str)
def test_fp8_gemm_lt_with_a_bias_matches_float64_and_scaled_mm(op, mnk, pair, out, fast):
    """The bias epilogue: round(sa * sb * acc + bias) within the same bound against float64 of the
    operands plus the bias, as torch._scaled_mm's bias on the same operands; a bias large against
    the product, so a bias left out or added twice fails."""
    m, n, k = mnk
    a, b = _operands(m, n, k, *pair, seed=2)
    sa, sb = 0.5, 2.0 ** -5
    s = (torch.tensor([sa], device="cuda"), torch.tensor([sb], device="cuda"))
    g = torch.Generator().manual_seed(3)
    bias = (torch.randn(n, generator=g) * 4).to(out).cuda()
    ref, absref = _reference(a, b, sa, sb, bias)
    assert np.abs(bias.double().cpu().numpy()).mean() > 0.5 * np.abs(ref).mean()  # the bias matters
    for name, got in (("fp8_gemm_lt", op(a, b, *s, out, fast, bias)),
                      ("_scaled_mm", torch._scaled_mm(a, b.t(), scale_a=s[0], scale_b=s[1], bias=bias, out_dtype=out,
                                                      use_fast_accum=fast))):
        assert got.shape == (m, n) and got.dtype == out, name
        assert _within_accumulation(got, ref, absref, out, fast) <= 1.0, name


@pytest.mark.gpu
@pytest.mark.fp8_gemm
def test_fp8_gemm_lt_bias_views_empty_k_and_graph_replay(op):
    """An offset bias view gives the bits of an aligned copy (the op copies it to an aligned buffer);
    K = 0 gives the bias itself; a captured call reads the bias from device memory at replay."""
    a, b = _operands(1000, 80, 48, E4, E4, seed=4)
    s = torch.tensor([0.25], device="cuda")
    store = torch.randn(81, device="cuda").to(torch.bfloat16)
    view = store[1:]  # 2 bytes past a 512-byte aligned block
    assert view.data_ptr() % 16
    torch.testing.assert_close(op(a, b, s, s, torch.bfloat16, False, view),
                               op(a, b, s, s, torch.bfloat16, False, view.clone()), rtol=0, atol=0)
    empty = op(a[:, :0], b[:, :0], s, s, torch.bfloat16, False, view)
    torch.testing.assert_close(empty, view.expand(1000, 80), rtol=0, atol=0)
    bias = view.clone()
    out = op(a, b, s, s, torch.bfloat16, True, bias)  # warm: the entry exists before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(a, b, s, s, torch.bfloat16, True, bias)
    bias.add_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, op(a, b, s, s, torch.bfloat16, True, bias), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.fp8_gemm
def test_fp8_gemm_lt_in_a_cuda_graph_and_compiled(op):
    a, b = _operands(1000, 80, 48, E4, E5, seed=1)
    s = torch.tensor([0.25], device="cuda")
    want = op(a, b, s, s, torch.bfloat16)
    out = op(a, b, s, s, torch.bfloat16)  # warm: the entry exists before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(a, b, s, s, torch.bfloat16)
    s.fill_(0.5)  # the graph reads the scale from device memory at replay
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, (want.float() * 4).to(torch.bfloat16), rtol=0, atol=0)  # both scales doubled
    compiled = torch.compile(lambda a, b, s: op(a, b, s, s, torch.bfloat16) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(a, b, s), op(a, b, s, s, torch.bfloat16) * 2, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("blocks", [(1, 128), (128, 1), (1, 1)], ids=["1x128-128x128", "128x128-1x128", "1x128-1x128"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("mnk", [(2048, 1024, 4096), (1008, 80, 304), (1008, 208, 304), (16, 16, 16)], ids=str)
def test_fp8_gemm_lt_block_matches_float64(mnk, pair, blocks, out):
    """Operands block-quantized by the NumPy definition (every block at its own magnitude, so that
    a scale read from the wrong block shows), the op's result against the float64 product of the
    dequantized operands; with a bias of the output's dtype in the epilogue for bf16."""
    from fusedfp8.numerics import block as B
    m, n, k = mnk
    rng = np.random.default_rng(m + n + k)
    fmts = ["e4m3" if t == E4 else "e5m2" for t in pair]
    qs, deqs = [], []
    for rows, fmt, blk, seed in ((m, fmts[0], blocks[0], 1), (n, fmts[1], blocks[1], 2)):
        x = (rng.standard_normal((rows, k)) * np.exp2(rng.integers(-8, 8, (rows, 1)))).astype(np.float32)
        q = B.block_quantize(x, fmt, (blk, 128), True)
        qs.append(q)
        deqs.append(B.block_dequantize(q.data, q.scale_inv, (blk, 128)).astype(np.float64))
    a, b = (torch.from_numpy(q.data.view(np.uint8)).cuda().view(t) for q, t in zip(qs, pair))
    sa, sb = (torch.from_numpy(q.scale_inv).cuda() for q in qs)
    bias = torch.linspace(-1, 1, n, device="cuda").to(out) if out == torch.bfloat16 else None
    y = torch.ops.fusedfp8.fp8_gemm_lt_block(a, b, sa, sb, blocks[0], blocks[1], out, bias)
    ref, absref = deqs[0] @ deqs[1].T, np.abs(deqs[0]) @ np.abs(deqs[1]).T
    if bias is not None:
        ref, absref = ref + bias.double().cpu().numpy(), absref + np.abs(bias.double().cpu().numpy())
    assert y.shape == (m, n) and y.dtype == out
    assert _within_accumulation(y, ref, absref, out) <= 1.0
