"""impl 'ptx' lowered for CUDA on a machine without a GPU: what the lowering needs of a GPU, faked.

:func:`fake_gpu` makes jax's CUDA lowering of the primitives believe in one local GPU (CUDA
ordinal 0) of compute capability 9.0 with :data:`SMS` multiprocessors whose kernels each have
:data:`PER_SM` resident blocks: the plans are built from name expressions alone
(:func:`fake_refs`, no CuPy, no module), so that the custom calls carry the plans' real grids,
blocks and parameters. ``compile`` False: the PTX is the wrapper's source (no NVRTC in the
process: torch 2.13 cannot torch.load some tensors in a process that has compiled with
cuda-bindings' NVRTC, see tests/support/nvrtc.py); True: NVRTC's PTX (tests/run/ptx_compile.py).
"""
from __future__ import annotations

import re

from fusedfp8 import _cuda

SMS = 132
PER_SM = 4
CC = 90


def fake_refs(key: _cuda.ModuleKey, device: int) -> dict:
    return {role: _cuda.KernelRef(1000 + i, expr, role, PER_SM)
            for i, (role, expr) in enumerate(_cuda.name_expressions(key).items())}


def fake_gpu(setattr_, compile: bool = False, auto: bool = True):
    """Patch (with ``setattr_(obj, name, value)``, e.g. pytest's ``monkeypatch.setattr``) what the
    CUDA lowering of impl 'ptx' asks of a GPU; with ``auto``, impl='auto' lowers its CUDA branch to
    'ptx'. Clear the plan caches after (:func:`clear_plans`)."""
    from fusedfp8.jax import callbacks as C
    from fusedfp8.jax import primitives as JP
    from fusedfp8.jax import ptx as X

    clear_plans()
    setattr_(C, "gpu_devices", lambda: [0])
    setattr_(_cuda, "kernel_refs", fake_refs)
    setattr_(_cuda, "sm_count", lambda device: SMS)
    setattr_(X, "compute_capability", lambda device: CC)
    if auto:
        setattr_(JP, "_auto_backend", lambda: "ptx")
    if not compile:
        setattr_(X, "compile_ptx", lambda family, wrapper, cc: f"// {family} compute_{cc}\n{wrapper}")


def clear_plans():
    for fn in (_cuda.quantize_plan, _cuda.amax_plan, _cuda.update_plan):
        fn.cache_clear()


CALL = re.compile(r"stablehlo\.custom_call @(\S+?)\(")


def custom_calls(text: str) -> list[str]:
    """The custom call lines of a StableHLO text."""
    return [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]


def targets(text: str) -> list[str]:
    return [CALL.search(ln).group(1) for ln in custom_calls(text)]


def attr(line: str, name: str) -> str:
    m = re.search(rf"\b{name} = ([^,}}]+?)(?: : i32)?[,}}]", line)
    return m.group(1) if m else None


def kernel_data(line: str) -> str:
    """The kernel_data string of a PTX call line, unescaped (MLIR's \\XX escapes)."""
    m = re.search(r'kernel_data = "((?:[^"\\]|\\.)*)"', line)
    return re.sub(r"\\([0-9A-F]{2})", lambda h: chr(int(h.group(1), 16)), m.group(1)) if m else None


def n_aliases(line: str) -> int:
    return line.count("output_operand_alias<")


KNOWN_TO_RUN = (0, 11, 2)  # jaxlib measured to run XLA's PTX custom call (H200, 2026-12-04)


def require_ptx() -> None:
    """On a GPU: skip where this jaxlib is older than one known to run the PTX custom call and
    its probe fails; FAIL where the jaxlib should run it and the probe says it does not (a broken
    probe or wrapper must not pass as a skip)."""
    import jaxlib
    import pytest

    from fusedfp8.jax import ptx

    ok, why = ptx.supported()
    if ok:
        return
    version = tuple(int(p) for p in re.findall(r"\d+", jaxlib.__version__)[:3])
    if version < KNOWN_TO_RUN:
        pytest.skip(f"impl='ptx': {why}")
    pytest.fail(f"impl='ptx' should run on jaxlib {jaxlib.__version__} (>= {KNOWN_TO_RUN}), but: {why}")
