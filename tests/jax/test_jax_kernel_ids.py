"""An XLA program holding fusedfp8 kernels is the same program in every process: its launch plans
name the kernels by stable id (fusedfp8.launch.kernels.kernel_id), not by CUfunction handle (a pointer
of one process), so JAX's persistent compilation cache serves it to the next process, and an
executable run where its kernels were never loaded is refused by name.

The tests run tests/run/jax_kernel_ids.py in two fresh processes: a flax train step (Dense with
Fp8DotGeneral, a residual Fp8MLP, Adam) lowered for CUDA in processes made to see one GPU with
random kernel handles (CPU), or trained with the compilation cache shared (GPU, marked); and an
executable serialized in one process and loaded in the other (GPU, marked)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fusedfp8.launch import format as P

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "run" / "jax_kernel_ids.py"


def _start(mode: str, out: Path, **env) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **env}
    return subprocess.Popen([sys.executable, str(SCRIPT), mode, str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: int = 600) -> None:
    log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, log[-4000:]


def kernel_fields(plan: list) -> list:
    """The kernel field of every variant of every launch step of an encoded plan (Plan.encode's format)."""
    assert plan[0] == P.PLAN_VERSION
    out, at = [], 3
    for _ in range(plan[2]):
        if plan[at] == P.MEMSET:
            at += 3
            continue
        nvar, ntok = plan[at + 1], plan[at + 5]
        out += plan[at + 6:at + 6 + 2 * nvar:2]
        at += 6 + 2 * nvar + 4 * ntok
    assert at == len(plan)
    return out


def launch_attributes(text: str) -> list:
    """The int64 array attributes of every fusedfp8_launch call, {name: ints}; MLIR prints a large
    one as a hex blob (little-endian), a small one as a list."""
    out = []
    for call in (ln for ln in text.splitlines() if "@fusedfp8_launch" in ln):
        attrs = {}
        for name, value in re.findall(r"(\w+) = dense<([^>]*)> : tensor<\d*x?i64>", call):
            if value.startswith('"0x'):
                attrs[name] = np.frombuffer(bytes.fromhex(value[3:-1]), "<i8").tolist()
            else:
                attrs[name] = [int(v) for v in value.strip("[]").split(",") if v.strip()]
        assert {"plans", "offsets", "slots", "aliases"} <= set(attrs), call[:300]
        out.append(attrs)
    return out


def test_a_lowered_train_step_holds_no_number_of_its_process(tmp_path):
    """Two processes lower the same jitted train step for CUDA (impl='auto': the FFI launch; per-tensor
    and block-scaled layers), each with kernel handles of its own (random): the StableHLO texts are
    equal; every kernel field of every plan is the id of a kernel its process loaded (block_quantize
    among them), the same ids in both; no handle of either process appears anywhere in the text."""
    outs = [tmp_path / f"{k}.json" for k in range(2)]
    procs = [_start("lower", out, JAX_PLATFORMS="cpu") for out in outs]
    for proc in procs:
        _finish(proc)
    a, b = (json.loads(out.read_text()) for out in outs)
    assert a["handles"] != b["handles"] and sorted(a["ids"]) == sorted(b["ids"])  # the handles were random
    assert a["text"] == b["text"]
    calls = launch_attributes(a["text"])
    assert len(calls) >= 10  # every quantization of the forward and backward, and each module's update
    assert all(c["offsets"] == [0] for c in calls)  # one GPU: one plan a call
    fields = {f for c in calls for f in kernel_fields(c["plans"])}
    assert fields <= set(a["ids"]) and len(fields) >= 5
    named = {kid: name for kid, name in zip(a["ids"], a["names"])}
    assert any(named[f].startswith("block_quantize<") for f in fields)  # the block-scaled layer's plans too
    handles = {h for h in a["handles"] + b["handles"]}
    assert not handles & {v for c in calls for ints in c.values() for v in ints}
    assert not {str(h) for h in handles} & set(re.findall(r"\d+", a["text"]))


@pytest.mark.gpu
@pytest.mark.jax_gpu
def test_a_second_process_compiles_nothing_and_gives_the_same_bytes(tmp_path):
    """The train step in a process, then in a second one sharing its persistent compilation cache:
    the second compiles no program (no cache write, every request a hit, the cache folder's entries
    unchanged) and its losses and variables after three steps are the first's, byte for byte.
    (Before plans named kernels by id, the handles in the plans made each process's program new:
    3 misses in 52 on the H200.)"""
    cache = tmp_path / "xla-cache"
    cache.mkdir()
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()}
    runs, entries = [], []
    for k in range(2):
        out = tmp_path / f"{k}.npz"
        _finish(_start("train", out, **env))
        runs.append(dict(np.load(out)))
        entries.append(sorted(p.name for p in cache.glob("*-cache")))  # (jax's LRU cache: one file a program)
    first, second = runs
    assert first["misses"] >= 1 and entries[0]  # the first process filled the cache
    assert str(second["text"]) == str(first["text"])
    assert second["misses"] == 0, f"compiled again: {second['missed']}"
    assert second["hits"] == second["requests"] >= 1
    assert entries[1] == entries[0]
    assert sorted(first) == sorted(second)
    for key in first:
        if key not in ("requests", "hits", "misses", "missed"):
            assert first[key].tobytes() == second[key].tobytes(), key


@pytest.mark.gpu
@pytest.mark.jax_gpu
def test_a_serialized_executable_refuses_kernels_its_process_has_not_loaded(tmp_path):
    """An executable of the primitives' step serialized in one process and loaded in a fresh one:
    run before anything there traced a fusedfp8 function, the handler refuses it, naming the kernel
    and what to do (it launched a dead handle before kernels were named by id); after the process
    traced the step (which loads and registers its kernels) the same executable gives the first
    process's bytes."""
    _finish(_start("serialize", tmp_path))
    _finish(_start("run_serialized", tmp_path))
    refused = (tmp_path / "refused.txt").read_text()
    assert re.search(r"fusedfp8: kernel \S.* is not loaded on CUDA device 0 in this process \(kernel id [0-9a-f]{16}\)",
                     refused), refused
    assert "trace the function in this process first" in refused
    direct, loaded = dict(np.load(tmp_path / "direct.npz")), dict(np.load(tmp_path / "loaded.npz"))
    assert sorted(direct) == sorted(loaded) and len(direct) == 7
    for key in direct:
        assert direct[key].tobytes() == loaded[key].tobytes(), key
