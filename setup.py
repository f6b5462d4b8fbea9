"""Packaging for fusedfp8.

The CUDA sources live in the top-level ``cuda_src/`` directory of the repository. They are
shipped inside the installed package as ``fusedfp8/cuda_src/*.cu|*.cuh`` (a package-dir
mapping below), so that a non-editable install can compile its kernels. At run time
``fusedfp8.launch.kernels`` looks first at ``<repo>/cuda_src`` next to the package (editable install
or a source checkout), then at ``fusedfp8/cuda_src`` inside the package.

The compiled host shim (``fusedfp8/csrc``: the launch-plan interpreter as an XLA FFI handler
and as the torch C++ ops) is built here when a C++ compiler and the framework it is for (jax,
torch) are importable where setup.py runs; otherwise the install goes on, says why, and the
shim is compiled on first use into a cache folder (see fusedfp8/csrc/__init__.py). pip builds
in an isolated environment without jax or torch: ``pip install --no-build-isolation -e .`` in
an environment that has them builds the shim now.
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

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
    "pytest-xdist>=3",  # two workers by default (tests/conftest.py)
    "hypothesis>=6",
    "ml_dtypes>=0.5",
    "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime",
    "cuda-bindings",
], _TORCH, _JAX, _PLOTS)

_HERE = Path(__file__).resolve().parent


def _shim():
    """fusedfp8/csrc/__init__.py, loaded by path (the package's dependencies may not exist yet)."""
    spec = importlib.util.spec_from_file_location("_fusedfp8_shim_build", _HERE / "fusedfp8" / "csrc" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildShim(build_ext):
    """Builds each shim library it can; one that cannot be built is skipped with the reason (the
    install never fails on it: the library is then compiled on first use)."""

    def build_extension(self, ext):
        shim = _shim()
        target = ext.name.rsplit("._ff8_", 1)[1]
        out = Path(self.get_ext_fullpath(ext.name))
        ok, why = shim.build(target, out)
        what = {"xla": "JAX (XLA FFI)", "torch": "torch"}[target]
        if ok:
            print(f"fusedfp8: built the {what} launch shim: {out}", file=sys.stderr)
        else:
            first = why.strip().splitlines()[0] if why.strip() else "unknown reason"
            if "not importable" in first:  # pip's isolated build environment has neither jax nor torch
                first += " where setup.py runs; pip install --no-build-isolation builds it here"
            print(f"fusedfp8: not building the {what} launch shim now ({first}); it is compiled on first use "
                  f"where a C++ compiler is found, and the Python launch path runs without it", file=sys.stderr)
            if "\n" in why.strip():
                print(why, file=sys.stderr)

    def copy_extensions_to_source(self):
        """Editable installs: copy what was built, with its stamp, beside the sources."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace, regular = self._get_inplace_equivalent(build_py, ext)
            for suffix in ("", ".stamp"):
                if os.path.exists(regular + suffix):
                    self.copy_file(regular + suffix, inplace + suffix, level=self.verbose)

    def get_outputs(self):
        return [p for p in super().get_outputs() if os.path.exists(p)]


setup(
    name="fusedfp8",
    version="0.1.0",
    description=(
        "Fused FP8 quantize + amax (+ transpose, + activation) kernels as CuPy RawKernels, "
        "with delayed scaling, for PyTorch and JAX"
    ),
    license="Apache-2.0",  # LICENSE
    python_requires=">=3.11",
    packages=[*find_packages(include=["fusedfp8*"]), "fusedfp8.cuda_src"],
    package_dir={"fusedfp8.cuda_src": "cuda_src"},
    package_data={"fusedfp8.cuda_src": ["*.cu", "*.cuh"], "fusedfp8.csrc": ["*.h", "*.cc"],
                  "fusedfp8": ["data/*.json"]},  # the calibration tables of policy='auto'; see fusedfp8/policy.py
    include_package_data=False,
    ext_modules=[Extension(f"fusedfp8.csrc._ff8_{t}", sources=[f"fusedfp8/csrc/{src}"], optional=True)
                 for t, src in (("xla", "xla_ffi.cc"), ("torch", "torch_ops.cc"))],
    cmdclass={"build_ext": BuildShim},
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
