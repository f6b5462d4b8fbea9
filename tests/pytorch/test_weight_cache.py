"""One weight quantization per optimizer step (issue 19.3): Fp8Linear / Fp8MLP keep the FP8 weight
and its transpose while neither the weight (its version counter) nor its scale (an update) has
changed, so gradient accumulation over micro-batches quantizes each weight once. Tested: the
count of weight quantizations, the same bytes as without the cache (outputs, gradients, state)
over several optimizer steps, and every way the weight or its scale can change."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusedfp8 as ff
import fusedfp8.pytorch as fp8
from fusedfp8.pytorch import autograd as F8
from support.frameworks import same_bytes

R = ff.DelayedScaling(amax_history_len=4)


class Count:
    """Counts the quantizations of weights (tensors that are nn.Parameters' data)."""

    def __init__(self, monkeypatch, model):
        self.n = 0
        real = F8._quantize

        def spy(x, *a, **k):
            self.n += x.data_ptr() in {p.data_ptr() for n, p in model.named_parameters() if n.endswith("weight")}
            return real(x, *a, **k)

        monkeypatch.setattr(F8, "_quantize", spy)


def _model(kind, device):
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(fp8.Fp8Linear(32, 48, recipe=R, device=device),
                             fp8.Fp8Linear(48, 16, recipe=R, device=device))
    return fp8.Fp8MLP(32, 64, recipe=R, device=device)


def _step(model, opt, micro, device, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(micro):
        x = torch.randn(24, 32, generator=g).to(device)
        model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    fp8.update_model_scales(model)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_gradient_accumulation_quantizes_each_weight_once_per_step_with_the_same_bytes(device, kind, monkeypatch):
    model = _model(kind, device)
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if isinstance(m, fp8.Fp8Linear):
            m.cache_fp8_weight = False
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    count = Count(monkeypatch, model)
    for step in range(3):
        before = count.n
        _step(model, opt, 4, device, seed=step)
        assert count.n - before == 2, f"step {step}: {count.n - before} weight quantizations for 2 weights"
        _step(plain, opt_plain, 4, device, seed=step)
        for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values()):
            assert same_bytes(a, b), f"step {step}: {name}"


def test_every_change_of_the_weight_or_its_scale_quantizes_again(device, monkeypatch):
    f = fp8.Fp8Linear(32, 16, recipe=R, device=device)
    count = Count(monkeypatch, f)
    x = torch.randn(8, 32, device=device)

    def quantizes(action=None) -> int:
        if action is not None:
            action()
        before = count.n
        f(x)
        return count.n - before

    assert quantizes() == 1
    assert quantizes() == 0  # nothing changed
    with torch.no_grad():
        assert quantizes(lambda: f.weight.add_(1e-3)) == 1  # an in-place change (an optimizer step)
    assert quantizes(lambda: fp8.update_model_scales(f)) == 1  # the scales moved
    assert quantizes(lambda: ff.update_scales(f.fp8_state, R)) == 1  # the generic update of its state
    assert quantizes(lambda: f.load_state_dict(copy.deepcopy(f.state_dict()))) == 1
    assert quantizes(lambda: f.weight.data.mul_(2)) == 0  # .data: invisible to the version counter ...
    assert quantizes(f.clear_fp8_weight) == 1  # ... so say it
    f.weight = nn.Parameter(f.weight.detach().clone())
    assert quantizes() == 1  # another tensor
    with torch.no_grad():
        assert quantizes() == 1  # no transpose needed: another entry
    f.cache_fp8_weight = False
    assert quantizes() == 1 and quantizes() == 1


def test_copies_do_not_share_a_cached_weight(device):
    f = fp8.Fp8Linear(32, 16, recipe=R, device=device)
    x = torch.randn(8, 32, device=device)
    f(x)
    g = copy.deepcopy(f)
    assert g._wcache.value is None
    with torch.no_grad():
        g.weight.mul_(2)
    torch.testing.assert_close(g(x), 2 * f(x) - f.bias, rtol=0.1, atol=0.1)
