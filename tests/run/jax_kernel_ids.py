"""fusedfp8 programs in a process of its own, for tests/jax/test_jax_kernel_ids.py, which runs each
mode in two processes and compares them:

    JAX_PLATFORMS=cpu python tests/run/jax_kernel_ids.py lower OUT.json
    JAX_COMPILATION_CACHE_DIR=DIR python tests/run/jax_kernel_ids.py train OUT.npz     (on a GPU)
    python tests/run/jax_kernel_ids.py serialize DIR; python tests/run/jax_kernel_ids.py run_serialized DIR  (GPU)

``lower``: in a process made to see one GPU (tests/support/fake_cuda.pretend_gpu; each kernel's
handle a random number of this process, as a real handle is a pointer of its process), the
StableHLO of a flax train step (:func:`model_and_step`: per-tensor and block-scaled layers) lowered
for CUDA with impl='auto' (the XLA FFI launch; the per-tensor FP8 GEMM left to XLA's dot, the block-
scaled one the shim's FFI GEMM, its availability forced). Writes OUT.json: ``text``, and the ``handles``,
``ids`` and ``names`` of the kernels this process loaded.

``train``: three steps of the train step on the GPU, JAX's persistent compilation cache in DIR
taking every program (no minimum compile time or size). Writes OUT.npz: the ``losses``, the final
variables (``var/<path>``), jax's cache events (``requests``, ``hits``, ``misses``), ``missed``
(the programs written to the cache, by name, ';'-joined) and ``text`` (the train step's StableHLO).

``serialize``: on the GPU, the primitives' step (:func:`primitives_step`) compiled and run, and its
executable serialized (jax.experimental.serialize_executable). Writes DIR/executable.bin and
DIR/direct.npz (the outputs' bytes). ``run_serialized``: in a fresh process, that executable loaded
and called before anything traced a fusedfp8 function (the handler refuses it: its kernels are
not loaded here), then again after tracing the step. Writes DIR/refused.txt (the error) and
DIR/loaded.npz (the outputs' bytes).
"""
from __future__ import annotations

import json
import os
import secrets
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: support

IN, HIDDEN, FFN, OUT, BATCH = 64, 128, 256, 16, 32


def model_and_step():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import fusedfp8
    from fusedfp8.jax.flax import Fp8DotGeneral, Fp8MLP, TrainState

    recipe = fusedfp8.DelayedScaling(amax_history_len=16)

    def dense(features):
        return nn.Dense(features, dot_general_cls=lambda: Fp8DotGeneral(recipe=recipe))

    block = fusedfp8.BlockScaling()  # (stateless: its kernels' plans are named the same way)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = dense(HIDDEN)(x)
            h = h + nn.Dense(HIDDEN, dot_general_cls=lambda: Fp8DotGeneral(recipe=block))(h)
            return dense(OUT)(h + Fp8MLP(FFN, recipe=recipe)(h))

    model = Net()

    def make_state(x):
        variables = jax.jit(model.init)(jax.random.key(0), x)
        return TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3)).replace(
            step=jnp.zeros((), jnp.int32))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(v):
            return jnp.mean((state.apply_fn(v, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return make_state, train_step


def primitives_step():
    """(step, its arguments as numpy arrays): quantize (with q_t), gelu_quantize and update_scales
    on flat arrays (a state's: the executable's arguments and results are plain pytrees)."""
    import numpy as np

    import fusedfp8
    from fusedfp8.jax import primitives as JP
    from fusedfp8.state import ScalingState

    recipe = fusedfp8.DelayedScaling(amax_history_len=8)

    def step(x, hist, scale, scale_inv, overflows, updates):
        s = ScalingState(hist, scale, scale_inv, overflows, updates, (False, False))
        q, s = JP.quantize(x, s, 0, recipe, transpose=True)
        g, s = JP.gelu_quantize(x, s, 1, recipe)
        s = JP.update_scales(s, recipe)
        return q.data, q.data_t, g.data, s.amax_history, s.scale, s.scale_inv, s.updates

    st = ScalingState.create((False, False), recipe)
    x = (np.random.default_rng(1).standard_normal((96, 80)) * 4).astype(np.float32)
    return step, (x, st.amax_history, st.scale, st.scale_inv, st.overflows, st.updates)


def as_bytes(arrays) -> dict:
    import numpy as np

    return {f"out{k}": np.frombuffer(np.asarray(a).tobytes(), np.uint8) for k, a in enumerate(arrays)}


def batch(step: int):
    import numpy as np

    g = np.random.default_rng(step)
    x = (g.standard_normal((BATCH, IN)) * 3).astype(np.float32)
    return x, (x[:, :OUT] * 0.5 + g.standard_normal((BATCH, OUT))).astype(np.float32)


def lower(out_path: str) -> None:
    from support import fake_cuda as F

    handles: dict = {}
    F.pretend_gpu(setattr, lambda d, k, v: d.__setitem__(k, v),
                  lambda expr: handles.setdefault(expr, 0x7F00_0000_0000 + secrets.randbits(32) * 0x100))
    from fusedfp8.jax import callbacks
    from fusedfp8.jax import gemm as G
    from fusedfp8.launch import kernels as K

    callbacks.gpu_devices = lambda: [0]
    G.gemm_target = lambda: (False, "the FP8 GEMM is not part of this test")
    G._has_gpu, G._block_ready, G._prepared = (lambda: True), (lambda: (True, "forced")), (lambda code: "")
    make_state, train_step = model_and_step()
    x, y = batch(0)
    state = make_state(x)  # (the CPU backend: jax.numpy)
    text = train_step.trace(state, x, y).lower(lowering_platforms=("cuda",)).as_text()
    kernels = [k for ks in K._loaded.values() for k in ks.values()]
    with open(out_path, "w") as f:
        json.dump({"text": text, "handles": [k.func for k in kernels], "ids": [k.kid for k in kernels],
                   "names": [k.name for k in kernels]}, f)


def train(out_path: str) -> None:
    import logging

    import jax
    import numpy as np

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events: dict = {}
    jax.monitoring.register_event_listener(lambda name, **kw: events.__setitem__(name, events.get(name, 0) + 1))
    missed = []

    class Written(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Writing ") and "persistent compilation cache" in record.getMessage():
                missed.append(str(record.args[0]))

    log = logging.getLogger("jax._src.compilation_cache")
    log.setLevel(logging.DEBUG)
    log.addHandler(Written(logging.DEBUG))

    from fusedfp8.jax import cuda_backend

    assert cuda_backend.launch_path()[0] == "ffi", cuda_backend.launch_path()
    make_state, train_step = model_and_step()
    gpu = jax.devices("gpu")[0]
    x, y = (jax.device_put(a, gpu) for a in batch(0))
    state = make_state(x)
    text = train_step.lower(state, x, y).as_text()
    assert "fusedfp8_launch" in text
    losses = []
    for step in range(3):
        x, y = (jax.device_put(a, gpu) for a in batch(step))
        state, loss = train_step(state, x, y)
        losses.append(np.asarray(loss))
    leaves = jax.tree_util.tree_leaves_with_path(state.params)
    out = {f"var/{jax.tree_util.keystr(p)}": np.asarray(a) for p, a in leaves}
    prefix = "/jax/compilation_cache/"
    np.savez(out_path, losses=np.stack(losses), text=np.asarray(text), missed=np.asarray(";".join(missed)),
             requests=events.get(prefix + "compile_requests_use_cache", 0), hits=events.get(prefix + "cache_hits", 0),
             misses=events.get(prefix + "cache_misses", 0), **out)


def serialize(folder: str) -> None:
    import jax
    import numpy as np
    from jax.experimental import serialize_executable

    step, args = primitives_step()
    args = jax.device_put(args, jax.devices("gpu")[0])
    compiled = jax.jit(step).lower(*args).compile()
    np.savez(os.path.join(folder, "direct.npz"), **as_bytes(compiled(*args)))
    payload, _, _ = serialize_executable.serialize(compiled)
    with open(os.path.join(folder, "executable.bin"), "wb") as f:
        f.write(payload)


def run_serialized(folder: str) -> None:
    import jax
    import numpy as np
    from jax.experimental import serialize_executable

    from fusedfp8.jax import callbacks
    from fusedfp8.launch import kernels as K

    ok, why = callbacks.ffi_target()  # the handler registered with jax (a first trace would do it)
    assert ok, why
    step, args = primitives_step()
    args = jax.device_put(args, jax.devices("gpu")[0])
    with open(os.path.join(folder, "executable.bin"), "rb") as f:
        loaded = serialize_executable.deserialize_and_load(f.read(), jax.tree.structure((tuple(args), {})),
                                                           jax.tree.structure((0,) * 7))
    assert not K._loaded, "a kernel module is loaded already"
    try:
        jax.block_until_ready(loaded(*args))
        refused = ""
    except Exception as e:  # noqa: BLE001 - the handler's error, as jax raises it
        refused = f"{type(e).__name__}: {e}"
    with open(os.path.join(folder, "refused.txt"), "w") as f:
        f.write(refused)
    jax.jit(step).lower(*args)  # tracing loads the kernels (and registers them)
    np.savez(os.path.join(folder, "loaded.npz"), **as_bytes(loaded(*args)))


if __name__ == "__main__":
    {"lower": lower, "train": train, "serialize": serialize, "run_serialized": run_serialized}[sys.argv[1]](sys.argv[2])
