"""fusedfp8.jax on several (CPU) devices: the staged amaxes MAX-reduced over a mesh axis.

The checks run in one process of their own, started with 4 host devices
(tests/run/jax_multidevice.py, the 'jax_multidevice' background job: see its docstring for what
each case checks); each test reads its own case's verdict. Bad axis names are refused here.
"""
import json

import jax.numpy as jnp
import pytest

import fusedfp8
from fusedfp8.jax import functional as F
from fusedfp8.jax import meta as JM
from fusedfp8.jax import primitives as FP

CASES = ("update", "flax_step", "one_reduce")


@pytest.fixture(scope="module")
def verdicts(background):
    return json.loads((background.result("jax_multidevice").check().out / "verdicts.json").read_text())


@pytest.mark.slow
@pytest.mark.background("jax_multidevice")
@pytest.mark.parametrize("case", CASES)
def test_distributed(verdicts, case):
    assert verdicts[case] == "ok", verdicts[case]


@pytest.mark.parametrize("bad", [3, (), ("d", 1), b"d"], ids=["int", "empty", "tuple-int", "bytes"])
def test_bad_axis_name(bad):
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    st = JM.meta_to_state(JM.fresh_meta(recipe))
    with pytest.raises(TypeError, match="axis_name"):
        FP.update_scales(st, recipe, axis_name=bad)
    with pytest.raises(TypeError, match="axis_name"):
        F.fp8_dot(jnp.ones((2, 4)), jnp.ones((4, 3)), JM.fresh_meta(recipe), recipe, axis_name=bad)
