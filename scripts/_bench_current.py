"""Current scaling in one launch: ``bench_kernels.py --recipe current``.

For each size and job (quantize, quantize_t, gelu, gelu_t, dgelu_dbias, dgelu_dbias_t; bf16 input)
launches of the same job, timed in the same run (CUDA graph replays, CUDA events, input sets
rotating over > 200 MB as bench_kernels does):

- ``delayed``: the delayed-scaling kernel (the state's scale; one launch): the yardstick;
- ``one_launch``: current scaling, the amax and the cast in one cooperative launch (the library's
  path: a thread's first vector / a block's first tile kept in registers, the rest read again);
- ``two_pass``: current scaling through an amax pre-pass launch, then the cast (the stage-1 path);
- ``later_step``: the one-launch plan on a step that is not a first step (``updates`` 1: the delayed
  recipe's steady steps with ``first_step='current'`` run it): the state's scale, no barrier, but the
  grid of the first-step launch.

Beside them, with ``--peers`` (default: eager and compile of bench_kernels.py's peers), current scaling
as torch does it without us (torchao's tensorwise recipe: amax, scale, cast as separate operations):
``eager`` (torch ops: several kernels) and ``compile`` (the same function under torch.compile:
inductor's reduction and cast kernels), graph-timed the same way, their q compared with the one-launch
q (``<peer>_mismatch``: the fraction of bytes that differ; torch's tanh is not ours, so gelu's may).
Transformer Engine's three launches are not here (it is not installed on the machines we are lent).

Correctness first, on the full tensor: the bytes (q, q_t), amax, scale and scale_inv of one_launch
equal the two-pass path's, bit for bit, later_step's equal the delayed kernel's, and q
equals the NumPy reference on a row block (quantized with the scale of the whole tensor's amax,
computed by the reference). Each row also records the one-launch plan (kernel, grid). Targets:
one_launch / delayed <= 1.15 at 2048x4096 and 4096x4096, <= 1.6 at
8192x16384 (quantize).
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

import _bench
from fusedfp8 import launch
from fusedfp8.numerics import reference as ref

JOBS = ["quantize", "quantize_t", "gelu", "gelu_t", "dgelu_dbias", "dgelu_dbias_t"]
SIZES = [(2048, 4096), (4096, 4096), (8192, 16384)]
TARGETS = {"2048x4096": 1.15, "4096x4096": 1.15, "8192x16384": 1.6}  # one_launch / delayed, quantize jobs
MODES = ("delayed", "one_launch", "two_pass", "later_step")
FIRST = ("one_launch", "two_pass")  # the modes that run a first step (updates 0)


class Call:
    """One job's launch.quantize on (x, b) with a state of its own (mode: one of MODES)."""

    def __init__(self, job: str, mode: str, m: int, n: int):
        self.job, self.mode, self.m, self.n = job, mode, m, n
        self.op = "identity" if job.startswith("quantize") else ("gelu_tanh" if job.startswith("gelu") else "dgelu_tanh")
        self.fmt = "e5m2" if job.startswith("dgelu") else "e4m3"
        dev = torch.device("cuda")
        self.q = torch.empty(m, n, dtype=torch.uint8, device=dev)
        self.q_t = torch.empty(n, m, dtype=torch.uint8, device=dev) if job.endswith("_t") else None
        self.scale = torch.ones(1, device=dev)
        self.amax = torch.zeros(1, device=dev)
        self.scale_inv = torch.ones(1, device=dev)
        self.siu = torch.empty(1, device=dev)
        self.updates = torch.full((1,), 0 if mode in FIRST else 1, dtype=torch.int32, device=dev)
        self.dbias = self.partial = self.counters = None
        if "dbias" in job:
            shape, n_cnt = launch.dbias_workspace(m, n)
            self.dbias = torch.empty(n, device=dev)
            self.partial = torch.empty(shape, device=dev)
            self.counters = torch.empty(n_cnt, dtype=torch.int32, device=dev)

    def __call__(self, x, b):
        def p(a):
            return a.data_ptr() if a is not None else 0

        first = self.mode != "delayed"
        buffers = dict(x=x.data_ptr(), b=p(b) if self.op.startswith("dgelu") else 0, q=self.q.data_ptr(),
                       scale=p(self.scale), amax=p(self.amax), q_t=p(self.q_t), dbias=p(self.dbias),
                       partial=p(self.partial), counters=p(self.counters), scale_inv_used=p(self.siu))
        if first:
            buffers.update(updates=p(self.updates), scale_out=p(self.scale), scale_inv_out=p(self.scale_inv))
        launch.quantize(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream, buffers,
                        dtype="bfloat16", fmt=self.fmt, op=self.op, rows=self.m, cols=self.n, first=first,
                        coop=self.mode != "two_pass")

    def plan(self) -> dict:
        """The kernel and grid of this mode's last launch (its plan, as launch.quantize builds it)."""
        first = self.mode != "delayed"
        main = launch.quantize_plan(torch.cuda.current_device(), "bfloat16", self.fmt, self.op, self.m, self.n,
                                    self.q_t is not None, self.dbias is not None, first, 1.0, 0, 1,
                                    self.mode != "two_pass").steps[-1]
        return {"kernel": main.variants[0].name, "grid": main.variants[0].grid}


PEERS = ("eager", "compile")
FLT_MAX = float(np.finfo(np.float32).max)


def torch_current_job(job: str, x, b):
    """Current scaling in plain torch ops: the activation in float32 (_bench.torch_activation), amax =
    max |y|, scale = fmt_max / amax (FLT_MAX where that overflows, 1 where amax is 0 or not finite: the
    library's rule for a fresh state, margin 0), the saturating cast; q_t and dbias as the job asks.
    Returns (q, q_t or None, dbias or None, amax, scale)."""
    y, fmax, dt = _bench.torch_activation(job, x, b)
    amax = y.abs().amax()
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, (fmax / amax).clamp(max=FLT_MAX), torch.ones_like(amax))
    q = (y * scale).clamp(-fmax, fmax).to(dt)
    return (q, q.t().contiguous() if job.endswith("_t") else None, y.sum(0) if "dbias" in job else None, amax,
            scale)


def _bits(t):
    return t.detach().cpu().numpy().view(np.uint8 if t.element_size() == 1 else np.uint32)


def check(job: str, x, b, m: int, n: int) -> tuple[dict, Call]:
    """The one-launch paths against the two-pass path and the later step against the delayed kernel
    (everything, full tensor), and q against the reference (first rows): (check -> passed, the
    one-launch call, its outputs those of (x, b))."""
    calls = {mode: Call(job, mode, m, n) for mode in MODES}
    for c in calls.values():
        c(x, b)
    torch.cuda.synchronize()

    def same(a, b):
        return all(np.array_equal(_bits(getattr(a, f)), _bits(getattr(b, f)))
                   for f in ("q", "q_t", "amax", "scale", "scale_inv", "siu", "dbias") if getattr(a, f) is not None)

    one, two = calls["one_launch"], calls["two_pass"]
    ok = {"one_launch == two_pass": same(one, two), "later_step == delayed": same(calls["later_step"], calls["delayed"])}
    import ml_dtypes

    def host(t):
        return t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)

    rows = min(m, 64)
    op = "identity" if one.op == "identity" else one.op.split("_")[0]
    y_rows = ref.activation(op, host(x[:rows]), host(b[:rows]) if op == "dgelu" else None, "tanh")
    a = np.float32(one.amax.item())  # (equal to the two-pass amax; the reference's amax of the whole tensor below)
    if job in ("quantize", "quantize_t"):
        ok["amax == reference"] = bool(a == ref.amax(host(x)))
    s = ref.current_scale(a, one.fmt, 1.0, np.float32(1))
    ok["scale == reference"] = bool(np.float32(one.scale.item()) == s)
    want = ref.finish(y_rows, ref.amax(y_rows), s, one.fmt, False).data.view(np.uint8)
    ok["q == reference (first rows)"] = np.array_equal(_bits(one.q[:rows]), want)
    return ok, one


def run(sizes, jobs, ceiling: float, job_bytes, peers=()) -> list[dict]:
    results = []
    compiled = {}
    for m, n in sizes:
        size = f"{m}x{n}"
        k = max(2, min(64, -(-(200 << 20) // (2 * m * n))))
        gen = torch.Generator(device="cuda").manual_seed(m * 31 + n)
        xs = [torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(k)]
        bs = [torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(k)]
        for job in jobs:
            row = {"job": job, "size": size, "bytes": job_bytes(job, m, n), "recipe": "current"}
            row["checks"], ours = check(job, xs[0], bs[0], m, n)  # (ours: the one-launch q of xs[0], bs[0])
            row["correct"] = all(row["checks"].values())
            if not row["correct"]:  # (no timing of wrong bytes)
                print(f"{size:>11} {job:<14} ok=False, not timed: {row['checks']}", flush=True)
                results.append(row)
                continue
            inputs = list(zip(xs, bs))
            for mode in MODES:
                call = Call(job, mode, m, n)
                row[f"{mode}_us"] = _bench.graph_us(call, inputs)
                row[f"{mode}_frac"] = row["bytes"] / (row[f"{mode}_us"] * 1e-6) / 1e12 / ceiling
                if mode == "one_launch":
                    row[f"{mode}_plan"] = call.plan()
            for mode in MODES[1:]:
                row[f"{mode}_vs_delayed"] = row[f"{mode}_us"] / row["delayed_us"]
            for peer in peers:
                fn = (partial(torch_current_job, job) if peer == "eager" else
                      compiled.setdefault(job, torch.compile(partial(torch_current_job, job), dynamic=False)))
                q = fn(xs[0], bs[0])[0]
                row[f"{peer}_mismatch"] = _bench.mismatch(q, ours.q)
                row[f"{peer}_us"], row[f"{peer}_timing"] = _bench.device_us(fn, inputs)
                row[f"{peer}_frac"] = row["bytes"] / (row[f"{peer}_us"] * 1e-6) / 1e12 / ceiling
                row[f"one_launch_vs_{peer}"] = row["one_launch_us"] / row[f"{peer}_us"]
            if job.startswith("quantize") and size in TARGETS:
                row["target_vs_delayed"] = TARGETS[size]
                row["meets_target"] = row["one_launch_vs_delayed"] <= TARGETS[size]
            results.append(row)
            print(f"{size:>11} {job:<14} ok={row['correct']}  " + "  ".join(
                f"{mode} {row[mode + '_us']:8.1f}us ({row[mode + '_frac']:.2f})" for mode in MODES)
                + f"  one/delayed {row['one_launch_vs_delayed']:.2f}"
                + "".join(f"  {p} {row[p + '_us']:.1f}us (mismatch {row[p + '_mismatch']:.4f})" for p in peers)
                + f"  plan {row['one_launch_plan']}", flush=True)
        del xs, bs
        torch.cuda.empty_cache()
    return results


def print_table(results: list[dict]) -> None:
    rows = []
    for r in results:
        if not r["correct"]:
            rows.append([r["job"], r["size"], *("-" for _ in (*MODES, *PEERS)), "-", "-", "False"])
            continue
        tgt = (f"{r['target_vs_delayed']:.2f} {'met' if r['meets_target'] else 'MISSED'}"
               if "target_vs_delayed" in r else "")
        rows.append([r["job"], r["size"], *(f"{r[m + '_us']:.1f} ({r[m + '_frac']:.2f})" for m in MODES),
                     *(f"{r[p + '_us']:.1f} ({r[p + '_frac']:.2f})" if p + "_us" in r else "-" for p in PEERS),
                     f"{r['one_launch_vs_delayed']:.2f}", tgt,
                     str(r["correct"])])
    _bench.print_table(["job", "size", "delayed us (frac)", "one launch", "two pass", "later step",
                        "torch eager", "torch.compile", "one/delayed", "target", "correct"], rows)
