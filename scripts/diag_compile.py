"""Diagnostic: Fp8MLP eager against torch.compile (aot_eager and inductor), one step after the
states are linked; prints where they part (outputs, gradients, states).

Usage: python scripts/diag_compile.py [--device cuda|cpu] (default: cuda when available; on the
CPU the FP8 ops run the NumPy reference, so this checks the graph capture, not the kernels).
"""
import argparse
import copy

import torch

import fusedfp8
import fusedfp8.pytorch as fp8


def report(tag, a, b):
    a, b = a.detach().float(), b.detach().float()
    bad = (a - b).abs().max().item()
    print(f"  {tag:28s} max|diff| {bad:.3e}  max|a| {a.abs().max().item():.3e}  nan {torch.isnan(b).any().item()}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    dev = ap.parse_args(argv).device
    torch.manual_seed(0)
    H, F, T = 256, 1024, 512
    base = fp8.Fp8MLP(H, F, fusedfp8.DelayedScaling()).to(dev).to(torch.bfloat16)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    y = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
        for m in (m1, m2):  # two eager steps: link, settle the first step
            for _ in range(2):
                m.zero_grad()
                ((m(x).float() - y.float()) ** 2).mean().backward()
                fp8.update_model_scales(m)
        f2 = torch.compile(lambda a: ((m2(a).float() - y.float()) ** 2).mean(), fullgraph=True, backend=backend)
        print(f"backend {backend}")
        for step in range(2):
            m1.zero_grad()
            m2.zero_grad()
            l1 = ((m1(x).float() - y.float()) ** 2).mean()
            l1.backward()
            l2 = f2(x)
            l2.backward()
            print(f" step {step}: loss eager {l1.item():.6f} compiled {l2.item():.6f}")
            for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
                report(f"grad {n}", p1.grad, p2.grad)
            for (n, b1), (_, b2) in zip(m1.named_buffers(), m2.named_buffers()):
                report(f"buf {n}", b1, b2)
            fp8.update_model_scales(m1)
            fp8.update_model_scales(m2)


if __name__ == "__main__":
    main()
