"""The launch-plan format: what a plan is, as data, and its byte encodings.

A plan is the pure-data description of one call's launches (:mod:`fusedfp8.launch.plans` builds
them): memsets and kernel launches, each kernel by handle and by stable id, with its grid, block
and parameters. Two executors read it: the Python one (:mod:`fusedfp8.launch.executor`) and the
compiled shim's (``fusedfp8/csrc/plan.h``: the XLA FFI handler and the torch C++ ops), which gets
it as int64s (:meth:`Plan.encode`) naming each kernel by its stable id
(:func:`fusedfp8.launch.kernels.kernel_id`): a handle is a pointer that means nothing in another
process, and an XLA program holds its encoded plans as attributes. The constants below are
plan.h's (``kPlanVersion``, whose mirror :data:`fusedfp8.csrc.PLAN_VERSION` a library is checked
against when it loads; the step and parameter kinds); tests/kernels/test_launch_layout.py holds
the two sides against each other.

A plan names buffers by slot (:class:`Slots`: the names of a plan family's buffers, in the one
order their pointers come in): a parameter is "the pointer of slot i plus a byte offset", and the
caller hands one device pointer per slot, 0 for an absent buffer (whose pointer parameters are
then null, whatever their offset).

Nothing here imports a framework, CuPy or the driver.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from ..csrc import PLAN_VERSION  # the version of this format: the one the shim's libraries read
MEMSET, LAUNCH, COOP_LAUNCH = 0, 1, 2  # step kinds (COOP_LAUNCH: a LAUNCH through cuLaunchCooperativeKernel)
I64, I32, F32, PTR, NULL, FLAG = 1, 2, 3, 4, 5, 6  # parameter (token) kinds
_LAYOUT_CHAR = {I64: "q", I32: "i", F32: "f", PTR: "P", NULL: "P", FLAG: "i"}
_PACK_CHAR = {I64: "q", I32: "i", F32: "I", PTR: "Q", NULL: "Q", FLAG: "i"}  # F32 goes in as its bits


class Slots(tuple):
    """The buffer names of a plan family, in the order its pointers come in: the one place that
    order is written. A name's slot is its attribute (``QUANTIZE_SLOTS.amax``); :meth:`arrange`
    puts buffers given by name into slot order."""

    __slots__ = ()

    def __new__(cls, *names: str):
        bad = [n for n in names if not n.isidentifier() or n.startswith("_") or hasattr(tuple, n) or n == "arrange"]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"fusedfp8: buffer slots need distinct names, none an attribute of a tuple; got {names}")
        return super().__new__(cls, names)

    def __getnewargs__(self):
        return tuple(self)

    def __getattr__(self, name: str) -> int:
        if name in self:
            return self.index(name)
        raise AttributeError(f"fusedfp8: no buffer slot {name!r} (the slots are {', '.join(self)})")

    def arrange(self, buffers, absent=0) -> tuple:
        """The values of ``buffers`` ({slot name: value}) in slot order, ``absent`` for a slot not
        named; ValueError for a name that is no slot (a misspelt buffer would otherwise be null)."""
        if not buffers.keys() <= set(self):
            raise ValueError(f"fusedfp8: {sorted(set(buffers) - set(self))} are no buffer slots of this plan (its "
                             f"slots are {', '.join(self)})")
        return tuple(buffers.get(n, absent) for n in self)


class Token(NamedTuple):
    """One kernel parameter. I64 / I32: the immediate ``a``; F32: ``a`` = the float's bits; PTR: the
    pointer of slot ``a`` plus ``b`` bytes (null when the slot's pointer is 0); NULL: a null
    pointer; FLAG: int32 1 iff ``c`` (a static condition) is 1 and the pointer of every slot in
    the bit mask ``a`` is a multiple of ``b``, else 0."""

    kind: int
    a: int = 0
    b: int = 0
    c: int = 0


def mask(slots) -> int:
    """The bit mask of the slot indices ``slots`` (a launch's ``select``, a FLAG's ``a``)."""
    return sum(1 << s for s in set(slots))


def imm64(v: int) -> Token:
    return Token(I64, int(v))


def imm32(v: int) -> Token:
    return Token(I32, int(v))


def immf32(v: float) -> Token:
    return Token(F32, struct.unpack("<I", struct.pack("<f", v))[0])


def ptr(slot: int, offset: int = 0) -> Token:
    return Token(PTR, slot, offset)


NULLPTR = Token(NULL)


def flag(slots, align: int, cond: bool = True) -> Token:
    return Token(FLAG, mask(slots), align, int(bool(cond)))


class Variant(NamedTuple):
    """One kernel a launch step may run: its CUfunction handle (the Python executor's), grid
    (blocks), name and stable id (the encoded plan's)."""

    func: int
    grid: int
    name: str
    kid: int


class Launch(NamedTuple):
    """A kernel launch: ``variants[0]`` when the pointers of every slot in the bit mask ``select``
    are 16-byte aligned (always, for a mask of 0), else ``variants[1]``; ``block`` threads; the
    parameters laid out as the kernel declares them (natural alignment, no trailing padding);
    ``shared`` bytes of dynamic shared memory; ``coop``: a cooperative launch (all blocks resident
    at once, the grid-wide barrier's workspace; the driver refuses a grid larger than resident)."""

    variants: tuple
    select: int
    block: int
    params: tuple
    shared: int = 0
    coop: bool = False

    @property
    def layout(self) -> str:
        return "@" + "".join(_LAYOUT_CHAR[t.kind] for t in self.params)


class Memset(NamedTuple):
    """Zero ``nbytes`` (a multiple of 4) of slot ``slot``'s buffer on the stream (none for a null slot)."""

    slot: int
    nbytes: int


class Plan(NamedTuple):
    slots: Slots  # the buffer names, in the order the caller's pointers come in
    steps: tuple  # Memset | Launch, in launch order
    program: tuple  # the steps, pre-digested for the Python executor (make_plan)
    # the CUDA ordinal whose context holds the kernels (their handles are valid there only); -1 for a
    # plan of made-up kernels, which runs in whatever context is current
    device: int = -1

    def encode(self) -> tuple[np.ndarray, str]:
        """(int64 array, names) for the compiled shim: ``[PLAN_VERSION, n_slots, n_steps]``, then per
        step ``[MEMSET, slot, nbytes]`` or ``[LAUNCH | COOP_LAUNCH, n_variants, select, block,
        shared_bytes, n_params, (kernel id, grid) * n_variants, (kind, a, b, c) * n_params]``;
        names: the variants' kernel names in the same order, joined by ';'. No handle: the same
        bytes in every process that builds the plan on the same device."""
        out = [PLAN_VERSION, len(self.slots), len(self.steps)]
        names = []
        for st in self.steps:
            if isinstance(st, Memset):
                out += [MEMSET, st.slot, st.nbytes]
                continue
            out += [COOP_LAUNCH if st.coop else LAUNCH, len(st.variants), st.select, st.block, st.shared,
                    len(st.params)]
            for v in st.variants:
                out += [v.kid, v.grid]
                names.append(v.name)
            for t in st.params:
                out += list(t)
        return np.array(out, dtype=np.int64), ";".join(names)


def _packer(st: Launch, n_slots: int):
    """``pack(ptrs) -> (variant index, parameter values)`` of one launch, generated once per plan
    (as namedtuple does) so that a call costs one Python function call, not a walk over tokens."""

    def aligned(bits: int, align: int) -> str:
        tests = [f"p[{i}] % {align} == 0" for i in range(n_slots) if bits >> i & 1]
        return " and ".join(tests) or "True"

    values = []
    for t in st.params:
        if t.kind == PTR:
            if not 0 <= t.a < n_slots:
                raise ValueError(f"fusedfp8: a plan parameter points at slot {t.a} of {n_slots}")
            values.append(f"p[{t.a}]" if t.b == 0 else f"(p[{t.a}] + {t.b} if p[{t.a}] else 0)")
        elif t.kind == FLAG:
            values.append(f"int({aligned(t.a, t.b)})" if t.c else "0")
        elif t.kind == NULL:
            values.append("0")
        else:
            values.append(str(int(t.a)))
    choice = f"0 if {aligned(st.select, 16)} else 1" if st.select else "0"
    scope: dict = {}
    exec(f"def pack(p):\n    return ({choice}), ({', '.join(values)},)\n", scope)  # noqa: S102 - generated from ints
    return scope["pack"]


def param_offsets(layout: str) -> tuple:
    """Byte offset of each parameter of the packed layout ``layout`` ('@' + one character a
    parameter): cuLaunchCooperativeKernel takes a pointer per parameter, not the packed buffer."""
    return tuple(struct.calcsize(layout[:i + 1]) - struct.calcsize(layout[i]) for i in range(1, len(layout)))


def make_plan(slots: Slots, steps) -> Plan:
    """The plan of ``steps`` over ``slots``, checked (slot indices, variant counts, shared memory)
    and pre-digested for the Python executor: per launch its variants, block, struct format,
    packed size, packer (:func:`_packer`), shared bytes and, for a cooperative launch, the
    parameters' offsets."""
    program = []
    for st in steps:
        if isinstance(st, Memset):
            if st.nbytes % 4 or st.nbytes < 0 or not 0 <= st.slot < len(slots):
                raise ValueError(f"fusedfp8: a memset of {st.nbytes} bytes of slot {st.slot} cannot be planned")
            program.append((MEMSET, st.slot, st.nbytes))
            continue
        if not 1 <= len(st.variants) <= 2 or (st.select and len(st.variants) != 2):
            raise ValueError("fusedfp8: a launch has one variant, or two chosen by a select mask")
        if st.shared < 0:
            raise ValueError(f"fusedfp8: a launch cannot ask for {st.shared} bytes of shared memory")
        fmt = "@" + "".join(_PACK_CHAR[t.kind] for t in st.params)
        program.append((COOP_LAUNCH if st.coop else LAUNCH, st.variants, st.block, fmt, struct.calcsize(fmt),
                        _packer(st, len(slots)), st.shared, param_offsets(fmt) if st.coop else ()))
    return Plan(slots if isinstance(slots, Slots) else Slots(*slots), tuple(steps), tuple(program))
