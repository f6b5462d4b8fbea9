"""Fault injection in torch FP8 training, for tests/pytorch/test_torch_reliability.py (on the CPU the
reference path, on the GPU the CUDA kernels and torch._scaled_mm) and tests/run/checkpoint_resume.py.

The model is Fp8Linear -> residual Fp8MLP -> Fp8Linear, trained with Adam on a noisy linear teacher.
A fault puts inf or NaN into one element of the input batch, or of the gradient that reaches
the first layer's output (through a tensor hook). The training loop does what a mixed-precision
loop does: it skips the optimizer step when a gradient is not finite (FP8 saturates inf to the
format's max, so an inf alone leaves the gradients finite; a NaN does not), and always calls
update_scales.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

import fusedfp8
import fusedfp8.pytorch as fp8
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState

IN, HIDDEN, FFN, OUT, BATCH = 32, 64, 128, 16, 64
RECIPE = DelayedScaling(amax_history_len=16)
FAULTS = ("input-inf", "input-nan", "grad-inf", "grad-nan")
# (module index in fp8_modules order: layer0, mlp.fc1, mlp.fc2, head; column: 0 input, 1 weight, 2 grad)
ALL_ACTIVATIONS = {(m, c) for m in range(4) for c in (0, 2)}
EXPECTED_OVERFLOWS = {
    "input-inf": {(0, 0)},  # saturates in the first quantize: everything downstream stays finite
    "input-nan": ALL_ACTIVATIONS,  # NaN flows through every activation and every gradient
    "grad-inf": {(0, 2)},
    "grad-nan": {(0, 2)},
}


class Net(nn.Module):
    """Fp8Linear -> residual Fp8MLP (LayerNorm, fused gelu) -> Fp8Linear."""

    def __init__(self):
        super().__init__()
        self.l0 = fp8.Fp8Linear(IN, HIDDEN, recipe=RECIPE)
        self.mlp = fp8.Fp8MLP(HIDDEN, FFN, RECIPE)
        self.head = fp8.Fp8Linear(HIDDEN, OUT, recipe=RECIPE)

    def forward(self, x):
        h = self.l0(x)
        return self.head(h + self.mlp(h))


def make_model(device="cpu", seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return Net().to(device)


class Task:
    """A fixed regression task: y = x @ W + 0.5 noise, x with rows of varied magnitude. The label
    noise sets a loss floor (0.25) that both runs reach, so 'within 2%' compares where they
    converge, not the run-to-run spread of the trajectories (about 1% between model seeds)."""

    def __init__(self, device="cpu", seed=123):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(IN, OUT, generator=g) / IN ** 0.5
        self.device = device
        self.seed = seed
        (x1, y1), (x2, y2) = self.batch(10_000), self.batch(10_001)
        self.eval_x, self.eval_y = torch.cat([x1, x2]), torch.cat([y1, y2])

    def batch(self, step: int):
        g = torch.Generator().manual_seed(self.seed * 100_003 + step)
        x = torch.randn(BATCH, IN, generator=g) * torch.exp2(torch.randint(-2, 3, (BATCH, 1), generator=g).float())
        y = x @ self.w + 0.5 * torch.randn(BATCH, OUT, generator=g)
        return x.to(self.device), y.to(self.device)


def step(model, opt, x, y, fault: str | None = None) -> tuple[float, bool]:
    """One training step; returns (loss, whether the optimizer stepped)."""
    handle = None
    if fault is not None:
        kind, value = fault.split("-")
        bad = float(value)
        if kind == "input":
            x = x.clone()
            x[3, 5] = bad
        else:
            def poison(grad):
                grad = grad.clone()
                grad[2, 7] = bad
                return grad

            def hook(module, inputs, out):
                out.register_hook(poison)  # (returns None: the output itself is not replaced)

            handle = model.l0.register_forward_hook(hook)
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    if handle is not None:
        handle.remove()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    if finite:
        opt.step()
    opt.zero_grad(set_to_none=True)
    fp8.update_model_scales(model)
    return float(loss.detach()), finite


def eval_loss(model, task: Task) -> float:
    with torch.no_grad():
        return float((model(task.eval_x) - task.eval_y).pow(2).mean())


def states(model) -> list[dict]:
    """Every Fp8Linear's state, as numpy copies, in fp8_modules order."""
    return [{f: getattr(m, f).detach().cpu().numpy().copy() for f in STATE_FIELDS} for m in fp8.fp8_modules(model)]


def twin_update(before: list[dict]) -> list[dict]:
    """The reference update applied to copies of the given staged states."""
    out = []
    for s in before:
        twin = ScalingState(**{f: a.copy() for f, a in s.items()}, grad=(False, False, True))
        fusedfp8.update_scales(twin, RECIPE)
        out.append({f: getattr(twin, f) for f in STATE_FIELDS})
    return out


def check_fault_step(device: str, fault: str, warm: int = 12, after: int = 30) -> None:
    """One faulty step among clean ones; see EXPECTED_OVERFLOWS."""
    task = Task(device)
    model = make_model(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = [step(model, opt, *task.batch(s))[0] for s in range(warm)]
    before = states(model)
    loss, stepped = step(model, opt, *task.batch(warm), fault=fault)
    assert stepped == (fault == "input-inf"), (fault, loss)  # (the bias gradients sum an inf gradient)
    after_fault = states(model)
    expected = EXPECTED_OVERFLOWS[fault]
    for m, (b, a) in enumerate(zip(before, after_fault)):
        for c in range(3):
            tag = f"{fault}: module {m} column {c}"
            if (m, c) in expected:
                assert a["overflows"][c] == b["overflows"][c] + 1, tag
                assert a["scale"][c].tobytes() == b["scale"][c].tobytes(), tag + ": scale kept"
                assert a["scale_inv"][c].tobytes() == b["scale_inv"][c].tobytes(), tag
                assert a["amax_history"][1:, c].tobytes() == b["amax_history"][1:, c].tobytes(), tag + ": no roll"
                assert a["amax_history"][0, c] == 0 and a["updates"][c] == b["updates"][c], tag
            else:
                assert a["overflows"][c] == b["overflows"][c], tag
                assert a["updates"][c] == b["updates"][c] + 1, tag + ": a normal update"
            assert np.isfinite(a["amax_history"]).all() and np.isfinite(a["scale"]).all(), tag + ": not poisoned"
    # the next clean step updates every tensor normally: staged state -> the reference rule
    x, y = task.batch(warm + 1)
    loss_next = (model(x) - y).pow(2).mean()
    loss_next.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    staged_states = states(model)
    fp8.update_model_scales(model)
    now = states(model)
    for m, (want, got) in enumerate(zip(twin_update(staged_states), now)):
        for f in STATE_FIELDS:
            assert want[f].tobytes() == got[f].tobytes(), f"{fault}: module {m} {f} after the next clean step"
        assert (got["updates"] == after_fault[m]["updates"] + 1).all(), fault
        assert (got["overflows"] == after_fault[m]["overflows"]).all(), fault
    # the loss keeps falling
    losses += [loss, float(loss_next.detach())]
    losses += [step(model, opt, *task.batch(s))[0] for s in range(warm + 2, warm + 2 + after)]
    assert np.isfinite(losses[warm + 1:]).all(), losses
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[warm - 5:warm]), losses


def check_periodic_overflows(device: str, steps: int = 100, every: int = 10, tol: float = 0.02,
                             lr: float = 1e-2) -> dict:
    """A run with a fault every ``every``-th step (cycling through FAULTS) ends within ``tol`` of
    the clean run's loss (on a held-out batch). Returns the numbers for the message."""
    task = Task(device)
    result = {}
    for name in ("clean", "faulty"):
        model = make_model(device)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)  # both runs settle by the end
        skipped = 0
        for s in range(steps):
            fault = FAULTS[(s // every) % len(FAULTS)] if name == "faulty" and s % every == every - 1 else None
            _, stepped = step(model, opt, *task.batch(s), fault=fault)
            skipped += not stepped
            sched.step()
        overflows = sum(int(m.overflows.sum()) for m in fp8.fp8_modules(model))
        result[name] = (eval_loss(model, task), skipped, overflows)
    (clean, clean_skipped, clean_over), (faulty, skipped, over) = result["clean"], result["faulty"]
    assert clean_skipped == 0 and clean_over == 0, result
    assert skipped == sum(1 for s in range(steps) if s % every == every - 1
                          and FAULTS[(s // every) % len(FAULTS)] != "input-inf"), result
    assert over > 0, result
    assert abs(faulty - clean) <= tol * clean, result
    return result


TOTAL = 100  # steps of the checkpoint run (its cosine schedule)


def checkpoint_run(device: str, first: int, last: int, save_at: tuple[int, str] | None = None,
                   load: str | None = None) -> dict:
    """Steps first..last-1 of the checkpoint run (Adam with a cosine schedule over TOTAL steps, a
    fault every 10th step so overflow counters are part of the state), optionally saving {model,
    optimizer, scheduler} with torch.save before step ``save_at[0]`` or loading such a checkpoint
    first. Returns per step the loss and every module's FP8 state, and the final parameters."""
    task = Task(device)
    model = make_model(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, TOTAL)
    if load:
        ckpt = torch.load(load, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
    out = {}
    for s in range(first, last):
        if save_at and s == int(save_at[0]):
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                       save_at[1])
        fault = FAULTS[(s // 10) % len(FAULTS)] if s % 10 == 9 else None
        loss, _ = step(model, opt, *task.batch(s), fault=fault)
        sched.step()
        out[f"loss/{s}"] = np.float32(loss)
        for k, m in enumerate(fp8.fp8_modules(model)):
            for f in STATE_FIELDS:
                out[f"state/{s}/{k}/{f}"] = getattr(m, f).detach().cpu().numpy().copy()
    for name, prm in model.named_parameters():
        out[f"param/{name}"] = prm.detach().cpu().numpy().copy()
    return out
