"""The long subprocess entry points of tests/run/, run beside the in-process tests.

A test that reads the result of one marks itself ``@pytest.mark.background("<job>")`` and asks
``background.result("<job>")`` (the session fixture of tests/conftest.py). When collection ends,
tests/conftest.py starts the jobs that the collected tests need, one at a time on a thread (one
a process: under pytest-xdist each worker's thread claims the next job nobody runs yet), in the
order of :data:`JOBS`, and moves those tests to the end of the session (in that order): a job's
compile time (NVRTC, XLA) then overlaps the in-process tests instead of adding to them. A job
that was not started (a test without the marker) starts when it is asked for.

Each job is a list of steps (commands) run in order in fresh processes; a step that fails stops
the job. Its files go to a folder of its own (``JobResult.out``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
RUN = TESTS / "run"
TIMEOUT = 900  # seconds a job may take, all steps together


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _script(name: str, *args) -> list:
    return [sys.executable, str(RUN / name), *map(str, args)]


def _flax_checkpoint(out: Path) -> list:
    """Both legs of the flax checkpoint test in fresh processes: the uninterrupted run (it saves the
    TrainState before step 50) and the restored one (from_bytes, steps 50..99). Both with
    ``--xla_gpu_deterministic_ops=true``: XLA:GPU picks its GEMM algorithms by timing them at
    compile time, so two processes can compile the same step with different algorithms (a
    different summation order); on the H200 without the flag the restored run differed from its
    first step on. The flag turns the autotuning off; harmless on the CPU."""
    ckpt = out / "step50.msgpack"
    env = _env(XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip())
    return [(_script("flax_checkpoint.py", 0, 100, out / "whole.npz", "--save-at", 50, ckpt), env),
            (_script("flax_checkpoint.py", 50, 100, out / "resumed.npz", "--load", ckpt), env)]


def _bench_jax(out: Path) -> list:
    """scripts/bench_mlp_jax.py's CPU smoke run under both recipes (tests/api/test_bench_recipes.py):
    tens of seconds of XLA:CPU compiles of the FP8 train steps, off the in-process tests' path.
    JAX_PLATFORMS=cpu: on a GPU machine the process would otherwise also take its share of the GPU."""
    argv = [sys.executable, str(TESTS.parent / "scripts" / "bench_mlp_jax.py"), "--device", "cpu", "--shapes",
            "16x32x16", "--modes", "bf16_jit,fp8_fused", "--recipes", "delayed,current", "--steps", 3, "--block", 1,
            "--reps", 1, "--no-profile", "--out", out]
    return [(list(map(str, argv)), _env(JAX_PLATFORMS="cpu"))]


def _jax_multidevice(out: Path) -> list:
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env = _env(XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return [(_script("jax_multidevice.py", out / "verdicts.json"), env),
            (_script("jax_current_multidevice.py", out / "current.json"), env)]  # CurrentScaling across devices


# name -> steps (argv, environment) given the job's output folder; the order is the order the
# jobs start in (and the order of their tests at the end of the session): the longest first (CPU
# seconds on 2 cores: jax_multidevice ~65, bench_jax ~30, NVRTC ~30 on its 2 processes, the others
# ~15-30), so that the session does not end waiting for a long job started late.
JOBS = {
    "jax_multidevice": _jax_multidevice,
    "bench_jax": _bench_jax,
    "nvrtc": lambda out: [(_script("nvrtc_compile.py", out / "verdicts.json"), _env())],
    "flax_checkpoint": _flax_checkpoint,
    "torch_distributed": lambda out: [(_script("torch_distributed.py", out), _env())],
    "readme": lambda out: [(_script("readme_blocks.py", out / "verdicts.json"), _env())],
}


@dataclass
class JobResult:
    name: str
    out: Path
    returncode: int | None = None
    log: str = ""  # the failing step's command and output tail (or the timeout)
    seconds: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def check(self) -> "JobResult":
        """Raises AssertionError with the log when a step failed."""
        assert self.returncode == 0, f"background job {self.name!r} failed (rc {self.returncode}):\n{self.log}"
        return self


class Runner:
    """Runs queued jobs one at a time on a daemon thread.

    Several pytest processes (pytest-xdist's workers) can share one ``root``: each queues the jobs
    its tests need, and each job runs once, in the process whose thread claims it first
    (``mkdir root/<job>``) when it gets to it, so two processes run two jobs at a time. The
    owner writes ``result.json`` there when the job ends; another process asking for that job
    waits for the file. ``shared``: other processes may wait on this one's jobs, so :meth:`close`
    lets the jobs it claimed finish (and claims no more) instead of killing them."""

    POLL = 0.5  # seconds between looks for another process's result.json

    def __init__(self, root: Path, shared: bool = False):
        self.root = root
        self.shared = shared
        self.jobs: dict[str, JobResult] = {}
        self._owned: set[str] = set()
        self._queue: list[str] = []
        self._cv = threading.Condition()
        self._proc = None
        self._closed = False
        self._draining = False  # claim no more jobs
        self._thread = threading.Thread(target=self._loop, name="fusedfp8-tests-background", daemon=True)
        self._thread.start()

    def start(self, names) -> None:
        with self._cv:
            for name in names:
                if name not in self.jobs:
                    if name not in JOBS:
                        raise KeyError(f"unknown background job {name!r}; known: {sorted(JOBS)}")
                    self.jobs[name] = JobResult(name, self.root / name)
                    self._queue.append(name)
            self._cv.notify()

    def result(self, name: str) -> JobResult:
        """The job's result, waiting for it (and starting it if nothing did)."""
        self.start([name])
        job = self.jobs[name]
        path, t0 = job.out / "result.json", time.monotonic()
        while not job.done.wait(self.POLL):
            if name not in self._owned and path.exists():  # run by another process
                saved = json.loads(path.read_text())
                job.returncode, job.log, job.seconds = saved["returncode"], saved["log"], saved["seconds"]
                job.done.set()
            assert time.monotonic() - t0 < TIMEOUT + 60, f"background job {name!r} did not finish"
        return job

    def close(self) -> None:
        if self.shared:  # another process may be waiting for a job this one claimed
            with self._cv:
                self._draining = True
            for name in list(self._owned):
                self.jobs[name].done.wait(TIMEOUT + 60)
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify()
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed or self._draining:
                    return
                job = self.jobs[self._queue.pop(0)]
                try:
                    job.out.mkdir(parents=True)
                except FileExistsError:
                    continue  # claimed by another process: result() reads its result.json
                self._owned.add(job.name)
            try:
                self._run(job)
            finally:
                try:
                    tmp = job.out / "result.json.tmp"
                    tmp.write_text(json.dumps({"returncode": job.returncode, "log": job.log, "seconds": job.seconds}))
                    tmp.replace(job.out / "result.json")
                except OSError:  # the session ended and removed the folder: nobody is waiting
                    if not self._closed:
                        raise
                finally:
                    job.done.set()

    def _run(self, job: JobResult) -> None:
        t0 = time.monotonic()
        job.returncode = 0
        for k, (argv, env) in enumerate(JOBS[job.name](job.out)):
            left = TIMEOUT - (time.monotonic() - t0)
            log = job.out / f"step{k}.log"
            with open(log, "w+") as fh:
                with self._cv:
                    if self._closed:
                        job.returncode, job.log = -1, "the session ended first"
                        return
                    self._proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                                  cwd=str(job.out))
                try:
                    rc = self._proc.wait(timeout=max(left, 1))
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                    rc = f"timeout after {TIMEOUT} s"
                fh.seek(0)
                tail = fh.read()[-6000:]
            if rc != 0:
                job.returncode, job.log = (rc if isinstance(rc, int) else -9), f"$ {' '.join(argv)}\n{rc}\n{tail}"
                break
        job.seconds = time.monotonic() - t0
