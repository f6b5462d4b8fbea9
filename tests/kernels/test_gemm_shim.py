"""The FP8 GEMM of the compiled shim (fusedfp8/csrc/gemm.h) and its JAX wrapper, on the CPU:
the cuBLASLt declarations against the real header, the shim's shape check, the wrapper's
argument checks, the XLA-dot path unchanged, and what the FFI path lowers to for CUDA.
The GEMM itself runs in tests/jax/test_jax_gemm.py (GPU)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fusedfp8 import csrc as shim
from support.shim import built as built_shim

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from fusedfp8.jax import gemm as G  # noqa: E402
from fusedfp8.jax import primitives as P  # noqa: E402


# ---- the declarations against cublasLt.h --------------------------------------------------------
def _cublaslt_include_dirs() -> list[str]:
    """Folders holding a cublasLt.h: $FUSEDFP8_CUBLASLT_INCLUDE, the nvidia wheels' include folders
    (nvidia/cu13/include, nvidia/cublas/include), $CUDA_HOME/include, /usr/local/cuda/include."""
    roots = [os.environ.get("FUSEDFP8_CUBLASLT_INCLUDE", "")]
    for site in sys.path:
        roots += glob.glob(os.path.join(site, "nvidia", "*", "include"))
    roots += [os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "include"), "/usr/local/cuda/include"]
    return [r for r in dict.fromkeys(roots) if r and os.path.isfile(os.path.join(r, "cublasLt.h"))]


def _cuda_include_dirs() -> list[str]:
    """Folders of the CUDA runtime headers that cublasLt.h includes (library_types.h, ...)."""
    roots = []
    for site in sys.path:
        roots += glob.glob(os.path.join(site, "nvidia", "*", "include"))
    roots += [os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "include"), "/usr/local/cuda/include"]
    return [r for r in dict.fromkeys(roots) if os.path.isfile(os.path.join(r, "library_types.h"))]


def test_gemm_declarations_match_cublaslt_h():
    """gemm.h declares its own cuBLASLt enum values and structs (the shim includes no CUDA header);
    gemm_check.cc static_asserts each against the real header, wherever one is found."""
    cxx = shim.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    found = _cublaslt_include_dirs()
    if not found:
        pytest.skip("no cublasLt.h here (the nvidia cuBLAS wheel's headers, a CUDA toolkit, or "
                    "FUSEDFP8_CUBLASLT_INCLUDE=<folder>)")
    incs = [f"-I{d}" for d in dict.fromkeys([found[0], *_cuda_include_dirs()])]
    cmd = [*cxx.split(), "-std=c++17", "-fsyntax-only", *incs, str(shim.HERE / "gemm_check.cc")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"


def test_gemm_check_fails_on_a_wrong_value(tmp_path):
    """The check can fail: gemm.h with one FP8 type code changed does not compile against the header."""
    cxx = shim.compiler()
    found = _cublaslt_include_dirs()
    if cxx is None or not found:
        pytest.skip("no C++ compiler or no cublasLt.h")
    for name in ("plan.h", "gemm_check.cc"):
        shutil.copy(shim.HERE / name, tmp_path / name)
    text = (shim.HERE / "gemm.h").read_text()
    assert "kR8F_E5M2 = 29" in text
    (tmp_path / "gemm.h").write_text(text.replace("kR8F_E5M2 = 29", "kR8F_E5M2 = 30"))
    incs = [f"-I{d}" for d in dict.fromkeys([found[0], *_cuda_include_dirs()])]
    proc = subprocess.run([*cxx.split(), "-std=c++17", "-fsyntax-only", *incs, str(tmp_path / "gemm_check.cc")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "kR8F_E5M2 != CUDA_R_8F_E5M2" in proc.stderr


# ---- the shim's shape check ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def xla_lib():
    return built_shim("xla")


E4, E5, BF = "float8_e4m3fn", "float8_e5m2", "bfloat16"


@pytest.mark.parametrize("args, message", [
    ((64, 64, 48, 48, 48, 64, E5, E5, BF), "no float8_e5m2 x float8_e5m2 GEMM"),
    ((64, 64, 40, 40, 40, 64, E4, E4, BF), "multiples of 16"),
    ((64, 64, 48, 40, 48, 64, E4, E4, BF), "lda=40"),
    ((64, 50, 48, 48, 48, 50, E4, E4, BF), "output row stride must be a multiple of 16 elements; got 50"),
    ((64, 64, 48, 48, 48, 64, E4, E4, "float8_e4m3fn"), "output must be bfloat16, float16 or float32"),
    ((64, 64, 48, 48, 48, 64, BF, E4, BF), "operands must be float8_e4m3fn or float8_e5m2"),
    ((0, 64, 48, 48, 48, 64, E4, E4, BF), "every dimension must be >= 1"),
    ((64, 64, 48, 32, 48, 64, E4, E4, BF), "a row stride is shorter than its row"),
], ids=["e5m2xe5m2", "ragged-k", "lda", "ldd", "out-fp8", "a-bf16", "empty", "short-lda"])
def test_the_shim_refuses_what_cublaslt_fp8_cannot_run(xla_lib, args, message):
    why = G.check_shape(*args)
    assert message in why, why
    assert why.startswith("fusedfp8 FP8 GEMM (m=")


@pytest.mark.parametrize("pair", [(E4, E4), (E4, E5), (E5, E4)], ids=["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"])
@pytest.mark.parametrize("out", ["bfloat16", "float16", "float32"])
def test_the_wrapper_hands_the_shim_only_shapes_it_takes(xla_lib, pair, out):
    """Every shape the JAX wrapper makes (K padded to 16, the output columns of output_cols, the
    bias padded with them) passes the shim's own check, for ragged shapes and their backward GEMMs,
    with and without the bias epilogue (bf16 / fp16 outputs: fp8_gemm adds a float32 output's bias
    itself)."""
    def operands(mm, kk, nn, with_bias):  # traced for their shapes only: nothing is compiled
        found = {}

        def make():
            bias = jnp.zeros((nn,), out) if with_bias else None
            _, _, padded_bias, found["cols"], found["code"] = G._ffi_operands(
                jnp.zeros((mm, kk), pair[0]), jnp.zeros((nn, kk), pair[1]), bias, out, mm, nn, False)
            return padded_bias

        return jax.eval_shape(make), found["cols"], found["code"]

    for m, k, n in ((1000, 48, 80), (17, 33, 50), (303, 300, 200), (8190, 64, 128), (2048, 1024, 4096), (1, 1, 1)):
        for mm, kk, nn in ((m, k, n), (m, n, k), (k, m, n)):  # forward, dgrad, wgrad
            for bias in (False, True)[:1 if out == "float32" else 2]:
                padded_bias, cols, code = operands(mm, kk, nn, bias)
                assert cols >= nn and cols % 16 == 0 and (cols == nn or nn % 16)
                assert not bias or padded_bias.shape == (cols,)
                assert G.check_shape(*code[:6], pair[0], pair[1], out, bias=bias) == ""


def test_the_shim_refuses_a_bias_it_cannot_add(xla_lib):
    """cuBLASLt's FP8 bias epilogue: a bias of the output's type, bf16 or fp16 (not float32)."""
    for out in ("bfloat16", "float16"):
        assert G.check_shape(64, 64, 48, 48, 48, 64, E4, E4, out, bias=True) == ""
    why = G.check_shape(64, 64, 48, 48, 48, 64, E4, E4, "float32", bias=True)
    assert "the bias must have the output's type, bfloat16 or float16" in why, why


# ---- the wrapper's checks -----------------------------------------------------------------------
def _ops(m=32, n=48, k=64, ta=E4, tb=E4):
    return (jnp.zeros((m, k), ta), jnp.zeros((n, k), tb), jnp.ones((1,), jnp.float32), jnp.ones((1,), jnp.float32))


@pytest.mark.parametrize("change, error, message", [
    (lambda o: (o[0].astype(jnp.bfloat16), *o[1:]), TypeError, r"^a must be a float8_e4m3fn or float8_e5m2 array; "
                                                               r"got bfloat16"),
    (lambda o: (o[0], o[1].reshape(-1), *o[2:]), ValueError, r"^b must be 2-D \(rows, K\); got shape \(3072,\)"),
    (lambda o: (o[0], o[1][:, :32], *o[2:]), ValueError, r"^a \(M, K\) and b \(N, K\) must agree on K"),
    (lambda o: _ops(ta=E5, tb=E5), TypeError, r"^a and b cannot both be float8_e5m2"),
    (lambda o: (*o[:2], o[2].astype(jnp.bfloat16), o[3]), ValueError,
     r"^scale_inv_a must be a float32 array of shape \(1,\)"),
    (lambda o: (*o[:3], jnp.ones((2,), jnp.float32)), ValueError, r"^scale_inv_b must be a float32 array"),
], ids=["a-dtype", "b-1d", "k-mismatch", "e5m2xe5m2", "scale-dtype", "scale-shape"])
def test_fp8_gemm_refuses_bad_operands(change, error, message):
    with pytest.raises(error, match=message):
        G.fp8_gemm(*change(_ops()), jnp.bfloat16)


def test_fp8_gemm_refuses_bad_options():
    ops = _ops()
    with pytest.raises(TypeError, match=r"^out_dtype must be one of \('bfloat16', 'float16', 'float32'\); got int8"):
        G.fp8_gemm(*ops, jnp.int8)
    with pytest.raises(ValueError, match=r"^shape \(m, n\) must be within a's rows \(32\) and b's rows \(48\); "
                                         r"got \(33, 48\)"):
        G.fp8_gemm(*ops, jnp.bfloat16, shape=(33, 48))
    with pytest.raises(TypeError, match=r"^shape must be None or a pair of ints"):
        G.fp8_gemm(*ops, jnp.bfloat16, shape=(1.5, 2))
    with pytest.raises(ValueError, match=r"^impl must be one of"):
        G.fp8_gemm(*ops, jnp.bfloat16, impl="cublas")


# ---- the XLA-dot path (CPU, impl jnp / callback) is today's -------------------------------------
@pytest.mark.parametrize("mkn", [(64, 32, 48), (303, 300, 200), (17, 33, 50)], ids=str)
@pytest.mark.parametrize("impl", ["auto", "jnp"])
def test_the_xla_dot_path_is_the_old_formula(mkn, impl):
    """On the CPU (and for impl 'jnp' everywhere) fp8_gemm is the dot that fp8_dot used before the
    FFI GEMM: dot_general in float32 of the zero-padded operands, times the scales, cast, sliced;
    bitwise."""
    m, k, n = mkn
    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]  # (on a GPU machine too: impl='auto' takes the FFI GEMM there)
    a = jax.device_put(jnp.asarray(rng.standard_normal((m, k)) * 4, jnp.float32).astype(jnp.float8_e4m3fn), cpu)
    b = jax.device_put(jnp.asarray(rng.standard_normal((n, k)) * 4, jnp.float32).astype(jnp.float8_e5m2), cpu)
    sa, sb = (jax.device_put(jnp.asarray([v], jnp.float32), cpu) for v in (0.5, 0.125))
    for fast in (False, True):
        got = jax.jit(lambda *o: G.fp8_gemm(*o, jnp.bfloat16, fast_accum=fast, impl=impl))(a, b, sa, sb)

        def old(a, b, sa, sb):
            pad = 16 if any(d % 16 for d in (m, k, n)) else 1
            a, b = (jnp.pad(x, [(0, -d % pad) for d in x.shape]) for x in (a, b))
            prec = jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST
            y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec,
                                    preferred_element_type=jnp.float32)
            return (y * (sa[0] * sb[0])).astype(jnp.bfloat16)[:m, :n]

        want = jax.jit(old)(a, b, sa, sb)
        assert got.shape == (m, n) and got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_empty_gemms_are_zeros_without_a_gemm():
    a, b, sa, sb = _ops(m=0)
    assert G.fp8_gemm(a, b, sa, sb, jnp.float32).shape == (0, 48)
    a, b, sa, sb = _ops(k=0)
    np.testing.assert_array_equal(np.asarray(G.fp8_gemm(a, b, sa, sb, jnp.float32)), np.zeros((32, 48), np.float32))


# ---- what the FFI path lowers to for CUDA -------------------------------------------------------
@pytest.fixture
def ffi_gemm_on_cuda(monkeypatch, xla_lib):
    """impl='auto' lowered for CUDA on this CPU machine takes the FFI GEMM (the trace-time
    decision forced: here there is neither a GPU nor cuBLASLt)."""
    monkeypatch.setattr(G, "_auto_uses_ffi", lambda *a: True)
    monkeypatch.setattr(P, "_auto_backend", lambda: "ffi")
    return G


def _lowered_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_fp8_dot_lowers_to_three_ffi_gemms_writing_bf16(ffi_gemm_on_cuda):
    """fp8_dot's forward and both gradients, bf16 in and out, ragged (303, 300, 200): three calls of
    the FFI GEMM, each writing bf16 (no float32 GEMM output, so no conversion after it), no
    dot_general, the 32 MiB workspace as a second result; the ragged output columns (300 -> 304
    for dx, 200 -> 208 for y and dw) sliced."""
    import fusedfp8
    from fusedfp8.jax import functional as F
    from fusedfp8.jax import meta as JM

    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    x = jnp.ones((303, 300), jnp.bfloat16)
    w = jnp.ones((300, 200), jnp.bfloat16)
    meta = JM.fresh_meta(recipe)

    def loss(x, w, meta):
        return jnp.sum(F.fp8_dot(x, w, meta, recipe).astype(jnp.float32) ** 2)

    text = _lowered_cuda(jax.grad(loss, argnums=(0, 1, 2)), x, w, meta)
    calls = [ln for ln in text.splitlines() if "@fusedfp8_fp8_gemm" in ln]
    assert len(calls) == 3, calls
    assert "dot_general" not in text
    for c in calls:
        assert re.search(r"-> \(tensor<\d+x\d+xbf16>, tensor<33554432xui8>\)", c), c
    outs = sorted(re.search(r"-> \(tensor<(\d+x\d+)xbf16>", c).group(1) for c in calls)
    assert outs == sorted(["303x208", "303x304", "300x208"]), outs  # y (M, N), dx (M, K), dw (K, N)


def test_fp8_gemm_lowers_to_the_target_with_its_accumulation(ffi_gemm_on_cuda):
    a, b, sa, sb = _ops()
    text = _lowered_cuda(lambda *o: G.fp8_gemm(*o, jnp.float32), a, b, sa, sb)
    assert re.search(r"@fusedfp8_fp8_gemm\(", text) and "fast_accum = 0" in text
    text = _lowered_cuda(lambda *o: G.fp8_gemm(*o, jnp.float32, fast_accum=True), a, b, sa, sb)
    assert re.search(r"@fusedfp8_fp8_gemm\(", text) and "fast_accum = 1" in text
    assert "fusedfp8_fp8_gemm" not in jax.jit(lambda *o: G.fp8_gemm(*o, jnp.float32)).trace(a, b, sa, sb).lower(
        lowering_platforms=("cpu",)).as_text()  # XLA's dot there
