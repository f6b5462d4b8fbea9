"""Every kernel family compiles with NVRTC for sm_90, for every template instantiation the
library can ask for; no GPU needed (cuda-bindings' NVRTC and the CUDA headers only). Each
(family, dtype) group is one program compiled with the least optimization
(support.nvrtc.FAST_OPTIONS): the bfloat16 groups of quantize, current_quantize,
layernorm_quantize and block_quantize, dequantize and update_scales to sm_90 cubins (NVVM and
ptxas: every template and every FMT, OP and weight dtype, so every inline-asm string, goes through
ptxas), the float32 and float16 groups of those four families to compute_90 PTX only
(support.nvrtc.target_of; ptxas does not run on them). One module per family
(support.nvrtc.SIGNATURE_KEYS) is also compiled as the library compiles it, with full
optimization, to a cubin whose kernels' parameter sizes the launch signatures are checked
against. The compiles run in one process of their own (tests/run/nvrtc_compile.py): after an
NVRTC compile through cuda-bindings, torch 2.13 (CPU) cannot torch.load some tensors in the same
process, and the pytest process runs torch.save / torch.load round trips (tests/pytorch/). That
process runs beside the other tests (the 'nvrtc' background job)."""
import json
import shutil
import struct

import pytest

from fusedfp8.launch import kernels as K, plans as PL
from support import nvrtc as N  # (the lists only: it compiles nothing here)

GROUPS = N.groups()


def uses_the_compiles(test):
    """The test reads the verdicts of the NVRTC compiles (the 'nvrtc' background job, ~30 CPU-s)."""
    return pytest.mark.slow(pytest.mark.background("nvrtc")(test))


@pytest.fixture(scope="module")
def nvrtc(background):
    """The verdicts of tests/run/nvrtc_compile.py (run once, beside the other tests)."""
    verdicts = json.loads((background.result("nvrtc").check().out / "verdicts.json").read_text())
    if not verdicts["ready"]:
        pytest.skip(verdicts["reason"])
    return verdicts


@uses_the_compiles
@pytest.mark.parametrize("group", list(GROUPS))
def test_family_compiles_for_sm90(nvrtc, group):
    assert len(GROUPS[group]) == len(set(GROUPS[group])), f"{group}: a name expression is listed twice"
    v = nvrtc["group"][group]
    assert v["target"] == N.target_of(group), (group, v["target"])
    assert v["ok"], f"{group} failed to compile for {v['target']}:\n{v['log']}"
    assert "warning" not in v["log"].lower(), f"{group} compiles with warnings:\n{v['log']}"


def test_the_cubin_groups_put_every_template_and_argument_through_ptxas():
    """The groups compiled to PTX only are the float32 and float16 groups of the three quantize
    families; the cubin groups still hold every template, every FMT, OP and weight dtype, and the
    kernels whose parameter sizes are read from a cubin."""
    ptx_only = {g for g in GROUPS if N.target_of(g) == N.PTX}
    assert ptx_only == {f"{f}-{d}" for f in ("quantize", "current_quantize", "layernorm_quantize", "block_quantize")
                        for d in ("float32", "float16")}
    # block_quantize's cubin group holds every FMT, block shape, op, the identity's dbias and the LayerNorm's
    # parameter dtypes
    assert N.target_of("block_quantize-bfloat16") == N.CUBIN
    assert {e.split(",", 1)[1] for e in GROUPS["block_quantize-bfloat16"]} == {
        f" {f}, {tail}>" for f in K.FMT_IDS.values()
        for tail in ("false", "true", "false, 0, true", *(f"false, {o}" for o in range(1, 5)),
                     *(f"false, 0, false, {p}, true" for p in K.CPP_TYPES.values()))}
    assert {N.target_of(N.group_of(k)) for k in N.SIGNATURE_KEYS.values()} == {N.CUBIN}
    keys = K.all_module_keys()
    in_cubin = [k for k in keys if N.target_of(N.group_of(k)) == N.CUBIN]
    for family in K.families():
        assert ({k._replace(dtype="") for k in keys if k.family == family}
                == {k._replace(dtype="") for k in in_cubin if k.family == family}), family

    def templates(ks):
        return {e.split("<")[0] for k in ks for e in K.name_expressions(k).values()}

    assert templates(in_cubin) == templates(keys)


@uses_the_compiles
def test_the_check_compiled_every_group(nvrtc):
    assert set(nvrtc["group"]) == set(GROUPS) and len(GROUPS) == 16
    # every instantiation of every module; a kernel without template parameters (transpose_fp8, held by
    # every layernorm_quantize module) once per group
    assert sum(len(names) for names in GROUPS.values()) == len(
        {(N.group_of(k), e) for k in K.all_module_keys() for e in K.name_expressions(k).values()})


def test_every_family_and_instantiation_is_listed():
    keys = K.all_module_keys()
    assert {k.family for k in keys} == set(K.families()) == {
        "quantize", "current_quantize", "layernorm_quantize", "block_quantize", "dequantize", "update_scales"}
    bq = [k for k in keys if k.family == "block_quantize"]
    # the identity: both block shapes and the 1x128 one with dbias; every other op: 1x128 (dgelu's with dbias)
    assert {tuple(e[len("block_quantize<"):-1].split(", ")) for k in bq for e in K.name_expressions(k).values()} == {
        (t, str(f), *tail) for t in K.CPP_TYPES.values() for f in K.FMT_IDS.values()
        for tail in (("false",), ("true",), ("false", "0", "true"), *(("false", str(o)) for o in range(1, 5)),
                     *(("false", "0", "false", p, "true") for p in K.CPP_TYPES.values()))}
    assert {(k.dtype, k.fmt, k.op) for k in bq} == {(d, f, o) for d in K.CPP_TYPES for f in K.FMT_IDS for o in K.OPS}
    assert K.name_expressions(K.ModuleKey("block_quantize", "bfloat16", "e5m2", "identity")) == {
        "block_1x128": "block_quantize<__nv_bfloat16, 1, false>",
        "block_128x128": "block_quantize<__nv_bfloat16, 1, true>",
        "block_1x128_dbias": "block_quantize<__nv_bfloat16, 1, false, 0, true>",
        "block_1x128_ln_float32": "block_quantize<__nv_bfloat16, 1, false, 0, false, float, true>",
        "block_1x128_ln_float16": "block_quantize<__nv_bfloat16, 1, false, 0, false, __half, true>",
        "block_1x128_ln_bfloat16": "block_quantize<__nv_bfloat16, 1, false, 0, false, __nv_bfloat16, true>"}
    assert K.name_expressions(K.ModuleKey("block_quantize", "float16", "e4m3", "dgelu_erf")) == {
        "block_1x128": "block_quantize<__half, 0, false, 4>"}
    identity = next(k for k in bq if k.op == "identity")
    assert {PL.block_role(b) for b in ((1, 128), (128, 128))} | {PL.block_role((1, 128), True)} | {
        PL.block_layernorm_role(p) for p in K.CPP_TYPES} == set(K.name_expressions(identity))
    for family in ("quantize", "current_quantize"):
        q = {(k.dtype, k.fmt, k.op) for k in keys if k.family == family}
        assert q == {(d, f, o) for d in K.CPP_TYPES for f in K.FMT_IDS for o in K.OPS}
    ln = {(k.dtype, k.fmt, k.param) for k in keys if k.family == "layernorm_quantize"}
    assert ln == {(d, f, p) for d in K.CPP_TYPES for f in K.FMT_IDS for p in K.CPP_TYPES}
    dq = {(k.dtype, k.fmt) for k in keys if k.family == "dequantize"}
    assert dq == {(d, f) for d in K.CPP_TYPES for f in K.FMT_IDS}
    # every launch role the launch interface uses is among the name expressions
    roles = K.name_expressions(K.ModuleKey("quantize", "bfloat16", "e4m3", "identity"))
    assert set(roles) == {"flat_vec1_store1", "flat_vec1_store0", "flat_vec0_store1", "flat_vec0_store0", "tiled",
                          "tiled_dbias"}
    assert roles["tiled_dbias"] == "quantize_tiled<__nv_bfloat16, 0, 0, StagedAmax, true>"
    roles = K.name_expressions(K.ModuleKey("current_quantize", "bfloat16", "e4m3", "identity"))
    assert roles == {"coop_flat_vec1": "quantize_flat<__nv_bfloat16, 0, 0, true, true, GridAmax>",
                     "coop_flat_vec0": "quantize_flat<__nv_bfloat16, 0, 0, false, true, GridAmax>",
                     "coop_tiled": "quantize_tiled<__nv_bfloat16, 0, 0, GridAmax>",
                     "coop_tiled_dbias": "quantize_tiled<__nv_bfloat16, 0, 0, GridAmax, true>"}
    roles = K.name_expressions(K.ModuleKey("layernorm_quantize", "bfloat16", "e4m3", param="float32"))
    assert set(roles) == {"layernorm_store1", "layernorm_store1_t", "layernorm_store0", "padded_layernorm_store1",
                          "padded_layernorm_store1_t", "transpose_tiled", "layernorm_stats"}
    assert roles["layernorm_stats"] == "layernorm_quantize<__nv_bfloat16, float, 0, false, false, true>"


def test_name_expressions_reject_unknown_family():
    with pytest.raises(ValueError, match="unknown kernel family 'softmax'"):
        K.name_expressions(K.ModuleKey("softmax"))


@uses_the_compiles
@pytest.mark.parametrize("broken", list(N.BROKEN))
def test_broken_source_fails_with_a_log(nvrtc, broken):
    v = nvrtc["broken"][broken]
    assert not v["ok"]
    assert v["log"].strip() and "error" in v["log"].lower()


@pytest.mark.parametrize("family", K.families())
def test_family_source_inlines_the_header(family):
    src = K.family_source(family)
    assert '#include "common.cuh"' not in src
    assert '#include "' not in src  # no local include left for CuPy's cache key to miss
    header = (K.source_dir() / "common.cuh").read_text()
    body = [ln for ln in header.splitlines() if ln.strip() and not ln.startswith("#")]
    assert all(ln in src for ln in body[-20:])  # the header's text is in the source
    assert src.count("namespace ff8 {") == header.count("namespace ff8 {")  # inlined once


def test_family_source_follows_header_edits(tmp_path, monkeypatch):
    """CuPy keys its disk cache on the source text: an edited header must change that text."""
    copy = tmp_path / "cuda_src"
    shutil.copytree(K.source_dir(), copy)
    before = {f: K.family_source(f) for f in K.families()}
    with open(copy / "common.cuh", "a") as fh:
        fh.write("\n// edited: 5c1f0e\n")
    monkeypatch.setattr(K, "source_dir", lambda: copy)
    for family, text in before.items():
        after = K.family_source(family)
        assert after != text and "// edited: 5c1f0e" in after


@uses_the_compiles
@pytest.mark.parametrize("family", list(N.SIGNATURE_KEYS))
def test_one_module_per_family_compiles_with_full_optimization(nvrtc, family):
    v = nvrtc["signature"][family]
    assert v["target"] == N.CUBIN
    assert v["ok"], f"{family} ({N.SIGNATURE_KEYS[family]}) failed to compile with full optimization:\n{v['log']}"
    assert "warning" not in v["log"].lower(), f"{family} compiles with warnings:\n{v['log']}"


@uses_the_compiles
@pytest.mark.parametrize("family", list(N.SIGNATURE_KEYS))
def test_launch_signatures_match_kernel_parameters(nvrtc, family):
    """The packed parameter buffer of every launch is exactly the kernel's parameter size (a
    mismatch makes the driver refuse every launch with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)."""
    sizes = nvrtc["sizes"][family]
    names = K.name_expressions(N.SIGNATURE_KEYS[family])
    assert set(sizes) == set(names.values())
    for role, expr in names.items():
        sig = PL.SIGNATURES[next(k for k in PL.SIGNATURES if role.startswith(k))]
        assert sizes[expr] == struct.calcsize(sig), (role, expr, sizes[expr], sig)
