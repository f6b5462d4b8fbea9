"""The activations of cuda_src/common.cuh in float32, before any quantization, bit for bit against
the NumPy reference (the FP8 byte tests see only the top bits of each value), and the kernels'
reciprocal (rcp.approx + one Newton step) against IEEE division on every float it can be given.
GPU only: small RawKernels over the shared header, built with the library's compile options."""
from __future__ import annotations

import numpy as np
import pytest

from fusedfp8 import launch
from fusedfp8.launch import kernels as K
from fusedfp8.numerics import constants as C
from fusedfp8.numerics import reference as ref

pytestmark = pytest.mark.gpu

SOURCE = r'''
using namespace ff8;
extern "C" __global__ void activation(const float* x, float* out, long long n, int op) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = x[i];
        out[i] = op == 1 ? gelu_tanh(v) : op == 2 ? gelu_erf(v) : op == 3 ? dgelu_tanh(v) : dgelu_erf(v);
    }
}
// every float d = bits(lo + i), i < n: rcp_f32(d) against rcp.rn.f32(d); counts the differences
extern "C" __global__ void rcp_check(unsigned lo, long long n, unsigned long long* bad, unsigned* first) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const unsigned b = lo + (unsigned)i;
        const float d = __uint_as_float(b);
        float r; asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(d));
        if (__float_as_uint(rcp_f32(d)) != __float_as_uint(r)) { atomicAdd(bad, 1ull); atomicMin(first, b); }
    }
}
extern "C" __global__ void rcp_many(const float* d, float* out, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = rcp_f32(d[i]);
}
'''
OPS = {"gelu_tanh": 1, "gelu_none": 2, "dgelu_tanh": 3, "dgelu_none": 4}


@pytest.fixture(scope="module")
def module():
    import cupy

    ok, reason = launch.probe()
    if not ok:
        pytest.skip(reason)
    code = (K.source_dir() / "common.cuh").read_text().replace("#pragma once", "") + SOURCE
    options = tuple(K.COMPILE_OPTIONS) + tuple(f"-I{d}" for d in K.cuda_include_dirs())
    return cupy.RawModule(code=code, options=options)


def inputs() -> np.ndarray:
    """A dense grid over where the activations are not flat, random floats of every exponent, the
    neighbourhoods of every threshold (+-X_MAX, the exp and erfc cut-offs), denormals, specials."""
    rng = np.random.default_rng(18)
    near = []
    for t in (C.GELU_X_MAX, 13.19, 9.3, 13.1, 26.0, 28.3, 40.0, 0.0):
        for s in (np.float32(t), -np.float32(t)):
            near.append(s + np.arange(-64, 65, dtype=np.float32) * np.spacing(np.float32(max(abs(s), 1e-30))))
    bits = rng.integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    specials = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 1e30, -1e30, 3e38, -3e38, 2.0 ** -140,
                         -(2.0 ** -140), 2.0 ** -126, 1e-20, -1e-20], np.float32)
    return np.concatenate([np.linspace(-16, 16, 1_500_001, dtype=np.float32), rng.standard_normal(500_000).astype(np.float32),
                           bits, *near, specials]).astype(np.float32)


@pytest.mark.parametrize("op", list(OPS))
def test_activation_is_the_reference_bit_for_bit(module, op):
    import cupy

    x = inputs()
    out = cupy.empty(x.shape, cupy.float32)
    module.get_function("activation")((1024,), (256,), (cupy.asarray(x), out, np.int64(x.size), np.int32(OPS[op])))
    got = cupy.asnumpy(out)
    kind, approx = op.split("_")
    want = (ref.gelu_f32 if kind == "gelu" else ref.dgelu_f32)(x, approx)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    bad = np.flatnonzero(got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan])
    assert bad.size == 0, (op, x[~nan][bad[:8]], got[~nan][bad[:8]], want[~nan][bad[:8]])


@pytest.mark.parametrize("lo, hi", [(1.0, 2.0 ** 126)], ids=["1..2**126"])
def test_rcp_is_correctly_rounded_on_every_float_of_its_range(module, lo, hi):
    """Every float d in [1, 2**126) (1.06e9 of them): the kernels' reciprocal is rcp.rn.f32's, and a
    sample is NumPy's float32 1 / d (which is what the reference uses)."""
    import cupy

    b0, b1 = int(np.float32(lo).view(np.uint32)), int(np.float32(hi).view(np.uint32))
    bad = cupy.zeros(1, cupy.uint64)
    first = cupy.full(1, 0xFFFFFFFF, cupy.uint32)
    module.get_function("rcp_check")((4096,), (256,), (np.uint32(b0), np.int64(b1 - b0), bad, first))
    assert int(bad.get()[0]) == 0, f"first difference at d = {np.uint32(first.get()[0]).view(np.float32)!r}"
    d = np.random.default_rng(5).integers(b0, b1, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = cupy.empty(d.shape, cupy.float32)
    module.get_function("rcp_many")(((d.size + 255) // 256,), (256,), (cupy.asarray(d), out, np.int64(d.size)))
    np.testing.assert_array_equal(cupy.asnumpy(out).view(np.uint32), ref.rcp_f32(d).view(np.uint32))
