"""Two measurements of issue 19 on the GPU, bf16 beside FP8 in the same run.

1. Ragged token counts: one train step (forward, backward, fused Adam, update_model_scales) of
   ``fusedfp8.pytorch.Fp8MLP`` at ``tokens`` and at the next multiple of 16, eager and replayed
   from a CUDA graph, with the GPU busy time of each (torch profiler) and the kernels whose time
   differs most between the two counts. Target: the ragged count costs at most 2% more than the
   multiple of 16 (the quantize kernels write the padded operands in the same pass).
2. Gradient accumulation: an optimizer step over ``--micro`` micro-batches, FP8 with the weight
   cache (default) and without it (``cache_fp8_weight = False``), and bf16; with a CUDA profiler
   trace of one step each: the number of fusedfp8 quantize kernels that read a weight
   (one per weight per step with the cache) and the GPU busy time; the host's time to issue each
   eager step; and the whole step captured as ONE CUDA graph (the cache is keyed on the capture,
   so the graph holds one quantization per weight) with its quantize kernels counted.

Correctness first: the FP8 model's first output against the bf16 twin's (SQNR >= 20 dB), and the
cached and uncached FP8 steps give the same bytes (parameters and state) after the timed steps.
Usage: python scripts/bench_shapes_accum.py [--out DIR] [--hidden 1024 --ffn 4096]
       [--tokens 8190] [--micro 4] [--reps 7]
Writes DIR/bench_shapes_accum.json.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import _bench as B


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8190)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import fusedfp8
    import fusedfp8.pytorch as fp8
    from fusedfp8.demo.task import TorchMLP

    ok, why = fusedfp8._cuda.probe(need_fp8_gemm=True)
    if not ok:
        print(f"bench_shapes_accum.py needs a GPU with FP8 GEMMs: {why}")
        return 2
    dev, dt = "cuda", torch.bfloat16
    clock = B.Clock(dev)
    H, F = args.hidden, args.ffn
    torch.manual_seed(0)
    bf = TorchMLP(H, F, device=dev, dtype=dt)
    fp = fp8.Fp8MLP(H, F, device=dev, dtype=dt)
    fp.load_state_dict(bf.state_dict(), strict=False)

    def batch(tokens, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(tokens, H, device=dev, dtype=dt, generator=g)

    x0 = batch(2048, 0)
    sq = B.sqnr_db(bf(x0).detach().float().cpu().numpy(), fp(x0).detach().float().cpu().numpy())
    print(f"correctness: FP8 output vs bf16 SQNR {sq:.1f} dB")
    if sq < B.SQNR_MIN_DB:
        print("FAILED: below the SQNR floor")
        return 1

    def stepper(model, tokens, micro):
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True, capturable=True)  # graphed too
        xs = [batch(tokens, 100 + i) for i in range(micro)]

        def step():
            for x in xs:
                model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            if isinstance(model, fp8.Fp8MLP):
                fp8.update_model_scales(model)

        return step

    def time_step(step):
        for _ in range(3):
            step()
        return statistics.median(clock.ms(step) for _ in range(args.reps))

    results = []
    # 1. ragged token counts: eager and CUDA-graphed steps (the graph takes the host out), the GPU
    # busy time of each, and the kernels whose time differs most between the two token counts
    aligned = -(-args.tokens // 16) * 16
    row = {"part": "ragged", "hidden": H, "ffn": F}
    for name, model in (("bf16", bf), ("fp8", fp)):
        kernels = {}
        for tokens in (args.tokens, aligned):
            row[f"{name}_ms_{tokens}"] = time_step(stepper(copy.deepcopy(model), tokens, 1))
            graphed = B.GraphedStep(stepper(copy.deepcopy(model), tokens, 1))
            row[f"{name}_graphed_ms_{tokens}"] = time_step(graphed)
            prof = B.torch_profile(graphed, clock)
            row[f"{name}_busy_ms_{tokens}"] = prof.get("device_ms_total")
            kernels[tokens] = prof.get("all_kernels_ms") or {}  # (None: the trace missed the kernels)
        keys = set(kernels[args.tokens]) | set(kernels[aligned])
        diff = {k: kernels[args.tokens].get(k, 0.0) - kernels[aligned].get(k, 0.0) for k in keys}
        row[f"{name}_kernel_ms_ragged_minus_aligned"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:8])
        for kind in ("", "graphed_", "busy_"):
            row[f"{name}_{kind}ragged_vs_aligned"] = row[f"{name}_{kind}ms_{args.tokens}"] / row[f"{name}_{kind}ms_{aligned}"]
    print(f"ragged {args.tokens} vs {aligned} tokens (target FP8 <= 1.02): FP8 eager {row['fp8_ragged_vs_aligned']:.4f}x, "
          f"graphed {row['fp8_graphed_ragged_vs_aligned']:.4f}x, GPU busy {row['fp8_busy_ragged_vs_aligned']:.4f}x; "
          f"bf16 eager {row['bf16_ragged_vs_aligned']:.4f}x, graphed {row['bf16_graphed_ragged_vs_aligned']:.4f}x")
    print("  FP8 kernels, ragged minus aligned (ms):", row["fp8_kernel_ms_ragged_minus_aligned"])
    results.append(row)

    # 2. gradient accumulation
    cached, plain = copy.deepcopy(fp), copy.deepcopy(fp)
    plain.fc1.cache_fp8_weight = plain.fc2.cache_fp8_weight = False
    row = {"part": "accumulation", "micro": args.micro, "tokens": 2048, "hidden": H, "ffn": F}
    steps = {"bf16": stepper(copy.deepcopy(bf), 2048, args.micro), "fp8_cached": stepper(cached, 2048, args.micro),
             "fp8_uncached": stepper(plain, 2048, args.micro)}
    for name in ("fp8_uncached", "fp8_cached", "fp8_uncached", "fp8_cached", "bf16"):  # twice, alternating
        row[f"{name}_ms"] = min(row.get(f"{name}_ms", float("inf")), time_step(steps[name]))
    for name, step in steps.items():  # the host's share: time to issue the eager step (no sync inside)
        torch.cuda.synchronize()
        issue = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            step()
            issue.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        row[f"{name}_host_ms"] = statistics.median(issue)
    # the whole accumulation step as ONE CUDA graph (the cache keyed on the capture: one weight
    # quantization per weight in the graph), each model a fresh copy
    graphed = {"bf16": copy.deepcopy(bf), "fp8_cached": copy.deepcopy(cached), "fp8_uncached": copy.deepcopy(plain)}
    gsteps = {name: B.GraphedStep(stepper(model, 2048, args.micro)) for name, model in graphed.items()}
    for name in ("fp8_uncached", "fp8_cached", "fp8_uncached", "fp8_cached", "bf16"):
        row[f"{name}_graphed_ms"] = min(row.get(f"{name}_graphed_ms", float("inf")), time_step(gsteps[name]))
    for name, step in gsteps.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        row[f"{name}_graphed_quantize_kernels"] = sum(calls for key, ms, calls in B.device_events(prof)
                                                      if "quantize" in key)
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        busy = count = 0
        for key, ms, calls in B.device_events(prof):
            busy += ms
            count += calls if "quantize" in key else 0
        row[f"{name}_busy_ms"] = busy
        row[f"{name}_quantize_kernels"] = count
    same = all(torch.equal(a, b) for a, b in zip(cached.state_dict().values(), plain.state_dict().values()))
    row["cached_equals_uncached"] = same
    print(f"{args.micro} micro-batches: bf16 {row['bf16_ms']:.3f} ms, FP8 cached {row['fp8_cached_ms']:.3f} ms "
          f"({row['fp8_cached_quantize_kernels']} quantize kernels), uncached {row['fp8_uncached_ms']:.3f} ms "
          f"({row['fp8_uncached_quantize_kernels']}); same bytes: {same}")
    print(f"  host issue ms: bf16 {row['bf16_host_ms']:.3f}, cached {row['fp8_cached_host_ms']:.3f}, uncached "
          f"{row['fp8_uncached_host_ms']:.3f}; one graph a step: bf16 {row['bf16_graphed_ms']:.3f} ms, cached "
          f"{row['fp8_cached_graphed_ms']:.3f} ({row['fp8_cached_graphed_quantize_kernels']} quantize kernels), "
          f"uncached {row['fp8_uncached_graphed_ms']:.3f} ({row['fp8_uncached_graphed_quantize_kernels']})")
    results.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    B.write_json(args.out / "bench_shapes_accum.json",
                 B.run_meta(device=torch.cuda.get_device_name(), torch=torch.__version__), results)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
