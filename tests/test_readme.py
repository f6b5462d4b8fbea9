"""README.md cannot rot: every ```python block runs here, and its set-up commands match .ci/run
and setup.py.

A block may carry, on its first line, one of two markers (and nothing else opts out):
- ``# readme-test: gpu-only``: runs only where the capability probe accepts the GPU;
- ``# readme-test: requires module.attr``: runs once ``module`` imports and has ``attr``; skipped
  with the reason until then (the flax example, while fusedfp8.jax is being written).
"""
import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from _markers import gpu_ok, gpu_reason

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
MARKER = re.compile(r"#\s*readme-test:\s*(.*)")


def blocks(lang: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of ``lang``."""
    out = []
    for m in re.finditer(rf"^```{lang}\n(.*?)^```", README, re.M | re.S):
        out.append((README.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


PY_BLOCKS = blocks("python")


def _marker(code: str):
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    m = MARKER.match(first)
    return m.group(1).strip() if m else None


def _requirement_missing(spec: str):
    """None if ``module.attr`` is available, else the reason it is not."""
    module, _, attr = spec.rpartition(".")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return f"{module} cannot be imported ({e})"
    if not hasattr(mod, attr):
        return f"{module} has no {attr} yet"
    return None


def test_readme_has_the_python_examples():
    assert len(PY_BLOCKS) >= 3
    markers = [_marker(code) for _, code in PY_BLOCKS]
    for m in markers:  # only the two known markers exist: nothing else can opt a block out
        assert m is None or m == "gpu-only" or m.startswith("requires "), m


@pytest.mark.parametrize("line, code", PY_BLOCKS, ids=[f"README.md:{line}" for line, _ in PY_BLOCKS])
def test_readme_python_block_runs(line, code, tmp_path, monkeypatch):
    marker = _marker(code)
    if marker == "gpu-only" and not gpu_ok:
        pytest.skip(f"GPU-only README block: {gpu_reason}")
    if marker and marker.startswith("requires "):
        missing = _requirement_missing(marker.split(None, 1)[1])
        if missing:
            pytest.skip(f"README block needs {marker.split(None, 1)[1]}: {missing}")
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


# ---- the two set-up commands -------------------------------------------------------------------
def _commands(code: str) -> list[list[str]]:
    """Every command of a bash block, split at '&&', as argv lists."""
    out = []
    for line in code.splitlines():
        for part in line.split("&&"):
            if part.strip() and not part.strip().startswith("#"):
                out.append(shlex.split(part))
    return out


def _ci_commands() -> list[list[str]]:
    """The pip / python commands of .ci/run, with '"$PY" -m' made 'python -m' and --quiet dropped."""
    text = (REPO / ".ci" / "run").read_text()
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('"$PY" -m ') and " venv " not in line:
            argv = ["python", "-m", *shlex.split(line[len('"$PY" -m '):])]
            out.append([a for a in argv if a != "--quiet"])
    return out


def _pip(argv: list[str]) -> list[str]:
    """``pip install X`` and ``python -m pip install X`` both as ['install', X...]; [] for other commands."""
    return argv[3:] if argv[:3] == ["python", "-m", "pip"] else argv[1:] if argv[:1] == ["pip"] else []


def test_readme_test_commands_are_what_ci_runs():
    test_block = next(code for _, code in blocks("bash") if "pytest" in code)
    readme = _commands(test_block)
    ci = _ci_commands()
    ci_pip = [_pip(c) for c in ci if _pip(c)]
    for argv in readme:
        if _pip(argv):
            assert _pip(argv) in ci_pip, (argv, ci_pip)
        else:
            assert argv in ci, (argv, ci)
    assert ["python", "-m", "pytest", "-q", "tests"] in readme


def _extras() -> dict:
    """setup.py's extras_require, evaluated without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    env: dict = {}
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call))]
    exec(compile(ast.Module(body=[n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))],
                            type_ignores=[]), "setup.py", "exec"), env)
    call = next(n.value for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call))
    kw = next(k for k in call.keywords if k.arg == "extras_require")
    return eval(compile(ast.Expression(kw.value), "setup.py", "eval"), env)


def test_readme_demo_command_installs_what_the_demo_needs():
    demo_block = next(code for _, code in blocks("bash") if "fusedfp8 demo" in code)
    argv = _commands(demo_block)
    assert ["python", "-m", "fusedfp8", "demo"] in argv
    install = next(_pip(a) for a in argv if _pip(a) and any(x.startswith(".[") for x in a))
    spec = next(x for x in install if x.startswith(".["))
    extras = _extras()
    wanted = spec[2:-1].split(",")
    assert all(e in extras for e in wanted), (wanted, list(extras))
    reqs = [r for e in wanted for r in extras[e]]
    for pkg in ("torch", "tqdm", "matplotlib"):
        assert any(re.match(rf"{pkg}\b", r) for r in reqs), (pkg, reqs)
    assert not any(r.startswith("cupy") for r in reqs)  # no GPU package in the CPU quick start
