"""Build a draft source and depth policy from user settings (CLI flags, server options).

Oracle: tests/test_cli.py, tests/test_server.py (drafters built from flags).
"""

from __future__ import annotations

from pathlib import Path

from mlx_tandem.drafters.assistant import MODES, AssistantSource
from mlx_tandem.drafters.draft_model import DraftModelSource, check_compatible
from mlx_tandem.drafters.lookup_first import LookupFirstSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.depth import AdaptiveDepth, DepthPolicy, FixedDepth
from mlx_tandem.engine.draft_source import DraftSource
from mlx_tandem.engine.prefill import PrefillPolicy, device_kind
from mlx_tandem.engine.sampling import MAX_DRAFT
from mlx_tandem.engine.scheduler import default_budget
from mlx_tandem.models.assistant_folder import is_assistant_folder, load_assistant
from mlx_tandem.models.catalogue import tandem_home
from mlx_tandem.models.loader import LoadedModel, load

SHIPPED = Path(__file__).resolve().parents[1] / "assistants"

DEPTHS = ("fixed", "adaptive")
LOOKUP_FIRST = "+ngram"


def build_drafter(
    spec: str, target: LoadedModel, config: RuntimeConfig, dtype: str = "auto"
) -> DraftSource:
    """'ngram' -> prompt lookup; 'mtp' -> the target checkpoint's MTP layer;
    'assistant[:MODE]' -> the target's assistant (shipped or trained here); an assistant
    folder[:MODE]; anything else is a draft model (folder, .gguf, catalogue name).
    'SPEC+ngram': prompt lookup where a row's text recurs, SPEC's drafter elsewhere."""
    if spec == "ngram":
        return PromptLookupSource()
    if spec.endswith(LOOKUP_FIRST):
        inner = spec[: -len(LOOKUP_FIRST)]
        if inner in ("", "ngram"):
            raise ValueError(f"{spec!r}: name a model drafter before '+ngram' (assistant+ngram)")
        return LookupFirstSource(build_drafter(inner, target, config, dtype))
    if spec == "mtp":  # the target checkpoint's own multi-token-prediction layer
        from mlx_tandem.drafters.mtp import MTPSource

        return MTPSource(target)
    base, _, mode = spec.partition(":")
    if base == "assistant" or is_assistant_folder(Path(base).expanduser()):
        folder = find_assistant(target) if base == "assistant" else Path(base).expanduser()
        return AssistantSource(load_assistant(folder), target, mode or DEFAULT_ASSISTANT_MODE)
    draft = target if spec == target.name else load(spec, dtype=dtype, progress=False)
    check_compatible(target, draft)
    # its prompt chunks: sized for the draft model as the engine's are for the target, so
    # one draft chunk costs about what one target chunk does (both run in a prefill unit)
    policy = PrefillPolicy.resolve(draft.config, config, default_budget(draft), device_kind())
    return DraftModelSource(draft, chunk=policy.chunk, batch_invariant=config.batch_invariant)


def build_depth(kind: str, num_draft_tokens: int) -> DepthPolicy:
    if kind not in DEPTHS:
        raise ValueError(f"unknown draft depth {kind!r} (choose from {', '.join(DEPTHS)})")
    if not 0 <= num_draft_tokens <= MAX_DRAFT:
        raise ValueError(f"--num-draft-tokens must be in [0, {MAX_DRAFT}], got {num_draft_tokens}")
    return (
        AdaptiveDepth(max(1, num_draft_tokens))
        if kind == "adaptive"
        else FixedDepth(num_draft_tokens)
    )


DEFAULT_ASSISTANT_MODE = "greedy"


def assistant_folders(target_name: str) -> list[Path]:
    """Where `--draft-model assistant` looks, in order: trained here, then shipped."""
    return [tandem_home() / "assistants" / target_name, SHIPPED / target_name]


def find_assistant(target: LoadedModel) -> Path:
    for folder in assistant_folders(target.name):
        if is_assistant_folder(folder):
            return folder
    raise ValueError(
        f"no assistant drafter for {target.name!r} (looked in "
        f"{', '.join(str(f) for f in assistant_folders(target.name))}); train one with "
        f"`tandem distill --target {target.name}` (modes: {', '.join(MODES)})"
    )
