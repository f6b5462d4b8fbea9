"""The compiled host shim (fusedfp8/csrc) for the tests that need it."""
from __future__ import annotations

import pytest

from fusedfp8 import csrc


def built(target: str):
    """The loaded library of ``target`` ('xla' or 'torch'): built on first use; a skip where there
    is no C++ compiler, a failure where one is present and the build or load failed."""
    lib, why = csrc.library(target)
    if lib is None:
        if csrc.compiler() is None:
            pytest.skip(f"no C++ compiler: {why}")
        pytest.fail(f"the {target} shim is not available: {why}")
    return lib
