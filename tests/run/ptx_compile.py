"""The PTX wrappers of impl 'ptx' compile with NVRTC for sm_90, in a process of its own:

    python tests/run/ptx_compile.py OUT.json

Lowers for CUDA, with no GPU (tests/support/ptx.py fakes what the lowering asks of one, NVRTC is
real: cuda-bindings' and the CUDA headers), one program per (input dtype, op, format) that
reaches every kernel variant impl 'ptx' launches: the first-step pre-pass (quantize_flat, STORE
false), the flat cast (quantize_flat, STORE true), the tiled kernel (transpose; dbias with the
dgelu ops), each for 16-byte aligned buffers; update_scales, update_meta and the amax-only launch. Each
PTX is checked to define its wrapper's entry. Writes the verdicts as JSON. A process of its own
for the reason tests/run/nvrtc_compile.py gives (torch.load after cuda-bindings' NVRTC).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import nvrtc  # noqa: E402
from support import ptx as SP  # noqa: E402


def setattr_(obj, name, value):
    setattr(obj, name, value)


def main(out_path: str) -> None:
    ok, reason = nvrtc.ready()
    result = {"ready": ok, "reason": reason, "programs": {}, "calls": 0, "compiles": 0}
    if ok:
        import jax
        import jax.numpy as jnp

        import fusedfp8
        from fusedfp8 import _cuda
        from fusedfp8.jax import primitives as JP
        from fusedfp8.jax import ptx as X
        from fusedfp8.state import ScalingState

        SP.fake_gpu(setattr_, compile=True)
        bodies_of = {}  # kernel name -> the body its wrapper calls
        real = X.compile_ptx

        def recording(family, wrapper, cc):
            bodies_of[re.search(r"(ff8_ptx_\w+)\(", wrapper).group(1)] = re.search(r"(\w+_body)", wrapper).group(1)
            return real(family, wrapper, cc)

        X.compile_ptx = recording
        recipe = fusedfp8.DelayedScaling(amax_history_len=4)
        state = ScalingState.create((False, True), recipe, like=jnp.zeros(1))  # tensor 0 E4M3, tensor 1 E5M2
        t0 = time.monotonic()
        for dtype in _cuda.CPP_TYPES:
            x = jnp.ones((256, 64), dtype)
            for op in _cuda.OPS:
                for index, fmt in ((0, "e4m3"), (1, "e5m2")):
                    name = f"{dtype}-{op}-{fmt}"

                    def step(x, s, op=op, index=index):
                        kind, _, approximate = op.partition("_")
                        approximate = {"erf": "none"}.get(approximate, approximate or "tanh")
                        outs = []
                        for transpose in (False, True):
                            if kind == "identity":
                                r, s = JP.quantize(x, s, index, recipe, transpose=transpose)
                            elif kind == "gelu":
                                r, s = JP.gelu_quantize(x, s, index, recipe, approximate=approximate,
                                                        transpose=transpose)
                            else:
                                r, s = JP.dgelu_quantize(x, x, s, index, recipe, approximate=approximate,
                                                         transpose=transpose, dbias=transpose)
                            outs.append(r)
                        b = x if kind == "dgelu" else None
                        return outs, s, JP.amax(x, b, op=kind, approximate=approximate)

                    try:
                        text = jax.jit(step).trace(x, state).lower(lowering_platforms=("cuda",)).as_text()
                        calls = SP.custom_calls(text)
                        missing = [SP.attr(c, "name") for c in calls
                                   if f".entry {SP.attr(c, 'name').strip(chr(34))}(" not in SP.kernel_data(c)]
                        bodies = sorted({bodies_of[SP.attr(c, "name").strip(chr(34))] for c in calls})
                        result["programs"][name] = {"ok": not missing, "calls": len(calls), "bodies": bodies,
                                                    "log": f"no .entry for {missing}" if missing else ""}
                        result["calls"] += len(calls)
                    except Exception as e:  # noqa: BLE001 - the verdict says what failed
                        result["programs"][name] = {"ok": False, "calls": 0, "bodies": [],
                                                    "log": f"{type(e).__name__}: {e}"[-4000:]}
        from fusedfp8.jax.meta import fresh_meta

        for prog, fn, arg in (("update_scales", lambda s: JP.update_scales(s, recipe), state),
                              ("update_meta", lambda m: JP.update_meta(m, recipe, (False, True)),
                               fresh_meta(recipe, 2))):
            try:
                text = jax.jit(fn).trace(arg).lower(lowering_platforms=("cuda",)).as_text()
                calls = SP.custom_calls(text)
                name = SP.attr(calls[0], "name").strip(chr(34)) if calls else ""
                result["programs"][prog] = {"ok": len(calls) == 1 and f".entry {name}(" in SP.kernel_data(calls[0]),
                                            "calls": len(calls), "bodies": [bodies_of.get(name, "")], "log": ""}
            except Exception as e:  # noqa: BLE001
                result["programs"][prog] = {"ok": False, "calls": 0, "bodies": [],
                                            "log": f"{type(e).__name__}: {e}"[-4000:]}
        result["compiles"] = real.cache_info().currsize
        result["seconds"] = time.monotonic() - t0
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
