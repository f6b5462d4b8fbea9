"""Every launch runs under its tensor's device, whatever the caller's current device.

A kernel handle is valid in the context it was loaded into only. On the CPU (a stand-in for the
driver's context calls, tests/support/fake_cuda.py): the Python executor runs a plan in its
device's context from another GPU's, from none (a fresh thread) and from its own, and restores the
caller's, also after a failed launch; every cached plan carries its device; the occupancy query,
the shared-memory attribute and the static shared size run in the kernel's context, and a driver
error there raises instead of becoming one block per multiprocessor; plans for several GPUs built
while the first is current get each GPU's own occupancy (what the JAX primitives do for every local
GPU). The compiled shim's context guard (plan.h, held by the torch ops and the cuBLASLt GEMM) runs
against a fake libcuda.so.1. On two GPUs (marked, skipped elsewhere): the functions on the second
GPU while the first is current, and from a thread that has no context."""
from __future__ import annotations

import json
import os
import subprocess
import threading

import numpy as np
import pytest

from fusedfp8 import launch
from fusedfp8.launch import executor as E, format as P, kernels as K, plans as PL
from fusedfp8 import csrc as shim
from support import fake_cuda as F
from support.fake_cuda import FakeDriver, primary

SMS = 132
QKEY = K.ModuleKey("quantize", "bfloat16", "e4m3", "identity")


@pytest.fixture
def fake(monkeypatch):
    return F.install(monkeypatch.setattr)


def device_refs(key: K.ModuleKey, device: int) -> dict:
    """Made-up kernel references (4 resident blocks a multiprocessor), with handles of ``device``
    (FakeDriver's rule)."""
    return {role: PL.KernelRef(device * FakeDriver.DEVICE_STRIDE + 1000 + i, expr, role, 4, F.fake_id(expr))
            for i, (role, expr) in enumerate(K.name_expressions(key).items())}


def a_plan(device: int) -> P.Plan:
    """A memset, then a plain launch (dgelu with dbias: the counters' memset, the tiled kernel),
    and a cooperative one (a first step), tagged with ``device``."""
    key = K.ModuleKey("quantize", "bfloat16", "e4m3", "dgelu_tanh")
    refs = {**device_refs(key, device), **device_refs(key._replace(family="current_quantize"), device)}
    plain = PL.build_quantize_plan(refs, SMS, 300, 64, True, True)
    coop = PL.build_quantize_plan(refs, SMS, 300, 64, False, False, True)
    return P.make_plan(PL.QUANTIZE_SLOTS, plain.steps + coop.steps)._replace(device=device)


PTRS = tuple(0x10000 * (i + 1) for i in range(len(PL.QUANTIZE_SLOTS)))


# ---- the Python executor -----------------------------------------------------------------------
@pytest.mark.parametrize("start", [0, None, 1], ids=["another-gpu-current", "no-context", "own-context"])
def test_a_plan_runs_in_its_devices_context_and_restores_the_callers(fake, start):
    fake.start = start
    before = list(fake.stack())
    E.execute(a_plan(1), PTRS, 0x5)
    kinds = [r[0] for r in fake.records]
    assert kinds == ["memset", "launch", "coop"]
    assert all(r[2] == primary(1) for r in fake.records)  # every step in device 1's context
    assert fake.stack() == before  # the caller's context (or none) is current again
    assert fake.calls == ([] if start == 1 else [("push", primary(1)), ("pop", primary(1))])
    assert fake.retained == [1]


def test_a_failed_launch_still_restores_the_callers_context(fake):
    fake.fail_launch = 700
    with pytest.raises(RuntimeError, match=r"launching quantize_tiled<.*CUDA error 700"):
        E.execute(a_plan(1), PTRS, 0x5)
    assert fake.stack() == [primary(0)] and [c[0] for c in fake.calls] == ["push", "pop"]


def test_without_the_guard_the_launch_would_fail(fake):
    """The fake is faithful: a plan whose device tag is dropped runs in the caller's context, and
    its kernels (device 1's) are refused there, as the driver refuses them."""
    with pytest.raises(RuntimeError, match=f"CUDA error {F.CUDA_ERROR_INVALID_CONTEXT}"):
        E.execute(a_plan(1)._replace(device=-1), PTRS, 0x5)
    assert fake.calls == []


def test_a_thread_without_a_context_gets_the_plans(fake):
    """A thread that made no CUDA call has no current context (torch's autograd workers)."""
    fake.start = None
    errors = []

    def run():
        try:
            E.execute(a_plan(0), PTRS, 0x5)
            assert fake.current() is None
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    assert [r[2] for r in fake.records] == [primary(0)] * 3


# ---- the plans carry their device ----------------------------------------------------------------
PLANS = {  # every cached plan of fusedfp8.launch, by name: a call for device d
    "quantize": lambda d: launch.quantize_plan(d, "bfloat16", "e4m3", "identity", 300, 64, True, False, True),
    "layernorm": lambda d: launch.layernorm_plan(d, "bfloat16", "float32", "e4m3", 300, 4000, True, True),
    "amax": lambda d: launch.amax_plan(d, "bfloat16", "gelu_tanh", 4096),
    "layernorm_amax": lambda d: launch.layernorm_amax_plan(d, "bfloat16", "float32", 300, 1024),
    "dequantize": lambda d: launch.dequantize_plan(d, "bfloat16", "e4m3", 4096),
    "update": lambda d: launch.update_plan(d, 6, 16, 1.0, True),
    "block_quantize": lambda d: launch.block_quantize_plan(d, "bfloat16", "e4m3", (1, 128), 300, 4000, True),
    "block_layernorm": lambda d: launch.block_layernorm_plan(d, "bfloat16", "float32", "e4m3", 300, 4000, True),
}


@pytest.fixture
def fake_gpus(fake, monkeypatch):
    """Two GPUs of the FakeDriver, device 0 current, kernels and plans made from nothing."""
    monkeypatch.setattr(K, "load", F.fake_kernels)
    monkeypatch.setattr(K, "sm_count", lambda device: SMS)
    monkeypatch.setattr(K, "shared_optin", lambda device: 227 << 10)
    clear = [launch.quantize_plan, launch.layernorm_plan, launch.amax_plan, launch.layernorm_amax_plan,
             launch.dequantize_plan, launch.update_plan, launch.block_quantize_plan, launch.block_layernorm_plan]
    for fn in clear:
        fn.cache_clear()
    yield fake
    for fn in clear:
        fn.cache_clear()


def test_every_cached_plan_is_a_function_of_its_device(fake_gpus):
    assert set(PLANS) == {n[:-5] for n, f in vars(launch).items() if n.endswith("_plan") and hasattr(f, "cache_clear")}
    for name, make in PLANS.items():
        for device in (0, 1):
            plan = make(device)
            assert plan.device == device, name
            funcs = {v.func for st in plan.steps if isinstance(st, P.Launch) for v in st.variants}
            assert funcs and all(f // FakeDriver.DEVICE_STRIDE == device for f in funcs), name


def test_plans_for_every_gpu_get_each_gpus_occupancy(fake_gpus):
    """Plans for both GPUs built while device 0 is current (as the JAX primitives build them for
    every local GPU): each kernel's occupancy is queried in its own device's context and sizes its
    own plan's grids; the caller's context is current after."""
    fake_gpus.per_sm = {0: 4, 1: 2}
    for device in (0, 1):
        for name, make in PLANS.items():
            make(device)
    queries = [r for r in fake_gpus.records if r[0] in ("occupancy", "get_attribute", "set_attribute")]
    assert {r[0] for r in queries} == {"occupancy", "get_attribute", "set_attribute"}  # the q_t tile's shared memory
    assert all(r[2] == primary(r[1] // FakeDriver.DEVICE_STRIDE) for r in queries)
    assert fake_gpus.stack() == [primary(0)]
    grids = [launch.amax_plan(d, "bfloat16", "gelu_tanh", 10 ** 8).steps[-1].variants[0].grid for d in (0, 1)]
    assert grids == [4 * SMS, 2 * SMS]


def test_an_occupancy_error_raises_instead_of_one_block(fake_gpus):
    kernel = K.load(QKEY, 1)["flat_vec1_store1"]
    fake_gpus.cuOccupancyMaxActiveBlocksPerMultiprocessor = lambda n, func, block, shared: 999
    for _ in range(2):  # not cached as an answer
        with pytest.raises(RuntimeError, match=r"occupancy query of quantize_flat<.*> \(256 threads, 0 bytes .*"
                                               r"cuda:1 failed: CUDA error 999"):
            kernel.blocks_per_sm(256)
    with pytest.raises(RuntimeError, match="occupancy query"):
        launch.quantize_plan(1, "bfloat16", "e4m3", "identity", 64, 64)
    assert fake_gpus.stack() == [primary(0)]


def test_a_kernel_queried_outside_its_context_would_fail(fake_gpus):
    """The fake is faithful: the same query in device 0's context is refused for device 1's kernel."""
    kernel = K.load(QKEY, 1)["flat_vec1_store1"]
    kernel.device = 0  # as if the kernel were taken for device 0's: no context switch
    with pytest.raises(RuntimeError, match=f"CUDA error {F.CUDA_ERROR_INVALID_CONTEXT}"):
        kernel.blocks_per_sm(128)


# ---- the compiled shim's guard (plan.h), against a fake libcuda.so.1 -----------------------------
FAKE_LIBCUDA = r"""
// libcuda.so.1 for the test: contexts are the handles 0xC00000 + device, one current context per
// thread; a launch records the context it ran in and fails for a kernel of another device's
// (the handle's device is handle / 0x10000), as the driver does.
#include <cstddef>
#include <cstdint>
#include <vector>
typedef int CUresult;
static thread_local void* current = nullptr;
static std::vector<uintptr_t> g_log;  // the context of each launch
static int g_sets = 0;
static uintptr_t ctx_of(int d) { return 0xC00000 + d; }
extern "C" {
CUresult cuCtxGetCurrent(void** c) { *c = current; return 0; }
CUresult cuCtxSetCurrent(void* c) { current = c; ++g_sets; return 0; }
CUresult cuCtxGetDevice(int* d) { if (!current) return 201; *d = (int)((uintptr_t)current - 0xC00000); return 0; }
CUresult cuDeviceGet(int* dev, int ordinal) { if (ordinal >= 4) return 101; *dev = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** c, int dev) { *c = (void*)ctx_of(dev); return 0; }
CUresult cuLaunchKernel(void* f, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                        void**) {
  g_log.push_back((uintptr_t)current);
  return (uintptr_t)current == ctx_of((int)((uintptr_t)f / 0x10000)) ? 0 : 201;
}
CUresult cuLaunchCooperativeKernel(void* f, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                                   void**) { return cuLaunchKernel(f, 0, 0, 0, 0, 0, 0, 0, nullptr, nullptr, nullptr); }
CUresult cuMemsetD32Async(unsigned long long, unsigned, size_t, void*) { return 0; }
CUresult cuMemcpyDtoDAsync_v2(unsigned long long, unsigned long long, size_t, void*) { return 0; }
CUresult cuGetErrorName(CUresult, const char** s) { *s = "FAKE"; return 0; }
CUresult cuGetErrorString(CUresult, const char** s) { *s = "fake"; return 0; }
int fake_sets() { return g_sets; }
size_t fake_launches(uintptr_t* out, size_t cap) {
  for (size_t i = 0; i < g_log.size() && i < cap; ++i) out[i] = g_log[i];
  size_t n = g_log.size();
  g_log.clear();
  return n;
}
}
"""

GUARD_MAIN = r"""
// Runs a one-launch plan of device 1's kernel under ff8::ContextGuard(1) from each starting
// context, and prints what the fake driver saw, as JSON lines.
#include <dlfcn.h>
#include <cstdio>
#include <thread>
#include "plan.h"

using Launches = size_t (*)(uintptr_t*, size_t);
using Sets = int (*)();

int main() {
  const ff8::Driver& d = ff8::driver();
  if (!d.why.empty()) { std::printf("{\"error\": \"%s\"}\n", d.why.c_str()); return 1; }
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  auto launches = reinterpret_cast<Launches>(dlsym(lib, "fake_launches"));
  auto sets = reinterpret_cast<Sets>(dlsym(lib, "fake_sets"));
  const int64_t kid = 7;  // device 1's kernel, registered as the Python side does for a module it loads
  if (!ff8::kernels::add(1, kid, 0x10000 + 0x40).empty()) return 1;
  const int64_t plan[] = {ff8::kPlanVersion, 1, 1, ff8::kLaunch, 1, 0, 32, 0, 1, kid, 1, ff8::kPtr, 0, 0, 0};
  const uint64_t bufs[] = {0x1000};
  auto run = [&](const char* label, void* start, int device, bool guarded) {
    d.ctx_set_current(start);
    const int sets_before = sets();
    std::string err;
    {
      ff8::ContextGuard g(device);
      err = g.error();
      if (err.empty() || !guarded) {
        std::string e = ff8::run(plan, sizeof plan / sizeof plan[0], bufs, 1, 1, nullptr, "k");
        if (err.empty()) err = e;
      }
    }
    uintptr_t seen[4] = {0};
    const size_t n = launches(seen, 4);
    void* after = nullptr;
    d.ctx_get_current(&after);
    std::printf("{\"case\": \"%s\", \"launches\": %zu, \"launch_ctx\": %lu, \"after\": %lu, \"sets\": %d, "
                "\"error\": \"%s\"}\n", label, n, (unsigned long)seen[0], (unsigned long)(uintptr_t)after,
                sets() - sets_before, err.c_str());
  };
  run("another-gpu-current", (void*)0xC00000, 1, true);
  run("no-context", nullptr, 1, true);
  run("own-context", (void*)0xC00001, 1, true);
  run("no-such-device", (void*)0xC00000, 7, true);
  run("unguarded", (void*)0xC00000, 0, false);  // device 0's guard, device 1's kernel: refused
  std::thread t([&] { run("fresh-thread", nullptr, 1, true); });
  t.join();
  return 0;
}
"""


def test_the_shims_context_guard_holds_the_devices_context(tmp_path):
    """plan.h's ContextGuard, which the torch C++ ops (run_plan) and the cuBLASLt GEMM (through
    gemm.h's on_device) hold for every launch: the launch runs in the device's primary context from
    another GPU's, from none and from a fresh thread, the caller's context is current again after,
    nothing is switched when the context is current already, and a device that cannot be had is an
    error, not a launch."""
    cxx = shim.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "fake.cc").write_text(FAKE_LIBCUDA)
    (tmp_path / "main.cc").write_text(GUARD_MAIN)
    for cmd in ([*cxx.split(), "-std=c++17", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"),
                 str(tmp_path / "fake.cc")],
                [*cxx.split(), "-std=c++17", f"-I{shim.HERE}", "-o", str(tmp_path / "main"), str(tmp_path / "main.cc"),
                 "-ldl", "-pthread"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    proc = subprocess.run([str(tmp_path / "main")], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {r.pop("case"): r for r in map(json.loads, proc.stdout.splitlines())}
    ctx0, ctx1 = 0xC00000, 0xC00001
    assert got["another-gpu-current"] == {"launches": 1, "launch_ctx": ctx1, "after": ctx0, "sets": 2, "error": ""}
    assert got["no-context"] == {"launches": 1, "launch_ctx": ctx1, "after": 0, "sets": 2, "error": ""}
    assert got["fresh-thread"] == got["no-context"]
    assert got["own-context"] == {"launches": 1, "launch_ctx": ctx1, "after": ctx1, "sets": 0, "error": ""}
    assert got["no-such-device"]["launches"] == 0 and got["no-such-device"]["after"] == ctx0
    assert "retaining the primary context of CUDA device 7 failed" in got["no-such-device"]["error"]
    assert got["unguarded"]["launch_ctx"] == ctx0 and "CUDA error 201" in got["unguarded"]["error"]


# ---- two GPUs ----------------------------------------------------------------------------------
two_gpus = pytest.mark.skipif(K._gpu_count()[0] < 2, reason="needs two CUDA GPUs")


@pytest.mark.gpu
@two_gpus
def test_the_functions_on_the_second_gpu_while_the_first_is_current():
    """quantize (a slot and a plain scale), layernorm_quantize, dequantize and update_scales on
    cuda:1 tensors (torch) and arrays (cupy) while device 0 is current: the reference's bytes,
    and device 0 still current after."""
    import cupy
    import torch

    import fusedfp8 as ff
    from fusedfp8.numerics import reference as ref
    from support.frameworks import to_np

    recipe = ff.DelayedScaling(amax_history_len=4)
    rng = np.random.default_rng(3)
    xn = (rng.standard_normal((300, 256)) * 3).astype(np.float32)
    wn = rng.standard_normal(256).astype(np.float32)
    host = ff.ScalingState.create(2, recipe, like=np.zeros(1, np.float32))
    want_q = ff.quantize(xn, host.slot(0, recipe), transpose=True)
    want_ln = ff.layernorm_quantize(xn, wn, None, 1e-5, host.slot(1, recipe))
    want_dq = ff.dequantize(want_q.data, np.ones(1, np.float32), "float32")
    host = ff.update_scales(host, recipe)
    torch.cuda.set_device(0)
    x, w = torch.from_numpy(xn).to("cuda:1"), torch.from_numpy(wn).to("cuda:1")
    st = ff.ScalingState.create(2, recipe, like=torch.zeros(1, device="cuda:1"))
    q = ff.quantize(x, st.slot(0, recipe), transpose=True)
    ln = ff.layernorm_quantize(x, w, None, 1e-5, st.slot(1, recipe))
    dq = ff.dequantize(q.data, torch.ones(1, device="cuda:1"), "float32")
    st = ff.update_scales(st, recipe)
    plain = ff.quantize(x, 1.0)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    for got, want in ((q.data, want_q.data), (q.data_t, want_q.data_t), (ln.quantized.data, want_ln.quantized.data),
                      (ln.mean, want_ln.mean), (dq, want_dq), (plain.data, ref.quantize(xn, np.float32(1), "e4m3").data)):
        assert to_np(got).tobytes() == np.asarray(want).tobytes()
    for f in ("amax_history", "scale", "scale_inv", "updates"):
        assert to_np(getattr(st, f)).tobytes() == getattr(host, f).tobytes(), f
    with cupy.cuda.Device(1):
        xc = cupy.asarray(xn)
    with cupy.cuda.Device(0):
        r = ff.quantize(xc, 1.0, transpose=True)
        assert r.data.device.id == 1 and cupy.cuda.Device().id == 0
    assert r.data.get().tobytes() == ref.quantize(xn, np.float32(1), "e4m3", True).data.view(np.uint8).tobytes()


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "python"])
def test_a_thread_without_a_context_launches_on_the_second_gpu(cpp):
    """A fresh thread (no current context; torch's current device there is 0) quantizes cuda:1
    tensors with a first step, through the custom ops' C++ and Python launch paths."""
    import torch

    import fusedfp8 as ff
    from fusedfp8.pytorch import custom_ops as C
    from support.torch_helpers import launch_path

    x = torch.randn(256, 512, device="cuda:1")
    st = ff.ScalingState.create(1, ff.CurrentScaling(), like=torch.zeros(1, device="cuda:1"))
    got, errors = [], []

    def run():
        try:
            got.extend(C.call(C.quantize, x, st.amax_history, st.scale, st.scale_inv, st.updates, 0, "e4m3", 1.0,
                              True))
            torch.cuda.synchronize(1)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with launch_path(cpp):
        t = threading.Thread(target=run)
        t.start()
        t.join()
    assert not errors, errors
    q, si = got
    scale = float(st.scale[0])
    assert scale != 1.0 and float(si[0]) == np.float32(1) / np.float32(scale)
    assert torch.equal(q.view(torch.uint8), ff.quantize(x, scale).data.view(torch.uint8))


@pytest.mark.gpu
@two_gpus
def test_occupancy_on_the_second_gpu_is_its_own():
    """Plans for cuda:1 built while device 0 is current size their grids from cuda:1's occupancy:
    on two GPUs of one model, the same numbers as cuda:0's (the query no longer fails into 1)."""
    import cupy

    props = [cupy.cuda.runtime.getDeviceProperties(d)["name"] for d in (0, 1)]
    if props[0] != props[1]:
        pytest.skip(f"two GPUs of different models ({props})")
    with cupy.cuda.Device(0):
        for role in ("flat_vec1_store1", "tiled"):
            per = [K.load(QKEY, d)[role].blocks_per_sm(256) for d in (0, 1)]
            assert per[0] == per[1] > 1, (role, per)
        plans = [launch.layernorm_plan(d, "bfloat16", "float32", "e4m3", 4096, 1024, True) for d in (0, 1)]
    grids = [[[v.grid for v in st.variants] for st in p.steps if isinstance(st, P.Launch)] for p in plans]
    assert grids[0] == grids[1] and [p.device for p in plans] == [0, 1]
