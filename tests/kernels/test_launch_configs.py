"""The launch configurations (FUSEDFP8_LAUNCH=old | new | split, :func:`fusedfp8._plans._launch_config`)
write the same bytes: every output of the kernels the 'new' one changes (layernorm_quantize with
q_t, one pass per tile), of the two launches 'split' takes for it (the kernel without q_t, then
transpose_fp8 over q; wide rows, whose fused tile holds 8 or 4 rows, included) and kernels they leave alone (the dgelu tiled kernel with and without dbias
and q_t, gelu, quantize), at the seed's sizes, a ragged shape and a padded one, compared bit for
bit, dbias included (test_kernels holds the GPU's dbias to the reference only within float32
summation order; here the two configurations must agree exactly). The configuration is read at
import, so each runs in a process of its own (this file's main)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (kind, rows, cols, dtype, fmt, transpose, dbias, pad_to); kind: dgelu | gelu | quantize | layernorm
CASES = [
    ("dgelu", 2048, 4096, "bfloat16", "e5m2", True, True, 1),
    ("dgelu", 2048, 4096, "bfloat16", "e5m2", False, True, 1),
    ("dgelu", 2048, 4096, "float16", "e4m3", True, False, 1),
    ("dgelu", 300, 1000, "bfloat16", "e5m2", True, True, 1),
    ("dgelu", 1000, 520, "bfloat16", "e5m2", True, True, 16),
    ("dgelu", 2048, 1024, "float32", "e5m2", True, True, 1),
    ("gelu", 2048, 4096, "bfloat16", "e4m3", True, False, 1),
    ("quantize", 2048, 1024, "bfloat16", "e4m3", True, False, 1),
    ("layernorm", 2048, 1024, "bfloat16", "e4m3", True, False, 1),
    ("layernorm", 2048, 4096, "bfloat16", "e4m3", True, False, 1),
    ("layernorm", 303, 300, "float32", "e5m2", True, False, 16),
    ("layernorm", 2048, 1024, "bfloat16", "e4m3", False, False, 1),
    ("layernorm", 264, 16384, "bfloat16", "e4m3", True, False, 1),  # an 8-row tile (fused)
    ("layernorm", 100, 20000, "float16", "e5m2", True, False, 16),  # a 4-row tile, padded
    ("layernorm", 8190, 1000, "bfloat16", "e4m3", True, False, 1),  # q_t rows % 16 != 0: byte stores
]


def digests() -> dict:
    """Case -> {output name: sha256 of its bytes} (the case's inputs from a fixed seed)."""
    import torch

    import fusedfp8

    out = {}
    for case in CASES:
        kind, rows, cols, dtype, fmt, transpose, dbias, pad_to = case
        gen = torch.Generator(device="cuda").manual_seed(rows * 7919 + cols)
        dt = getattr(torch, dtype)
        x = (torch.randn(rows, cols, device="cuda", generator=gen) * 3).to(dt)
        b = (torch.randn(rows, cols, device="cuda", generator=gen) * 2).to(dt)
        scale = torch.full((1,), 0.75, device="cuda")
        if kind == "layernorm":
            w, bias = torch.randn(cols, device="cuda", generator=gen), torch.randn(cols, device="cuda", generator=gen)
            r = fusedfp8.layernorm_quantize(x, w, bias, 1e-5, scale, fmt, transpose=transpose, pad_to=pad_to)
            got = {"mean": r.mean, "rstd": r.rstd, **r.quantized._asdict()}
        elif kind == "dgelu":
            got = fusedfp8.dgelu_quantize(x, b, scale, fmt, transpose=transpose, dbias=dbias, pad_to=pad_to)._asdict()
        elif kind == "gelu":
            got = fusedfp8.gelu_quantize(x, scale, fmt, transpose=transpose, pad_to=pad_to)._asdict()
        else:
            got = fusedfp8.quantize(x, scale, fmt, transpose=transpose, pad_to=pad_to)._asdict()
        torch.cuda.synchronize()
        out[repr(case)] = {k: hashlib.sha256(v.reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
                           .hexdigest() for k, v in sorted(got.items()) if v is not None}
    return out


def run_config(config: str, tmp: Path) -> dict:
    path = tmp / f"{config}.json"
    env = {**os.environ, "FUSEDFP8_LAUNCH": config}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"FUSEDFP8_LAUNCH={config}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(path.read_text())


@pytest.mark.gpu
@pytest.mark.slow
def test_every_launch_configuration_writes_the_same_bytes(tmp_path):
    got = {config: run_config(config, tmp_path) for config in ("old", "new", "split")}
    old = got["old"]
    assert set(old) == {repr(c) for c in CASES}
    for config in ("new", "split"):
        other = got[config]
        assert set(other) == set(old), config
        for c in CASES:
            case = repr(c)
            assert old[case].keys() == other[case].keys(), (config, case)
            assert "data" in old[case] and "amax" in old[case] and ("data_t" in old[case]) == c[5], case
            differ = [k for k in old[case] if old[case][k] != other[case][k]]
            assert not differ, f"{case}: {differ} differ between FUSEDFP8_LAUNCH=old and {config}"


if __name__ == "__main__":
    from fusedfp8 import _plans

    assert _plans.LAUNCH == os.environ["FUSEDFP8_LAUNCH"], (_plans.LAUNCH, os.environ["FUSEDFP8_LAUNCH"])
    Path(sys.argv[1]).write_text(json.dumps(digests()))
