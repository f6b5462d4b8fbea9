"""Skip markers shared by the test modules, fed by the library's one capability probe.

Kept out of conftest.py because conftest cannot be imported by name reliably.
"""
import pytest

import fusedfp8._cuda

gpu_ok, gpu_reason = fusedfp8._cuda.probe()
requires_gpu = pytest.mark.skipif(not gpu_ok, reason=gpu_reason)

fp8_gemm_ok, fp8_gemm_reason = fusedfp8._cuda.probe(need_fp8_gemm=True)
requires_fp8_gemm = pytest.mark.skipif(not fp8_gemm_ok, reason=fp8_gemm_reason)
