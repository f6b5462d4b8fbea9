"""The format table (formats.py), the recipes (recipe.py: DelayedScaling, BlockScaling) and the
package's face (fusedfp8/__init__.py)."""
import dataclasses
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import fusedfp8
from fusedfp8.formats import E4M3, E5M2, FORMATS, HYBRID, RECIPE_FORMATS, Format, get_format
from fusedfp8.recipe import BlockScaling, CurrentScaling, DelayedScaling
from fusedfp8.types import check_recipe
from support.frameworks import bytes_of, to_fw

ALLOWED_NAMES = ("'e4m3'", "'e5m2'", "'e4m3fn'", "'float8_e4m3fn'", "'float8_e5m2'")

# every spelling of a format a user may hold: the names in any case, ml_dtypes' suffix, and the
# dtype objects of numpy / ml_dtypes, torch and jax.numpy (jnp.dtype(...) is a numpy dtype)
SPELLINGS = {
    "e4m3": ["e4m3", "E4M3", "e4m3fn", "E4M3FN", "float8_e4m3fn", "Float8_E4M3FN", ml_dtypes.float8_e4m3fn,
             np.dtype(ml_dtypes.float8_e4m3fn), torch.float8_e4m3fn, jnp.float8_e4m3fn, E4M3],
    "e5m2": ["e5m2", "E5M2", "float8_e5m2", "FLOAT8_E5M2", ml_dtypes.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2),
             torch.float8_e5m2, jnp.float8_e5m2, E5M2],
}
SPELLING_CASES = [(name, s) for name, spellings in SPELLINGS.items() for s in spellings]


def _label(s) -> str:
    if isinstance(s, Format):
        return f"Format-{s.name}"
    if isinstance(s, type):
        return f"{s.__module__.split('.')[0]}.{s.__name__}"
    return f"np.dtype-{s.name}" if isinstance(s, np.dtype) else str(s)


SPELLING_IDS = [f"{name}-{_label(s)}" for name, s in SPELLING_CASES]
# near misses: other FP8 encodings of ml_dtypes / torch (not ours), non-FP8 dtypes, the wrong type
NOT_FORMATS = ["float8_e4m3", ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3fnuz, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz, jnp.float8_e4m3b11fnuz, torch.float32, jnp.bfloat16, np.dtype(np.uint8),
               torch.zeros(1, dtype=torch.float8_e4m3fn)]
NOT_FORMAT_IDS = ["str-e4m3-ieee", "ml_dtypes-e4m3-ieee", "ml_dtypes-e4m3fnuz", "torch-e4m3fnuz", "torch-e5m2fnuz",
                  "jnp-e4m3b11fnuz", "torch-float32", "jnp-bfloat16", "numpy-uint8", "a-torch-tensor"]


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


def test_the_face_exports_formats_recipe_state_and_the_functions():
    """The top level is the face (LAYOUT.md): the pairings and the lookup live in fusedfp8.formats."""
    import fusedfp8.ops
    import fusedfp8.state
    import fusedfp8.types

    assert sorted(fusedfp8.__all__) == sorted([
        "E4M3", "E5M2", "Format", "DelayedScaling", "CurrentScaling", "BlockScaling", "ScalingState", "Slot", "Quantized",
        "LayerNormQuantized", "quantize", "gelu_quantize", "dgelu_quantize", "layernorm_quantize", "dequantize",
        "update_scales", "block_quantize", "block_gelu_quantize", "block_dgelu_quantize",
        "block_layernorm_quantize"])
    for name in ("quantize", "gelu_quantize", "dgelu_quantize", "layernorm_quantize", "dequantize", "update_scales"):
        assert getattr(fusedfp8, name) is getattr(fusedfp8.ops, name)
    assert fusedfp8.ScalingState is fusedfp8.state.ScalingState and fusedfp8.Slot is fusedfp8.state.Slot
    assert fusedfp8.Quantized is fusedfp8.types.Quantized and fusedfp8.DelayedScaling is DelayedScaling
    assert fusedfp8.LayerNormQuantized is fusedfp8.types.LayerNormQuantized
    assert fusedfp8.CurrentScaling is fusedfp8.recipe.CurrentScaling
    assert fusedfp8.BlockScaling is fusedfp8.recipe.BlockScaling
    assert fusedfp8.block_quantize is fusedfp8.block.block_quantize
    for gone in ("HYBRID", "FORMATS", "get_format", "slot"):
        assert not hasattr(fusedfp8, gone), gone


@pytest.mark.parametrize("name, expected", [
    ("e4m3", E4M3), ("e5m2", E5M2),
    ("float8_e4m3fn", E4M3), ("float8_e5m2", E5M2),
    ("E4M3", E4M3), ("E5M2", E5M2), ("FLOAT8_E5M2", E5M2),
], ids=["e4m3", "e5m2", "alias-e4m3fn", "alias-e5m2", "upper-e4m3", "upper-e5m2", "upper-alias"])
def test_get_format_names_and_aliases(name, expected):
    assert get_format(name) is expected


@pytest.mark.parametrize("name, spelling", SPELLING_CASES, ids=SPELLING_IDS)
def test_get_format_takes_every_spelling(name, spelling):
    assert get_format(spelling) is FORMATS[name]


@pytest.mark.parametrize("bad", NOT_FORMATS, ids=NOT_FORMAT_IDS)
def test_get_format_refuses_other_encodings_and_dtypes_by_name(bad):
    with pytest.raises(ValueError) as ei:
        get_format(bad, argname="fmt")
    msg = str(ei.value)
    assert msg.startswith(f"fmt: unsupported FP8 format {bad!r}; expected one of "), msg
    for name in ALLOWED_NAMES:
        assert name in msg, (name, msg)


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
    (dict(fp8_format=torch.float32), TypeError, "fp8_format"),
    (dict(first_step="zero"), ValueError, "first_step"),
    (dict(first_step=0), TypeError, "first_step"),
], ids=["margin-neg", "margin-tiny-neg", "margin-inf", "margin-nan", "margin-bool", "margin-str", "margin-None",
        "len-0", "len-neg", "len-float", "len-bool", "len-str", "algo-mean", "algo-upper", "algo-None",
        "format-e5m2", "format-fp8", "format-torch-float32", "first-zero", "first-int"])
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


@pytest.mark.parametrize("Recipe", [DelayedScaling, CurrentScaling], ids=["delayed", "current"])
@pytest.mark.parametrize("spelling", ["HYBRID", "Hybrid", *SPELLINGS["e4m3"]],
                         ids=["HYBRID", "Hybrid", *(i for i in SPELLING_IDS if i.startswith("e4m3"))])
def test_recipe_format_takes_every_spelling_and_keeps_the_canonical_name(Recipe, spelling):
    """fp8_format takes 'hybrid' in any case and 'e4m3' in every spelling fmt takes; the field holds
    the canonical name, so the recipe equals (and hashes as, for jit's static arguments) the canonical one."""
    canonical = "hybrid" if isinstance(spelling, str) and spelling.lower() == "hybrid" else "e4m3"
    r = Recipe(fp8_format=spelling)
    assert r.fp8_format == canonical
    assert r == Recipe(fp8_format=canonical) and hash(r) == hash(Recipe(fp8_format=canonical))
    assert r.format_for(grad=True) is (E5M2 if canonical == "hybrid" else E4M3)


@pytest.mark.parametrize("Recipe", [DelayedScaling, CurrentScaling], ids=["delayed", "current"])
@pytest.mark.parametrize("spelling", SPELLINGS["e5m2"], ids=[i for i in SPELLING_IDS if i.startswith("e5m2")])
def test_recipe_format_refuses_e5m2_in_every_spelling_and_says_why(Recipe, spelling):
    with pytest.raises(ValueError, match=rf"^{Recipe.__name__}\.fp8_format must be one of \('hybrid', 'e4m3'\); got "
                                         r".*; E5M2 for every tensor is no recipe \('hybrid' takes it for the gradients\)$"):
        Recipe(fp8_format=spelling)


# ---- BlockScaling ----------------------------------------------------------------------------
def test_block_recipe_defaults_and_fields():
    r = BlockScaling()
    assert [f.name for f in dataclasses.fields(r)] == ["block", "weight_block", "fp8_format", "power_of_two_scales"]
    assert (r.block, r.weight_block, r.fp8_format, r.power_of_two_scales) == ((1, 128), (128, 128), "e4m3", True)
    assert r.format_for(False) is E4M3 and r.format_for(grad=True) is E4M3
    assert BlockScaling(fp8_format="hybrid").format_for(grad=True) is E5M2
    assert r.block_for(weight=True) == (128, 128) and r.block_for(weight=False) == (1, 128)
    assert r == BlockScaling() and hash(r) == hash(BlockScaling())
    assert not hasattr(r, "margin") and not hasattr(r, "amax_history_len")  # no state to derive
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.power_of_two_scales = False


@pytest.mark.parametrize("kwargs, canonical", [
    (dict(block=[1, 128]), dict(block=(1, 128))),
    (dict(block=(np.int64(1), np.int32(128))), dict()),
    (dict(weight_block=[1, 128]), dict(weight_block=(1, 128))),
    (dict(fp8_format="HYBRID"), dict(fp8_format="hybrid")),
    (dict(fp8_format=torch.float8_e4m3fn), dict(fp8_format="e4m3")),
    (dict(power_of_two_scales=np.bool_(False)), dict(power_of_two_scales=False)),
], ids=["block-list", "block-numpy-ints", "weight-rows", "format-upper", "format-dtype", "pow2-numpy-bool"])
def test_block_recipe_keeps_canonical_fields(kwargs, canonical):
    """Every accepted spelling is stored canonically (tuples of ints, the format's name, a bool), so
    the recipe equals and hashes as the canonical one (jit's static arguments)."""
    r = BlockScaling(**kwargs)
    want = BlockScaling(**canonical)
    assert r == want and hash(r) == hash(want)
    assert type(r.block[0]) is int and type(r.power_of_two_scales) is bool


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(block=(128, 128)), ValueError,
     r"^BlockScaling\.block must be \(1, 128\); got \(128, 128\); cuBLASLt's block-scaled FP8 GEMM takes 1x128"),
    (dict(block=(1, 64)), ValueError, r"^BlockScaling\.block must be \(1, 128\); got \(1, 64\)"),
    (dict(block=128), TypeError, r"^BlockScaling\.block must be a pair of ints, \(1, 128\); got 128$"),
    (dict(block="1x128"), TypeError, r"^BlockScaling\.block must be a pair of ints, \(1, 128\); got '1x128'$"),
    (dict(block=(1, 128.0)), TypeError, r"^BlockScaling\.block must be a pair of ints"),
    (dict(block=(True, 128)), TypeError, r"^BlockScaling\.block must be a pair of ints"),
    (dict(block=(1, 128, 1)), TypeError, r"^BlockScaling\.block must be a pair of ints"),
    (dict(weight_block=(64, 64)), ValueError,
     r"^BlockScaling\.weight_block must be \(128, 128\) or \(1, 128\); got \(64, 64\)"),
    (dict(weight_block=(128, 1)), ValueError, r"^BlockScaling\.weight_block must be \(128, 128\) or \(1, 128\)"),
    (dict(weight_block=None), TypeError, r"^BlockScaling\.weight_block must be a pair of ints, \(128, 128\) or "
                                         r"\(1, 128\); got None$"),
    (dict(fp8_format="e5m2"), ValueError, r"^BlockScaling\.fp8_format must be one of \('hybrid', 'e4m3'\); got "
                                          r"'e5m2'; E5M2 for every tensor is no recipe"),
    (dict(fp8_format=3), TypeError, r"^BlockScaling\.fp8_format must be a str, one of \('hybrid', 'e4m3'\); got int"),
    (dict(power_of_two_scales=1), TypeError, r"^BlockScaling\.power_of_two_scales must be a bool; got int 1$"),
    (dict(power_of_two_scales="yes"), TypeError, r"^BlockScaling\.power_of_two_scales must be a bool; got str"),
    (dict(margin=1), TypeError, r"margin"),
], ids=["block-2d", "block-64", "block-int", "block-str", "block-float", "block-bool", "block-three",
        "weight-64", "weight-column", "weight-None", "format-e5m2", "format-int", "pow2-int", "pow2-str",
        "no-margin-field"])
def test_block_recipe_refuses_bad_fields_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        BlockScaling(**kwargs)


def test_check_recipe_takes_a_block_recipe_only_where_asked():
    """The core accepts a BlockScaling where the caller says it can take one (block=True); every
    per-tensor path (the default) refuses it by name, and a non-recipe is refused either way."""
    r = BlockScaling()
    assert check_recipe(r, block=True) is r
    assert check_recipe(DelayedScaling(), block=True) == DelayedScaling()
    with pytest.raises(TypeError, match=r"^layer\.recipe: a fusedfp8\.BlockScaling is not accepted here, which takes "
                                        r"a per-tensor recipe \(fusedfp8\.DelayedScaling or fusedfp8\.CurrentScaling"):
        check_recipe(r, "layer.recipe")
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.DelayedScaling, a fusedfp8\.CurrentScaling or a "
                                        r"fusedfp8\.BlockScaling; got type$"):
        check_recipe(BlockScaling, block=True)
    with pytest.raises(TypeError, match=r"^recipe must be a fusedfp8\.DelayedScaling or a fusedfp8\.CurrentScaling; "
                                        r"got str$"):
        check_recipe("block")


def test_every_per_tensor_entry_point_refuses_a_block_recipe_by_name():
    """The state and the update refuse a BlockScaling with the message that names it, before they
    read a field it does not have; the JAX functions that take it (the fused MLP, the weight
    cache: test_jax_block_dot.py) refuse a meta with it by name, as the layers do."""
    from fusedfp8.jax import functional as jf, meta as jmeta

    r = BlockScaling()
    state = fusedfp8.ScalingState.create(3, DelayedScaling(amax_history_len=4))
    meta = jmeta.fresh_meta(DelayedScaling(amax_history_len=4))
    x, w = jnp.ones((16, 32), jnp.float32), jnp.ones((32, 32), jnp.float32)
    calls = {
        "ScalingState.create": lambda: fusedfp8.ScalingState.create(2, r),
        "update_scales": lambda: fusedfp8.update_scales(state, r),
        "slot": lambda: state.slot(0, r),
        "fresh_meta": lambda: jmeta.fresh_meta(r),
    }
    before = {f: a.copy() for f, a in state.arrays().items()}
    for name, call in calls.items():
        with pytest.raises(TypeError, match=r"recipe: a fusedfp8\.BlockScaling is not accepted here"):
            call()
    with pytest.raises(ValueError, match=r"^meta must be None under BlockScaling \(no state"):
        jf.quantize_weight(w, meta, r)
    with pytest.raises(ValueError, match=r"^meta1 must be None under BlockScaling \(no state"):
        jf.fp8_mlp(x, w, jnp.zeros(32), w, jnp.zeros(32), meta, meta, r)
    assert all(np.array_equal(a, before[f]) for f, a in state.arrays().items())


# ---- every spelling through the entry points ---------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_reaches_every_entry_point(name, device):
    """quantize, gelu_quantize, dgelu_quantize, layernorm_quantize (scale given or a recipe's slot)
    and dequantize take each spelling of a format and give the bytes and the dtype of its name,
    which differ from the other format's; a spelling of the other format is refused by name."""
    other = "e5m2" if name == "e4m3" else "e4m3"
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal((8, 32)) * 40).astype(np.float32)
    for fw in (("numpy", "torch", "jax") if device == "cpu" else ("torch",)):
        x, dy = to_fw(x_np, fw, device), to_fw(x_np[::-1] * 3, fw, device)
        w, b = to_fw(np.linspace(0.5, 2, 32, dtype=np.float32), fw, device), to_fw(np.full(32, 0.25, np.float32), fw, device)
        scale_inv = to_fw(np.array([2.0], np.float32), fw, device)
        calls = {
            "quantize": lambda f: fusedfp8.quantize(x, 0.5, f).data,
            "gelu_quantize": lambda f: fusedfp8.gelu_quantize(x, 0.5, f).data,
            "dgelu_quantize": lambda f: fusedfp8.dgelu_quantize(dy, x, 0.5, f).data,
            "layernorm_quantize": lambda f: fusedfp8.layernorm_quantize(x, w, b, 1e-5, 0.5, f).quantized.data,
        }
        want = {k: call(name) for k, call in calls.items()}
        for k, call in calls.items():
            assert bytes_of(call(other)) != bytes_of(want[k]), (fw, k)  # the spelling decides something
        q = want["quantize"]
        deq = bytes_of(fusedfp8.dequantize(q, scale_inv))
        for spelling in SPELLINGS[name]:
            for k, call in calls.items():
                got = call(spelling)
                assert got.dtype == want[k].dtype and bytes_of(got) == bytes_of(want[k]), (fw, k, spelling)
            assert bytes_of(fusedfp8.dequantize(q, scale_inv, "float32", spelling)) == deq, (fw, spelling)
        for spelling in SPELLINGS[other]:
            with pytest.raises(ValueError, match=rf"^fmt: '{other}' disagrees with q's dtype"):
                fusedfp8.dequantize(q, scale_inv, "float32", spelling)
        if fw != "jax":  # (jax arrays are not written in place: no slot outside jit)
            recipe = DelayedScaling(amax_history_len=4, fp8_format="e4m3")
            like = torch.zeros(0, device=device) if fw == "torch" else None
            state = fusedfp8.ScalingState.create(2, recipe, like=like)
            for spelling in SPELLINGS["e4m3"]:
                fusedfp8.quantize(x, state.slot(0, recipe), spelling)
            with pytest.raises(ValueError, match=r"^fmt: 'e5m2' disagrees with the slot's recipe format 'e4m3'"):
                fusedfp8.quantize(x, state.slot(0, recipe), torch.float8_e5m2)
