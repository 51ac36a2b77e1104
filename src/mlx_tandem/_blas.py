"""Optimized BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel links a reference BLAS (~3.5 GFLOP/s float32 matmul on a
2-core x86 machine).  Loading OpenBLAS with RTLD_GLOBAL *before* MLX initialises
lets its cblas symbols win symbol resolution (~190 GFLOP/s measured).  This
module owns that choice and reports it; `tandem doctor` shows the result.

On an x86 CPU with AVX-512 the preload asks OpenBLAS for its Haswell (AVX2) kernels
(`OPENBLAS_CORETYPE=Haswell`, unless the user set that variable): its AVX-512 sgemm gives a
row's result bits that depend on the call's width (the last 1-8 columns of a 16-column
tile go through another kernel; measured on an AMD EPYC Zen 4 VM, 2026-12-04), and no
batch-invariant attention grouping exists under it for rows over ~1,000 keys, so the
exact rows engine could not run. Its matmul is ~30% slower there (185 -> 131 GFLOP/s).

Environment: TANDEM_BLAS=auto (default) | off | /path/to/libblas.so; OpenBLAS reads its own
OPENBLAS_NUM_THREADS and OPENBLAS_CORETYPE. A path that cannot be loaded does not fail the
import (the CLI could not say so in one line): MLX keeps its reference BLAS, `BlasInfo.error`
says why, and `check_blas_setting` (called by `load` and by every `tandem` command) raises
it. `blas_threads` / `set_blas_threads` read and set that count.
Oracle: tests/test_blas.py (OpenBLAS preloaded by default and mapped into the
process; TANDEM_BLAS=off and mlx-imported-first keep the reference BLAS; a bad
path is an error when loading a model, not at import; an AVX-512 CPU gets the Haswell
kernels unless the user chose, and under the AVX-512 ones attention is not
batch-invariant). Parity with mlx-lm under it: tests/test_generate_parity.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from dataclasses import dataclass

_CANDIDATES = ("libopenblas.so.0", "libopenblas.so")


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "openblas", "reference", "accelerate", "<path>"
    path: str | None
    reason: str
    error: str = ""  # a TANDEM_BLAS path that could not be loaded, and why


def preload_blas(setting: str | None = None) -> BlasInfo:
    """Load an optimized BLAS into the global symbol namespace if it helps here."""
    setting = (setting if setting is not None else os.environ.get("TANDEM_BLAS", "auto")).strip()
    if sys.platform == "darwin":
        return BlasInfo("accelerate", None, "macOS: MLX uses Accelerate/Metal")
    if not sys.platform.startswith("linux"):
        return BlasInfo("reference", None, f"no BLAS preload on {sys.platform}")
    if setting.lower() == "off":
        return BlasInfo("reference", None, "TANDEM_BLAS=off")
    if "mlx.core" in sys.modules:
        return BlasInfo(
            "reference", None, "mlx was imported before mlx_tandem; import mlx_tandem first"
        )
    if setting.lower() != "auto":
        error = _load_path(setting)
        if error:
            return BlasInfo("reference", None, "TANDEM_BLAS could not be loaded", error)
        return BlasInfo(os.path.basename(setting), setting, "TANDEM_BLAS path")
    kernel = _exact_kernel()
    found = ctypes.util.find_library("openblas")
    for name in (found, *_CANDIDATES):
        if not name:
            continue
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return BlasInfo("openblas", name, "preloaded before MLX" + kernel)
    return BlasInfo("reference", None, "OpenBLAS not found (apt-get install libopenblas0-pthread)")


def check_blas_setting() -> None:
    """Raise ValueError where the TANDEM_BLAS this process was started with names a library
    that cannot be loaded (the preload recorded it in `BlasInfo.error` and went on)."""
    setting = os.environ.get("TANDEM_BLAS", "auto").strip()
    if sys.platform.startswith("linux") and setting.lower() not in ("auto", "off"):
        error = _load_path(setting)  # loads nothing new: that path failed, or is loaded
        if error:
            raise ValueError(error)


def _load_path(setting: str) -> str:
    """Load the BLAS at `setting` into the global namespace; what went wrong, or ""."""
    try:
        ctypes.CDLL(setting, mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        return f"TANDEM_BLAS={setting!r} could not be loaded ({err}); set it to auto, off or " \
            "a BLAS library's path"
    return ""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _exact_kernel() -> str:
    """Choose OpenBLAS's Haswell kernels on an AVX-512 CPU (see the header); a note for
    BlasInfo.reason. Left alone where the user set OPENBLAS_CORETYPE."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return f"; OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} (set by the user)"
    flags = _cpu_flags()
    if "avx512f" in flags and {"avx2", "fma"} <= flags:
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"
        return "; Haswell kernels (AVX-512 sgemm is not batch-invariant)"
    return ""


@functools.cache  # looked up once: the rows attention reads the thread count every call
def _openblas_call(name: str) -> ctypes._CFuncPtr | None:
    """OpenBLAS's `name` from the global symbol namespace (the preload put it there)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError):
        return None


def blas_threads() -> int:
    """OpenBLAS's thread count now (0: no OpenBLAS in this process). A projection's bits for
    a row in a call of many rows depend on it, so row plans are probed per count."""
    get = _openblas_call("openblas_get_num_threads")
    return int(get()) if get is not None else 0


def set_blas_threads(count: int) -> None:
    """Set OpenBLAS's thread count (no-op without OpenBLAS). Test workers run one thread each."""
    if count < 1:
        raise ValueError(f"BLAS thread count must be at least 1, got {count}")
    put = _openblas_call("openblas_set_num_threads")
    if put is not None:
        put(int(count))
