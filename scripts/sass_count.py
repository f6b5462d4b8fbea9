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

For the tiled kernel it also prints "per tile": the instructions of one thread's steady-state path
through the tile loop (every full tile; per_tile() says which path), per tile and per element, with
and without dbias, and the registers per thread (cuobjdump -res-usage).
"""
from __future__ import annotations

import argparse
import heapq
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


def _branch_target(text: str) -> int | None:
    m = re.search(r"\bBRA\s+(?:!?U?P\d+,\s*)?(0x[0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


# a path through the tile loop that holds one of these is not the steady state of full tiles: the
# element-wise edge path (byte stores and loads), 8-byte q stores (pcols % 16 != 0), the dbias finish
# of a column strip (its L2 reads), the exit
_COLD = re.compile(r"^(?:@!?U?P\d+\s+)?(?:STG\.E\.(?:U8|64)|STS\.U8|LDG(?!.*\.128)|EXIT)\b")


def per_tile(ins: list[tuple[int, str]], dbias: bool) -> list[dict]:
    """per_loop_tile() of each outermost loop of the kernel that holds a steady-state tile path (the
    tiled kernel has one such loop per index width: 32- and 64-bit offsets), in code order."""
    back = sorted((t, a) for a, text in ins if (t := _branch_target(text)) is not None and t < a)
    outer = [(h, e) for h, e in back if not any(h2 <= h and e <= e2 and (h2, e2) != (h, e) for h2, e2 in back)]
    return [r for h, e in outer if (r := per_loop_tile(ins, h, e, dbias)) is not None]


def per_loop_tile(ins: list[tuple[int, str]], head: int, end: int, dbias: bool) -> dict | None:
    """The shortest path of one thread through one iteration of the tile loop from ``head`` to the
    backward branch at ``end`` that does the steady state of full tiles: no cold block (_COLD), both
    16-byte q stores and both 16-byte q_t stores of each tile, and with ``dbias`` the 4 shared float4
    stores of each tile's column sums and the strip counter's atomic (thread 0's path; without it,
    none of either). Of those: the most tiles an iteration, then the most 16-byte loads (of the next
    tile) a tile, then the fewest instructions. Tiles on the path = its F2FP / 16 (32 elements a
    thread and tile), so a loop that does two tiles an iteration is counted per tile too."""
    body = [(a, t) for a, t in ins if head <= a <= end]
    blocks, cur = [], []
    starts = {tg for _, t in body if (tg := _branch_target(t)) is not None and head < tg <= end}
    for a, t in body:
        if a in starts and cur:
            blocks.append(cur)
            cur = []
        cur.append((a, t))
        if opcode(t) in ("BRA", "EXIT", "RET"):
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    index = {b[0][0]: i for i, b in enumerate(blocks)}

    def marks(b):
        ops = [t.split("@", 1)[-1].split(None, 1)[-1] if t.startswith("@") else t for _, t in b]
        n = lambda f: sum(f(o) for o in ops)
        return (2 * n(lambda o: o.startswith("F2FP")), n(lambda o: o.startswith("STG.E.128")),
                n(lambda o: o.startswith("LDG.E.128")), n(lambda o: o.startswith("STS.128")),
                n(lambda o: o.startswith("ATOMG.E.ADD")))

    # Dijkstra over (block, marks): marks = (elements, q stores, loads, shared 16-byte stores, atomics),
    # bounded by two tiles' worth; a branch back to the head ends an iteration
    cap = (64, 8, 32, 12, 2)
    # (a predicated cold op beside a 16-byte one is the merged if/else of the two q store variants)
    cold = [any(_COLD.match(t) and (not t.startswith("@") or not any(".128" in u for _, u in b)) for _, t in b)
            for b in blocks]
    done, seen, heap = {}, set(), [(0, 0, (0, 0, 0, 0, 0))]
    while heap:
        n, i, st = heapq.heappop(heap)
        if (i, st) in seen or cold[i]:
            continue
        seen.add((i, st))
        b = blocks[i]
        ns = tuple(x + y for x, y in zip(st, marks(b)))
        if any(x > c for x, c in zip(ns, cap)):
            continue
        nn = n + len(b)
        last = b[-1][1]
        tg = _branch_target(last)
        succ = []
        if tg is not None and head <= tg <= end:
            succ.append(tg)
        if not (opcode(last) == "BRA" and not last.startswith("@")) and i + 1 < len(blocks):
            succ.append(blocks[i + 1][0][0])
        for a in succ:
            if a == head:
                done[ns] = min(done.get(ns, nn), nn)
            elif a in index:
                heapq.heappush(heap, (nn, index[a], ns))
    tiles_of = {st: st[0] // 32 for st in done if st[0] and st[0] % 32 == 0}
    ok = [st for st, k in tiles_of.items() if st[1] == 4 * k
          and st[3] == (6 if dbias else 2) * k and st[4] == (k if dbias else 0)]
    if not ok:
        return None
    # the most tiles an iteration (a path that skips a tile's work is no steady state), then the most
    # loads a tile, then the fewest instructions
    best = min(ok, key=lambda st: (-tiles_of[st], -st[2] / tiles_of[st], done[st] / tiles_of[st]))
    k = tiles_of[best]
    return {"per_tile": round(done[best] / k, 1), "per_element": round(done[best] / k / 32, 2),
            "tiles_per_iteration": k, "loads_per_tile": best[2] // k}


def count(cuobjdump: str, dtype: str, fmt: str, op: str) -> dict:
    key = _cuda.ModuleKey("quantize", dtype, fmt, op)
    names = _cuda.name_expressions(key)
    opts = list(_cuda.COMPILE_OPTIONS) + [f"-I{d}" for d in _cuda.cuda_include_dirs()]
    binary, lowered = cubin(_cuda.family_source("quantize"), list(names.values()), opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = dict(re.findall(r"Function (\S+):\s*REG:(\d+)", res))
    functions = re.split(r"\n\s+Function : ", sass)
    out = {}
    for role, expr in names.items():
        body = next((fn for fn in functions if fn.startswith(lowered[expr])), "")
        ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]  # (5+ digits past 0xfff0)
        opcodes = Counter(opcode(t) for _, t in ins)
        out[role] = {"instructions": len(ins), "registers": int(regs.get(lowered[expr], -1)),
                     "per_element": per_element(ins), "top": opcodes.most_common(12)}
        if role.endswith("tiled"):
            out[role]["per_tile"] = per_tile(ins, dbias=False)
            if key.op.startswith("dgelu"):
                out[role]["per_tile_dbias"] = per_tile(ins, dbias=True)
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
            print(f"{op:12s} {role:18s} {r['instructions']:6d}  regs {r['registers']:3d}  per element {r['per_element']}"
                  f"  {r['top'][:8]}")
            for k in ("per_tile", "per_tile_dbias"):
                if k in r:
                    print(f"{'':12s} {role + ' ' + k:30s} {r[k]}")
    if args.json:
        args.json.write_text(json.dumps({"dtype": args.dtype, "fmt": args.fmt, "counts": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
