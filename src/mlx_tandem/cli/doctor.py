"""`tandem doctor`: device, BLAS in use, a one-second matmul figure, versions.

Oracle: tests/test_cli.py (test_doctor_and_models).
"""

from __future__ import annotations

import argparse
import platform
import time
from importlib.metadata import version

from mlx_tandem.models import catalogue


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="report device, BLAS and matmul speed")
    p.add_argument("--size", type=int, default=1024, help="square matmul size (float32)")
    p.set_defaults(run=run)


def matmul_gflops(size: int, seconds: float = 1.0) -> float:
    import mlx.core as mx

    a = mx.random.normal((size, size))
    b = mx.random.normal((size, size))
    mx.eval(a, b, a @ b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        mx.eval(a @ b)
        count += 1
    return count * 2 * size**3 / (time.perf_counter() - start) / 1e9


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from mlx_tandem import BLAS

    if args.size < 1:
        raise ValueError("--size must be >= 1")
    print(
        f"platform:  {platform.system()} {platform.machine()}, Python {platform.python_version()}"
    )
    print(
        f"versions:  mlx {version('mlx')}, mlx-lm {version('mlx-lm')}, "
        f"mlx-tandem {version('mlx-tandem')}"
    )
    print(f"device:    {mx.default_device()} (metal available: {mx.metal.is_available()})")
    print(f"blas:      {BLAS.name} ({BLAS.path or '-'}; {BLAS.reason})")
    print(f"matmul:    {matmul_gflops(args.size):.1f} GFLOP/s float32 {args.size}x{args.size}")
    print(f"home:      {catalogue.tandem_home()}")
    return 0
