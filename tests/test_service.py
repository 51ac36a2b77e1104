"""The service shell: no request ever hangs, a failing step fails only what was in flight."""

import asyncio
import subprocess
import sys
import threading
import time

import pytest
from test_engine import make_params, make_prompts, run_alone

from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.request import EngineClosed
from mlx_tandem.engine.service import Engine

CFG = RuntimeConfig.resolve(environ={})


@pytest.fixture
def engine(tiny_model):
    made = []

    def make(arch="llama", **kwargs):
        made.append(Engine(tiny_model(arch), CFG, **kwargs))
        return made[-1]

    yield make
    for e in made:
        e.shutdown()


def test_threaded_engine_and_async_iteration_without_threads(tiny_model, engine):
    m = tiny_model("qwen3")
    prompts, params = make_prompts(6, seed=9), make_params(6, seed=9)
    ref = [run_alone(m, p, sp, CFG) for p, sp in zip(prompts, params, strict=True)]
    live = engine("qwen3")
    threads = threading.active_count()
    seen_threads = []

    async def collect(handle):
        tokens = []
        async for out in handle:
            tokens += out.tokens
            seen_threads.append(threading.active_count())
        return tokens

    async def main():
        handles = [live.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return await asyncio.gather(*(collect(h) for h in handles))

    assert asyncio.run(main()) == ref
    assert max(seen_threads) == threads  # awaiting six handles started no thread


def test_a_failing_step_fails_requests_in_flight_and_the_next_request_succeeds(engine):
    live = engine()
    original = live.core.runner.forward
    armed = threading.Event()

    def failing(rows, ids, lengths=None, **kw):
        if armed.is_set() and rows.row_count > 0 and ids.shape[0] == rows.row_count:
            armed.clear()
            raise RuntimeError("injected device failure")
        return original(rows, ids, lengths, **kw)

    live.core.runner.forward = failing
    first = [live.submit([3, 4, 5, i], SamplingParams(max_tokens=50)) for i in range(3)]
    next(iter(first[0]))  # the rows are decoding
    start = time.monotonic()
    armed.set()
    results = [h.result(timeout=5) for h in first]
    assert time.monotonic() - start < 1.0
    assert all(r.finish_reason == "error" and "injected device failure" in r.error for r in results)
    assert live.healthy
    after = live.submit([3, 4, 5], SamplingParams(max_tokens=6)).result(timeout=10)
    assert after.finish_reason == "length" and after.tokens == run_alone(
        live.core.model, [3, 4, 5], SamplingParams(max_tokens=6), CFG
    )
    assert live.core.scheduler.reserved == 0


def test_waiting_requests_survive_a_failed_step(tiny_model):
    core = EngineCore(tiny_model("llama"), RuntimeConfig.resolve(environ={}, max_rows=1))
    running = core.submit([3, 4, 5], SamplingParams(max_tokens=20))
    waiting = core.submit([6, 7], SamplingParams(max_tokens=4))
    core.step()
    core.fail_in_flight("engine step failed: boom")
    core.run_until_idle()
    assert running.result(timeout=1).finish_reason == "error"
    assert len(waiting.result(timeout=1).tokens) == 4


def test_failed_recovery_closes_the_engine_and_fails_everything(engine):
    live = engine()

    def broken(*_a, **_k):
        raise RuntimeError("still broken")

    live.core._forward_and_verify = broken  # the step itself fails (prefill catches its own)
    live.core.fail_in_flight = broken
    handle = live.submit([3, 4, 5], SamplingParams(max_tokens=5))
    res = handle.result(timeout=5)
    assert res.finish_reason == "error" and "still broken" in res.error
    deadline = time.monotonic() + 2
    while live.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not live.healthy
    with pytest.raises(EngineClosed):
        live.submit([3, 4], SamplingParams(max_tokens=2))


def test_shutdown_under_load_ends_every_handle_and_the_thread_exits(engine):
    live = engine()
    handles = [live.submit([3, 4, i + 5], SamplingParams(max_tokens=200)) for i in range(20)]
    next(iter(handles[0]))
    live.shutdown()
    results = [h.result(timeout=5) for h in handles]  # none hangs
    assert {r.finish_reason for r in results} <= {"cancelled", "length", "stop"}
    assert not live._thread.is_alive()
    assert not live.healthy
    with pytest.raises(EngineClosed):
        live.submit([3], SamplingParams(max_tokens=1))


def test_shutdown_drains_the_inbox(engine):
    live = engine()
    live.core.scheduler.max_rows = 0  # nothing is ever admitted: requests stay queued
    handle = live.submit([3, 4, 5], SamplingParams(max_tokens=5))
    live.shutdown()
    assert handle.result(timeout=2).finish_reason == "cancelled"


def test_drain_lets_accepted_requests_finish(engine):
    live = engine()
    handles = [live.submit([3, 4, i + 5], SamplingParams(max_tokens=8)) for i in range(4)]
    live.shutdown(drain=True, timeout=30)
    assert all(len(h.result(timeout=1).tokens) == 8 for h in handles)


def test_result_timeout_raises_instead_of_hanging(tiny_model):
    core = EngineCore(tiny_model("llama"), CFG)
    handle = core.submit([3, 4], SamplingParams(max_tokens=3))  # nobody steps the core
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.05)
    core.step()  # the first token's event is read, then the wait times out
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.05)
    core.run_until_idle()
    reference = core.submit([3, 4], SamplingParams(max_tokens=3))
    core.run_until_idle()
    assert handle.result().tokens == reference.result().tokens  # nothing read was lost
    assert len(handle.result().tokens) == 3


def test_requests_sharing_an_id_release_their_own_reservations(tiny_model):
    """Request ids are the caller's and may repeat: each row's KV reservation is its own."""
    core = EngineCore(tiny_model("llama"), CFG)
    handles = [core.submit([3, 4, i], SamplingParams(max_tokens=4, ignore_eos=True), request_id="same")
               for i in range(3)]
    core.run_until_idle()
    assert [len(h.result().tokens) for h in handles] == [4, 4, 4]
    assert core.scheduler.reserved == 0


def test_warm_up_drafts_and_verifies_then_leaves_nothing_behind(tiny_model):
    """The start-up request runs a prefill, decode steps and a verify of drafted tokens, then
    the engine is as built: no speculation counts, empty prefix caches, a depth policy that
    never observed it, and what it serves next is what a cold engine serves. Negative
    control (run by hand): without the reset, `stats.drafted` keeps the warm-up's drafts."""
    from mlx_tandem.drafters.factory import build_depth, build_drafter
    from mlx_tandem.engine.service import warm_up
    from mlx_tandem.kv.prefix_cache import PrefixStats

    m = tiny_model("llama")
    config = CFG.with_(prefix_cache_bytes=1 << 24)
    drafter, depth = build_drafter("ngram", m, config), build_depth("adaptive", 3)
    observed, proposed = [], []
    depth.observe = lambda *a: observed.append(a)
    core = EngineCore(m, config, drafter, depth)
    draft = drafter.draft

    def spy(requests, depths, rows):
        drafts = draft(requests, depths, rows)
        proposed.append(sum(len(d) for d in drafts.tokens))
        return drafts

    drafter.draft = spy
    assert warm_up(core) > 0
    assert len(proposed) >= 2 and sum(proposed) > 0  # decode steps, drafted tokens verified
    assert core.depth is depth and not observed
    assert core.stats.drafted == {} and core.stats.steps == 0
    caches = [core.scheduler.prefix_cache, core.scheduler.short_cache]
    assert all(c is not None and c.blocks == 0 and c.stats == PrefixStats() for c in caches)
    assert not core.busy() and core.rows.row_count == 0
    prompts, params = make_prompts(4, seed=3), make_params(4, seed=3)
    handles = [core.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    core.run_until_idle()
    ref = [run_alone(m, p, sp, config) for p, sp in zip(prompts, params, strict=True)]
    assert [h.result().tokens for h in handles] == ref


EXIT_SCRIPT = """
import sys
from pathlib import Path
from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.service import Engine
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model
make_tiny_model("gemma3_text", Path(sys.argv[1]))
engine = Engine(load_folder(Path(sys.argv[1]), name="tiny"), RuntimeConfig.resolve(environ={}))
print(len(engine.submit([3, 4, 5], SamplingParams(max_tokens=4)).result().tokens))
if sys.argv[2] == "shutdown":
    engine.shutdown()  # the engine thread exits here; else atexit runs the same
"""


@pytest.mark.parametrize("how", ["shutdown", "shutdown", "shutdown", "atexit"])
def test_process_exits_cleanly_after_the_engine_thread_exits(tmp_path, how):
    """The engine thread ran MLX and exits; the process must not abort afterwards (it did,
    3 runs in 4, before the thread destroyed its own MLX streams)."""
    run = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "m"), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "4"
