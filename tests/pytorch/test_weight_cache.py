"""One weight quantization per optimizer step (issue 19.3): Fp8Linear / Fp8MLP keep the FP8 weight
and its transpose while neither the weight (its version counter) nor its scale (an update) has
changed, so gradient accumulation over micro-batches quantizes each weight once. Tested: the
count of weight quantizations, the same bytes as without the cache (outputs, gradients, state)
over several optimizer steps, and every way the weight or its scale can change."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fusedfp8 as ff
import fusedfp8.pytorch as fp8
from fusedfp8.pytorch import autograd as F8
from fusedfp8.pytorch import weights as W
from support.frameworks import same_bytes
from support.shim import built as built_shim

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


OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)}  # (no version bump of its own)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_gradient_accumulation_quantizes_each_weight_once_per_step_with_the_same_bytes(device, kind, optimizer,
                                                                                      monkeypatch):
    model = _model(kind, device)
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if isinstance(m, fp8.Fp8Linear):
            m.cache_fp8_weight = False
    opt = OPTIMIZERS[optimizer](model.parameters())
    opt_plain = OPTIMIZERS[optimizer](plain.parameters())
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
    assert quantizes(lambda: f.weight.data.mul_(2)) == 0  # in place through .data: invisible to torch ...
    assert quantizes(f.clear_fp8_weight) == 1  # ... so say it
    assert quantizes(lambda: setattr(f.weight, "data", f.weight.data * 2)) == 1  # another storage
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


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("on", [False, True])
def test_a_copy_keeps_the_cache_setting(device, monkeypatch, how, on):
    """cache_fp8_weight is the module's setting: a copy (deepcopy, a pickle through torch.save)
    keeps it, and only the cached FP8 copy stays behind (a copy that reset it to on would
    quantize each weight once per optimizer step while the user asked for every micro-batch)."""
    f = fp8.Fp8Linear(32, 16, recipe=R, device=device)
    f.cache_fp8_weight = on
    x = torch.randn(8, 32, device=device)
    f(x)
    if how == "deepcopy":
        g = copy.deepcopy(f)
    else:
        buf = io.BytesIO()
        torch.save(f, buf)
        buf.seek(0)
        g = torch.load(buf, weights_only=False)
    assert g.cache_fp8_weight is on and g._wcache.value is None
    count = Count(monkeypatch, g)
    for _ in range(3):
        g(x)
    assert count.n == (1 if on else 3)


# ---- CUDA graphs: the cache keyed on the capture in progress ----------------------------------
def test_a_capture_uses_only_what_it_filled_itself(monkeypatch):
    """The key logic, with the capture id stood in for (CPU): what a capture fills serves that
    capture only; eager entries never serve a capture; where the id cannot be known (no shim)
    nothing is cached during a capture. Once a capture has quantized the weight, eager forwards
    quantize it every time: a replay may write the weight (an optimizer step in the graph) with
    no Python running to say so, and an eager entry would then be stale."""
    f = fp8.Fp8Linear(32, 16, recipe=R)
    count = Count(monkeypatch, f)
    x = torch.randn(8, 32)
    capture = {"id": 0}
    monkeypatch.setattr(W, "_capture", lambda w: capture["id"])

    def quantizes(cid) -> int:
        capture["id"] = cid
        before = count.n
        f(x)
        return count.n - before

    assert quantizes(0) == 1 and quantizes(0) == 0  # eager: filled, then reused
    assert quantizes(None) == 1 and quantizes(None) == 1  # id unknown: no cache in the capture ...
    assert quantizes(0) == 0  # ... and the eager entry was left alone
    assert quantizes(7) == 1 and quantizes(7) == 0  # capture 7: its own quantization, then reused in it
    assert quantizes(8) == 1 and quantizes(8) == 0  # capture 8 never reads capture 7's
    assert quantizes(0) == 1 and quantizes(0) == 1  # eager, after a capture: never cached
    f.clear_fp8_weight()  # (an update of the scales: still never cached)
    assert quantizes(0) == 1 and quantizes(0) == 1
    assert quantizes(9) == 1 and quantizes(9) == 0  # captures still use their own


def test_the_shim_reports_no_capture_where_it_cannot_know():
    """The torch shim's capture_id: an int (0: not capturing) where the driver answers, None where
    there is no driver (this CPU machine) - never an id made up."""
    lib = built_shim("torch")
    got = lib.capture_id(0)
    assert got is None if not torch.cuda.is_available() else got == 0
    with pytest.raises((TypeError, OverflowError)):
        lib.capture_id("stream")


def _captured(step):
    """``step`` captured in one CUDA graph after warm-up on a side stream (thread-local capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    return graph


def _quantize_kernels(replay) -> int:
    """Quantize kernels (of any tensor) run by one call of ``replay``, from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "quantize" in e.key and e.device_type.name == "CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_graphed_accumulation_step_quantizes_each_weight_once_with_the_same_bytes(kind):
    """A whole optimizer step (4 micro-batches, Adam, the scale update) captured as ONE graph: with
    the cache the graph holds one weight quantization per weight, without it one per micro-batch;
    replays give the eager uncached step's bytes, also after a weight changed in place between
    replays (the next replay quantizes what it finds)."""
    built_shim("torch")
    models = {"cached": _model(kind, "cuda")}
    models["plain"] = copy.deepcopy(models["cached"])
    models["eager"] = copy.deepcopy(models["cached"])
    for name in ("plain", "eager"):
        for m in models[name].modules():
            if isinstance(m, fp8.Fp8Linear):
                m.cache_fp8_weight = False
    xs = [torch.randn(24, 32, generator=torch.Generator().manual_seed(i)).cuda() for i in range(4)]
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-2, capturable=True) for k, m in models.items()}

    def stepper(name):
        model, opt = models[name], opts[name]

        def step():
            for x in xs:
                model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            fp8.update_model_scales(model)
        return step

    steps = {k: stepper(k) for k in models}
    for _ in range(2):
        steps["eager"]()  # as the graphs' two warm-up steps (a capture itself runs nothing)
    graphs = {k: _captured(steps[k]) for k in ("cached", "plain")}
    counts = {k: _quantize_kernels(g.replay) for k, g in graphs.items()}  # the third step
    steps["eager"]()
    assert counts["plain"] - counts["cached"] == 3 * 2, counts  # 2 weights, 3 micro-batches reuse
    for step in range(3):
        if step == 1:
            with torch.no_grad():  # between replays, outside the graphs: an in-place change of the weights
                for m in models.values():
                    for p in m.parameters():
                        p.mul_(0.5)
        for g in graphs.values():
            g.replay()
        steps["eager"]()
        torch.cuda.synchronize()
        for name in ("cached", "plain"):
            for (key, a), b in zip(models[name].state_dict().items(), models["eager"].state_dict().values()):
                assert torch.equal(a, b), f"{name} step {step}: {key}"


@pytest.mark.gpu
def test_separate_captures_never_share_a_cached_weight():
    """Micro-batch graphs captured one after the other each quantize the weight themselves: graph B
    replayed alone after the weight changed uses the new weight (B filled nothing from A)."""
    built_shim("torch")
    torch.manual_seed(0)
    f = fp8.Fp8Linear(32, 16, recipe=R, device="cuda")
    x = torch.randn(24, 32, device="cuda")
    outs = {}

    def fwd(name):
        def run():
            with torch.no_grad():
                outs[name] = f(x)
        return run

    graph_a, graph_b = _captured(fwd("a")), _captured(fwd("b"))
    assert _quantize_kernels(graph_b.replay) == _quantize_kernels(graph_a.replay) >= 2  # x's and w's, each
    with torch.no_grad():
        f.weight.mul_(2)
    graph_b.replay()
    torch.cuda.synchronize()
    f.clear_fp8_weight()
    with torch.no_grad():
        want = f(x)
    assert torch.equal(outs["b"], want)


@pytest.mark.parametrize("kind", ["linear", "mlp", "block-linear", "block-mlp"])
def test_compiling_after_eager_steps_compiles_once(kind):
    """A model run eagerly (its weight cache filled), then compiled: the cache is not used while
    dynamo traces, and tracing writes nothing to it, so the graph is compiled once (a write to the
    cache's epoch would be a guard that the next call fails, and each such call compiles again)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    r = ff.BlockScaling() if kind.startswith("block") else R
    model = (fp8.Fp8MLP(32, 64, recipe=r) if kind.endswith("mlp") else
             nn.Sequential(fp8.Fp8Linear(32, 48, recipe=r), fp8.Fp8Linear(48, 32, recipe=r)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(24, 32)

    def step(forward):
        forward(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if not kind.startswith("block"):
            fp8.update_model_scales(model)  # (the first one links the states: one step before compiling)

    step(model)
    model(x)  # eagerly: fills the cache
    assert all(m._wcache.value is not None for m in model.modules() if hasattr(m, "_wcache"))
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(3):
        step(compiled)
    assert len(compiles) == 1
