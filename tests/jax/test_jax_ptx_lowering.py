"""impl 'ptx' (fusedfp8/jax/ptx.py) without a GPU: the primitives lowered for CUDA from the CPU
(tests/support/ptx.py fakes the one GPU the lowering asks about) become XLA's own PTX custom calls,
one per launch of their plan, with the plan's grids and blocks, the state aliased in place, the
memsets as zeros operands, and no FFI call; the names of the impl and of the environment variable
are checked; the wrappers compile with NVRTC for sm_90 (tests/run/ptx_compile.py, the 'ptx'
background job). The bytes on a GPU: tests/jax/test_jax_ptx.py."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedfp8
from fusedfp8 import _cuda
from fusedfp8.csrc.plan import Launch, Memset
from fusedfp8.jax import callbacks as C
from fusedfp8.jax import primitives as JP
from fusedfp8.jax import ptx as X
from fusedfp8.state import ScalingState
from support import ptx as SP

RECIPE = fusedfp8.DelayedScaling(amax_history_len=4)
UNIT = fusedfp8.DelayedScaling(amax_history_len=4, first_step="unit")


@pytest.fixture
def gpu_faked(monkeypatch):
    SP.fake_gpu(monkeypatch.setattr)
    yield
    SP.clear_plans()


def lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def state(recipe=RECIPE):
    return ScalingState.create((False, False, True), recipe, like=jnp.zeros(1))


def plan_launches(dtype, fmt, op, rows, cols, transpose=False, dbias=False, first=True, offset=0, pad_to=1):
    """The launches (grid, block) of the two-launch plan impl 'ptx' bakes, from the same fake kernels."""
    refs = SP.fake_refs(_cuda.ModuleKey("quantize", dtype, fmt, op), 0)
    plan = _cuda.build_quantize_plan(refs, SP.SMS, rows, cols, transpose, dbias, first, 1.0, offset, pad_to, False)
    return [(st.variants[0].grid, st.block) for st in plan.steps if isinstance(st, Launch)]


def dims(call: str) -> tuple[int, int]:
    return int(SP.attr(call, "grid_x")), int(SP.attr(call, "block_x"))


def test_ptx_is_an_impl():
    assert JP.IMPLS == ("auto", "jnp", "ffi", "callback", "callback_no_cmdbuf", "ptx")
    assert "ptx" in JP._CUDA_IMPLS and JP.IMPL_ENV == "FUSEDFP8_JAX_IMPL"


def test_a_step_lowers_to_ptx_calls_only(gpu_faked):
    """A first-step quantize (transpose) is two calls: the amax pre-pass (quantize_flat, STORE false,
    reading updates) and the tiled cast; dgelu with dbias the same two, its dbias counters a zeros
    operand aliased to their result; update_scales one call, its five state arrays in place."""
    def step(x, dy, s):
        r, s = JP.quantize(x, s, 1, RECIPE, transpose=True)
        g, s = JP.dgelu_quantize(dy, x, s, 2, RECIPE, transpose=True, dbias=True)
        return r.data, g.dbias, JP.update_scales(s, RECIPE)

    x = jnp.ones((300, 520), jnp.bfloat16)
    text = lowered(step, x, x, state())
    assert "fusedfp8_launch" not in text
    calls = SP.custom_calls(text)
    assert SP.targets(text) == [X.TARGET] * 5
    pre, main, dpre, dmain, upd = calls
    want = (plan_launches("bfloat16", "e4m3", "identity", 300, 520, True, offset=4)
            + plan_launches("bfloat16", "e5m2", "dgelu_tanh", 300, 520, True, True, offset=8))
    assert [dims(c) for c in calls[:4]] == want
    assert want[0] == (min(-(-300 * 520 // (16 * 256)), SP.SMS), 256) and want[1][1] == 256  # not a single block
    assert dims(upd) == (3, 256)  # a block per tensor
    # aliases: the pre-pass updates scale and history (q comes out of it unwritten); the cast q, the state
    assert [SP.n_aliases(c) for c in calls] == [2, 4, 2, 5, 5]
    src = SP.kernel_data(pre)
    assert "quantize_flat_body<__nv_bfloat16, 0, 0, true, false>(" in src  # the aligned variant, STORE false
    assert "(long long)156000LL" in src and "+ 4}" in src  # n baked, tensor 1's state entries at byte 4
    assert re.search(r"__launch_bounds__\(256\) ff8_ptx_\w+\(char\* p0,", src)
    dsrc = SP.kernel_data(dmain)
    assert "quantize_tiled_body<__nv_bfloat16, 1, 3>(" in dsrc and "+ 8}" in dsrc and "nullptr" not in dsrc
    assert "update_scales_body(" in SP.kernel_data(upd)
    # the dbias counters: a zeros operand (no memset), aliased to the tiled kernel's counters result
    assert re.search(r"tensor<\d+xi32>", dmain.split("->")[0])
    assert "cooperative" not in text and "current_quantize" not in text


def test_later_steps_only_is_one_call(gpu_faked):
    """first_step='unit': no pre-pass, the flat cast alone (a tensor without transpose)."""
    x = jnp.ones((64, 128), jnp.float32)
    text = lowered(lambda x, s: JP.gelu_quantize(x, s, 0, UNIT, approximate="none"), x, state(UNIT))
    (call,) = SP.custom_calls(text)
    assert dims(call) == plan_launches("float32", "e4m3", "gelu_erf", 64, 128, first=False)[0]
    assert "quantize_flat_body<float, 0, 2, true, true>(" in SP.kernel_data(call)


@pytest.mark.parametrize("shape, flat", [((300, 32), True), ((303, 300), False)])
def test_padded_shapes(gpu_faked, shape, flat):
    """pad_to=16: padded in rows only -> the flat kernel writes the zero rows (npad baked); else the tiled."""
    x = jnp.ones(shape, jnp.float16)
    text = lowered(lambda x, s: JP.quantize(x, s, 0, UNIT, pad_to=16), x, state(UNIT))
    (call,) = SP.custom_calls(text)
    rows, cols = shape
    src = SP.kernel_data(call)
    if flat:
        assert "quantize_flat_body<__half" in src and f"(long long){(304 - rows) * cols}LL" in src
    else:
        assert "quantize_tiled_body<__half" in src and "(long long)304LL" in src
    assert "tensor<304x" in call


def test_empty_tensor_with_dbias(gpu_faked):
    """0 x 16 with dbias: the plan's memset of the column sums is a zeros result; one launch hands out 1 / scale."""
    x = jnp.ones((0, 16), jnp.bfloat16)
    text = lowered(lambda x, s: JP.dgelu_quantize(x, x, s, 2, UNIT, transpose=True, dbias=True), x, state(UNIT))
    (call,) = SP.custom_calls(text)
    assert "(long long)0LL" in SP.kernel_data(call)


def test_amax_is_one_call_on_a_zeros_operand(gpu_faked):
    x = jnp.ones((1000,), jnp.bfloat16)
    text = lowered(lambda x: JP.amax(x, x, op="dgelu"), x)
    (call,) = SP.custom_calls(text)
    assert SP.n_aliases(call) == 1 and "tensor<2xf32>" in call
    assert "quantize_flat_body<__nv_bfloat16, 0, 3, true, false>(" in SP.kernel_data(call)


def test_vmap_lowers(gpu_faked):
    x = jnp.ones((3, 64, 32), jnp.bfloat16)
    text = lowered(jax.vmap(lambda x: JP.amax(x)), x)
    assert SP.targets(text) == [X.TARGET] and "stablehlo.while" in text


def test_plans_of_gpus_that_differ_are_refused(monkeypatch):
    """One call bakes one launch: GPUs whose plans differ (here in multiprocessors) are refused."""
    refs = SP.fake_refs(_cuda.ModuleKey("quantize", "float32", "e4m3", "identity"), 0)
    a = _cuda.build_quantize_plan(refs, 132, 4096, 4096)
    b = _cuda.build_quantize_plan(refs, 108, 4096, 4096)
    monkeypatch.setattr(X, "compute_capability", lambda d: 90)
    assert X.one_plan({0: a, 1: a}) == (a, 90)
    with pytest.raises(ValueError, match=r"impl='ptx' bakes one launch configuration for every local GPU"):
        X.one_plan({0: a, 1: b})


def test_a_memset_of_part_of_a_buffer_is_refused(gpu_faked, monkeypatch):
    plan = _cuda._plan(_cuda.UPDATE_SLOTS, [Memset(0, 4)])
    shapes = [jax.ShapeDtypeStruct((2, 3), jnp.float32)]
    with pytest.raises(ValueError, match=r"zeroes whole results only; the plan zeroes 4 bytes"):
        X.run({0: plan}, shapes, (), [("out", 0)] + [None] * 5, {})


def test_body_call_names():
    assert X.body_call("quantize_tiled<float, 1, 3>") == ("quantize", "quantize_tiled_body<float, 1, 3>")
    assert X.body_call("update_scales") == ("update_scales", "update_scales_body")
    with pytest.raises(ValueError, match=r"impl='ptx' has no wrapper for kernel 'layernorm_quantize<"):
        X.body_call("layernorm_quantize<float, float, 0, true, false>")


# ---- names and availability ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["PTX", "xla_ptx", ""])
def test_bad_impl_names_are_refused(bad):
    with pytest.raises(ValueError, match=r"^impl must be one of .*'ptx'.*; got " + re.escape(repr(bad))):
        JP.quantize(jnp.ones(4), state(), 0, RECIPE, impl=bad)


@pytest.mark.parametrize("bad", ["PTX", "auto", "jnp", "cuda"])
def test_bad_environment_override_is_refused(monkeypatch, bad):
    monkeypatch.setenv("FUSEDFP8_JAX_IMPL", bad)
    with pytest.raises(ValueError, match=r"FUSEDFP8_JAX_IMPL must be one of \('ffi', 'callback', "
                                         r"'callback_no_cmdbuf', 'ptx'\).*got " + re.escape(repr(bad))):
        JP._auto_backend()


def test_environment_override_sets_autos_backend(monkeypatch):
    """FUSEDFP8_JAX_IMPL=ptx: impl='auto' lowers its CUDA branch to PTX calls (checked as impl='ptx'
    is: a GPU, and the probe of the jaxlib); unset, the FFI call."""
    monkeypatch.setenv("FUSEDFP8_JAX_IMPL", "ptx")
    assert JP.launch_path() == ("ptx", "set by the environment variable FUSEDFP8_JAX_IMPL")
    SP.fake_gpu(monkeypatch.setattr, auto=False)
    monkeypatch.setattr(_cuda, "probe", lambda *a: (True, "faked"))
    monkeypatch.setattr(X, "supported", lambda: (True, "faked"))
    x = jnp.ones((8, 16), jnp.bfloat16)
    try:
        assert SP.targets(lowered(lambda x, s: JP.quantize(x, s, 0, UNIT), x, state(UNIT))) == [X.TARGET]
        monkeypatch.setattr(X, "supported", lambda: (False, "faked"))
        with pytest.raises(ValueError, match=r"^impl='ptx' needs XLA's PTX custom call"):
            lowered(lambda x, s: JP.quantize(x, s, 0, UNIT), x, state(UNIT))
    finally:
        SP.clear_plans()


def test_ptx_needs_a_gpu_here():
    if _cuda.probe()[0]:
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match=r"^impl='ptx' runs the CUDA kernels, which cannot run here: "):
        JP._check_impl("ptx")


def test_a_jaxlib_without_the_ptx_call_is_named(monkeypatch):
    """Where the probe fails (a jaxlib whose XLA lacks the call), impl='ptx' says what it needs and why."""
    import jaxlib

    monkeypatch.setattr(_cuda, "probe", lambda *a: (True, "faked"))
    monkeypatch.setattr(C, "gpu_devices", lambda: [0])
    monkeypatch.setattr(X, "supported", lambda: (False, f"jaxlib {jaxlib.__version__} could not run it: faked"))
    with pytest.raises(ValueError, match=r"^impl='ptx' needs XLA's PTX custom call \(__gpu\$xla\.gpu\.ptx\) in "
                                         r"jaxlib, which did not run here: jaxlib \S+ could not run it"):
        JP._check_impl("ptx")


def test_the_probe_says_why_without_a_gpu():
    if _cuda.probe()[0]:
        pytest.skip("a GPU is here")
    import jaxlib

    ok, why = X.supported()
    assert not ok and why.startswith(f"jaxlib {jaxlib.__version__} could not run it: ")


# ---- NVRTC --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.background("ptx")
def test_every_wrapper_compiles_for_sm90(background):
    """tests/run/ptx_compile.py: every kernel variant impl 'ptx' launches, for every input dtype, op
    and format, wrapped and compiled to PTX with NVRTC (each PTX defines its wrapper's entry)."""
    v = json.loads((background.result("ptx").check().out / "verdicts.json").read_text())
    if not v["ready"]:
        pytest.skip(v["reason"])
    progs = v["programs"]
    assert len(progs) == 3 * 5 * 2 + 2
    bad = {k: p["log"] for k, p in progs.items() if not p["ok"]}
    assert not bad, bad
    for name, p in progs.items():
        if not name.startswith("update_"):  # pre-pass + flat cast, pre-pass + tiled cast, amax
            assert p["calls"] == 5 and p["bodies"] == ["quantize_flat_body", "quantize_tiled_body"], (name, p)
    assert progs["update_scales"]["bodies"] == ["update_scales_body"]
    assert progs["update_meta"]["bodies"] == ["update_meta_body"]
    assert v["compiles"] >= 3 * 5 * 2 * 3  # pre-pass, flat and tiled per (dtype, op, format), amax per (dtype, op)


def test_shard_map_lowers(gpu_faked):
    """Inside shard_map (x and the state varying over the mesh axis, as primitives.py asks): the same
    PTX calls, the zeros operand of the dbias counters and the amax included."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as PS

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def f(x, s):
        s = jax.tree.map(lambda a: jax.lax.pcast(a, ("d",), to="varying"), s)
        g, s = JP.dgelu_quantize(x, x, s, 2, UNIT, transpose=True, dbias=True)
        return g.dbias, JP.amax(x).reshape(1)

    sf = jax.shard_map(f, mesh=mesh, in_specs=(PS("d"), PS()), out_specs=(PS("d"), PS("d")))
    assert SP.targets(lowered(sf, jnp.ones((64, 32), jnp.bfloat16), state(UNIT))) == [X.TARGET] * 2


def test_the_gpu_tests_fail_rather_than_skip_where_ptx_should_run(monkeypatch):
    """tests/support/ptx.require_ptx: a failing probe skips the GPU tests of impl 'ptx' only on a
    jaxlib older than one known to run the call; on a newer one it fails them (a broken probe must
    not pass as a skip)."""
    import jaxlib

    monkeypatch.setattr(X, "supported", lambda: (False, "the probe failed"))
    monkeypatch.setattr(jaxlib, "__version__", "0.10.0")
    with pytest.raises(pytest.skip.Exception, match="the probe failed"):
        SP.require_ptx()
    monkeypatch.setattr(jaxlib, "__version__", "0.11.2")
    with pytest.raises(pytest.fail.Exception, match="should run on jaxlib 0.11.2.*the probe failed"):
        SP.require_ptx()
    monkeypatch.setattr(X, "supported", lambda: (True, "runs"))
    SP.require_ptx()
