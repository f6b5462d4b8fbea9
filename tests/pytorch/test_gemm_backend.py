"""The torch layers' ``gemm=`` switch (fusedfp8/pytorch/gemm.py): the shim's cuBLASLt FP8 GEMM
(torch.ops.fusedfp8.fp8_gemm_lt) or torch._scaled_mm on CUDA. On the CPU: the argument's checks,
the once-per-process decision and its fallback, the wiring of each layer's choice to its GEMMs,
the op's Meta kernel through autograd's call (layouts, bias) and the decision under
torch.compile. On the GPU: Fp8Linear / Fp8MLP forward and backward with each backend, every GEMM
within the accumulation tolerance of tests/kernels/test_torch_gemm_op.py against float64 of its own
operands and against torch._scaled_mm on the same operands, aligned and ragged shapes, compiled and
in a CUDA graph."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import fusedfp8.pytorch as fp8
from fusedfp8.pytorch import autograd as A8
from fusedfp8.pytorch import gemm as G
from fusedfp8.pytorch import modules as M
from fusedfp8.recipe import DelayedScaling
from support.shim import built as built_shim
from support.torch_helpers import Spy, inputs, sqnr

R = DelayedScaling(amax_history_len=4)


# ---- the argument ----------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda g: fp8.Fp8Linear(16, 16, gemm=g),
    lambda g: fp8.Fp8MLP(16, 32, gemm=g),
    lambda g: fp8.Fp8Linear.from_linear(nn.Linear(16, 16), gemm=g),
    lambda g: setattr(fp8.Fp8Linear(16, 16), "gemm", g),
], ids=["Fp8Linear", "Fp8MLP", "from_linear", "attribute"])
@pytest.mark.parametrize("bad", ["lt", "cuBLASLt", None, 1])
def test_a_bad_gemm_is_refused_naming_the_argument(make, bad):
    with pytest.raises(ValueError, match=r"gemm must be one of \('auto', 'cublaslt', 'scaled_mm'\); got"):
        make(bad)


def test_convert_to_fp8_refuses_a_bad_gemm_before_swapping_anything():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(ValueError, match="gemm must be one of"):
        fp8.convert_to_fp8(model, gemm="fast")
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    fp8.convert_to_fp8(model, gemm="scaled_mm")
    assert model[0].gemm == model[2].gemm == "scaled_mm" and "gemm='scaled_mm'" in repr(model[0])


def test_default_is_auto_and_the_attribute_switches():
    m = fp8.Fp8MLP(16, 32)
    assert m.fc1.gemm == m.fc2.gemm == "auto"
    m.fc2.gemm = "cublaslt"
    assert (m.fc1.gemm, m.fc2.gemm) == ("auto", "cublaslt")
    assert copy.deepcopy(m).fc2.gemm == "cublaslt"


# ---- the decision: once per process and value, with the fallback -----------------------------
class _Library:
    """A stand-in for csrc.library that counts its calls."""

    def __init__(self, result):
        self.result, self.calls = result, 0

    def __call__(self, target):
        assert target == "torch"
        self.calls += 1
        return self.result


@pytest.fixture
def fresh(monkeypatch):
    """An empty decision cache (restored afterwards)."""
    monkeypatch.setattr(G, "_resolved", {})


def test_without_the_shim_cublaslt_raises_and_auto_falls_back_to_scaled_mm(monkeypatch, fresh):
    lib = _Library((None, "no C++ compiler to build it"))
    monkeypatch.setattr(G._shim, "library", lib)
    with pytest.raises(RuntimeError, match=r"gemm='cublaslt': .*no C\+\+ compiler.*gemm='auto' falls back"):
        G.backend("cublaslt")
    calls = lib.calls
    assert G.backend("scaled_mm") == "scaled_mm" and lib.calls == calls  # 'scaled_mm' never loads the shim
    assert [G.backend("auto") for _ in range(3)] == ["scaled_mm"] * 3 and lib.calls == calls + 1
    assert G.gemm_path("auto")[0] == "scaled_mm" and "no C++ compiler" in G.gemm_path("auto")[1]
    for _ in range(5):
        with pytest.raises(RuntimeError):
            G.backend("cublaslt")


def test_auto_says_scaled_mm_before_the_first_forward_where_the_shim_cannot_be_had(monkeypatch, fresh):
    monkeypatch.setattr(G._shim, "status", lambda target: (False, "FUSEDFP8_NO_SHIM is set"))
    backend, why = G.gemm_path("auto")
    assert backend == "scaled_mm" and "FUSEDFP8_NO_SHIM" in why
    assert G.gemm_path("cublaslt")[0] == "error"


def test_with_the_shim_cublaslt_and_auto_take_its_gemm_once(monkeypatch, fresh):
    """'auto' is the shim's GEMM where it can be had: with the bias in its epilogue it runs the same
    cuBLASLt kernels as torch._scaled_mm for less host time (the H200 figures in
    fusedfp8.pytorch.gemm's docstring); each value loads the shim once."""
    built_shim("torch")  # defines fusedfp8::fp8_gemm_lt
    real = G._shim.library
    lib = _Library(real("torch"))
    monkeypatch.setattr(G._shim, "library", lib)
    assert [G.backend("cublaslt") for _ in range(4)] == ["cublaslt"] * 4 and lib.calls == 1
    assert G.gemm_path("cublaslt")[0] == "cublaslt" and "fp8_gemm_lt" in G.gemm_path("cublaslt")[1]
    assert [G.backend("auto") for _ in range(4)] == ["cublaslt"] * 4 and lib.calls == 2
    assert "gemm='auto'" in G.gemm_path("auto")[1]


def test_deciding_cublaslt_gives_the_shim_torchs_cublaslt_workspace(monkeypatch, fresh):
    """Where torch says its cuBLASLt workspace size, the shim's GEMM takes it (the same heuristic
    question as torch._scaled_mm's); where it does not (no CUDA here), the shim keeps its own."""
    lib = built_shim("torch")
    before = lib.gemm_workspace()
    try:
        assert G.torch_lt_workspace() is None or torch.cuda.is_available()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch._C, "_cuda_getCublasLtWorkspaceSize", lambda: 3 << 20, raising=False)
        assert G.torch_lt_workspace() == 3 << 20
        assert G.backend("cublaslt") == "cublaslt" and lib.gemm_workspace() == 3 << 20
        assert f"workspace {3 << 20} bytes, as torch's" in G.gemm_path("cublaslt")[1]
    finally:
        lib.gemm_set_workspace(before)


def test_the_decision_is_a_constant_under_torch_compile(monkeypatch, fresh):
    """Made at trace time outside the graph (assume_constant_result): fullgraph, no graph break,
    even when this is the first call of the process."""
    monkeypatch.setattr(G._shim, "library", _Library((None, "switched off")))
    f = torch.compile(lambda x: x + (1.0 if G.backend("auto") == "scaled_mm" else 2.0), backend="eager",
                      fullgraph=True)
    assert torch.equal(f(torch.zeros(3)), torch.ones(3))


# ---- each layer's choice reaches its GEMMs ---------------------------------------------------
def test_each_layer_runs_its_own_backend(monkeypatch):
    """What the layers hand scaled_mm: fc1's choice for fc1's three GEMMs, fc2's for fc2's (forced
    here as if on CUDA; the CPU emulation computes the same either way)."""
    monkeypatch.setattr(M.Fp8Linear, "_gemm_backend", lambda self, x: {"auto": "cublaslt"}.get(self.gemm, self.gemm))
    spy = Spy(monkeypatch)
    mlp = fp8.Fp8MLP(32, 64, R)
    mlp.fc2.gemm = "scaled_mm"
    mlp(inputs(16, 32).requires_grad_()).sum().backward()
    # forward z (fc1), y (fc2); backward da, dw2 (fc2), dh, dw1 (fc1)
    assert spy.gemms == ["cublaslt", "scaled_mm", "scaled_mm", "scaled_mm", "cublaslt", "cublaslt"]
    spy.gemms.clear()
    lin = fp8.Fp8Linear(32, 16, recipe=R, gemm="cublaslt")
    lin(inputs(16, 32).requires_grad_()).sum().backward()
    assert spy.gemms == ["cublaslt"] * 3


def test_cpu_modules_never_decide(monkeypatch, fresh):
    monkeypatch.setattr(G._shim, "library", lambda target: pytest.fail("the CPU loaded the shim"))
    fp8.Fp8Linear(32, 16, recipe=R, gemm="cublaslt")(inputs(16, 32)).sum()
    assert G._resolved == {}


# ---- the op through autograd's call, on meta tensors (its Meta kernel) -----------------------
@pytest.mark.parametrize("bias", [None, torch.bfloat16, torch.float32], ids=["no-bias", "bf16-bias", "f32-bias"])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_cublaslt_call_layouts_on_meta(bias, out):
    """a (M, K) row-major and b the .t() of a contiguous (N, K) tensor, as the layers pass them. A
    bias of the output's dtype (bf16) goes into the op's epilogue: one op, nothing after it; any
    other pairing is the float32 product plus the bias, rounded once (the route of _scaled_mm)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((func.overloadpacket.__name__, len(args) + len(kwargs or {})))
            return func(*args, **(kwargs or {}))

    built_shim("torch")
    a = torch.empty(17, 64, dtype=torch.float8_e4m3fn, device="meta")
    w = torch.empty(48, 64, dtype=torch.float8_e5m2, device="meta")
    s = torch.empty(1, device="meta")
    b = None if bias is None else torch.empty(48, dtype=bias, device="meta")
    with Ops() as ops:
        y = G._cublaslt_mm(a, w.t(), s, s, b, out, True)
    assert y.shape == (17, 48) and y.dtype == out and y.device.type == "meta"
    fused = bias == out == torch.bfloat16
    assert [n for n, count in ops.seen if n == "fp8_gemm_lt"] == ["fp8_gemm_lt"]
    if bias is None or fused:  # one op and nothing after it; the bias handed to it
        assert [(n, count) for n, count in ops.seen if n != "t"] == [("fp8_gemm_lt", 7 if fused else 6)], ops.seen
    else:
        assert "add_" in [n for n, _ in ops.seen], ops.seen  # the float32 route
    with pytest.raises(RuntimeError, match="must be contiguous"):
        G._cublaslt_mm(a, torch.empty(64, 48, dtype=torch.float8_e4m3fn, device="meta"), s, s, b, out, True)


class _ByHand:
    """Stands in for ctx: the autograd functions' forward and backward called directly (autograd
    itself cannot record on fake CUDA tensors in a CPU build of torch)."""

    needs_input_grad = (True,) * 40

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_every_layer_gemm_passes_the_ops_checks_on_fake_cuda(monkeypatch, kind, bias):
    """FakeTensorMode with CUDA-device fake tensors: the layers' whole cublaslt route, forward and
    backward, through the op's Meta kernel (its contiguity, K and multiple-of-16 checks, and its bias
    checks: the bf16 layers' bias goes into the op); aligned shapes (slicing a fake CUDA tensor needs a CUDA build of torch)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    if torch.cuda.is_available():
        pytest.skip("a CPU build's check (the GPU tests run the real thing)")
    built_shim("torch")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = lambda t: FakeTensor(mode, torch.empty_like(t, device="meta"), torch.device("cuda", 0))  # noqa: E731
    spy = Spy(monkeypatch)
    outs = []
    for fn in (A8._LinearFn, A8._MLPFn):
        def apply(*args, fn=fn):
            ctx = _ByHand()
            y = fn.forward(ctx, *args)
            outs.append([g for g in fn.backward(ctx, torch.ones_like(y)) if g is not None])
            return y
        monkeypatch.setattr(fn, "apply", apply)
    tokens, hidden, ffn = 512, 256, 384
    m = (fp8.Fp8MLP(hidden, ffn, R, bias=bias, device="meta", dtype=torch.bfloat16, gemm="cublaslt")
         if kind == "mlp" else fp8.Fp8Linear(hidden, ffn, bias, R, "meta", torch.bfloat16, gemm="cublaslt"))
    m._apply(fake)
    for layer in fp8.fp8_modules(m):
        layer.cache_fp8_weight = False  # (the cache asks whether a CUDA stream is capturing)
    monkeypatch.setattr(M.Fp8Linear, "_need_grads", lambda self, x, w: (True, True))
    with torch.no_grad(), mode:  # (autograd recording a fake CUDA tensor aborts a CPU build of torch)
        monkeypatch.setattr(torch, "is_grad_enabled", lambda: True)  # Fp8MLP's "a backward will follow"
        y = m(fake(torch.empty(tokens, hidden, dtype=torch.bfloat16)))
        monkeypatch.undo()
    out = ffn if kind == "linear" else hidden
    assert y.shape == (tokens, out) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    assert spy.gemms == ["cublaslt"] * (3 if kind == "linear" else 6)
    want = {"linear": [(tokens, ffn), (tokens, hidden), (ffn, hidden)],
            "mlp": [(tokens, ffn), (tokens, hidden), (tokens, ffn), (hidden, ffn), (tokens, hidden), (ffn, hidden)]}
    assert [tuple(c[-1].shape) for c in spy.calls] == want[kind]
    grads = [tuple(g.shape) for g in outs[0]]
    assert grads[:2] == ([(tokens, hidden), (ffn, hidden)] if kind == "linear" else [(tokens, hidden), (hidden,)])


# ---- on the GPU: each backend, every GEMM checked --------------------------------------------
SHAPES = {"aligned": (512, 256, 384), "ragged": (1000, 72, 200)}  # tokens, hidden (in), ffn (out)


def _tolerance_check(calls, biases, fast):
    """Every recorded GEMM within the accumulation bound of test_torch_gemm_op against float64 of
    its operands (+ bias); fast-accumulation GEMMs (the forward's) with a looser 2**-7 term."""
    worst = 0.0
    for (a, b, sa, sb, out), bias, f in zip(calls, biases, fast):
        a64, b64 = a.double().cpu().numpy(), b.double().cpu().numpy()
        scale = float(sa) * float(sb)
        ref, absref = (a64 @ b64) * scale, (np.abs(a64) @ np.abs(b64)) * scale
        if bias is not None:
            b64 = bias.detach().double().cpu().numpy()
            ref, absref = ref + b64, absref + np.abs(b64)
        eps = 2.0 ** -8 if out.dtype in (torch.bfloat16, torch.float16) else 2.0 ** -23
        acc = 2.0 ** -7 if f else 2.0 ** -9
        err = np.abs(out.double().cpu().numpy() - ref)
        ratio = err / (eps * np.abs(ref) + acc * absref + 1e-30)
        worst = max(worst, float(ratio.max()))
    assert worst <= 1.0, worst
    return worst


class _Recorder:
    """Spy plus each call's bias and fast_accum, and the same GEMM through torch._scaled_mm."""

    def __init__(self, monkeypatch):
        self.calls, self.gemms, self.biases, self.fast, self.twins = [], [], [], [], []
        real = A8.scaled_mm

        def spy(a, b, sa, sb, bias, out_dtype, fast_accum=False, gemm="scaled_mm"):
            out = real(a, b, sa, sb, bias, out_dtype, fast_accum, gemm)
            self.calls.append((a, b, sa.clone(), sb.clone(), out))
            self.gemms.append(gemm)
            self.biases.append(bias)
            self.fast.append(fast_accum)
            self.twins.append(real(a, b, sa, sb, bias, out_dtype, fast_accum, "scaled_mm"))
            return out

        monkeypatch.setattr(A8, "scaled_mm", spy)


def _run(model, x, g):
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(g)
    return [y, x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cublaslt_layers_match_scaled_mm_within_accumulation(monkeypatch, shape, kind, bias, dtype):
    """bf16 layers: the bias in the GEMM's epilogue on both backends; float32 layers: the float32
    product plus the bias on both."""
    built_shim("torch")
    tokens, hidden, ffn = shape
    torch.manual_seed(0)
    if kind == "linear":
        base = fp8.Fp8Linear(hidden, ffn, bias, R, device="cuda", dtype=dtype, gemm="scaled_mm")
        out = ffn
    else:
        base = fp8.Fp8MLP(hidden, ffn, R, bias=bias, device="cuda", dtype=dtype, gemm="scaled_mm")
        out = hidden
    if bias:  # a bias that matters against the product (the default init's is small)
        with torch.no_grad():
            for m in base.modules():
                if isinstance(m, fp8.Fp8Linear):
                    m.bias.copy_(torch.randn_like(m.bias))
    x = inputs(tokens, hidden, dtype, 1, device="cuda")
    g = inputs(tokens, out, dtype, 2, device="cuda") * 0.01
    lt = copy.deepcopy(base)
    for m in lt.modules():
        if isinstance(m, fp8.Fp8Linear):
            m.gemm = "cublaslt"
    want = _run(base, x, g)
    rec = _Recorder(monkeypatch)
    got = _run(lt, x, g)
    assert rec.gemms == ["cublaslt"] * len(rec.calls) and len(rec.calls) == (3 if kind == "linear" else 6)
    _tolerance_check(rec.calls, rec.biases, rec.fast)
    twins = [(a, b, sa, sb, twin) for (a, b, sa, sb, _), twin in zip(rec.calls, rec.twins)]
    _tolerance_check(twins, rec.biases, rec.fast)  # torch._scaled_mm on the very same operands
    for i, (w, o) in enumerate(zip(want, got)):
        assert o.dtype == w.dtype and o.shape == w.shape, i
        assert sqnr(w, o) >= 30, (i, sqnr(w, o))  # the layers: FP8 re-quantization of near-equal values


@pytest.mark.gpu
@pytest.mark.fp8_gemm
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cublaslt_mlp_compiled_and_in_a_cuda_graph(shape):
    """torch.compile (fullgraph, inductor) and a captured forward+backward replay with the shim's
    GEMM give the eager results (compiled: to bf16 rounding, inductor may reorder the bias-gradient
    and LayerNorm reductions; graph: bitwise)."""
    built_shim("torch")
    tokens, hidden, ffn = shape
    torch.manual_seed(0)
    model = fp8.Fp8MLP(hidden, ffn, R, device="cuda", dtype=torch.bfloat16, gemm="cublaslt")
    x = inputs(tokens, hidden, torch.bfloat16, 1, device="cuda")
    g = inputs(tokens, hidden, torch.bfloat16, 2, device="cuda") * 0.01
    twin, graphed = copy.deepcopy(model), copy.deepcopy(model)
    want = _run(model, x, g)
    got = _run(torch.compile(twin, fullgraph=True), x, g)
    for i, (w, o) in enumerate(zip(want, got)):
        assert sqnr(w, o) >= 40, (i, sqnr(w, o))
    sx = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed(sx).backward(g)  # warm-up: the GEMM's descriptors for these shapes exist before the capture
    torch.cuda.current_stream().wait_stream(side)
    twin_state = copy.deepcopy(model)  # the state the eager twin starts its second step from
    for p in list(graphed.parameters()) + [sx]:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        y = graphed(sx)
        y.backward(g)
    graph.replay()
    torch.cuda.synchronize()
    eager = _run(twin_state, x, g)
    replayed = [y, sx.grad] + [p.grad for p in graphed.parameters()]
    for i, (w, o) in enumerate(zip(eager, replayed)):
        assert torch.equal(w, o), i
