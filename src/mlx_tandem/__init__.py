"""mlx-tandem: lossless speculative decoding over a continuously batched cohort, on MLX.

Importing this package first preloads an optimized BLAS (see `_blas`) so that
MLX's CPU backend picks it up; then the public library API is re-exported.
"""

from mlx_tandem._blas import preload_blas

BLAS = preload_blas()

from mlx_tandem.engine.generate import GenerationResult, generate, stream_generate  # noqa: E402
from mlx_tandem.engine.sampling import SamplingParams  # noqa: E402
from mlx_tandem.models.loader import LoadedModel, load  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "BLAS",
    "GenerationResult",
    "LoadedModel",
    "SamplingParams",
    "generate",
    "load",
    "stream_generate",
]
