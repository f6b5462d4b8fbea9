"""Compile CUDA source for sm_90 with NVRTC through cuda-bindings: no GPU needed."""
from __future__ import annotations


def compile_for_sm90(source: str, name_expressions=(), options=(), name: str = "kernel.cu") -> tuple[bool, str]:
    """(ok, log). Uses the same options as the library, minus CuPy's additions."""
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
        ok = result == nvrtc.nvrtcResult.NVRTC_SUCCESS
        if ok:
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            ok = size > 0
            for expr in name_expressions:
                err, lowered = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
                ok = ok and err == nvrtc.nvrtcResult.NVRTC_SUCCESS and bool(lowered)
        return ok, log.decode(errors="replace").rstrip("\x00 ")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
