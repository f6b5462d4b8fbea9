"""Packaging for fusedfp8.

The CUDA sources live in the top-level ``cuda_src/`` directory of the repository. They are
shipped inside the installed package as ``fusedfp8/cuda_src/*.cu|*.cuh`` (a package-dir
mapping below), so that a non-editable install can compile its kernels. At run time
``fusedfp8._cuda`` looks first at ``<repo>/cuda_src`` next to the package (editable install
or a source checkout), then at ``fusedfp8/cuda_src`` inside the package.
"""

from setuptools import find_packages, setup

_TORCH = ["torch>=2.11"]
_JAX = ["jax>=0.10", "flax>=0.12", "optax"]
_CUDA = ["cupy-cuda13x>=13"]
_PLOTS = ["tqdm", "matplotlib"]


def _union(*groups):
    out = []
    for group in groups:
        for req in group:
            if req not in out:
                out.append(req)
    return out


# `pip install -e ".[demo]"` is all `python -m fusedfp8 demo` needs (torch, the progress bar, the
# plot); on a GPU add the cuda extra.
_DEMO = _union(_TORCH, _PLOTS)
_TEST = _union([
    "pytest>=8",
    "hypothesis>=6",
    "ml_dtypes>=0.5",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime",
    "cuda-bindings",
], _TORCH, _JAX, _PLOTS)


setup(
    name="fusedfp8",
    version="0.1.0",
    description=(
        "Fused FP8 quantize + amax (+ transpose, + activation) kernels as CuPy RawKernels, "
        "with delayed scaling, for PyTorch and JAX"
    ),
    python_requires=">=3.11",
    packages=[*find_packages(include=["fusedfp8*"]), "fusedfp8.cuda_src"],
    package_dir={"fusedfp8.cuda_src": "cuda_src"},
    package_data={"fusedfp8.cuda_src": ["*.cu", "*.cuh"]},
    include_package_data=False,
    zip_safe=False,
    install_requires=[
        "numpy>=1.26",
        "ml_dtypes>=0.5",
    ],
    extras_require={
        "torch": _TORCH,
        "jax": _JAX,
        "cuda": _CUDA,
        "demo": _DEMO,
        "test": _TEST,
        "all": _union(_TORCH, _JAX, _CUDA, _DEMO, _TEST),
    },
)
