"""Arrays of every framework to and from numpy, bit for bit (bfloat16 and float8 as ml_dtypes),
and the type checks of results that come back in the caller's framework."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
HOST_FRAMEWORKS = ("numpy", "torch", "jax")  # the frameworks whose CPU arrays run the host path


def np_dtype(name: str) -> np.dtype:
    """'float32' / 'float16' / 'bfloat16' (or an fp8 dtype name) as a numpy dtype."""
    return np.dtype(getattr(ml_dtypes, name)) if name.startswith(("bfloat", "float8")) else np.dtype(name)


def to_fw(x: np.ndarray, fw: str, device: str = "cpu"):
    """A copy of the numpy array x (float32/float16/ml_dtypes bfloat16/float8/ints) as a ``fw``
    array ('numpy', 'torch', 'jax', 'cupy') on ``device``."""
    x = np.array(x, order="C", copy=True)  # (np.ascontiguousarray would make a 0-d array 1-d)
    if fw == "numpy":
        assert device == "cpu", device
        return x
    if fw == "jax":
        import jax
        import jax.numpy as jnp

        out = jnp.asarray(x)
        return out if device == "cpu" else jax.device_put(out, jax.devices("gpu")[0])
    if fw == "cupy":
        import cupy

        return cupy.asarray(x.view(np.uint8) if x.dtype.itemsize == 1 and x.dtype.kind not in "iub" else x)
    return to_torch(x, device)


def to_torch(x: np.ndarray, device: str = "cpu"):
    import torch

    x = np.array(x, order="C", copy=True)
    if x.dtype.itemsize == 1 and x.dtype.kind not in "iub":  # float8
        t = torch.from_numpy(x.view(np.uint8)).view(getattr(torch, x.dtype.name))
    elif x.dtype == BF16:
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(x)
    return t.to(device)


def to_np(a) -> np.ndarray:
    """Any framework's array -> numpy on the host, bfloat16 / float8 as ml_dtypes (bits preserved)."""
    mod = type(a).__module__
    if mod.startswith("torch"):
        import torch

        t = a.detach().contiguous().cpu()
        name = str(t.dtype).replace("torch.", "")
        if name == "bfloat16":
            return t.view(torch.int16).numpy().view(BF16)
        if name.startswith("float8"):
            return t.view(torch.uint8).numpy().view(getattr(ml_dtypes, name))
        return t.numpy()
    if mod.startswith("cupy"):
        import cupy

        return cupy.asnumpy(a)
    return np.asarray(a)


def bytes_of(a) -> bytes:
    """The raw bytes of any framework's array (b'' for an empty one)."""
    return np.ascontiguousarray(to_np(a)).tobytes()


def same_bytes(a, b) -> bool:
    """Same shape and the same bytes (arrays of any framework, or numpy scalars)."""
    a, b = to_np(a), to_np(b)
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def scalar(fw: str, v: float, dtype=np.float32, device: str = "cpu"):
    """A (1,) array holding v, of framework fw on device."""
    return to_fw(np.array([v], dtype), fw, device)


def assert_type(a, fw: str, dtype_name: str, shape, device: str = "cpu") -> None:
    """``a`` is a ``fw`` array of dtype ``dtype_name`` and this shape, on ``device``."""
    if fw == "torch":
        import torch

        assert isinstance(a, torch.Tensor) and a.device.type == device
        assert a.dtype == getattr(torch, dtype_name)
    elif fw == "jax":
        import jax
        import jax.numpy as jnp

        assert isinstance(a, jax.Array)
        assert a.dtype == jnp.dtype(dtype_name)
    else:
        assert type(a) is np.ndarray
        assert a.dtype == (BF16 if dtype_name == "bfloat16" else np.dtype(getattr(ml_dtypes, dtype_name, dtype_name)))
    assert tuple(a.shape) == tuple(shape)


def mse_train_step(x, y):
    """A jitted train step of a flax TrainState on ``mean((apply(params, x) - y) ** 2)`` in float32:
    ``step(state) -> (state, loss)``."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(state):
        def loss_fn(p):
            return jnp.mean((state.apply_fn(p, x).astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step
