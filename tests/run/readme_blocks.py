"""The README's python blocks (tests/api/test_readme.py), run in a process of their own:

    python tests/run/readme_blocks.py OUT.json

Every ```python block of README.md runs, in order, in its own namespace and in a fresh temporary
working folder (a block that writes files writes them there), unless its first-line marker says
otherwise: ``# readme-test: gpu-only`` runs only where the capability probe accepts the GPU,
``# readme-test: requires module.attr`` only once ``module`` has ``attr``. Writes one verdict per
block, keyed by its line number: 'ok', 'skip: <reason>' or the traceback.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

from support import readme  # noqa: E402


def main(out_path: str) -> None:
    verdicts = {}
    for line, code in readme.blocks("python"):
        why = readme.skip_reason(code)
        if why:
            verdicts[line] = f"skip: {why}"
            continue
        here = os.getcwd()
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            try:
                exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
                verdicts[line] = "ok"
            except BaseException:  # noqa: BLE001  (reported to the test of this block)
                verdicts[line] = traceback.format_exc()
            finally:
                os.chdir(here)
    with open(out_path, "w") as f:
        json.dump(verdicts, f)


if __name__ == "__main__":
    main(sys.argv[1])
