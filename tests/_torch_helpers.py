"""Helpers shared by the torch tests (CPU and GPU)."""
from __future__ import annotations

import torch

from fusedfp8.pytorch import functional as F8


def inputs(rows: int, cols: int, dtype=torch.float32, seed: int = 0, device="cpu") -> torch.Tensor:
    """Normal values whose rows span 2**-4 .. 2**4 (so a scale from the amax matters)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-4, 5, (rows, 1), generator=g).float())
    return (torch.randn(rows, cols, generator=g) * mag).to(device=device, dtype=dtype)


class Spy:
    """Records every scaled_mm call: (a, b, scale_a, scale_b, result)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = F8.scaled_mm

        def spy(a, b, sa, sb, bias, out_dtype, fast_accum=False):
            out = real(a, b, sa, sb, bias, out_dtype, fast_accum)
            self.calls.append((a, b, sa.clone(), sb.clone(), out))
            return out

        monkeypatch.setattr(F8, "scaled_mm", spy)
