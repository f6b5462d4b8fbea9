"""SYNTHETIC calibration tables for the tests of ``policy='auto'`` (fusedfp8/policy.py).

Nothing here was measured: the times follow a made-up cost model (a fixed launch cost plus
FLOPs at a fixed rate, FP8 with the larger fixed cost and the higher rate), so that FP8 wins
exactly where ``tokens * in * out`` is large. The graphed mode has smaller fixed costs (a CUDA
graph removes the launches), so there FP8 wins from a smaller layer on, as on a real GPU; its grid
is coarser (features 16 and 256 only). The device is named ``SYNTHETIC_DEVICE`` unless a test
asks for a real GPU's name (to test the selection by name), and the table's meta says
``"synthetic": true``.
"""
from __future__ import annotations

import re
from pathlib import Path

from fusedfp8.policy import PolicyTable

# a path of some machine: absolute POSIX ('/work/x', '/tmp'), home-relative ('~/x') or Windows ('C:\\x');
# not a ratio ('bf16 / fp8') or a unit ('GB/s')
MACHINE_PATH = re.compile(r"(?<![\w.~)\]-])/[A-Za-z0-9_.+-]|~/|\b[A-Za-z]:\\")


def machine_paths(text: str) -> list[str]:
    """The machine paths in ``text`` (each from its start to the next blank or quote)."""
    return [re.split(r"[\s'\"]", text[m.start():], maxsplit=1)[0] for m in MACHINE_PATH.finditer(text)]


SYNTHETIC_DEVICE = "Synthetic GPU (test table, not measured)"
TOKENS = (16, 64, 256)
FEATURES = (16, 64, 256)
GRAPHED_FEATURES = (16, 256)
BF16_MACS_PER_MS, FP8_MACS_PER_MS = 2e6, 4e6
FIXED_MS = {"eager": (0.02, 0.08), "graphed": (0.005, 0.008)}  # (bf16, fp8) per mode
# FP8 is faster once tokens * in * out > (fp8 fixed - bf16 fixed) / (1 / 2e6 - 1 / 4e6): 240,000
# eager, 12,000 graphed
CROSSOVER_MACS = {m: (f - b) / (1 / BF16_MACS_PER_MS - 1 / FP8_MACS_PER_MS) for m, (b, f) in FIXED_MS.items()}


def synthetic_ms(tokens: int, in_f: int, out_f: int, mode: str = "eager") -> tuple[float, float]:
    """(bf16 ms, fp8 ms) of the made-up cost model."""
    macs = tokens * in_f * out_f
    bf16_fixed, fp8_fixed = FIXED_MS[mode]
    return bf16_fixed + macs / BF16_MACS_PER_MS, fp8_fixed + macs / FP8_MACS_PER_MS


def synthetic_points(tokens=TOKENS, features=FEATURES, mode: str = "eager") -> list[dict]:
    out = []
    for t in tokens:
        for i in features:
            for o in features:
                b, f = synthetic_ms(t, i, o, mode)
                out.append({"tokens": t, "in_features": i, "out_features": o, "bf16_ms": b, "fp8_ms": f})
    return out


def synthetic_table(path: Path | None = None, device: str = SYNTHETIC_DEVICE, graphed: bool = True,
                    **grid) -> PolicyTable:
    """A synthetic :class:`PolicyTable`, saved to ``path`` when given: the eager grid (``grid``:
    ``tokens=``, ``features=``) and, with ``graphed``, the coarser graphed one (else marked
    missing)."""
    made_up = {"measure": "made-up cost model of tests/support/policy.py"}
    modes = {"eager": {"points": synthetic_points(**grid), "meta": made_up},
             "graphed": ({"points": synthetic_points(TOKENS, GRAPHED_FEATURES, "graphed"), "meta": made_up}
                         if graphed else {"missing": "synthetic table without graphed steps"})}
    table = PolicyTable(device, modes, date="2000-01-01", versions={"fusedfp8": "test"}, meta={"synthetic": True})
    if path is not None:
        table.save(path)
    return table


def fp8_wins(tokens: int, in_f: int, out_f: int, mode: str = "eager") -> bool:
    """What the cost model says at a grid point."""
    b, f = synthetic_ms(tokens, in_f, out_f, mode)
    return f < b
