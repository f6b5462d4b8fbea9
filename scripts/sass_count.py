"""SASS instructions per kernel of a quantize instantiation, compiled for sm_90 with NVRTC (no GPU
needed) and disassembled with cuobjdump (the CUDA toolkit's, or the one Triton's wheel carries in
triton/backends/nvidia/bin/):

    python scripts/sass_count.py --cuobjdump /path/to/cuobjdump --dtype bfloat16 --fmt e4m3 gelu_tanh dgelu_tanh

Prints, per op and kernel role, the instruction count and the most frequent opcodes; ``--json``
writes them. The count that matters for speed is that of the straight-line fast path, printed as
"per element": every basic block that quantizes (its F2FP instructions pack two elements each: 16 or
32 elements a block) divided by its element count, for each such block (the tiled kernel has one
for each row of a thread, or copies of it for its store variants). It counts the block's share of
the loads, stores and shared-memory writes, not the per-tile work outside it (loop control, the
transposed store, the dbias sums).
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


def basic_blocks(ins: list[tuple[int, str]]) -> list[list[str]]:
    """The instructions ``(address, text)`` split into basic blocks: at each branch target, after
    each branch, exit, return, call or reconvergence point."""
    targets = {int(t, 16) for _, text in ins
               for t in re.findall(r"\b(?:BRA|CALL\.REL\.NOINC|BSSY\s+B\d+,)\s*(?:!?U?P\d+,\s*)?(0x[0-9a-f]+)", text)}
    out, cur = [], []
    for addr, text in ins:
        if addr in targets and cur:
            out.append(cur)
            cur = []
        cur.append(text)
        if opcode(text) in ("BRA", "EXIT", "RET", "CALL", "BSYNC", "WARPSYNC"):
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def opcode(text: str) -> str:
    return (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]


def per_element(ins: list[tuple[int, str]]) -> list[float]:
    """Instructions per element of each run of basic blocks that quantizes a multiple of 16 elements
    (a block that packs part of a row is joined with the blocks after it until the row is whole)."""
    out, size, elements = [], 0, 0
    for block in basic_blocks(ins):
        n = 2 * sum(opcode(t) == "F2FP" for t in block)
        if n or elements:
            size, elements = size + len(block), elements + n
        if elements and elements % 16 == 0:
            out.append(round(size / elements, 1))
            size, elements = 0, 0
    return out


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
        ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]  # (5+ digits past 0xfff0)
        opcodes = Counter(opcode(t) for _, t in ins)
        out[role] = {"instructions": len(ins), "per_element": per_element(ins), "top": opcodes.most_common(12)}
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
            print(f"{op:12s} {role:18s} {r['instructions']:6d}  per element {r['per_element']}  {r['top'][:8]}")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "fmt": args.fmt, "counts": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
