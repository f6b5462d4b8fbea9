"""The block-scaled FP8 linear in torch (fusedfp8.pytorch.block_layers): block_linear and
Fp8BlockLinear, which Fp8Linear / from_linear / convert_to_fp8 build for a BlockScaling recipe.

On the CPU the forward and both gradients are held against the NumPy definition: each operand
block-quantized by fusedfp8.numerics.block (the bytes the kernels write), dequantized, and
multiplied in float64 -- the emulation's float32 product may differ from that only by its own
rounding. The modules: construction through every entry point, parameters taken over, a state
dict that is nn.Linear's, no update to do, copies, torch.compile, training, arguments refused by
name. On the GPU (marked): both CUDA GEMMs (the shim's cuBLASLt block GEMM and torch._scaled_mm's
blockwise path) against the same definition, on ragged and aligned shapes."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.numerics import block as B
from fusedfp8.numerics import reference as ref
from fusedfp8.pytorch import gemm as G
from fusedfp8.pytorch.block_layers import Fp8BlockLinear, block_linear
from support.block import inputs

RECIPES = {
    "default": fusedfp8.BlockScaling(),  # 1x128 activations, 128x128 weights, E4M3, power-of-two scales
    "1x128w-hybrid-exact": fusedfp8.BlockScaling(weight_block=(1, 128), fp8_format="hybrid",
                                                 power_of_two_scales=False),
}
SHAPES = {"aligned-256x384x128": (256, 384, 128), "ragged-17x300x200": (17, 300, 200),
          "ragged-130x48x49": (130, 48, 49), "3d-2x5x130x64": ((2, 5), 130, 64)}


def _deq(q: B.BlockQuantized, block, transposed: bool = False) -> np.ndarray:
    data, s = (q.data_t, q.scale_inv_t) if transposed else (q.data, q.scale_inv)
    return B.block_dequantize(data, s, block).astype(np.float64)


def _reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, g: np.ndarray, recipe) -> dict:
    """{name: (float64 value, the sum of |products| bounding its float32 rounding)} of y, dx, dw
    from the NumPy definition's bytes (x, g as 2-D float32)."""
    fwd, grd, wb = recipe.format_for(False), recipe.format_for(True), recipe.weight_block
    p2 = recipe.power_of_two_scales
    qx = B.block_quantize(x, fwd, (1, 128), p2, True)
    qw = B.block_quantize(w, fwd, wb, p2, True)
    qg = B.block_quantize(g, grd, (1, 128), p2, True)
    bias = 0 if b is None else b.astype(np.float64)
    pairs = {"y": (_deq(qx, (1, 128)), _deq(qw, wb)),
             "dx": (_deq(qg, (1, 128)), _deq(qw, wb, transposed=True)),
             "dw": (_deq(qg, (1, 128), transposed=True), _deq(qx, (1, 128), transposed=True))}
    out = {k: (a @ c.T, np.abs(a) @ np.abs(c).T) for k, (a, c) in pairs.items()}
    out["y"] = (out["y"][0] + bias, out["y"][1] + np.abs(bias))
    return out


def _close(got: torch.Tensor, want: np.ndarray, scale: np.ndarray, what: str, rtol: float = 1e-5) -> None:
    """|got - want| <= rtol * scale elementwise (scale: the sum of |products|, which bounds the
    float32 product's rounding error, K * 2**-24 of it)."""
    err = np.abs(got.detach().double().numpy().reshape(want.shape) - want)
    bad = err > rtol * scale + 1e-30
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, worst {float((err / (scale + 1e-30)).max()):.3g}"


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_forward_and_gradients_are_the_block_definition(shape, recipe):
    lead, k, n = shape
    lead = lead if isinstance(lead, tuple) else (lead,)
    m = int(np.prod(lead))
    x = inputs((m, k), "float32", m + k)
    w = inputs((n, k), "float32", n + 1) * np.float32(0.05)
    b = np.linspace(-1, 1, n, dtype=np.float32)
    g = inputs((m, n), "float32", k + n + 2)
    xt = torch.from_numpy(x).reshape(*lead, k).requires_grad_(True)
    wt, bt = torch.from_numpy(w).requires_grad_(True), torch.from_numpy(b).requires_grad_(True)
    y = block_linear(xt, wt, bt, recipe)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    y.backward(torch.from_numpy(g).reshape(*lead, n))
    ref = _reference(x, w, b, g, recipe)
    for got, name in ((y, "y"), (xt.grad, "dx"), (wt.grad, "dw")):
        _close(got, *ref[name], name)
    _close(bt.grad, g.astype(np.float64).sum(0), np.abs(g).astype(np.float64).sum(0), "db")


def test_bf16_input_and_float32_master_weight():
    """The output and dx in the input's dtype, dw in the weight's (float32 master weights)."""
    x = torch.from_numpy(inputs((32, 256), "float32", 3)).bfloat16().requires_grad_(True)
    lin = fp8.Fp8Linear(256, 64, recipe=fusedfp8.BlockScaling())
    y = lin(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert lin.weight.grad.dtype == torch.float32 and lin.bias.grad.dtype == torch.float32
    ref = x.detach().float() @ lin.weight.detach().T + lin.bias.detach()
    assert float((y.detach().float() - ref).abs().max() / ref.abs().max()) < 0.1  # FP8 operands: a few percent


def test_without_gradients_only_the_forward_runs():
    lin = fp8.Fp8Linear(128, 32, recipe=fusedfp8.BlockScaling())
    x = torch.randn(16, 128)
    with torch.no_grad():
        y0 = lin(x)
    y1 = lin(x)
    assert not y0.requires_grad and torch.equal(y0, y1.detach())
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    xg = x.clone().requires_grad_(True)
    lin(xg).sum().backward()  # dx only (the forward wrote no transpose of the input)
    assert xg.grad is not None and lin.weight.grad is None


# ---- the modules ------------------------------------------------------------------------------
def test_every_entry_point_builds_the_block_module():
    r = fusedfp8.BlockScaling()
    assert type(fp8.Fp8Linear(64, 32, recipe=r)) is Fp8BlockLinear
    assert type(fp8.Fp8Linear(64, 32, True, r)) is Fp8BlockLinear  # the recipe positionally
    assert type(fp8.Fp8Linear(64, 32)) is fp8.Fp8Linear  # the per-tensor default is unchanged
    lin = nn.Linear(64, 32)
    m = fp8.Fp8Linear.from_linear(lin, r)
    assert type(m) is Fp8BlockLinear and m.weight is lin.weight and m.bias is lin.bias and m.recipe is r
    model = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
    w0 = model[0].weight
    out = fp8.convert_to_fp8(model, r)
    assert out is model and type(model[0]) is Fp8BlockLinear and type(model[2]) is Fp8BlockLinear
    assert model[0].weight is w0
    assert fp8.fp8_modules(model) == []  # no per-tensor state among them
    fp8.update_model_scales(model)  # nothing to update: does nothing
    hand = nn.Sequential(Fp8BlockLinear(64, 32, recipe=r))
    fp8.update_model_scales(hand)  # built by hand (no conversion report): also nothing to do


def test_state_dict_is_a_linear_one_and_copies_work():
    r = fusedfp8.BlockScaling(weight_block=(1, 128))
    m = fp8.Fp8Linear(130, 20, recipe=r)
    lin = nn.Linear(130, 20)
    assert set(m.state_dict()) == set(lin.state_dict()) == {"weight", "bias"}
    m.load_state_dict(lin.state_dict())
    assert torch.equal(m.weight, lin.weight)
    x = torch.randn(3, 130)
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(twin) is Fp8BlockLinear and twin.recipe == r and twin.gemm == m.gemm
        assert torch.equal(twin(x), m(x))
    assert "recipe=BlockScaling(" in repr(m)


@pytest.mark.parametrize("build, error, message", [
    (lambda: fp8.Fp8Linear(8, 8, recipe=fusedfp8.BlockScaling(), gemm="cutlass"), ValueError, "gemm must be one of"),
    (lambda: fp8.Fp8Linear(8, 8, recipe=fusedfp8.BlockScaling(), missed_update="never"), ValueError,
     "missed_update must be one of"),
    (lambda: fp8.Fp8Linear(8, 8, recipe=fusedfp8.BlockScaling(), amax_group=object()), ValueError,
     "amax_group is for CurrentScaling"),
    (lambda: Fp8BlockLinear(8, 8, recipe=fusedfp8.DelayedScaling()), TypeError, "must be a fusedfp8.BlockScaling"),
    (lambda: fp8.convert_to_fp8(nn.Linear(8, 8), fusedfp8.BlockScaling(), amax_group=object()), ValueError,
     "amax_group is for CurrentScaling"),
    (lambda: Fp8BlockLinear.from_linear(nn.Conv1d(1, 1, 1)), TypeError,
     "linear must be an nn.Linear"),
    (lambda: type("Sub", (fp8.Fp8Linear,), {})(8, 8, recipe=fusedfp8.BlockScaling()), TypeError,
     r"recipe: a fusedfp8\.BlockScaling is not accepted here"),
], ids=["gemm", "missed_update", "amax_group", "per-tensor-recipe", "convert-amax_group", "from-not-linear",
        "stateful-subclass"])
def test_bad_arguments_are_refused_by_name(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize("call, error, message", [
    (lambda m: m(torch.zeros(4, 9)), ValueError, "must have 8 features"),
    (lambda m: m(torch.zeros(4, 8, dtype=torch.int32)), TypeError, "input must be float32, float16 or bfloat16"),
    (lambda m: block_linear(torch.zeros(4, 8), m.weight, None, fusedfp8.DelayedScaling()), TypeError,
     "recipe must be a fusedfp8.BlockScaling"),
    (lambda m: block_linear(torch.zeros(4, 8), m.weight, torch.zeros(3), fusedfp8.BlockScaling()), ValueError,
     r"bias must be None or a tensor of shape \(8,\)"),
    (lambda m: block_linear(torch.zeros(4, 8), m.weight[0], None, fusedfp8.BlockScaling()), ValueError,
     "weight must be a 2-D torch.Tensor"),
], ids=["features", "int-input", "per-tensor-recipe", "bias-shape", "weight-1d"])
def test_bad_inputs_are_refused_before_anything_runs(call, error, message):
    m = Fp8BlockLinear(8, 8)
    with pytest.raises(error, match=message):
        call(m)


def test_compiled_is_the_eager_result():
    """torch.compile (fullgraph, aot_eager: the custom ops' fake implementations and the autograd
    function traced) gives the eager bytes, forward and gradients."""
    torch.manual_seed(0)
    m = fp8.Fp8Linear(130, 48, recipe=fusedfp8.BlockScaling())
    x = torch.randn(20, 130, requires_grad=True)
    y = m(x)
    y.square().sum().backward()
    want = (y.detach(), x.grad.clone(), m.weight.grad.clone(), m.bias.grad.clone())
    x.grad = None
    m.zero_grad()
    yc = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    yc.square().sum().backward()
    for got, w in zip((yc.detach(), x.grad, m.weight.grad, m.bias.grad), want):
        assert torch.equal(got, w)


def test_a_block_scaled_model_trains_as_its_float32_twin():
    """Twenty SGD steps of a two-layer regression: the FP8 model's loss falls as the float32 one's
    and ends within 5% of it."""
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 128))
    model = fp8.convert_to_fp8(copy.deepcopy(ref), fusedfp8.BlockScaling())
    x, target = torch.randn(64, 256), torch.randn(64, 128) * 0.1
    losses = {}
    for name, net in (("fp32", ref), ("fp8", model)):
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        losses[name] = []
        for _ in range(20):
            loss = (net(x) - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    first, last = losses["fp32"][0], losses["fp32"][-1]
    assert abs(losses["fp8"][0] - first) < 0.05 * first  # the same model at the start, up to FP8
    assert last < 0.8 * first and losses["fp8"][-1] < 1.05 * last, losses


def test_the_cpu_emulation_reads_the_scale_layout():
    """block_scaled_mm's CPU path against numerics.block.expand_scales on both block shapes."""
    x = inputs((48, 300), "float32", 5)
    w = inputs((40, 300), "float32", 6)
    for wb in ((128, 128), (1, 128)):
        qa, qb = B.block_quantize(x, "e4m3", (1, 128), True), B.block_quantize(w, "e4m3", wb, True)
        y = G.block_scaled_mm(*(torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
                                for a in (qa.data, qb.data)),
                              torch.from_numpy(qa.scale_inv), torch.from_numpy(qb.scale_inv), 1, wb[0], None,
                              torch.float32)
        a, c = _deq(qa, (1, 128)), _deq(qb, wb)
        _close(y, a @ c.T, np.abs(a) @ np.abs(c).T, f"weight block {wb}")


@pytest.mark.parametrize("blocks", [(1, 128), (128, 1)], ids=["1x128-128x128", "128x128-1x128"])
@pytest.mark.parametrize("mnk", [(48, 300, 304), (300, 48, 640), (256, 256, 512), (48, 100, 304)], ids=str)
def test_the_scaled_mm_views_are_what_torch_checks_and_give_the_same_product(mnk, blocks):
    """For torch._scaled_mm's blockwise recipes the scales are views that its checks accept: a 128x128
    scale of more than one block row (ceil(rows/128), ceil(K/128)) with row stride exactly
    ceil(K/128), where our layout pads each row's K blocks to a multiple of 4 -- so where ceil(K/128)
    is not, K is padded (zero bytes, scale rows of 1), which must leave the product unchanged (the
    CPU emulation on the padded operands against the float64 product of the unpadded ones); 1x128
    scales (M, ceil(K/128)) with strides (1, pad4(M))."""
    m, n, k = mnk
    a_blk, b_blk = blocks
    qa = B.block_quantize(inputs((m, k), "float32", 7), "e4m3", (a_blk, 128), True)
    qb = B.block_quantize(inputs((n, k), "float32", 8), "e4m3", (b_blk, 128), True)
    a, b = (torch.from_numpy(q.data.view(np.uint8)).view(torch.float8_e4m3fn) for q in (qa, qb))
    sa, sb = torch.from_numpy(qa.scale_inv), torch.from_numpy(qb.scale_inv)
    pa, pb, psa, psb, kp = G._k_padded_for_scaled_mm(a, b, sa, sb, a_blk, b_blk, m, n, k)
    kb, kbp = -(-k // 128), -(-kp // 128)
    rows128 = m if a_blk == 128 else n
    assert kp == (k if kb % 4 == 0 or rows128 <= 128 else 128 * (-(-kb // 4) * 4))
    assert pa.shape == (m, kp) and pb.shape == (n, kp) and pa.dtype == a.dtype and pb.dtype == b.dtype
    for rows, s, blk, op in ((m, psa, a_blk, "a"), (n, psb, b_blk, "b")):
        v = G._scaled_mm_scale(s, rows, kp, blk, op)
        if blk == 1:
            want = ((rows, kbp), (1, -(-rows // 4) * 4)) if op == "a" else ((kbp, rows), (-(-rows // 4) * 4, 1))
        else:
            rb = -(-rows // 128)
            want = ((rb, kbp), (kbp, 1)) if op == "a" else ((kbp, rb), (1, kbp))
            if rb == 1:  # torch checks no row stride of a single block row
                want = (want[0], v.stride())
        assert (tuple(v.shape), v.stride()) == want, (op, blk)
    da, db = _deq(qa, (a_blk, 128)), _deq(qb, (b_blk, 128))
    yp = G.block_scaled_mm(pa, pb, psa, psb, a_blk, b_blk, None, torch.float32)
    _close(yp, da @ db.T, np.abs(da) @ np.abs(db).T, "padded")


# ---- on the GPU -------------------------------------------------------------------------------
CUDA_SHAPES = {"aligned-2048x1024x4096": (2048, 1024, 4096), "ragged-1000x300x200": (1000, 300, 200),
               "small-16x128x16": (16, 128, 16), "ragged-k-300x640x300": (300, 640, 300)}


@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("gemm", ["cublaslt", "scaled_mm"])
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
@pytest.mark.parametrize("shape", list(CUDA_SHAPES.values()), ids=list(CUDA_SHAPES))
def test_cuda_linear_is_the_block_definition(shape, recipe, gemm):
    """Forward and both gradients on CUDA against the float64 product of the NumPy definition's
    operands (the kernels write those bytes): within the allowance of cuBLASLt's split accumulator
    that tests/kernels/test_torch_gemm_op.py gives the per-tensor GEMM (2**-9 of the sum of
    |products|)."""
    m, k, n = shape
    x = inputs((m, k), "float32", m + k)
    w = inputs((n, k), "float32", n + 1) * np.float32(0.05)
    g = inputs((m, n), "float32", k + n + 2)
    b = np.linspace(-1, 1, n, dtype=np.float32)
    xt = torch.from_numpy(x).cuda().requires_grad_(True)
    lin = fp8.Fp8Linear(k, n, recipe=recipe, gemm=gemm, device="cuda")
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    y = lin(xt)
    y.backward(torch.from_numpy(g).cuda())
    ref = _reference(x, w, b, g, recipe)
    for got, name in ((y, "y"), (xt.grad, "dx"), (lin.weight.grad, "dw")):
        _close(got.cpu(), *ref[name], name, rtol=2.0 ** -9)  # the split accumulator's allowance (float32 out)


@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("gemm", ["cublaslt", "scaled_mm"])
def test_cuda_bf16_linear_with_its_bias_in_the_epilogue(gemm):
    m, k, n = 512, 384, 256
    x = inputs((m, k), "float32", 9)
    w = inputs((n, k), "float32", 10) * np.float32(0.05)
    b = np.linspace(-1, 1, n, dtype=np.float32)
    lin = fp8.Fp8Linear(k, n, recipe=fusedfp8.BlockScaling(), gemm=gemm, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    xb = torch.from_numpy(x).cuda().bfloat16()
    y = lin(xb)
    w_b = lin.weight.detach().float().cpu().numpy()
    y_ref, _ = _reference(xb.float().cpu().numpy(), w_b, lin.bias.detach().float().cpu().numpy(),
                          np.zeros((m, n), np.float32), fusedfp8.BlockScaling())["y"]
    err = np.abs(y.float().cpu().numpy() - y_ref).max() / np.abs(y_ref).max()
    assert y.dtype == torch.bfloat16 and err < 8e-3  # one bf16 rounding of the epilogue's sum


@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.fp8_gemm
def test_cuda_compiled_block_linear_matches_eager():
    lin = fp8.Fp8Linear(256, 128, recipe=fusedfp8.BlockScaling(), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    yc = torch.compile(lin, fullgraph=True)(x)
    assert torch.equal(y, yc)


@pytest.mark.gpu
@pytest.mark.block_gemm
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("gemm", ["cublaslt", "scaled_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_block_mlp_is_the_cpu_one(dtype, gemm):
    """Fp8BlockMLP on CUDA (the fused gelu / dgelu+dbias kernels, the block GEMMs) against the same
    module on the CPU (the NumPy definition's bytes, the float32 emulation of the GEMMs): the output
    and every gradient within 2**-6 of their largest magnitude (the GEMMs' accumulation differs,
    and an activation re-quantized after it may take a neighbouring FP8 value)."""
    torch.manual_seed(4)
    cpu = fp8.Fp8MLP(320, 1000, fusedfp8.BlockScaling(), dtype=dtype)
    gpu = copy.deepcopy(cpu).cuda()
    gpu.fc1.gemm = gpu.fc2.gemm = gemm
    x = torch.randn(4, 300, 320, dtype=dtype)

    def run(m, dev):
        xd = x.to(dev).requires_grad_(True)
        m(xd).float().square().sum().backward()
        return [t.detach().float().cpu() for t in (m(xd), xd.grad, m.fc1.weight.grad, m.fc1.bias.grad,
                                                    m.fc2.weight.grad, m.fc2.bias.grad, m.norm.weight.grad)]

    for name, a, b in zip(("y", "dx", "dw1", "db1", "dw2", "db2", "dnorm"), run(gpu, "cuda"), run(cpu, "cpu")):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 2.0 ** -6, (name, err)


class _DefinitionGelu(torch.autograd.Function):
    """gelu and its backward as the kernels compute them: float32, the NumPy definition's
    (fusedfp8.numerics.reference.activation), which the fused block MLP quantizes."""

    @staticmethod
    def forward(ctx, z, approximate):
        ctx.save_for_backward(z)
        ctx.approximate = approximate
        return torch.from_numpy(ref.activation("gelu", z.detach().numpy(), None, approximate))

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return torch.from_numpy(ref.activation("dgelu", g.numpy(), z.detach().numpy(), ctx.approximate)), None


class _DefinitionLayerNorm(torch.autograd.Function):
    """LayerNorm as the fused kernels compute it (float32, fusedfp8.numerics.layernorm's op order and
    summation, which block_layernorm_quantize quantizes), and the backward the fused MLP runs from
    its mean and rstd (torch's, fusedfp8.pytorch.autograd._layernorm_backward)."""

    @staticmethod
    def forward(ctx, x, w, b, eps):
        from fusedfp8.numerics import layernorm as LN

        y, mean, rstd = LN.layernorm_f32(x.detach().numpy(), *(None if p is None else p.detach().numpy() for p in (w, b)),
                                         eps)
        mean, rstd = torch.from_numpy(mean), torch.from_numpy(rstd)
        ctx.save_for_backward(x, mean, rstd, w, b)
        return torch.from_numpy(y).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        from fusedfp8.pytorch.autograd import _layernorm_backward

        x, mean, rstd, w, b = ctx.saved_tensors
        dx, dw, db = _layernorm_backward(g.reshape(-1, x.shape[-1]).contiguous(), x.reshape(-1, x.shape[-1]), mean,
                                         rstd, w, b, (w is not None, b is not None))
        return dx.reshape(x.shape), dw, db, None


def _output_and_grads(fn, x, m, params) -> tuple:
    """fn(x) and, after backward of its squares' sum, the gradients of x and of ``params`` (m's cleared first)."""
    x.grad = None
    m.zero_grad()
    y = fn(x)
    y.square().sum().backward()
    return (y.detach(), x.grad.clone(), *(p.grad.clone() for p in params))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_fp8_mlp_under_block_scaling_is_its_composition_with_the_gelu_fused(approximate):
    """Fp8MLP(recipe=BlockScaling()) builds Fp8BlockMLP: the per-tensor Fp8MLP's parameter names
    (state dicts carry over), no state, and bit for bit the kernels' LayerNorm (fused into the
    quantization of fc1's input) -> block linear -> the kernels' gelu -> block linear, forward and
    every gradient (the biases' too: fc1's from the fused dgelu, fc2's from the output gradient's
    quantization, the LayerNorm's from torch's backward on the saved statistics), on a ragged
    shape (every GEMM dimension padded); with fuse_layernorm off, torch's LayerNorm then the
    same."""
    from fusedfp8.pytorch.block_layers import Fp8BlockMLP

    torch.manual_seed(3)
    r = fusedfp8.BlockScaling()
    m = fp8.Fp8MLP(130, 260, r, approximate=approximate)
    assert type(m) is Fp8BlockMLP and m.recipe is r
    per_tensor = fp8.Fp8MLP(130, 260)
    assert {k for k in per_tensor.state_dict() if k.endswith(("weight", "bias"))} == set(m.state_dict())
    m.load_state_dict({k: v for k, v in per_tensor.state_dict().items() if k in m.state_dict()})
    x = torch.randn(3, 7, 130, requires_grad=True)
    params = (m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias, m.norm.weight, m.norm.bias)

    def run(fn):
        return _output_and_grads(fn, x, m, params)

    def composition(x, fused=True):
        h = (_DefinitionLayerNorm.apply(x, m.norm.weight, m.norm.bias, m.norm.eps) if fused else
             torch.nn.functional.layer_norm(x, (130,), m.norm.weight, m.norm.bias, m.norm.eps))
        z = block_linear(h, m.fc1.weight, m.fc1.bias, r)
        return block_linear(_DefinitionGelu.apply(z, approximate), m.fc2.weight, m.fc2.bias, r)

    got, want = run(m), run(composition)
    names = ("y", "dx", "dw1", "db1", "dw2", "db2", "dnorm_w", "dnorm_b")
    for name, a, b in zip(names, got, want):
        assert torch.equal(a, b), name
    m.fuse_layernorm = False
    for name, a, b in zip(names, run(m), run(lambda x: composition(x, False))):
        assert torch.equal(a, b), ("unfused", name)
    m.fuse_layernorm = True
    if approximate == "tanh":  # and compiled whole (aot_eager: the same ops, one graph)
        for name, a, b in zip(names, run(torch.compile(m, backend="aot_eager", fullgraph=True)), got):
            assert torch.equal(a, b), name
    # and close to torch's own gelu (the FP8 rounding of the activation dominates)
    plain = run(lambda x: m.fc2(torch.nn.functional.gelu(m.fc1(m.norm(x)), approximate=approximate)))
    assert torch.allclose(got[0], plain[0], rtol=0.05, atol=0.05 * float(plain[0].abs().max()))
    with pytest.raises(TypeError, match=r"recipe: a fusedfp8\.BlockScaling is not accepted here"):
        type("Sub", (fp8.Fp8MLP,), {})(8, 16, r)


@pytest.mark.parametrize("norm", ["no-bias", "no-affine"])
def test_the_fused_layernorm_without_a_bias_or_any_parameter(norm):
    """nn.LayerNorm(bias=False) and nn.LayerNorm(elementwise_affine=False) in Fp8BlockMLP: fused
    (a missing weight is 1, a missing bias -0: the kernels' exact identities), bit for bit the
    kernels' LayerNorm -> block linear -> gelu -> block linear, forward and every gradient."""
    torch.manual_seed(5)
    r = fusedfp8.BlockScaling(fp8_format="hybrid")
    m = fp8.Fp8MLP(130, 200, r)
    m.norm = torch.nn.LayerNorm(130, bias=False) if norm == "no-bias" else torch.nn.LayerNorm(
        130, elementwise_affine=False)
    x = torch.randn(5, 130, requires_grad=True)
    params = [p for p in (m.fc1.weight, m.fc1.bias, m.fc2.weight, m.fc2.bias, m.norm.weight) if p is not None]

    def run(fn):
        return _output_and_grads(fn, x, m, params)

    def composition(x):
        h = _DefinitionLayerNorm.apply(x, m.norm.weight, None, m.norm.eps)
        z = block_linear(h, m.fc1.weight, m.fc1.bias, r)
        return block_linear(_DefinitionGelu.apply(z, "tanh"), m.fc2.weight, m.fc2.bias, r)

    for k, (a, b) in enumerate(zip(run(m), run(composition))):
        assert torch.equal(a, b), k


def test_the_block_mlp_runs_the_fused_kernels_and_only_what_a_gradient_needs(monkeypatch):
    """The forward quantizes fc1's input with the LayerNorm fused (with its transpose) and fc2's
    with the gelu op, and the backward fc1's output gradient with the dgelu op and dbias; with
    frozen weights and no input gradient no transposes are written and fc1's gelu gradient is
    skipped when nothing before fc2 needs one; a frozen input with a trainable LayerNorm still takes
    the gradient through fc1 (the LayerNorm's parameters need it)."""
    from fusedfp8.pytorch import block_layers as BL

    calls, real, real_ln = [], BL.block_quantize_op, BL.block_layernorm_quantize_op

    def spy(x, fmt, ws, p2, weight, grad, transpose, pad, op="identity", b=None, approximate="tanh", dbias=False):
        calls.append((op, weight, grad, transpose, dbias))
        return real(x, fmt, ws, p2, weight, grad, transpose, pad, op, b, approximate, dbias)

    def spy_ln(x, w, b, eps, fmt, p2, transpose, pad):
        calls.append(("layernorm", False, False, transpose, False))
        return real_ln(x, w, b, eps, fmt, p2, transpose, pad)

    monkeypatch.setattr(BL, "block_quantize_op", spy)
    monkeypatch.setattr(BL, "block_layernorm_quantize_op", spy_ln)
    m = fp8.Fp8MLP(128, 256, fusedfp8.BlockScaling())
    x = torch.randn(32, 128, requires_grad=True)
    m(x).sum().backward()
    acts = [c for c in calls if not c[1]]
    assert acts == [("layernorm", False, False, True, False), ("gelu", False, False, True, False),
                    ("identity", False, True, True, True), ("dgelu", False, True, True, True)]
    calls.clear()
    m.zero_grad()
    m(x.detach()).sum().backward()  # x frozen: the LayerNorm's weight and bias still get their gradients
    assert m.norm.weight.grad is not None and m.norm.bias.grad is not None and m.norm.weight.grad.abs().sum() > 0
    calls.clear()
    for p in m.parameters():
        p.requires_grad_(False)
    m(x.detach()).sum()
    assert [c for c in calls if not c[1]] == [("layernorm", False, False, False, False),
                                              ("gelu", False, False, False, False)]


# ---- the FP8 weight cache -------------------------------------------------------------------------
def _count_weight_quantizations(monkeypatch) -> list:
    from fusedfp8.pytorch import block_layers as BL

    calls, real = [], BL.block_quantize_op
    monkeypatch.setattr(BL, "block_quantize_op", lambda x, *a: calls.append(a[3]) or real(x, *a))  # a[3]: weight
    return calls


@pytest.mark.parametrize("optimizer", ["sgd-foreach", "adam-fused", "data-assigned"])
def test_the_weight_is_quantized_once_per_step_and_again_after_it(monkeypatch, optimizer):
    """Gradient accumulation: the micro-batches of one step quantize the weight once (the same
    gradients as without the cache); the step (a fused optimizer too, which leaves the version
    counter alone) or an assigned .data makes the next forward quantize it again."""
    torch.manual_seed(4)
    cached = fp8.Fp8Linear(130, 40, recipe=fusedfp8.BlockScaling())
    plain = copy.deepcopy(cached)
    plain.cache_fp8_weight = False
    xs = [torch.randn(8, 130) for _ in range(3)]
    calls = _count_weight_quantizations(monkeypatch)
    for x in xs:
        cached(x).square().sum().backward()
    assert calls.count(True) == 1
    for x in xs:
        plain(x).square().sum().backward()
    assert calls.count(True) == 4 and torch.equal(cached.weight.grad, plain.weight.grad)
    if optimizer == "data-assigned":
        cached.weight.data = cached.weight.data * 0.5
    else:
        opt = (torch.optim.SGD(cached.parameters(), lr=0.1, foreach=True) if optimizer == "sgd-foreach" else
               torch.optim.Adam(cached.parameters(), lr=0.1, fused=True))
        opt.step()
    y = cached(xs[0])
    assert calls.count(True) == 5
    cached.cache_fp8_weight = False
    assert torch.equal(cached(xs[0]), y) and calls.count(True) == 6


def test_a_forward_without_gradients_does_not_serve_one_that_needs_the_transpose(monkeypatch):
    m = fp8.Fp8Linear(130, 40, recipe=fusedfp8.BlockScaling())
    x = torch.randn(8, 130, requires_grad=True)
    calls = _count_weight_quantizations(monkeypatch)
    with torch.no_grad():
        m(x)
    m(x).sum().backward()  # needs the weight's transpose: quantized again, with it
    m(x).sum().backward()
    assert calls.count(True) == 2 and x.grad is not None
    twin = copy.deepcopy(m)  # a copy starts with an empty cache
    twin(x)
    assert calls.count(True) == 3


def test_inference_mode_and_a_parametrized_weight(monkeypatch):
    """A forward under torch.inference_mode fills a cache entry that a later training forward can
    use (it is made outside inference mode); a parametrized weight (weight_norm) is quantized at
    every forward, never cached, and its gradient reaches the parametrization's parameters."""
    m = fp8.Fp8Linear(130, 40, recipe=fusedfp8.BlockScaling())
    m.weight.requires_grad_(False)  # (x needs no gradient either: no weight transpose, one cache entry)
    x = torch.randn(8, 130)
    calls = _count_weight_quantizations(monkeypatch)
    with torch.inference_mode():
        y = m(x)
    y_train = m(x)  # a training forward (the bias needs its gradient) served by the inference-mode entry
    y_train.sum().backward()
    assert torch.equal(y_train.detach(), y) and calls.count(True) == 1 and m.bias.grad is not None
    wn = torch.nn.utils.parametrizations.weight_norm(fp8.Fp8Linear(130, 40, recipe=fusedfp8.BlockScaling()))
    wn(x).sum().backward()
    wn(x).sum().backward()
    assert calls.count(True) == 3  # twice more
    assert all(p.grad is not None for p in wn.parametrizations.weight.parameters())
