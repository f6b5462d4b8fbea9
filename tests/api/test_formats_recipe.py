"""The format table (formats.py), the DelayedScaling recipe (recipe.py) and the package's face
(fusedfp8/__init__.py)."""
import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import fusedfp8
from fusedfp8.formats import E4M3, E5M2, FORMATS, HYBRID, RECIPE_FORMATS, Format, get_format
from fusedfp8.recipe import DelayedScaling

ALLOWED_NAMES = ("'e4m3'", "'e5m2'", "'float8_e4m3fn'", "'float8_e5m2'")


# ---- the format table ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, mx, ebits, mbits, has_inf, dtype", [
    (E4M3, 448.0, 4, 3, False, ml_dtypes.float8_e4m3fn),
    (E5M2, 57344.0, 5, 2, True, ml_dtypes.float8_e5m2),
], ids=["e4m3", "e5m2"])
def test_format_table(fmt, mx, ebits, mbits, has_inf, dtype):
    assert fmt.max == mx
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.has_inf) == (ebits, mbits, has_inf)
    assert fmt.numpy_dtype == np.dtype(dtype)
    # The table agrees with ml_dtypes' own description of the encoding.
    fi = ml_dtypes.finfo(dtype)
    assert float(fi.max) == fmt.max
    assert fi.nmant == fmt.mantissa_bits
    # The canonical NaN byte decodes to NaN in that dtype.
    assert fmt.nan_bits == 0x7F
    assert np.isnan(np.array([fmt.nan_bits], np.uint8).view(dtype).astype(np.float32))[0]


def test_format_registry_and_hybrid_pairing():
    assert FORMATS == {"e4m3": E4M3, "e5m2": E5M2}
    assert HYBRID == (E4M3, E5M2)
    assert RECIPE_FORMATS["hybrid"] == (E4M3, E5M2)
    assert RECIPE_FORMATS["e4m3"] == (E4M3, E4M3)
    assert fusedfp8.E4M3 is E4M3 and fusedfp8.E5M2 is E5M2 and fusedfp8.Format is Format


def test_the_face_exports_formats_recipe_state_and_the_six_functions():
    """The top level is the face (LAYOUT.md): the pairings and the lookup live in fusedfp8.formats."""
    import fusedfp8.ops
    import fusedfp8.state
    import fusedfp8.types

    assert sorted(fusedfp8.__all__) == sorted(["E4M3", "E5M2", "Format", "DelayedScaling", "CurrentScaling",
                                               "ScalingState", "Slot", "Quantized", "LayerNormQuantized", "quantize", "gelu_quantize",
                                               "dgelu_quantize", "layernorm_quantize", "dequantize", "update_scales"])
    for name in ("quantize", "gelu_quantize", "dgelu_quantize", "layernorm_quantize", "dequantize", "update_scales"):
        assert getattr(fusedfp8, name) is getattr(fusedfp8.ops, name)
    assert fusedfp8.ScalingState is fusedfp8.state.ScalingState and fusedfp8.Slot is fusedfp8.state.Slot
    assert fusedfp8.Quantized is fusedfp8.types.Quantized and fusedfp8.DelayedScaling is DelayedScaling
    assert fusedfp8.LayerNormQuantized is fusedfp8.types.LayerNormQuantized
    assert fusedfp8.CurrentScaling is fusedfp8.recipe.CurrentScaling
    for gone in ("HYBRID", "FORMATS", "get_format", "slot"):
        assert not hasattr(fusedfp8, gone), gone


@pytest.mark.parametrize("name, expected", [
    ("e4m3", E4M3), ("e5m2", E5M2),
    ("float8_e4m3fn", E4M3), ("float8_e5m2", E5M2),
    ("E4M3", E4M3), ("E5M2", E5M2), ("FLOAT8_E5M2", E5M2),
], ids=["e4m3", "e5m2", "alias-e4m3fn", "alias-e5m2", "upper-e4m3", "upper-e5m2", "upper-alias"])
def test_get_format_names_and_aliases(name, expected):
    assert get_format(name) is expected


@pytest.mark.parametrize("fmt", [E4M3, E5M2, Format("custom", 1.0, 1, 1, False, "float8_e4m3fn", 0x7F)],
                         ids=["e4m3", "e5m2", "custom"])
def test_get_format_passes_a_format_through(fmt):
    assert get_format(fmt) is fmt


@pytest.mark.parametrize("bad", ["e3m4", "", "fp8", "float8_e4m3", "e4m3 ", 3, None, 4.48e2, np.float32],
                         ids=["e3m4", "empty", "fp8", "e4m3-no-fn", "trailing-space", "int", "None", "float",
                              "numpy-type"])
def test_get_format_unknown_lists_allowed_names(bad):
    with pytest.raises(ValueError) as ei:
        get_format(bad)
    msg = str(ei.value)
    assert msg.startswith("fmt:"), msg
    assert repr(bad) in msg
    for name in ALLOWED_NAMES:
        assert name in msg, (name, msg)


def test_get_format_error_names_the_caller_argument():
    with pytest.raises(ValueError, match=r"^out_fmt: unsupported FP8 format 'int8'"):
        get_format("int8", argname="out_fmt")


# ---- DelayedScaling --------------------------------------------------------------------------
def test_recipe_defaults():
    r = DelayedScaling()
    assert (r.margin, r.amax_history_len, r.amax_compute_algo, r.fp8_format, r.first_step) == (
        0, 1024, "max", "hybrid", "current")
    assert r.margin_factor == 1.0
    assert r == DelayedScaling() and hash(r) == hash(DelayedScaling())


@pytest.mark.parametrize("field, value", [
    ("margin", 1), ("amax_history_len", 16), ("amax_compute_algo", "most_recent"), ("fp8_format", "e4m3"),
    ("first_step", "unit"),
], ids=lambda v: str(v))
def test_recipe_is_frozen(field, value):
    r = DelayedScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(r, field, value)
    assert r == DelayedScaling()


@pytest.mark.parametrize("kwargs, exc, field", [
    (dict(margin=-1), ValueError, "margin"),
    (dict(margin=-1e-9), ValueError, "margin"),
    (dict(margin=math.inf), ValueError, "margin"),
    (dict(margin=math.nan), ValueError, "margin"),
    (dict(margin=True), TypeError, "margin"),
    (dict(margin="2"), TypeError, "margin"),
    (dict(margin=None), TypeError, "margin"),
    (dict(amax_history_len=0), ValueError, "amax_history_len"),
    (dict(amax_history_len=-4), ValueError, "amax_history_len"),
    (dict(amax_history_len=16.0), TypeError, "amax_history_len"),
    (dict(amax_history_len=True), TypeError, "amax_history_len"),
    (dict(amax_history_len="16"), TypeError, "amax_history_len"),
    (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
    (dict(amax_compute_algo="MAX"), ValueError, "amax_compute_algo"),
    (dict(amax_compute_algo=None), TypeError, "amax_compute_algo"),
    (dict(fp8_format="e5m2"), ValueError, "fp8_format"),
    (dict(fp8_format="fp8"), ValueError, "fp8_format"),
    (dict(fp8_format=E4M3), TypeError, "fp8_format"),
    (dict(first_step="zero"), ValueError, "first_step"),
    (dict(first_step=0), TypeError, "first_step"),
], ids=["margin-neg", "margin-tiny-neg", "margin-inf", "margin-nan", "margin-bool", "margin-str", "margin-None",
        "len-0", "len-neg", "len-float", "len-bool", "len-str", "algo-mean", "algo-upper", "algo-None",
        "format-e5m2", "format-fp8", "format-Format", "first-zero", "first-int"])
def test_recipe_rejects_bad_fields(kwargs, exc, field):
    with pytest.raises(exc, match=rf"DelayedScaling\.{field}\b"):
        DelayedScaling(**kwargs)


@pytest.mark.parametrize("field, bad, allowed", [
    ("amax_compute_algo", "mean", ("max", "most_recent")),
    ("fp8_format", "e5m2", ("hybrid", "e4m3")),
    ("first_step", "zero", ("current", "unit")),
], ids=["algo", "format", "first_step"])
def test_recipe_choice_error_lists_allowed_values(field, bad, allowed):
    with pytest.raises(ValueError) as ei:
        DelayedScaling(**{field: bad})
    msg = str(ei.value)
    assert repr(bad) in msg
    for a in allowed:
        assert repr(a) in msg, msg


@pytest.mark.parametrize("kwargs", [dict(margin=0), dict(margin=2), dict(margin=0.5), dict(amax_history_len=1),
                                    dict(amax_compute_algo="most_recent"), dict(fp8_format="e4m3"),
                                    dict(first_step="unit")],
                         ids=["margin0", "margin2", "margin-half", "len1", "most_recent", "e4m3", "unit"])
def test_recipe_accepts_good_fields(kwargs):
    r = DelayedScaling(**kwargs)
    for k, v in kwargs.items():
        assert getattr(r, k) == v


@pytest.mark.parametrize("margin, factor", [(0, 1.0), (2, 4.0), (0.5, 2 ** 0.5), (10, 1024.0)],
                         ids=["0", "2", "0.5", "10"])
def test_margin_factor(margin, factor):
    assert DelayedScaling(margin=margin).margin_factor == factor


@pytest.mark.parametrize("fp8_format, fwd, grad", [("hybrid", E4M3, E5M2), ("e4m3", E4M3, E4M3)],
                         ids=["hybrid", "e4m3"])
def test_format_for(fp8_format, fwd, grad):
    r = DelayedScaling(fp8_format=fp8_format)
    assert r.format_for(False) is fwd
    assert r.format_for(grad=True) is grad
