"""The FFI FP8 GEMM with XLA's command buffers on or off (tests/jax/test_jax_gemm.py runs it twice),
in a process of its own because XLA reads its flags when jax starts:

    XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLASLT --xla_gpu_graph_min_graph_size=1" \
        python tests/run/jax_gemm_graph.py OUT.npz
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" python tests/run/jax_gemm_graph.py OUT.npz

Five donated SGD steps of fp8_dot (ragged 1000x48x80) and of fp8_mlp (2048x1024x4096). Writes
OUT.npz: the weights and metas after the steps (``leaf_0``, ``leaf_1``, ...), the ``losses`` and
``in_command_buffer`` (the optimized HLO has a command-buffer computation holding the GEMM).
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo


def _in_command_buffer(text: str) -> bool:
    comps = re.split(r"\n(?=(?:ENTRY )?%?[\w.\-]+ [(\[{])", text)
    return any(re.match(r"%?command_buffer", c.strip()) and "fusedfp8_fp8_gemm" in c for c in comps)


def main(out_path: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fusedfp8
    from fusedfp8.jax import functional as F
    from fusedfp8.jax import gemm as G
    from fusedfp8.jax import meta as JM

    ok, why = G.gemm_target()
    assert ok, why
    recipe = fusedfp8.DelayedScaling(amax_history_len=16)
    dev = jax.devices("gpu")[0]
    rng = np.random.default_rng(0)

    def arr(shape, scale):
        return jax.device_put(jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16), dev)

    x1, w1 = arr((1000, 48), 1.0), arr((48, 80), 0.05)
    x2, v1, v2 = arr((2048, 1024), 1.0), arr((1024, 4096), 0.03), arr((4096, 1024), 0.015)
    b1, b2 = jnp.zeros((4096,), jnp.bfloat16), jnp.zeros((1024,), jnp.bfloat16)

    def step(params, metas):
        def loss(params, metas):
            (w, v1, v2), (m0, m1, m2) = params, metas
            y = F.fp8_dot(x1, w, m0, recipe).astype(jnp.float32)
            z = F.fp8_mlp(x2, v1, b1, v2, b2, m1, m2, recipe).astype(jnp.float32)
            return jnp.mean(y ** 2) + jnp.mean(z ** 2)

        l, (g, new) = jax.value_and_grad(loss, argnums=(0, 1))(params, metas)
        return jax.tree.map(lambda p, d: (p - 0.1 * d).astype(p.dtype), params, g), new, l

    fn = jax.jit(step, donate_argnums=(0, 1))
    params = tuple(jnp.array(a) for a in (w1, v1, v2))
    metas = tuple(jax.tree.map(lambda a: jax.device_put(a, dev), JM.fresh_meta(recipe)) for _ in range(3))
    text = fn.lower(params, metas).compile().as_text()
    losses = []
    for _ in range(5):
        params, metas, l = fn(params, metas)
        losses.append(float(l))
    leaves = {f"leaf_{i}": np.asarray(a, np.float32) for i, a in enumerate(jax.tree.leaves((params, metas)))}
    np.savez(out_path, losses=np.array(losses, np.float64), in_command_buffer=_in_command_buffer(text), **leaves)
    print("losses", losses, "in_command_buffer", _in_command_buffer(text))


if __name__ == "__main__":
    main(sys.argv[1])
