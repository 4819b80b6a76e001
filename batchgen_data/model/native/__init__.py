"""CPU kernels of our own, compiled on first use: the skinny GEMM, a MoE layer's SwiGLU experts
for few rows each, paged decode attention, fused decoder blocks, logits-row statistics for
logprobs, and grammar bitmasks on logits rows.

``load_native()`` builds this folder's C++ sources (``skinny_gemm.cpp``, ``expert_swiglu.cpp``,
``paged_attention.cpp``, ``decode_layer.cpp``, ``logit_stats.cpp``, ``grammar_mask.cpp``, ``argmax.cpp``,
``bindings.cpp``, sharing ``simd.h``, ``skinny_gemm.h`` and ``kernels.h``) with torch's C++ extension builder (the system C++ compiler, ``-O3
-march=native``) once per machine, source, torch version and CPU into ``<cache>/native-kernels/``
(~5 s on 2 cores: no unit includes torch's C++ API, only ATen's thread pool and pybind11), and
loads it; later processes import the built library directly. ``kernels.py`` wraps its raw-buffer
functions over tensors. Where nothing can be built (no compiler, no torch headers) or
``BATCHGEN_DATA_NATIVE_KERNELS=0`` is set, it returns None and the engine keeps torch's kernels:
the GEMM tuner only ever chooses among kernels that exist and measured fastest.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from types import ModuleType

import torch

from batchgen_data.hardware import cpu_model
from batchgen_data.model.native.kernels import NativeKernels
from batchgen_data.paths import cache_dir

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("skinny_gemm.cpp", "expert_swiglu.cpp",
                                                       "paged_attention.cpp", "decode_layer.cpp",
                                                       "logit_stats.cpp", "grammar_mask.cpp", "argmax.cpp",
                                                       "bindings.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "skinny_gemm.h", "kernels.h")]
ENV_SWITCH = "BATCHGEN_DATA_NATIVE_KERNELS"  # "0" keeps torch's kernels only


def native_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


_CFLAGS = ["-O3", "-march=native",
           # no fused multiply-adds beyond the explicit ones: a*b + c rounds twice, as in torch
           "-ffp-contract=off",
           # for ATen's header-only parallel_for; its GOMP symbols resolve to the OpenMP runtime
           # torch already loaded (no second runtime is linked)
           "-fopenmp"]


@functools.lru_cache(maxsize=1)
def load_native() -> NativeKernels | None:
    """The compiled kernels (``skinny_linear``, ``swiglu_experts``, ``paged_decode_attention``), or
    None where they cannot be built here."""
    if not native_enabled() or not torch.backends.cpu.get_cpu_capability():
        return None
    name = library_name()
    folder = cache_dir() / "native-kernels" / name
    start = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _build_lock(folder):
            library = _import_built(name, folder) or _build(name, folder)
    except Exception as err:  # no compiler, no headers, a failed build: torch's kernels serve
        logger.warning("native CPU kernels unavailable (%s: %s); using torch's", type(err).__name__,
                       str(err).splitlines()[0] if str(err) else "")
        return None
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        logger.info("built native CPU kernels in %.1f s (%s)", elapsed, folder)
    return NativeKernels(library)


def library_name() -> str:
    """The built library's name: a hash of the sources, flags, torch version and CPU."""
    sources = [path.read_bytes() for path in _SOURCES + _HEADERS]  # a changed header rebuilds too
    key = hashlib.sha1(repr((sources, _CFLAGS, torch.__version__, cpu_model(), platform.machine())).encode())
    return f"batchgen_native_{key.hexdigest()[:12]}"


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One process builds at a time. An OS file lock, released if its holder dies (torch's own
    lock file is not: a process killed mid-build would leave every later one waiting forever)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(folder / ".build-lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import_built(name: str, folder: Path) -> ModuleType | None:
    """The library an earlier process built (no compiler run, no torch lock), or None."""
    library = folder / f"{name}.so"
    if not library.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError as err:  # a library cut short by a killed build: build it again
        logger.warning("rebuilding native kernels (%s)", err)
        library.unlink(missing_ok=True)
        return None


def _build(name: str, folder: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    (folder / "lock").unlink(missing_ok=True)  # torch's lock, stale if a build was killed: we hold ours
    module = load(name=name, sources=[str(path) for path in _SOURCES], build_directory=str(folder),
                  extra_cflags=_CFLAGS, verbose=False)
    built, expected = Path(module.__file__), folder / f"{name}.so"
    if built != expected:  # torch names a second build of one name in a process "<name>_v1"
        staging = folder / f".{name}.{os.getpid()}.so"
        shutil.copyfile(built, staging)
        os.replace(staging, expected)  # where later processes look (``_import_built``)
    return module


_ACTIVE = {"on": False}


def use_native_kernels(enabled: bool) -> None:
    """The engine turns the native layer kernels on (decode attention, the fused experts) once
    ``load_native`` succeeds for a CPU fp32 model; the GEMM plan chooses ``skinny_linear`` apart."""
    _ACTIVE["on"] = enabled


def active_native() -> NativeKernels | None:
    """The native kernels if the engine turned them on in this process, else None."""
    return load_native() if _ACTIVE["on"] else None
