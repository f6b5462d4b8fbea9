"""What one custom call costs the host in a non-donated XLA step (the seed's host cost, issue 18).

Without donation XLA updates its command buffer before every execution, and every FFI custom call is
re-captured (stream capture into a new child graph, no cache), while a kernel that XLA launches itself
is a plain kernel node (its pointers re-packed). This times three chains of 16 operations, each jitted,
its input a different array on every call (as a non-donated step's state is):

- ``ptx``: 16 ``__gpu$xla.gpu.ptx`` custom calls of a small CUDA kernel (y = x + 1, compiled to PTX
  with NVRTC here), with the backend_config as a string (``api_version=1``) and as a dictionary
  (``api_version=4``): whether this jaxlib runs XLA's own PTX custom call at all, and its cost;
- ``jnp``: 16 XLA fusions (x + 1, kept apart by optimization barriers);
- ``ffi``: 16 fusedfp8 FFI calls (``fusedfp8.jax.primitives.amax``, impl 'ffi': a memset and one kernel)
  beside 16 fusions;
- ``fusedfp8_ptx``: the same 16 amaxes with impl 'ptx' (fusedfp8/jax/ptx.py: each one PTX custom call
  of the same kernel on a zeros operand) beside 16 fusions, where this jaxlib runs the PTX call.

Each chain's result is checked before it is timed (the ptx chain adds 16 exactly). JSON to --out.

    python scripts/xla_custom_call_probe.py --out out
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import _bench
import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

N = 1 << 20
SRC = r'''
extern "C" __global__ void addone(const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < %d) y[i] = x[i] + 1.0f;
}''' % N


def ptx_source() -> str:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(SRC, "addone.cu", [], [])
    nvrtc.compileProgram(prog, ["-arch=compute_90"])
    ptx = nvrtc.getPTX(prog)
    return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")


def mlir_string(s: str) -> str:
    """``s`` as the body of an MLIR string literal (quotes, backslashes and control bytes as \\XX)."""
    return "".join(f"\\{ord(c):02X}" if c in '"\\' or not 32 <= ord(c) <= 126 else c for c in s)


def ptx_primitive(ptx: str, dict_config: bool) -> Primitive:
    from jax._src.interpreters.mlir import custom_call
    from jax._src.lib.mlir import ir
    from jax.interpreters import mlir

    p = Primitive("ptx_addone_" + ("dict" if dict_config else "str"))
    p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    launch = {"grid_x": N // 256, "grid_y": 1, "grid_z": 1, "block_x": 256, "block_y": 1, "block_z": 1,
              "shared_mem_bytes": 0}

    def lowering(ctx, x):
        out = [ir.RankedTensorType.get(list(ctx.avals_out[0].shape), ir.F32Type.get())]
        if dict_config:
            i32 = ir.IntegerType.get_signless(32)
            cfg = {"name": ir.StringAttr.get("addone"), "kernel_type": ir.StringAttr.get("ptx"),
                   "kernel_data": ir.StringAttr.get(ptx), **{k: ir.IntegerAttr.get(i32, v) for k, v in launch.items()}}
            return custom_call("__gpu$xla.gpu.ptx", result_types=out, operands=[x], backend_config=cfg,
                               api_version=4).results
        cfg = ('{name = "addone", kernel_type = "ptx", kernel_data = "%s", ' % mlir_string(ptx)
               + ", ".join(f"{k} = {v} : i32" for k, v in launch.items()) + "}")
        return custom_call("__gpu$xla.gpu.ptx", result_types=out, operands=[x], backend_config=cfg,
                           api_version=1).results

    mlir.register_lowering(p, lowering, platform="cuda")
    return p


def ms_per_call(fn, xs, calls: int = 200, reps: int = 5) -> float:
    for _ in range(20):
        fn(xs[0]).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(calls):
            out = fn(xs[i % len(xs)])
        out.block_until_ready()
        times.append((time.perf_counter() - t) / calls * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    args = ap.parse_args(argv)
    from fusedfp8.jax import primitives as P

    x = jnp.arange(N, dtype=jnp.float32)
    xs = [x + i for i in range(4)]  # a different input array on every call (no donation)
    res = {}
    ptx = ptx_source()
    for name, dict_config in (("str_v1", False), ("dict_v4", True)):
        p = ptx_primitive(ptx, dict_config)

        def chain(v, p=p):
            for _ in range(16):
                v = p.bind(v)
            return v

        fn = jax.jit(chain)
        ok = bool(jnp.all(fn(x) == x + 16))
        res[name] = {"ok": ok, "ms_per_call_16_kernels": ms_per_call(fn, xs) if ok else None}

    def jchain(v):
        for _ in range(16):
            v = jax.lax.optimization_barrier(v + 1.0)
        return v

    fn = jax.jit(jchain)
    assert bool(jnp.all(fn(x) == x + 16))
    res["jnp_16_fusions_ms"] = ms_per_call(fn, xs)

    from fusedfp8.jax import ptx as X

    for impl, key in (("ffi", "ffi_16_amax_plus_16_fusions_ms"), ("ptx", "fusedfp8_ptx_16_amax_plus_16_fusions_ms")):
        if impl == "ptx" and not X.supported()[0]:
            res[key], res["fusedfp8_ptx_why_not"] = None, X.supported()[1]
            continue

        def achain(v, impl=impl):
            for _ in range(16):
                v = jax.lax.optimization_barrier(v + P.amax(v, impl=impl) * 0.0)
            return v

        fn = jax.jit(achain)
        assert bool(jnp.all(fn(x) == x))
        res[key] = ms_per_call(fn, xs)
    print(json.dumps(res, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = _bench.run_meta(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    (args.out / "xla_custom_call_probe.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
