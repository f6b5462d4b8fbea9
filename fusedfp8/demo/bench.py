"""``python -m fusedfp8 bench``: run the benchmark scripts of a source checkout
(``scripts/bench_kernels.py``, ``scripts/bench_mlp_torch.py``, ``scripts/bench_mlp_jax.py``; they
are not installed with the package) and collect their JSON, PNG and logs in one folder with a
markdown summary (``summary.md``: per benchmark its command, status, log and the markdown table
it printed).

What runs where. On a GPU that the capability probe accepts (with FP8 GEMMs): all three, at full
size or, with ``tiny``, at a small one (a quick check that they run, not a measurement; the jax
benchmark also needs jax's GPU backend). Without one: the kernel benchmark is skipped, and the
MLP benchmarks run only with ``tiny``, as CPU smoke tests of the scripts. Every command is shown,
skipped ones too. The scripts run with this package's folder first on ``PYTHONPATH``, so that
they import the same fusedfp8.

``calibrate`` (``python -m fusedfp8 bench --calibrate``): runs ``scripts/calibrate_policy.py``
instead, which measures the table of ``convert_to_fp8(policy='auto')`` on this GPU, eager and
CUDA-graphed steps (meant to take under 90 s on an H200; with ``tiny`` a small grid, or without a
GPU a CPU smoke test of the script, eager steps only) and writes
it to the output folder; its progress is shown as it runs and kept in ``calibrate_policy.log``.
Without a GPU with FP8 GEMMs (and without ``tiny``) it refuses with the probe's reason.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BENCHMARKS = ("bench_kernels", "bench_mlp_torch", "bench_mlp_jax")
CALIBRATE = "calibrate_policy"
_CALIBRATE_TINY = {
    "gpu": ["--tokens", "512,2048", "--features", "256,1024", "--graphed-tokens", "512,2048", "--graphed-features",
            "256,1024", "--reps", "3"],
    "cpu": ["--device", "cpu", "--tokens", "16,32", "--features", "16,32", "--warmup", "1", "--calls", "1", "--reps",
            "1"],
}
_GPU_TINY = {  # the MLP steps under both FP8 recipes (--recipes: scripts/_bench_recipes.py)
    "bench_kernels": ["--sizes", "1024x1024", "--jobs", "quantize,quantize_t"],
    "bench_mlp_torch": ["--shapes", "1024x4096x2048", "--modes", "bf16_eager,fp8_eager", "--recipes", "delayed,current",
                        "--steps", "10", "--reps", "2", "--no-profile"],
    "bench_mlp_jax": ["--shapes", "1024x4096x2048", "--modes", "bf16_jit,fp8_fused", "--recipes", "delayed,current",
                      "--steps", "10", "--reps", "2", "--no-profile"],
}
_CPU_SMOKE = {  # tiny shape, no events / graphs / profiles; the jax step under one recipe (XLA:CPU compiles
    # each FP8 step for tens of seconds)
    "bench_mlp_torch": ["--device", "cpu", "--shapes", "32x64x48", "--modes", "bf16_eager,fp8_eager", "--recipes",
                        "delayed,current", "--steps", "3", "--block", "1", "--reps", "1", "--no-profile"],
    "bench_mlp_jax": ["--device", "cpu", "--shapes", "32x64x48", "--modes", "bf16_jit,fp8_fused", "--steps", "3",
                      "--block", "1", "--reps", "1", "--no-profile"],
}


@dataclass(frozen=True)
class Command:
    """One benchmark: ``argv`` (always set: the command it runs or would run), ``skip`` (why it
    does not run here; '' when it does) and ``note`` (what a run here is, e.g. a smoke test)."""

    name: str
    argv: list
    skip: str = ""
    note: str = ""


def scripts_dir(names=BENCHMARKS) -> Path | None:
    """``scripts/`` of the source checkout this package runs from (holding the scripts ``names``),
    or None (installed wheel)."""
    d = Path(__file__).resolve().parent.parent.parent / "scripts"
    return d if all((d / f"{name}.py").is_file() for name in names) else None


def _jax_gpu() -> str:
    """'' when jax has a GPU backend, else why not."""
    try:
        import jax

        return "" if jax.devices("gpu") else "jax has no GPU device"
    except (ImportError, RuntimeError) as e:
        return f"jax has no GPU backend ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def bench_commands(scripts: Path, out: Path, gpu: bool, tiny: bool, jax_gpu: str = "") -> list[Command]:
    """The :class:`Command` of every benchmark. ``gpu``: the probe accepts the GPU (FP8 GEMMs
    included); ``jax_gpu``: '' when jax has a GPU backend, else why not."""
    cmds = []
    for name in BENCHMARKS:
        base = [sys.executable, str(scripts / f"{name}.py"), "--out", str(out)]
        gpu_argv = base + (_GPU_TINY[name] if tiny else [])
        if gpu and name == "bench_mlp_jax" and jax_gpu:
            cmds.append(Command(name, gpu_argv, skip=f"needs jax's GPU backend: {jax_gpu}"))
        elif gpu:
            cmds.append(Command(name, gpu_argv))
        elif name == "bench_kernels":
            cmds.append(Command(name, gpu_argv, skip="needs a GPU that runs the fused kernels"))
        elif tiny:
            cmds.append(Command(name, base + _CPU_SMOKE[name],
                                note="CPU smoke test of the script: tiny shape, not a measurement"))
        else:
            cmds.append(Command(name, gpu_argv, skip="needs a GPU with FP8 GEMMs; --tiny runs a CPU smoke test of "
                                                     "the script"))
    return cmds


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def _env() -> dict:
    """The environment of a script: this package's folder first on ``PYTHONPATH``."""
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}


def _run(cmd: Command, out: Path, cwd: Path, say) -> tuple[int, list[str]]:
    """Run one benchmark; (exit code, its summary lines)."""
    shown = " ".join(cmd.argv)
    say(f"{cmd.name}: running {shown}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd.argv, capture_output=True, text=True, cwd=cwd, env=_env())
    wall = time.perf_counter() - t0
    log = out / f"{cmd.name}.log"
    log.write_text(proc.stdout + ("\n--- stderr ---\n" + proc.stderr if proc.stderr else ""))
    status = "ok" if proc.returncode == 0 else f"FAILED (exit code {proc.returncode})"
    say(f"{cmd.name}: {status} in {wall:.0f} s; log {log}")
    lines = [f"{status}, {wall:.0f} s; log: [{log.name}]({log.name})", ""]
    lines += _table_lines(proc.stdout) + [""]
    for ext in ("json", "png"):
        f = out / f"{cmd.name}.{ext}"
        if f.is_file():
            lines += [f"![{cmd.name}]({f.name})" if ext == "png" else f"data: [{f.name}]({f.name})", ""]
    return proc.returncode, lines


def run_bench(out, dry_run: bool = False, tiny: bool = False, only=None, echo: Callable[[str], None] = print) -> int:
    """Run (or with ``dry_run`` only list) the benchmarks, ``only`` the named ones if given, and
    write ``summary.md`` to ``out``. Returns 0, 1 when a benchmark failed, 2 without a source
    checkout. The last line echoed says where the files went."""
    from .. import launch

    scripts = scripts_dir()
    if scripts is None:
        names = ", ".join(f"scripts/{n}.py" for n in BENCHMARKS)
        print(f"python -m fusedfp8 bench: error: the benchmark scripts ({names})"
              " are not installed with the package; run this from a source checkout (git clone the fusedfp8 "
              "repository, pip install -e '.[all]' there)", file=sys.stderr)
        return 2
    ok, reason = launch.probe(need_fp8_gemm=True)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cmds = [c for c in bench_commands(scripts, out, ok, tiny, _jax_gpu() if ok else "")
            if only is None or c.name in only]
    lines = ["# fusedfp8 benchmarks", "",
             f"- date {time.strftime('%Y-%m-%d %H:%M')}, python {platform.python_version()}, "
             f"device: {'GPU' if ok else 'no usable GPU'} ({reason})",
             f"- mode: {'dry run (nothing executed)' if dry_run else 'tiny sizes' if tiny else 'full'}", ""]
    rc, written = 0, []
    for cmd in cmds:
        shown = " ".join(cmd.argv)
        lines += [f"## {cmd.name}", "", f"command: `{shown}`" + (f" ({cmd.note})" if cmd.note else ""), ""]
        if cmd.skip:
            lines += [f"skipped: {cmd.skip}", ""]
            echo(f"{cmd.name}: skipped ({cmd.skip}); the command: {shown}")
        elif dry_run:
            lines += ["not executed (--dry-run)", ""]
            echo(f"{cmd.name}: would run {shown}" + (f" ({cmd.note})" if cmd.note else ""))
        else:
            code, more = _run(cmd, out, scripts.parent, echo)
            rc = rc or code
            lines += more
            written += [f"{cmd.name}.{ext}" for ext in ("log", "json", "png") if (out / f"{cmd.name}.{ext}").is_file()]
    (out / "summary.md").write_text("\n".join(lines))
    echo(f"wrote {', '.join(['summary.md', *written])} to {out}/")
    return 1 if rc else 0


# ---- the calibration table of policy='auto' -------------------------------------------------
def calibrate_command(scripts: Path, out: Path, gpu: bool, tiny: bool) -> Command:
    """The :class:`Command` of ``scripts/calibrate_policy.py`` (``gpu``: the probe accepts the GPU,
    FP8 GEMMs included)."""
    base = [sys.executable, str(scripts / f"{CALIBRATE}.py"), "--out", str(out)]
    if gpu:
        return Command(CALIBRATE, base + (_CALIBRATE_TINY["gpu"] if tiny else []),
                       note="tiny grid: a check that it runs, too coarse a table to use" if tiny else "")
    if tiny:
        return Command(CALIBRATE, base + _CALIBRATE_TINY["cpu"],
                       note="CPU smoke test of the script: tiny grid, not a measurement")
    return Command(CALIBRATE, base, skip="the table holds this GPU's timings of FP8 GEMMs, and there is no GPU with "
                                         "FP8 GEMMs here; --tiny runs a CPU smoke test of the script")


def run_calibrate(out, dry_run: bool = False, tiny: bool = False, echo: Callable[[str], None] = print) -> int:
    """Run (or with ``dry_run`` only show) the calibration into the folder ``out``, echoing its
    output as it comes and keeping it in ``calibrate_policy.log``. Returns the script's exit code,
    1 where it cannot run here, 2 without a source checkout. The last line echoed says where the
    table went."""
    from .. import launch

    scripts = scripts_dir((CALIBRATE,))
    if scripts is None:
        print(f"python -m fusedfp8 bench --calibrate: error: scripts/{CALIBRATE}.py is not installed with the package; "
              "run this from a source checkout (git clone the fusedfp8 repository, pip install -e '.[all]' there)",
              file=sys.stderr)
        return 2
    ok, reason = launch.probe(need_fp8_gemm=True)
    out = Path(out).resolve()
    cmd = calibrate_command(scripts, out, ok, tiny)
    shown = " ".join(cmd.argv)
    if cmd.skip:
        echo(f"{cmd.name}: cannot run here ({reason}): {cmd.skip}. The command: {shown}")
        return 1
    if dry_run:
        echo(f"{cmd.name}: would run {shown}" + (f" ({cmd.note})" if cmd.note else ""))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{CALIBRATE}.log"
    echo(f"{cmd.name}: running {shown}" + (f" ({cmd.note})" if cmd.note else ""))
    table = None
    with log.open("w") as f:
        proc = subprocess.Popen(cmd.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=scripts.parent, env=_env())
        for line in proc.stdout:
            f.write(line)
            echo(line.rstrip("\n"))
            if line.startswith("wrote ") and line.rstrip().endswith(".json"):
                table = line[len("wrote "):].strip()
        rc = proc.wait()
    if rc or table is None:
        echo(f"{cmd.name}: FAILED (exit code {rc}); log {log}")
        return rc or 1
    echo(f"wrote {Path(table).name}, {log.name} to {out}/")
    return 0
