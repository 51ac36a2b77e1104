"""Connections: uvicorn's h11 protocol with a request-head deadline and a connection cap.

Owns what happens below HTTP requests, so that slow or idle clients cannot take the
server's file descriptors:
  * a connection must deliver a complete request head within `header_timeout_s` of
    connecting (or of its previous response); else it is closed — trickling bytes
    does not extend the deadline;
  * at most `max_connections` are open; at the cap, the connection that has waited
    longest for its request head is closed to make room (so a flood of half-open
    connections cannot lock out real clients), and when every open connection is busy
    with a request the new one is closed at once;
  * idle keep-alive connections close after `keep_alive_s` (uvicorn's own timer).
The body's deadline is the Guard's (server/guard.py), which can still answer 408.
Closing happens on the event loop's next turn, and the loop accepts up to `backlog`
connections per turn, so open sockets stay under max_connections + backlog; the
listen backlog is therefore a quarter of the cap (at least 64, at most 2048).

Oracle: tests/test_server_hostile.py (2,100 slow half-open connections: open
connections stay under the cap, /health answers within 1 s throughout).
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from mlx_tandem.server.state import ServerOptions

FD_RESERVE = 128  # descriptors kept for the model files, logs, the engine, ...


def connection_cap(requested: int) -> int:
    """`requested`, lowered so that connections cannot exhaust the process's descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    room = soft - FD_RESERVE  # connections + one accept burst (backlog) must fit in it
    return max(16, min(requested, room - backlog(room)))


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol subclass for one server (its registry of waiting connections)."""
    waiting: dict[GuardedH11, None] = {}  # connections awaiting a request head, oldest first

    class GuardedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _cycle_seen: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                oldest = next(iter(waiting), None)
                if oldest is None:  # every connection is serving a request: refuse this one
                    self.transport.close()
                    return
                oldest._close_waiting()
            self._await_head()

        def _await_head(self) -> None:
            self._cycle_seen = self.cycle
            waiting[self] = None
            self._head_timer = self.loop.call_later(header_timeout_s, self._close_waiting)

        def _head_arrived(self) -> None:
            waiting.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _close_waiting(self) -> None:
            self._head_arrived()
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not self._cycle_seen:  # a new request's head was parsed
                self._head_arrived()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._head_timer is None:
                self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_arrived()
            super().connection_lost(exc)

    return GuardedH11


def uvicorn_config(app: Any, options: ServerOptions, host: str, port: int, **kw: Any) -> Any:
    """uvicorn.Config for the app with the transport limits of `options`."""
    import uvicorn

    cap = connection_cap(options.max_connections)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(cap, options.header_timeout_s),
        timeout_keep_alive=max(1, round(options.keep_alive_s)),
        backlog=backlog(cap),
        **kw,
    )


def backlog(cap: int) -> int:
    return max(64, min(2048, cap // 4))
