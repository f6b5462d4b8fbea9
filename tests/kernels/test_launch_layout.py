"""The launch is written down once, in fusedfp8.launch; what the C++ shim and the CUDA sources hold of
it is read from their text here and held against Python (no GPU, no compiler):

- the buffer slots that torch_ops.cc fills, by name, in the order of plans.QUANTIZE_SLOTS /
  DEQUANTIZE_SLOTS; the attributes xla_ffi.cc's handler binds, which the JAX primitives pass
  (their slot order travels in the ``slots`` attribute);
- the plan format plan.h reads (its version, step and parameter kinds), which format.py writes;
- every parameter layout (plans.SIGNATURES) against the parameter list of its kernel in cuda_src;
- the tile geometry (plans: tile, blocks; numerics.layernorm: the layernorm row layout) against the
  constants and __launch_bounds__ of the .cu files.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusedfp8.launch import format as P
from fusedfp8.launch import kernels as K
from fusedfp8.launch import plans as PL
from fusedfp8.numerics import layernorm as ln

CSRC = Path(PL.__file__).resolve().parent.parent / "csrc"
# one module of each family: the parameter lists do not depend on the template arguments
MODULES = {"quantize": K.ModuleKey("quantize", "bfloat16", "e4m3", "dgelu_tanh"),
           "current_quantize": K.ModuleKey("current_quantize", "bfloat16", "e4m3", "identity"),
           "layernorm_quantize": K.ModuleKey("layernorm_quantize", "bfloat16", "e4m3", param="float32"),
           "block_quantize": K.ModuleKey("block_quantize", "bfloat16", "e5m2", "dgelu_tanh"),
           "dequantize": K.ModuleKey("dequantize", "float16", "e5m2"),
           "update_scales": K.ModuleKey("update_scales")}
# a parameter's struct character by its C++ type (pointers: 'P'); the aliases are common.cuh's typedefs
PARAM_CHAR = {"i64": "q", "long long": "q", "int64_t": "q", "int": "i", "float": "f"}


def cpp_name(slot: str) -> str:
    """The C++ enumerator of a slot name: 'scale_inv_used' -> 'kScaleInvUsed', 'q_t' -> 'kQT'."""
    return "k" + "".join(part.capitalize() for part in slot.split("_"))


def without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def enum_of(text: str, namespace: str) -> list:
    m = re.search(rf"namespace {namespace} {{\s*enum : size_t {{([^}}]*)}};", without_comments(text))
    assert m, f"no enum in namespace {namespace}"
    return [e.strip() for e in m.group(1).split(",") if e.strip()]


def kernel_params(source: str, kernel: str) -> tuple[str, list]:
    """(the __launch_bounds__ argument, the parameter declarations) of the __global__ ``kernel`` of a
    family's source."""
    text = without_comments(source)
    m = re.search(rf"__global__\s+void\s+__launch_bounds__\((\w+)(?:,[^)]*)?\)\s+{kernel}\s*\(", text)
    assert m, f"no __global__ {kernel} in the source"
    depth, at = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[at], 0)
        at += 1
    params = [" ".join(p.split()) for p in text[m.end():at - 1].split(",")]
    return m.group(1), params


def layout_of(params: list) -> str:
    out = "@"
    for decl in params:
        if "*" in decl:
            out += "P"
            continue
        ctype = " ".join(w for w in decl.split()[:-1] if w != "const")
        assert ctype in PARAM_CHAR, f"parameter {decl!r}: no struct character for {ctype!r}"
        out += PARAM_CHAR[ctype]
    return out


def define(text: str, name: str) -> int:
    m = re.search(rf"^#define {name} (\d+)\b", text, re.M)
    assert m, f"no #define {name}"
    return int(m.group(1))


# ---- the C++ shim ----------------------------------------------------------------------------------
def test_torch_ops_fill_the_slots_by_name_in_the_python_order():
    text = (CSRC / "torch_ops.cc").read_text()
    for namespace, slots in (("quantize_slot", PL.QUANTIZE_SLOTS), ("dequantize_slot", PL.DEQUANTIZE_SLOTS)):
        assert enum_of(text, namespace) == [cpp_name(s) for s in slots] + ["kCount"], namespace
    code = without_comments(text)
    quantize = code[code.index("std::vector<at::Tensor> quantize("):code.index("QArgs qargs_from_stack(")]
    filled = re.findall(r"^\s*bufs\[(k\w+)\] = ", quantize, re.M)  # (after `using namespace quantize_slot`)
    assert sorted(filled) == sorted(cpp_name(s) for s in PL.QUANTIZE_SLOTS) and len(set(filled)) == len(filled)
    dequantize = code[code.index("at::Tensor dequantize("):code.index("void cuda_kernel(")]
    filled = re.findall(r"^\s*bufs\[dequantize_slot::(k\w+)\] = ", dequantize, re.M)
    assert sorted(filled) == sorted(cpp_name(s) for s in PL.DEQUANTIZE_SLOTS)
    assert "kQuantizeSlots" not in code and not re.search(r"bufs\[\d", code)  # no count or index by hand


def test_buffers_by_name_take_the_slot_order():
    s = PL.QUANTIZE_SLOTS
    assert s.arrange({"amax": 8, "x": 1, "updates": 13}) == (1,) + (0,) * 7 + (8,) + (0,) * 3 + (13,)
    assert s.arrange({"q": ("out", 0)}, None)[s.q] == ("out", 0) and s.q == 2 and s.scale_inv_used == 11
    with pytest.raises(ValueError, match=r"\['amx'\] are no buffer slots of this plan"):
        s.arrange({"amx": 8})
    with pytest.raises(AttributeError, match="no buffer slot 'amx'"):
        s.amx
    with pytest.raises(ValueError, match="distinct names"):
        P.Slots("x", "count")  # a tuple's own attribute
    assert P.make_plan(("q", "out"), ()).slots.out == 1  # a plan's slots answer by name


def test_cpp_names_of_the_slots_are_distinct():
    for slots in (PL.QUANTIZE_SLOTS, PL.LAYERNORM_SLOTS, PL.BLOCK_SLOTS, PL.DEQUANTIZE_SLOTS, PL.UPDATE_SLOTS,
                  PL.META_UPDATE_SLOTS):
        assert len({cpp_name(s) for s in slots}) == len(slots)
    assert cpp_name("q_t") == "kQT" and cpp_name("scale_inv_used") == "kScaleInvUsed"


def test_the_xla_handler_binds_the_attributes_the_primitives_pass(monkeypatch):
    jax = pytest.importorskip("jax")
    from fusedfp8.jax import callbacks

    text = without_comments((CSRC / "xla_ffi.cc").read_text())
    binding = text[text.index("XLA_FFI_DEFINE_HANDLER_SYMBOL(ff8_xla_launch"):]
    binding = binding[:binding.index(";")]
    bound = re.findall(r'\.Attr<.*?>\("(\w+)"\)', binding)
    passed = {}

    def ffi_call(target, shapes, **kw):
        assert target == callbacks.TARGET
        return lambda *args, **attrs: passed.update(attrs) or []

    monkeypatch.setattr(jax.ffi, "ffi_call", ffi_call)
    sources = PL.DEQUANTIZE_SLOTS.arrange({"q": ("in", 0), "out": ("out", 0), "scale_inv": ("in", 1)}, None)
    callbacks.run("ffi", {}, [], (), sources, {})
    assert sorted(bound) == sorted(passed) == ["aliases", "names", "offsets", "plans", "slots"]
    assert passed["slots"].tolist() == [0, -2, 1]  # in 0, out 0 (-k - 2), in 1, in DEQUANTIZE_SLOTS order
    assert "const int64_t src = slots[i];" in text  # each slot's buffer: as the plan's slots attribute says


def test_plan_h_reads_the_format_that_python_writes():
    text = without_comments((CSRC / "plan.h").read_text())
    assert int(re.search(r"kPlanVersion = (\d+);", text).group(1)) == P.PLAN_VERSION

    def enum(names):
        m = re.search(r"enum : int64_t {\s*" + r"\s*,\s*".join(rf"{n} = (\d+)" for n in names) + r"\s*}", text)
        assert m, names
        return [int(v) for v in m.groups()]

    assert enum(["kMemset", "kLaunch", "kCoopLaunch"]) == [P.MEMSET, P.LAUNCH, P.COOP_LAUNCH]
    assert enum(["kI64", "kI32", "kF32", "kPtr", "kNull", "kFlag"]) == [P.I64, P.I32, P.F32, P.PTR, P.NULL, P.FLAG]


# ---- the kernels' parameter lists --------------------------------------------------------------------
@pytest.mark.parametrize("family", list(MODULES))
def test_every_signature_is_its_kernels_parameter_list(family):
    source = K.family_source(family)
    roles = K.name_expressions(MODULES[family])
    for role, expr in roles.items():
        _, params = kernel_params(source, expr.split("<")[0])
        assert layout_of(params) == PL.signature(role), (role, expr, params)
    assert {k for k in PL.SIGNATURES if any(r.startswith(k) for r in roles)}, family


def test_every_signature_serves_a_kernel():
    roles = [r for key in MODULES.values() for r in K.name_expressions(key)]
    assert all(any(r.startswith(k) for r in roles) for k in PL.SIGNATURES)


def test_a_changed_parameter_list_is_seen():
    source = K.family_source("dequantize")
    _, params = kernel_params(source, "dequantize_flat")
    assert layout_of(params) == "@PPPqi"
    _, params = kernel_params(source.replace("i64 n,", "int n,"), "dequantize_flat")
    assert layout_of(params) != PL.signature("dequant")


# ---- the tile geometry ---------------------------------------------------------------------------------
def test_the_tile_and_the_blocks_are_the_kernels():
    header = (K.source_dir() / "common.cuh").read_text()
    assert (define(header, "TILE_R"), define(header, "TILE_C")) == (PL.TILE_R, PL.TILE_C)
    # FF8_THREADS comes in as -D; the header's default is the same, so a compile without it agrees
    assert f"-DFF8_THREADS={PL.THREADS}" in K.COMPILE_OPTIONS and define(header, "FF8_THREADS") == PL.THREADS
    ln_source = (K.source_dir() / "layernorm_quantize.cu").read_text()
    assert define(ln_source, "LN_THREADS") == PL.LN_THREADS == ln.MAX_THREADS_PER_ROW
    assert (define(ln_source, "LN_CHUNK"), define(ln_source, "LN_CACHED")) == (ln.CHUNK, ln.CACHED_CHUNKS)
    value = {"FF8_THREADS": PL.THREADS, "LN_THREADS": PL.LN_THREADS}
    for family, key in MODULES.items():
        source = K.family_source(family)
        for role, expr in K.name_expressions(key).items():
            bounds, _ = kernel_params(source, expr.split("<")[0])
            block = value[bounds] if bounds in value else int(bounds)
            if family == "layernorm_quantize" and role != "transpose_tiled":
                assert block == PL.LN_THREADS, role  # the largest block layernorm_block gives
            else:
                assert block == PL.block_of(role), (role, bounds)


def test_the_workspaces_and_grids_follow_the_tile():
    assert PL.dbias_workspace(PL.TILE_R + 1, 3 * PL.TILE_C, 1) == ((2, 3 * PL.TILE_C), 3)
    assert PL.dbias_workspace(5, 7, 2 * PL.TILE_C) == ((1, 7), 2)  # tiles of the padded shape
    ref = PL.KernelRef(1, "k", "tiled", 1000, 1)
    assert PL._tiled_grid(ref, 1, 2 * PL.TILE_R, 3 * PL.TILE_C) == 6
    ref = PL.KernelRef(1, "k", "flat_vec1_store1", 1000, 1)
    assert PL._flat_grid(ref, 1, PL.FLAT_ELEMS * PL.THREADS * 5) == 5
    assert all(PL.layernorm_block(t, 16) <= PL.LN_THREADS for t in (32, 64, 128, 256, 512))
