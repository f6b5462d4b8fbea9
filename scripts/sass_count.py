"""SASS instructions per kernel of a quantize instantiation, compiled for sm_90 with NVRTC (no GPU
needed) and disassembled with cuobjdump (the CUDA toolkit's, or the one Triton's wheel carries in
triton/backends/nvidia/bin/):

    python scripts/sass_count.py --cuobjdump /path/to/cuobjdump --dtype bfloat16 --fmt e4m3 gelu_tanh dgelu_tanh

Prints, per op and kernel role, the instruction count and the most frequent opcodes; ``--json``
writes them. The flat vector kernel handles 16 elements per loop iteration (plus an element-wise
tail with the same operation inlined again), so its count over 17 approximates the instructions
per element.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from fusedfp8 import _cuda


def cubin(source: str, names: list[str], options: list[str]) -> tuple[bytes, dict]:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], [])
    for n in names:
        nvrtc.nvrtcAddNameExpression(prog, n.encode())
    opts = [b"-arch=sm_90", *(o.encode() for o in options)]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise SystemExit(log.decode())
    err, size = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, buf)
    return buf, {n: nvrtc.nvrtcGetLoweredName(prog, n.encode())[1].decode() for n in names}


def count(cuobjdump: str, dtype: str, fmt: str, op: str) -> dict:
    key = _cuda.ModuleKey("quantize", dtype, fmt, op)
    names = _cuda.name_expressions(key)
    opts = list(_cuda.COMPILE_OPTIONS) + [f"-I{d}" for d in _cuda.cuda_include_dirs()]
    binary, lowered = cubin(_cuda.family_source("quantize"), list(names.values()), opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    functions = re.split(r"\n\s+Function : ", sass)
    out = {}
    for role, expr in names.items():
        body = next((fn for fn in functions if fn.startswith(lowered[expr])), "")
        ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", body)  # (addresses past 0xfff0 have 5+ digits)
        opcodes = Counter((i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in ins)
        out[role] = {"instructions": len(ins), "top": opcodes.most_common(12)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ops", nargs="*", default=list(_cuda.OPS), help=f"of {list(_cuda.OPS)}")
    ap.add_argument("--dtype", default="bfloat16", choices=list(_cuda.CPP_TYPES))
    ap.add_argument("--fmt", default="e4m3", choices=list(_cuda.FMT_IDS))
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="path to cuobjdump")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.cuobjdump:
        ap.error("no cuobjdump on PATH: pass --cuobjdump (Triton's wheel carries one)")
    res = {op: count(args.cuobjdump, args.dtype, args.fmt, op) for op in args.ops}
    for op, roles in res.items():
        for role, r in roles.items():
            print(f"{op:12s} {role:18s} {r['instructions']:6d}  {r['top']}")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "fmt": args.fmt, "counts": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
