"""CurrentScaling across devices in JAX (``axis_name`` with a CurrentScaling recipe): every
quantization of fp8_dot / fp8_mlp takes the amax of the tensor over the mesh axis, one
``lax.pmax`` per tensor group. The multi-device checks run on 4 forced host devices in a process
of their own (tests/run/jax_current_multidevice.py, a step of the 'jax_multidevice' background
job: see its docstring); the amax-only primitives are checked here against the quantizations'
staged amaxes.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fusedfp8
from fusedfp8.jax import layernorm as LN
from fusedfp8.jax import meta as JM
from fusedfp8.jax import primitives as FP

CASES = ("equal", "nan", "one_reduce")
R = fusedfp8.CurrentScaling()


@pytest.fixture(scope="module")
def verdicts(background):
    return json.loads((background.result("jax_multidevice").check().out / "current.json").read_text())


@pytest.mark.slow
@pytest.mark.background("jax_multidevice")
@pytest.mark.parametrize("case", CASES)
def test_current_scaling_across_devices(verdicts, case):
    assert verdicts[case] == "ok", verdicts[case]


def _inputs(shape=(6, 40)):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    return x, z


def _bits(a):
    return np.asarray(a, np.float32).view(np.int32).tolist()


def _staged(impl, x, z, w):
    st = JM.meta_to_state(JM.fresh_meta(R))
    return {
        "identity": FP.quantize(x, st, 0, R, impl=impl)[0].amax,
        "gelu": FP.gelu_quantize(z, st, 0, R, approximate="none", impl=impl)[0].amax,
        "dgelu": FP.dgelu_quantize(x, z, st, 2, R, impl=impl)[0].amax,
        "layernorm": LN.layernorm_quantize(x, w, None, 1e-5, st, 0, R, impl=impl)[0].quantized.amax}


def _amaxes(impl, x, z, w):
    return {"identity": FP.amax(x, impl=impl), "gelu": FP.amax(z, op="gelu", approximate="none", impl=impl),
            "dgelu": FP.amax(x, z, op="dgelu", impl=impl), "layernorm": LN.layernorm_amax(x, w, None, 1e-5, impl=impl)}


def _operands():
    x, z = _inputs()
    return x, z, jnp.asarray(np.linspace(-1, 2, 40), jnp.float32)


def test_amax_is_the_amax_the_quantization_stages():
    # one program (op by op, each primitive would compile on its own)
    want, got = jax.jit(lambda *a: (_staged("jnp", *a), _amaxes("jnp", *a)))(*_operands())
    for k in want:
        assert got[k].shape == () and got[k].dtype == jnp.float32 and float(got[k]) > 0, k
        assert _bits(got[k]) == _bits(want[k]), (k, got[k], want[k])


@pytest.mark.gpu
@pytest.mark.jax_gpu
@pytest.mark.parametrize("impl", ["ffi", "callback"])
def test_amax_kernels_equal_jnp_on_gpu(impl):
    gpu = jax.devices("gpu")[0]
    ops = [jax.device_put(a, gpu) for a in _operands()]
    staged, got = jax.jit(lambda *a: (_staged(impl, *a), _amaxes(impl, *a)))(*ops)
    want = _amaxes("jnp", *_operands())
    for k in want:
        assert _bits(got[k]) == _bits(want[k]) == _bits(staged[k]), (k, got[k], want[k], staged[k])


def test_amax_bad_input():
    x, z = _inputs()
    with pytest.raises(ValueError, match="op must be"):
        FP.amax(x, op="relu")
    with pytest.raises(ValueError, match="b is the dgelu's second input"):
        FP.amax(x, op="dgelu")
    with pytest.raises(ValueError, match="b is the dgelu's second input"):
        FP.amax(x, z)
    with pytest.raises(ValueError, match="b must match"):
        FP.amax(x, z[:2], op="dgelu")
    with pytest.raises(TypeError, match="x must be float32"):
        FP.amax(jnp.ones((2, 2), jnp.int32))


@pytest.mark.parametrize("bad", [3, ("d", 1)], ids=["int", "tuple-int"])
def test_bad_axis_name_with_current_scaling(bad):
    from fusedfp8.jax import functional as F
    with pytest.raises(TypeError, match="axis_name"):
        F.fp8_dot(jnp.ones((2, 4)), jnp.ones((4, 3)), JM.fresh_meta(R), R, axis_name=bad)
