"""CUDA-graph captures: a kernel module is never loaded inside one.

The first call of a kernel module would compile and load it; inside a capture (in the default
global mode) loading a module invalidates the capture. On the CPU, against a stand-in for the
driver (tests/support/fake_cuda.py): every launch function refuses to load a module while its
stream captures, with a message naming the warm-up, before it loads or launches anything; a
module loaded before is planned for a new shape and launched inside the capture; the legacy
stream counts as capturing while another stream of its context captures. On the GPU (marked):
the torch ops' C++ and Python launch paths refuse inside torch.cuda.graph and leave the capture
usable, then capture after the warm-up (a new shape of a loaded module included) and replay the
eager bytes."""
from __future__ import annotations

import pytest

from fusedfp8 import launch
from fusedfp8.launch import kernels as K
from support import fake_cuda as F

STREAM = 0x5
PLAN_FNS = (launch.quantize_plan, launch.layernorm_plan, launch.amax_plan, launch.layernorm_amax_plan,
            launch.dequantize_plan, launch.update_plan)

# every route that loads a module: the launch functions of fusedfp8.ops, on raw pointers
LAUNCHES = {
    "quantize": (lambda: launch.quantize(0, STREAM, dict(x=0x1000, q=0x2000, scale=0x3000, amax=0x4000, updates=0x5000,
                                                         scale_out=0x3000, scale_inv_out=0x6000),
                                         dtype="bfloat16", fmt="e4m3", op="gelu_tanh", rows=64, cols=64, first=True),
                 ["quantize", "current_quantize"]),
    "layernorm": (lambda: launch.layernorm_quantize(
        0, STREAM, dict(x=0x1000, q=0x2000, mean=0x3000, rstd=0x4000, scale=0x5000, amax=0x6000), dtype="bfloat16",
        param="float32", fmt="e4m3", rows=64, cols=64, eps=1e-5), ["layernorm_quantize"]),
    "dequantize": (lambda: launch.dequantize(0, STREAM, dict(q=0x1000, out=0x2000, scale_inv=0x3000), dtype="float32",
                                             fmt="e5m2", n=64), ["dequantize"]),
    "update": (lambda: launch.update_scales(0, STREAM, dict(amax_history=1, scale=2, scale_inv=3, overflows=4,
                                                            updates=5, fmt_max=6), n=3, L=8, margin_factor=1.0,
                                            algo_max=True),
               ["update_scales"]),
}


@pytest.fixture
def fake(monkeypatch):
    """The FakeDriver, no module loaded; K._build makes fake kernels and records what it loads."""
    drv = F.install(monkeypatch.setattr)
    drv.built = []

    def build(key, device):
        drv.built.append(key.family)
        return F.fake_kernels(key, device)

    monkeypatch.setattr(K, "_loaded", {})
    monkeypatch.setattr(K, "_build", build)
    monkeypatch.setattr(K, "sm_count", lambda device: 132)
    monkeypatch.setattr(K, "shared_optin", lambda device: 227 << 10)
    for fn in PLAN_FNS:
        fn.cache_clear()
    yield drv
    for fn in PLAN_FNS:
        fn.cache_clear()


@pytest.mark.parametrize("route", list(LAUNCHES))
def test_a_capture_refuses_to_load_a_module_and_names_the_warm_up(fake, route):
    launch, families = LAUNCHES[route]
    fake.capturing.add(STREAM)
    with pytest.raises(RuntimeError, match=r"the \w+ kernels \(.*\) are not loaded on cuda:0 yet, and the stream is "
                                           r"capturing a CUDA graph.*Warm up first: run the same call"):
        launch()
    assert fake.built == [] and fake.records == []  # nothing loaded, nothing launched
    fake.capturing.clear()  # the warm-up, outside the capture: loads and launches
    launch()
    assert fake.built == families and [r[0] for r in fake.records if r[0] in ("launch", "coop", "memset")]
    assert all(r[3] == STREAM for r in fake.records if r[0] in ("launch", "coop", "memset"))


def test_a_loaded_module_is_planned_and_launched_inside_a_capture(fake):
    """After the warm-up, a new shape of the same module (and a new layernorm width, whose
    transposed tile needs a new shared-memory attribute) is planned inside the capture: occupancy
    queries and attributes, no module load."""
    LAUNCHES["quantize"][0]()
    ln_buffers = dict(x=0x1000, q=0x2000, q_t=0x7000, mean=0x3000, rstd=0x4000, scale=0x5000, amax=0x6000)
    launch.layernorm_quantize(0, STREAM, ln_buffers, dtype="bfloat16", param="float32", fmt="e4m3", rows=64, cols=64,
                              eps=1e-5)
    built = list(fake.built)
    fake.capturing.add(STREAM)
    fake.records.clear()
    launch.quantize(0, STREAM, dict(x=0x1000, q=0x2000, scale=0x3000, amax=0x4000, q_t=0x7000, updates=0x5000,
                                    scale_out=0x3000, scale_inv_out=0x6000),
                    dtype="bfloat16", fmt="e4m3", op="gelu_tanh", rows=300, cols=40, first=True)
    launch.layernorm_quantize(0, STREAM, ln_buffers, dtype="bfloat16", param="float32", fmt="e4m3", rows=64, cols=4000,
                              eps=1e-5)
    assert fake.built == built  # nothing loaded in the capture
    kinds = [r[0] for r in fake.records]
    assert "set_attribute" in kinds and kinds.count("coop") == 1 and kinds.count("launch") == 1


def test_the_legacy_stream_counts_as_capturing_while_another_stream_captures(fake):
    fake.capturing.add(0x77)
    with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
        launch.dequantize(0, 0, dict(q=0x1000, out=0x2000, scale_inv=0x3000), dtype="float32", fmt="e5m2", n=64)
    assert fake.built == []


def test_building_plans_outside_a_launch_is_not_refused(fake):
    """Plans built at trace time (the JAX primitives, for every local GPU) name no stream: nothing
    to refuse, the module loads."""
    fake.capturing.add(STREAM)
    launch.quantize_plan(0, "bfloat16", "e4m3", "identity", 64, 64)
    assert fake.built == ["quantize"]


# ---- the GPU: torch.cuda.graph -----------------------------------------------------------------
@pytest.fixture
def unloaded(monkeypatch):
    """``unload(*families)``: those modules as not loaded yet (the rest as loaded), and no plan cached
    anywhere (the launch caches, the custom ops' checked signatures, the C++ ops' cache), before and
    after the test."""
    from fusedfp8 import csrc
    from fusedfp8.pytorch import op_plans

    def forget():
        for fn in PLAN_FNS:
            fn.cache_clear()
        op_plans._checked.clear()
        lib, _ = csrc.library("torch")
        if lib is not None:
            lib.clear_cache()

    def unload(*families):
        monkeypatch.setattr(K, "_loaded", {k: v for k, v in K._loaded.items() if k[0].family not in families})
        forget()

    yield unload
    forget()


@pytest.mark.gpu
@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "python"])
def test_torch_ops_refuse_to_load_in_a_capture_then_capture_after_the_warm_up(cpp, unloaded):
    import torch

    from fusedfp8.pytorch import custom_ops as C
    from fusedfp8.recipe import DelayedScaling
    from fusedfp8.state import ScalingState
    from support.frameworks import same_bytes
    from support.torch_helpers import launch_path

    recipe = DelayedScaling(amax_history_len=4)

    def state():
        s = ScalingState.create(2, recipe, like=torch.zeros(1, device="cuda"))
        return [s.amax_history, s.scale, s.scale_inv, s.updates]

    def step(x, st):
        q, si = C.call(C.gelu_quantize, x, *st, 0, "e4m3", 1.0, True, "tanh")
        ln = C.call(C.layernorm_quantize, x, None, None, 1e-5, *st, 1, "e4m3", 1.0, True, True)
        return [q, si, *ln]

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    with launch_path(cpp):
        unloaded("quantize", "current_quantize", "layernorm_quantize")
        st = state()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="not loaded on cuda:0 yet, and the stream is capturing a CUDA graph"):
            with torch.cuda.graph(graph):  # (global mode: a module load here would invalidate the capture)
                step(x, st)
        assert not any(k[0].family == "quantize" for k in K._loaded)
        step(x, state())  # the warm-up
        for shape in ((256, 512), (96, 4000)):  # the warmed-up shape, then a new one of the loaded modules
            xs = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
            eager_st, graph_st = state(), state()
            want = step(xs, eager_st)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = step(xs, graph_st)
            graph.replay()
            torch.cuda.synchronize()
            for k, (g, w) in enumerate(zip(got + graph_st, want + eager_st)):
                assert same_bytes(g, w), (shape, k)
