"""Reading XLA's optimized HLO text (``jax.jit(f).lower(...).compile().as_text()``) in the tests."""
from __future__ import annotations

import re

_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)\[")
_DOT = re.compile(r"= \S+ dot\(%([^,\s]+), %([^,)\s]+)\)")
_FUSION = re.compile(r"= \S+ fusion\(.*kind=kCustom, calls=%([^,\s]+)")
_PAD = re.compile(r"^\s*(?:ROOT )?%\S+ = (\S+?)\[\S*\s+pad\(%([^,\s]+),")
_CONVERT = re.compile(r"\s+convert\(%([^,)\s]+)\)")
_OPERANDS = re.compile(r"= \S+ (\w[\w-]*)\(([^)]*)\)")
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
    computation is a dot of two FP8 operands), fusedfp8's own GEMM custom calls (with and without
    the bias epilogue)."""
    comps = computations(text)
    fp8_comps = _fp8_dot_computations(comps)
    triton = sum(1 for m in map(_FUSION.search, text.splitlines()) if m and m.group(1) in fp8_comps)
    return {"cublaslt": text.count(CUBLASLT_FP8), "triton": triton,
            "fusedfp8": len(re.findall(r'custom_call_target="fusedfp8_fp8_gemm(?:_bias)?"', text))}


def other_gemms(text: str) -> int:
    """GEMMs that are not FP8: cuBLAS(Lt) calls in high precision, and dots of non-FP8 operands."""
    comps = computations(text)
    fp8_comps = _fp8_dot_computations(comps)
    dots = sum(1 for name, lines in comps.items() if name not in fp8_comps for ln in lines if _DOT.search(ln))
    return dots + text.count('custom_call_target="__cublas$gemm"') + text.count('custom_call_target="__cublas$lt$matmul"')


def fp8_pads(text: str) -> list[str]:
    """The ``pad`` instructions of FP8 data, each as "computation: instruction" (one more pass over
    the bytes: on the H200 the ``loop_pad_fusion`` that fed each ragged GEMM): a pad whose result
    is FP8 or uint8 (the codes the kernels write), or whose operand is a convert of such a value
    (XLA:CPU pads FP8 through f16), in any computation, fused ones included."""
    found = []
    for name, lines in computations(text).items():
        instrs = {m.group(1): (m.group(2), ln) for ln in lines if (m := _INSTR.match(ln))}
        for ln in lines:
            pad = _PAD.match(ln)
            if not pad:
                continue
            conv = _CONVERT.search(instrs.get(pad.group(2), ("", ""))[1])
            if pad.group(1).startswith(_BYTES) or (conv and instrs.get(conv.group(1), ("",))[0].startswith(_BYTES)):
                found.append(f"{name}: {ln.strip()}")
    return found


def xors_with_zero(text: str) -> list[str]:
    """The ``xor`` instructions that XLA can see through, each as "computation: instruction": an
    operand it knows is 0 (a constant 0, or a broadcast of one) and the other not a parameter of
    the computation. ``fusedfp8.numerics.jnp`` hides a product or a constant as ``bits ^ zero``;
    where XLA sees the zero, LLVM folds the xor away and a product is free to be contracted into
    the add that reads it. (An operand that is a parameter was computed elsewhere, a product
    already rounded; a hidden constant 0.0 is ``0 ^ zero``, the zero itself.)"""
    found = []
    for name, lines in computations(text).items():
        ops = {}
        for ln in lines:
            m, o = _INSTR.match(ln), _OPERANDS.search(ln)
            if m and o:
                ops[m.group(1)] = (o.group(1), [a.strip().lstrip("%") for a in o.group(2).split(",")])

        def zero(op: str) -> bool:
            kind, args = ops.get(op, ("", []))
            return (kind == "constant" and args == ["0"]) or (kind == "broadcast" and zero(args[0]))

        for ln in lines:
            m = _INSTR.match(ln)
            kind, args = ops.get(m.group(1), ("", [])) if m else ("", [])
            if kind == "xor" and len(args) == 2 and any(
                    zero(a) and ops.get(other, ("",))[0] != "parameter" for a, other in (args, args[::-1])):
                found.append(f"{name}: {ln.strip()}")
    return found
