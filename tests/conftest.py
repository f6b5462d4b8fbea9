"""The test suite's one capability probe and the fixtures every folder shares.

Markers (registered in pytest.ini):

- ``gpu``: needs a CUDA GPU that runs the FP8 kernels (``fusedfp8.launch.probe()``);
- ``fp8_gemm``: also needs FP8 GEMMs (``probe(need_fp8_gemm=True)``); it only matters for a
  test that runs on the GPU (a ``gpu`` test, or the ``cuda`` parameter of ``device``);
- ``block_gemm``: a ``gpu`` test that also needs block-scaled FP8 GEMMs (BlockScaling's:
  ``probe(need_block_gemm=True)``, Hopper only);
- ``jax_gpu``: a ``gpu`` test that also needs jax's GPU backend;
- ``slow``: genuinely long (tens of seconds on a 2-core CPU machine). Slow tests run by default;
  ``-m "not slow"`` leaves them out.

Every GPU skip in the suite goes through :func:`pytest_collection_modifyitems` below, so each
skip carries the probe's own reason ("no CUDA GPU (...)" and "GPU without FP8 GEMMs" differ).
A test that runs the same check on the host and on the GPU takes the ``device`` fixture, whose
``cuda`` parameter carries the ``gpu`` marker.

Order: the folders run bottom-up as the package is built (numerics, kernels, api, pytorch, jax;
anything else after), and the tests that read a background job's result (tests/run/ entry points
marked ``background``, see tests/support/background.py) run last: the jobs start when collection
ends and run beside the in-process tests, one at a time.

Under pytest-xdist (``-n 14`` on a GPU machine) the workers share the background jobs (each
runs once, in the worker that claims it; two workers run two at a time) and the compilation cache
below. Where pytest-xdist is installed (the test extra) and the command line names no ``-n``,
the suite runs on two workers (:func:`pytest_cmdline_main`): on a 2-core machine one process
leaves the second core idle once the background jobs end, and the tests/jax folder (the last and
longest) then runs alone. Measured on 2 cores, the full suite: one process 485 s (717 CPU-s),
two workers 390 s (758 CPU-s). ``-n 0`` runs one process.

Compiled XLA programs are shared by this session and the processes it starts (tests/run/)
through jax's persistent compilation cache in a temporary folder made for the session: the flax
train step that the first leg of the checkpoint test compiles is loaded, not compiled again, by
its second leg in a fresh process, and a program that eager code compiles again and again (the
same HLO: a lax.fori_loop called outside jit is traced and compiled anew on every call) is
compiled once.

A folder named by JAX_COMPILATION_CACHE_DIR is used instead (and kept): one that outlives the
run serves the next run's identical programs (jax keys each entry on the program, the compile
options, the XLA flags and the jax/jaxlib versions, so a changed program is compiled again).
Measured on 2 cores, the full suite with two workers: 497 s (952 CPU-s) with an empty folder, 293
s (579 CPU-s) with the folder that run left (about 40 MB).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:  # `import support` from every folder and from tests/run/ scripts
    sys.path.insert(0, TESTS)

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="fusedfp8-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
# every program, also the small ones that eager jax code compiles again and again (in a folder
# given by JAX_COMPILATION_CACHE_DIR too, unless these are set: see the docstring)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from fusedfp8 import launch  # noqa: E402  (imports neither CuPy nor jax)

GPU = launch.probe()
FP8_GEMM = launch.probe(need_fp8_gemm=True)
BLOCK_GEMM = launch.probe(need_block_gemm=True)


def _jax_gpu() -> tuple[bool, str]:
    if not GPU[0]:
        return GPU
    try:
        import jax

        return (True, "jax GPU backend") if jax.devices("gpu") else (False, "jax has no GPU device")
    except RuntimeError as e:
        return False, f"jax has no GPU backend ({e})"


FOLDERS = ("numerics", "kernels", "api", "pytorch", "jax")  # the package's floors, ground floor first


def _rank(item) -> tuple:
    parts = os.path.relpath(str(item.path), TESTS).split(os.sep)
    folder = FOLDERS.index(parts[0]) if len(parts) > 1 and parts[0] in FOLDERS else len(FOLDERS)
    job = item.get_closest_marker("background")
    return (1, _job_order(job.args[0])) if job else (0, folder)


def _job_order(name: str) -> int:
    from support.background import JOBS

    return list(JOBS).index(name)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # (stable: the order inside a folder and a job is kept)
    jax_gpu = None
    for item in items:
        on_gpu = item.get_closest_marker("gpu") is not None
        if not on_gpu:
            continue
        if not GPU[0]:
            item.add_marker(pytest.mark.skip(reason=GPU[1]))
        elif item.get_closest_marker("fp8_gemm") is not None and not FP8_GEMM[0]:
            item.add_marker(pytest.mark.skip(reason=FP8_GEMM[1]))
        elif item.get_closest_marker("block_gemm") is not None and not BLOCK_GEMM[0]:
            item.add_marker(pytest.mark.skip(reason=BLOCK_GEMM[1]))
        elif item.get_closest_marker("jax_gpu") is not None:
            jax_gpu = jax_gpu or _jax_gpu()
            if not jax_gpu[0]:
                item.add_marker(pytest.mark.skip(reason=jax_gpu[1]))


# The folder of the background jobs' files: made by the first process (pytest-xdist's controller,
# or a plain pytest run) and inherited through the environment, so that xdist's workers share the
# jobs: each job runs once, in the worker that claims it (tests/support/background.py).
_OWN_RUN_DIR = None
if "FUSEDFP8_TESTS_RUN_DIR" not in os.environ:
    _OWN_RUN_DIR = tempfile.mkdtemp(prefix="fusedfp8-tests-run-")
    os.environ["FUSEDFP8_TESTS_RUN_DIR"] = _OWN_RUN_DIR
_RUNNER = None


def _runner():
    global _RUNNER
    if _RUNNER is None:
        from support.background import Runner

        _RUNNER = Runner(Path(os.environ["FUSEDFP8_TESTS_RUN_DIR"]), shared="PYTEST_XDIST_WORKER" in os.environ)
    return _RUNNER


def pytest_collection_finish(session):
    """Start the background jobs the collected tests need (in the order of support.background.JOBS)."""
    if session.config.option.collectonly:
        return
    names = {m.args[0] for item in session.items if item.get_closest_marker("skip") is None
             for m in item.iter_markers("background")}  # a skipped test reads no result
    if names:
        _runner().start(sorted(names, key=_job_order))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Two xdist workers by default where pytest-xdist is installed, there are two cores, and the
    command line does not say (``-n``), debug (``--pdb``) or only collect; never in a worker.
    Runs before xdist's own hook (a conftest registers after the plugins), which turns ``-n`` into
    its workers."""
    if (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", 0) is None
            and "PYTEST_XDIST_WORKER" not in os.environ and (os.cpu_count() or 1) >= 2
            and not config.getoption("usepdb", False) and not config.getoption("collectonly", False)):
        config.option.numprocesses = 2


@pytest.fixture(scope="session")
def background():
    """The runner of the tests/run/ jobs: ``background.result(name)`` waits for a job's result."""
    return _runner()


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count (pytest.ini asks for no line per skipped test):
    on a machine without a GPU every GPU test skips with the probe's one reason."""
    reasons: dict = {}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{n:6d}  {reason}")


def pytest_unconfigure(config):
    if _RUNNER is not None:
        _RUNNER.close()
    if _OWN_RUN_DIR is not None:
        shutil.rmtree(_OWN_RUN_DIR, ignore_errors=True)
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """'cpu' (the host path: the bit-exact NumPy reference) and 'cuda' (the kernels), one test
    body for both; the 'cuda' run skips with the probe's reason where there is no usable GPU."""
    return request.param


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.jax_gpu])])
def jax_device(request):
    """A jax device: the CPU, or the GPU (skipped without jax's GPU backend)."""
    import jax

    return jax.devices(request.param if request.param == "cpu" else "gpu")[0]


@pytest.fixture
def rng():
    """A seeded generator: every test that draws random data gets the same data on every run."""
    return np.random.default_rng(1234)
