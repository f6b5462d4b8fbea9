"""The torch layers on a GPU that is not the current device (two GPUs; skipped elsewhere): an
Fp8MLP moved to cuda:1 trains while cuda:0 is current, through the C++ and the Python launch
paths and both GEMM backends, and matches the same model on cuda:0 byte for byte; the amax-only
ops run there too. The guard itself is tested on the CPU in tests/kernels/test_device_guard.py."""
from __future__ import annotations

import copy

import pytest
import torch

import fusedfp8.pytorch as fp8
from fusedfp8.launch import kernels as K
from fusedfp8.pytorch import amax_ops
from fusedfp8.pytorch import custom_ops as C
from fusedfp8.recipe import DelayedScaling
from support.torch_helpers import inputs, launch_path, train_step

pytestmark = [pytest.mark.gpu, pytest.mark.fp8_gemm,
              pytest.mark.skipif(K._gpu_count()[0] < 2, reason="needs two CUDA GPUs")]


def _run(model, device: str, steps: int = 3) -> tuple:
    """Outputs, the last gradients and the state after ``steps`` training steps on ``device``."""
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs = []
    for i in range(steps):
        x = inputs(96, 64, torch.bfloat16, seed=i, device=device)
        outs.append(model(x).detach().cpu())
        train_step(model, x, torch.zeros(96, 64, device=device), opt)
    torch.cuda.synchronize(device)
    return outs, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("gemm", ["cublaslt", "scaled_mm"])
@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "python"])
def test_fp8_mlp_on_the_second_gpu_while_the_first_is_current(cpp, gemm):
    torch.manual_seed(0)
    model = fp8.Fp8MLP(64, 128, DelayedScaling(amax_history_len=4), gemm=gemm, dtype=torch.bfloat16)
    with launch_path(cpp):
        torch.cuda.set_device(0)
        want = _run(copy.deepcopy(model), "cuda:0")
        got = _run(copy.deepcopy(model), "cuda:1")
        assert torch.cuda.current_device() == 0
    for k, (g, w) in enumerate(zip(got[0], want[0])):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"output of step {k}"
    assert got[1].keys() == want[1].keys()
    for name, w in want[1].items():
        assert torch.equal(got[1][name], w), name


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "python"])
def test_amax_ops_on_the_second_gpu(cpp):
    x = inputs(300, 256, torch.bfloat16, device="cuda:1")
    w = torch.randn(256, device="cuda:1")
    with launch_path(cpp):
        torch.cuda.set_device(0)
        got = [C.call(amax_ops.amax, x, None, "gelu", "tanh"), C.call(amax_ops.layernorm_amax, x, w, None, 1e-5)]
        want = [C.call(amax_ops.amax, x.cpu(), None, "gelu", "tanh"), C.call(amax_ops.layernorm_amax, x.cpu(), w.cpu(), None, 1e-5)]
    for g, v in zip(got, want):
        assert g.device == torch.device("cuda:1") and torch.equal(g.cpu(), v)
