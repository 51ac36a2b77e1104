"""The BLAS preload (mlx_tandem._blas): chosen before MLX loads, honouring TANDEM_BLAS."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

PROBE = (
    "import mlx_tandem, mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)));"
    "maps = open('/proc/self/maps').read();"
    "print(mlx_tandem.BLAS.name, 'libopenblas' in maps)"
)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="preload is Linux-only")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "TANDEM_BLAS"} | env
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120, check=False)


@linux
@pytest.mark.skipif(not ctypes.util.find_library("openblas"), reason="no OpenBLAS installed")
def test_openblas_is_preloaded_by_default():
    done = _run(PROBE)
    assert done.stdout.split() == ["openblas", "True"], done.stderr


@linux
def test_tandem_blas_off_keeps_mlx_reference_blas():
    done = _run(PROBE, TANDEM_BLAS="off")
    assert done.stdout.split() == ["reference", "False"], done.stderr


@linux
def test_a_blas_path_that_cannot_load_is_an_error():
    done = _run("import mlx_tandem", TANDEM_BLAS="/nonexistent/libblas.so")
    assert done.returncode != 0 and "TANDEM_BLAS='/nonexistent/libblas.so'" in done.stderr


@linux
def test_mlx_imported_first_is_reported_not_preloaded():
    done = _run("import mlx.core; import mlx_tandem; print(mlx_tandem.BLAS.name, "
                "mlx_tandem.BLAS.reason)")
    assert done.stdout.startswith("reference mlx was imported before mlx_tandem"), done.stderr


def test_the_blas_thread_count_is_read_and_set():
    from mlx_tandem._blas import blas_threads, set_blas_threads

    with pytest.raises(ValueError, match="at least 1"):
        set_blas_threads(0)
    before = blas_threads()
    if before == 0:
        pytest.skip("no OpenBLAS in this process")
    try:
        set_blas_threads(before + 1)
        assert blas_threads() == before + 1
    finally:
        set_blas_threads(before)
    assert blas_threads() == before
