"""CPU kernels of our own, compiled on first use: the skinny GEMM, a MoE layer's SwiGLU experts
for few rows each, and paged decode attention.

``load_native()`` builds this folder's C++ sources (``skinny_gemm.cpp``, ``expert_swiglu.cpp``,
``paged_attention.cpp``, ``bindings.cpp``, sharing ``simd.h`` and ``skinny_gemm.h``) with torch's
C++ extension builder (the system C++ compiler, ``-O3 -march=native``) once per machine, source,
torch version and CPU into
``<cache>/native-kernels/`` (~15 s on 2 cores), and loads it; later processes load the built
library in milliseconds. Where nothing can be built (no compiler, no torch headers) or
``BATCHGEN_DATA_NATIVE_KERNELS=0`` is set, it returns None and the engine keeps torch's kernels:
the GEMM tuner only ever chooses among kernels that exist and measured fastest.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

from batchgen_data.hardware import cpu_model
from batchgen_data.paths import cache_dir

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("skinny_gemm.cpp", "expert_swiglu.cpp",
                                                       "paged_attention.cpp", "bindings.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "skinny_gemm.h")]
ENV_SWITCH = "BATCHGEN_DATA_NATIVE_KERNELS"  # "0" keeps torch's kernels only


def native_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=1)
def load_native() -> ModuleType | None:
    """The compiled kernels (``skinny_linear``, ``swiglu_experts``, ``paged_decode_attention``), or
    None where they cannot be built here."""
    if not native_enabled() or not torch.backends.cpu.get_cpu_capability():
        return None
    sources = [path.read_bytes() for path in _SOURCES + _HEADERS]  # a changed header rebuilds too
    key = hashlib.sha1(repr((sources, torch.__version__, cpu_model(), platform.machine())).encode()).hexdigest()[:12]
    name = f"batchgen_native_{key}"
    folder = cache_dir() / "native-kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        module = load(name=name, sources=[str(path) for path in _SOURCES], build_directory=str(folder),
                      # -fopenmp for ATen's header-only parallel_for; its GOMP symbols resolve to
                      # the OpenMP runtime torch already loaded (no second runtime is linked).
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no headers, a failed build: torch's kernels serve
        logger.warning("native CPU kernels unavailable (%s: %s); using torch's", type(err).__name__,
                       str(err).splitlines()[0] if str(err) else "")
        return None
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        logger.info("built native CPU kernels in %.1f s (%s)", elapsed, folder)
    return module


_ACTIVE = {"on": False}


def use_native_kernels(enabled: bool) -> None:
    """The engine turns the native layer kernels on (decode attention, the fused experts) once
    ``load_native`` succeeds for a CPU fp32 model; the GEMM plan chooses ``skinny_linear`` apart."""
    _ACTIVE["on"] = enabled


def active_native() -> ModuleType | None:
    """The native kernels if the engine turned them on in this process, else None."""
    return load_native() if _ACTIVE["on"] else None
