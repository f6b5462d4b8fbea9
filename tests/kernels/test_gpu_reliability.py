"""Reliability of the kernels on the GPU (issue 8): a tensor of more than 2^31 elements, threads
on separate streams racing to compile, memory (10,000 calls; allocations inside a captured CUDA
graph) and determinism across runs and launch configurations. GPU only (skipped with the probe's
reason elsewhere); the CPU has nothing to race, leak or reorder here. Expected runtime on an
H200: well under a minute once the kernels are compiled (the first compile of a module costs
NVRTC time when CuPy's cache is cold)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fusedfp8 import launch, ops
from fusedfp8.launch import kernels as K, plans as PL
from fusedfp8.numerics import reference as ref
from fusedfp8.recipe import DelayedScaling
from fusedfp8.state import STATE_FIELDS, ScalingState
from support.frameworks import bytes_of as raw
from support.frameworks import to_np as host

pytestmark = pytest.mark.gpu

DEV = "cuda"
R = DelayedScaling(amax_history_len=8)


# ---- more than 2^31 elements ----------------------------------------------------------------
def _check_slices(x_dev, q_dev, scale: float, slices) -> None:
    for sl in slices:
        want = ref.quantize(host(x_dev[sl]), np.float32(scale), "e4m3")
        assert raw(q_dev[sl]) == want.data.tobytes(), sl


@pytest.mark.slow
def test_quantize_more_than_2_31_elements_flat_and_transposed():
    """bf16 (65552, 32784) = 2^31 + 1,573,120 elements (4.3 GB): a flat quantize of the whole
    buffer and a quantize with transpose of the 2-D view. The amax is planted beyond element
    2^31 (then a NaN there), and slices on both sides of 2^31 (rows, and columns of the
    transpose) are compared byte for byte with the reference."""
    rows, cols = 65536 + 16, 32768 + 16
    n = rows * cols
    assert n > 2 ** 31
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(rows, cols, device=DEV, dtype=torch.bfloat16, generator=g)
    flat = x.view(-1)
    flat[-1] = 1000.0  # the amax, at the last element
    s = torch.full((1,), 0.25, device=DEV)
    edge = 2 ** 31
    flat_slices = [slice(0, 4096), slice(edge - 4096, edge + 4096), slice(n - 4096, n)]

    r = ops.quantize(flat, s)
    assert r.amax.item() == 1000.0
    _check_slices(flat, r.data, 0.25, flat_slices)
    flat[edge + 7] = float("nan")
    r = ops.quantize(flat, s)
    assert np.isnan(r.amax.item())
    assert raw(r.data[edge + 7:edge + 8]) == bytes([0x7F])
    del r
    flat[edge + 7] = 0.5

    r = ops.quantize(x, s, transpose=True)
    assert r.amax.item() == 1000.0 and tuple(r.data_t.shape) == (cols, rows)
    _check_slices(flat, r.data.view(-1), 0.25, flat_slices)
    for rs in (slice(0, 8), slice(edge // cols - 4, edge // cols + 4), slice(rows - 8, rows)):
        want = ref.quantize(host(x[rs]), np.float32(0.25), "e4m3", transpose=True)
        assert raw(r.data_t[:, rs]) == want.data_t.tobytes(), rs
    cs = slice(cols - 8, cols)
    want = ref.quantize(host(x[:, cs]), np.float32(0.25), "e4m3", transpose=True)
    assert raw(r.data_t[cs]) == want.data_t.tobytes()
    del r, x, flat
    torch.cuda.empty_cache()


@pytest.mark.slow
@pytest.mark.parametrize("rows", [32752, 32768], ids=["32bit_offsets_top", "64bit_from_2_31"])
def test_tiled_quantize_on_both_sides_of_the_32_bit_offset_switch(rows):
    """quantize_tiled takes 32-bit offsets while prows * pcols < 2^31 and 64-bit ones from there
    (issue 18). bf16 (32752, 65536) is 2^31 - 2^20 elements, the 32-bit loop with offsets up to its
    top; (32768, 65536) is 2^31 exactly, the 64-bit loop. The amax is planted at the last element;
    q and q_t of the last rows and columns are compared byte for byte with the reference."""
    cols = 65536
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(rows, cols, device=DEV, dtype=torch.bfloat16, generator=g)
    x[-1, -1] = 1000.0
    s = torch.full((1,), 0.25, device=DEV)
    r = ops.quantize(x, s, transpose=True)
    assert r.amax.item() == 1000.0 and tuple(r.data_t.shape) == (cols, rows)
    n = rows * cols
    _check_slices(x.view(-1), r.data.view(-1), 0.25, [slice(0, 4096), slice(n - 70000, n)])
    for rs in (slice(0, 8), slice(rows - 136, rows)):
        want = ref.quantize(host(x[rs]), np.float32(0.25), "e4m3", transpose=True)
        assert raw(r.data_t[:, rs]) == want.data_t.tobytes(), rs
    cs = slice(cols - 72, cols)
    want = ref.quantize(host(x[:, cs]), np.float32(0.25), "e4m3", transpose=True)
    assert raw(r.data_t[cs]) == want.data_t.tobytes()
    del r, x
    torch.cuda.empty_cache()


# ---- concurrency -----------------------------------------------------------------------------
def test_threads_on_separate_streams_race_to_compile_and_get_correct_results(monkeypatch):
    """12 threads, each on its own stream, start together (a barrier) with an empty kernel cache:
    6 distinct modules, each wanted by 2 threads at once. Each module is built once, and every
    result equals the reference."""
    monkeypatch.setattr(K, "_loaded", {})
    before = K.compile_count
    combos = [("bfloat16", "e4m3", "identity"), ("float16", "e5m2", "identity"), ("float32", "e4m3", "gelu"),
              ("bfloat16", "e4m3", "gelu"), ("float32", "e5m2", "dgelu"), ("float16", "e5m2", "dgelu")]
    jobs = [c for c in combos for _ in range(2)]
    barrier = threading.Barrier(len(jobs))
    results, errors = [None] * len(jobs), []
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((300, 260)) * 4).astype(np.float32) for _ in jobs]

    def work(k):
        dtype, fmt, op = jobs[k]
        try:
            tdt = getattr(torch, dtype)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                x = torch.from_numpy(data[k]).to(DEV).to(tdt)
                s = torch.full((1,), 2.0, device=DEV)
                barrier.wait(timeout=300)  # (a thread that fails first breaks it for all)
                for _ in range(5):
                    if op == "identity":
                        r = ops.quantize(x, s, fmt, transpose=True)
                    elif op == "gelu":
                        r = ops.gelu_quantize(x, s, fmt, transpose=True)
                    else:
                        r = ops.dgelu_quantize(x, x, s, fmt, transpose=True)
                stream.synchronize()
                results[k] = (host(x), host(r.data), host(r.data_t), host(r.amax))
        except Exception as e:  # reported below with the thread's job
            errors.append((jobs[k], repr(e)))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert K.compile_count - before == len(combos)
    for (dtype, fmt, op), (xh, q, q_t, amax) in zip(jobs, results):
        if op == "identity":
            want = ref.quantize(xh, np.float32(2.0), fmt, transpose=True)
        elif op == "gelu":
            want = ref.gelu_quantize(xh, np.float32(2.0), fmt, transpose=True)
        else:
            want = ref.dgelu_quantize(xh, xh, np.float32(2.0), fmt, transpose=True)
        assert q.tobytes() == want.data.tobytes() and q_t.tobytes() == want.data_t.tobytes(), (dtype, fmt, op)
        assert amax.tobytes() == np.float32(want.amax).tobytes(), (dtype, fmt, op)


# ---- memory ----------------------------------------------------------------------------------
def test_10000_calls_leave_the_torch_and_cupy_pools_where_they_were():
    import cupy

    st = ScalingState.create((False, True), R, like=torch.zeros(1, device=DEV))
    x = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    s = torch.ones(1, device=DEV)
    q = ops.quantize(x, s).data

    def once(k):
        kind = k % 5
        if kind == 0:
            ops.quantize(x, st.slot(0, R), transpose=True)
        elif kind == 1:
            ops.gelu_quantize(x, s, approximate="none")
        elif kind == 2:
            ops.dgelu_quantize(dy, x, st.slot(1, R), transpose=True, dbias=True)
        elif kind == 3:
            ops.dequantize(q, s, "bfloat16")
        else:
            ops.update_scales(st, R)

    for k in range(50):  # compiles, the cached fmt_max array, the first steps
        once(k)
    torch.cuda.synchronize()
    pool = cupy.get_default_memory_pool()
    before = (torch.cuda.memory_allocated(), pool.used_bytes(), pool.total_bytes())
    for k in range(10_000):
        once(k)
    torch.cuda.synchronize()
    assert (torch.cuda.memory_allocated(), pool.used_bytes(), pool.total_bytes()) == before


def test_captured_ops_allocate_only_their_outputs_and_replay_correctly():
    st = ScalingState.create((False, True), R, like=torch.zeros(1, device=DEV))
    x = torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, first steps done, fmt_max cached
        for _ in range(2):
            ops.quantize(x, st.slot(0, R), transpose=True)
            ops.update_scales(st, R)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    m0 = torch.cuda.memory_allocated()
    # thread_local: an unsafe CUDA call from this thread still breaks the capture, but not one
    # from the JAX runtime's threads when the pytest worker also ran JAX tests (run 4 of 2026-12-03)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        r = ops.quantize(x, st.slot(0, R), transpose=True)
        m1 = torch.cuda.memory_allocated()
        ops.update_scales(st, R)
        m2 = torch.cuda.memory_allocated()
    n = x.numel()
    assert m1 - m0 <= 2 * n + 3 * 512, (m0, m1)  # q, q_t and the (1,) scale_inv, in 512-byte blocks
    assert m2 == m1  # the update allocates nothing
    for k in range(3):
        x.copy_(torch.randn(1024, 1024, device=DEV, dtype=torch.bfloat16) * 4.0 ** k)
        scale = st.scale[0:1].clone()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        want = ref.quantize(host(x), host(scale)[0], "e4m3", transpose=True)
        assert raw(r.data) == want.data.tobytes() and raw(r.data_t) == want.data_t.tobytes(), k


# ---- determinism -----------------------------------------------------------------------------
def _everything(xs) -> list[bytes]:
    """Three steps of quantize / gelu / dgelu(+dbias) / update on fixed inputs: every output,
    amax and state array as bytes."""
    st = ScalingState.create((False, True, False), R, like=torch.zeros(1, device=DEV))
    s = torch.full((1,), 3.0, device=DEV)
    out = []
    for step in range(3):
        for x, dy in xs:
            r0 = ops.quantize(x, st.slot(0, R), transpose=True)
            r1 = ops.dgelu_quantize(dy, x, st.slot(1, R), transpose=True, dbias=True)
            r2 = ops.gelu_quantize(x, st.slot(2, R), approximate="none")
            r3 = ops.quantize(x.view(-1), s)
            out += [raw(t) for t in (r0.data, r0.data_t, r1.data, r1.data_t, r1.dbias, r2.data, r3.data, r3.amax)]
        ops.update_scales(st, R)
        out += [raw(getattr(st, f)) for f in STATE_FIELDS]
    return out


@pytest.fixture
def fixed_grid(monkeypatch):
    """``fixed_grid(g)``: every flat and tiled launch planned from now on gets ``g`` blocks. The
    launch plans are cached per call signature, so the caches are emptied here and at the end."""
    plans = [launch.quantize_plan, launch.dequantize_plan, launch.update_plan]

    def clear():
        for cached in plans:
            cached.cache_clear()

    def use(g: int) -> None:
        monkeypatch.setattr(PL, "_flat_grid", lambda ref, sms, n: g)  # (where the plan builders read them)
        monkeypatch.setattr(PL, "_tiled_grid", lambda ref, sms, rows, cols: g)
        clear()

    yield use
    monkeypatch.undo()
    clear()


def test_bitwise_deterministic_across_runs_and_grids(fixed_grid):
    g = torch.Generator(device=DEV).manual_seed(3)
    big = torch.randn(2048 * 1024 + 9, device=DEV, dtype=torch.bfloat16, generator=g)
    big[::1001] *= 1e4
    xs = [(big[:2048 * 1024].view(2048, 1024), big[9:].view(2048, 1024) * 1e-3),  # aligned, vectorised
          (big[3:3 + 333 * 517].view(333, 517), big[5:5 + 333 * 517].view(333, 517))]  # ragged, unaligned
    base = _everything(xs)
    assert _everything(xs) == base
    for grid in (1, 3, 7, 1000):  # the grid-stride loops cover the work for any grid
        fixed_grid(grid)
        got = _everything(xs)
        differ = [k for k, (a, b) in enumerate(zip(base, got)) if a != b]
        assert not differ, (grid, differ)
