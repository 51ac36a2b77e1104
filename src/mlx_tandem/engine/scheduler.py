"""Scheduler: FIFO admission by row count and KV-memory estimate.

A request reserves `kv_bytes(prompt + max_tokens)` when admitted and returns
it when it leaves. Requests that could never fit (alone over the budget or
the context window) are refused at submit; the others wait in FIFO order —
a large request at the head is not overtaken, so it cannot starve.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlx_tandem.engine.request import Request, Status


@dataclass
class MemoryModel:
    """Bytes a row holds: per token of context, plus a fixed part (recurrent state)."""

    per_token: int
    per_row: int = 0

    def row_bytes(self, tokens: int) -> int:
        return self.per_token * tokens + self.per_row


@dataclass
class Scheduler:
    max_rows: int
    budget: int
    memory: MemoryModel
    max_queue: int
    waiting: deque[Request] = field(default_factory=deque)
    joining: list[Request] = field(default_factory=list)
    reserved: int = 0
    _reservations: dict[str, int] = field(default_factory=dict)

    def need(self, request: Request) -> int:
        return self.memory.row_bytes(len(request.prompt) + request.params.max_tokens)

    def check(self, request: Request, queued: int = 0) -> None:
        """Refuse (ValueError) what can never run, or what the queue has no room for."""
        need = self.need(request)
        if need > self.budget:
            raise ValueError(
                f"request needs ~{need / 2**20:.1f} MiB of KV cache (prompt {len(request.prompt)} + "
                f"max_tokens {request.params.max_tokens}); the budget is {self.budget / 2**20:.1f} MiB"
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
            self._reservations[head.id] = need
            head.status = Status.PREFILLING
            self.joining.append(head)
            admitted.append(head)
        return admitted

    def release(self, request: Request) -> None:
        self.reserved -= self._reservations.pop(request.id, 0)

    def remove_waiting(self, request_id: str) -> Request | None:
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                return r
        return None


class QueueFull(ValueError):
    """Raised by submit when the waiting queue is at its limit (HTTP 429)."""
