"""Scheduler: FIFO admission by row count and KV-memory estimate.

A request reserves `kv_bytes(prompt + max_tokens)` when admitted and returns
it when it leaves. Requests that could never fit (alone over the budget or
the context window) are refused at submit; the others wait in FIFO order —
a large request at the head is not overtaken, so it cannot starve.
`measure_memory` finds the bytes per token with one real forward (a sliding
layer's ring stops growing at its size);
`default_budget` is half the device's memory minus the weights. The scheduler also
holds the engine's prefix caches (kv/prefix_cache.py, None when off: long prompts' whole
chunks, short prompts' whole pack units): what the KV
budget leaves, `prefix_cache_budget` sizes it from. `size_buffer_cache` sets how much
freed memory MLX keeps for reuse.

Oracle: tests/test_engine.py (budget limits concurrent rows; what cannot fit is
refused at submit; every reservation is returned), tests/test_config.py (the buffer
cache limit an engine sets).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_tandem.engine.config import format_bytes
from mlx_tandem.engine.request import Request
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.kv.prefix_cache import PrefixCache
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.models.loader import LoadedModel


@dataclass
class MemoryModel:
    """Bytes a row holds: per token of context, plus a fixed part (recurrent state), plus
    sliding layers' rings: (columns kept, bytes per column) — they stop growing there."""

    per_token: int
    per_row: int = 0
    rings: tuple[tuple[int, int], ...] = ()

    def row_bytes(self, tokens: int) -> int:
        capped = sum(min(tokens, ring) * per_column for ring, per_column in self.rings)
        return self.per_token * tokens + self.per_row + capped


@dataclass
class Scheduler:
    max_rows: int
    budget: int
    memory: MemoryModel
    max_queue: int
    waiting: deque[Request] = field(default_factory=deque)
    joining: list[Request] = field(default_factory=list)
    reserved: int = 0
    prefix_cache: PrefixCache | None = None
    short_cache: PrefixCache | None = None  # short prompts' whole pack units (engine/prefill.py)

    def need(self, request: Request) -> int:
        return self.memory.row_bytes(len(request.prompt) + request.params.max_tokens)

    def check(self, request: Request, queued: int = 0) -> None:
        """Refuse (ValueError) what can never run, or what the queue has no room for."""
        need = self.need(request)
        if need > self.budget:
            raise ValueError(
                f"request needs ~{format_bytes(need)} of KV cache (prompt {len(request.prompt)} + "
                f"max_tokens {request.params.max_tokens}); the budget is {format_bytes(self.budget)}"
            )
        if len(self.waiting) + queued >= self.max_queue:
            raise QueueFull(f"queue full ({self.max_queue} waiting requests)")

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self, running: int) -> list[Request]:
        """Move waiting requests to joining while rows and memory allow (FIFO, no overtaking)."""
        admitted = []
        while self.waiting and running + len(self.joining) < self.max_rows:
            head = self.waiting[0]
            need = self.need(head)
            if self.reserved + need > self.budget:
                break
            self.waiting.popleft()
            self.reserved += need
            head.reserved = need  # on the request: ids are the caller's and may repeat
            self.joining.append(head)
            admitted.append(head)
        return admitted

    def release(self, request: Request) -> None:
        self.reserved -= request.reserved
        request.reserved = 0

    def remove(self, request_id: str) -> Request | None:
        """Take a waiting or joining request out (cancel); None if it is not here."""
        for queue in (self.waiting, self.joining):
            for r in queue:
                if r.id == request_id:
                    queue.remove(r)
                    return r
        return None


class QueueFull(ValueError):
    """Raised by submit when the waiting queue is at its limit (HTTP 429)."""


def measure_memory(runner: ModelRunner) -> MemoryModel:
    """KV bytes per token and fixed bytes per row, from one real one-token forward."""
    row = runner.blank_rows(1)
    runner.graph.forward_hidden(mx.array([[0]], dtype=mx.int32), row.layers)
    per_token = per_row = 0
    rings: list[tuple[int, int]] = []
    for leaf in row.leaves():
        if isinstance(leaf, RowKVCache):
            per_column = sum(a.nbytes for a in leaf.state) // leaf.capacity
            if leaf.ring is None:
                per_token += per_column
            else:
                rings.append((leaf.ring, per_column))
        else:
            per_row += sum(a.nbytes for a in leaf.cache if a is not None)
    return MemoryModel(per_token=per_token, per_row=per_row, rings=tuple(rings))


def _device_memory() -> int:
    try:
        return int(mx.device_info()["memory_size"])
    except (AttributeError, KeyError, RuntimeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _weights(model: LoadedModel) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.model.parameters()))


def default_budget(model: LoadedModel) -> int:
    """Half of the device's memory, minus the weights, at least 256 MiB."""
    return max(256 << 20, _device_memory() // 2 - _weights(model))


BUFFER_CACHE_MOST = 1 << 30  # the auto limit on the CPU backend: at most this, a 16th of memory


def size_buffer_cache(requested: int | None) -> int | None:
    """Set MLX's buffer cache limit (freed arrays kept for reuse) and return it (None: left
    as it was): `requested` when given; else, on the CPU backend, min(BUFFER_CACHE_MOST, a
    16th of memory) unless the limit is higher already. MLX's CPU default keeps 32 MiB: a
    step's temporaries (several of rows x vocabulary floats each) outgrow it, and each array
    past it is new memory from malloc, first touched page by page — 270 page faults a token
    in a 16-row greedy SmolLM2 run here, 650 sampled, against ~30 above 256 MiB
    (docs/BENCHMARKS.md). GPU backends keep freed buffers up to their memory limit already.
    The limit is the process's: MLX has one allocator."""
    if requested is not None:
        mx.set_cache_limit(requested)
        return requested
    if mx.default_device() != mx.cpu:
        return None
    limit = min(BUFFER_CACHE_MOST, _device_memory() // 16)
    previous = mx.set_cache_limit(limit)
    if previous > limit:
        mx.set_cache_limit(previous)
    return max(limit, previous)


def prefix_cache_budget(model: LoadedModel, kv_budget: int) -> int:
    """A quarter of what the weights and the KV budget leave of the device's memory
    (0 when nothing is left), at most 8 GiB."""
    left = _device_memory() - _weights(model) - kv_budget
    return max(0, min(8 << 30, left // 4))
