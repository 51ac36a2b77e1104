"""What the rows engine promises per model family: the one declaration of support.

Each `Family` names an mlx-lm `model_type`, the kinds of per-layer state its models
keep, and whether the rows engine runs it batched (batch-invariant: each row's
tokens equal the row alone) and speculatively (greedy speculation == plain
decoding) — or the reason it refuses, naming the family and the missing piece.
`check_engine` is the refusal (engine/core.EngineCore calls it before building
anything); `markdown_table` renders the docs' "Model families" table.

Families not declared here are not refused by name: the rows engine still checks
their structure (every attention layer must route, kv/state_rows.probe_routing;
recurrent layers that keep no per-token checkpoints refuse speculation,
engine/runner.recurrent_layers), but nothing is promised. Hybrid families speculate:
their recurrent layers verify a block token by token and rewind to per-token
checkpoints (kv/recurrent.py).

Oracle: tests/test_families.py (every declared family: batched == alone and greedy
speculation == plain, or the declared refusal; the docs table equals `markdown_table`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# state kinds
FULL = "full attention"
SLIDING = "sliding-window attention"
SINKS = "attention sinks"
SOFTCAP = "soft-capped attention"
CONV = "short convolution"
DELTA = "Gated DeltaNet"
MAMBA = "Mamba 2 SSM"

ATTENTION = (FULL, SLIDING, SINKS, SOFTCAP)  # rows' ends live in attention caches
RECURRENT = (CONV, DELTA, MAMBA)  # state that cannot be rewound by moving a row's end
# (the rows engine rewinds it to per-token checkpoints, kv/recurrent.py)


@dataclass(frozen=True)
class Family:
    """One mlx-lm model family: its state kinds and what the rows engine does with it."""

    name: str  # mlx-lm's model_type
    state: tuple[str, ...]
    batched: str | None = None  # None: supported; else the missing piece
    speculation: str | None = None  # None: supported; else the missing piece
    note: str = ""

    def __post_init__(self) -> None:
        if not self.state:
            raise ValueError(f"family {self.name!r} declares no state kinds")
        if self.batched is None and not any(k in ATTENTION for k in self.state):
            raise ValueError(
                f"family {self.name!r} has no attention state but claims the rows engine"
            )

    def batched_refusal(self) -> str | None:
        if self.batched is None:
            return None
        return f"the rows engine does not support {self.name}: {self.batched}"

    def speculation_refusal(self) -> str | None:
        if self.batched is not None:
            return (
                f"speculative decoding is not supported for {self.name}: it needs the rows "
                f"engine, which does not support it ({self.batched})"
            )
        if self.speculation is None:
            return None
        return f"speculative decoding is not supported for {self.name}: {self.speculation}"


def _cannot_rewind(layers: str) -> str:
    return (
        f"its recurrent layers ({layers}) cannot rewind rejected drafts per row "
        "(no per-token state checkpoints); run it without a drafter"
    )


_STEPWISE = "recurrent layers verify token by token and rewind to per-token checkpoints"

_NO_ATTENTION = (
    "it has no attention layer, and the rows engine tracks each row's length in its "
    "attention caches"
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", (FULL,)),
        Family("qwen2", (FULL,)),
        Family("qwen3", (FULL,)),
        Family("qwen3_moe", (FULL,), note="mixture of experts"),
        Family("gemma2", (FULL, SOFTCAP), note="mlx-lm's gemma2 has no sliding window"),
        Family("gemma3_text", (FULL, SLIDING)),
        Family(
            "gemma4_text",
            (FULL, SLIDING),
            note="KV-shared layers (E2B/E4B) are refused: mlx-lm gives them no cache",
        ),
        Family("ministral3", (FULL, SLIDING)),
        Family("mistral3", (FULL, SLIDING), note="text model of the multimodal wrapper"),
        Family("phi3", (FULL,)),
        Family("olmo2", (FULL,)),
        Family("granite", (FULL,)),
        Family("smollm3", (FULL,), note="no-RoPE layers"),
        Family("gpt_oss", (FULL, SLIDING, SINKS), note="mixture of experts"),
        Family("lfm2", (FULL, CONV), note=_STEPWISE),
        Family(
            "qwen3_next", (FULL, DELTA), note="mixture of experts; " + _STEPWISE
        ),
        Family("qwen3_5", (FULL, DELTA), note=_STEPWISE),
        Family("nemotron_h", (FULL, MAMBA), note=_STEPWISE),
        Family("falcon_h1", (FULL, MAMBA), note=_STEPWISE),
        Family("mamba2", (MAMBA,), batched=_NO_ATTENTION),
    )
}


def model_type(config: Mapping[str, Any]) -> str:
    """A loaded model's family key: its config's model_type ("" when absent)."""
    return str(config.get("model_type") or "")


def family(config: Mapping[str, Any]) -> Family | None:
    """The declared family of a model config, or None when undeclared."""
    return FAMILIES.get(model_type(config))


def check_engine(config: Mapping[str, Any], speculative: bool) -> None:
    """Raise ValueError naming the family and the missing piece when the rows engine
    (with a drafter when `speculative`) refuses this model; undeclared families pass."""
    declared = family(config)
    if declared is None:
        return
    reason = declared.speculation_refusal() if speculative else declared.batched_refusal()
    if reason is not None:
        raise ValueError(reason)


def recurrent_refusal(config: Mapping[str, Any]) -> str:
    """The refusal for speculation on an undeclared family found to keep recurrent state."""
    name = model_type(config) or "this model"
    return f"speculative decoding is not supported for {name}: " + _cannot_rewind("ArraysCache")


def _mark(reason: str | None) -> str:
    return "✓" if reason is None else f"✗ {reason}"


def markdown_table() -> str:
    """The docs' table: one row per declared family."""
    lines = [
        "| family (`model_type`) | state kinds | batched | speculation | notes |",
        "|---|---|---|---|---|",
    ]
    for f in FAMILIES.values():
        speculation = None if f.batched is None else "needs the rows engine"
        lines.append(
            f"| `{f.name}` | {', '.join(f.state)} | {_mark(f.batched)} | "
            f"{_mark(f.speculation or speculation)} | {f.note} |"
        )
    return "\n".join(lines)
