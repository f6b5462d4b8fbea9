"""README.md's fenced blocks and the two markers a python block may carry on its first line (and
nothing else opts out):

- ``# readme-test: gpu-only``: runs only where the capability probe accepts the GPU;
- ``# readme-test: requires module.attr``: runs once ``module`` imports and has ``attr``.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MARKER = re.compile(r"#\s*readme-test:\s*(.*)")


def blocks(lang: str) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of ``lang``."""
    out = []
    for m in re.finditer(rf"^```{lang}\n(.*?)^```", README, re.M | re.S):
        out.append((README.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


def marker(code: str):
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    m = MARKER.match(first)
    return m.group(1).strip() if m else None


def requirement_missing(spec: str):
    """None if ``module.attr`` is available, else the reason it is not."""
    module, _, attr = spec.rpartition(".")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return f"{module} cannot be imported ({e})"
    if not hasattr(mod, attr):
        return f"{module} has no {attr} yet"
    return None


def skip_reason(code: str):
    """Why the block does not run here (None: it runs)."""
    m = marker(code)
    if m == "gpu-only":
        from fusedfp8 import launch

        ok, reason = launch.probe()
        return None if ok else f"GPU-only README block: {reason}"
    if m and m.startswith("requires "):
        missing = requirement_missing(m.split(None, 1)[1])
        return f"README block needs {m.split(None, 1)[1]}: {missing}" if missing else None
    return None
