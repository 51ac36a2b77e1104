"""PrefillPolicy: how many prompt tokens one prefill chunk may hold.

Resolved once per engine from the model config and the runtime config, never
from the current batch: a row's prefill arithmetic must not depend on what
else is running. The chunk bounds the activation memory of one chunk
(attention scores grow with chunk x context) and how long running rows wait
for a joining row: decode steps interleave with chunks.

Oracle: tests/test_engine.py (chunked prefill on/off gives the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_tandem.engine.config import RuntimeConfig

MIN_CHUNK, MAX_CHUNK, ALIGN = 64, 2048, 64


@dataclass(frozen=True)
class PrefillPolicy:
    chunk: int

    @classmethod
    def resolve(
        cls, model_config: dict[str, Any], runtime: RuntimeConfig, memory_budget: int
    ) -> PrefillPolicy:
        if runtime.prefill_chunk is not None:
            return cls(runtime.prefill_chunk)
        heads = int(model_config.get("num_attention_heads", 8))
        hidden = int(model_config.get("hidden_size", 1024))
        inter = int(model_config.get("intermediate_size", 4 * hidden))
        context = int(model_config.get("max_position_embeddings", 8192))
        # float32 bytes per chunk token: MLP activations + one layer's scores over a full context
        per_token = 4 * (3 * inter + 4 * hidden + heads * min(context, 8192))
        # give one chunk at most 1/8 of the budget, then align for stable kernel shapes
        chunk = memory_budget // 8 // per_token
        chunk = max(MIN_CHUNK, min(MAX_CHUNK, chunk // ALIGN * ALIGN))
        return cls(chunk)
