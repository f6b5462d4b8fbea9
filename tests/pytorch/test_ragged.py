"""Any shape (issue 19.1): GEMM dimensions that are not multiples of 16.

The quantize kernels write padded operands (``pad_to=16``: the (M, N) view rounded up, zeros in
the pad, the transpose likewise) in the same pass; the layers run the FP8 GEMMs on them and slice
the results. Tested here, on the CPU (reference) and the GPU (kernels), for every way to reach
it: the padded bytes against the reference's (ops, each op family, with and without transpose
and dbias), and each layer with ragged tokens / features against the same layer fed the
zero-padded problem (same GEMM shapes, so the same bytes), outputs, gradients and state."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import fusedfp8 as ff
import fusedfp8.pytorch as fp8
from fusedfp8.numerics import reference as ref
from support.frameworks import same_bytes, to_np

R = ff.DelayedScaling(amax_history_len=4)
SHAPES = [(303, 300), (8190, 64), (17, 33), (1, 1), (5, 16), (16, 5), (0, 20), (20, 0), (3, 7, 24)]
ID = lambda s: "x".join(map(str, s))  # noqa: E731


def _x(shape, device, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(device)


@pytest.mark.parametrize("transpose", [False, True], ids=["plain", "transpose"])
@pytest.mark.parametrize("op", ["identity", "gelu", "dgelu"])
@pytest.mark.parametrize("shape", SHAPES, ids=ID)
def test_padded_quantize_is_the_reference_in_a_corner_of_zeros(device, shape, op, transpose):
    x = _x(shape, device)
    dy = _x(shape, device, seed=1)
    scale = torch.tensor([3.0], device=device)
    kw = dict(transpose=transpose)

    def run(pad_to):
        if op == "identity":
            return ff.quantize(x, scale, "e4m3", pad_to=pad_to, **kw)
        if op == "gelu":
            return ff.gelu_quantize(x, scale, "e4m3", pad_to=pad_to, **kw)
        return ff.dgelu_quantize(dy, x, scale, "e5m2", dbias=True, pad_to=pad_to, **kw)

    plain, padded = run(1), run(16)
    rows = int(np.prod(shape[:-1]))
    cols = shape[-1]
    prows, pcols = -(-rows // 16) * 16, -(-cols // 16) * 16
    want = ref.pad2d(to_np(plain.data).reshape(rows, cols), prows, pcols)
    assert tuple(padded.data.shape) == (prows, pcols)
    assert same_bytes(padded.data, want)
    assert same_bytes(padded.amax, plain.amax), "the pad takes no part in the amax"
    if transpose:
        assert same_bytes(padded.data_t, ref.pad2d(to_np(plain.data_t), pcols, prows))
    if op == "dgelu":
        assert same_bytes(padded.dbias, plain.dbias), "nor in dbias"


def test_pad_to_is_checked_before_anything_is_written():
    amax = np.zeros(1, np.float32)
    for bad in (0, -16, 1.5, True, "16"):
        with pytest.raises(ValueError, match=f"pad_to must be a positive int .*got {bad!r}"):
            ff.quantize(np.ones((3, 3), np.float32), 1.0, amax=amax, pad_to=bad)
    assert amax[0] == 0


def _padded_twin(f: nn.Module, k_pad: int, n_pad: int) -> nn.Module:
    """The same Fp8Linear on a zero-padded problem: in_features + k_pad, out_features + n_pad,
    zeros in the new weight rows/columns and bias entries, the same state."""
    g = fp8.Fp8Linear(f.in_features + k_pad, f.out_features + n_pad, bias=f.bias is not None, recipe=R,
                      device=f.weight.device, dtype=f.weight.dtype)
    with torch.no_grad():
        g.weight.zero_()
        g.weight[:f.out_features, :f.in_features] = f.weight
        if f.bias is not None:
            g.bias.zero_()
            g.bias[:f.out_features] = f.bias
        for name, buf in f.named_buffers():
            getattr(g, name).copy_(buf)
    return g


@pytest.mark.parametrize("tokens, k, n", [(8190, 64, 128), (1000, 48, 50257 % 64 + 32), (24, 40, 16),
                                          (7, 16, 16), (3, 5, 9)])
def test_a_ragged_linear_equals_the_zero_padded_problem(device, tokens, k, n):
    """Fp8Linear on (tokens, k) -> n against the same layer on the problem padded with zeros to
    multiples of 16: the same FP8 GEMM shapes, so the same bytes in the output, dx, dw, db and the
    state, over three steps with updates between."""
    torch.manual_seed(0)
    f = fp8.Fp8Linear(k, n, recipe=R, device=device, dtype=torch.bfloat16)
    kp, np_, mp = (-(-d // 16) * 16 for d in (k, n, tokens))
    g = _padded_twin(f, kp - k, np_ - n)
    for step in range(3):
        x = _x((tokens, k), device, seed=10 + step).requires_grad_(True)
        xp = torch.zeros((mp, kp), dtype=x.dtype, device=device)
        xp[:tokens, :k] = x.detach()
        xp.requires_grad_(True)
        dy = _x((tokens, n), device, seed=20 + step)
        dyp = torch.zeros((mp, np_), dtype=dy.dtype, device=device)
        dyp[:tokens, :n] = dy
        y, yp = f(x), g(xp)
        assert y.shape == (tokens, n)
        assert same_bytes(y, yp[:tokens, :n]), f"step {step}: output"
        y.backward(dy)
        yp.backward(dyp)
        assert same_bytes(x.grad, xp.grad[:tokens, :k]), f"step {step}: dx"
        assert same_bytes(f.weight.grad, g.weight.grad[:n, :k]), f"step {step}: dw"
        assert same_bytes(f.bias.grad, g.bias.grad[:n]), f"step {step}: db"
        for name, buf in f.named_buffers():
            assert same_bytes(buf, getattr(g, name)), f"step {step}: {name}"
        fp8.update_model_scales(f)
        fp8.update_model_scales(g)
        f.weight.grad = g.weight.grad = f.bias.grad = g.bias.grad = None


@pytest.mark.parametrize("tokens", [8190, 1000, 3])
def test_a_ragged_token_count_in_the_mlp_equals_the_zero_padded_batch(device, tokens):
    """Fp8MLP with a ragged token count against the same MLP on the batch padded with zero rows
    (LayerNorm of a zero row is 0 with a zero LN bias; the fc1 bias is zeroed so gelu(0) = 0 keeps
    the padded rows out of the activation's amax): the same bytes in everything FP8 computes (not
    the LayerNorm's own parameter gradients: torch's bf16 reduction over another row count)."""
    torch.manual_seed(0)
    f = fp8.Fp8MLP(64, 128, recipe=R, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        f.fc1.bias.zero_()
    g = copy.deepcopy(f)
    mp = -(-tokens // 16) * 16
    for step in range(2):
        x = _x((tokens, 64), device, seed=step).requires_grad_(True)
        xp = torch.zeros((mp, 64), dtype=x.dtype, device=device)
        xp[:tokens] = x.detach()
        xp.requires_grad_(True)
        dy = _x((tokens, 64), device, seed=5 + step)
        dyp = torch.zeros((mp, 64), dtype=dy.dtype, device=device)
        dyp[:tokens] = dy
        y, yp = f(x), g(xp)
        assert same_bytes(y, yp[:tokens]), f"step {step}: output"
        y.backward(dy)
        yp.backward(dyp)
        assert same_bytes(x.grad, xp.grad[:tokens]), f"step {step}: dx"
        for (name, p), q in zip(f.named_parameters(), g.parameters()):
            if not name.startswith("norm."):  # torch's bf16 LayerNorm backward: another row count, other sums
                assert same_bytes(p.grad, q.grad), f"step {step}: {name}.grad"
        for (name, b), c in zip(f.named_buffers(), g.buffers()):
            assert same_bytes(b, c), f"step {step}: {name}"
        fp8.update_model_scales(f)
        fp8.update_model_scales(g)
        f.zero_grad()
        g.zero_grad()


@pytest.mark.parametrize("hidden, ffn, tokens", [(40, 72, 30), (64, 100, 64), (24, 48, 1)])
def test_ragged_features_in_the_mlp_follow_bf16(device, hidden, ffn, tokens):
    """Ragged hidden / ffn sizes (the pre-activation is sliced and copied): output and gradients
    within FP8's error of the bf16 MLP from the same weights (SQNR >= 20 dB)."""
    torch.manual_seed(0)
    f = fp8.Fp8MLP(hidden, ffn, recipe=R, device=device, dtype=torch.bfloat16)
    bf = copy.deepcopy(f)
    x = _x((tokens, hidden), device, seed=3)
    xb = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    y = f(x)
    h = bf.norm(xb)
    yb = bf.fc2(torch.nn.functional.gelu(bf.fc1(h), approximate="tanh"))  # the plain bf16 path
    assert y.shape == yb.shape == (tokens, hidden)
    dy = _x((tokens, hidden), device, seed=4)
    y.backward(dy)
    yb.backward(dy)

    def sqnr(a, b):
        a, b = a.double(), b.double()
        return 10 * torch.log10((b.square().sum() + 1e-30) / ((a - b).square().sum() + 1e-30)).item()

    assert sqnr(y, yb) >= 20
    assert sqnr(x.grad, xb.grad) >= 15
    for (name, p), q in zip(f.named_parameters(), bf.named_parameters()):
        if p.grad is not None and "norm" not in name:
            assert sqnr(p.grad, q[1].grad) >= 15, name


def test_custom_ops_report_padded_shapes_to_the_compiler():
    """The fake (meta) implementations give the padded shapes (torch.compile traces them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    st = ff.ScalingState.create(3, R, like=torch.zeros(1))
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.ones(1000, 40, dtype=torch.bfloat16))
        hist, s, si, u = (mode.from_tensor(t) for t in (st.amax_history, st.scale, st.scale_inv, st.updates))
        q, q_t, _ = torch.ops.fusedfp8.quantize_t(x, hist, s, si, u, 0, "e4m3", 1.0, True, 16)
        assert tuple(q.shape) == (1008, 48) and tuple(q_t.shape) == (48, 1008)
        q, _ = torch.ops.fusedfp8.quantize(x, hist, s, si, u, 0, "e4m3", 1.0, True)
        assert tuple(q.shape) == (1000, 40)
