"""The batched rows engine: every row's tokens in any cohort equal that request run alone."""

import random
import time

import mlx.core as mx
import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.engine.scheduler import QueueFull

from conftest import TINY_ARCHS, run_with_gaps

ENGINE_ARCHS = (*TINY_ARCHS, "lfm2")


def make_prompts(n, seed=0):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 5, 17, 40, 90, 150]) for _ in range(n)]
    return [[rng.randrange(3, 250) for _ in range(k)] for k in lengths]


def make_params(n, seed=0):
    rng = random.Random(seed + 1)
    out = []
    for i in range(n):
        max_tokens = rng.randrange(3, 16)
        if i % 3 == 1:
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=i))
        elif i % 3 == 2:
            out.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.3,
                    top_k=20,
                    seed=100 + i,
                    repetition_penalty=1.2,
                )
            )
        else:
            out.append(SamplingParams(max_tokens=max_tokens))
    return out


def run_alone(model, prompt, params, config):
    engine = EngineCore(model, config)
    handle = engine.submit(prompt, params)
    engine.run_until_idle()
    return handle.result().tokens


def run_together(model, prompts, params, config, seed=0):
    """Submit with random gaps so rows join (and, with different max_tokens, leave) mid-flight."""
    engine = EngineCore(model, config)
    results = run_with_gaps(engine, prompts, params, seed)
    assert engine.rows.row_count == 0 and engine.scheduler.reserved == 0
    return [r.tokens for r in results]


@pytest.fixture(scope="module")
def references(tiny_model):
    cache = {}

    def get(arch, chunk, n):
        key = (arch, chunk, n)
        if key not in cache:
            m = tiny_model(arch)
            cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=chunk, max_rows=1)
            cache[key] = [
                run_alone(m, p, sp, cfg)
                for p, sp in zip(make_prompts(n), make_params(n), strict=True)
            ]
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
@pytest.mark.parametrize("chunk", [16, 4096])
def test_rows_in_a_cohort_equal_rows_alone(tiny_model, references, arch, chunk):
    m = tiny_model(arch)
    n = 16
    ref = references(arch, chunk, n)
    for max_rows in (3, 16):
        cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=chunk, max_rows=max_rows)
        got = run_together(m, make_prompts(n), make_params(n), cfg, seed=max_rows)
        assert got == ref, f"max_rows={max_rows}"


def test_chunked_prefill_changes_nothing(tiny_model, references):
    assert references("llama", 16, 16) == references("llama", 4096, 16)


def test_cancel_stops_within_one_step_and_frees_the_row(tiny_model):
    m = tiny_model("llama")
    engine = EngineCore(m, RuntimeConfig.resolve(environ={}))
    keep = engine.submit([5, 6, 7], SamplingParams(max_tokens=40))
    drop = engine.submit([8, 9, 10, 11], SamplingParams(max_tokens=40))
    for _ in range(4):
        engine.step()
    assert engine.rows.row_count == 2
    reserved = engine.scheduler.reserved
    drop.cancel()
    engine.step()
    assert engine.rows.row_count == 1 and engine.scheduler.reserved < reserved
    res = drop.result()
    assert res.finish_reason == "cancelled" and len(res.tokens) <= 4
    engine.run_until_idle()
    cfg = RuntimeConfig.resolve(environ={})
    assert keep.result().tokens == run_alone(m, [5, 6, 7], SamplingParams(max_tokens=40), cfg)


def test_failed_admission_leaves_running_rows_untouched(tiny_model, monkeypatch, caplog):
    m = tiny_model("gemma3_text")
    cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=8)
    prompts, params = make_prompts(4, seed=5), [SamplingParams(max_tokens=20)] * 4
    ref = [run_alone(m, p, sp, cfg) for p, sp in zip(prompts, params, strict=True)]
    engine = EngineCore(m, cfg)
    poison = [7] * 33
    original = engine.runner.prefill

    def failing(rows, ids, chunk):
        if ids and ids[0] == 7 and len(set(ids)) == 1:
            raise RuntimeError("injected prefill failure")
        return original(rows, ids, chunk)

    monkeypatch.setattr(engine.runner, "prefill", failing)
    handles = [engine.submit(p, sp) for p, sp in zip(prompts[:2], params[:2], strict=True)]
    for _ in range(3):
        engine.step()
    bad = engine.submit(poison, SamplingParams(max_tokens=5))
    handles += [engine.submit(p, sp) for p, sp in zip(prompts[2:], params[2:], strict=True)]
    engine.run_until_idle()
    res = bad.result()
    assert res.finish_reason == "error" and "injected" in res.error and res.tokens == []
    assert [h.result().tokens for h in handles] == ref
    logged = [r for r in caplog.records if "failed while joining" in r.getMessage()]
    assert len(logged) == 1 and "injected" in str(logged[0].exc_info[1])  # with its trace


def test_requests_that_cannot_fit_are_refused_at_submit(tiny_model):
    m = tiny_model("llama")
    engine = EngineCore(
        m, RuntimeConfig.resolve(environ={}, memory_budget=1 << 20, max_queue=2)
    )
    with pytest.raises(ValueError, match="KV cache"):
        engine.submit([1] * 10, SamplingParams(max_tokens=4000))
    with pytest.raises(ValueError, match="context window"):
        engine.submit([1] * 10, SamplingParams(max_tokens=m.context_length))
    engine.submit([1, 2], SamplingParams(max_tokens=2))
    engine.submit([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull):
        engine.submit([1, 2], SamplingParams(max_tokens=2))
    engine.run_until_idle()


def test_memory_budget_limits_rows_and_everything_still_finishes(tiny_model):
    m = tiny_model("llama")
    probe = EngineCore(m, RuntimeConfig.resolve(environ={}))
    per_request = probe.scheduler.memory.row_bytes(3 + 10)
    cfg = RuntimeConfig.resolve(environ={}, memory_budget=2 * per_request + 1)
    engine = EngineCore(m, cfg)
    handles = [engine.submit([3, 4, 5], SamplingParams(max_tokens=10)) for _ in range(5)]
    peak = 0
    while engine.busy():
        engine.step()
        peak = max(peak, engine.rows.row_count + len(engine.scheduler.joining))
    assert peak == 2
    assert all(len(h.result().tokens) == 10 for h in handles)


def test_a_short_prompt_is_not_held_behind_a_long_prefill(tiny_model):
    """The long prompt needs 12 chunks; the short one behind it joins and decodes long before."""
    m = tiny_model("llama")
    cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=16, prefill_stall_ms=0)
    engine = EngineCore(m, cfg)
    long = engine.submit([(i * 7) % 200 + 3 for i in range(190)], SamplingParams(max_tokens=4))
    engine.step()
    short = engine.submit([5, 6, 7, 8], SamplingParams(max_tokens=3))
    for _ in range(4):
        engine.step()
    assert short.request.tokens and not long.request.tokens
    assert long.request.prefilled < 190 - 16
    engine.run_until_idle()
    assert short.result().tokens == run_alone(m, [5, 6, 7, 8], SamplingParams(max_tokens=3), cfg)


def test_prefill_leaves_the_running_rows_step_its_share_of_the_stall(tiny_model, monkeypatch):
    """Prefill units run while they fit in the stall target less the running rows' own step:
    with no rows running a step prefills many 16-token chunks; once the running rows' step
    takes the whole target (slowed here), each step prefills one chunk (the first unit
    always runs). Budgeting the stall without the running rows' step runs several."""
    m = tiny_model("llama")
    engine = EngineCore(m, RuntimeConfig.resolve(environ={}, prefill_chunk=16, prefill_stall_ms=300))
    prompt = [(i * 7) % 200 + 3 for i in range(200)]
    first = engine.submit(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    assert first.request.prefilled == 199 and first.request.tokens  # 13 chunks in one step
    forward = engine._forward_and_verify

    def slow(drafts):
        time.sleep(0.3)
        return forward(drafts)

    monkeypatch.setattr(engine, "_forward_and_verify", slow)
    engine.step()  # the running row's step of 0.3 s is measured here
    second = engine.submit(prompt[::-1], SamplingParams(max_tokens=1))
    for _ in range(3):
        before = second.request.prefilled
        engine.step()
        assert second.request.prefilled - before == 16


def test_short_prompts_arriving_at_an_idle_engine_are_prefilled_in_one_forward(tiny_model):
    """Sixteen 10-token prompts at an idle engine (chunk 16: ten chunks of tokens) go in one
    forward; behind a running row each group holds at most a chunk of tokens. Every row's tokens equal the row alone
    (grouping never changes a row's arithmetic)."""
    m = tiny_model("llama")
    cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=20)
    engine = EngineCore(m, cfg)
    groups: list[int] = []
    together = engine._prefill_together

    def counted(requests):
        groups.append(len(requests))
        return together(requests)

    engine._prefill_together = counted
    prompts = [[(i * 13 + j * 7) % 200 + 3 for j in range(10)] for i in range(16)]
    params = SamplingParams(max_tokens=6)
    idle = [engine.submit(p, params) for p in prompts]
    engine.step()
    assert groups == [16]
    busy = [engine.submit(p[::-1], params) for p in prompts[:3]]
    engine.run_until_idle()
    assert groups[1:] == [1, 1, 1]
    for handle, p in zip(idle + busy, prompts + [p[::-1] for p in prompts[:3]], strict=True):
        assert handle.result().tokens == run_alone(m, p, params, cfg)


def cohort_of(runner, prompts):
    """The runner's rows for these prompts, each prefilled alone in chunks of 64."""
    parts = []
    for p in prompts:
        rows = runner.blank_rows(1)
        runner.prefill(rows, p, 64)
        parts.append(rows)
    rows = runner.empty_rows()
    rows.prepare_append(parts).commit()
    return rows


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_compiled_rows_decode_equals_the_eager_forward(tiny_model, arch):
    """The runner's one-token forward runs compiled segments (engine/compiled_step.py) and
    gives every row the eager forward's bits, step after step, past a page of columns.
    Negative control: the same comparison against the forward without batch invariance
    (fused attention, unplanned projections) finds differences."""
    m = tiny_model(arch)
    runner = ModelRunner(m)
    eager = ModelRunner(m, compiled=False)
    loose = ModelRunner(m, batch_invariant=False)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 40, 236)]
    states = [cohort_of(r, prompts) for r in (runner, eager, loose)]
    ids = mx.array([[p[-1]] for p in prompts], dtype=mx.int32)
    loose_differs = False
    for step in range(30):  # the longest row crosses a page of columns (256)
        h = [r.forward(s, ids) for r, s in zip((runner, eager, loose), states, strict=True)]
        mx.eval(h, *(a for s in states for a in s.arrays()))
        assert mx.array_equal(h[0], h[1]).item(), f"step {step}"
        loose_differs |= not mx.array_equal(h[0], h[2]).item()
        ids = mx.argmax(runner.logits(h[0]), axis=-1).astype(mx.int32)
    assert runner._decode_step(states[0]) is not None  # the compiled step really ran
    assert eager._decode_step(states[1]) is None
    assert loose_differs


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_compiled_verify_blocks_equal_the_eager_forward(tiny_model, arch, monkeypatch):
    """Verify blocks run the compiled segments too — equal depths and ragged ones (rows
    drafting different depths: the real slots' indices are the ragged segments' inputs) —
    and give every real slot the eager forward's bits. Each block is rewound after it, as
    a rejected draft is. Traces are bounded: past TRACED_SHAPES (3 here) a segment set is
    compiled anew, with the same bits. Negative control: the forward without batch
    invariance differs."""
    from mlx_tandem.engine import compiled_step
    from mlx_tandem.engine.compiled_step import CompiledStep

    monkeypatch.setattr(compiled_step, "TRACED_SHAPES", 3)

    shapes: list[tuple[int, int, int | None]] = []
    call = CompiledStep.__call__

    def counted(self, ids, caches, ragged=None):
        shapes.append((*ids.shape, None if ragged is None else int(ragged.take.shape[0])))
        return call(self, ids, caches, ragged)

    monkeypatch.setattr(CompiledStep, "__call__", counted)
    m = tiny_model(arch)
    runners = (ModelRunner(m), ModelRunner(m, compiled=False), ModelRunner(m, batch_invariant=False))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (3, 70, 250)]
    states = [cohort_of(r, prompts) for r in runners]
    loose_differs = False
    for step, (width, lengths) in enumerate(
        [(4, None), (2, None), (4, [4, 2, 1]), (7, None), (4, [1, 4, 3]), (1, None)] * 2
    ):
        ids = mx.array([[rng.randrange(3, 250) for _ in range(width)] for _ in prompts])
        ends = states[0].ends
        h = [r.forward(s, ids, lengths) for r, s in zip(runners, states, strict=True)]
        mx.eval(h, *(a for s in states for a in s.arrays()))
        real = lengths or [width] * len(prompts)
        for i, n in enumerate(real):
            assert mx.array_equal(h[0][i, :n], h[1][i, :n]).item(), f"block {step}, row {i}"
            loose_differs |= not mx.array_equal(h[0][i, :n], h[2][i, :n]).item()
        keep = [e + rng.randrange(0, n + 1) for e, n in zip(ends, real, strict=True)]
        for s in states:  # a verify keeps an accepted prefix of each row's block
            s.set_ends(keep)
    assert set(shapes) == {(3, 4, None), (3, 2, None), (3, 4, 7), (3, 7, None), (3, 4, 8),
                           (3, 1, None)}
    assert len(shapes) == 12
    traced = runners[0]._decode._sets
    assert len(traced[False].shapes) <= 3 and len(traced[True].shapes) == 2
    assert loose_differs
