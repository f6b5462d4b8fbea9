"""torch.compile and CUDA graphs over fusedfp8.pytorch: fullgraph (no graph break at the custom
ops or the autograd functions) with AOTAutograd's functionalization of the state mutations
bitwise equal to eager, inductor's C++ (CPU) and Triton (GPU) code, and a whole train step
(forward, backward, Adam, update_model_scales) captured in one CUDA graph."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusedfp8.pytorch as fp8
from fusedfp8.recipe import DelayedScaling
from support.frameworks import same_bytes
from support.torch_helpers import inputs, same_state, sqnr, train_step

pytestmark = pytest.mark.fp8_gemm  # (on the GPU: torch._scaled_mm)


def mse_step(model, x, target, opt):
    opt.zero_grad(set_to_none=True)
    loss = (model(x).float() - target.float()).pow(2).mean()
    loss.backward()
    opt.step()
    fp8.update_model_scales(model)
    return loss


# ---- torch.compile ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_compile_fullgraph_matches_eager_bitwise(kind):
    """fullgraph=True: no graph break anywhere (custom ops, autograd functions); through
    AOTAutograd's functionalization the state mutations, the linking of the states by the
    first update (aliased buffers) and the recompile after the first step give the same bits."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    if kind == "linear":
        model = nn.Sequential(fp8.Fp8Linear(32, 64, recipe=recipe), nn.ReLU(), fp8.Fp8Linear(64, 16, recipe=recipe))
    else:
        model = nn.Sequential(fp8.Fp8MLP(32, 64, recipe), fp8.Fp8Linear(32, 16, recipe=recipe))
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    o1, o2 = torch.optim.Adam(model.parameters(), 1e-2), torch.optim.Adam(twin.parameters(), 1e-2)
    for s in range(3):
        x, t = inputs(16, 32, seed=s), inputs(16, 16, seed=9) * 0.1
        assert torch.equal(train_step(model, x, t, o1), train_step(compiled, x, t, o2))
    for (k, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert same_bytes(a, b), k


@pytest.mark.slow
def test_compile_inductor_on_cpu():
    """The inductor backend (C++ codegen) compiles a module that uses the custom ops."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    f = fp8.Fp8Linear(32, 16, recipe=recipe)
    twin = copy.deepcopy(f)
    x = inputs(16, 32)
    y = torch.compile(twin, fullgraph=True)(x)
    assert torch.equal(y, f(x)) and same_state(twin, f.fp8_state)


# ---- whole train steps: compile, CUDA graphs, moving a model ---------------------------------
def _model(recipe=DelayedScaling(amax_history_len=16)):
    torch.manual_seed(0)
    return nn.Sequential(fp8.Fp8MLP(256, 1024, recipe), fp8.Fp8Linear(256, 128, recipe=recipe)).to(
        device="cuda", dtype=torch.bfloat16)


def _data(seed):
    return (inputs(512, 256, torch.bfloat16, seed, device="cuda"),
            inputs(512, 128, torch.bfloat16, 100 + seed, device="cuda") * 0.1)


@pytest.mark.gpu
def test_compile_fullgraph_inductor_on_the_gpu_matches_eager():
    """No graph break (fullgraph=True) and the same training within float rounding: inductor may
    reorder the LayerNorm and bias-gradient reductions, so bits can differ by an ulp: losses to
    2e-3 and every float tensor of the state dict to 40 dB (SGD: Adam would turn an ulp on a
    near-zero gradient into a full step)."""
    model = _model()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True)
    o1 = torch.optim.SGD(model.parameters(), 0.1)
    o2 = torch.optim.SGD(twin.parameters(), 0.1)
    for s in range(4):
        x, t = _data(s)
        l1, l2 = mse_step(model, x, t, o1), mse_step(compiled, x, t, o2)
        torch.testing.assert_close(l2, l1, rtol=2e-3, atol=0)
    for (k, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        if a.is_floating_point():
            assert sqnr(a, b) >= 40, k
        else:
            assert torch.equal(a, b), k


@pytest.mark.gpu
def test_cuda_graph_train_step_replays_with_identical_losses():
    """Forward, backward, Adam (capturable) and update_scales captured in one CUDA graph: the
    replayed losses, weights and states are bitwise those of the eager run."""
    model = _model()
    twin = copy.deepcopy(model)
    o1 = torch.optim.Adam(model.parameters(), 1e-3, capturable=True)
    o2 = torch.optim.Adam(twin.parameters(), 1e-3, capturable=True)
    data = [_data(s) for s in range(8)]
    eager = [mse_step(model, x, t, o1).detach().clone() for x, t in data]

    sx, st = data[0][0].clone(), data[0][1].clone()
    graphed = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, t in data[:3]:  # warm-up: links the states, compiles the kernels, settles the first step
            sx.copy_(x)
            st.copy_(t)
            graphed.append(mse_step(twin, sx, st, o2).detach().clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: an unsafe CUDA call from this thread still breaks the capture, but not one
    # from the JAX runtime's threads when the pytest worker also ran JAX tests (run 4 of 2026-12-03)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_loss = mse_step(twin, sx, st, o2)
    for x, t in data[3:]:
        sx.copy_(x)
        st.copy_(t)
        graph.replay()
        graphed.append(static_loss.detach().clone())
    torch.cuda.synchronize()
    assert torch.equal(torch.stack(eager), torch.stack(graphed)), (eager, graphed)
    for (k, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert same_bytes(a, b), k
