"""The cross-rank MAX of the staged amaxes: one ``torch.distributed.all_reduce`` per step.

With data (or tensor, or sequence) parallelism every rank must quantize with the same scales, so
before the update the staged amaxes (row 0 of every linked state, see ``convert.py``) are
MAX-reduced over the process group. Linking already put them in one place: a model whose FP8
modules share one recipe and one device has ONE model-level state, whose history is a
contiguous (L, n) tensor, so its row 0 is a contiguous (n,) view that is reduced in place. Several
linked states on one device (several recipes) are concatenated into one buffer first and copied
back afterwards. Either way it is one collective per device holding FP8 state (one per step in the
usual one-device-per-rank setup).

Non-finite amaxes. The update rule treats NaN and inf alike (an overflow: scale kept, slot
cleared), so NaN is sent as +inf. A MAX over +inf is +inf whatever the order, so a non-finite
amax on any rank is an overflow on every rank. A NaN itself could not be trusted to survive the
reduction: gloo's MAX keeps or drops it depending on which rank holds it (measured with torch
2.13: ``max(NaN on rank 0, 1.0) = NaN`` but ``max(1.0, NaN on rank 1) = 1.0``), and NCCL does
not specify what its MAX does with NaN. The mapping is the only change it makes to the staged
values, and it changes no result: the rank that saw the NaN would have counted an overflow
either way.

A rank whose module did not run this step staged 0 for it; it still takes part in the collective
(every rank must call ``update_scales`` with the same group, with the same FP8 modules in the same
order) and afterwards holds the same state as the ranks that ran it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["check_group", "reduce_staged_amaxes"]


def check_group(group) -> None:
    """Raise if ``group`` cannot carry the reduction (before anything is written)."""
    if not dist.is_available():
        raise RuntimeError("group: torch.distributed is not available in this build of torch, so the amaxes cannot "
                           "be reduced across ranks; pass group=None")
    if not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized; call torch.distributed.init_process_group "
                           "first, or pass group=None for a single-process update")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD or one "
                        f"made by torch.distributed.new_group) or None; got {type(group).__name__}")


class _Reduction:
    """One in-flight (or finished) all_reduce over the staged rows of some linked states."""

    def __init__(self, rows: list[torch.Tensor], group, async_op: bool):
        if len(rows) == 1:
            self.buffer = rows[0]  # row 0 of a contiguous (L, n) history: reduced in place
            self.rows = []
        else:
            self.buffer = torch.cat(rows)
            self.rows = rows
        self.buffer.nan_to_num_(nan=float("inf"), posinf=float("inf"))
        self.work = dist.all_reduce(self.buffer, op=dist.ReduceOp.MAX, group=group, async_op=async_op)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()  # on NCCL: the current stream waits; the host does not
            self.work = None
        start = 0
        for row in self.rows:
            row.copy_(self.buffer[start:start + row.numel()])
            start += row.numel()
        self.rows = []


def reduce_staged_amaxes(histories: list[torch.Tensor], group, async_op: bool = False) -> list[_Reduction]:
    """MAX-reduce row 0 of each (L, n) history over ``group``: one all_reduce per device.

    Returns the reductions; call ``wait()`` on each before the histories are read (a no-op
    beyond the scatter back when ``async_op`` is False).
    """
    by_device: dict = {}
    for h in histories:
        by_device.setdefault(h.device, []).append(h[0])
    return [_Reduction(rows, group, async_op) for rows in by_device.values()]
