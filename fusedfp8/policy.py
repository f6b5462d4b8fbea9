"""Which linear layers gain from FP8: the calibration table and the decision of ``policy='auto'``.

FP8 GEMMs are faster than bf16 ones, but every FP8 linear also quantizes its input, its weight
and its output gradient, and launches more kernels from the host. For a small layer (few tokens,
narrow features) that costs more than the GEMMs save, so ``policy='auto'`` keeps it in bf16.
The decision is read from a table measured on the GPU by ``scripts/calibrate_policy.py``
(``python -m fusedfp8 bench --calibrate``): for a grid of (tokens, in_features, out_features),
the median time of one forward + backward (input and weight gradients) of a bf16 ``nn.Linear``
and of an ``Fp8Linear`` (its quantizations and its scale update included).

Prediction. The grid is a product of its axes (every tokens x in x out of the listed values). A
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
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PolicyTable", "Decision", "ConversionReport", "MissingTableError", "find_table", "decide",
           "table_file_name", "shipped_tables", "POLICIES", "TABLE_ENV", "CALIBRATE_COMMAND"]

POLICIES = ("all", "auto")
TABLE_ENV = "FUSEDFP8_POLICY_TABLE"
TABLE_FORMAT = "fusedfp8-policy-table/1"
CALIBRATE_COMMAND = "python -m fusedfp8 bench --calibrate"
DATA_DIR = Path(__file__).resolve().parent / "data"
AXES = ("tokens", "in_features", "out_features")


class MissingTableError(LookupError):
    """No calibration table for this GPU (measure one with ``python -m fusedfp8 bench --calibrate``)."""


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


# ---- decisions and the report ----------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """What a policy decided for one linear layer.

    ``name`` (the module's name, '' for a lone layer), ``tokens`` (None when the policy does not
    use it), ``in_features``, ``out_features``, ``fp8`` (True: converted), ``reason`` (why, in
    words), ``fp8_ms`` / ``bf16_ms`` (the predicted forward + backward times, None when no table
    was consulted) and ``source`` (where the figures come from: the table and whether they were
    measured, interpolated or taken at the grid's edge)."""

    name: str
    tokens: int | None
    in_features: int
    out_features: int
    fp8: bool
    reason: str
    fp8_ms: float | None = None
    bf16_ms: float | None = None
    source: str = ""

    @property
    def speedup(self) -> float | None:
        """Predicted bf16 time / fp8 time (None without figures)."""
        return None if self.fp8_ms is None else self.bf16_ms / self.fp8_ms


def _ms(v) -> str:
    return "-" if v is None else f"{v:.4f}"


@dataclass(frozen=True)
class ConversionReport:
    """The decisions of one conversion, one :class:`Decision` per linear layer considered, in
    module order. ``policy``, ``tokens`` and ``table`` (a description of the table used, or '')
    are the conversion's settings; ``str(report)`` is a markdown table; :meth:`rows` gives
    (name, in, out, decision, fp8 ms, bf16 ms, source) tuples."""

    policy: str
    tokens: int | None
    table: str
    decisions: tuple

    @property
    def converted(self) -> list[str]:
        """Names of the layers converted to FP8."""
        return [d.name for d in self.decisions if d.fp8]

    @property
    def kept(self) -> list[str]:
        """Names of the layers left in high precision."""
        return [d.name for d in self.decisions if not d.fp8]

    def __iter__(self):
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def __getitem__(self, name: str) -> Decision:
        """The decision of the layer called ``name``."""
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(name)

    def rows(self) -> list[tuple]:
        return [(d.name, d.in_features, d.out_features, "fp8" if d.fp8 else "bf16", d.fp8_ms, d.bf16_ms,
                 d.source) for d in self.decisions]

    def __str__(self) -> str:
        head = f"fusedfp8 conversion: policy={self.policy!r}"
        if self.tokens is not None:
            head += f", tokens={self.tokens}"
        if self.table:
            head += f", table {self.table}"
        head += f"; {len(self.converted)} of {len(self.decisions)} linear layers converted to FP8"
        lines = [head, "", "| layer | in | out | decision | reason | fp8 ms | bf16 ms | speed-up | source |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for d in self.decisions:
            sp = "-" if d.speedup is None else f"{d.speedup:.2f}x"
            lines.append(f"| {d.name or '(model)'} | {d.in_features} | {d.out_features} | "
                         f"{'fp8' if d.fp8 else 'bf16'} | {d.reason} | {_ms(d.fp8_ms)} | {_ms(d.bf16_ms)} | {sp} | "
                         f"{d.source or '-'} |")
        return "\n".join(lines)


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


class PolicyTable:
    """A calibration table: per (tokens, in_features, out_features) of a product grid, the median
    ms of one forward + backward in bf16 and in fp8 on ``device``.

    JSON form (what ``scripts/calibrate_policy.py`` writes)::

        {"format": "fusedfp8-policy-table/1", "device": "NVIDIA H200", "date": "2026-12-05",
         "versions": {"fusedfp8": ..., "torch": ..., "cuda": ...}, "meta": {...how it was measured},
         "points": [{"tokens": 512, "in_features": 256, "out_features": 256,
                     "bf16_ms": 0.041, "fp8_ms": 0.113, ...more fields are kept}, ...]}

    Raises ValueError (naming the file and the field) on anything else, and when the points do
    not cover the whole product of their axes.
    """

    def __init__(self, device: str, points: list, *, date: str = "", versions: dict | None = None,
                 meta: dict | None = None, path: str | os.PathLike | None = None):
        self.path = None if path is None else Path(path)
        where = f"policy table {self.path}" if self.path else "policy table"
        if not isinstance(device, str) or not device:
            raise ValueError(f"{where}: 'device' must be the GPU's name (a non-empty str); got {device!r}")
        if not isinstance(points, list) or not points:
            raise ValueError(f"{where}: 'points' must be a non-empty list; got {type(points).__name__}")
        self.device, self.date = device, str(date)
        self.versions, self.meta = dict(versions or {}), dict(meta or {})
        self.points = [self._check_point(where, i, p) for i, p in enumerate(points)]
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

    @staticmethod
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

    # -- JSON ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data, path=None) -> "PolicyTable":
        where = f"policy table {path}" if path else "policy table"
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a JSON object; got {type(data).__name__}")
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"{where}: 'format' must be {TABLE_FORMAT!r}; got {data.get('format')!r}")
        return cls(data.get("device"), data.get("points"), date=data.get("date", ""),
                   versions=data.get("versions"), meta=data.get("meta"), path=path)

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
        return {"format": TABLE_FORMAT, "device": self.device, "date": self.date, "versions": self.versions,
                "meta": self.meta, "points": self.points}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        self.path = path
        return path

    def describe(self) -> str:
        """'policy_nvidia_h200.json (NVIDIA H200, 2026-12-05, fusedfp8 0.1.0)'."""
        what = ", ".join(x for x in (self.device, self.date, f"fusedfp8 {self.versions['fusedfp8']}"
                                     if "fusedfp8" in self.versions else "") if x)
        return f"{self.path.name if self.path else '(in memory)'} ({what})"

    def __repr__(self) -> str:
        return (f"PolicyTable({self.describe()}, tokens {list(self.axes[0])} x in {list(self.axes[1])} x out "
                f"{list(self.axes[2])})")

    # -- prediction ------------------------------------------------------------------------------
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

    def decide(self, tokens: int, in_features: int, out_features: int, name: str = "") -> Decision:
        """FP8 when the predicted fp8 time is below the bf16 time."""
        fp8_ms, bf16_ms, how = self.predict(tokens, in_features, out_features)
        fp8 = fp8_ms < bf16_ms
        reason = (f"auto: fp8 predicted {bf16_ms / fp8_ms:.2f}x faster" if fp8 else
                  f"auto: fp8 predicted slower ({bf16_ms / fp8_ms:.2f}x)")
        src = f"{self.path.name if self.path else 'table'}: {how}"
        return Decision(name, int(tokens), int(in_features), int(out_features), fp8, reason, fp8_ms, bf16_ms, src)


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


def decide(tokens: int, in_features: int, out_features: int, *, policy: str = "auto", device: str | None = None,
           table=None, name: str = "") -> Decision:
    """The :class:`Decision` of ``policy`` ('auto' or 'all') for one layer (see :func:`find_table`
    for ``device`` and ``table``; 'all' consults no table)."""
    policy = check_policy(policy, allow_none=False)
    dims = check_dims(tokens, in_features, out_features)
    if policy == "all":
        return Decision(name, dims[0], dims[1], dims[2], True, "policy='all'")
    return find_table(device, table).decide(*dims, name=name)
