"""SYNTHETIC calibration tables for the tests of ``policy='auto'`` (fusedfp8/policy.py).

Nothing here was measured: the times follow a made-up cost model (a fixed launch cost plus
FLOPs at a fixed rate, FP8 with the larger fixed cost and the higher rate), so that FP8 wins
exactly where ``tokens * in * out`` is large. The device is named ``SYNTHETIC_DEVICE`` unless a
test asks for a real GPU's name (to test the selection by name), and the table's meta says
``"synthetic": true``.
"""
from __future__ import annotations

from pathlib import Path

from fusedfp8.policy import PolicyTable

SYNTHETIC_DEVICE = "Synthetic GPU (test table, not measured)"
TOKENS = (16, 64, 256)
FEATURES = (16, 64, 256)
BF16_FIXED_MS, BF16_MACS_PER_MS = 0.02, 2e6
FP8_FIXED_MS, FP8_MACS_PER_MS = 0.08, 4e6
# FP8 is faster once tokens * in * out > (0.08 - 0.02) / (1 / 2e6 - 1 / 4e6) = 240,000
CROSSOVER_MACS = (FP8_FIXED_MS - BF16_FIXED_MS) / (1 / BF16_MACS_PER_MS - 1 / FP8_MACS_PER_MS)


def synthetic_ms(tokens: int, in_f: int, out_f: int) -> tuple[float, float]:
    """(bf16 ms, fp8 ms) of the made-up cost model."""
    macs = tokens * in_f * out_f
    return BF16_FIXED_MS + macs / BF16_MACS_PER_MS, FP8_FIXED_MS + macs / FP8_MACS_PER_MS


def synthetic_points(tokens=TOKENS, features=FEATURES) -> list[dict]:
    out = []
    for t in tokens:
        for i in features:
            for o in features:
                b, f = synthetic_ms(t, i, o)
                out.append({"tokens": t, "in_features": i, "out_features": o, "bf16_ms": b, "fp8_ms": f})
    return out


def synthetic_table(path: Path | None = None, device: str = SYNTHETIC_DEVICE, **grid) -> PolicyTable:
    """A synthetic :class:`PolicyTable`, saved to ``path`` when given."""
    table = PolicyTable(device, synthetic_points(**grid), date="2000-01-01", versions={"fusedfp8": "test"},
                        meta={"synthetic": True, "measure": "made-up cost model of tests/support/policy.py"})
    if path is not None:
        table.save(path)
    return table


def fp8_wins(tokens: int, in_f: int, out_f: int) -> bool:
    """What the cost model says at a grid point."""
    b, f = synthetic_ms(tokens, in_f, out_f)
    return f < b
