"""Registers, stack and spills per kernel of a module, compiled for sm_90 with NVRTC and ptxas -v
(cuda-bindings; no GPU and no cuobjdump needed):

    python scripts/reg_usage.py quantize bfloat16 e5m2 dgelu_tanh
    python scripts/reg_usage.py layernorm_quantize bfloat16 e4m3 float32

Arguments: family, dtype, fmt, then the op (quantize, current_quantize) or the parameter dtype
(layernorm_quantize); extra arguments are passed to NVRTC (e.g. -DFF8_THREADS=128). One line per
kernel role: registers per thread, stack frame, spill stores and spill loads (bytes).
"""
from __future__ import annotations

import re
import sys

from fusedfp8 import _cuda


def usage(key: _cuda.ModuleKey, extra=()) -> dict:
    """Role -> (registers, stack bytes, spill store bytes, spill load bytes) of module ``key``."""
    from cuda.bindings import nvrtc

    names = _cuda.name_expressions(key)
    err, prog = nvrtc.nvrtcCreateProgram(_cuda.family_source(key.family).encode(), b"k.cu", 0, [], [])
    for expr in names.values():
        nvrtc.nvrtcAddNameExpression(prog, expr.encode())
    opts = [b"-arch=sm_90", b"-Xptxas=-v", *(o.encode() for o in _cuda.COMPILE_OPTIONS),
            *(f"-I{d}".encode() for d in _cuda.cuda_include_dirs()), *(e.encode() for e in extra)]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    log = log.decode(errors="replace")
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(log)
    lowered = {nvrtc.nvrtcGetLoweredName(prog, expr.encode())[1].decode(): role for role, expr in names.items()}
    nvrtc.nvrtcDestroyProgram(prog)
    out, role, frame = {}, None, (0, 0, 0)
    for line in log.splitlines():  # ptxas -v: the entry, its frame and spills, then its registers
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            role = lowered.get(m.group(1), m.group(1))
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            frame = tuple(map(int, m.groups()))
        elif (m := re.search(r"Used (\d+) registers", line)) and role is not None:
            out[role] = (int(m.group(1)), *frame)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__)
        return 2
    family, dtype, fmt, last, *extra = argv
    key = (_cuda.ModuleKey(family, dtype, fmt, param=last) if family == "layernorm_quantize"
           else _cuda.ModuleKey(family, dtype, fmt, last))
    if extra:
        print(f"NVRTC options added: {' '.join(extra)}")
    for role, (regs, stack, st, ld) in sorted(usage(key, extra).items()):
        print(f"{family} {dtype} {fmt} {last} {role:28s} registers {regs:4d}  stack {stack:4d}  spill st/ld {st}/{ld}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
