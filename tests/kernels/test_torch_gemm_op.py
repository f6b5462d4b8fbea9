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


def _reference(a, b, sa, sb):
    a64, b64 = a.cpu().double().numpy(), b.cpu().double().numpy()
    return (a64 @ b64.T) * sa * sb, (np.abs(a64) @ np.abs(b64).T) * sa * sb


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
    eps = 2.0 ** -8 if out == torch.bfloat16 else 2.0 ** -23
    for name, got in (("fp8_gemm_lt", op(a, b, *s, out)),
                      ("_scaled_mm", torch._scaled_mm(a, b.t(), scale_a=s[0], scale_b=s[1], out_dtype=out))):
        assert got.shape == (m, n) and got.dtype == out, name
        err = np.abs(got.double().cpu().numpy() - ref)
        # the split accumulator's error allowance of tests/jax/test_jax_gemm.py
        assert np.all(err <= eps * np.abs(ref) + 2.0 ** -9 * absref + 1e-30), (name, float(err.max()))


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
