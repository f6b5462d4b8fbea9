"""Every kernel family compiles with NVRTC for sm_90, for every template instantiation the
library can ask for; no GPU needed (cuda-bindings' NVRTC and the CUDA headers only)."""
import shutil
from collections import defaultdict

import pytest

from fusedfp8 import _cuda


def _nvrtc_ready():
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError as e:
        return False, f"cuda-bindings (NVRTC) is not installed: {e} (pip install 'fusedfp8[test]')"
    if not _cuda.cuda_include_dirs():
        return False, "no CUDA headers (cuda_fp8.h) found: install nvidia-cuda-runtime or set CUDA_PATH"
    return True, ""


nvrtc_ok, nvrtc_reason = _nvrtc_ready()
requires_nvrtc = pytest.mark.skipif(not nvrtc_ok, reason=nvrtc_reason)


def _groups() -> dict:
    """(family, dtype) -> every name expression of every module of that family and dtype: one NVRTC
    program per group keeps the test fast while still instantiating every template."""
    groups = defaultdict(list)
    for key in _cuda.all_module_keys():
        groups[(key.family, key.dtype)].extend(_cuda.name_expressions(key).values())
    return dict(groups)


GROUPS = _groups()


def _options():
    return tuple(_cuda.COMPILE_OPTIONS) + tuple(f"-I{d}" for d in _cuda.cuda_include_dirs())


@requires_nvrtc
@pytest.mark.parametrize("family, dtype", list(GROUPS), ids=[f"{f}-{d}" if d else f for f, d in GROUPS])
def test_family_compiles_for_sm90(family, dtype):
    from nvrtc_check import compile_for_sm90

    names = GROUPS[(family, dtype)]
    assert len(names) == len(set(names))
    ok, log = compile_for_sm90(_cuda.family_source(family), names, _options(), name=f"{family}.cu")
    assert ok, f"{family}.cu ({dtype}) failed to compile for sm_90:\n{log}"


def test_every_family_and_instantiation_is_listed():
    keys = _cuda.all_module_keys()
    assert {k.family for k in keys} == set(_cuda.families()) == {"quantize", "dequantize", "update_scales"}
    q = {(k.dtype, k.fmt, k.op) for k in keys if k.family == "quantize"}
    assert q == {(d, f, o) for d in _cuda.CPP_TYPES for f in _cuda.FMT_IDS for o in _cuda.OPS}
    dq = {(k.dtype, k.fmt) for k in keys if k.family == "dequantize"}
    assert dq == {(d, f) for d in _cuda.CPP_TYPES for f in _cuda.FMT_IDS}
    # every launch role the ops use is among the name expressions
    roles = _cuda.name_expressions(_cuda.ModuleKey("quantize", "bfloat16", "e4m3", "identity"))
    assert set(roles) == {"flat_vec1_store1", "flat_vec1_store0", "flat_vec0_store1", "flat_vec0_store0", "tiled"}


def test_name_expressions_reject_unknown_family():
    with pytest.raises(ValueError, match="unknown kernel family 'softmax'"):
        _cuda.name_expressions(_cuda.ModuleKey("softmax"))


@requires_nvrtc
@pytest.mark.parametrize("broken", [
    "\n__global__ void broken_kernel(float* p) { p[0] = undefined_symbol_xyz; }\n",
    "\n__global__ void broken_kernel(float* p) { p[0] = 1.0f }\n",
], ids=["undefined-symbol", "syntax"])
def test_broken_source_fails_with_a_log(broken):
    from nvrtc_check import compile_for_sm90

    ok, log = compile_for_sm90(_cuda.family_source("dequantize") + broken, ["broken_kernel"], _options(),
                               name="broken.cu")
    assert not ok
    assert log.strip() and "error" in log.lower()


@pytest.mark.parametrize("family", _cuda.families())
def test_family_source_inlines_the_header(family):
    src = _cuda.family_source(family)
    assert '#include "common.cuh"' not in src
    assert '#include "' not in src  # no local include left for CuPy's cache key to miss
    header = (_cuda.source_dir() / "common.cuh").read_text()
    body = [ln for ln in header.splitlines() if ln.strip() and not ln.startswith("#")]
    assert all(ln in src for ln in body[-20:])  # the header's text is in the source
    assert src.count("namespace ff8 {") == header.count("namespace ff8 {")  # inlined once


def test_family_source_follows_header_edits(tmp_path, monkeypatch):
    """CuPy keys its disk cache on the source text: an edited header must change that text."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(_cuda.source_dir(), copy)
    before = {f: _cuda.family_source(f) for f in _cuda.families()}
    with open(copy / "common.cuh", "a") as fh:
        fh.write("\n// edited: 5c1f0e\n")
    monkeypatch.setattr(_cuda, "source_dir", lambda: copy)
    for family, text in before.items():
        after = _cuda.family_source(family)
        assert after != text and "// edited: 5c1f0e" in after


@requires_nvrtc
@pytest.mark.parametrize("key", [_cuda.ModuleKey("quantize", "bfloat16", "e4m3", "dgelu_tanh"),
                                 _cuda.ModuleKey("dequantize", "float16", "e5m2"),
                                 _cuda.ModuleKey("update_scales")], ids=lambda k: k.family)
def test_launch_signatures_match_kernel_parameters(key):
    """The packed parameter buffer of every launch is exactly the kernel's parameter size (a
    mismatch makes the driver refuse every launch with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)."""
    import struct

    from nvrtc_check import kernel_param_sizes

    names = _cuda.name_expressions(key)
    options = _cuda.COMPILE_OPTIONS + tuple(f"-I{d}" for d in _cuda.cuda_include_dirs())
    sizes = kernel_param_sizes(_cuda.family_source(key.family), list(names.values()), options)
    for role, expr in names.items():
        sig = _cuda.SIGNATURES[next(k for k in _cuda.SIGNATURES if role.startswith(k))]
        assert sizes[expr] == struct.calcsize(sig), (role, expr, sizes[expr], sig)
