"""PrefillPolicy: where prompts are cut into chunks, and how many prompt tokens one step runs.

Two separate decisions, because only one of them may touch arithmetic:
  * `cuts` — a row's chunk boundaries (kv/prefix_cache.Cuts: `chunk` tokens from
    its start, fewer as the row grows). They decide the row's prefill arithmetic,
    so they come from the model config, the device kind and the runtime config
    only, never from the batch or from measured speed: the same request gets the
    same chunks alone, batched, and in every run. The size is what one step can
    afford: the model's forward FLOPs per token against a per-device FLOP
    allowance (about 0.6 s of work on a 2-core CPU, leaving the running rows' decode
    step room in a one-second stall), within the memory bound
    below. Deeper in a prompt each token also attends to every one before it, so
    the chunk at depth s shrinks by taper / (taper + s), where `taper` is the depth
    at which a token's attention costs as much as its projections (`attention_cost`:
    per key, its score and value FLOPs and the softmax's exponentials, which run
    scalar on a CPU). A fixed `prefill_chunk` in the runtime config keeps every
    chunk that size.
  * `stall_s` — how long one step may prefill while running rows wait: the
    engine runs one unit (a chunk) and more only while the last unit's
    measured time still fits beside the running rows' own step (engine/core.py),
    so running rows wait about `stall_s` per step whatever the machine. Scheduling
    only: it never moves a boundary.
The chunk also bounds the activation memory of one chunk (attention scores grow
with chunk x context).

The prefix cache's two hooks live here too (`start_from_cache`, `keep_in_cache`): a
long prompt's row looks its whole chunks up before its first chunk and, after each
chunk it computes, offers that chunk as a block (kv/prefix_cache.py). Blocks are
whole chunks, so a warm row's remaining chunks have a cold row's boundaries. Prompts
of at most one chunk (prefilled together, packed: other arithmetic) have their own
cache of whole pack units (`start_short`, `keep_short`), so a warm row's new tokens
sit where a cold row's do in the packed calls. Both caches also keep each prompt's tail
(its tokens after the last whole block), served only to the same prompt again: a
repeated prompt joins with nothing to prefill.

Oracle: tests/test_engine.py (chunked prefill on/off gives the same tokens; a
short prompt behind a long one is served before the long one's prefill ends);
tests/test_prefix_cache.py (warm == cold, long and short prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.request import Request
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.kv.prefix_cache import Block, Cuts, PrefixCache
from mlx_tandem.kv.state_rows import StateRows, copied

MIN_CHUNK, MAX_CHUNK, ALIGN = 64, 2048, 16
# forward FLOPs one chunk may take, per device kind: on a 2-core CPU about 0.6 s, so that a
# step running a chunk and the running rows' decode stays within the one-second stall
CHUNK_FLOPS = {"cpu": 18e9, "gpu": 2e12}
# one softmax exponential in FLOPs of the same device's matmuls (CPU: a scalar exp ~25 ns
# against ~35 GFLOP/s of sgemm, measured on this 2-core VM; GPU: vectorised)
EXP_FLOPS = {"cpu": 800.0, "gpu": 8.0}


def flops_per_token(model_config: dict[str, Any]) -> float:
    """Forward FLOPs of one token through the layers (projections; attention excluded)."""
    hidden = int(model_config.get("hidden_size", 1024))
    heads = int(model_config.get("num_attention_heads", 8))
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    kv = int(model_config.get("num_key_value_heads") or heads) * head_dim
    inter = int(model_config.get("intermediate_size", 4 * hidden))
    layers = int(model_config.get("num_hidden_layers", 1))
    per_layer = hidden * (heads * head_dim * 2 + 2 * kv) + 3 * hidden * inter
    return 2.0 * per_layer * layers


def attention_cost(model_config: dict[str, Any], device: str) -> float:
    """FLOPs one token spends per earlier key it attends to, over every layer: the score and
    value products and the softmax's exponentials."""
    heads = int(model_config.get("num_attention_heads", 8))
    hidden = int(model_config.get("hidden_size", 1024))
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    layers = int(model_config.get("num_hidden_layers", 1))
    return layers * heads * (4.0 * head_dim + EXP_FLOPS[device])


def device_kind() -> str:
    """"cpu" or "gpu": the CHUNK_FLOPS row for the default device."""
    return "cpu" if mx.default_device() == mx.cpu else "gpu"


@dataclass(frozen=True)
class PrefillPolicy:
    chunk: int
    stall_s: float = 1.0
    taper: int = 0  # depth at which a chunk is half `chunk` (0: every chunk `chunk`)

    @property
    def cuts(self) -> Cuts:
        return Cuts(self.chunk, self.taper)

    @classmethod
    def resolve(
        cls,
        model_config: dict[str, Any],
        runtime: RuntimeConfig,
        memory_budget: int,
        device: str = "cpu",
    ) -> PrefillPolicy:
        stall = runtime.prefill_stall_ms / 1000
        if runtime.prefill_chunk is not None:
            return cls(runtime.prefill_chunk, stall, runtime.prefill_taper or 0)
        heads = int(model_config.get("num_attention_heads", 8))
        hidden = int(model_config.get("hidden_size", 1024))
        inter = int(model_config.get("intermediate_size", 4 * hidden))
        context = int(model_config.get("max_position_embeddings", 8192))
        # float32 bytes per chunk token: MLP activations + one layer's scores over a full context
        per_token = 4 * (3 * inter + 4 * hidden + heads * min(context, 8192))
        # one chunk: at most 1/8 of the memory budget and the device's FLOP allowance
        affordable = int(CHUNK_FLOPS[device] / flops_per_token(model_config))
        chunk = min(memory_budget // 8 // per_token, affordable)
        chunk = max(MIN_CHUNK, min(MAX_CHUNK, chunk // ALIGN * ALIGN))
        taper = runtime.prefill_taper
        if taper is None:
            taper = max(1, int(flops_per_token(model_config) / attention_cost(model_config, device)))
        return cls(chunk, stall, taper)


def start_from_cache(cache: PrefixCache | None, request: Request) -> mx.array | None:
    """Before a long prompt's first chunk: load its cached whole chunks into its blank
    joining row (`request.joining`) and mark them prefilled. Returns the final hidden at
    the last cached token, or None on a miss. Never the pending last prompt token."""
    if cache is None or request.joining is None or request.prefilled:
        return None
    blocks = cache.lookup(request.prompt[: len(request.prompt) - 1])
    if not blocks:
        return None
    request.joining.load_spans([b.span for b in blocks])
    request.prefilled = blocks[-1].span.end
    return blocks[-1].hidden


def keep_in_cache(cache: PrefixCache | None, request: Request, last: mx.array) -> None:
    """After a chunk of a long prompt: offer it as a block if it was a whole one, or the
    prompt's tail if it was the last (`last`: the final hidden (1, D) at its last token)."""
    rows, end = request.joining, request.prefilled
    if cache is None or rows is None or rows.ends != [end]:
        return
    if end not in cache.cuts.ends(end) and end != len(request.prompt) - 1:
        return

    def block() -> Block:
        hidden = copied(last)
        mx.eval(hidden)
        return Block(rows.copy_span(cache.cuts.start_of(end)), hidden)

    cache.insert(request.prompt[:end], block)


@dataclass
class ShortStart:
    """Rows for short prompts prefilled together (engine/core._prefill_together): each row
    starts from its prompt's longest cached whole-unit prefix. `starts[i]`: tokens row i
    holds already; `hidden[i]`: the cached final hidden at its last one (None: nothing)."""

    rows: StateRows
    starts: list[int]
    hidden: list[mx.array | None]


def start_short(cache: PrefixCache | None, runner: ModelRunner, requests: list[Request]) -> ShortStart:
    """Look each short prompt up in the short-prompt cache (blocks of the runner's pack
    unit). A warm row's first new token lands at a unit-aligned offset of its packed calls,
    as its cold row's does, and the rows attention gives a query the same result whatever
    the call, so warm == cold bit for bit."""
    found = [cache.lookup(r.prompt[: len(r.prompt) - 1]) if cache else [] for r in requests]
    if not any(found):
        return ShortStart(runner.blank_rows(len(requests)), [0] * len(requests),
                          [None] * len(requests))
    ones = []
    for blocks in found:
        one = runner.blank_rows(1)
        if blocks:
            one.load_spans([b.span for b in blocks])
        ones.append(one)
    rows = runner.empty_rows()
    rows.prepare_append(ones).commit()
    return ShortStart(rows, [b[-1].span.end if b else 0 for b in found],
                      [b[-1].hidden if b else None for b in found])


def keep_short(
    cache: PrefixCache | None, start: ShortStart, requests: list[Request], hidden: mx.array
) -> None:
    """After a group's forward: offer each row's new whole units, then its prompt's tail,
    as blocks (`hidden`: the forward's (B, L, D), row i's column j at position
    starts[i] + j)."""
    if cache is None:
        return
    for i, (request, first) in enumerate(zip(requests, start.starts, strict=True)):
        one = start.rows.take([i])  # lazy: gathered only if some block is new
        n = len(request.prompt) - 1
        ends = [e for e in cache.cuts.ends(n) if e > first]
        if n > first and n not in ends:
            ends.append(n)
        for end in ends:

            def block(end: int = end, first: int = first, i: int = i, one: StateRows = one) -> Block:
                last = copied(hidden[i, end - 1 - first][None])
                mx.eval(last)
                return Block(one.copy_span(cache.cuts.start_of(end), end), last)

            if not cache.insert(request.prompt[:end], block):
                break
