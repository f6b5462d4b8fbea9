"""tests/run/cublaslt_block_probe.py, the answer to "which block-scaled FP8 GEMMs does this GPU's
cuBLASLt run, and does it read the scale layout of fusedfp8.numerics.block": without a GPU it says
why and exits 1; on a GPU (a ``gpu`` test, so that ``-m gpu`` runs it) every GEMM of the list gets
the heuristic's answer, and every GEMM it finds an algorithm for matches the float64 product
through the documented layout and not through the other one."""
import json
import os
import subprocess
import sys

import pytest

from fusedfp8 import launch

PROBE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run", "cublaslt_block_probe.py")


def _probe():
    sys.path.insert(0, os.path.dirname(PROBE))
    try:
        import cublaslt_block_probe as probe
    finally:
        sys.path.remove(os.path.dirname(PROBE))
    run = subprocess.run([sys.executable, PROBE, "--m", "256", "--n", "256", "--k", "512"], capture_output=True,
                         text=True, timeout=900)
    answer = json.loads(run.stdout)
    assert answer["shape"] == {"m": 256, "n": 256, "k": 512}
    return probe, run, answer


@pytest.mark.skipif(launch.probe()[0], reason="a GPU is here: test_the_probe_answers_on_the_gpu")
def test_without_a_gpu_the_probe_says_why():
    _, run, answer = _probe()
    assert not answer["available"]
    assert run.returncode == 1 and answer["reason"].startswith(("no CUDA GPU", "torch is not installed")), answer


@pytest.mark.gpu
@pytest.mark.fp8_gemm
def test_the_probe_answers_on_the_gpu():
    probe, run, answer = _probe()
    assert answer["available"], answer
    assert run.returncode == 0, run.stderr
    assert "cublaslt_error" not in answer, answer["cublaslt_error"]
    gemms = answer["heuristic_and_gemm"]
    assert set(gemms) == set(probe.GEMMS)
    for name, entry in gemms.items():
        if entry["split_accum"]["supported"]:
            assert entry["gemm_documented_layout"]["matches_float64"], (name, entry)
            assert not entry["gemm_other_layout"]["matches_float64"], (name, entry)
        else:
            assert entry["split_accum"]["why_not"], (name, entry)
