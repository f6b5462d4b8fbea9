"""The shim's cuBLASLt FP8 GEMM (fusedfp8_fp8_gemm, fusedfp8/csrc/gemm.h) on a GPU: its values
against a float64 reference and XLA's dot of the dequantized operands, for aligned and ragged
shapes and every format pair cuBLASLt allows; fp8_dot / fp8_mlp gradients with it against the
jax.numpy path; the compiled step (three GEMM calls writing bf16, no XLA GEMM); jit with donation;
XLA's command buffers (tests/run/jax_gemm_graph.py, a process of its own: the flags must be set
before jax starts). Skipped, with the probe's reason, without a GPU that runs FP8 GEMMs."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedfp8
from fusedfp8.jax import functional as F
from fusedfp8.jax import gemm as G
from fusedfp8.jax import meta as JM

pytestmark = [pytest.mark.gpu, pytest.mark.jax_gpu, pytest.mark.fp8_gemm]

RECIPE = fusedfp8.DelayedScaling(amax_history_len=16)
ISSUE_19 = [(1000, 48, 80), (17, 33, 50), (303, 300, 200), (8190, 64, 128)]
SHAPES = [pytest.param((2048, 1024, 4096), id="aligned-2048x1024x4096"),
          *(pytest.param(s, id="ragged-{}x{}x{}".format(*s)) for s in ISSUE_19)]
PAIRS = [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"), ("float8_e5m2", "float8_e4m3fn")]
PAIR_IDS = ["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"]
# unit roundoff of the output, and the accumulation error allowed relative to sum_k |a_ik b_jk|.
# Hopper's FP8 tensor cores accumulate with about 14 bits; the split accumulator promotes the
# partial sums to float32 every few k-blocks (so ~2^-14 x the additions of one block, at worst
# 2^-7, typically far less), fast accumulation never does. A wrong layout or scale errs by about
# |reference|, i.e. sum|ab| / sqrt(K): >= 2^-5 of it for every K here.
OUT_EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -23}
ACC_EPS = {False: 2.0 ** -9, True: 2.0 ** -6}


@pytest.fixture(scope="module", autouse=True)
def ffi_gemm():
    ok, why = G.gemm_target()
    assert ok, f"the shim's FP8 GEMM is not available on this GPU machine: {why}"
    return why


def gpu(a):
    return jax.device_put(a, jax.devices("gpu")[0])


def operand(rows, k, fmt, seed, garbage=448.0):
    """(rows, k) FP8 values in a zero-padded (rows rounded up to 16, k rounded up to 16) array whose
    padding ROWS hold ``garbage`` (the GEMM must not read them into the output it keeps) and whose
    padding COLUMNS (K) are zeros (what our kernels write, pad_to=16)."""
    rng = np.random.default_rng(seed)
    vals = (rng.standard_normal((rows, k)) * 2).astype(np.float32)
    full = np.zeros((-(-rows // 16) * 16, -(-k // 16) * 16), np.float32)
    full[rows:, :k] = garbage
    full[:rows, :k] = vals
    q = jnp.asarray(full).astype(fmt)
    return gpu(q), np.asarray(q[:rows, :k].astype(jnp.float32), np.float64)


def reference(a64, b64, sa, sb):
    """(a @ b.T) * sa * sb in float64, and sum_k |a_ik b_jk| * sa * sb (the error scale)."""
    return (a64 @ b64.T) * sa * sb, (np.abs(a64) @ np.abs(b64).T) * sa * sb


def assert_close(got, ref, absref, out, fast, what):
    got = np.asarray(jax.device_get(got), np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = np.abs(got - ref)
    bound = OUT_EPS[out] * np.abs(ref) + ACC_EPS[fast] * absref + 1e-30
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), (f"{what}: |err| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
                                  f"(got {got[worst]!r}, float64 {ref[worst]!r})")


@pytest.mark.parametrize("fast", [False, True], ids=["split-accum", "fast-accum"])
@pytest.mark.parametrize("out", ["bfloat16", "float32"])
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("mkn", SHAPES)
def test_ffi_gemm_matches_float64_and_xla_dot(mkn, pair, out, fast):
    """The FFI GEMM on the padded operands (garbage in the padding rows, zeros in the padding K
    columns), cut to (m, n): within the output's rounding plus the accumulation error of a float64
    reference, with distinct per-tensor scales; XLA's float32 dot of the dequantized operands is
    held to the same bound (so the bound is the one a correct GEMM meets)."""
    m, k, n = mkn
    (a, a64), (b, b64) = operand(m, k, pair[0], 1), operand(n, k, pair[1], 2)
    sa, sb = 0.5, 2.0 ** -5
    ref, absref = reference(a64, b64, sa, sb)
    s = (gpu(jnp.asarray([sa], jnp.float32)), gpu(jnp.asarray([sb], jnp.float32)))
    got = jax.jit(lambda a, b, x, y: G.fp8_gemm(a, b, x, y, jnp.dtype(out), shape=(m, n), fast_accum=fast,
                                                impl="ffi"))(a, b, *s)
    assert got.dtype == jnp.dtype(out)
    assert_close(got, ref, absref, out, fast, f"ffi {mkn} {pair} -> {out}")
    deq = jax.jit(lambda a, b: jnp.dot(a[:m, :k].astype(jnp.float32) * sa, (b[:n, :k].astype(jnp.float32) * sb).T,
                                       precision=jax.lax.Precision.HIGHEST))(a, b)
    assert_close(deq, ref, absref, "float32", False, f"XLA dot {mkn}")


@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_ffi_gemm_takes_unpadded_operands(pair):
    """Operands not padded by a kernel (ragged K, ragged rows): the wrapper pads what cuBLASLt
    needs (K to 16, b's rows to the output's columns) and the result is the same as from the
    kernel-padded operands, bitwise."""
    m, k, n = 303, 300, 200
    (a, _), (b, _) = operand(m, k, pair[0], 3, garbage=0.0), operand(n, k, pair[1], 4, garbage=0.0)
    s = gpu(jnp.asarray([0.25], jnp.float32))
    padded = jax.jit(lambda a, b, s: G.fp8_gemm(a, b, s, s, shape=(m, n), impl="ffi"))(a, b, s)
    plain = jax.jit(lambda a, b, s: G.fp8_gemm(a[:m, :k], b[:n, :k], s, s, impl="ffi"))(a, b, s)
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(padded, np.float32))


@pytest.mark.parametrize("out", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("mkn", [(2048, 1024, 4096), (303, 300, 200)], ids=["aligned", "ragged"])
def test_ffi_gemm_bias_is_added_before_the_one_rounding(mkn, out):
    """bias= (cuBLASLt's bias epilogue on bf16 / fp16 outputs, XLA's add on a float32 one): within
    the output's rounding of the float64 product + bias (so rounded once, not twice), on a bias of
    the product's magnitude; the same bound as without a bias, and XLA's dot path the same."""
    m, k, n = mkn
    (a, a64), (b, b64) = operand(m, k, "float8_e4m3fn", 5), operand(n, k, "float8_e4m3fn", 6)
    sa, sb = 0.5, 2.0 ** -5
    ref, absref = reference(a64, b64, sa, sb)
    bias = (np.random.default_rng(7).standard_normal(n) * np.abs(ref).mean()).astype(np.float32)
    bias_q = jnp.asarray(bias).astype(out)
    want = ref + np.asarray(bias_q.astype(jnp.float32), np.float64)[None, :]
    s = (gpu(jnp.asarray([sa], jnp.float32)), gpu(jnp.asarray([sb], jnp.float32)))
    for impl in ("ffi", "jnp"):
        got = jax.jit(lambda a, b, x, y, c: G.fp8_gemm(a, b, x, y, jnp.dtype(out), shape=(m, n), bias=c,
                                                       impl=impl))(a, b, *s, gpu(bias_q))
        assert got.dtype == jnp.dtype(out)
        assert_close(got, want, absref + np.abs(want), out, False, f"{impl} + bias {mkn} -> {out}")


# ---- fp8_dot / fp8_mlp on the FFI GEMM ------------------------------------------------------------
def _inputs(shape, seed, scale):
    rng = np.random.default_rng(seed)
    return gpu(jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16))


def _assert_grads_close(got, want, names):
    for name, g, h in zip(names, got, want):
        g, h = np.asarray(g, np.float64), np.asarray(h, np.float64)
        assert g.shape == h.shape, name
        assert ((g - h) ** 2).sum() <= 1e-4 * (h ** 2).sum() + 1e-30, name  # >= 40 dB


@pytest.mark.parametrize("mkn", SHAPES)
def test_fp8_dot_gradients_on_the_ffi_gemm_match_the_jnp_path(mkn):
    """impl='auto' (the quantize kernels and the FFI GEMM) against impl='jnp' (the jax.numpy
    numerics and XLA's dot): the same FP8 bytes into the GEMMs, so the output and both gradients
    agree to the GEMMs' rounding (>= 40 dB), the new meta bitwise."""
    M, K, N = mkn
    x, w = _inputs((M, K), 0, 1.0), _inputs((K, N), 1, 0.05)
    meta = jax.tree.map(gpu, JM.fresh_meta(RECIPE))

    def loss(x, w, meta, impl):
        return jnp.sum(F.fp8_dot(x, w, meta, RECIPE, impl=impl).astype(jnp.float32) ** 2)

    grads = {impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl=impl), argnums=(0, 1, 2)))(x, w, meta)
             for impl in ("auto", "jnp")}
    (lg, got), (lw, want) = grads["auto"], grads["jnp"]
    np.testing.assert_allclose(float(lg), float(lw), rtol=1e-2)
    _assert_grads_close(got[:2], want[:2], ("dx", "dw"))
    for g, h in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("layernorm", [False, True], ids=["mlp", "ln-mlp"])
@pytest.mark.parametrize("dims", [(2048, 1024, 4096), (1000, 48, 80)], ids=["aligned", "ragged"])
def test_fp8_mlp_gradients_on_the_ffi_gemm_match_the_jnp_path(dims, layernorm):
    tokens, hidden, ffn = dims
    x = _inputs((tokens, hidden), 0, 1.0)
    w1, w2 = _inputs((hidden, ffn), 1, hidden ** -0.5), _inputs((ffn, hidden), 2, ffn ** -0.5)
    b1, b2 = _inputs((ffn,), 3, 0.1), _inputs((hidden,), 4, 0.1)
    metas = [jax.tree.map(gpu, JM.fresh_meta(RECIPE)) for _ in range(2)]
    ln = {"ln_eps": 1e-5, "ln_weight": _inputs((hidden,), 5, 1.0)} if layernorm else {}

    def loss(x, w1, b1, w2, b2, m1, m2, impl):
        y = F.fp8_mlp(x, w1, b1, w2, b2, m1, m2, RECIPE, impl=impl, **ln)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    args = (x, w1, b1, w2, b2, *metas)
    got, want = (jax.jit(jax.grad(functools.partial(loss, impl=impl), argnums=tuple(range(7))))(*args)
                 for impl in ("auto", "jnp"))
    _assert_grads_close(got[:5], want[:5], ("dx", "dw1", "db1", "dw2", "db2"))
    for g, h in zip(jax.tree.leaves(got[5:]), jax.tree.leaves(want[5:])):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


def test_the_compiled_step_runs_three_ffi_gemms_writing_bf16():
    """fp8_dot's train step at 2048x1024x4096, bf16: three fusedfp8_fp8_gemm calls, each writing
    bf16 (so no float32 GEMM output and no f32 -> bf16 conversion after it), and no GEMM of XLA's."""
    M, K, N = 2048, 1024, 4096
    x, w = _inputs((M, K), 0, 1.0), _inputs((K, N), 1, 0.03)
    meta = jax.tree.map(gpu, JM.fresh_meta(RECIPE))

    def loss(x, w, meta):
        return jnp.sum(F.fp8_dot(x, w, meta, RECIPE).astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, w, meta).compile().as_text()
    calls = [ln for ln in text.splitlines() if 'custom_call_target="fusedfp8_fp8_gemm"' in ln]
    assert len(calls) == 3, calls
    for c in calls:
        assert re.search(r"= \(bf16\[\d+,\d+\]\S*, u8\[33554432\]\S*\) custom-call\(", c), c
    assert "__cublas" not in text, "an XLA GEMM is left in the step"
    # no float32 array of a GEMM output's shape is written to memory (outside fusion bodies)
    for shape in ("2048,4096", "2048,1024", "1024,4096"):
        written = [ln for ln in unfused_lines(text) if re.match(rf"\s*(ROOT )?%\S+ = f32\[{shape}\]", ln)]
        assert not written, written[:2]


def test_the_fp8_mlp_forward_adds_its_biases_in_the_gemm_epilogues():
    """fp8_mlp's two forward GEMMs take the biases (fusedfp8_fp8_gemm_bias): no add over a GEMM
    output of its own in the compiled forward."""
    M, H, F_ = 2048, 1024, 4096
    h, w1, w2 = _inputs((M, H), 0, 1.0), _inputs((H, F_), 1, 0.03), _inputs((F_, H), 2, 0.03)
    b1, b2 = _inputs((F_,), 3, 0.1), _inputs((H,), 4, 0.1)
    m1, m2 = (jax.tree.map(gpu, JM.fresh_meta(RECIPE)) for _ in range(2))
    text = jax.jit(lambda *a: F.fp8_mlp(*a, RECIPE)).lower(h, w1, b1, w2, b2, m1, m2).compile().as_text()
    calls = [ln for ln in text.splitlines() if 'custom_call_target="fusedfp8_fp8_gemm_bias"' in ln]
    assert len(calls) == 2, calls
    adds = [ln for ln in unfused_lines(text) if re.search(rf"= bf16\[{M},({F_}|{H})\]\S* (add|fusion)\(", ln)]
    assert not adds, adds[:2]


def unfused_lines(text: str) -> list[str]:
    """The instructions of a compiled HLO module outside fusion bodies (what writes memory)."""
    comps = re.split(r"\n(?=(?:ENTRY )?%?[\w.\-]+ [(\[{])", text)
    fused = set(re.findall(r"fusion\(.*?calls=%?([\w.\-]+)", text))
    out = []
    for comp in comps:
        name = re.match(r"(?:ENTRY )?%?([\w.\-]+)", comp.strip())
        if name is not None and name.group(1) not in fused:
            out += comp.splitlines()[1:]
    return out


def test_ffi_gemm_under_jit_with_donation():
    """Five SGD steps of fp8_dot under jax.jit with the weight and meta donated: the same values
    as the same steps without donation, bitwise (the GEMM reads XLA's buffers wherever they are)."""
    M, K, N = 1000, 48, 80
    x = _inputs((M, K), 0, 1.0)

    def step(w, meta):
        def loss(w, meta):
            return jnp.mean(F.fp8_dot(x, w, meta, RECIPE).astype(jnp.float32) ** 2)

        l, (dw, new_meta) = jax.value_and_grad(loss, argnums=(0, 1))(w, meta)
        return (w - 0.1 * dw).astype(w.dtype), new_meta, l

    runs = []
    for donate in ((), (0, 1)):
        fn = jax.jit(step, donate_argnums=donate)
        w, meta, losses = _inputs((K, N), 1, 0.05), jax.tree.map(gpu, JM.fresh_meta(RECIPE)), []
        for _ in range(5):
            w, meta, l = fn(w, meta)
            losses.append(float(l))
        runs.append((np.asarray(w, np.float32), [np.asarray(a) for a in jax.tree.leaves(meta)], losses))
    (w0, m0, l0), (w1, m1, l1) = runs
    assert l0[-1] < l0[0]
    np.testing.assert_array_equal(w1, w0)
    assert l1 == l0
    for a, b in zip(m1, m0):
        np.testing.assert_array_equal(a, b)


def test_ffi_gemm_with_xla_command_buffers_on_gives_the_results_with_them_off(tmp_path):
    """tests/run/jax_gemm_graph.py twice, each a fresh process (the flags are read when jax
    starts): with XLA's command buffers forced on for custom calls, and with them off. Several
    donated steps give the same weights, metas and losses, bitwise. Whether XLA records the GEMM
    into a command buffer is printed, not asserted: the script looks for command-buffer
    computations in the optimized HLO, and jax 0.11.2 on the H200 showed none at all, for any op,
    with the default flags too: this XLA seems to form its command buffers after the HLO passes,
    so the text cannot say."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run", "jax_gemm_graph.py")
    runs = {}
    for name, flags in (("on", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLASLT "
                                "--xla_gpu_graph_min_graph_size=1"),
                        ("off", "--xla_gpu_enable_command_buffer=")):
        out = tmp_path / f"{name}.npz"
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()}
        proc = subprocess.run([sys.executable, script, str(out)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = dict(np.load(out))
    print("GEMM recorded into a command buffer:", {k: bool(r["in_command_buffer"]) for k, r in runs.items()})
    on, off = runs["on"], runs["off"]
    assert sorted(on) == sorted(off) and len(on) > 3
    assert on["losses"][-1] < on["losses"][0]
    for key in on:
        if key != "in_command_buffer":
            np.testing.assert_array_equal(on[key], off[key], err_msg=key)
