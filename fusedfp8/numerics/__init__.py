"""The ground floor: pure float32 numerics, no state object, no framework glue, no device.

- :mod:`.constants`: the float32 constants and polynomial coefficients (the same hex literals as
  ``cuda_src/common.cuh``).
- :mod:`.reference`: the NumPy / ml_dtypes twin of every kernel (cast, amax, exp, erfc, gelu,
  dgelu, fma, column sums): the oracle of the CUDA kernels and the CPU backend.
- :mod:`.jnp`: the same op sequences in ``jax.numpy`` (imports jax; load it only when needed):
  the guarded arithmetic, amax, scale and cast; :mod:`.jnp_gelu` the activations,
  :mod:`.jnp_layernorm` LayerNorm.
- :mod:`.scaling`: the delayed-scaling rule and the scale formula, written once over an array
  namespace.
- :mod:`.block`: block scaling (1x128 and 128x128 blocks, each with the scale of its own max): the
  bytes, the scales in the layout cuBLASLt's block-scaled GEMM reads, the transposed copies;
  :mod:`.block_jnp`: the same in ``jax.numpy``, byte for byte (imports jax).
- :mod:`.xp`: the array namespaces (numpy, cupy, torch, jax.numpy) that :mod:`.scaling` runs on.

Nothing here imports the rest of the package but :mod:`fusedfp8.formats` and :mod:`fusedfp8.types`.
"""
