"""Build a draft source and depth policy from user settings (CLI flags, server options).

Oracle: tests/test_cli.py, tests/test_server.py (drafters built from flags).
"""

from __future__ import annotations

from mlx_tandem.drafters.draft_model import DraftModelSource, check_compatible
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.depth import AdaptiveDepth, DepthPolicy, FixedDepth
from mlx_tandem.engine.draft_source import DraftSource
from mlx_tandem.models.loader import LoadedModel, load

DEPTHS = ("fixed", "adaptive")


def build_drafter(
    spec: str, target: LoadedModel, config: RuntimeConfig, dtype: str = "auto"
) -> DraftSource:
    """'ngram' -> prompt lookup; anything else is a model (folder, .gguf, catalogue name)."""
    if spec == "ngram":
        return PromptLookupSource()
    draft = target if spec == target.name else load(spec, dtype=dtype, progress=False)
    check_compatible(target, draft)
    return DraftModelSource(
        draft, chunk=config.prefill_chunk or 512, batch_invariant=config.batch_invariant
    )


def build_depth(kind: str, num_draft_tokens: int) -> DepthPolicy:
    if kind not in DEPTHS:
        raise ValueError(f"unknown draft depth {kind!r} (choose from {', '.join(DEPTHS)})")
    if num_draft_tokens < 0:
        raise ValueError(f"--num-draft-tokens must be >= 0, got {num_draft_tokens}")
    return (
        AdaptiveDepth(max(1, num_draft_tokens))
        if kind == "adaptive"
        else FixedDepth(num_draft_tokens)
    )
