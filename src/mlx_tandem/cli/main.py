"""`tandem` entry point: one subcommand per module, one error boundary for all of them.

Every user error (unknown model, bad flag value, missing/corrupt GGUF, prompt
too long) reaches the user as one line `tandem: error: ...` and exit code 2;
tracebacks are reserved for bugs. SIGTERM ends a command as Ctrl-C does (exit 143):
cleanup runs, so a GGUF conversion in progress leaves nothing behind (`tandem serve`
drains on it once serving).  Oracle: tests/test_cli.py.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

import mlx_tandem  # noqa: F401  (BLAS preload before any mlx import)
from mlx_tandem._blas import check_blas_setting


def build_parser() -> argparse.ArgumentParser:
    from mlx_tandem.cli import bench, chat, distill, doctor, generate, models, serve

    parser = argparse.ArgumentParser(
        prog="tandem", description="mlx-tandem: batched, lossless speculative LLM inference on MLX"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (generate, chat, serve, bench, distill, models, doctor):
        module.register(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised where the command is (a BaseException, like KeyboardInterrupt, so no
    `except Exception` swallows it and every `finally` runs)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for provenance
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        check_blas_setting()
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("tandem: terminated", file=sys.stderr)
        return 143
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
