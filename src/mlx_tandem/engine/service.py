"""Engine: the service shell around an EngineCore — the thread, the inbox, cancellation, handles.

Any thread may `submit` (validated on the caller's thread, before anything
changes) and `cancel`; both only put messages in the inbox and wake the engine
thread, which alone touches the core: drain the inbox, step, repeat; sleep
when idle (no polling: a message wakes it).

Every request ends with exactly one final event, whatever happens:
  * a step that raises fails every admitted request with an error event
    (`engine step failed: ...`), the core rebuilds empty rows, waiting
    requests go on; `healthy` is False only while that recovery runs;
  * if recovery itself fails the engine is closed for good: every request
    gets an error, `healthy` stays False, `submit` raises EngineClosed;
  * `shutdown()` refuses new submits, optionally lets admitted and queued
    work drain, then cancels what is left — inbox included — and the engine
    thread exits (joined) after destroying its MLX streams. An interpreter
    exit without `shutdown()` runs it first (atexit).

`Engine(..., warm=True)` (what `tandem serve` builds) first runs `warm_up` on the core:
one short request that leaves nothing behind, so the first user does not wait for MLX
to build its kernels.

Oracle: tests/test_service.py (fault injection: errors within a second, the
next request succeeds; shutdown under load ends every handle; threads exit;
async handles need no thread; the warm-up drafts and verifies, then leaves no
counts, cache entries or depth observations, and the next requests match a cold engine's).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import logging
import queue
import sys
import threading
import time
import weakref
from typing import Any

import mlx.core as mx

from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.constraint import GrammarCompiler
from mlx_tandem.engine.core import EngineCore, EngineStats
from mlx_tandem.engine.depth import DepthPolicy, FixedDepth
from mlx_tandem.engine.draft_source import DraftSource
from mlx_tandem.engine.request import EngineClosed, Request, RequestHandle, RequestOutput
from mlx_tandem.engine.sampling import SamplingParams
from mlx_tandem.engine.scheduler import Scheduler
from mlx_tandem.kv.prefix_cache import PrefixStats
from mlx_tandem.models.loader import LoadedModel

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        config: RuntimeConfig | None = None,
        drafter: DraftSource | None = None,
        depth: DepthPolicy | None = None,
        warm: bool = False,
    ) -> None:
        self.core = EngineCore(model, config, drafter, depth)
        self.warm_up_s = warm_up(self.core) if warm else 0.0  # before the thread owns the core
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _in_transit and _closed against submit races
        self._in_transit = 0  # submitted, not yet seen by the engine thread
        self._closed = False
        self._recovering = False
        self._failed: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()
        self._exit_hook = _weak_shutdown(self)
        atexit.register(self._exit_hook)

    # --- views for callers ----------------------------------------------------------------
    @property
    def config(self) -> RuntimeConfig:
        return self.core.config

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def running(self) -> list[Request]:
        return self.core.running

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def grammars(self) -> GrammarCompiler:
        return self.core.grammars

    @property
    def healthy(self) -> bool:
        """Whether a request submitted now will be served."""
        return self._thread.is_alive() and not (self._closed or self._recovering or self._failed)

    # --- any thread -----------------------------------------------------------------------
    def submit(
        self, prompt: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Validate and queue; ValueError / QueueFull / EngineClosed before anything changes."""
        with self._lock:
            if self._closed or self._failed:
                raise EngineClosed(self._failed or "the engine is shut down")
            request = self.core.new_request(prompt, params, request_id, self._in_transit)
            self._in_transit += 1
            self._inbox.put(("submit", request))
        self._wake.set()
        return RequestHandle(request, self.cancel)

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
        self._wake.set()

    def busy(self) -> bool:
        return self._in_transit > 0 or self.core.busy()

    def shutdown(self, drain: bool = False, timeout: float | None = None) -> None:
        """Refuse new requests; with drain, let accepted ones finish first; then stop the thread."""
        with self._lock:
            self._closed = True
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.busy() and self._thread.is_alive():
                if deadline is not None and time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        atexit.unregister(self._exit_hook)

    # --- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            try:
                worked = self.core.step()
            except Exception as err:  # a bug or a device error: nobody may hang on it
                worked = self._recover(err)
            if not worked and not self._stop.is_set():
                release_memory()
                self._wake.wait()
                self._wake.clear()
        self._drain_inbox()
        if self._failed is None:
            self.core.cancel_all()
        # MLX's per-thread streams must be destroyed by the thread that made them before it
        # exits; left to static destructors at process exit they abort it (exit code 134).
        mx.clear_streams()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                with self._lock:
                    self._in_transit -= 1
                if self._failed is not None:
                    item.finish("error", self._failed)
                else:
                    self.core.scheduler.add(item)
            else:
                self.core.cancel(item)

    def _recover(self, err: Exception) -> bool:
        log.exception("engine step failed; failing the requests in flight")
        self._recovering = True
        message = f"engine step failed: {type(err).__name__}: {err}"
        try:
            self.core.fail_in_flight(message)
        except Exception as again:
            log.exception("engine recovery failed; the engine is closed")
            self._failed = f"{message} (recovery failed: {type(again).__name__}: {again})"
            for request in [*self.core.running, *self.core.scheduler.joining]:
                request.finish("error", self._failed)
            for request in self.core.scheduler.waiting:
                request.finish("error", self._failed)
            self.core.scheduler.waiting.clear()
            self._stop.set()
            return False
        finally:
            self._recovering = False
        return True


# a prompt that prompt lookup can draft from (every drafter can), so the warm-up verifies too
WARM_UP_TEXT = "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3 4"


def warm_up(core: EngineCore) -> float:
    """Run one short greedy request through the paths a first request takes (a packed
    prefill, decode steps, a verify of two drafted tokens where the core has a drafter), so
    MLX builds their kernels and traces before anyone waits on them, then forget it: the
    speculation counters and prefix caches are as built, and the depth policy never saw it
    (a fixed depth drafts meanwhile). On a fresh machine MLX's CPU backend compiles each
    fused kernel with the system compiler the first time: `tandem serve`'s first 16-token
    request took 8.9 s there, 1.3 s after a 7.9 s warm-up (0.5 s once the kernels are on
    disk; docs/BENCHMARKS.md, session 32). Returns the seconds taken."""
    assert not core.busy(), "warm up an idle engine"
    start, depth = time.perf_counter(), core.depth
    core.depth = FixedDepth(2)
    try:
        prompt = core.model.encode_text(WARM_UP_TEXT)
        core.submit(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        core.run_until_idle()
    finally:
        core.depth = depth
        core.stats = EngineStats()
        for cache in (core.scheduler.prefix_cache, core.scheduler.short_cache):
            if cache is not None:
                cache.clear()
                cache.stats = PrefixStats()
    return time.perf_counter() - start


def release_memory() -> None:
    """Idle: return MLX's cached buffers, and the C heap's free pages, to the OS."""
    mx.clear_cache()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)  # glibc keeps freed large blocks mapped otherwise


def _libc() -> Any:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def _weak_shutdown(engine: Engine) -> Any:
    ref = weakref.ref(engine)

    def shutdown_at_exit() -> None:
        alive = ref()
        if alive is not None:
            alive.shutdown()

    return shutdown_at_exit


__all__ = ["Engine", "EngineClosed", "RequestHandle", "RequestOutput"]
