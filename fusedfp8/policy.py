"""Which linear layers gain from FP8: the calibration table and the decision of ``policy='auto'``.

FP8 GEMMs are faster than bf16 ones, but every FP8 linear also quantizes its input, its weight
and its output gradient, and launches more kernels from the host. For a small layer (few tokens,
narrow features) that costs more than the GEMMs save, so ``policy='auto'`` keeps it in bf16.
The decision is read from a table measured on the GPU by ``scripts/calibrate_policy.py``
(``python -m fusedfp8 bench --calibrate``): for a grid of (tokens, in_features, out_features),
the median time of one forward + backward (input and weight gradients) of a bf16 ``nn.Linear``
and of an ``Fp8Linear`` (its quantizations and its scale update included).

Execution modes. How much the host's launch time counts depends on how the model runs, so the
table holds one grid per measured mode (:data:`TABLE_MODES`) and every decision is for one
execution mode (:data:`MODES`):

- ``'eager'``: steps timed as a plain PyTorch loop runs them, launch time included (the default
  of ``convert_to_fp8``);
- ``'graphed'``: steps captured once in a CUDA graph and replayed (``torch.cuda.graphs``), which
  removes nearly all host time: FP8 wins on smaller layers than eagerly;
- ``'compiled'`` (``torch.compile``, ``jax.jit``; the default of the flax helper): decided from the
  graphed figures. That is an approximation: a compiled step keeps some launch time (unless it
  is also graphed, as ``torch.compile(mode='reduce-overhead')`` does) and the compiler may fuse
  the bf16 side differently; no compiled step is timed.

A table without the grid a mode needs (one measured before graphed steps were timed) raises
:class:`MissingModeError`, which says how to measure it.

Prediction. A grid is a product of its axes (every tokens x in x out of the listed values). A
layer's bf16 and fp8 times are interpolated trilinearly in (log2 tokens, log2 in, log2 out),
each as the log of its time, so the predicted speed-up (bf16 ms / fp8 ms) is the same
interpolation of the log of the measured speed-ups. Where the layer lies outside the grid on an
axis, the grid's edge value on that axis is taken (no extrapolation; the report says so). FP8 is
chosen when the predicted fp8 time is below the bf16 time.

Which table. :func:`find_table`: the ``table`` argument (a path or a :class:`PolicyTable`), else
the file named by the environment variable ``FUSEDFP8_POLICY_TABLE``, else the table shipped in
``fusedfp8/data/`` for the GPU's name (``policy_<name>.json``, e.g. ``policy_nvidia_h200.json``
for "NVIDIA H200"). Without one, :class:`MissingTableError` says how to measure one.

Plain Python (no framework, no device): ``fusedfp8.pytorch.convert_to_fp8(policy='auto')`` and
``fusedfp8.jax.flax.dot_general_cls_for`` pass the device name they see.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import re
from pathlib import Path

from .policy_report import ConversionReport, Decision

__all__ = ["PolicyTable", "Grid", "Decision", "ConversionReport", "MissingTableError", "MissingModeError",
           "find_table", "decide", "table_file_name", "shipped_tables", "POLICIES", "MODES", "TABLE_MODES",
           "MEASURED_AS", "TABLE_ENV", "CALIBRATE_COMMAND"]

POLICIES = ("all", "auto")
MODES = ("eager", "graphed", "compiled")  # how a model runs: what a decision is for
TABLE_MODES = ("eager", "graphed")  # how the calibration times a step: the grids of a table
MEASURED_AS = {"eager": "eager", "graphed": "graphed", "compiled": "graphed"}  # execution mode -> its grid
TABLE_ENV = "FUSEDFP8_POLICY_TABLE"
TABLE_FORMAT = "fusedfp8-policy-table/2"
EAGER_ONLY_FORMAT = "fusedfp8-policy-table/1"  # still read: one grid of eager steps at the top level
CALIBRATE_COMMAND = "python -m fusedfp8 bench --calibrate"
DATA_DIR = Path(__file__).resolve().parent / "data"
AXES = ("tokens", "in_features", "out_features")


class MissingTableError(LookupError):
    """No calibration table for this GPU (measure one with ``python -m fusedfp8 bench --calibrate``)."""


class MissingModeError(MissingTableError):
    """The table has no grid for the execution mode asked for (e.g. an eager-only table and
    ``mode='graphed'``); ``python -m fusedfp8 bench --calibrate`` measures every mode."""


def device_slug(device: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200' (lower case, runs of anything but letters and digits -> '_')."""
    return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def table_file_name(device: str) -> str:
    """The file name of the table of a GPU: ``policy_<slug of its CUDA name>.json``."""
    return f"policy_{device_slug(device)}.json"


def shipped_tables() -> list[Path]:
    """The tables shipped in ``fusedfp8/data/``."""
    return sorted(DATA_DIR.glob("policy_*.json")) if DATA_DIR.is_dir() else []


def check_dims(tokens, in_features, out_features) -> tuple[int, int, int]:
    """The three sizes as ints; TypeError / ValueError naming the one that is not a positive int."""
    out = []
    for name, v in zip(AXES, (tokens, in_features, out_features)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be a positive int; got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be a positive int; got {v}")
        out.append(int(v))
    return tuple(out)


def check_policy(policy, allow_none: bool = True) -> str:
    """``policy`` as 'all' or 'auto' (None means 'all' where allowed); ValueError otherwise."""
    if policy is None and allow_none:
        return "all"
    if not isinstance(policy, str) or policy not in POLICIES:
        allowed = ("None", *map(repr, POLICIES)) if allow_none else tuple(map(repr, POLICIES))
        raise ValueError(f"policy must be one of {', '.join(allowed)}; got {policy!r}")
    return policy


def check_mode(mode) -> str:
    """``mode`` if it is one of :data:`MODES`; ValueError otherwise."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))} (how the model's steps run: eagerly, "
                         f"replayed from CUDA graphs, or compiled by torch.compile / jax.jit); got {mode!r}")
    return mode


# ---- the table -------------------------------------------------------------------------------
def _bracket(axis: tuple, v: int) -> tuple[list[tuple[int, float]], str]:
    """The grid indices around ``v`` on ``axis`` with their weights (linear in log2), and a note
    when ``v`` lies outside the axis (the edge value is taken)."""
    if v <= axis[0] or v >= axis[-1]:
        i = 0 if v <= axis[0] else len(axis) - 1
        return [(i, 1.0)], "" if v == axis[i] else f"{'<' if i == 0 else '>'} {axis[i]}"
    hi = next(i for i, a in enumerate(axis) if a >= v)
    if axis[hi] == v:
        return [(hi, 1.0)], ""
    lo = hi - 1
    w = (math.log2(v) - math.log2(axis[lo])) / (math.log2(axis[hi]) - math.log2(axis[lo]))
    return [(lo, 1.0 - w), (hi, w)], ""


def _check_point(where: str, i: int, p) -> dict:
    if not isinstance(p, dict):
        raise ValueError(f"{where}: points[{i}] must be an object; got {type(p).__name__}")
    for a in AXES:
        v = p.get(a)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: points[{i}].{a} must be a positive int; got {v!r}")
    for k in ("bf16_ms", "fp8_ms"):
        v = p.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{where}: points[{i}].{k} must be a positive finite number of ms; got {v!r}")
    return dict(p)


class Grid:
    """The measurements of one mode of a :class:`PolicyTable` (``mode``: 'eager' or 'graphed'):
    ``points`` (a full product grid of (tokens, in_features, out_features), each with ``bf16_ms``
    and ``fp8_ms``), ``axes`` (the sorted values on each axis) and ``meta`` (how it was measured).
    ``where`` prefixes every error ('policy table PATH: modes.graphed')."""

    def __init__(self, mode: str, points, meta=None, where: str = "policy table"):
        if not isinstance(points, list) or not points:
            raise ValueError(f"{where}: 'points' must be a non-empty list; got {type(points).__name__}")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"{where}: 'meta' must be an object; got {type(meta).__name__}")
        self.mode, self.meta = mode, dict(meta or {})
        self.points = [_check_point(where, i, p) for i, p in enumerate(points)]
        self.axes = tuple(tuple(sorted({p[a] for p in self.points})) for a in AXES)
        self._ms = {}
        for p in self.points:
            key = tuple(p[a] for a in AXES)
            if key in self._ms:
                raise ValueError(f"{where}: the point tokens={key[0]}, in_features={key[1]}, out_features={key[2]} "
                                 "appears twice")
            self._ms[key] = (math.log(p["bf16_ms"]), math.log(p["fp8_ms"]))
        size = math.prod(len(a) for a in self.axes)
        if size != len(self._ms):
            missing = next((t, i, o) for t in self.axes[0] for i in self.axes[1] for o in self.axes[2]
                           if (t, i, o) not in self._ms)
            raise ValueError(f"{where}: the points must cover the whole grid tokens {list(self.axes[0])} x in_features "
                             f"{list(self.axes[1])} x out_features {list(self.axes[2])} ({size} points); got "
                             f"{len(self._ms)}, missing e.g. tokens={missing[0]}, in_features={missing[1]}, "
                             f"out_features={missing[2]}")

    def to_dict(self) -> dict:
        return {"meta": self.meta, "points": self.points}

    def predict(self, tokens: int, in_features: int, out_features: int) -> tuple[float, float, str]:
        """(fp8 ms, bf16 ms, how): 'measured' at a grid point, 'interpolated' between grid points,
        or 'grid edge (...)' naming the axes on which the layer lies outside the grid."""
        dims = check_dims(tokens, in_features, out_features)
        brackets = [_bracket(axis, v) for axis, v in zip(self.axes, dims)]
        log_bf16 = log_fp8 = 0.0
        for it, wt in brackets[0][0]:
            for ii, wi in brackets[1][0]:
                for io, wo in brackets[2][0]:
                    b, f = self._ms[(self.axes[0][it], self.axes[1][ii], self.axes[2][io])]
                    w = wt * wi * wo
                    log_bf16 += w * b
                    log_fp8 += w * f
        outside = [f"{a} {note}" for a, (_, note) in zip(AXES, brackets) if note]
        exact = all(len(b[0]) == 1 for b in brackets)
        how = (f"grid edge ({', '.join(outside)})" if outside else "measured" if exact else "interpolated")
        return math.exp(log_fp8), math.exp(log_bf16), how

    def __repr__(self) -> str:
        return (f"Grid({self.mode!r}, tokens {list(self.axes[0])} x in {list(self.axes[1])} x out "
                f"{list(self.axes[2])})")


class PolicyTable:
    """A calibration table measured on ``device``: per measured mode (:data:`TABLE_MODES`), a
    :class:`Grid` of the median ms of one forward + backward in bf16 and in fp8.

    ``modes`` maps 'eager' and 'graphed' each to ``{"points": [...], "meta": {...}}`` (measured),
    to ``{"missing": "why"}`` (not measured; a mode left out counts as missing too). At least one
    mode must be measured. JSON form (what ``scripts/calibrate_policy.py`` writes)::

        {"format": "fusedfp8-policy-table/2", "device": "NVIDIA H200", "date": "2026-12-05",
         "versions": {"fusedfp8": ..., "torch": ..., "cuda": ...}, "meta": {...how it was measured},
         "modes": {"eager": {"meta": {...}, "points": [{"tokens": 512, "in_features": 256,
                                                        "out_features": 256, "bf16_ms": 0.041,
                                                        "fp8_ms": 0.113, ...more fields are kept}]},
                   "graphed": {"meta": {...}, "points": [...]} or {"missing": "why"}}}

    A file of the format "fusedfp8-policy-table/1" (one list of eager ``points`` at the top
    level, before graphed steps were measured) is read as a table whose graphed mode is missing.
    Raises ValueError (naming the file, the mode and the field) on anything else, and when a
    mode's points do not cover the whole product of their axes.
    """

    def __init__(self, device: str, modes: dict, *, date: str = "", versions: dict | None = None,
                 meta: dict | None = None, path: str | os.PathLike | None = None):
        self.path = None if path is None else Path(path)
        where = f"policy table {self.path}" if self.path else "policy table"
        if not isinstance(device, str) or not device:
            raise ValueError(f"{where}: 'device' must be the GPU's name (a non-empty str); got {device!r}")
        if not isinstance(modes, dict):
            raise ValueError(f"{where}: 'modes' must be an object with the keys {list(TABLE_MODES)}; got "
                             f"{type(modes).__name__}")
        unknown = sorted(set(modes) - set(TABLE_MODES), key=str)
        if unknown:
            raise ValueError(f"{where}: 'modes' may only hold {list(TABLE_MODES)}; got {unknown}")
        self.device, self.date = device, str(date)
        self.versions, self.meta = dict(versions or {}), dict(meta or {})
        self.grids, self.missing = {}, {}
        for m in TABLE_MODES:
            section = modes.get(m, {"missing": "not in the table"})
            if not isinstance(section, dict):
                raise ValueError(f"{where}: modes.{m} must be an object; got {type(section).__name__}")
            if "missing" in section:
                why = section["missing"]
                if not isinstance(why, str) or not why or set(section) != {"missing"}:
                    raise ValueError(f"{where}: modes.{m} must be either measured ({{'points', 'meta'}}) or "
                                     f"{{'missing': 'why'}} (a non-empty str, nothing else); got {section!r:.200}")
                self.missing[m] = why
            else:
                self.grids[m] = Grid(m, section.get("points"), section.get("meta"), f"{where}: modes.{m}")
        if not self.grids:
            raise ValueError(f"{where}: no mode is measured (every one of {list(TABLE_MODES)} is missing)")

    @property
    def modes(self) -> tuple:
        """The measured modes, in :data:`TABLE_MODES` order."""
        return tuple(m for m in TABLE_MODES if m in self.grids)

    def grid(self, mode: str = "eager") -> Grid:
        """The :class:`Grid` that decides for the execution mode ``mode`` (see :data:`MODES`;
        'compiled' reads the graphed grid). Raises :class:`MissingModeError` if the table lacks it."""
        measured = MEASURED_AS[check_mode(mode)]
        if measured in self.grids:
            return self.grids[measured]
        stand_in = " (compiled steps are decided from graphed ones)" if mode != measured else ""
        raise MissingModeError(
            f"policy table {self.describe()} has no {measured} measurements ({self.missing[measured]}), which "
            f"mode={mode!r} needs{stand_in}; it measured {', '.join(self.modes)} steps only. Measure every mode "
            f"on this GPU with `{CALIBRATE_COMMAND}` (it says where it wrote the table) and pass that table "
            f"(policy_table=PATH, or set {TABLE_ENV}=PATH); or decide with mode='eager' (the eager figures keep "
            "layers in bf16 that would gain under CUDA graphs or compilation)")

    # -- JSON ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data, path=None) -> "PolicyTable":
        where = f"policy table {path}" if path else "policy table"
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a JSON object; got {type(data).__name__}")
        fmt = data.get("format")
        if fmt == TABLE_FORMAT:
            modes = data.get("modes")
        elif fmt == EAGER_ONLY_FORMAT:
            modes = {"eager": {"points": data.get("points")},
                     "graphed": {"missing": f"a {EAGER_ONLY_FORMAT} table holds eager steps only"}}
        else:
            raise ValueError(f"{where}: 'format' must be {TABLE_FORMAT!r} (or the eager-only {EAGER_ONLY_FORMAT!r}); "
                             f"got {fmt!r}")
        return cls(data.get("device"), modes, date=data.get("date", ""), versions=data.get("versions"),
                   meta=data.get("meta"), path=path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PolicyTable":
        """Read a table from a JSON file (FileNotFoundError when there is none)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"policy table {path}: not valid JSON ({e})") from None
        return cls.from_dict(data, path)

    def to_dict(self) -> dict:
        """The JSON form, always of :data:`TABLE_FORMAT` (an eager-only table read from the old
        format is written with its graphed mode missing)."""
        modes = {m: self.grids[m].to_dict() if m in self.grids else {"missing": self.missing[m]} for m in TABLE_MODES}
        return {"format": TABLE_FORMAT, "device": self.device, "date": self.date, "versions": self.versions,
                "meta": self.meta, "modes": modes}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        self.path = path
        return path

    def describe(self) -> str:
        """'policy_nvidia_h200.json (NVIDIA H200, 2026-12-05, fusedfp8 0.1.0; eager, graphed steps)'."""
        what = ", ".join(x for x in (self.device, self.date, f"fusedfp8 {self.versions['fusedfp8']}"
                                     if "fusedfp8" in self.versions else "") if x)
        return f"{self.path.name if self.path else '(in memory)'} ({what}; {', '.join(self.modes)} steps)"

    def __repr__(self) -> str:
        return f"PolicyTable({self.describe()}, {', '.join(map(repr, self.grids.values()))})"

    # -- prediction ------------------------------------------------------------------------------
    def predict(self, tokens: int, in_features: int, out_features: int, mode: str = "eager"
                ) -> tuple[float, float, str]:
        """(fp8 ms, bf16 ms, how) of a layer run in the execution mode ``mode``, from its grid
        (:meth:`grid`, :meth:`Grid.predict`)."""
        return self.grid(mode).predict(tokens, in_features, out_features)

    def decide(self, tokens: int, in_features: int, out_features: int, name: str = "", mode: str = "eager"
               ) -> Decision:
        """FP8 when the predicted fp8 time in the execution mode ``mode`` is below the bf16 time."""
        grid = self.grid(mode)
        fp8_ms, bf16_ms, how = grid.predict(tokens, in_features, out_features)
        fp8 = fp8_ms < bf16_ms
        reason = (f"auto, {mode}: fp8 predicted {bf16_ms / fp8_ms:.2f}x faster" if fp8 else
                  f"auto, {mode}: fp8 predicted slower ({bf16_ms / fp8_ms:.2f}x)")
        steps = f"{grid.mode} steps" + ("" if grid.mode == mode else f" (approximating {mode})")
        src = f"{self.path.name if self.path else 'table'}, {steps}: {how}"
        return Decision(name, int(tokens), int(in_features), int(out_features), fp8, reason, fp8_ms, bf16_ms, src,
                        mode)


# ---- finding the table -----------------------------------------------------------------------
def find_table(device: str | None = None, table=None) -> PolicyTable:
    """The calibration table to use: ``table`` (a :class:`PolicyTable` or a path), else the file
    named by ``$FUSEDFP8_POLICY_TABLE``, else the table shipped for ``device`` (the GPU's CUDA
    name, e.g. ``torch.cuda.get_device_name()`` or a jax device's ``device_kind``).

    Raises
    ------
    TypeError
        ``table`` is neither a PolicyTable, a path nor None.
    FileNotFoundError
        ``table`` or ``$FUSEDFP8_POLICY_TABLE`` names a file that does not exist.
    MissingTableError
        No table given and none shipped for ``device`` (or ``device`` is None: no GPU seen).
    ValueError
        The table is malformed (see :class:`PolicyTable`).
    """
    if isinstance(table, PolicyTable):
        return table
    if table is not None and not isinstance(table, (str, os.PathLike)):
        raise TypeError(f"policy table must be a fusedfp8.policy.PolicyTable, a path to a JSON table or None; got "
                        f"{type(table).__name__}")
    how = "the policy table argument"
    if table is None and os.environ.get(TABLE_ENV):
        table, how = os.environ[TABLE_ENV], f"${TABLE_ENV}"
    if table is not None:
        if not Path(table).is_file():
            raise FileNotFoundError(f"{how} names {str(table)!r}, which is not a file; measure a table with "
                                    f"`{CALIBRATE_COMMAND}`")
        return PolicyTable.load(table)
    use = (f"`{CALIBRATE_COMMAND}` measures one on the GPU (a few minutes) and says where it wrote it; pass that "
           f"file as the policy table argument or set {TABLE_ENV}=PATH")
    if device is None:
        raise MissingTableError(f"policy='auto' picks its calibration table by the GPU's name, and no CUDA device is "
                                f"visible here; pass a table explicitly (or set {TABLE_ENV}). {use}")
    path = DATA_DIR / table_file_name(device)
    if not path.is_file():
        have = [p.name for p in shipped_tables()]
        raise MissingTableError(f"no calibration table for the GPU {device!r} ({path.name}); fusedfp8 ships "
                                f"{'tables for ' + ', '.join(have) if have else 'no table yet'}. {use}")
    found = PolicyTable.load(path)
    if device_slug(found.device) != device_slug(device):
        raise ValueError(f"policy table {path}: measured on {found.device!r}, but its file name is that of {device!r}")
    return found


def decide(tokens: int, in_features: int, out_features: int, *, policy: str = "auto", mode: str = "eager",
           device: str | None = None, table=None, name: str = "") -> Decision:
    """The :class:`Decision` of ``policy`` ('auto' or 'all') for one layer run in the execution
    mode ``mode`` ('eager', 'graphed' or 'compiled': see the module's docstring); see
    :func:`find_table` for ``device`` and ``table``; 'all' consults no table. Raises as
    :func:`find_table`, and :class:`MissingModeError` when the table lacks the mode's grid."""
    policy = check_policy(policy, allow_none=False)
    mode = check_mode(mode)
    dims = check_dims(tokens, in_features, out_features)
    if policy == "all":
        return Decision(name, dims[0], dims[1], dims[2], True, "policy='all'")
    return find_table(device, table).decide(*dims, name=name, mode=mode)
