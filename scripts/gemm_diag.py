"""The shim's cuBLASLt FP8 GEMM (fusedfp8_fp8_gemm) next to XLA's FP8 dot, per shape, on the GPU.

For each (M, K, N) and format pair: random FP8 operands (zero-padded to 16 in K and in rows, as
our kernels write them), per-tensor scales 0.5 and 1/32, the (M, N) bf16 output of both paths:
- max |err| against a float64 reference of the dequantized operands, and that error relative to
  max |reference|;
- the time per GEMM: a jitted program of ``--batch`` independent GEMMs dispatched ``--calls``
  times back to back, the host waiting once at the end (device-bound: CUDA events are not used
  because jax gives no handle on XLA's stream); median of ``--reps``, divided by calls x batch.
  XLA's dot includes its float32 -> bf16 conversion kernel (and, ragged, its high-precision
  fallback GEMM), as in fp8_dot before the FFI GEMM.
Usage: python scripts/gemm_diag.py [--shapes 2048x1024x4096,1000x48x80,...] [--fast]
"""
from __future__ import annotations

import argparse
import statistics

import _bench as B

DEFAULT = "2048x1024x4096,1000x48x80,17x33x50,303x300x200,8190x64x128,8192x4096x16384"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT, help="MxKxN[,...]")
    ap.add_argument("--fast", action="store_true", help="cuBLASLt's fast accumulation (default: split)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    shapes = B.parse_sizes(args.shapes, 3, "--shapes", ap.error)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fusedfp8.jax import gemm as G

    ok, why = G.gemm_target()
    print(f"FFI GEMM: {'available, ' if ok else 'NOT available: '}{why}")
    if not ok:
        return 1
    dev = jax.devices("gpu")[0]
    rng = np.random.default_rng(0)
    sa, sb = 0.5, 2.0 ** -5
    s = [jax.device_put(jnp.asarray([v], jnp.float32), dev) for v in (sa, sb)]
    rows = []
    for m, k, n in shapes:
        for fa, fb in (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn")):
            def operand(r, fmt):
                full = np.zeros((-(-r // 16) * 16, -(-k // 16) * 16), np.float32)
                full[:r, :k] = rng.standard_normal((r, k)) * 2
                q = jnp.asarray(full).astype(fmt)
                return jax.device_put(q, dev), np.asarray(q[:r, :k].astype(jnp.float32), np.float64)

            ops = [(operand(m, fa), operand(n, fb)) for _ in range(args.batch)]
            (a64, b64) = ops[0][0][1], ops[0][1][1]
            ref = (a64 @ b64.T) * sa * sb
            res = {}
            for impl in ("ffi", "jnp"):  # 'jnp': XLA's dot (its own cuBLASLt FP8 GEMM where it can)
                def many(pairs, x, y, impl=impl):
                    return [G.fp8_gemm(a, b, x, y, jnp.bfloat16, shape=(m, n), fast_accum=args.fast, impl=impl)
                            for a, b in pairs]

                fn = jax.jit(many)
                pairs = [(a, b) for (a, _), (b, _) in ops]
                out = fn(pairs, *s)
                got = np.asarray(out[0], np.float64)
                err = float(np.abs(got - ref).max())
                jax.block_until_ready(fn(pairs, *s))
                ms = statistics.median(B.host_block_ms(lambda: fn(pairs, *s), args.calls, args.reps,
                                                       jax.block_until_ready)) / args.batch
                res[impl] = (err, err / max(float(np.abs(ref).max()), 1e-30), ms * 1e3)
            (ef, rf, tf), (ex, rx, tx) = res["ffi"], res["jnp"]
            rows.append([f"{m}x{k}x{n}", f"{fa[7:11]}x{fb[7:11]}", f"{ef:.3g}", f"{rf:.2e}", f"{tf:.1f}",
                         f"{ex:.3g}", f"{rx:.2e}", f"{tx:.1f}", f"{tx / tf:.2f}x"])
    B.print_table(["M x K x N", "formats", "FFI max|err|", "rel", "FFI us", "XLA max|err|", "rel", "XLA us",
                   "XLA / FFI"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
