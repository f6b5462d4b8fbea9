"""Block scaling's quantize kernel: ``bench_kernels.py --recipe block``.

For each size and job (bf16 input, E4M3, power-of-two scales):

- ``act_t``: 1x128 blocks with the transposed copy and its own scales (an activation or a
  gradient of a BlockScaling linear: q, q_t and both scale arrays from one read);
- ``act``: the same without the transpose;
- ``weight_t``: 128x128 blocks with the transpose (a weight: the same tiles, transposed);
- ``gelu_t``: gelu (tanh) fused, 1x128 with the transpose (the activation of a block-scaled MLP);
- ``dgelu_t``: dy * gelu'(x) fused, 1x128 with the transpose and the column sums (its backward,
  with the bias gradient);
- ``layernorm_t``: LayerNorm (bf16 weight and bias) fused, 1x128 with the transpose, and the rows'
  mean and rstd (the input of a block-scaled MLP: :func:`fusedfp8.block_layernorm_quantize`, two
  launches that read x twice; its bytes count x once);

fusedfp8's kernel (one launch, :func:`fusedfp8.block_quantize` on torch tensors) beside the same
job in plain torch ops (``eager``: block amaxes by a reshape, the scales, the cast, the transpose's
own pass; ``compile``: that function under torch.compile), graph-timed as bench_kernels.py times
everything (CUDA graph replays of calls rotating over input sets larger than L2, CUDA events,
medians). Bandwidth = (input read once + q, q_t and the scales written once) / time, as a
fraction of a large device-to-device copy measured in the same run.

Correctness first: fusedfp8's q, q_t and scales byte for byte the NumPy definition
(fusedfp8.numerics.block) on the first 256 rows (whole 128-row blocks, so the same blocks as in
the whole tensor), and each peer's q / q_t bytes against fusedfp8's (the fraction that differ:
torch's float32 division for the scale is the library's, so 0 is expected). Target: act_t at
>= 0.85 of the copy ceiling at 8192x16384.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

import _bench
import fusedfp8
from fusedfp8.numerics import block as B

JOBS = ["act_t", "act", "weight_t", "gelu_t", "dgelu_t", "layernorm_t"]
SIZES = [(2048, 4096), (4096, 4096), (8192, 4096), (8192, 16384)]
TARGETS = {("act_t", "8192x16384"): 0.85}
RECIPE = fusedfp8.BlockScaling()  # 1x128 / 128x128, E4M3, power-of-two scales
E4M3_MAX = 448.0


def job_bytes(job: str, m: int, n: int) -> int:
    e = m * n
    kb = -(-n // 128)
    scales = 4 * (-(-m // 128) * kb if job.startswith("weight") else kb * m)
    reads = 4 * e if job == "dgelu_t" else 2 * e
    extra = 4 * n if job == "dgelu_t" else 4 * n + 8 * m if job == "layernorm_t" else 0  # dbias; params, mean, rstd
    return reads + e + scales + (e + scales if job.endswith("_t") else 0) + extra


def fused(job: str, x, b=None, lb=None):
    if job == "layernorm_t":  # (b: the LayerNorm's weight, lb its bias)
        r = fusedfp8.block_layernorm_quantize(x, b, lb, 1e-5, RECIPE, transpose=True)
        return r.quantized.data, r.quantized.data_t
    if job == "gelu_t":
        r = fusedfp8.block_gelu_quantize(x, RECIPE, transpose=True)
    elif job == "dgelu_t":
        return tuple(fusedfp8.block_dgelu_quantize(x, b, RECIPE, transpose=True, dbias=True)[i] for i in (0, 2, 5))
    else:
        r = fusedfp8.block_quantize(x, RECIPE, weight=job.startswith("weight"), transpose=job.endswith("_t"))
    return r.data, r.data_t


def _torch_blocks(x, rows_per_block: int):
    """q and scale_inv of x (m, n; multiples of the block) in plain torch ops, the library's rule:
    amax per block, scale = 448 / amax (1 for 0 / non-finite), rounded down to a power of two."""
    m, n = x.shape
    xf = x.float()
    blocks = xf.reshape(m // rows_per_block, rows_per_block, n // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, E4M3_MAX / amax, torch.ones_like(amax))
    scale = torch.exp2(torch.floor(torch.log2(scale)))  # power of two, rounded down
    q = (blocks * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(m, n)
    return q, (1.0 / scale)


def _dgelu_tanh(dy, x):
    """dy * gelu'(x) (tanh) in float32 torch ops."""
    xf = x.float()
    u = 0.7978845608028654 * (xf + 0.044715 * xf ** 3)
    t = torch.tanh(u)
    return dy.float() * (0.5 * (1 + t) + 0.5 * xf * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * xf * xf))


def torch_job(job: str, x, b=None, lb=None):
    """The job in plain torch ops (one block-amax reduction, the cast; the transpose as its own pass;
    the activation, the LayerNorm, and the column sums, as their own ops)."""
    if job == "layernorm_t":
        return torch_job("act_t", torch.nn.functional.layer_norm(x.float(), (x.shape[1],), b.float(), lb.float()))
    if job == "gelu_t":
        return torch_job("act_t", torch.nn.functional.gelu(x.float(), approximate="tanh"))
    if job == "dgelu_t":
        g = _dgelu_tanh(x, b)
        return (*torch_job("act_t", g), g.sum(0))  # (and the bias gradient)
    if job.startswith("weight"):
        q, _ = _torch_blocks(x, 128)
        return q, (q.t().contiguous() if job.endswith("_t") else None)
    q, _ = _torch_blocks(x, 1)
    q_t = _torch_blocks(x.t().contiguous(), 1)[0] if job.endswith("_t") else None
    return q, q_t


def _u8(t) -> np.ndarray:
    return t.detach().cpu().view(torch.uint8).numpy()


def check(job: str, x, b=None, lb=None) -> dict:
    """fusedfp8 against the NumPy definition on the first 256 rows (whole blocks; a LayerNorm's rows
    are normalised on their own); dgelu's column sums within float32 rounding of the float64 ones."""
    import ml_dtypes

    rows = min(x.shape[0], 256)
    xs = x[:rows].contiguous()

    def host(t):
        return t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)

    if job == "layernorm_t":
        r = fusedfp8.block_layernorm_quantize(xs, b, lb, 1e-5, RECIPE, transpose=True)
        want, mean, rstd = B.block_layernorm_quantize(host(xs), host(b), host(lb), 1e-5, "e4m3", True, True)
        q = r.quantized
        return {"q == definition": np.array_equal(_u8(q.data), want.data.view(np.uint8)),
                "q_t == definition": np.array_equal(_u8(q.data_t), want.data_t.view(np.uint8)),
                "scales == definition": np.array_equal(q.scale_inv.cpu().numpy(), want.scale_inv) and np.array_equal(
                    q.scale_inv_t.cpu().numpy(), want.scale_inv_t),
                "mean, rstd == definition": np.array_equal(r.mean.cpu().numpy(), mean) and np.array_equal(
                    r.rstd.cpu().numpy(), rstd)}
    bs = None if b is None else b[:rows].contiguous()

    op = {"gelu_t": "gelu", "dgelu_t": "dgelu"}.get(job, "identity")
    if op == "gelu":
        r = fusedfp8.block_gelu_quantize(xs, RECIPE, transpose=True)
    elif op == "dgelu":
        r = fusedfp8.block_dgelu_quantize(xs, bs, RECIPE, transpose=True, dbias=True)
    else:
        r = fusedfp8.block_quantize(xs, RECIPE, weight=job.startswith("weight"), transpose=job.endswith("_t"))
    want = B.block_quantize(host(xs), "e4m3", (128, 128) if job.startswith("weight") else (1, 128), True,
                            job.endswith("_t"), 1, op, None if bs is None else host(bs), "tanh", op == "dgelu")
    ok = {"q == definition": np.array_equal(_u8(r.data), want.data.view(np.uint8)),
          "scale_inv == definition": np.array_equal(r.scale_inv.cpu().numpy().view(np.uint32),
                                                    want.scale_inv.view(np.uint32))}
    if job.endswith("_t"):
        ok["q_t == definition"] = np.array_equal(_u8(r.data_t), want.data_t.view(np.uint8))
        ok["scale_inv_t == definition"] = np.array_equal(r.scale_inv_t.cpu().numpy().view(np.uint32),
                                                         want.scale_inv_t.view(np.uint32))
    if op == "dgelu":
        y = B.activation("dgelu", host(xs), host(bs)).astype(np.float64)
        bound = 2.0 ** -18 * np.abs(y).sum(axis=0) + 1e-37
        ok["dbias ~ float64 sums"] = bool((np.abs(r.dbias.cpu().numpy() - y.sum(axis=0)) <= bound).all())
    return {k: bool(v) for k, v in ok.items()}


def run(sizes, jobs, ceiling: float, peers=()) -> list[dict]:
    results, compiled = [], {}
    for m, n in sizes:
        size = f"{m}x{n}"
        k = max(2, min(64, -(-(200 << 20) // (2 * m * n))))
        gen = torch.Generator(device="cuda").manual_seed(m * 31 + n)
        xs = [(torch.randn(m, n, device="cuda", generator=gen)
               * torch.exp2(torch.randint(-8, 8, (m, 1), device="cuda", generator=gen).float())).to(torch.bfloat16)
              for _ in range(k)]
        ln = (torch.rand(n, device="cuda", generator=gen) + 0.5).to(torch.bfloat16), \
            (torch.rand(n, device="cuda", generator=gen) - 0.5).to(torch.bfloat16)
        for job in jobs:
            # dgelu reads two tensors: (dy, x) pairs of the same rotation; the LayerNorm its weight and bias
            inputs = [(x, xs[(i + 1) % k]) if job == "dgelu_t" else (x, *ln) if job == "layernorm_t" else (x,)
                      for i, x in enumerate(xs)]
            row = {"job": job, "size": size, "bytes": job_bytes(job, m, n), "recipe": "block"}
            row["checks"] = check(job, *inputs[0])
            row["correct"] = all(row["checks"].values())
            if not row["correct"]:
                print(f"{size:>11} {job:<9} ok=False, not timed: {row['checks']}", flush=True)
                results.append(row)
                continue
            fn = partial(fused, job)
            row["fusedfp8_us"] = _bench.graph_us(fn, inputs)
            row["fusedfp8_frac"] = row["bytes"] / (row["fusedfp8_us"] * 1e-6) / 1e12 / ceiling
            ours = fn(*inputs[0])
            for peer in peers:
                pf = partial(torch_job, job) if peer == "eager" else compiled.setdefault(
                    job, torch.compile(partial(torch_job, job), dynamic=False))
                got = pf(*inputs[0])
                row[f"{peer}_mismatch"] = max(_bench.mismatch(a, b) for a, b in zip(got[:2], ours[:2]) if a is not None)
                row[f"{peer}_us"], row[f"{peer}_timing"] = _bench.device_us(pf, inputs)
                row[f"{peer}_frac"] = row["bytes"] / (row[f"{peer}_us"] * 1e-6) / 1e12 / ceiling
                row[f"fusedfp8_vs_{peer}"] = row["fusedfp8_us"] / row[f"{peer}_us"]
            if (job, size) in TARGETS:
                row["target_frac"] = TARGETS[(job, size)]
                row["meets_target"] = row["fusedfp8_frac"] >= TARGETS[(job, size)]
            results.append(row)
            print(f"{size:>11} {job:<9} ok=True  fusedfp8 {row['fusedfp8_us']:8.1f}us ({row['fusedfp8_frac']:.2f})"
                  + "".join(f"  {p} {row[p + '_us']:.1f}us ({row[p + '_frac']:.2f}, mismatch "
                            f"{row[p + '_mismatch']:.4f})" for p in peers), flush=True)
        del xs, inputs
        torch.cuda.empty_cache()
    return results


def print_table(results: list[dict], peers) -> None:
    rows = []
    for r in results:
        if not r["correct"]:
            rows.append([r["job"], r["size"], "-", *("-" for _ in peers), "", "False"])
            continue
        tgt = f"{r['target_frac']:.2f} {'met' if r['meets_target'] else 'MISSED'}" if "target_frac" in r else ""
        rows.append([r["job"], r["size"], f"{r['fusedfp8_us']:.1f} ({r['fusedfp8_frac']:.2f})",
                     *(f"{r[p + '_us']:.1f} ({r[p + '_frac']:.2f})" if p + "_us" in r else "-" for p in peers), tgt,
                     "True"])
    _bench.print_table(["job", "size", "fusedfp8 us (frac)", *peers, "target", "correct"], rows)
