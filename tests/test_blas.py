"""The BLAS preload (mlx_tandem._blas): chosen before MLX loads, honouring TANDEM_BLAS."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

from mlx_tandem._blas import _cpu_flags

PROBE = (
    "import mlx_tandem, mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)));"
    "maps = open('/proc/self/maps').read();"
    "print(mlx_tandem.BLAS.name, 'libopenblas' in maps)"
)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="preload is Linux-only")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    drop = ("TANDEM_BLAS", "OPENBLAS_CORETYPE")  # this process's import set the latter
    environ = {k: v for k, v in os.environ.items() if k not in drop} | env
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
    """Not at import (the CLI could not say it in one line), but when a model is loaded, and
    as one line from every `tandem` command."""
    bad = {"TANDEM_BLAS": "/nonexistent/libblas.so"}
    done = _run("import mlx_tandem; print(mlx_tandem.BLAS.error); mlx_tandem.load('x')", **bad)
    named = "TANDEM_BLAS='/nonexistent/libblas.so' could not be loaded"
    assert done.stdout.startswith(named), done.stderr
    assert done.returncode != 0 and f"ValueError: {named}" in done.stderr
    done = _run("from mlx_tandem.cli.main import main; raise SystemExit(main(['models']))", **bad)
    assert done.returncode == 2 and done.stderr.startswith(f"tandem: error: {named}")
    assert len(done.stderr.splitlines()) == 1, done.stderr


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


KERNEL = "import mlx_tandem, os; print(os.environ.get('OPENBLAS_CORETYPE'), '|', mlx_tandem.BLAS.reason)"
avx512 = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or "avx512f" not in _cpu_flags()
    or not ctypes.util.find_library("openblas"),
    reason="needs Linux, OpenBLAS and an AVX-512 CPU",
)


@avx512
def test_an_avx512_cpu_gets_openblas_haswell_kernels_unless_the_user_chose():
    done = _run(KERNEL)
    assert done.stdout.startswith("Haswell | preloaded before MLX; Haswell kernels"), done.stderr
    done = _run(KERNEL, OPENBLAS_CORETYPE="SkylakeX")
    assert done.stdout.startswith("SkylakeX |") and "set by the user" in done.stdout, done.stderr


@avx512
def test_openblas_avx512_kernels_make_attention_depend_on_the_batch():
    """Why the preload picks Haswell kernels: under the AVX-512 sgemm a short row's
    attention changes when a ~2,000-key row shares its call (negative control for
    tests/test_invariance.py::test_invariant_attention_alone_equals_batched)."""
    code = ("import mlx_tandem, mlx.core as mx; from mlx_tandem.kv.attention import "
            "attention_mismatches as m; print(m(1, [70, 2000], 1, 9, 3, 64, mx.float32))")
    assert _run(code).stdout.strip() == "0"
    assert int(_run(code, OPENBLAS_CORETYPE="SkylakeX").stdout.strip()) > 0


@avx512
def test_under_avx512_kernels_the_attention_probe_refuses_instead_of_running_inexact():
    """A user who forces the AVX-512 kernels gets a clear error, not a silently inexact engine."""
    code = ("import mlx_tandem; from mlx_tandem.kv.attention import stable_group_rows as s; "
            "print(s(64, 9, 3, 'mlx.core.float32'))")
    assert _run(code).stdout.strip().isdigit()
    done = _run(code, OPENBLAS_CORETYPE="SkylakeX")
    assert "no batch-invariant attention grouping exists" in done.stderr
