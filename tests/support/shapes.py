"""The shape groups of the suite (STYLE.md: aligned, ragged, large; labelled for test ids) and
inputs with the edge values sprinkled in.

``params(...)`` gives ``pytest.param`` objects with the labels as ids. The 'large' shapes run on
the GPU only (the host reference would take minutes on them): ``on_devices(...)`` gives
``(device, shape)`` parameters, in place of the ``device`` fixture, with the large ones on 'cuda'
alone.
"""
from __future__ import annotations

import numpy as np
import pytest

from .frameworks import np_dtype

ALIGNED = {
    "aligned-64x128": (64, 128),
    "aligned-256x1024": (256, 1024),
}
RAGGED = {
    "ragged-303x300": (303, 300),
    "ragged-1x1": (1, 1),
    "ragged-7": (7,),
    "ragged-0x16": (0, 16),  # zero elements
    "ragged-odd-tail-33x17": (33, 17),
    "ragged-odd-tail-65x17": (65, 17),
    "ragged-3d-3x5x7": (3, 5, 7),
    "ragged-3d-5x3x40": (5, 3, 40),
}
LARGE = {
    "large-2048x4096": (2048, 4096),
}
OTHER = {  # one-off shapes some tests name on their own
    "ragged-130x72": (130, 72),
    "ragged-1x5": (1, 5),
    "large-1024x2048": (1024, 2048),
    "large-4096x8192": (4096, 8192),
}
ALL = {**ALIGNED, **RAGGED, **LARGE, **OTHER}
# the few shapes a test pays a compile (jax.jit) or a slow path for: one of each kind
SMALL_SET = ("aligned-64x128", "ragged-odd-tail-33x17", "ragged-1x1", "ragged-0x16", "ragged-3d-3x5x7")


def params(*labels_or_groups) -> list:
    """``pytest.param(shape, id=label)`` for group dicts and/or single labels."""
    out = []
    for g in labels_or_groups:
        items = g.items() if isinstance(g, dict) else [(g, ALL[g])]
        out += [pytest.param(shape, id=label) for label, shape in items]
    return out


def on_devices(*labels_or_groups, large=(LARGE,)) -> list:
    """``(device, shape)`` parameters for a test that runs on both sides: every shape on 'cpu' and
    on 'cuda' (marked ``gpu``), and the ``large`` groups / labels on 'cuda' only."""
    out = []
    for device in ("cpu", "cuda"):
        marks = [pytest.mark.gpu] if device == "cuda" else []
        for p in params(*labels_or_groups, *(large if device == "cuda" else ())):
            out.append(pytest.param(device, p.values[0], id=f"{device}-{p.id}", marks=marks))
    return out


def transposed(shape) -> tuple:
    """The shape of the quantized transpose: (N, M) of the input viewed as (M, N)."""
    return (shape[-1], int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1)


def edge_values(fmt: str) -> np.ndarray:
    """+-0, +-max and just above, huge, the FP8 subnormal range and its ties, float32 denormals,
    exact FP8 values and ties, +-inf and NaN."""
    m = 448.0 if fmt == "e4m3" else 57344.0
    tiny = 2.0 ** -9 if fmt == "e4m3" else 2.0 ** -16
    return np.array([0.0, -0.0, m, -m, np.nextafter(np.float32(m), np.float32(np.inf)), 1e30, -1e30,
                     tiny, tiny / 2, tiny * 0.75, -tiny / 2, 1e-40, -1e-40, 1.0, 1.0625, 1.1875, 3.0, np.inf,
                     -np.inf, np.nan], np.float32)


def make_input(rng, shape, dtype: str, fmt: str, edges: bool = True) -> np.ndarray:
    """Random values over many binades with the edge values sprinkled in (never all zeros)."""
    n = int(np.prod(shape, dtype=np.int64))
    v = (rng.standard_normal(n) * np.exp2(rng.integers(-12, 8, n))).astype(np.float32)
    if edges and n >= 64:
        e = edge_values(fmt)
        idx = rng.choice(n, size=min(len(e), n // 8), replace=False)
        v[idx] = e[: len(idx)]
    with np.errstate(over="ignore"):  # (1e30 in float16 is inf: an edge value too)
        return v.astype(np_dtype(dtype)).reshape(shape)


def special_values(rng, n: int = 3000) -> np.ndarray:
    """Random float32 values over 50 binades, the FP8 boundaries, denormals and non-finite values."""
    e = rng.integers(-30, 20, n)
    v = rng.uniform(1, 2, n) * np.exp2(e) * rng.choice([-1.0, 1.0], n)
    special = [0.0, -0.0, np.inf, -np.inf, 448.0, 449.0, 464.0, 57344.0, 61440.0, 2.0 ** -9, 2.0 ** -10,
               1.5 * 2 ** -9, 2.0 ** -16, 2.0 ** -17, 1e-40, -1e-40, 3e38, -3e38, 1e30]
    return np.concatenate([v, special]).astype(np.float32)
