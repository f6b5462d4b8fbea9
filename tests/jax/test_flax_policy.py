"""``fusedfp8.jax.flax.dot_general_cls_for``: the decision of ``policy='auto'`` (fusedfp8/policy.py)
as the ``dot_general_cls`` of one nn.Dense, from a SYNTHETIC table written by the test
(tests/support/policy.py: none of its numbers was measured): by default for compiled steps (the
table's graphed grid), the error for a table without it, the table chosen by the GPU's name, the
error without one, and the options passed through to Fp8DotGeneral."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fusedfp8
from fusedfp8 import policy as P
from fusedfp8.jax.flax import Fp8DotGeneral, dot_general_cls_for
from support.policy import synthetic_table


@pytest.fixture(autouse=True)
def no_env_table(monkeypatch):
    monkeypatch.delenv(P.TABLE_ENV, raising=False)


def test_fp8_where_the_table_predicts_it_faster(tmp_path):
    table = synthetic_table(tmp_path / "synthetic.json")
    assert dot_general_cls_for(256, 256, 256, table=table.path) is Fp8DotGeneral
    assert dot_general_cls_for(16, 16, 16, table=table) is None  # None: flax's own lax.dot_general
    assert dot_general_cls_for(16, 16, 16, "all") is Fp8DotGeneral  # 'all' reads no table


def test_the_default_mode_is_compiled_decided_from_graphed_steps(tmp_path):
    """16 x 16 -> 256 gains in FP8 on the synthetic graphed grid, not on the eager one."""
    table = synthetic_table()
    assert P.decide(16, 16, 256, mode="compiled", table=table).fp8 and not P.decide(16, 16, 256, table=table).fp8
    assert dot_general_cls_for(16, 16, 256, table=table) is Fp8DotGeneral
    assert dot_general_cls_for(16, 16, 256, mode="graphed", table=table) is Fp8DotGeneral
    assert dot_general_cls_for(16, 16, 256, mode="eager", table=table) is None


def test_a_table_without_graphed_steps_says_how_to_measure_them(tmp_path):
    table = synthetic_table(tmp_path / "eager_only.json", graphed=False)
    with pytest.raises(P.MissingModeError, match=r"^policy table eager_only\.json .* has no graphed measurements "
                                                 r"\(synthetic table without graphed steps\), which mode='compiled' "
                                                 r"needs .*`python -m fusedfp8 bench --calibrate`"):
        dot_general_cls_for(256, 256, 256, table=table.path)
    assert dot_general_cls_for(256, 256, 256, mode="eager", table=table) is Fp8DotGeneral
    assert dot_general_cls_for(16, 16, 16, "all", table=None) is Fp8DotGeneral  # 'all' reads no table


def test_the_class_works_as_dot_general_cls(tmp_path):
    table = synthetic_table()
    recipe = fusedfp8.DelayedScaling(amax_history_len=4)
    cls = dot_general_cls_for(256, 256, 256, table=table, recipe=recipe, impl="jnp")
    assert isinstance(cls, functools.partial) and cls.func is Fp8DotGeneral
    layer = cls()  # what nn.Dense does with its dot_general_cls
    assert isinstance(layer, Fp8DotGeneral) and layer.recipe is recipe and layer.impl == "jnp"
    kept = nn.Dense(8, dot_general_cls=dot_general_cls_for(16, 16, 8, table=table))
    variables = kept.init(jax.random.key(0), jnp.ones((16, 16)))
    assert set(variables) == {"params"}  # a plain Dense: no FP8 state


def test_the_table_is_chosen_by_the_gpus_name(monkeypatch, tmp_path):
    monkeypatch.setattr(P, "DATA_DIR", tmp_path)
    synthetic_table(tmp_path / "policy_nvidia_h200.json", device="NVIDIA H200")
    assert dot_general_cls_for(256, 256, 256, device="NVIDIA H200") is Fp8DotGeneral
    with pytest.raises(P.MissingTableError, match=r"no calibration table for the GPU 'NVIDIA B200'.*"
                                                  r"`python -m fusedfp8 bench --calibrate` measures one"):
        dot_general_cls_for(256, 256, 256, device="NVIDIA B200")


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="checks the error where jax has no GPU")
def test_without_a_gpu_or_a_table(monkeypatch, tmp_path):
    monkeypatch.setattr(P, "DATA_DIR", tmp_path)
    with pytest.raises(P.MissingTableError, match="no CUDA device is visible here"):
        dot_general_cls_for(256, 256, 256)
    synthetic_table(tmp_path / "env.json")
    monkeypatch.setenv(P.TABLE_ENV, str(tmp_path / "env.json"))
    assert dot_general_cls_for(256, 256, 256) is Fp8DotGeneral


def test_bad_arguments(tmp_path):
    table = synthetic_table()
    with pytest.raises(TypeError, match=r"^options must be fields of Fp8DotGeneral \('recipe', 'impl', 'axis_name', "
                                        r"'forward_fast_accum'\); got \['features'\]"):
        dot_general_cls_for(256, 256, 256, table=table, features=3)
    with pytest.raises(TypeError,
                       match=r"^recipe must be a fusedfp8\.DelayedScaling or a fusedfp8\.CurrentScaling; got str"):
        dot_general_cls_for(256, 256, 256, table=table, recipe="hybrid")
    with pytest.raises(ValueError, match=r"^policy must be one of 'all', 'auto'; got None"):
        dot_general_cls_for(256, 256, 256, None, table=table)
    with pytest.raises(TypeError, match=r"^tokens must be a positive int; got float"):
        dot_general_cls_for(256.0, 256, 256, table=table)
    with pytest.raises(TypeError, match=r"^device must be a jax Device, a GPU's name or None; got int"):
        dot_general_cls_for(256, 256, 256, device=0)
    with pytest.raises(ValueError, match=r"^mode must be one of 'eager', 'graphed', 'compiled' \(how the model's "
                                         r"steps run: .*\); got 'jit'$"):
        dot_general_cls_for(256, 256, 256, mode="jit", table=table)
