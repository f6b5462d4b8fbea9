"""Shared fixtures. GPU skip markers live in tests/_markers.py (import them from there)."""
import numpy as np
import pytest

from _markers import gpu_ok, gpu_reason, requires_gpu  # noqa: F401  (re-exported for convenience)


@pytest.fixture
def rng():
    """A seeded generator: every test that draws random data gets the same data on every run."""
    return np.random.default_rng(1234)
