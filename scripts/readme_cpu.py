"""The CPU figures of README.md, measured as a newcomer meets them: ``python -m fusedfp8 demo`` and
every python block of README.md, each in a fresh process in an empty folder, on the wall clock
(interpreter start and imports included).

    python scripts/readme_cpu.py --out docs/bench
    python scripts/readme_cpu.py --suite --out docs/bench

The first writes ``readme_cpu.json`` (per README block its name, its line, and the seconds of each
run and of the fastest, the nearest to an idle machine; the same for the demo command) and
``demo_cpu.json`` (the last demo's own ``demo.json``: losses, step times, scales). ``--suite``
writes ``suite_cpu.json``: README's test command (its bash block's pytest line) run once from the
repository root, its wall and CPU seconds and counts, and README's smoke subset (the inline
``python -m pytest ... -n 0 ...`` command) run ``--reps`` times, the median. README's CPU numbers
point into these files (tests/api/test_readme_numbers.py). A block's name is the most specific
fusedfp8 module it imports ('fusedfp8', 'fusedfp8.pytorch', 'fusedfp8.jax.flax').
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bench

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support import readme  # noqa: E402


def block_name(code: str) -> str:
    mods = re.findall(r"^\s*(?:from|import)\s+(fusedfp8[\w.]*)", code, re.M)
    return max(mods, key=len) if mods else "other"


def timed(argv: list[str], cwd: str) -> float:
    """Seconds of one run of ``argv`` in ``cwd``; a failed run stops the script with its output."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    s = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"{' '.join(argv[:4])} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return s


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    m = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    return m.group(1).strip() if m else "unknown"


def readme_commands() -> tuple[str, str]:
    """README's test command (the pytest line of its bash blocks) and its smoke subset (the inline
    ``python -m pytest`` command with ``-n 0``)."""
    tests = [ln.strip() for _, code in readme.blocks("bash") for ln in code.splitlines()
             if ln.strip().startswith("python -m pytest")]
    smoke = re.findall(r"`(python -m pytest [^`]*-n 0[^`]*)`", readme.README)
    if len(tests) != 1 or len(smoke) != 1:
        sys.exit(f"README.md should give one test command and one smoke command; found {tests} and {smoke}")
    return tests[0], smoke[0]


def suite(meta: dict, reps: int, out: Path) -> None:
    """README's test command once and its smoke subset ``reps`` times, from the repository root."""
    test_cmd, smoke_cmd = readme_commands()
    py = sys.executable
    before = os.times()
    t0 = time.perf_counter()
    done = subprocess.run([py, *test_cmd.split()[1:]], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = os.times()
    if done.returncode:
        sys.exit(f"{test_cmd} failed ({done.returncode}):\n{done.stdout[-5000:]}{done.stderr[-2000:]}")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|skipped|failed)", done.stdout.splitlines()[-1])}
    smoke = sorted(timed([py, *smoke_cmd.split()[1:]], str(REPO)) for _ in range(reps))
    meta.update(test_command=test_cmd, wall_s=round(wall, 1), wall_minutes=round(wall / 60, 1),
                user_s=round(after.children_user - before.children_user, 1),
                sys_s=round(after.children_system - before.children_system, 1),
                passed=counts.get("passed", 0), skipped=counts.get("skipped", 0),
                smoke_command=smoke_cmd, smoke_wall_s=round(smoke[len(smoke) // 2], 1),
                smoke_runs_s=[round(v, 1) for v in smoke])
    print(f"{test_cmd}: {wall:.1f} s ({meta['user_s']} user-s), {counts}; smoke subset {smoke}")
    _bench.write_json(out / "suite_cpu.json", meta, [])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out", help="output folder (docs/bench for README's figures)")
    ap.add_argument("--reps", type=int, default=3,
                    help="runs of each command (the fastest is reported; with --suite, of the smoke subset: the median)")
    ap.add_argument("--suite", action="store_true", help="time README's test command and smoke subset instead")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    import jax
    import torch

    meta = _bench.run_meta(device=f"{cpu_name()}, {os.cpu_count()} cores", torch=torch.__version__,
                           jax=jax.__version__, load_average_at_start=list(os.getloadavg()))
    if args.suite:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip() or "unknown"
        return suite(meta, args.reps, out)
    blocks = []
    for line, code in readme.blocks("python"):
        if readme.skip_reason(code):
            continue
        runs = []
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(timed([py, "-c", code], tmp))
        blocks.append({"name": block_name(code), "line": line, "fastest_s": min(runs), "runs_s": runs})
        print(f"README.md:{line} ({blocks[-1]['name']}): fastest {min(runs):.1f} s, runs {runs}")
    demo = []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            demo.append(timed([py, "-m", "fusedfp8", "demo", "--out", "demo", "--no-progress"], tmp))
            shutil.copy(Path(tmp) / "demo" / "demo.json", out / "demo_cpu.json")
    print(f"python -m fusedfp8 demo: fastest {min(demo):.1f} s, runs {demo}")
    meta.update(demo_command_fastest_s=min(demo), demo_command_runs_s=demo)
    _bench.write_json(out / "readme_cpu.json", meta, blocks)
    print(f"wrote {out / 'demo_cpu.json'}")


if __name__ == "__main__":
    main()
