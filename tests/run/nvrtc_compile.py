"""The NVRTC compile check (tests/kernels/test_compile.py), in a process of its own:

    python tests/run/nvrtc_compile.py OUT.json

Compiles, for sm_90 and with no GPU (cuda-bindings' NVRTC and the CUDA headers only): every
kernel family with every template instantiation the library can ask for (one NVRTC program per
(family, dtype) group, support.nvrtc.groups, with the least optimization; to an sm_90 cubin or,
for the float32 and float16 groups of the quantize families, to compute_90 PTX only:
support.nvrtc.target_of), one module per family as the library compiles it (full optimization,
an sm_90 cubin: support.nvrtc.SIGNATURE_KEYS; the parameter sizes the launch signatures are
checked against are read from these), and the broken sources (which must fail with a log).
Writes the verdicts as JSON. A process of its own because torch 2.13 (CPU) cannot
torch.load some tensors in a process that has compiled an NVRTC program through cuda-bindings.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusedfp8.launch import kernels as K  # noqa: E402
from support import nvrtc  # noqa: E402


def main(out_path: str) -> None:
    ok, reason = nvrtc.ready()
    result = {"ready": ok, "reason": reason}
    if ok:
        opts = nvrtc.options()
        jobs = {}
        with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # NVRTC holds the GIL
            for gid, names in nvrtc.groups().items():
                family = gid.split("-")[0]
                jobs[("group", gid)] = pool.submit(nvrtc.compile_for_sm90, K.family_source(family), names, opts,
                                                   f"{family}.cu", (), nvrtc.target_of(gid), True)
            for family, key in nvrtc.SIGNATURE_KEYS.items():
                names = list(K.name_expressions(key).values())
                jobs[("signature", family)] = pool.submit(nvrtc.compile_for_sm90, K.family_source(family), names,
                                                          opts, f"{family}.cu", names, nvrtc.CUBIN)
            for bid, text in nvrtc.BROKEN.items():
                jobs[("broken", bid)] = pool.submit(nvrtc.compile_for_sm90, K.family_source("dequantize") + text,
                                                    ["broken_kernel"], opts, "broken.cu")
        result["sizes"] = {}
        for (kind, name), fut in jobs.items():
            compiled, log, sizes = fut.result()
            result.setdefault(kind, {})[name] = {"ok": compiled, "log": log,
                                                 "target": nvrtc.target_of(name) if kind == "group" else nvrtc.CUBIN}
            if kind == "signature":
                result["sizes"][name] = sizes
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
