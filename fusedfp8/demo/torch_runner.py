"""The demo in torch: ``TorchMLP`` (bf16) and :class:`fusedfp8.pytorch.Fp8MLP` (FP8, one
``update_model_scales`` per step), trained one after the other from the same bf16 weights on the
same batch with ``torch.optim.Adam``.

Every step is timed: CUDA events around it on the GPU (read after the last step),
``time.perf_counter`` on the CPU. The FP8 step includes two small device copies that record the
staged amaxes and the new scales for the plot. On the CPU torch runs single-threaded (with more
threads, torch's idle OpenMP workers spin against NumPy's reference kernels and slow the FP8
emulation several-fold).
"""
from __future__ import annotations

import contextlib
import platform
import time

import numpy as np
import torch

import fusedfp8.pytorch as fp8

from .config import Curve, DemoConfig, joined_state, tensor_names
from .task import Task, torch_initial_weights, torch_model


@contextlib.contextmanager
def _threads(device: str):
    if device != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train_one(model, config: DemoConfig, x, y, bar) -> Curve:
    dev = x.device
    cuda = dev.type == "cuda"
    opt = torch.optim.Adam(model.parameters(), lr=config.lr, fused=cuda)
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)]
    steps, k = config.steps, 3 * len(mods)
    losses = torch.empty(steps, device=dev)
    amax = torch.empty(steps, k, device=dev)
    scale = torch.empty(steps, k, device=dev)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)] if cuda else []
    host_ms = []
    for i in range(steps):
        if cuda:
            events[i][0].record()
        else:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = (model(x).float() - y.float()).pow(2).mean()
        loss.backward()
        opt.step()
        if mods:
            amax[i] = torch.cat([m.amax_history[0] for _, m in mods])
            fp8.update_model_scales(model)
            scale[i] = torch.cat([m.scale for _, m in mods])
        losses[i] = loss.detach()
        if cuda:
            events[i][1].record()
        else:
            host_ms.append((time.perf_counter() - t0) * 1e3)
            bar.set_postfix_str(f"loss {float(loss.detach()):.4f}")
        bar.update(1)
    if cuda:
        torch.cuda.synchronize()
        host_ms = [a.elapsed_time(b) for a, b in events]
    curve = Curve(loss=losses.cpu().numpy(), step_ms=np.array(host_ms))
    bar.set_postfix_str(f"loss {curve.loss[-1]:.4f}")
    if mods:
        curve.tensors = tensor_names(n for n, _ in mods)
        curve.amax, curve.scale = amax.cpu().numpy(), scale.cpu().numpy()
        state = joined_state([m.fp8_state for _, m in mods], lambda arrays: torch.cat(arrays, -1))
        curve.state_table = state.summary(config.recipe, curve.tensors)
        curve.overflows = state.overflows.cpu().numpy()
    return curve


def train(config: DemoConfig, device: str, bar) -> dict:
    """{'bf16': Curve, 'fp8': Curve} of ``config`` on ``device`` ('cuda' or 'cpu')."""
    hidden, ffn, tokens = config.shape_for(device)
    dev = torch.device(device)
    x, y = Task(hidden, tokens, config.seed).torch_batch(0, dev)
    weights = torch_initial_weights(hidden, ffn, config.seed, dev)
    curves = {}
    with _threads(device):
        for kind in ("bf16", "fp8"):
            bar.set_description(f"{kind} ({device})")
            model = torch_model(kind, hidden, ffn, weights, config.recipe, dev)
            curves[kind] = _train_one(model, config, x, y, bar)
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return curves


def meta(device: str) -> dict:
    """Versions and the device's name, for the JSON."""
    out = {"torch": torch.__version__}
    if device == "cuda":
        out["device_name"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    else:
        out["device_name"] = platform.processor() or platform.machine() or "cpu"
        out["torch_threads"] = 1
    return out
