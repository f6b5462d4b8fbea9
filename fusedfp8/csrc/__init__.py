"""The compiled host shim: build, cache, load, and why not.

Two libraries, each the launch-plan interpreter (``plan.h``) with one front end:

- ``xla`` (``xla_ffi.cc``): a plain shared library (ctypes) holding the XLA FFI handler
  ``ff8_xla_launch``; compiled with the headers of ``jax.ffi.include_dir()``, links nothing of jax.
- ``torch`` (``torch_ops.cc``): a Python extension module, the C++ CUDA kernels of the
  ``fusedfp8::*`` custom ops, compiled against the installed torch (the CPU wheel suffices).

Where a library comes from, first match wins:

1. built by ``setup.py`` (``pip install -e .`` or a wheel) beside this file, if its stamp equals
   the fingerprint of this process (sources, flags, Python, framework version);
2. the cache folder (``$FUSEDFP8_CACHE_DIR``, default ``~/.cache/fusedfp8/shim``), keyed by that
   fingerprint;
3. compiled into the cache on first use, with one line on stderr; a file lock lets concurrent
   processes (DDP ranks) compile it once. A failed compile is remembered
   (``<name>-<fingerprint>.failed``, with the compiler's log) so that later processes do not
   retry it; delete that file to retry.

An encoded plan (:mod:`fusedfp8.launch.format`) names its kernels by stable id
(:func:`fusedfp8.launch.kernels.kernel_id`), which a
library resolves in a registry of its own (``plan.h``) that :func:`register_kernels` fills with the
handles of every module loaded in the process, before or after the library loads.

The frameworks use the shim by default (:func:`default_on`; its GPU tests compare it with the
Python launch path byte for byte); ``impl='ffi'`` in JAX and
``fusedfp8.pytorch.cpp_path.use_cpp(True)`` ask for it explicitly. Without a C++ compiler,
without the headers, or with ``FUSEDFP8_NO_SHIM=1`` (which also refuses the explicit requests) the
frameworks keep the Python launch path (:mod:`fusedfp8.launch.executor`), and :func:`library` /
:func:`status` say why. This module imports only the standard library at import time (setup.py
loads it by path, before any dependency exists).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = ("xla", "torch")
_SOURCES = {"xla": ("plan.h", "gemm.h", "xla_ffi.cc"), "torch": ("plan.h", "gemm.h", "torch_gemm.h", "torch_ops.cc")}
_WHAT = {"xla": "JAX (XLA FFI)", "torch": "torch"}
TIMEOUT = 900  # seconds a compile may take
# The launch-plan format the libraries read (plan.h's kPlanVersion) and fusedfp8.launch.format writes;
# 2: the cooperative launch step; 3: kernels named by id
PLAN_VERSION = 3


def filename(target: str) -> str:
    """The library's file name (setuptools names an extension so: setup.py builds it under it)."""
    return f"_ff8_{target}" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def cache_dir() -> Path:
    return Path(os.environ.get("FUSEDFP8_CACHE_DIR") or Path.home() / ".cache" / "fusedfp8" / "shim")


def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++, else c++ (None when there is none)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx.split()[0]) and cxx
    return shutil.which("g++") or shutil.which("c++")


class Unavailable(Exception):
    """The shim of a target cannot be built here; the message says why."""


def _flags(target: str) -> tuple[list[str], list[str], str]:
    """(compile flags, link flags, framework version) of ``target``; Unavailable if its framework
    or headers are missing. Imports the framework (cheap when it is already imported)."""
    if target == "xla":
        try:
            import jax
            import jax.ffi
        except ImportError as e:
            raise Unavailable(f"jax is not importable ({e})") from None
        inc = jax.ffi.include_dir()
        if not os.path.isfile(os.path.join(inc, "xla", "ffi", "api", "ffi.h")):
            raise Unavailable(f"the XLA FFI headers are missing from {inc}")
        return ["-std=c++17", "-isystem", inc], ["-ldl"], f"jax {jax.__version__}"
    try:
        import torch
    except ImportError as e:
        raise Unavailable(f"torch is not importable ({e})") from None
    root = Path(torch.__file__).resolve().parent
    py_inc = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(py_inc, "Python.h")):
        raise Unavailable(f"Python.h is missing from {py_inc} (install the Python development headers)")
    if not (root / "include" / "torch" / "library.h").is_file():
        raise Unavailable(f"torch's C++ headers are missing from {root / 'include'}")
    lib = str(root / "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    cflags = ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-isystem", str(root / "include"), "-isystem",
              str(root / "include" / "torch" / "csrc" / "api" / "include"), "-isystem", py_inc]
    lflags = [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl", f"-Wl,-rpath,{lib}"]
    return cflags, lflags, f"torch {torch.__version__}"


def fingerprint(target: str) -> str:
    """What a built library must match to be loaded here (Unavailable if it cannot be built)."""
    cflags, lflags, version = _flags(target)
    h = hashlib.sha256()
    for part in (target, sys.version.split()[0], sysconfig.get_config_var("EXT_SUFFIX") or "", version,
                 " ".join(cflags), " ".join(lflags)):
        h.update(part.encode() + b"\0")
    for name in _SOURCES[target]:
        h.update((HERE / name).read_bytes())
    return h.hexdigest()[:20]


def command(target: str, out: Path, cxx: str) -> list[str]:
    cflags, lflags, _ = _flags(target)
    return [*cxx.split(), "-O2", "-fPIC", "-shared", "-Wall", *cflags, str(HERE / _SOURCES[target][-1]), "-o",
            str(out), *lflags]


def build(target: str, out: Path) -> tuple[bool, str]:
    """Compile ``target`` into ``out`` (atomically: a temporary file, then a rename) and write its
    stamp ``out.stamp``. (ok, why-or-log)."""
    cxx = compiler()
    if cxx is None:
        return False, "no C++ compiler (set CXX, or install g++)"
    try:
        key = fingerprint(target)
        cmd = command(target, out.with_name(f"{out.name}.tmp{os.getpid()}"), cxx)
    except Unavailable as e:
        return False, str(e)
    tmp = Path(cmd[cmd.index("-o") + 1])
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{' '.join(cmd)}\n{type(e).__name__}: {e}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return False, f"{' '.join(cmd)}\nexit status {proc.returncode}\n{proc.stdout}{proc.stderr}"
    os.replace(tmp, out)
    Path(str(out) + ".stamp").write_text(key + "\n")
    return True, ""


def _stamped(path: Path, key: str) -> bool:
    stamp = Path(str(path) + ".stamp")
    return path.is_file() and stamp.is_file() and stamp.read_text().strip() == key


def _open(target: str, path: Path):
    """Load a built library: the ctypes library (xla) or the extension module (torch)."""
    if target == "xla":
        import ctypes

        lib = ctypes.CDLL(str(path))
        lib.ff8_plan_version.restype = ctypes.c_int64
        lib.ff8_dry_run.restype = ctypes.c_int64
        lib.ff8_dry_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
        lib.ff8_register_kernels.restype = ctypes.c_int64
        lib.ff8_register_kernels.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_char_p, ctypes.c_int64]
        i64, vp, cp = ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p  # the FP8 GEMM's (gemm.h)
        for name, args, res in (("ff8_gemm_set_library", [cp], None), ("ff8_gemm_load", [cp, i64], i64),
                                ("ff8_gemm_check", [vp, cp, i64], i64), ("ff8_gemm_prepare", [i64, vp, cp, i64], i64)):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
        version = lib.ff8_plan_version()
        lib.ff8_gemm_set_library(cublaslt_path().encode())  # (read at the FP8 GEMM's first use)
    else:
        import torch  # noqa: F401  (its libraries first)

        name = "_ff8_torch"
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_loader(name, loader, origin=str(path))
        lib = importlib.util.module_from_spec(spec)
        loader.exec_module(lib)
        version = lib.plan_version()
        lib.gemm_set_library(cublaslt_path())
    if version != PLAN_VERSION:
        raise ImportError(f"{path} reads launch plans of version {version}, this package writes {PLAN_VERSION}")
    return lib


_lock = threading.Lock()
_found: dict = {}  # target -> (library or None, where it came from or why not)


def library(target: str):
    """(library, origin) of ``target``, loading, and on first use compiling, it once per process;
    (None, why) where it cannot be had. A library loaded is told of every kernel registered."""
    found = _found.get(target)
    if found is None:
        with _lock:
            found = _found.get(target)
            if found is None:
                found = _find(target)
                if found[0] is not None:
                    _adopt(target, found[0])
                _found[target] = found
    return found


# ---- the kernel registry: the handles behind the ids of encoded plans (plan.h, launch.kernels.kernel_id) ----
MAX_DEVICES = 64  # CUDA ordinals 0 .. 63 (plan.h's kernels::kMaxDevices)
_kernels: dict = {}  # CUDA ordinal -> {kernel id: CUfunction handle}, every kernel loaded in this process
_shims: list = []  # (target, library) of the libraries loaded, each told of every kernel
_kernels_lock = threading.Lock()


def register_kernels(device: int, kernels) -> None:
    """Kernel id ``kid`` is the handle ``func`` on CUDA device ``device``, for each (kid, func) of
    ``kernels`` (the kernels of a module just loaded: fusedfp8.launch.kernels calls this; a later handle of
    an id replaces the earlier). The libraries loaded now are told at once, any loaded later when
    it loads: an encoded plan names its kernels by id, which the libraries resolve."""
    pairs = [(int(k), int(f)) for k, f in kernels]
    if not 0 <= device < MAX_DEVICES:
        raise ValueError(f"fusedfp8: CUDA device {device} is out of range for the kernel registry "
                         f"(0 .. {MAX_DEVICES - 1})")
    for k, f in pairs:
        if not 0 < k < 2 ** 63:
            raise ValueError(f"fusedfp8: id {k} is not a kernel id (1 .. 2**63 - 1: fusedfp8.launch.kernels.kernel_id)")
        if not 0 < f < 2 ** 64:
            raise ValueError(f"fusedfp8: kernel {k:016x}: handle {f} is null or not a pointer")
    with _kernels_lock:
        for target, lib in _shims:
            _tell(target, lib, device, pairs)
        _kernels.setdefault(device, {}).update(pairs)


def _adopt(target: str, lib) -> None:
    with _kernels_lock:
        for device, known in _kernels.items():
            _tell(target, lib, device, list(known.items()))
        _shims.append((target, lib))


def _tell(target: str, lib, device: int, pairs: list) -> None:
    if not pairs:
        return
    import struct

    ids = struct.pack(f"<{len(pairs)}q", *(k for k, _ in pairs))
    funcs = struct.pack(f"<{len(pairs)}Q", *(f for _, f in pairs))
    if target == "torch":
        lib.register_kernels(device, ids, funcs)  # (raises ValueError with the reason)
        return
    import ctypes

    err = ctypes.create_string_buffer(512)
    if lib.ff8_register_kernels(device, ids, funcs, len(pairs), err, len(err)) != 0:
        raise ValueError(err.value.decode())


def switched_off() -> bool:
    """``FUSEDFP8_NO_SHIM`` set to anything but '' or '0': the Python launch path everywhere."""
    return os.environ.get("FUSEDFP8_NO_SHIM", "") not in ("", "0")


def _find(target: str):
    if switched_off():
        return None, "FUSEDFP8_NO_SHIM is set"
    try:
        key = fingerprint(target)
    except Unavailable as e:
        return None, str(e)
    name = filename(target)
    packaged = HERE / name
    if _stamped(packaged, key):
        try:
            return _open(target, packaged), f"built at install time: {packaged}"
        except (OSError, ImportError) as e:
            stale = f"{packaged} does not load ({e}); "
    else:
        stale = ""
    stem, dot, ext = name.partition(".")
    cached = cache_dir() / f"{stem}-{key}{dot}{ext}"
    failed = cached.with_name(f"{stem}-{key}.failed")
    if not _stamped(cached, key):
        if failed.is_file():
            return None, f"{stale}compiling it failed before (log: {failed}; delete that file to retry)"
        cxx = compiler()
        if cxx is None:
            return None, f"{stale}no C++ compiler to build it (set CXX, or install g++)"
        cached.parent.mkdir(parents=True, exist_ok=True)
        import fcntl

        with open(cached.with_name(f"{stem}-{key}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling it right now
            if not _stamped(cached, key) and not failed.is_file():
                print(f"fusedfp8: compiling the {_WHAT[target]} launch shim with {cxx.split()[0]} (first use, "
                      f"~{20 if target == 'torch' else 2} s; cached in {cached.parent})", file=sys.stderr, flush=True)
                ok, log = build(target, cached)
                if not ok:
                    failed.write_text(log + "\n")
                    return None, f"{stale}compiling it failed (log: {failed}; delete that file to retry)"
        if failed.is_file() and not _stamped(cached, key):
            return None, f"{stale}compiling it failed (log: {failed}; delete that file to retry)"
    try:
        return _open(target, cached), f"compiled on first use: {cached}"
    except (OSError, ImportError) as e:
        return None, f"{stale}{cached} does not load: {e}"


_CUBLASLT = (("cu13", "libcublasLt.so.13"), ("cublas", "libcublasLt.so.12"))  # nvidia wheel folder, library


def cublaslt_path() -> str:
    """Where the FP8 GEMM of the shim (gemm.h) loads cuBLASLt from when the process has none
    loaded yet: a libcublasLt already mapped into this process (the copy XLA or torch use), else
    the nvidia cuBLAS wheel that jax / torch install (``nvidia/cu13/lib``, ``nvidia/cublas/lib``),
    else "" (the shim then tries the sonames on the loader's search path)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libcublasLt.so"):
                    return path
    except OSError:
        pass
    spec = importlib.util.find_spec("nvidia") if "nvidia" not in sys.modules else sys.modules["nvidia"].__spec__
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for folder, name in _CUBLASLT:
            path = os.path.join(root, folder, "lib", name)
            if os.path.isfile(path):
                return path
    return ""


def default_on() -> tuple[bool, str]:
    """(whether the frameworks take the shim without being asked, why not)."""
    if switched_off():
        return False, "FUSEDFP8_NO_SHIM is set"
    return True, ""


def status(target: str) -> tuple[bool | None, str]:
    """Without building anything: (True, where) when the library is loaded or ready to load,
    (None, how it would be built) when the first use would compile it, (False, why) when it
    cannot be had."""
    found = _found.get(target)
    if found is not None:
        return found[0] is not None, found[1]
    if switched_off():
        return False, "FUSEDFP8_NO_SHIM is set"
    try:
        key = fingerprint(target)
    except Unavailable as e:
        return False, str(e)
    name = filename(target)
    if _stamped(HERE / name, key):
        return True, f"built at install time: {HERE / name}"
    stem, dot, ext = name.partition(".")
    cached = cache_dir() / f"{stem}-{key}{dot}{ext}"
    if _stamped(cached, key):
        return True, f"compiled into the cache: {cached}"
    if cached.with_name(f"{stem}-{key}.failed").is_file():
        return False, f"compiling it failed (log: {cached.with_name(f'{stem}-{key}.failed')})"
    cxx = compiler()
    if cxx is None:
        return False, "no C++ compiler to build it (set CXX, or install g++)"
    return None, f"not built yet: the first use compiles it with {cxx.split()[0]} into {cache_dir()}"
