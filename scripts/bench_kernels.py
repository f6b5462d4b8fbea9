"""Benchmark the fused kernels against torch eager, torch.compile and XLA doing the same job.

For each size and job it checks correctness first (fusedfp8 byte for byte against the NumPy
reference on a sample; each peer's FP8 bytes and amax against fusedfp8), then times. Device
time: torch-side implementations are captured K calls at a time (rotating over enough input
sets to defeat the 60 MB L2) in a CUDA graph and the replays are timed with CUDA events; XLA runs
the K calls inside one jitted function, timed over many calls with one block at the end.
Bandwidth = (every input read once + every output written once) / time, reported as a fraction
of a large device-to-device copy measured in the same run. Also: the host cost of one
fusedfp8.quantize call from torch at 1024x1024 (pipelined calls, no sync).

Usage: python scripts/bench_kernels.py [--out DIR] [--sizes 1024x1024,4096x4096] [--jobs quantize,gelu_t,...]
       [--peers eager,compile,xla | --peers none]
Writes DIR/bench_kernels.json and DIR/bench_kernels.png.

       python scripts/bench_kernels.py --recipe current [--sizes ...] [--jobs quantize,quantize_t,...]
Current scaling (scripts/_bench_current.py): the one-launch kernel beside the delayed kernel and
the two-pass path, same run, correctness first; writes DIR/bench_kernels_current.json.

       python scripts/bench_kernels.py --ragged [--sizes 8190x4096,2046x1024] [--jobs quantize,quantize_t,...]
Ragged shapes: fusedfp8 alone, each size as the layers run it (pad_to=16: q and q_t
padded to multiples of 16, zeros in the pad) beside the next aligned size (rows and cols rounded up
to 16, the same kernels with nothing to pad) and the ragged size unpadded (pad_to=1), same run;
bytes first (a block of the last rows, which holds the edge tiles, against the reference, padded);
writes DIR/bench_kernels_ragged.json. Target: padded / aligned <= 1.02.

       python scripts/bench_kernels.py --recipe block [--sizes ...] [--jobs act_t,act,weight_t,gelu_t,dgelu_t,layernorm_t] [--peers eager,compile]
Block scaling (scripts/_bench_block.py): the block quantize kernel (1x128 with the transposed copy and
its scales; 128x128 weights; the fused gelu, and dgelu with its column sums) beside torch doing the
same job, bytes first; writes
DIR/bench_kernels_block.json. Target: act_t >= 0.85 of the copy ceiling at 8192x16384.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax shares the GPU with torch here

import torch  # noqa: E402

import _bench  # noqa: E402
import _bench_block  # noqa: E402
import _bench_current  # noqa: E402
import fusedfp8  # noqa: E402

E4M3_MAX, E5M2_MAX = _bench.E4M3_MAX, _bench.E5M2_MAX
SIZES = [(1024, 1024), (4096, 4096), (8192, 4096), (8192, 16384)]
JOBS = ["quantize", "quantize_t", "gelu", "gelu_t", "dgelu_dbias", "dgelu_dbias_t", "layernorm", "layernorm_t"]
TARGETS = {  # fraction of the copy ceiling, at 8192x16384 (and 4096x4096 for quantize)
    ("quantize", "8192x16384"): 0.92, ("quantize", "4096x4096"): 0.75, ("quantize_t", "8192x16384"): 0.85,
    ("gelu", "8192x16384"): 0.85, ("gelu_t", "8192x16384"): 0.85, ("dgelu_dbias", "8192x16384"): 0.80,
    ("dgelu_dbias_t", "8192x16384"): 0.80, ("layernorm", "8192x16384"): 0.80, ("layernorm_t", "8192x16384"): 0.80,
    ("layernorm", "2048x4096"): 0.70, ("layernorm_t", "2048x4096"): 0.70,
}
LN_EPS = 1e-5
RAGGED_SIZES = [(8190, 4096), (2046, 1024), (4096, 1000)]
RAGGED_JOBS = ["quantize", "quantize_t", "gelu_t", "dgelu_dbias_t"]
RAGGED_TARGET = 1.02  # padded time / aligned time


def job_bytes(job: str, m: int, n: int) -> int:
    e = m * n
    read = 2 * e * (2 if job.startswith("dgelu") else 1) + (2 * 2 * n if job.startswith("layernorm") else 0)
    write = e * (2 if job.endswith("_t") else 1) + (4 * n if "dbias" in job else 0)
    write += 2 * 4 * m if job.startswith("layernorm") else 0  # mean and rstd
    return read + write


_LN_PARAMS: dict = {}


def ln_params(n: int, device="cuda"):
    """The LayerNorm weight and bias of width n (bf16, as in a bf16 model; made once)."""
    if (n, device) not in _LN_PARAMS:
        g = torch.Generator(device=device).manual_seed(n)
        _LN_PARAMS[(n, device)] = ((1 + 0.1 * torch.randn(n, device=device, generator=g)).to(torch.bfloat16),
                                   (0.1 * torch.randn(n, device=device, generator=g)).to(torch.bfloat16))
    return _LN_PARAMS[(n, device)]


# ---- implementations -------------------------------------------------------------------------
def fused(job, x, b, scale, amax, pad_to=1):
    t = job.endswith("_t")
    if job.startswith("quantize"):
        r = fusedfp8.quantize(x, scale, "e4m3", amax=amax, transpose=t, pad_to=pad_to)
    elif job.startswith("gelu"):
        r = fusedfp8.gelu_quantize(x, scale, "e4m3", approximate="tanh", amax=amax, transpose=t, pad_to=pad_to)
    elif job.startswith("layernorm"):
        w, bias = ln_params(x.shape[-1])
        r = fusedfp8.layernorm_quantize(x, w, bias, LN_EPS, scale, "e4m3", amax=amax, transpose=t,
                                        pad_to=pad_to).quantized
    else:
        r = fusedfp8.dgelu_quantize(x, b, scale, "e5m2", approximate="tanh", amax=amax, transpose=t, dbias=True,
                                    pad_to=pad_to)
    return r.data, r.data_t, r.dbias


def torch_job(job, x, b, scale, amax):
    """The same job in plain torch ops: activation in fp32, amax, scale, saturating cast."""
    t = job.endswith("_t")
    if job.startswith("layernorm"):  # (mean and rstd come out of native_layer_norm too)
        w, bias = ln_params(x.shape[-1])
        y = torch.native_layer_norm(x.float(), (x.shape[-1],), w.float(), bias.float(), LN_EPS)[0]
        fmax, dt = E4M3_MAX, torch.float8_e4m3fn
    else:
        y, fmax, dt = _bench.torch_activation(job, x, b)
    torch.maximum(amax, y.abs().amax().reshape(1), out=amax)
    q = (y * scale).clamp(-fmax, fmax).to(dt)
    qt = q.t().contiguous() if t else None
    db = y.sum(0) if "dbias" in job else None
    return q, qt, db


def make_xla_job(job):
    import jax
    import jax.numpy as jnp

    def one(x, b, scale, amax):
        xf = x.astype(jnp.float32)
        if job.startswith("quantize"):
            y, fmax, dt = xf, E4M3_MAX, jnp.float8_e4m3fn
        elif job.startswith("gelu"):
            y, fmax, dt = jax.nn.gelu(xf, approximate=True), E4M3_MAX, jnp.float8_e4m3fn
        elif job.startswith("layernorm"):
            w, bias = (jax.dlpack.from_dlpack(p) for p in ln_params(x.shape[-1]))
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
            rstd = jax.lax.rsqrt(var + LN_EPS)
            y = (xf - mean) * rstd * w.astype(jnp.float32) + bias.astype(jnp.float32)
            fmax, dt = E4M3_MAX, jnp.float8_e4m3fn
        else:
            bf = b.astype(jnp.float32)
            th = jnp.tanh(0.7978845608028654 * (bf + 0.044715 * bf * bf * bf))
            g = 0.5 * (1 + th) + 0.5 * bf * (1 - th * th) * 0.7978845608028654 * (1 + 3 * 0.044715 * bf * bf)
            y, fmax, dt = xf * g, E5M2_MAX, jnp.float8_e5m2
        new_amax = jnp.maximum(amax, jnp.max(jnp.abs(y)))
        q = jnp.clip(y * scale, -fmax, fmax).astype(dt)
        out = [q, new_amax]
        if job.endswith("_t"):
            out.append(q.T)
        if "dbias" in job:
            out.append(jnp.sum(y, axis=0))
        return out

    @jax.jit
    def many(xs, bs, scale, amax):
        return [one(x, b, scale, amax) for x, b in zip(xs, bs)]

    return many


# ---- timing ----------------------------------------------------------------------------------
def time_xla(fn, args, reps=7, iters=10):
    """Median us per job of the jitted ``fn`` (len(args[0]) jobs per call), host-timed around
    blocks of ``iters`` calls with one block_until_ready."""
    import jax

    jax.block_until_ready(fn(*args))
    return statistics.median(_bench.host_block_ms(lambda: fn(*args), iters, reps, jax.block_until_ready)) \
        * 1e3 / len(args[0])


def host_cost_us():
    """Host microseconds of one fusedfp8.quantize call from torch at 1024x1024 bf16 (pipelined calls)."""
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.ones(1, device="cuda")
    amax = torch.zeros(1, device="cuda")
    return _bench.host_us_per_call(lambda: fusedfp8.quantize(x, s, "e4m3", amax=amax), sync=torch.cuda.synchronize,
                                   warmup=50)


# ---- correctness -----------------------------------------------------------------------------
def to_np_bf16(t):
    import ml_dtypes

    return t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def check_fused(job, x, b, m, n, pad_to=1):
    """fusedfp8 against the reference, byte for byte, on a row block of the input (the same
    functions on NumPy arrays run the reference). With ``pad_to``: the padded outputs against the
    reference's in a corner of zeros, on a block of the last rows (256 + m % 128 of them: the
    row tiles' edge is where it is in the whole tensor)."""
    if pad_to == 1:
        rows = min(m, 256)
        xs, bs = x[:rows].contiguous(), b[:rows].contiguous()
    else:
        rows = min(m, 256 + m % 128)
        xs, bs = x[m - rows:].contiguous(), b[m - rows:].contiguous()
    s = torch.full((1,), 2.0, device="cuda")
    amax = torch.zeros(1, device="cuda")
    q, qt, db = fused(job, xs, bs, s, amax, pad_to)
    xn, bn = to_np_bf16(xs), to_np_bf16(bs)
    sn = np.array([2.0], np.float32)
    t = job.endswith("_t")
    if job.startswith("quantize"):
        want = fusedfp8.quantize(xn, sn, "e4m3", transpose=t)
    elif job.startswith("gelu"):
        want = fusedfp8.gelu_quantize(xn, sn, "e4m3", approximate="tanh", transpose=t)
    elif job.startswith("layernorm"):
        w, bias = ln_params(n)
        want = fusedfp8.layernorm_quantize(xn, to_np_bf16(w), to_np_bf16(bias), LN_EPS, sn, "e4m3", transpose=t)
        got = fusedfp8.layernorm_quantize(xs, w, bias, LN_EPS, s, "e4m3", transpose=t)
        stats_ok = all(np.array_equal(a.cpu().numpy().view(np.uint32), b.view(np.uint32))
                       for a, b in ((got.mean, want.mean), (got.rstd, want.rstd)))
        want = want.quantized
        if not stats_ok:
            return False
    else:
        want = fusedfp8.dgelu_quantize(xn, bn, sn, "e5m2", approximate="tanh", transpose=t, dbias=True)
    if pad_to > 1:
        from fusedfp8.numerics.reference import pad2d

        prows, pcols = -(-rows // pad_to) * pad_to, -(-n // pad_to) * pad_to
        want = want._replace(data=pad2d(want.data, prows, pcols),
                             data_t=pad2d(want.data_t, pcols, prows) if t else None)
    ok = np.array_equal(q.cpu().view(torch.uint8).numpy(), want.data.view(np.uint8))
    ok &= np.float32(amax.item()) == np.float32(np.asarray(want.amax).reshape(-1)[0])
    if t:
        ok &= np.array_equal(qt.cpu().view(torch.uint8).numpy(), want.data_t.view(np.uint8))
    if db is not None:
        ok &= np.allclose(db.cpu().numpy(), want.dbias, rtol=1e-4, atol=1e-3)
    return bool(ok)


# ---- main ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder")
    ap.add_argument("--sizes", default=None, help="MxN list")
    ap.add_argument("--jobs", default=None, help="jobs to run")
    ap.add_argument("--peers", default="eager,compile,xla", help="peers to run ('none': fusedfp8 alone)")
    ap.add_argument("--recipe", default="delayed", choices=("delayed", "current", "block"),
                    help="current: one-launch current scaling against the delayed kernel and the two-pass path; "
                         "block: the block-scaling quantize kernel against torch doing the same")
    ap.add_argument("--ragged", action="store_true",
                    help="ragged sizes padded to 16 against the next aligned size (fusedfp8 alone)")
    args = ap.parse_args(argv)
    if args.ragged:
        if args.recipe != "delayed":
            ap.error("--ragged runs the delayed kernels; leave --recipe out")
        sizes = _bench.parse_sizes(args.sizes or ",".join(f"{m}x{n}" for m, n in RAGGED_SIZES), 2, "--sizes",
                                   ap.error)
        jobs = (args.jobs or ",".join(RAGGED_JOBS)).split(",")
        if set(jobs) - set(JOBS):
            ap.error(f"--jobs: unknown {sorted(set(jobs) - set(JOBS))}; choose from {JOBS}")
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU that runs the fused kernels (this machine has none)")
        return run_ragged(args, sizes, jobs)
    if args.recipe == "block":
        sizes = _bench.parse_sizes(args.sizes or ",".join(f"{m}x{n}" for m, n in _bench_block.SIZES), 2, "--sizes",
                                   ap.error)
        jobs = (args.jobs or ",".join(_bench_block.JOBS)).split(",")
        if set(jobs) - set(_bench_block.JOBS):
            ap.error(f"--jobs: unknown with --recipe block {sorted(set(jobs) - set(_bench_block.JOBS))}; choose from "
                     f"{_bench_block.JOBS}")
        peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p != "xla"]
        if set(peers) - {"eager", "compile"}:
            ap.error(f"--peers with --recipe block: from eager, compile (xla is ignored); got {args.peers!r}")
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU that runs the fused kernels (this machine has none)")
        return run_block(args, sizes, jobs, peers)
    current = args.recipe == "current"
    own_jobs, own_sizes = (_bench_current.JOBS, _bench_current.SIZES) if current else (JOBS, SIZES)
    sizes = _bench.parse_sizes(args.sizes or ",".join(f"{m}x{n}" for m, n in own_sizes), 2, "--sizes", ap.error)
    jobs = (args.jobs or ",".join(own_jobs)).split(",")
    if current:
        if set(jobs) - set(own_jobs):
            ap.error(f"--jobs: unknown with --recipe current {sorted(set(jobs) - set(own_jobs))}; choose from {own_jobs}")
        peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p != "xla"]
        if set(peers) - set(_bench_current.PEERS):
            ap.error(f"--peers with --recipe current: from {list(_bench_current.PEERS)} (xla is ignored); got {args.peers!r}")
        return run_current(args, sizes, jobs, peers)
    peers = [] if args.peers == "none" else args.peers.split(",")
    if set(jobs) - set(JOBS):
        ap.error(f"--jobs: unknown {sorted(set(jobs) - set(JOBS))}; choose from {JOBS}")
    if set(peers) - {"eager", "compile", "xla"}:
        ap.error(f"--peers: unknown {sorted(set(peers) - {'eager', 'compile', 'xla'})}; choose from eager, compile, "
                 "xla")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU that runs the fused kernels (this machine has none)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    _bench.allow_recompiles()  # one compiled peer per (job, size)
    ceiling = _bench.copy_ceiling_tbps()
    print(f"copy ceiling: {ceiling:.3f} TB/s (read + write)", flush=True)
    results = []
    compiled = {}
    xla_ok = "xla" in peers
    if xla_ok:
        try:
            import jax
            import jax.numpy as jnp

            xla_ok = any(d.platform == "gpu" for d in jax.devices())
        except Exception as e:  # noqa: BLE001
            print(f"jax unavailable: {e}")
            xla_ok = False
    for m, n in sizes:
        size = f"{m}x{n}"
        k = max(2, min(64, -(-(200 << 20) // (2 * m * n))))  # input sets per graph: >= 200 MB, > 3x the L2
        gen = torch.Generator(device="cuda").manual_seed(m * 31 + n)
        xs = [torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(k)]
        bs = [torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(k)]
        scale = torch.full((1,), 2.0, device="cuda")
        amax = torch.zeros(1, device="cuda")
        for job in jobs:
            row = {"job": job, "size": size, "bytes": job_bytes(job, m, n)}
            row["fusedfp8_correct"] = check_fused(job, xs[0], bs[0], m, n)
            inputs = [(x, b, scale, amax) for x, b in zip(xs, bs)]
            row["fusedfp8_us"] = _bench.graph_us(lambda *a: fused(job, *a), inputs)
            q_f = fused(job, xs[0], bs[0], scale, torch.zeros(1, device="cuda"))[0]
            if "eager" in peers:
                q_e = torch_job(job, xs[0], bs[0], scale, torch.zeros(1, device="cuda"))[0]
                row["eager_mismatch"] = _bench.mismatch(q_e, q_f)
                row["eager_us"] = _bench.graph_us(lambda *a: torch_job(job, *a), inputs)
            if "compile" in peers:
                fn = compiled.setdefault(job, torch.compile(lambda *a, _j=job: torch_job(_j, *a), dynamic=False))
                q_c = fn(xs[0], bs[0], scale, torch.zeros(1, device="cuda"))[0]
                row["compile_mismatch"] = _bench.mismatch(q_c, q_f)
                row["compile_us"], row["compile_timing"] = _bench.device_us(fn, inputs)
            if xla_ok:
                import jax
                import jax.numpy as jnp

                xj = [jax.dlpack.from_dlpack(x) for x in xs]
                bj = [jax.dlpack.from_dlpack(b) for b in bs]
                fn = make_xla_job(job)
                res = fn(xj[:1], bj[:1], jnp.float32(2.0), jnp.float32(0.0))[0]
                q_x = torch.from_dlpack(jax.lax.bitcast_convert_type(res[0], jnp.uint8))
                row["xla_mismatch"] = _bench.mismatch(q_x, q_f)
                row["xla_us"] = time_xla(fn, (xj, bj, jnp.float32(2.0), jnp.float32(0.0)))
            for impl in ("fusedfp8", "eager", "compile", "xla"):
                if f"{impl}_us" in row:
                    row[f"{impl}_frac"] = row["bytes"] / (row[f"{impl}_us"] * 1e-6) / 1e12 / ceiling
            peers_us = [row[f"{p}_us"] for p in ("eager", "compile", "xla") if f"{p}_us" in row]
            row["faster_than_all_peers"] = bool(peers_us) and row["fusedfp8_us"] < min(peers_us)
            tgt = TARGETS.get((job, size))
            if tgt is not None:
                row["target_frac"] = tgt
                row["meets_target"] = row["fusedfp8_frac"] >= tgt
            results.append(row)
            cells = "  ".join(f"{p} {row[p + '_us']:8.1f}us ({row[p + '_frac']:.2f})" for p in
                              ("fusedfp8", "eager", "compile", "xla") if f"{p}_us" in row)
            print(f"{size:>11} {job:<14} ok={row['fusedfp8_correct']}  {cells}", flush=True)
        del xs, bs
        torch.cuda.empty_cache()
    host = host_cost_us()
    print(f"host cost per fusedfp8.quantize call from torch, 1024x1024: {host:.1f} us")
    meta = _bench.run_meta(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_ceiling_TBps=ceiling,
                           host_cost_us_1024x1024=host)
    try:
        import jax

        meta["jax"] = jax.__version__
    except ImportError:
        pass
    _bench.write_json(out / "bench_kernels.json", meta, results)
    plot(results, out / "bench_kernels.png", meta)
    print_table(results)
    return 0 if all(r["fusedfp8_correct"] for r in results) else 1


def run_ragged(args, sizes, jobs) -> int:
    """Each (m, n) as the layers run it (pad_to=16) against the next aligned shape and against
    itself unpadded; every launch checked byte for byte (check_fused) before it is timed."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for m, n in sizes:
        am, an = -(-m // 16) * 16, -(-n // 16) * 16
        row = {"size": f"{m}x{n}", "aligned": f"{am}x{an}"}
        shapes = {"padded": (m, n, 16), "aligned": (am, an, 16), "unpadded": (m, n, 1)}
        for job in jobs:
            r = dict(row, job=job, correct=True)
            for name, (rows, cols, pad_to) in shapes.items():
                k = max(2, min(64, -(-(200 << 20) // (2 * rows * cols))))  # input sets: >= 200 MB, > 3x the L2
                gen = torch.Generator(device="cuda").manual_seed(rows * 31 + cols)
                xs = [torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(k)]
                bs = [torch.randn(rows, cols, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(k)]
                scale, amax = torch.full((1,), 2.0, device="cuda"), torch.zeros(1, device="cuda")
                ok = check_fused(job, xs[0], bs[0], rows, cols, pad_to)
                r["correct"] &= ok
                r[f"{name}_correct"] = ok
                r[f"{name}_us"] = _bench.graph_us(lambda *a, _p=pad_to: fused(job, *a, pad_to=_p),
                                                  [(x, b, scale, amax) for x, b in zip(xs, bs)])
                del xs, bs
                torch.cuda.empty_cache()
            r["padded_vs_aligned"] = r["padded_us"] / r["aligned_us"]
            r["meets_target"] = r["padded_vs_aligned"] <= RAGGED_TARGET
            results.append(r)
            print(f"{r['size']:>10} {job:<14} ok={r['correct']}  padded {r['padded_us']:8.1f}us  aligned "
                  f"{r['aligned']} {r['aligned_us']:8.1f}us  unpadded {r['unpadded_us']:8.1f}us  padded/aligned "
                  f"{r['padded_vs_aligned']:.4f} ({'met' if r['meets_target'] else 'MISSED'} <= {RAGGED_TARGET})",
                  flush=True)
    meta = _bench.run_meta(device=torch.cuda.get_device_name(), torch=torch.__version__, target=RAGGED_TARGET)
    _bench.write_json(out / "bench_kernels_ragged.json", meta, results)
    return 0 if all(r["correct"] for r in results) else 1


def run_current(args, sizes, jobs, peers) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU that runs the fused kernels (this machine has none)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceiling = _bench.copy_ceiling_tbps()
    print(f"copy ceiling: {ceiling:.3f} TB/s (read + write)", flush=True)
    _bench.allow_recompiles()  # one compiled peer per (job, size)
    results = _bench_current.run(sizes, jobs, ceiling, job_bytes, peers)
    meta = _bench.run_meta(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_ceiling_TBps=ceiling)
    _bench.write_json(out / "bench_kernels_current.json", meta, results)
    _bench_current.print_table(results)
    return 0 if all(r["correct"] for r in results) else 1


def run_block(args, sizes, jobs, peers) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceiling = _bench.copy_ceiling_tbps()
    print(f"copy ceiling: {ceiling:.3f} TB/s (read + write)", flush=True)
    _bench.allow_recompiles()
    results = _bench_block.run(sizes, jobs, ceiling, peers)
    meta = _bench.run_meta(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_ceiling_TBps=ceiling)
    _bench.write_json(out / "bench_kernels_block.json", meta, results)
    _bench_block.print_table(results, peers)
    return 0 if all(r["correct"] for r in results) else 1


def print_table(results):
    def cell(r, p):
        return f"{r[p + '_us']:.1f} ({r[p + '_frac']:.2f})" if f"{p}_us" in r else "-"

    rows = []
    for r in results:
        tgt = f"{r['target_frac']:.2f} {'met' if r['meets_target'] else 'MISSED'}" if "target_frac" in r else ""
        rows.append([r["job"], r["size"], *(cell(r, p) for p in ("fusedfp8", "eager", "compile", "xla")), tgt,
                     str(r["fusedfp8_correct"])])
    header = ["job", "size", "fusedfp8 us (frac)", "eager", "torch.compile", "XLA", "target", "correct"]
    _bench.print_table(header, rows)


def plot(results, path, meta):
    plt = _bench.pyplot()
    if plt is None:
        return
    jobs = list(dict.fromkeys(r["job"] for r in results))
    fig, axes = plt.subplots(1, len(jobs), figsize=(4 * len(jobs), 3.6), sharey=True, squeeze=False)
    for ax, job in zip(axes[0], jobs):
        rows = [r for r in results if r["job"] == job]
        xs = [r["bytes"] / 2**20 for r in rows]
        for impl, style in (("fusedfp8", "o-"), ("eager", "s--"), ("compile", "^--"), ("xla", "d--")):
            if f"{impl}_frac" in rows[0]:
                ax.plot(xs, [r[f"{impl}_frac"] for r in rows], style, label=impl)
        ax.set_xscale("log")
        ax.set_title(job)
        ax.set_xlabel("MiB moved")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of copy ceiling")
    axes[0][0].legend()
    fig.suptitle(f"{meta['device']}, {meta['date']}: copy ceiling {meta['copy_ceiling_TBps']:.2f} TB/s")
    _bench.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
