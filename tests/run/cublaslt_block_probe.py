"""What this GPU's cuBLASLt and torch offer for block-scaled FP8 GEMMs (BlockScaling's GEMM), as JSON:

    python tests/run/cublaslt_block_probe.py [--m 2048 --n 1024 --k 4096] [--out probe.json]

1. cuBLASLt's heuristic (cublasLtMatmulAlgoGetHeuristic), asked as the shim's per-tensor FP8 GEMM
   asks it (fusedfp8/csrc/gemm.h: out (m, n) = a @ b.T, both operands K-contiguous, cuBLASLt's
   "TN" with A = b, B = a, bf16 out, float32 compute) with CUBLASLT_MATMUL_DESC_A_SCALE_MODE /
   B_SCALE_MODE set to VEC128_32F (1x128) or BLK128x128_32F (128x128), for the GEMMs of a linear
   layer under BlockScaling: forward (activation 1x128 x weight 128x128), data gradient (gradient
   1x128 x the weight's transpose 128x128), weight gradient (both transposed copies 1x128), in
   E4M3 and, for the gradient, E5M2 ('hybrid'); 1x128 weights; and 128x128 x 128x128, which
   cuBLASLt is not known to run (the probe then says no).
2. Where an algorithm is found, the GEMM itself on operands quantized by the NumPy definition
   (fusedfp8.numerics.block) with their scales in the documented layout, against the float64
   product of the dequantized operands; also with the scale arrays laid out the other way round
   (K-major 1x128, transposed 128x128), which must then be wrong: the answer says which layout
   cuBLASLt reads.
3. torch: whether ``torch._scaled_mm`` and ``torch.nn.functional.scaled_mm`` accept the 1x128 /
   128x128 scales (views of the same arrays, as torch's checks want them) on this version, and
   whether their result is the float64 one.

Without a CUDA GPU it prints {"available": false, "reason": ...} and exits with status 1.
cuBLASLt is reached through ctypes (the library torch loaded: fusedfp8.csrc.cublaslt_path), with
the enum values of cublasLt.h (CUDA 12.9+ / 13) written below.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

import numpy as np  # noqa: E402

from fusedfp8.numerics import block as B  # noqa: E402

# cublasLt.h (CUDA 13): cudaDataType_t, cublasComputeType_t, cublasOperation_t, the matmul
# descriptor's attributes, cublasLtMatmulMatrixScale_t, the preference's workspace attribute
R_32F, R_16BF, R_8F_E4M3, R_8F_E5M2 = 0, 14, 28, 29
COMPUTE_32F = 68
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 3, 4, 17, 18, 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_SCALAR_32F, SCALE_VEC128_32F, SCALE_BLK128x128_32F = 0, 4, 5
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE = 32 << 20
TYPES = {"e4m3": R_8F_E4M3, "e5m2": R_8F_E5M2}
MODES = {(1, 128): SCALE_VEC128_32F, (128, 128): SCALE_BLK128x128_32F}


class HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt():
    """(library, path): the libcublasLt torch has loaded, else the nvidia wheel's, else the soname."""
    from fusedfp8.csrc import cublaslt_path

    path = cublaslt_path()
    for name in [path] if path else ["libcublasLt.so.13", "libcublasLt.so.12"]:
        try:
            return ctypes.CDLL(name), name
        except OSError:
            continue
    raise OSError(f"libcublasLt cannot be loaded (tried {path or 'libcublasLt.so.13, libcublasLt.so.12'})")


class Lt:
    """The handful of cuBLASLt calls the probe makes; every status checked by name."""

    def __init__(self):
        self.lib, self.path = load_cublaslt()
        L, vp, i32, sz = self.lib, ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t
        sig = {"cublasLtCreate": [ctypes.POINTER(vp)], "cublasLtGetVersion": [],
               "cublasLtGetStatusString": [ctypes.c_int],
               "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
               "cublasLtMatmulDescDestroy": [vp], "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
               "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, ctypes.c_uint64, ctypes.c_uint64,
                                              ctypes.c_int64],
               "cublasLtMatrixLayoutDestroy": [vp], "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
               "cublasLtMatmulPreferenceDestroy": [vp], "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
               "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                  ctypes.POINTER(HeuristicResult), ctypes.POINTER(ctypes.c_int)],
               "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]}
        for name, args in sig.items():
            fn = getattr(L, name)
            fn.argtypes = args
            fn.restype = ctypes.c_size_t if name == "cublasLtGetVersion" else (
                ctypes.c_char_p if name == "cublasLtGetStatusString" else ctypes.c_int)
        self.handle = vp()
        self.check(L.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.version = int(L.cublasLtGetVersion())

    def status(self, st: int) -> str:
        text = self.lib.cublasLtGetStatusString(st)
        return f"{st} ({text.decode() if text else '?'})"

    def check(self, st: int, what: str) -> None:
        if st != 0:
            raise RuntimeError(f"{what}: cuBLASLt status {self.status(st)}")

    def set(self, desc, attr: int, value) -> None:
        self.check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   f"cublasLtMatmulDescSetAttribute({attr})")

    def gemm_plan(self, m, n, k, a_fmt, b_fmt, a_block, b_block, fast_accum=0):
        """(desc, layouts, heuristic result or None, why): out (m, n) = a @ b.T as gemm.h calls it;
        a_*: our a (cuBLASLt's B), b_*: our b (cuBLASLt's A)."""
        L, vp = self.lib, ctypes.c_void_p
        desc = vp()
        self.check(L.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "cublasLtMatmulDescCreate")
        self.set(desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        self.set(desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        self.set(desc, DESC_FAST_ACCUM, ctypes.c_int8(fast_accum))
        self.set(desc, DESC_A_SCALE_MODE, ctypes.c_int32(MODES[b_block]))
        self.set(desc, DESC_B_SCALE_MODE, ctypes.c_int32(MODES[a_block]))
        for attr in (DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER):  # stand-ins, 256-byte aligned, never read
            self.set(desc, attr, vp(256))  # (a call sets the real ones, as gemm.h does)
        la, lb, ld = vp(), vp(), vp()
        self.check(L.cublasLtMatrixLayoutCreate(ctypes.byref(la), TYPES[b_fmt], k, n, k), "layout A")
        self.check(L.cublasLtMatrixLayoutCreate(ctypes.byref(lb), TYPES[a_fmt], k, m, k), "layout B")
        self.check(L.cublasLtMatrixLayoutCreate(ctypes.byref(ld), R_16BF, n, m, n), "layout D")
        pref = vp()
        self.check(L.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE)
        self.check(L.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                          ctypes.sizeof(ws)), "preference")
        res, found = HeuristicResult(), ctypes.c_int(0)
        st = L.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, la, lb, ld, ld, pref, 1, ctypes.byref(res),
                                              ctypes.byref(found))
        L.cublasLtMatmulPreferenceDestroy(pref)
        why = "" if st == 0 and found.value > 0 and res.state == 0 else (
            f"cublasLtMatmulAlgoGetHeuristic: status {self.status(st)}" if st != 0 else
            f"no algorithm (returned {found.value}, state {res.state})")
        return desc, (la, lb, ld), (None if why else res), why

    def release(self, desc, layouts) -> None:
        for lay in layouts:
            self.lib.cublasLtMatrixLayoutDestroy(lay)
        self.lib.cublasLtMatmulDescDestroy(desc)

    def run(self, plan, a, b, sa, sb, out, workspace, stream) -> None:
        desc, (la, lb, ld), res, _ = plan
        pa, pb = ctypes.c_void_p(sb.data_ptr()), ctypes.c_void_p(sa.data_ptr())  # cuBLASLt's A is our b
        self.set(desc, DESC_A_SCALE_POINTER, pa)
        self.set(desc, DESC_B_SCALE_POINTER, pb)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        vp = ctypes.c_void_p
        self.check(self.lib.cublasLtMatmul(self.handle, desc, ctypes.byref(one), vp(b.data_ptr()), la, vp(a.data_ptr()),
                                           lb, ctypes.byref(zero), vp(out.data_ptr()), ld, vp(out.data_ptr()), ld,
                                           ctypes.byref(res.algo), vp(workspace.data_ptr()), WORKSPACE, vp(stream)),
                   "cublasLtMatmul")


def operand(seed: int, rows: int, cols: int, fmt: str, block):
    """The block quantization of a float32 (rows, cols) operand whose rows and 128-column blocks are
    at their own magnitudes (a scale read from the wrong block shows)."""
    g = np.random.default_rng(seed)
    x = (g.standard_normal((rows, cols)) * np.exp2(g.integers(-8, 8, (rows, 1)))
         * np.repeat(np.exp2(g.integers(-6, 6, (1, -(-cols // 128)))), 128, axis=1)[:, :cols]).astype(np.float32)
    return B.block_quantize(x, fmt, block, power_of_two=True)


def other_layout(s: np.ndarray, rows: int, cols: int, block) -> np.ndarray:
    """The same scales laid out the other way round (the layout the probe must find wrong): 1x128
    K-major (rows, ceil(cols / 128)); 128x128 transposed (ceil(cols / 128), ceil(rows / 128)); as a
    flat array of at least the documented one's size (the rest 1), so that no read leaves it."""
    nk = -(-cols // 128)
    other = s[:nk, :rows].T if block[0] == 1 else s[:-(-rows // 128), :nk].T
    flat = np.ones(max(s.size, other.size), np.float32)
    flat[:other.size] = other.reshape(-1)
    return flat


def deq(q, s, block) -> np.ndarray:
    return B.block_dequantize(q, s, block).astype(np.float64)


def rel_err(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """max |got - a @ b.T| relative to |a| @ |b|.T, element by element (a row at a small magnitude
    counts as much as a large one: a scale read from the wrong block shows wherever it lands)."""
    want, mag = a @ b.T, np.abs(a) @ np.abs(b).T
    return float(np.max(np.abs(got - want) / np.maximum(mag, 1e-300)))


GEMMS = {  # name: (our a: format, block; our b: format, block) -- out = a @ b.T, K-contiguous operands
    "forward_1x128_x_128x128_e4m3": (("e4m3", (1, 128)), ("e4m3", (128, 128))),
    "dgrad_1x128_e5m2_x_128x128_e4m3": (("e5m2", (1, 128)), ("e4m3", (128, 128))),
    "dgrad_1x128_x_128x128_e4m3": (("e4m3", (1, 128)), ("e4m3", (128, 128))),
    "wgrad_1x128_e5m2_x_1x128_e4m3": (("e5m2", (1, 128)), ("e4m3", (1, 128))),
    "wgrad_1x128_x_1x128_e4m3": (("e4m3", (1, 128)), ("e4m3", (1, 128))),
    "forward_128x128_x_1x128_e4m3": (("e4m3", (128, 128)), ("e4m3", (1, 128))),
    "128x128_x_128x128_e4m3": (("e4m3", (128, 128)), ("e4m3", (128, 128))),
}
OK_ERR = 2.0 ** -7  # a bf16 output (2**-9 relative) of a float32 sum of exact products: far below this


def probe_cublaslt(m: int, n: int, k: int) -> dict:
    import torch

    out: dict = {}
    lt = Lt()
    out["cublaslt"] = {"path": lt.path, "version": lt.version}
    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device=dev)
    results = {}
    for name, ((fa, ba), (fb, bb)) in GEMMS.items():
        entry: dict = {}
        for fast in (0, 1):
            plan = lt.gemm_plan(m, n, k, fa, fb, ba, bb, fast)
            entry["fast_accum" if fast else "split_accum"] = {
                "supported": plan[2] is not None, "why_not": plan[3],
                "workspace": int(plan[2].workspaceSize) if plan[2] is not None else None}
            if fast == 0 and plan[2] is not None:
                qa = operand(1, m, k, fa, ba)
                qb = operand(2, n, k, fb, bb)
                da, db = deq(qa.data, qa.scale_inv, ba), deq(qb.data, qb.scale_inv, bb)
                t = {key: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for key, v in
                     {"a": qa.data.view(np.uint8), "b": qb.data.view(np.uint8), "sa": qa.scale_inv,
                      "sb": qb.scale_inv, "oa": other_layout(qa.scale_inv, m, k, ba),
                      "ob": other_layout(qb.scale_inv, n, k, bb)}.items()}
                res = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                for layout, (sa, sb) in {"documented": (t["sa"], t["sb"]), "other": (t["oa"], t["ob"])}.items():
                    res.zero_()
                    lt.run(plan, t["a"], t["b"], sa, sb, res, workspace, stream)
                    torch.cuda.synchronize()
                    err = rel_err(res.float().cpu().numpy().astype(np.float64), da, db)
                    entry[f"gemm_{layout}_layout"] = {"max_rel_err": err, "matches_float64": err <= OK_ERR}
            lt.release(plan[0], plan[1])
        results[name] = entry
    out["heuristic_and_gemm"] = results
    return out


def probe_torch(m: int, n: int, k: int) -> dict:
    """torch's blockwise scaled matmuls on the same operands (a 1x128 activation, a 128x128 weight)."""
    import torch

    dev = torch.device("cuda")
    qa = operand(1, m, k, "e4m3", (1, 128))
    qb = operand(2, n, k, "e4m3", (128, 128))
    da, db = deq(qa.data, qa.scale_inv, (1, 128)), deq(qb.data, qb.scale_inv, (128, 128))
    a = torch.from_numpy(qa.data.view(np.uint8)).to(dev).view(torch.float8_e4m3fn)
    b = torch.from_numpy(qb.data.view(np.uint8)).to(dev).view(torch.float8_e4m3fn)
    sa_mem = torch.from_numpy(qa.scale_inv).to(dev)  # (ceil(K/128), pad4(M)); torch: (M, K/128) strides (1, M)
    sb_mem = torch.from_numpy(qb.scale_inv).to(dev)  # (N/128, pad4(K/128)); torch: (pad4(K/128), N/128) strides (1, .)
    sa, sb = sa_mem[:, :m].t(), sb_mem.t()
    out: dict = {"torch": torch.__version__, "scale_a": [list(sa.shape), list(sa.stride())],
                 "scale_b": [list(sb.shape), list(sb.stride())]}

    def attempt(name, fn):
        try:
            res = fn()
            torch.cuda.synchronize()
            err = rel_err(res.float().cpu().numpy().astype(np.float64), da, db)
            out[name] = {"accepted": True, "max_rel_err": err, "matches_float64": err <= OK_ERR}
        except Exception as e:  # noqa: BLE001 (the answer is whatever torch says)
            out[name] = {"accepted": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}

    attempt("torch._scaled_mm", lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    F = torch.nn.functional
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        kinds = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
        attempt("torch.nn.functional.scaled_mm",
                lambda: F.scaled_mm(a, b.t(), sa, kinds[0], sb, kinds[1], output_dtype=torch.bfloat16))
    else:
        out["torch.nn.functional.scaled_mm"] = {"accepted": False, "error": "not in this torch"}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=2048)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    answer: dict = {"shape": {"m": a.m, "n": a.n, "k": a.k}}
    try:
        import torch
    except ImportError as e:
        answer.update(available=False, reason=f"torch is not installed: {e}")
    else:
        if not torch.cuda.is_available():
            answer.update(available=False, reason="no CUDA GPU (torch.cuda.is_available() is False)")
        else:
            props = torch.cuda.get_device_properties(0)
            answer.update(available=True, device=props.name, capability=f"{props.major}.{props.minor}")
            ones = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
            _ = ones @ ones  # (torch's cuBLASLt loaded: the copy the probe then finds mapped)
            try:
                answer.update(probe_cublaslt(a.m, a.n, a.k))
            except (OSError, RuntimeError, AttributeError) as e:
                answer["cublaslt_error"] = f"{type(e).__name__}: {e}"
            answer["torch"] = probe_torch(a.m, a.n, a.k)
    text = json.dumps(answer, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if answer["available"] else 1


if __name__ == "__main__":
    sys.exit(main())
