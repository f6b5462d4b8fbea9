"""Compile CUDA source for sm_90 with NVRTC through cuda-bindings: no GPU needed.

Two kinds of compile check every kernel the library can ask for:

- the compile groups (:func:`groups`): one NVRTC program per (family, dtype) holding every
  template instantiation of that family and dtype, compiled with NVVM's and ptxas's
  optimizations reduced to the least (:data:`FAST_OPTIONS`) to one of two targets
  (:func:`target_of`): ``sm_90``, a cubin (NVVM, then ptxas), for the bfloat16 groups of
  quantize, current_quantize, layernorm_quantize and block_quantize (between them every template,
  and every FMT, OP, block shape and layernorm weight dtype, so every inline-asm string goes
  through ptxas) and for dequantize and update_scales; ``compute_90``, PTX only (ptxas does not
  run), for the float32 and float16 groups of those four families. The C++ front end and NVVM's
  code generation run for every instantiation, and every kernel must be an entry of the PTX;
- the signature modules (:data:`SIGNATURE_KEYS`): one module per family, compiled as the library
  compiles it (its options, NVVM's and ptxas's full optimization) to an sm_90 cubin, from which
  the parameter sizes the launch signatures are checked against are read.

So NVVM's optimizing passes and ptxas's allocation of optimized code run on one module per family
here (every module on the GPU, where the library compiles them). Measured on a 2-core CPU
machine: the bfloat16 layernorm_quantize group alone took 56 CPU-s with full optimization and 5
with ``--Ofast-compile=max``; the whole check ~30 CPU-s instead of ~95.

The compiles run only in tests/run/nvrtc_compile.py, a process of its own: torch 2.13 (CPU)
fails to torch.load some tensors in a process that has compiled an NVRTC program through
cuda-bindings. Importing this module imports no cuda-bindings (the tests read the lists).
"""
from __future__ import annotations

import struct
from collections import defaultdict

from fusedfp8.launch import kernels as K

BROKEN = {  # sources that must fail, with a log
    "undefined-symbol": "\n__global__ void broken_kernel(float* p) { p[0] = undefined_symbol_xyz; }\n",
    "syntax": "\n__global__ void broken_kernel(float* p) { p[0] = 1.0f }\n",
}
# one module per family whose kernels' parameter sizes the launch signatures are checked against
SIGNATURE_KEYS = {"quantize": K.ModuleKey("quantize", "bfloat16", "e4m3", "dgelu_tanh"),
                  "current_quantize": K.ModuleKey("current_quantize", "bfloat16", "e4m3", "dgelu_tanh"),
                  "layernorm_quantize": K.ModuleKey("layernorm_quantize", "bfloat16", "e4m3", param="float32"),
                  "block_quantize": K.ModuleKey("block_quantize", "bfloat16", "e4m3", "identity"),
                  "dequantize": K.ModuleKey("dequantize", "float16", "e5m2"),
                  "update_scales": K.ModuleKey("update_scales")}


CUBIN, PTX = "sm_90", "compute_90"
PTX_ONLY_DTYPES = ("float32", "float16")  # of the families below
PTX_ONLY_FAMILIES = ("quantize", "current_quantize", "layernorm_quantize", "block_quantize")
FAST_OPTIONS = ("--Ofast-compile=max",)  # added to a compile group's compile (see the module's docstring)
def target_of(group: str) -> str:
    """What ``group`` is compiled to: :data:`CUBIN` (``-arch=sm_90``) or :data:`PTX`
    (``-arch=compute_90``, PTX only); see the module's docstring."""
    family, _, dtype = group.partition("-")
    return PTX if family in PTX_ONLY_FAMILIES and dtype in PTX_ONLY_DTYPES else CUBIN


def group_of(key: K.ModuleKey) -> str:
    """The compile group ('family-dtype', or the family) that instantiates ``key``'s kernels."""
    return f"{key.family}-{key.dtype}" if key.dtype else key.family


def groups() -> dict:
    """'family-dtype' -> every name expression of every module of that family and dtype: one
    NVRTC program per group keeps the check fast while still instantiating every template. A kernel
    that every module of a family holds alike (layernorm_quantize's transpose_fp8, no template
    parameter) is listed once."""
    out = defaultdict(list)
    for key in K.all_module_keys():
        group = out[group_of(key)]
        group.extend(e for e in K.name_expressions(key).values() if "<" in e or e not in group)
    return dict(out)


def options() -> tuple:
    """The library's compile options, minus CuPy's additions."""
    return tuple(K.COMPILE_OPTIONS) + tuple(f"-I{d}" for d in K.cuda_include_dirs())


def ready() -> tuple[bool, str]:
    """(ok, reason): cuda-bindings' NVRTC and the CUDA headers are there."""
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError as e:
        return False, f"cuda-bindings (NVRTC) is not installed: {e} (pip install 'fusedfp8[test]')"
    if not K.cuda_include_dirs():
        return False, "no CUDA headers (cuda_fp8.h) found: install nvidia-cuda-runtime or set CUDA_PATH"
    return True, ""


def compile_for_sm90(source: str, name_expressions=(), options=(), name: str = "kernel.cu",
                     sizes_of=(), arch: str = CUBIN, fast: bool = False) -> tuple[bool, str, dict]:
    """(ok, log, sizes). Uses the same options as the library, minus CuPy's additions, plus
    :data:`FAST_OPTIONS` with ``fast``. ``arch``: :data:`CUBIN` compiles to an sm_90 cubin (ok: a
    non-empty cubin), :data:`PTX` to compute_90 PTX only (ok: a non-empty PTX; ptxas does not
    run). ``sizes`` maps each name expression of ``sizes_of`` (some of ``name_expressions``; a
    cubin compile only) to its kernel's parameter bytes, read from the cubin (see
    :func:`_param_sizes`); empty when the compile failed."""
    from cuda.bindings import nvrtc

    if arch not in (CUBIN, PTX):
        raise ValueError(f"arch must be {CUBIN!r} or {PTX!r}; got {arch!r}")
    if sizes_of and arch != CUBIN:
        raise ValueError(f"sizes_of needs a cubin (arch {CUBIN!r}); got arch {arch!r}")

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        for expr in name_expressions:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, (expr, err)
        opts = [f"-arch={arch}".encode(), *(o.encode() for o in (*options, *(FAST_OPTIONS if fast else ())))]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00 ")
        ok, sizes = result == nvrtc.nvrtcResult.NVRTC_SUCCESS, {}
        if ok:
            err, size = (nvrtc.nvrtcGetCUBINSize if arch == CUBIN else nvrtc.nvrtcGetPTXSize)(prog)
            ok = err == nvrtc.nvrtcResult.NVRTC_SUCCESS and size > 0
            lowered = {}
            for expr in name_expressions:
                err, low = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
                ok = ok and err == nvrtc.nvrtcResult.NVRTC_SUCCESS and bool(low)
                lowered[expr] = low
            if ok and arch == PTX:  # every kernel is an entry of the PTX
                ptx = b" " * size
                nvrtc.nvrtcGetPTX(prog, ptx)
                missing = [expr for expr, low in lowered.items() if b".entry " + low + b"(" not in ptx]
                ok = not missing
                log += f"\nno .entry in the PTX for {missing}" if missing else ""
            if ok and sizes_of:
                cubin = b" " * size
                nvrtc.nvrtcGetCUBIN(prog, cubin)
                sizes = _param_sizes(cubin, {expr: lowered[expr].decode() for expr in sizes_of})
        return ok, log, sizes
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _elf_sections(elf: bytes) -> dict:
    """Section name -> bytes of a little-endian ELF64 image (a cubin)."""

    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = hdrs[shstrndx][4]

    def name(off):
        start = names_at + off
        return elf[start:elf.index(b"\0", start)].decode()

    return {name(h[0]): elf[h[4]:h[4] + h[5]] for h in hdrs}


def _param_sizes(cubin: bytes, lowered: dict) -> dict:
    """Name expression -> the kernel's parameter bytes, read from the cubin's .nv.info section
    (attribute EIATTR_CBANK_PARAM_SIZE, 0x19): what the driver checks a packed buffer against.
    ``lowered``: name expression -> its lowered (mangled) kernel name."""
    sections = _elf_sections(cubin)
    sizes = {}
    for expr, name in lowered.items():
        info, i = sections[".nv.info." + name], 0
        while i + 2 <= len(info):
            fmt, attr = info[i], info[i + 1]
            if fmt == 0x03 and attr == 0x19:
                sizes[expr] = struct.unpack_from("<H", info, i + 2)[0]
            size = struct.unpack_from("<H", info, i + 2)[0] if fmt == 0x04 else 0
            i += {0x01: 2, 0x02: 4, 0x03: 4}.get(fmt, 4 + size)
            if fmt not in (0x01, 0x02, 0x03, 0x04):
                break
    return sizes
