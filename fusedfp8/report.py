"""The host-side report of a scaling state (:meth:`fusedfp8.ScalingState.summary`) and the
``fusedfp8`` logger that overflows are reported on.

Nothing here runs in a hot path. The kernels and ``update_scales`` never read device memory;
overflows (non-finite amaxes, counted per tensor in ``ScalingState.overflows``) become visible
when the host reads a state on purpose: :meth:`fusedfp8.ScalingState.summary` calls
:func:`state_rows`, which copies the state to the host once and logs every overflow that
appeared since the previous read of the same ``overflows`` array, as a WARNING on
``logging.getLogger("fusedfp8")``. Without any logging configuration Python prints WARNINGs to
stderr; ``logging.getLogger("fusedfp8").setLevel(logging.ERROR)`` silences them.
"""
from __future__ import annotations

import logging
import math
import weakref

import numpy as np

from ._interop import host_copy

logger = logging.getLogger("fusedfp8")

# id(overflows array) -> (weak reference to it, counts already reported)
_reported: dict[int, tuple[weakref.ref, np.ndarray]] = {}

COLUMNS = ("tensor", "role", "format", "scale", "scale_inv", "amax (last)", "amax (history max)", "staged amax",
           "overflows", "updates")


def _previous(owner) -> np.ndarray | None:
    entry = _reported.get(id(owner))
    if entry is None or entry[0]() is not owner:
        return None
    return entry[1]


def _remember(owner, counts: np.ndarray) -> None:
    key = id(owner)
    try:
        ref = weakref.ref(owner, lambda _r, key=key: _reported.pop(key, None))
    except TypeError:  # not weak-referenceable: every read reports the totals
        return
    _reported[key] = (ref, counts.copy())


def report_overflows(owner, counts: np.ndarray, names) -> list[int]:
    """Log (WARNING) every tensor whose overflow count grew since the last report for ``owner``
    (the state's ``overflows`` array object). Returns the indices that were logged.

    Immutable arrays (jax) are new objects after every update, so their totals are reported at
    each read.
    """
    counts = np.asarray(counts, np.int64)
    prev = _previous(owner)
    if prev is None or prev.shape != counts.shape:
        prev = np.zeros_like(counts)
    new = counts - prev
    logged = [int(i) for i in np.nonzero(new > 0)[0]]
    for i in logged:
        logger.warning("fusedfp8: tensor %s saw %d new non-finite amax(es) (%d in total): its scale was kept and "
                       "the non-finite amax dropped from the history", names[i], int(new[i]), int(counts[i]))
    _remember(owner, counts)
    return logged


def state_rows(state, recipe=None, names=None) -> list[dict]:
    """One dict per tensor of ``state`` (keys :data:`COLUMNS`), read from the device once.

    Also reports new overflows (:func:`report_overflows`).
    """
    n = state.num_tensors
    names = [str(i) for i in range(n)] if names is None else [str(v) for v in names]
    if len(names) != n:
        raise ValueError(f"names: the state has {n} tensors; got {len(names)} names")
    hist = host_copy(state.amax_history)
    scale, scale_inv = host_copy(state.scale), host_copy(state.scale_inv)
    overflows, updates = host_copy(state.overflows), host_copy(state.updates)
    report_overflows(state.overflows, overflows, names)
    past = hist[1:] if hist.shape[0] > 1 else hist[:0]
    rows = []
    for i in range(n):
        # the newest past amax; none before the first update (a current-scaling state keeps updates at 0)
        last = float(past[-1, i]) if past.shape[0] and (updates[i] > 0 or past[-1, i] != 0) else math.nan
        rows.append({
            "tensor": names[i],
            "role": "gradient" if state.grad[i] else "forward",
            "format": recipe.format_for(state.grad[i]).name if recipe is not None else "-",
            "scale": float(scale[i]),
            "scale_inv": float(scale_inv[i]),
            "amax (last)": last,
            "amax (history max)": float(past[:, i].max()) if past.shape[0] else math.nan,
            "staged amax": float(hist[0, i]),
            "overflows": int(overflows[i]),
            "updates": int(updates[i]),
        })
    return rows


def _cell(v) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def format_table(rows: list[dict], columns=COLUMNS) -> str:
    """A plain-text table with aligned columns (one header line, one rule, one line per row)."""
    cells = [[_cell(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(line[j]) for line in cells]) for j, c in enumerate(columns)]
    fmt = "  ".join("{:<%d}" % w if j < 3 else "{:>%d}" % w for j, w in enumerate(widths))
    out = [fmt.format(*columns), "  ".join("-" * w for w in widths)]
    out += [fmt.format(*line) for line in cells]
    return "\n".join(line.rstrip() for line in out)
