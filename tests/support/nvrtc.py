"""Compile CUDA source for sm_90 with NVRTC through cuda-bindings: no GPU needed.

The compiles run only in tests/run/nvrtc_compile.py, a process of its own: torch 2.13 (CPU)
fails to torch.load some tensors in a process that has compiled an NVRTC program through
cuda-bindings. Importing this module imports no cuda-bindings (the tests read the lists).
"""
from __future__ import annotations

import struct
from collections import defaultdict

from fusedfp8 import _cuda

BROKEN = {  # sources that must fail, with a log
    "undefined-symbol": "\n__global__ void broken_kernel(float* p) { p[0] = undefined_symbol_xyz; }\n",
    "syntax": "\n__global__ void broken_kernel(float* p) { p[0] = 1.0f }\n",
}
# one module per family whose kernels' parameter sizes the launch signatures are checked against
SIGNATURE_KEYS = {"quantize": _cuda.ModuleKey("quantize", "bfloat16", "e4m3", "dgelu_tanh"),
                  "current_quantize": _cuda.ModuleKey("current_quantize", "bfloat16", "e4m3", "dgelu_tanh"),
                  "layernorm_quantize": _cuda.ModuleKey("layernorm_quantize", "bfloat16", "e4m3", param="float32"),
                  "dequantize": _cuda.ModuleKey("dequantize", "float16", "e5m2"),
                  "update_scales": _cuda.ModuleKey("update_scales")}


def group_of(key: _cuda.ModuleKey) -> str:
    """The compile group ('family-dtype', or the family) that instantiates ``key``'s kernels."""
    return f"{key.family}-{key.dtype}" if key.dtype else key.family


def groups() -> dict:
    """'family-dtype' -> every name expression of every module of that family and dtype: one
    NVRTC program per group keeps the check fast while still instantiating every template."""
    out = defaultdict(list)
    for key in _cuda.all_module_keys():
        out[group_of(key)].extend(_cuda.name_expressions(key).values())
    return dict(out)


def options() -> tuple:
    """The library's compile options, minus CuPy's additions."""
    return tuple(_cuda.COMPILE_OPTIONS) + tuple(f"-I{d}" for d in _cuda.cuda_include_dirs())


def ready() -> tuple[bool, str]:
    """(ok, reason): cuda-bindings' NVRTC and the CUDA headers are there."""
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError as e:
        return False, f"cuda-bindings (NVRTC) is not installed: {e} (pip install 'fusedfp8[test]')"
    if not _cuda.cuda_include_dirs():
        return False, "no CUDA headers (cuda_fp8.h) found: install nvidia-cuda-runtime or set CUDA_PATH"
    return True, ""


def compile_for_sm90(source: str, name_expressions=(), options=(), name: str = "kernel.cu",
                     sizes_of=()) -> tuple[bool, str, dict]:
    """(ok, log, sizes). Uses the same options as the library, minus CuPy's additions. ``sizes``
    maps each name expression of ``sizes_of`` (some of ``name_expressions``) to its kernel's
    parameter bytes, read from the cubin (see :func:`_param_sizes`); empty when the compile failed."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        for expr in name_expressions:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, expr.encode())
            assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, (expr, err)
        opts = [b"-arch=sm_90", *(o.encode() for o in options)]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        ok, sizes = result == nvrtc.nvrtcResult.NVRTC_SUCCESS, {}
        if ok:
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            ok = size > 0
            lowered = {}
            for expr in name_expressions:
                err, low = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
                ok = ok and err == nvrtc.nvrtcResult.NVRTC_SUCCESS and bool(low)
                lowered[expr] = low
            if ok and sizes_of:
                cubin = b" " * size
                nvrtc.nvrtcGetCUBIN(prog, cubin)
                sizes = _param_sizes(cubin, {expr: lowered[expr].decode() for expr in sizes_of})
        return ok, log.decode(errors="replace").rstrip("\x00 "), sizes
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
