"""Helpers shared by the test folders (imported as ``support.<module>``; tests/conftest.py puts
tests/ on sys.path, and the tests/run/ scripts do the same).

- :mod:`.frameworks`: arrays of numpy / torch / jax / cupy to and from numpy, bit-preserving
  byte views, result-type checks.
- :mod:`.shapes`: the shape groups (aligned, ragged, large) and the edge values.
- :mod:`.fuzz`: seeded fuzz cases and the harness that runs them on a device.
- :mod:`.torch_helpers`: inputs, the scaled_mm spy, SQNR, one train step.
- :mod:`.reliability` / :mod:`.flax_reliability`: fault injection (and the checkpoint runs) in
  torch / flax training.
- :mod:`.checkpoint`: running a checkpoint leg in a fresh process and comparing the records.
- :mod:`.torch_distributed`: the torch.distributed scenarios and their oracle.
- :mod:`.nvrtc`: compiling CUDA source for sm_90 with NVRTC (no GPU), for tests/run/.
- :mod:`.readme`: README.md's blocks and their markers.
- :mod:`.background`: the tests/run/ jobs that run beside the in-process tests.
"""
