"""What ``policy='auto'`` decided, per linear layer (:class:`Decision`) and per conversion
(:class:`ConversionReport`); re-exported by :mod:`fusedfp8.policy`. Plain Python."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Decision", "ConversionReport"]


@dataclass(frozen=True)
class Decision:
    """What a policy decided for one linear layer.

    ``name`` (the module's name, '' for a lone layer), ``tokens`` (None when the policy does not
    use it), ``in_features``, ``out_features``, ``fp8`` (True: converted), ``reason`` (why, in
    words), ``fp8_ms`` / ``bf16_ms`` (the predicted forward + backward times, None when no table
    was consulted), ``source`` (where the figures come from: the table, which of its measured
    modes, and whether they were measured, interpolated or taken at the grid's edge) and ``mode``
    (the execution mode the decision is for: 'eager', 'graphed' or 'compiled'; None when no table
    was consulted)."""

    name: str
    tokens: int | None
    in_features: int
    out_features: int
    fp8: bool
    reason: str
    fp8_ms: float | None = None
    bf16_ms: float | None = None
    source: str = ""
    mode: str | None = None

    @property
    def speedup(self) -> float | None:
        """Predicted bf16 time / fp8 time (None without figures)."""
        return None if self.fp8_ms is None else self.bf16_ms / self.fp8_ms


def _ms(v) -> str:
    return "-" if v is None else f"{v:.4f}"


@dataclass(frozen=True)
class ConversionReport:
    """The decisions of one conversion, one :class:`Decision` per linear layer considered, in
    module order. ``policy``, ``tokens``, ``table`` (a description of the table used, or '') and
    ``mode`` (the execution mode decided for, None with policy='all') are the conversion's
    settings; ``str(report)`` is a markdown table; :meth:`rows` gives (name, in, out, decision,
    fp8 ms, bf16 ms, source) tuples."""

    policy: str
    tokens: int | None
    table: str
    decisions: tuple
    mode: str | None = None

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
        if self.mode is not None:
            head += f", mode={self.mode!r}"
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
