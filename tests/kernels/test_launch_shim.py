"""The launch plans (fusedfp8.launch: plans, format, executor) and the compiled host shim (fusedfp8/csrc):
the shim compiles; its packer hands the driver the same bytes as the Python executor; every
plan's parameter layout has exactly the parameter size the cubin declares; the plans launch what
the launch interface launched before plans existed; an encoded plan names its kernels by stable
ids, which the shims resolve in their registries (filled when a module loads) and refuse by name
when unloaded; the XLA FFI target registers and a jitted function lowers to the custom call on
CUDA; the torch C++ kernels are registered for the ops.
On the GPU (marked, skipped here): the shim path against the Python path byte for byte (torch
eager / dispatcher / compiled / CUDA-graphed, JAX jit with and without donation)."""
from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fusedfp8 import launch
from fusedfp8.launch import executor as E, format as P, kernels as K, plans as PL
from fusedfp8 import csrc as shim
from support import fake_cuda as F
from support import nvrtc as N
from support import shapes as S
from support.fake_cuda import FakeContexts
from support.shim import built as built_shim

SMS = 132
THREADS = PL.THREADS


# ---- plans with fake kernels -------------------------------------------------------------------
def fake_refs(key: K.ModuleKey, base: int | None = None) -> dict:
    """Role -> KernelRef with made-up handles (distinct per role and family) and occupancies. A
    quantize module comes with its current_quantize twin (the one-launch first step), as
    launch.quantize_plan merges them."""
    if base is None:
        base = {"quantize": 0x7F00_0000_1000, "dequantize": 0x7F10_0000_1000,
                "layernorm_quantize": 0x7F30_0000_1000, "block_quantize": 0x7F40_0000_1000}.get(key.family,
                                                                                                0x7F20_0000_1000)
    names = K.name_expressions(key)
    refs = {role: PL.KernelRef(base + 0x100 * i, expr, role, 2 + i % 3, F.fake_id(expr))
            for i, (role, expr) in enumerate(names.items())}
    if key.family == "quantize":
        refs.update(fake_refs(key._replace(family="current_quantize"), base + 0x10_0000))
    return refs


QKEY = K.ModuleKey("quantize", "bfloat16", "e4m3", "dgelu_tanh")
DQKEY = K.ModuleKey("dequantize", "float16", "e5m2")
UKEY = K.ModuleKey("update_scales")
LNKEY = K.ModuleKey("layernorm_quantize", "bfloat16", "e4m3", param="float32")
BQKEY = K.ModuleKey("block_quantize", "bfloat16", "e4m3", "identity")

# (rows, cols, transpose, dbias, first, margin_factor, offset): every launch configuration
QUANTIZE_CASES = [(r, c, t, d, f, m, o) for (r, c) in [(256, 1024), (303, 300), (1, 1), (0, 16), (16, 0), (24, 8)]
                  for t in (False, True) for d in (False, True) for f in (False, True)
                  for m, o in [(1.0, 0), (0.25, 12)]]


def quantize_plans():
    refs = fake_refs(QKEY)  # (a first step: the one-launch plan and the two-pass one beside it)
    return ([(case, PL.build_quantize_plan(refs, SMS, *case)) for case in QUANTIZE_CASES]
            + [((*case, "two-pass"), PL.build_quantize_plan(refs, SMS, *case, 1, False)) for case in QUANTIZE_CASES
               if case[4]])


def other_plans():
    return ([(("dequantize", n), PL.build_dequantize_plan(fake_refs(DQKEY), SMS, n)) for n in (0, 1, 4096, 10 ** 7)]
            + [(("update", n, L), PL.build_update_plan(fake_refs(UKEY), n, L, 0.5, algo)) for n, L, algo in
               [(1, 1, True), (3, 1024, False), (1024, 31, True)]]
            # the flax meta's update (JAX: decode, rule and counters in one launch, out of place)
            + [(("update_meta", n, L), PL.build_update_plan(fake_refs(UKEY), n, L, 0.5, algo, meta=True))
               for n, L, algo in [(3, 1, True), (3, 1024, False)]]
            + [(("layernorm", r, c, t, f, p), PL.build_layernorm_plan(
                fake_refs(LNKEY), SMS, r, c, t, f, 1e-5, 0.5, 4,
                PL.layernorm_tile(launch.padded(r, c, p)[1], 227 << 10)
                if t and not PL.split_transpose(launch.padded(r, c, p)[1]) else (0, 0), p))
               for r, c, p in [(2048, 1024, 1), (303, 300, 1), (0, 8, 1), (5, 20000, 1),  # (pad_to: padded kernels)
                               (303, 300, 16), (1, 8, 16), (8190, 1024, 16), (17, 40, 3), (40, 4100, 1)]
               for t in (False, True) for f in (False, True)]  # (q_t by transpose_fp8 from 4096 columns on)
            # the amax-only plans (current scaling across ranks): a memset, then the pre-pass kernel
            + [(("amax", n), PL.build_amax_plan(fake_refs(QKEY), SMS, n)) for n in (0, 1, 4096, 10 ** 7)]
            + [(("layernorm_amax", r, c), PL.build_layernorm_amax_plan(fake_refs(LNKEY), SMS, r, c, 1e-5))
               for r, c in [(0, 8), (303, 300), (2048, 1024)]]
            # block scaling: the amax zeroed, then the kernel of the block shape (none for an empty input)
            + [(("block", r, c, b, t, p), PL.build_block_quantize_plan(fake_refs(BQKEY), SMS, r, c, b, t, True, p))
               for r, c, p in [(0, 8, 1), (303, 300, 1), (303, 300, 16), (8192, 4096, 1)]
               for b in ((1, 128), (128, 128)) for t in (False, True)]
            # a plain gradient's column sums: the counters zeroed, the identity's dbias kernel
            + [(("block_dbias", r, c, t), PL.build_block_quantize_plan(fake_refs(BQKEY), SMS, r, c, (1, 128), t, False,
                                                                       16, True))
               for r, c in [(0, 8), (303, 300)] for t in (False, True)]
            # LayerNorm with 1x128 blocks: the layernorm module's statistics kernel, then block_quantize's
            # LayerNorm instantiation of the parameters' dtype
            + [(("block_layernorm", r, c, t, p, w), PL.build_block_layernorm_plan(
                {**fake_refs(BQKEY), "layernorm_stats": fake_refs(LNKEY)["layernorm_stats"]}, SMS, r, c, w, t, True, p,
                1e-5)) for r, c, p in [(0, 8, 1), (303, 300, 16), (2048, 4096, 1)] for t in (False, True)
               for w in K.CPP_TYPES])


def pointer_sets(n_slots: int):
    """Aligned, 8-byte aligned, unaligned and null pointers for the slots."""
    return [tuple(0x7000_0000_0000 + 0x10_0000 * (i + 1) for i in range(n_slots)),
            tuple(0x7000_0000_0000 + 0x10_0000 * (i + 1) + (8 if i % 2 == 0 else 0) for i in range(n_slots)),
            tuple(0x7000_0000_0000 + 0x10_0000 * (i + 1) + 2 * i for i in range(n_slots)),
            tuple(0 if i in (1, 3, 4, 5, 6) else 0x7100_0000_0000 + 0x100 * i for i in range(n_slots))]


def records(dry: bytes) -> list:
    """Parse the dry-run byte format: ('memset', ptr, nbytes) | ('launch' | 'coop', func, grid, block, shared,
    params) ('coop': a cooperative launch)."""
    out, at = [], 0
    while at < len(dry):
        (kind,) = struct.unpack_from("<q", dry, at)
        if kind == P.MEMSET:
            _, ptr, nbytes = struct.unpack_from("<qQq", dry, at)
            out.append(("memset", ptr, nbytes))
            at += 24
        else:
            _, func, grid, block, shared, size = struct.unpack_from("<qQqqqq", dry, at)
            out.append(("coop" if kind == P.COOP_LAUNCH else "launch", func, grid, block, shared,
                        dry[at + 48:at + 48 + size]))
            at += 48 + size + (-size % 8)
    return out


# ---- the plans themselves ----------------------------------------------------------------------
def legacy_quantize(refs, *, x, b, q, scale, amax, rows, cols, q_t=0, dbias=0, partial=0, counters=0,
                    scale_inv_used=0, first=False, updates=0, scale_out=0, scale_inv_out=0, margin_factor=1.0,
                    pad_to=1):
    """The launches of the quantize launch interface as it was before plans (2026-12-03), as
    (func, grid, block, parameter bytes): the plans must launch exactly these. (Since: the tiled
    kernel takes the padded shape, and every padded call but one padded in rows only without q_t or
    dbias, which the flat kernel takes with the pad's zeros after x's bytes (npad, a parameter it
    gained then); the tiled kernel's vec flag covers x and b only, q's stores look at q itself.)"""
    out = []

    def launch(role, grid, block, *args):
        fmt = PL.SIGNATURES[next(k for k in PL.SIGNATURES if role.startswith(k))]
        out.append((refs[role].func, grid, block, struct.pack(fmt, *args)))

    def flat_grid(role, n):
        return max(1, min(-(-n // (16 * THREADS)), refs[role].per_sm * SMS))

    n = rows * cols
    prows, pcols = -(-rows // pad_to) * pad_to, -(-cols // pad_to) * pad_to
    if not first:
        updates = scale_out = scale_inv_out = 0
    if n == 0:
        if scale_inv_used:
            launch("flat_vec0_store1", 1, THREADS, x, b, q, scale, amax, 0, 0, scale_inv_used, 0, 0, 0,
                   margin_factor)
        return out
    vec = PL.aligned(x, b, q)
    if first:
        launch(f"flat_vec{int(vec)}_store0", flat_grid(f"flat_vec{int(vec)}_store0", n), THREADS, x, b, q, scale,
               amax, 0, 0, 0, updates, n, 0, margin_factor)
    if q_t or dbias or pcols != cols:
        tiles = -(-prows // PL.TILE_R) * -(-pcols // PL.TILE_C)
        launch("tiled", max(1, min(tiles, refs["tiled"].per_sm * SMS)), 256, x, b, q, q_t, dbias, partial, counters,
               scale, amax, scale_out, scale_inv_out, scale_inv_used, updates, rows, cols, prows, pcols,
               int(PL.aligned(x, b) and cols % 8 == 0), int(bool(q_t) and q_t % 8 == 0 and prows % 8 == 0),
               margin_factor)
    else:
        role = f"flat_vec{int(vec)}_store1"
        launch(role, flat_grid(role, n), THREADS, x, b, q, scale, amax, scale_out, scale_inv_out, scale_inv_used,
               updates, n, (prows - rows) * cols, margin_factor)
    return out


@pytest.mark.parametrize("case", QUANTIZE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_quantize_plans_launch_what_the_launch_interface_launched(case):
    rows, cols, transpose, dbias, first, margin_factor, offset = case
    refs = fake_refs(QKEY)
    plan = PL.build_quantize_plan(refs, SMS, *case, 1, False)  # the two-pass path
    coop = PL.build_quantize_plan(refs, SMS, *case)  # the default: a first step in one launch
    for ptrs in pointer_sets(len(PL.QUANTIZE_SLOTS)):
        s = dict(zip(PL.QUANTIZE_SLOTS, ptrs))
        if transpose and not s["q_t"] or dbias and not (s["dbias"] and s["partial"] and s["counters"]):
            continue  # a caller always passes the buffers its flags ask for

        def st(name):
            return s[name] + offset if s[name] else 0

        want = legacy_quantize(
            refs, x=s["x"], b=s["b"], q=s["q"], scale=st("scale"), amax=st("amax"), rows=rows, cols=cols,
            q_t=s["q_t"] if transpose else 0, dbias=s["dbias"] if dbias else 0, partial=s["partial"] if dbias else 0,
            counters=s["counters"] if dbias else 0, scale_inv_used=s["scale_inv_used"], first=first,
            updates=st("updates"), scale_out=st("scale_out"), scale_inv_out=st("scale_inv_out"),
            margin_factor=margin_factor)
        got = records(E.dry_run(plan, ptrs))
        assert [(r[1], r[2], r[3], r[5]) for r in got if r[0] == "launch"] == want
        memsets = [r[1:] for r in got if r[0] == "memset"]
        if dbias and rows * cols:  # the strip counters start at zero
            assert memsets == [(s["counters"], 4 * launch.dbias_workspace(rows, cols)[1])]
        elif dbias and cols:  # nothing to sum: dbias is zeros
            assert memsets == [(s["dbias"], 4 * cols)]
        else:
            assert memsets == []
        # the one-launch first step: the same memsets; the pre-pass gone; the cast launch the same but for
        # its kernel (the current_quantize twin of the same role), the grid (the twin's occupancy) and
        # the cooperative launch
        one = records(E.dry_run(coop, ptrs))
        assert [r for r in one if r[0] == "memset"] == [r for r in got if r[0] == "memset"]
        if not (first and rows * cols):
            assert one == got
            continue
        main = want[-1]
        role = next(r for r, k in refs.items() if k.func == main[0])
        twin = refs["coop_tiled" if role == "tiled" else f"coop_{role[:9]}"]
        grid = (max(1, min(-(-rows // PL.TILE_R) * -(-cols // PL.TILE_C), twin.per_sm * SMS)) if role == "tiled"
                else max(1, min(-(-rows * cols // (16 * THREADS)), twin.per_sm * SMS)))
        assert [(r[0], r[1], r[2], r[3], r[5]) for r in one if r[0] != "memset"] == [
            ("coop", twin.func, grid, main[2], main[3])]


def test_one_launch_plans_encode_the_cooperative_step():
    refs = fake_refs(QKEY)
    plan = PL.build_quantize_plan(refs, SMS, 300, 64, True, False, True, 1.0, 4)
    data, names = plan.encode()
    assert list(data[:4]) == [P.PLAN_VERSION, len(PL.QUANTIZE_SLOTS), 1, P.COOP_LAUNCH] and P.PLAN_VERSION == 3
    assert names == refs["coop_tiled"].name and plan.steps[0].coop
    assert [st.coop for st in PL.build_quantize_plan(refs, SMS, 300, 64, True, False, True, 1.0, 4, 1,
                                                        False).steps] == [False, False]
    assert not any(st.coop for st in PL.build_quantize_plan(refs, SMS, 300, 64, True, False, False).steps)
    flat = PL.build_quantize_plan(refs, SMS, 256, 1024, False, False, True, 0.5, 0)
    assert [v.name for v in flat.steps[0].variants] == [refs["coop_flat_vec1"].name, refs["coop_flat_vec0"].name]
    assert flat.steps[0].layout == PL.signature("coop_flat") == PL.signature("flat")


def test_cooperative_launch_passes_a_pointer_per_parameter():
    """cuLaunchCooperativeKernel takes no packed buffer: one pointer per parameter, at its packed offset."""
    assert P.param_offsets("@QQQqIi") == (0, 8, 16, 24, 32, 36)
    layout = PL.signature("coop_tiled")
    offsets = P.param_offsets(layout)
    assert len(offsets) == len(layout) - 1 and offsets[-1] + 4 == struct.calcsize(layout)
    params = layout[1:]
    for i in range(1, len(params)):  # natural alignment, no overlap
        assert offsets[i] % struct.calcsize("@" + params[i]) == 0
        assert offsets[i] >= offsets[i - 1] + struct.calcsize("@" + params[i - 1])


def test_dequantize_and_update_plans_launch_what_the_launch_interface_launched():
    refs = fake_refs(DQKEY)
    r = refs["dequant"]
    for n in (1, 4096, 10 ** 7):
        for q, out in [(0x1000, 0x2000), (0x1001, 0x2000), (0x1000, 0x2008)]:
            got = records(E.dry_run(PL.build_dequantize_plan(refs, SMS, n), (q, out, 0x3000)))
            grid = max(1, min(-(-n // (16 * THREADS)), r.per_sm * SMS))
            vec = int(PL.aligned(q, out))
            assert got == [("launch", r.func, grid, THREADS, 0, struct.pack("@3Pqi", q, out, 0x3000, n, vec))]
    assert PL.build_dequantize_plan(refs, SMS, 0).steps == ()
    u = fake_refs(UKEY)["update"]
    ptrs = tuple(range(0x100, 0x700, 0x100))
    got = records(E.dry_run(PL.build_update_plan(fake_refs(UKEY), 7, 1024, 0.5, False), ptrs))
    assert got == [("launch", u.func, 7, THREADS, 0, struct.pack("@6Piifi", *ptrs, 7, 1024, 0.5, 0))]


def test_a_plan_refuses_a_layout_that_is_not_the_kernels_signature():
    refs = fake_refs(DQKEY)
    with pytest.raises(RuntimeError, match=r"lays out dequantize_flat<__half, 1>'s parameters as @PPPq"):
        PL._launch([(refs["dequant"], 1)], 0, THREADS, (P.ptr(0), P.ptr(1), P.ptr(2), P.imm64(5)))


def test_python_executor_packs_into_the_driver_call(monkeypatch):
    """execute() (the wrappers' path) hands cuLaunchKernel (cuLaunchCooperativeKernel) the bytes dry_run() describes."""
    seen = []
    coop_size = struct.calcsize(PL.signature("coop_tiled"))

    class FakeDriver(FakeContexts):
        def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            size = ctypes.c_size_t.from_address(extra[3]).value
            assert (gy, gz, by, bz, params, extra[0], extra[2], extra[4]) == (1, 1, 1, 1, None, 1, 2, None)
            seen.append(("launch", func, gx, bx, shared, ctypes.string_at(extra[1], size)))
            return 0

        def cuLaunchCooperativeKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, params):
            assert (gy, gz, by, bz) == (1, 1, 1, 1)
            args = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
            offsets = P.param_offsets(PL.signature("coop_tiled"))
            assert [args[i] - args[0] for i in range(len(offsets))] == list(offsets)
            seen.append(("coop", func, gx, bx, shared, ctypes.string_at(args[0], coop_size)))
            return 0

        def cuMemsetD32Async(self, ptr, value, words, stream):
            seen.append(("memset", ptr, 4 * words))
            return 0

    fake = FakeDriver(start=0)  # device 0's context is current, as the plans' device
    monkeypatch.setattr(E, "driver", lambda: fake)
    monkeypatch.setattr(E, "_primary", {})
    monkeypatch.setattr(launch, "kernel_refs", lambda key, dev: fake_refs(key))
    monkeypatch.setattr(K, "sm_count", lambda dev: SMS)
    for cached in (launch.quantize_plan, launch.dequantize_plan, launch.update_plan):
        cached.cache_clear()
    try:
        ptrs = dict(x=0x10000, b=0, q=0x20000, scale=0x30004, amax=0x40004, q_t=0x50000, dbias=0x60000,
                    partial=0x70000, counters=0x80000, scale_inv_used=0x90000, updates=0xA0004, scale_out=0x30004,
                    scale_inv_out=0xB0004)
        launch.quantize(0, 0x5, ptrs, dtype="bfloat16", fmt="e4m3", op="dgelu_tanh", rows=300, cols=64, first=True,
                        margin_factor=0.5)
        plan = launch.quantize_plan(0, "bfloat16", "e4m3", "dgelu_tanh", 300, 64, True, True, True, 0.5, 0)
        slots = tuple(ptrs.get(n, 0) for n in PL.QUANTIZE_SLOTS)
        assert slots == PL.QUANTIZE_SLOTS.arrange(ptrs) and slots[PL.QUANTIZE_SLOTS.amax] == 0x40004
        assert seen == records(E.dry_run(plan, slots)) and [r[0] for r in seen] == ["memset", "coop"]
        assert plan.steps[-1].variants[0].name == fake_refs(QKEY)["coop_tiled"].name
        assert plan.steps[-1].shared == 0
        seen.clear()
        launch.quantize(0, 0x5, ptrs, dtype="bfloat16", fmt="e4m3", op="dgelu_tanh", rows=300, cols=64, first=True,
                        margin_factor=0.5, coop=False)
        plan = launch.quantize_plan(0, "bfloat16", "e4m3", "dgelu_tanh", 300, 64, True, True, True, 0.5, 0, 1, False)
        assert seen == records(E.dry_run(plan, slots)) and len(seen) == 3  # counters memset, pre-pass, tiled
        seen.clear()
        launch.dequantize(0, 0x5, {"q": 0x1000, "out": 0x2000, "scale_inv": 0x3000}, dtype="float16", fmt="e5m2", n=0)
        assert seen == []  # nothing to do for 0 elements
        launch.update_scales(0, 0x5, dict(amax_history=1, scale=2, scale_inv=3, overflows=4, updates=5, fmt_max=6),
                             n=3, L=8, margin_factor=1.0, algo_max=True)
        assert len(seen) == 1 and seen[0][2] == 3
        assert fake.calls == []  # the plans' device's context was current: nothing pushed
    finally:
        for cached in (launch.quantize_plan, launch.dequantize_plan, launch.update_plan):
            cached.cache_clear()


def test_encode_layout():
    refs = fake_refs(QKEY)
    plan = PL.build_quantize_plan(refs, SMS, 64, 64, False, True, False, 1.0, 8)
    data, names = plan.encode()
    assert data.dtype == np.int64 and list(data[:3]) == [P.PLAN_VERSION, len(PL.QUANTIZE_SLOTS), 2]
    assert list(data[3:6]) == [P.MEMSET, PL.QUANTIZE_SLOTS.index("counters"), 4]
    assert names == refs["tiled"].name  # one launch of one variant
    assert plan.steps[1].layout == PL.signature("tiled")
    # the launch step names its kernel by id, not by handle (a pointer of this process)
    assert list(data[6:12]) == [P.LAUNCH, 1, 0, 256, 0, len(plan.steps[1].params)]
    assert data[12] == refs["tiled"].kid and refs["tiled"].func not in data


# ---- the compiled shim ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def xla_lib():
    pytest.importorskip("jax")
    return built_shim("xla")


@pytest.fixture(scope="module")
def torch_lib():
    pytest.importorskip("torch")
    return built_shim("torch")


def test_the_loaded_shim_is_stamped_with_this_process_fingerprint(xla_lib):
    """The library that library() loaded was compiled by build() (at install time, or on first use
    into the cache, under a name that holds its fingerprint) from these sources and flags: its
    stamp is this process's fingerprint and it reads this package's plan version."""
    where = shim.library("xla")[1]
    path = Path(where.rsplit(": ", 1)[1])
    assert (path.parent / (path.name + ".stamp")).read_text().strip() == shim.fingerprint("xla")
    assert xla_lib.ff8_plan_version() == P.PLAN_VERSION


FAKE_CXX = """#!/bin/sh
# a stand-in compiler: writes the file after -o; then fails with a message if $FAKE_CXX_FAIL is set
while [ "$1" != "-o" ]; do shift; done
echo built > "$2"
[ -n "$FAKE_CXX_FAIL" ] && { echo "fake-cxx: $FAKE_CXX_FAIL" >&2; exit 3; }
exit 0
"""


@pytest.mark.parametrize("fails", [False, True], ids=["compiles", "fails"])
def test_build_writes_the_library_and_its_stamp_only_when_the_compile_succeeds(tmp_path, monkeypatch, fails):
    """build() (what setup.py and first use run) with a stand-in compiler: on success the library
    appears under its name (renamed from a temporary file) with the fingerprint as its stamp; on a
    failure after writing part of its output nothing is left (no library, no stamp, no temporary
    file) and the log holds the command and the compiler's output. (The real compile: the test
    above, and every test that loads the shim.)"""
    pytest.importorskip("jax")
    cxx = tmp_path / "fake-cxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    if fails:
        monkeypatch.setenv("FAKE_CXX_FAIL", "no such header")
    out = tmp_path / "lib" / shim.filename("xla")
    ok, log = shim.build("xla", out)
    left = sorted(p.name for p in out.parent.iterdir())
    if fails:
        assert not ok and "fake-cxx: no such header" in log and "exit status 3" in log and str(cxx) in log
        assert left == []
    else:
        assert ok and log == ""
        assert out.read_text() == "built\n"
        assert (out.parent / (out.name + ".stamp")).read_text().strip() == shim.fingerprint("xla")
        assert left == [out.name, out.name + ".stamp"]


def test_status_and_library_agree(xla_lib):
    ready, why = shim.status("xla")
    assert ready is True and why == shim.library("xla")[1]


def register(plan: P.Plan, device: int = 0) -> P.Plan:
    """Register the plan's (made-up) kernels on ``device`` in every loaded shim, as loading their
    module does, so that the shims resolve its kernel ids to the handles the Python executor uses."""
    shim.register_kernels(device, {(v.kid, v.func) for st in plan.steps if isinstance(st, P.Launch)
                                   for v in st.variants})
    return plan


def cxx_dry_run(lib, plan_data: np.ndarray, ptrs, names: str = "", device: int = 0) -> bytes:
    out = ctypes.create_string_buffer(1 << 16)
    err = ctypes.create_string_buffer(1024)
    bufs = (ctypes.c_uint64 * max(len(ptrs), 1))(*ptrs)
    data = np.ascontiguousarray(plan_data, np.int64)
    n = lib.ff8_dry_run(data.ctypes.data, len(data), bufs, len(ptrs), device, names.encode(), out, len(out), err,
                        len(err))
    if n < 0:
        raise ValueError(err.value.decode())
    return out.raw[:n]


def test_cxx_packer_matches_the_python_executor(xla_lib, torch_lib):
    checked = 0
    for _, plan in quantize_plans() + other_plans():
        data, names = register(plan).encode()
        for ptrs in pointer_sets(len(plan.slots)):
            want = E.dry_run(plan, ptrs)
            assert cxx_dry_run(xla_lib, data, ptrs, names) == want
            assert torch_lib.dry_run(data.tobytes(), ptrs, 0, names) == want
            checked += 1
    assert checked > 400


def test_the_jax_plan_table_holds_each_devices_plan(xla_lib):
    """encode_plans: the attributes of the FFI call; the handler starts at offsets[device]."""
    from fusedfp8.jax import callbacks as C

    plans = {0: PL.build_quantize_plan(fake_refs(QKEY, 0x1000_0000), SMS, 300, 64, True, False, True, 1.0, 4),
             2: PL.build_quantize_plan(fake_refs(QKEY, 0x2000_0000), 78, 300, 64, True, False, True, 1.0, 4)}
    table, offsets, names = C.encode_plans(plans)
    assert list(offsets) == [0, -1, len(plans[0].encode()[0])] and names == plans[0].encode()[1]
    ptrs = pointer_sets(len(PL.QUANTIZE_SLOTS))[1]
    for dev, plan in plans.items():  # the same kernel ids, each device's own handles
        register(plan, dev)
    for dev, plan in plans.items():
        assert cxx_dry_run(xla_lib, table[offsets[dev]:], ptrs, names, dev) == E.dry_run(plan, ptrs)
    table, offsets, names = C.encode_plans({})
    assert list(offsets) == [-1] and names == ""


# ---- kernel ids and the shims' registries ----------------------------------------------------------
ID_ARGS = ("quantize_tiled<__nv_bfloat16, 0, 0>", "sm_90 nvrtc 12.8")  # a kernel's name, a target


def test_kernel_ids_are_the_same_in_another_process_and_change_with_every_input():
    """kernel_id of a real module's kernel (its source and NVRTC options as the kernels' build takes them): the same
    in a fresh process (another hash seed), 63 bits, not 0; another for any other name, source
    (one character), option set or target."""
    name, target = ID_ARGS
    src, opts = K.family_source("quantize"), K.compile_options()
    kid = K.kernel_id(name, src, opts, target)
    code = ("from fusedfp8.launch import kernels as K; "
            f"print(K.kernel_id({name!r}, K.family_source('quantize'), K.compile_options(), {target!r}))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == kid and 0 < kid < 2 ** 63
    at = len(src) // 2
    others = [K.kernel_id(name.replace("0, 0>", "0, 1>"), src, opts, target),
              K.kernel_id(name, src[:at] + ("x" if src[at] != "x" else "y") + src[at + 1:], opts, target),
              K.kernel_id(name, src, opts[:-1], target), K.kernel_id(name, src, (*opts, "-DFF8_X=1"), target),
              K.kernel_id(name, src, opts, "sm_89 nvrtc 12.8"), K.kernel_id(name, src, opts, "sm_90 nvrtc 12.9"),
              K.kernel_id(name + src[:8], src[8:], opts, target)]  # (the parts do not run into each other)
    assert len(set(others)) == len(others) and kid not in others


def test_the_shims_resolve_kernel_ids_per_device_and_refuse_an_unloaded_kernel_by_name(xla_lib, torch_lib):
    """A plan's kernels registered on device 5: both shims launch their handles there (the Python
    executor's bytes); on device 6, or with an id no module had (an executable of another fusedfp8),
    they refuse the plan naming the kernel and what to do; a later registration of an id replaces
    its handle (a module loaded again)."""
    plan = PL.build_dequantize_plan(fake_refs(DQKEY, 0x7F50_0000_1000), SMS, 4096)
    (step,) = plan.steps
    data, names = plan.encode()
    ptrs = (0x1000, 0x2000, 0x3000)
    want = E.dry_run(plan, ptrs)
    register(plan, 5)

    def both(data, device):
        got = cxx_dry_run(xla_lib, data, ptrs, names, device)
        assert torch_lib.dry_run(data.tobytes(), ptrs, device, names) == got
        return got

    assert both(data, 5) == want
    for data_, device in ((data, 6), (np.where(data == step.variants[0].kid, K.kernel_id("x", "", (), ""), data), 5)):
        for run in (lambda: cxx_dry_run(xla_lib, data_, ptrs, names, device),
                    lambda: torch_lib.dry_run(data_.tobytes(), ptrs, device, names)):
            with pytest.raises(ValueError) as e:
                run()
            assert str(e.value).startswith(f"fusedfp8: kernel dequantize_flat<__half, 1> is not loaded on CUDA "
                                           f"device {device} in this process (kernel id ")
            assert "trace the function in this process first" in str(e.value)
    v = step.variants[0]
    shim.register_kernels(5, [(v.kid, v.func + 0x40)])
    assert records(both(data, 5))[0][1] == v.func + 0x40


@pytest.mark.parametrize("device, kid, func, message", [
    (64, 1, 1, "device 64 is out of range"), (-1, 1, 1, "device -1 is out of range"),
    (0, 0, 1, "id 0 is not a kernel id"), (0, 2 ** 63, 1, "is not a kernel id"), (0, 1, 0, "handle 0 is null")])
def test_the_registry_refuses_what_is_no_kernel(xla_lib, device, kid, func, message):
    with pytest.raises(ValueError, match=message):
        shim.register_kernels(device, [(kid, func)])
    assert (kid, func) not in shim._kernels.get(device, {}).items()


def test_a_full_registry_still_resolves_and_refuses_more(xla_lib, torch_lib):
    """Device 63's table filled (4096 kernels): each id resolves, an unknown one is refused after a
    walk over every slot, and one more kernel is refused."""
    plan = PL.build_dequantize_plan(fake_refs(DQKEY, 0x7F60_0000_1000), SMS, 4096)
    (v,) = plan.steps[0].variants
    others = [(k, 0x6000 + k) for k in range(1, 4096)]  # with v's: the 4096 slots of a device (plan.h)
    assert v.kid >= 4096
    shim.register_kernels(63, [(v.kid, v.func), *others])
    data, names = plan.encode()
    ptrs = (0x1000, 0x2000, 0x3000)
    assert cxx_dry_run(xla_lib, data, ptrs, names, 63) == E.dry_run(plan, ptrs)
    assert all(records(cxx_dry_run(xla_lib, np.where(data == v.kid, k, data), ptrs, names, 63))[0][1] == f
               for k, f in others[::97])
    with pytest.raises(ValueError, match="is not loaded on CUDA device 63"):
        cxx_dry_run(xla_lib, np.where(data == v.kid, 7777, data), ptrs, names, 63)
    with pytest.raises(ValueError, match=r"the kernel registry of CUDA device 63 is full \(4096 kernels\)"):
        shim.register_kernels(63, [(7777, 0x7777)])


def test_a_shim_learns_every_kernel_registered_before_it_loaded_and_after(monkeypatch):
    told = []

    def tell(device, ids, funcs):
        told.append((device, struct.unpack(f"<{len(ids) // 8}q", ids), struct.unpack(f"<{len(funcs) // 8}Q", funcs)))

    lib = types.SimpleNamespace(register_kernels=tell)
    monkeypatch.setattr(shim, "_kernels", {})
    monkeypatch.setattr(shim, "_shims", [])
    monkeypatch.setattr(shim, "_found", {})
    monkeypatch.setattr(shim, "_find", lambda target: (lib, "made up"))
    shim.register_kernels(0, [(5, 0x50), (6, 0x60)])
    shim.register_kernels(1, [(5, 0x51)])
    shim.register_kernels(0, [(5, 0x55)])  # (a module loaded again: the latest handle)
    assert shim.library("torch") == (lib, "made up")
    assert sorted(told) == [(0, (5, 6), (0x55, 0x60)), (1, (5,), (0x51,))]
    told.clear()
    shim.register_kernels(2, [(7, 0x72)])
    assert told == [(2, (7,), (0x72,))]


def test_loading_a_module_registers_its_kernels_in_the_loaded_shims(monkeypatch, xla_lib, torch_lib):
    """The real K._build over a made-up CuPy: each kernel's id is kernel_id of its name, its
    family's source, compile_options() and the target, and the shims resolve a plan of the module
    to the handles CuPy gave, on the module's device only."""
    handles: dict = {}
    F.pretend_gpu(monkeypatch.setattr, monkeypatch.setitem,
                  lambda expr: handles.setdefault(expr, 0x5000 + len(handles)))
    kernels = K.load(DQKEY, 0)
    src = K.family_source("dequantize")
    assert {k.name: (k.func, k.kid) for k in kernels.values()} == {
        name: (h, K.kernel_id(name, src, K.compile_options(), F.FAKE_TARGET)) for name, h in handles.items()}
    plan = PL.build_dequantize_plan(launch.kernel_refs(DQKEY, 0), SMS, 4096)
    data, names = plan.encode()
    ptrs = (0x1000, 0x2000, 0x3000)
    want = E.dry_run(plan, ptrs)
    assert records(want)[0][1] == handles[names]
    assert cxx_dry_run(xla_lib, data, ptrs, names, 0) == want
    assert torch_lib.dry_run(data.tobytes(), ptrs, 0, names) == want
    with pytest.raises(ValueError, match=re.escape(f"kernel {names} is not loaded on CUDA device 1")):
        cxx_dry_run(xla_lib, data, ptrs, names, 1)


@pytest.mark.parametrize("bad, message", [
    (lambda d: d[:2], "not a launch plan"),
    (lambda d: np.concatenate([[99], d[1:]]), "not a launch plan of version"),
    (lambda d: d[:-3], "malformed launch step"),
    (lambda d: np.concatenate([d[:3], [1, 3, 0, 256, 0, 0]]), "malformed launch step"),
    (lambda d: np.concatenate([d[:3], [0, 40, 16]]), "malformed memset"),
    (lambda d: np.concatenate([d[:3], [0, 1, 6]]), "malformed memset"),
    (lambda d: np.concatenate([d[:3], [7]]), "malformed step"),
    (lambda d: np.concatenate([d[:3], [P.COOP_LAUNCH, 1, 0, 256, 0, 65, 1, 1] + [P.I64, 0, 0, 0] * 65]),
     "malformed launch step"),
], ids=["truncated", "version", "short", "variants", "memset-slot", "memset-bytes", "kind", "coop-params"])
def test_cxx_interpreter_refuses_a_malformed_plan(xla_lib, bad, message):
    data, _ = register(PL.build_quantize_plan(fake_refs(QKEY), SMS, 64, 64, True, True, True, 1.0, 0)).encode()
    with pytest.raises(ValueError, match=message):
        cxx_dry_run(xla_lib, bad(data), pointer_sets(len(PL.QUANTIZE_SLOTS))[0])
    with pytest.raises(ValueError, match="takes 13 buffers, 3 were given"):
        cxx_dry_run(xla_lib, data, (1, 2, 3))


# ---- parameter sizes against the cubins (NVRTC, in the background job of test_compile.py) --------
@pytest.fixture(scope="module")
def cubin_sizes(background):
    verdicts = json.loads((background.result("nvrtc").check().out / "verdicts.json").read_text())
    if not verdicts["ready"]:
        pytest.skip(verdicts["reason"])
    return verdicts["sizes"]


@pytest.mark.background("nvrtc")
def test_every_plan_packs_exactly_the_parameter_size_the_cubin_declares(cubin_sizes, xla_lib):
    """Each launch of each plan, packed by the Python executor and by the C++ packer, is as long as
    the kernel's parameter bank in the sm_90 cubin (the driver refuses any other size)."""
    keys = {"quantize": N.SIGNATURE_KEYS["quantize"], "dequantize": N.SIGNATURE_KEYS["dequantize"],
            "update_scales": N.SIGNATURE_KEYS["update_scales"],
            "layernorm_quantize": N.SIGNATURE_KEYS["layernorm_quantize"],
            "block_quantize": N.SIGNATURE_KEYS["block_quantize"]}
    assert keys == {"quantize": QKEY, "dequantize": DQKEY, "update_scales": UKEY,
                    "layernorm_quantize": LNKEY, "block_quantize": BQKEY}  # the modules built above
    by_func = {}
    for family, key in keys.items():
        for ref in fake_refs(key).values():  # (quantize's come with their current_quantize twins)
            twin = ref.role.startswith("coop_")
            assert not twin or N.SIGNATURE_KEYS["current_quantize"] == key._replace(family="current_quantize")
            by_func[ref.func] = cubin_sizes["current_quantize" if twin else family][ref.name]
    seen = set()
    for _, plan in quantize_plans() + other_plans():
        for ptrs in pointer_sets(len(plan.slots)):
            for rec in records(cxx_dry_run(xla_lib, register(plan).encode()[0], ptrs)):
                if rec[0] in ("launch", "coop"):
                    assert len(rec[5]) == by_func[rec[1]], rec
                    seen.add(rec[1])
            for step in plan.steps:
                if isinstance(step, P.Launch):
                    assert all(struct.calcsize(step.layout) == by_func[v.func] for v in step.variants)
    assert seen == set(by_func)  # every kernel of the six modules was launched by some plan


# ---- JAX: the FFI target ---------------------------------------------------------------------------
@pytest.fixture
def ffi_on_cuda(monkeypatch, xla_lib):
    """impl='auto' lowers its CUDA branch to the FFI path (on this machine: with no GPU, no plans)."""
    from fusedfp8.jax import callbacks as C
    from fusedfp8.jax import primitives as JP

    ok, why = C.ffi_target()
    assert ok, why
    monkeypatch.setattr(JP, "_auto_backend", lambda: "ffi")
    return JP


def test_jax_impls():
    from fusedfp8.jax import cuda_backend
    from fusedfp8.jax import primitives as JP

    assert JP.IMPLS == ("auto", "jnp", "ffi", "callback")
    backend, why = cuda_backend.launch_path()
    assert backend in ("ffi", "callback") and why


def test_jax_ffi_impl_needs_a_gpu_here():
    from fusedfp8.jax import primitives as JP

    if launch.probe()[0]:
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match=r"^impl='ffi' runs the CUDA kernels, which cannot run here: "):
        JP._check_impl("ffi")


def _lowered(fn, *args, platform):
    import jax

    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_jax_quantize_lowers_to_the_ffi_custom_call_on_cuda(ffi_on_cuda):
    import jax.numpy as jnp

    import fusedfp8
    from fusedfp8.state import ScalingState

    JP = ffi_on_cuda
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    state = ScalingState.create((False, False, True), recipe, like=jnp.zeros(1))

    def step(x, dy, s):
        r, s = JP.quantize(x, s, 1, recipe, transpose=True)
        g, s = JP.dgelu_quantize(dy, x, s, 2, recipe, transpose=True, dbias=True)
        return r.data, g.dbias, JP.update_scales(s, recipe)

    x = jnp.ones((48, 32), jnp.bfloat16)
    text = _lowered(step, x, x, state, platform="cuda")
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls) == 3 and all("@fusedfp8_launch" in c for c in calls)
    q, dg, up = calls
    # quantize: x -> arg 0; q, q_t, scale_inv_used, history, scale, scale_inv -> results 0..5
    assert "slots = dense<[0, -1, -2, -3, -1, -1, -1, -6, -5, -6, -7, -4, 4]>" in q
    assert "aliases = dense<[1, 3, 2, 4, 3, 5]>" in q and q.count("output_operand_alias<") == 3
    # dgelu with dbias: dy, x -> args 0, 1; q, q_t, dbias, partial, counters, scale_inv_used, state -> 0..8
    assert "slots = dense<[0, 1, -2, -3, -4, -5, -6, -9, -8, -9, -10, -7, 5]>" in dg
    assert "slots = dense<[-2, -3, -4, -5, -6, 5]>" in up and up.count("output_operand_alias<") == 5
    assert "fusedfp8_launch" not in _lowered(step, x, x, state, platform="cpu")  # jax.numpy there


def test_jax_layernorm_quantize_lowers_to_the_ffi_custom_call_on_cuda(ffi_on_cuda):
    """layernorm_quantize is one call of the same handler: x, weight, bias in; q, q_t, mean, rstd,
    scale_inv_used and the state out (the state aliased); without weight and bias their slots are
    null. The flax Fp8MLP's forward holds it and no flax LayerNorm (rsqrt)."""
    import jax
    import jax.numpy as jnp

    import fusedfp8
    from fusedfp8.jax.flax import Fp8MLP
    from fusedfp8.state import ScalingState

    from fusedfp8.jax import layernorm as JLN  # on the primitives' backends (patched by the fixture)
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    state = ScalingState.create((False, False, True), recipe, like=jnp.zeros(1))

    def step(x, w, b, s):
        r1, s = JLN.layernorm_quantize(x, w, b, 1e-5, s, 0, recipe, transpose=True)
        r2, s = JLN.layernorm_quantize(x, None, None, 1e-5, s, 1, recipe, pad_to=16)
        return r1.quantized.data_t, r1.mean, r2.quantized.data, s

    x, w = jnp.ones((48, 40), jnp.bfloat16), jnp.ones(40)
    text = _lowered(step, x, w, w, state, platform="cuda")
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls) == 2 and all("@fusedfp8_launch" in c for c in calls)
    # x, weight, bias -> args 0..2; q, q_t, mean, rstd, scale_inv_used, history, scale, scale_inv -> results 0..7
    assert "slots = dense<[0, 1, 2, -2, -3, -4, -5, -8, -7, -8, -9, -6, 6]>" in calls[0]
    assert "aliases = dense<[3, 5, 4, 6, 5, 7]>" in calls[0] and calls[0].count("output_operand_alias<") == 3
    # x -> arg 0, no weight, bias or q_t; q (48, 48: padded), mean, rstd, scale_inv_used, state -> 0..6
    assert "slots = dense<[0, -1, -1, -2, -1, -3, -4, -7, -6, -7, -8, -5, 4]>" in calls[1]
    assert "tensor<48x48xui8>" in calls[1]
    assert "fusedfp8_launch" not in _lowered(step, x, w, w, state, platform="cpu")  # jax.numpy there
    model = Fp8MLP(64, recipe=recipe)
    variables = jax.jit(model.init)(jax.random.key(0), x)  # (on the CPU: the jnp path)
    text = _lowered(model.apply, variables, x, platform="cuda")
    assert text.count("@fusedfp8_launch") == 6  # the two updates, then LayerNorm(x), w1, gelu(z), w2
    assert "rsqrt" not in text


# ---- torch: the C++ kernels of the custom ops ------------------------------------------------------
TORCH_OPS = ("quantize", "quantize_t", "gelu_quantize", "gelu_quantize_t", "dgelu_quantize_t", "dequantize")


@pytest.fixture
def cpp_ops(torch_lib):
    """The C++ kernels registered for the ops (and, afterwards, the registration as it was)."""
    from fusedfp8.pytorch import cpp_path, custom_ops

    was = cpp_path._cpp
    cpp_path.use_cpp(True)
    yield custom_ops
    if was is None:
        cpp_path.use_cpp(False)
        cpp_path._cpp_state.clear()  # undecided again: a CUDA call would load it


def test_torch_cpp_kernels_are_registered_for_the_cuda_keys(cpp_ops):
    import torch

    from fusedfp8.pytorch import cpp_path

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in TORCH_OPS:
        assert has(f"fusedfp8::{name}", "CUDA") and has(f"fusedfp8::{name}", "AutogradCUDA"), name
        assert not has(f"fusedfp8::{name}", "CPU")  # CPU tensors keep the Python implementation
    assert cpp_path.launch_path()[0] == "C++"
    cpp_path.use_cpp(False)
    assert not any(has(f"fusedfp8::{n}", "CUDA") or has(f"fusedfp8::{n}", "AutogradCUDA") for n in TORCH_OPS)
    assert cpp_path.launch_path() == ("Python", "switched off with use_cpp(False)")
    cpp_path.use_cpp(True)
    assert all(has(f"fusedfp8::{n}", "CUDA") for n in TORCH_OPS)


def test_torch_cpu_ops_unchanged_with_the_cpp_kernels(cpp_ops):
    import torch

    from fusedfp8.numerics import reference as ref
    from fusedfp8.recipe import DelayedScaling
    from fusedfp8.state import ScalingState
    from support.frameworks import same_bytes, to_np
    from support.torch_helpers import inputs

    recipe = DelayedScaling(amax_history_len=4)
    s = ScalingState.create([False, True], recipe, like=torch.empty(0))
    x = inputs(40, 24, torch.bfloat16)
    q, q_t, si = torch.ops.fusedfp8.quantize_t(x, s.amax_history, s.scale, s.scale_inv, s.updates, 1, "e5m2", 1.0,
                                               True)
    scale = ref.current_scale(ref.amax(to_np(x)), "e5m2", 1.0, np.float32(1))
    want = ref.quantize(to_np(x), scale, "e5m2", transpose=True)
    assert same_bytes(q, want.data) and same_bytes(q_t, want.data_t)


@pytest.mark.parametrize("rows, cols, transpose, dbias", [
    (303, 300, False, False), (303, 300, True, True), (8190, 64, True, False), (5, 16, False, True),
    (32, 48, False, False), (8190, 64, False, False), (1, 4096, False, False), (16, 300, False, False)])
def test_padded_plans_take_the_tiled_kernel_with_the_padded_shape(rows, cols, transpose, dbias):
    refs = fake_refs(QKEY)
    plan = PL.build_quantize_plan(refs, SMS, rows, cols, transpose, dbias, True, 1.0, 0, 16, False)
    ptrs = pointer_sets(len(PL.QUANTIZE_SLOTS))[0]
    s = dict(zip(PL.QUANTIZE_SLOTS, ptrs))
    want = legacy_quantize(refs, x=s["x"], b=s["b"], q=s["q"], scale=s["scale"], amax=s["amax"], rows=rows,
                           cols=cols, q_t=s["q_t"] if transpose else 0, dbias=s["dbias"] if dbias else 0,
                           partial=s["partial"] if dbias else 0, counters=s["counters"] if dbias else 0,
                           scale_inv_used=s["scale_inv_used"], first=True, updates=s["updates"],
                           scale_out=s["scale_out"], scale_inv_out=s["scale_inv_out"], pad_to=16)
    got = [(r[1], r[2], r[3], r[5]) for r in records(E.dry_run(plan, ptrs)) if r[0] == "launch"]
    assert got == want
    padded = cols % 16  # then the tiled kernel, also without transpose / dbias
    assert (got[-1][0] == refs["tiled"].func) == bool(padded or transpose or dbias)
    if not (padded or transpose or dbias):  # rows padded only (or none): the flat kernel, the pad's zeros after x's
        assert got[-1][0] == refs["flat_vec1_store1"].func
        assert struct.unpack_from("<qqf", got[-1][3], 9 * 8) == (rows * cols, (-rows % 16) * cols, 1.0)
    one = [r[:2] for r in records(E.dry_run(PL.build_quantize_plan(refs, SMS, rows, cols, transpose, dbias, True,
                                                                       1.0, 0, 16), ptrs)) if r[0] != "memset"]
    assert one == [("coop", refs["coop_tiled" if padded or transpose or dbias else "coop_flat_vec1"].func)]
    if not (padded or transpose or dbias):
        coop_step = [r for r in records(E.dry_run(PL.build_quantize_plan(
            refs, SMS, rows, cols, transpose, dbias, True, 1.0, 0, 16), ptrs)) if r[0] != "memset"][0]
        assert struct.unpack_from("<qq", coop_step[5], 9 * 8) == (rows * cols, (-rows % 16) * cols)
    if dbias:
        assert launch.dbias_workspace(rows, cols, 16)[1] == -(-(-(-cols // 16) * 16) // PL.TILE_C)


@pytest.mark.parametrize("op", ["gelu_tanh", "gelu_erf"])
def test_dbias_goes_with_a_gradients_ops_only(op):
    """The tiled kernel sums columns for a gradient's ops only (the identity, dgelu): a gelu op with
    dbias is refused by name before anything compiles or launches."""
    with pytest.raises(ValueError, match=f"dbias: the column sums come with op 'identity', 'dgelu_tanh' or "
                                         f"'dgelu_erf'.*got op '{op}'"):
        launch.quantize_plan(0, "bfloat16", "e4m3", op, 303, 300, True, True)


@pytest.mark.parametrize("first", [False, True], ids=["delayed", "first-step"])
def test_a_gradients_dbias_takes_the_identitys_own_kernel(first):
    """quantize with dbias runs the identity's instantiation with the column sums compiled in
    (tiled_dbias / coop_tiled_dbias); without dbias the forward's kernel, whose registers the sums
    would double."""
    key = K.ModuleKey("quantize", "bfloat16", "e5m2", "identity")
    refs = fake_refs(key)
    names = {"tiled_dbias", "coop_tiled_dbias"}
    for dbias in (False, True):
        plan = PL.build_quantize_plan(refs, 132, 303, 300, True, dbias, first)
        (launch,) = [st for st in plan.steps if isinstance(st, P.Launch)]
        role = next(r for r, k in refs.items() if k.name == launch.variants[0].name)
        assert (role in names) == dbias, (dbias, role)
        assert role.startswith("coop_") == first, role


def test_torch_direct_call_refuses_cpu_tensors(cpp_ops):
    import torch

    from fusedfp8.pytorch import cpp_path

    x = torch.ones(4, 4)
    st = [torch.zeros(2, 1), torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.int32)]
    with pytest.raises(RuntimeError, match="the C\\+\\+ ops run CUDA tensors"):
        cpp_path._cpp.call(0, x, *st, 0, "e4m3", 1.0, True)
    with pytest.raises(TypeError, match="quantize takes 9 or 10 arguments; got 2"):
        cpp_path._cpp.call(0, x, x)
    with pytest.raises(TypeError, match="amax_history must be a tensor; got int"):
        cpp_path._cpp.call(0, x, 1, *st[1:], 0, "e4m3", 1.0, True)


def test_info_reports_the_launch_paths(capsys):
    from fusedfp8.__main__ import info

    assert info(False, progress=False) == 0
    out = capsys.readouterr().out
    assert "JAX launch" in out and "torch launch" in out and "JAX FP8 GEMM" in out
    # the block-scaled GEMM's path is said beside the per-tensor one's, in both frameworks
    lines = {ln[:18].strip(): ln[18:] for ln in out.splitlines()}
    jax_path, torch_path = lines["JAX FP8 GEMM"].split(":")[0], lines["torch FP8 GEMM"].split(" ")[0]
    assert lines["JAX block GEMM"].startswith("fusedfp8_fp8_gemm_block" if jax_path == "fusedfp8_fp8_gemm" else "none")
    assert lines["torch block GEMM"].startswith({"cublaslt": "fusedfp8::fp8_gemm_lt_block",
                                                 "scaled_mm": "torch._scaled_mm (blockwise)"}[torch_path])


# ---- on the GPU: the shim path against the Python path, byte for byte ------------------------------
def _torch_state(first: bool, n: int = 3, L: int = 5, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    hist = torch.rand(L, n, generator=g) * (0 if first else 4)
    scale = torch.full((n,), 1.0 if first else 0.75)
    updates = torch.full((n,), 0 if first else 2, dtype=torch.int32)
    return [hist.cuda(), scale.cuda(), (1 / scale).cuda(), updates.cuda()]


def _torch_args(name, x, b, state, approximate="tanh", dbias=True, index=1, fmt="e4m3"):
    head = (x, b) if name == "dgelu_quantize_t" else (x,)
    tail = (approximate,) if name.startswith("gelu") else (approximate, dbias) if name.startswith("dgelu") else ()
    return (*head, *state, index, fmt, 0.5, True, *tail)


def _torch_x(shape, dtype, seed, unaligned):
    import torch

    from support.torch_helpers import inputs

    n = int(np.prod(shape))
    flat = inputs(1, n + 1, getattr(torch, dtype), seed=seed).reshape(-1).cuda()
    return (flat[1:] if unaligned else flat[:n]).reshape(shape)  # offset by one element: not 16-byte aligned


def _same_all(got, want):
    from support.frameworks import bytes_of

    got, want = list(got), list(want)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape and bytes_of(g) == bytes_of(w), k


TORCH_SHAPES = S.params("aligned-64x128", "ragged-303x300", "ragged-1x1", "ragged-0x16", "ragged-3d-3x5x7")


@pytest.mark.gpu
@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "offset"])
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later"])
@pytest.mark.parametrize("shape", TORCH_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", TORCH_OPS[:-1])
def test_torch_cpp_ops_match_the_python_path(cpp_ops, name, dtype, shape, first, unaligned):
    """Python executor, C++ through the dispatcher (AutogradCUDA -> CUDA) and C++ direct (call):
    the same outputs and the same state, byte for byte."""
    import torch

    from fusedfp8.pytorch import cpp_path

    x = _torch_x(shape, dtype, 1, unaligned)
    b = _torch_x(shape, dtype, 2, unaligned)
    op = getattr(torch.ops.fusedfp8, name)
    for approximate, dbias in ([("tanh", True), ("none", False)] if name.startswith("dgelu") else
                               [("none", True)] if name.startswith("gelu") else [("tanh", True)]):
        states = [_torch_state(first) for _ in range(3)]
        cpp_path.use_cpp(False)
        want = op(*_torch_args(name, x, b, states[0], approximate, dbias))
        cpp_path.use_cpp(True)
        got = op.default(*_torch_args(name, x, b, states[1], approximate, dbias))
        direct = cpp_ops.call(getattr(cpp_ops, name), *_torch_args(name, x, b, states[2], approximate, dbias))
        torch.cuda.synchronize()
        _same_all(got, want)
        _same_all(direct, want)
        _same_all(states[1], states[0])
        _same_all(states[2], states[0])


@pytest.mark.gpu
@pytest.mark.parametrize("name", TORCH_OPS)
def test_torch_cpp_ops_launch_from_a_thread_without_a_cuda_context(cpp_ops, name):
    """The C++ ops launch through the driver API, into the thread's current context. torch's
    autograd engine runs the backward on threads of its own whose first CUDA work can be a
    fusedfp8 op (the caching allocator hands out memory without a CUDA call): they have no current
    context, and the launch failed with CUDA_ERROR_INVALID_CONTEXT (found by tests/pytorch/
    test_ragged.py on the H200). Every op, called first thing in a fresh thread, gives the bytes
    it gives on the main thread; so does the backward of an Fp8Linear."""
    import threading

    import torch

    x = _torch_x((64, 128), "bfloat16", 1, False)
    b = _torch_x((64, 128), "bfloat16", 2, False)
    if name == "dequantize":
        q = cpp_ops.call(cpp_ops.quantize, *_torch_args("quantize", x, b, _torch_state(False)))[0]
        args = lambda: (q, torch.full((1,), 0.5, device="cuda"), torch.bfloat16)  # noqa: E731
    else:
        states = [_torch_state(False) for _ in range(2)]
        args = iter([_torch_args(name, x, b, s) for s in states]).__next__
    want = cpp_ops.call(getattr(cpp_ops, name), *args())
    got, errors = [], []

    def run():
        try:
            got.append(cpp_ops.call(getattr(cpp_ops, name), *args()))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors[0]
    got, want = (got[0], want) if isinstance(want, tuple) else ((got[0],), (want,))
    _same_all(got, want)


@pytest.mark.gpu
def test_fp8_linear_backward_runs_on_the_autograd_threads(cpp_ops):
    """The backward of a fresh Fp8Linear in a fresh process-level thread: the engine's worker
    thread launches the gradient's quantization first (see the test above)."""
    import threading

    import torch

    import fusedfp8
    import fusedfp8.pytorch as fp8

    lin = fp8.Fp8Linear(48, 32, recipe=fusedfp8.DelayedScaling(), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(40, 48, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    errors = []

    def run():
        try:
            lin(x).float().pow(2).sum().backward()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors[0]
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torch_cpp_dequantize_matches_the_python_path(cpp_ops, dtype, fmt):
    import torch

    from fusedfp8.pytorch import cpp_path

    dt = getattr(torch, dtype)
    q = (torch.randn(303, 300) * 8).to(getattr(torch, "float8_e4m3fn" if fmt == "e4m3" else "float8_e5m2")).cuda()
    si = torch.tensor([0.37], device="cuda")
    cpp_path.use_cpp(False)
    want = torch.ops.fusedfp8.dequantize(q, si, dt)
    cpp_path.use_cpp(True)
    _same_all([torch.ops.fusedfp8.dequantize(q, si, dt)], [want])
    _same_all([cpp_ops.call(cpp_ops.dequantize, q, si, dt)], [want])
    _same_all([cpp_ops.call(cpp_ops.dequantize, q[1:].reshape(-1)[:1000], si, dt)],
              [torch.ops.fusedfp8.dequantize(q[1:].reshape(-1)[:1000].contiguous(), si, dt)])


@pytest.mark.gpu
def test_torch_cpp_ops_raise_the_checks_errors(cpp_ops):
    import torch

    from fusedfp8.pytorch import cpp_path

    x = torch.ones(8, 16, device="cuda", dtype=torch.bfloat16)
    st = _torch_state(True)
    with pytest.raises(ValueError, match="must hold exactly one element"):
        cpp_ops.call(cpp_ops.quantize, x, *st, 7, "e4m3", 1.0, True)  # index out of range
    with pytest.raises(ValueError):
        torch.ops.fusedfp8.quantize(x, *st, 0, "e3m4", 1.0, True)
    with pytest.raises(ValueError, match="contiguous"):
        cpp_ops.call(cpp_ops.quantize, x.t(), *st, 0, "e4m3", 1.0, True)
    cache = cpp_path._cpp.cache_size()
    cpp_ops.call(cpp_ops.quantize, x, *st, 0, "e4m3", 1.0, True)
    cpp_ops.call(cpp_ops.quantize, x, *st, 0, "e4m3", 1.0, True)
    assert cpp_path._cpp.cache_size() <= cache + 1  # one new signature, checked once


@pytest.mark.gpu
def test_torch_cpp_ops_compiled_and_cuda_graphed(cpp_ops):
    """torch.compile(fullgraph) and a CUDA graph of the ops give the eager Python path's bytes."""
    import torch

    from fusedfp8.pytorch import cpp_path

    def step(x, dy, h, s, si, u):
        q, q_t, si1 = torch.ops.fusedfp8.gelu_quantize_t(x, h, s, si, u, 0, "e4m3", 1.0, True, "tanh")
        g, g_t, db, si2 = torch.ops.fusedfp8.dgelu_quantize_t(dy, x, h, s, si, u, 2, "e5m2", 1.0, True, "tanh", True)
        return q, q_t, si1, g, g_t, db, si2, torch.ops.fusedfp8.dequantize(q, si1, torch.bfloat16)

    x = _torch_x((256, 192), "bfloat16", 3, False)
    dy = _torch_x((256, 192), "bfloat16", 4, False)
    states = [_torch_state(True) for _ in range(3)]
    cpp_path.use_cpp(False)
    want = step(x, dy, *states[0])
    cpp_path.use_cpp(True)
    compiled = torch.compile(step, fullgraph=True)
    _same_all(compiled(x, dy, *states[1]), want)
    _same_all(states[1], states[0])
    st = states[2]
    s0 = [t.clone() for t in st]
    step(x, dy, *st)  # warm up (plans cached, kernels loaded) outside the capture
    for t, v in zip(st, s0):
        t.copy_(v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: an unsafe CUDA call from this thread still breaks the capture, but not one
    # from the JAX runtime's threads when the pytest worker also ran JAX tests (run 4 of 2026-12-03)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step(x, dy, *st)
    for t, v in zip(st, s0):
        t.copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    _same_all(out, want)
    _same_all(st, states[0])


def _jax_case(shape, dtype, first, seed=0):
    import jax
    import jax.numpy as jnp

    import fusedfp8
    from fusedfp8.state import ScalingState

    recipe = fusedfp8.DelayedScaling(amax_history_len=7, first_step="current" if first else "unit")
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(seed)
    x = jax.device_put(jnp.asarray((rng.standard_normal(shape) * 3).astype(np.float32)).astype(dtype), gpu)
    dy = jax.device_put(jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype), gpu)

    def state():
        s = ScalingState.create((False, False, True), recipe, like=jax.device_put(jnp.zeros(1), gpu))
        return s if first else s.replace(updates=s.updates + 1, scale=s.scale * 0.5, scale_inv=s.scale_inv * 2)

    return recipe, x, dy, state


def _jax_quantize_step(JP, recipe):
    def step(x, dy, s, impl):
        r1, s = JP.quantize(x, s, 0, recipe, transpose=True, impl=impl)
        r2, s = JP.gelu_quantize(x, s, 1, recipe, approximate="none", impl=impl)
        r3, s = JP.dgelu_quantize(dy, x, s, 2, recipe, transpose=True, dbias=True, impl=impl)
        r4, s = JP.quantize(x, s, 1, recipe, impl=impl)  # a tensor used twice in a step
        s = JP.update_scales(s, recipe, impl=impl)
        return [r1.data, r1.data_t, r1.scale_inv, r2.data, r3.data, r3.data_t, r3.dbias, r3.scale_inv, r4.data], s

    return step


def _jax_layernorm_step(JP, recipe):
    """layernorm_quantize with weight and bias, without them (padded), and with a weight alone."""
    def step(x, dy, s, impl):
        import jax.numpy as jnp

        from fusedfp8.jax import layernorm as JLN  # on the backends of JP

        w = jnp.linspace(0.5, 1.5, x.shape[-1], dtype=jnp.float32)
        r1, s = JLN.layernorm_quantize(x, w, -w / 4, 1e-5, s, 0, recipe, transpose=True, impl=impl)
        r2, s = JLN.layernorm_quantize(dy, None, None, 1e-2, s, 1, recipe, transpose=True, pad_to=16, impl=impl)
        r3, s = JLN.layernorm_quantize(x, w, None, 0.0, s, 0, recipe, impl=impl)  # a tensor used twice in a step
        s = JP.update_scales(s, recipe, impl=impl)
        q1, q2, q3 = (r.quantized for r in (r1, r2, r3))
        return [q1.data, q1.data_t, q2.data, q2.data_t, q3.data, r1.mean, r2.rstd, q3.scale_inv], s

    return step


@pytest.mark.gpu
@pytest.mark.jax_gpu
@pytest.mark.parametrize("donate", [False, True], ids=["", "donated"])
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later"])
@pytest.mark.parametrize("shape", S.params("aligned-64x128", "ragged-303x300", "ragged-1x1", "ragged-0x16",
                                           "ragged-3d-3x5x7"))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ops", ["quantize", "layernorm"])
def test_jax_ffi_matches_the_callback_path(ops, dtype, shape, first, donate):
    """The FFI handler, the callback and impl='auto', byte for byte over two steps: quantize / gelu /
    dgelu (+ dbias), or layernorm_quantize."""
    import jax

    from fusedfp8.jax import primitives as JP
    from fusedfp8.state import STATE_FIELDS

    recipe, x, dy, state = _jax_case(shape, dtype, first)
    step = (_jax_quantize_step if ops == "quantize" else _jax_layernorm_step)(JP, recipe)
    results = {}
    for impl in ("callback", "ffi", "auto"):
        fn = jax.jit(step, static_argnames="impl", donate_argnames=("s",) if donate else ())
        outs, s = fn(x, dy, state(), impl=impl)
        outs2, s2 = fn(x, dy, s, impl=impl)  # a second step from the first one's state
        arrays = (*outs, *outs2, *(getattr(s2, f) for f in STATE_FIELDS))
        results[impl] = [(a.dtype, a.shape, np.asarray(jax.device_get(a)).tobytes()) for a in arrays]
    want = results["callback"]
    for impl, got in results.items():
        assert got == want, impl


def test_the_shim_is_on_by_default_and_no_shim_refuses_it(monkeypatch):
    """The frameworks take the shim by default; FUSEDFP8_NO_SHIM refuses it (and the frameworks
    then say so)."""
    from fusedfp8 import csrc
    from fusedfp8.jax import cuda_backend

    monkeypatch.delenv("FUSEDFP8_NO_SHIM", raising=False)
    assert csrc.default_on() == (True, "")
    monkeypatch.setenv("FUSEDFP8_NO_SHIM", "1")
    on, why = csrc.default_on()
    assert (on, why) == (False, "FUSEDFP8_NO_SHIM is set")
    assert cuda_backend.launch_path() == ("callback", why)
    assert cpp_launch_path_without_loading() == ("Python", why)


def cpp_launch_path_without_loading():
    import fusedfp8.pytorch.cpp_path as cpp_path

    saved, cpp_path._cpp_state[:] = list(cpp_path._cpp_state), []
    try:
        return cpp_path.launch_path() if cpp_path._cpp is None else ("Python", cpp_path._shim.default_on()[1])
    finally:
        cpp_path._cpp_state[:] = saved


@pytest.mark.gpu
@pytest.mark.jax_gpu
def test_jax_auto_lowers_to_the_ffi_handler_on_the_gpu(monkeypatch):
    import jax
    import jax.numpy as jnp

    from fusedfp8.jax import cuda_backend
    from fusedfp8.jax import primitives as JP

    monkeypatch.setenv("FUSEDFP8_SHIM", "1")
    assert cuda_backend.launch_path()[0] == "ffi", cuda_backend.launch_path()
    recipe, x, dy, state = _jax_case((64, 128), jnp.bfloat16, True)
    text = jax.jit(lambda x, s: JP.quantize(x, s, 0, recipe, transpose=True)).lower(x, state()).as_text()
    assert "fusedfp8_launch" in text


@pytest.mark.gpu
@pytest.mark.jax_gpu
@pytest.mark.parametrize("donate", [False, True], ids=["", "donated"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_jax_ffi_update_scales_matches_the_callback_path(algo, donate):
    """Staged amaxes NaN, inf, 0, -0, a denormal and ordinary ones, over three updates."""
    import jax
    import jax.numpy as jnp

    import fusedfp8
    from fusedfp8.jax import primitives as JP
    from fusedfp8.state import STATE_FIELDS, ScalingState

    recipe = fusedfp8.DelayedScaling(amax_history_len=31, amax_compute_algo=algo, margin=1)
    gpu = jax.devices("gpu")[0]
    staged = np.array([np.nan, np.inf, 0.0, -0.0, 1e-40, 3.0, 1e4, 0.5], np.float32)
    grads = (False, True) * 4
    results = {}
    for impl in ("callback", "ffi"):
        fn = jax.jit(lambda s, impl=impl: JP.update_scales(s, recipe, impl=impl),
                     donate_argnums=(0,) if donate else ())
        s = ScalingState.create(grads, recipe, like=jax.device_put(jnp.zeros(1), gpu))
        out = []
        for step in range(3):
            s = s.replace(amax_history=s.amax_history.at[0].set(jnp.asarray(staged * (step + 1))))
            s = fn(s)
            out += [np.asarray(jax.device_get(getattr(s, f))).tobytes() for f in STATE_FIELDS]
        results[impl] = out
    assert results["ffi"] == results["callback"]
