"""README.md cannot rot: every ```python block runs (in a process of its own, beside the other
tests: tests/run/readme_blocks.py, the 'readme' background job), and its set-up commands match
.ci/run and setup.py.

A block may carry, on its first line, one of two markers (and nothing else opts out):
- ``# readme-test: gpu-only``: runs only where the capability probe accepts the GPU (the test
  carries the ``gpu`` marker and skips with the probe's reason elsewhere);
- ``# readme-test: requires module.attr``: runs once ``module`` imports and has ``attr``; skipped
  with the reason until then.
"""
import ast
import json
import re
import shlex

import pytest

from support import readme as R

REPO = R.REPO
PY_BLOCKS = R.blocks("python")
blocks = R.blocks


def _params():
    for line, code in PY_BLOCKS:
        marks = [pytest.mark.background("readme")] + ([pytest.mark.gpu] if R.marker(code) == "gpu-only" else [])
        yield pytest.param(line, code, id=f"README.md:{line}", marks=marks)


def test_readme_has_the_python_examples():
    assert len(PY_BLOCKS) >= 3
    markers = [R.marker(code) for _, code in PY_BLOCKS]
    for m in markers:  # only the two known markers exist: nothing else can opt a block out
        assert m is None or m == "gpu-only" or m.startswith("requires "), m


@pytest.fixture(scope="module")
def verdicts(background):
    return json.loads((background.result("readme").check().out / "verdicts.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("line, code", list(_params()))
def test_readme_python_block_runs(line, code, verdicts):
    verdict = verdicts[str(line)]
    if verdict.startswith("skip: "):
        pytest.skip(verdict[len("skip: "):])
    assert verdict == "ok", f"README.md:{line} failed:\n{verdict}"


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


def _setup_keyword(name: str):
    """A keyword of setup.py's ``setup(...)`` call, evaluated without running setup(): every
    top-level statement of setup.py runs (its imports too) except that call, whose keyword is then
    evaluated."""
    tree = ast.parse((REPO / "setup.py").read_text())
    is_setup = [isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == "setup"
                for n in tree.body]
    env: dict = {"__file__": str(REPO / "setup.py"), "__name__": "setup_py_under_test"}
    body = [n for n, skip in zip(tree.body, is_setup) if not skip]
    exec(compile(ast.Module(body=body, type_ignores=[]), "setup.py", "exec"), env)
    call = next(n.value for n, skip in zip(tree.body, is_setup) if skip)
    kw = next(k for k in call.keywords if k.arg == name)
    return eval(compile(ast.Expression(kw.value), "setup.py", "eval"), env)


def test_the_license_is_apache_2_in_the_file_and_the_metadata():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("Copyright 2026 The fusedfp8 authors\n\n                                 Apache License\n"
                           "                           Version 2.0, January 2004\n")
    for part in ("TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION", "9. Accepting Warranty or Additional "
                 "Liability.", "END OF TERMS AND CONDITIONS", "http://www.apache.org/licenses/LICENSE-2.0"):
        assert part in text, part
    assert _setup_keyword("license") == "Apache-2.0"


def test_readme_demo_command_installs_what_the_demo_needs():
    demo_block = next(code for _, code in blocks("bash") if "fusedfp8 demo" in code)
    argv = _commands(demo_block)
    assert ["python", "-m", "fusedfp8", "demo"] in argv
    install = next(_pip(a) for a in argv if _pip(a) and any(x.startswith(".[") for x in a))
    spec = next(x for x in install if x.startswith(".["))
    extras = _setup_keyword("extras_require")
    wanted = spec[2:-1].split(",")
    assert all(e in extras for e in wanted), (wanted, list(extras))
    reqs = [r for e in wanted for r in extras[e]]
    for pkg in ("torch", "tqdm", "matplotlib"):
        assert any(re.match(rf"{pkg}\b", r) for r in reqs), (pkg, reqs)
    assert not any(r.startswith("cupy") for r in reqs)  # no GPU package in the CPU quick start
