"""Reading XLA's optimized HLO text (``jax.jit(f).lower(...).compile().as_text()``) in the GPU tests."""
from __future__ import annotations

import re

_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)\[")
_DOT = re.compile(r"= \S+ dot\(%([^,\s]+), %([^,)\s]+)\)")
_FUSION = re.compile(r"= \S+ fusion\(.*kind=kCustom, calls=%([^,\s]+)")
_ANY_FUSION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)\[.* fusion\(.*calls=%([^,\s]+)")
_PAD = re.compile(r"^\s*(?:ROOT )?%\S+ = (\S+?)\[.* pad\(")
_PARAM = re.compile(r"= (\S+?)\[\S*\s+parameter\(")
_BYTES = ("f8", "u8")  # FP8 values, and the uint8 codes the kernels write (bitcast to FP8)

CUBLASLT_FP8 = 'custom_call_target="__cublas$lt$matmul$f8"'


def computations(text: str) -> dict[str, list[str]]:
    """name -> instruction lines of every computation in the module."""
    out, name = {}, None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            name = m.group(1)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def _fp8_dot_computations(comps: dict[str, list[str]]) -> set[str]:
    """Computations holding a dot whose two operands are FP8 (f8e4m3fn / f8e5m2) values."""
    found = set()
    for name, lines in comps.items():
        types = {m.group(1): m.group(2) for m in map(_INSTR.match, lines) if m}
        for line in lines:
            d = _DOT.search(line)
            if d and all(types.get(op, "").startswith("f8") for op in d.groups()):
                found.add(name)
    return found


def fp8_gemm_counts(text: str) -> dict[str, int]:
    """How many FP8 GEMMs the compiled module runs, by backend: cuBLASLt's FP8 custom call, a
    Triton GEMM fusion (XLA's autotuner picks it for small / ragged shapes: a kCustom fusion whose
    computation is a dot of two FP8 operands), fusedfp8's own GEMM custom call."""
    comps = computations(text)
    fp8_comps = _fp8_dot_computations(comps)
    triton = sum(1 for m in map(_FUSION.search, text.splitlines()) if m and m.group(1) in fp8_comps)
    return {"cublaslt": text.count(CUBLASLT_FP8), "triton": triton,
            "fusedfp8": len(re.findall(r'custom_call_target="fusedfp8_fp8_gemm(?:_no_cmdbuf)?"', text))}


def other_gemms(text: str) -> int:
    """GEMMs that are not FP8: cuBLAS(Lt) calls in high precision, and dots of non-FP8 operands."""
    comps = computations(text)
    fp8_comps = _fp8_dot_computations(comps)
    dots = sum(1 for name, lines in comps.items() if name not in fp8_comps for ln in lines if _DOT.search(ln))
    return dots + text.count('custom_call_target="__cublas$gemm"') + text.count('custom_call_target="__cublas$lt$matmul"')


def _bytes(type_name: str) -> bool:
    return type_name.startswith(_BYTES)


def fp8_pads(text: str) -> list[str]:
    """Instructions that pad FP8 data (one more pass over the bytes): a ``pad`` of an FP8 / uint8
    result outside fusions, and a fusion holding a ``pad`` whose result or one of whose
    parameters is FP8 / uint8 (XLA fuses the pad, on the CPU through f16 converts: the GPU's
    ``loop_pad_fusion`` feeding a GEMM). Their names and types, one line each."""
    comps = computations(text)

    def pads_bytes(lines) -> bool:
        return any(_PAD.match(ln) for ln in lines) and any(
            _bytes(m.group(1)) for m in map(_PARAM.search, lines) if m)

    fused = {m.group(3) for lines in comps.values() for m in map(_ANY_FUSION.match, lines) if m}
    found = []
    for name, lines in comps.items():
        for ln in lines if name not in fused else ():  # a fused pad is found through its fusion
            pad, fus = _PAD.match(ln), _ANY_FUSION.match(ln)
            if pad and _bytes(pad.group(1)):
                found.append(ln.strip())
            elif fus and fus.group(3) in comps and any(_PAD.match(x) for x in comps[fus.group(3)]) and (
                    _bytes(fus.group(2)) or pads_bytes(comps[fus.group(3)])):
                found.append(ln.strip())
    return found
