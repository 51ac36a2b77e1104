"""Sliding-window layers keep a ring of window + widest append in the rows engine: rows that
run past the ring (tiny gemma3_text: window 16, chunks of 64, ring 256) stay exact —
speculative == plain, batched == alone, warm (prefix cache) == cold — and the ring layers'
memory stops growing while the full-attention layers' grows."""

import random

import mlx.core as mx

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.kv.row_cache import RowKVCache

from conftest import run_with_gaps

CHUNK = 64


def config(**kw) -> RuntimeConfig:
    return RuntimeConfig.resolve(environ={}, prefill_chunk=CHUNK, **kw)


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Long prompts (whole shared chunks, repeats for prompt lookup) that wrap the ring."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(2 * CHUNK)]
    prompts, params = [], []
    for i, n in enumerate([300, 40, 250, 200]):
        body = [rng.randrange(3, 250) for _ in range(n // 2)]
        prompts.append(shared + body + body[:20] * 3)
        sampled = i % 2 == 1
        params.append(SamplingParams(max_tokens=40, temperature=0.9 if sampled else 0.0,
                                     seed=i if sampled else None, logprobs=2))  # fmt: skip
    return prompts, params


def outputs(results) -> list:
    return [(r.tokens, [(t.logprob, t.top) for t in r.logprobs]) for r in results]


def sliding(engine: EngineCore) -> list[RowKVCache]:
    return [c for c in engine.rows.leaves() if isinstance(c, RowKVCache) and c.window]


def test_rows_past_the_ring_stay_exact(tiny_model):
    model = tiny_model("gemma3_text")
    prompts, params = workload()
    alone = []
    for p, sp in zip(prompts, params, strict=True):
        engine = EngineCore(model, config())
        h = engine.submit(p, sp)
        engine.run_until_idle()
        alone.append(h.result())
    engine = EngineCore(model, config())
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for _ in range(6):
        engine.step()
    rings = sliding(engine)
    assert rings and max(engine.rows.ends) > 256
    assert all(c.ring == 256 and c.capacity == 256 for c in rings)
    full = [c for c in engine.rows.leaves() if isinstance(c, RowKVCache) and not c.window]
    assert all(c.capacity > 256 for c in full)
    engine.run_until_idle()
    assert outputs(h.result() for h in handles) == outputs(alone)
    spec = EngineCore(model, config(), drafter=PromptLookupSource(), depth=FixedDepth(4))
    results = run_with_gaps(spec, prompts, params, seed=1)
    assert outputs(results) == outputs(alone)
    assert spec.stats.accepted["ngram"] > 0
    warm = EngineCore(model, config(prefix_cache_bytes=1 << 30))
    results = run_with_gaps(warm, prompts + prompts, params + params, seed=2)
    assert outputs(results) == outputs(alone + alone)
    assert warm.scheduler.prefix_cache.stats.hit_tokens >= 4 * CHUNK


def test_the_ring_attends_like_every_column(tiny_model):
    """Against the same engine keeping every column of its sliding layers: the same
    distributions up to summation order."""
    model = tiny_model("gemma3_text")
    prompts, _ = workload()
    greedy = [SamplingParams(max_tokens=30, logprobs=1) for _ in prompts]
    ring = run_with_gaps(EngineCore(model, config()), prompts, greedy, seed=3)
    linear = EngineCore(model, config())
    linear.runner.reach = None  # sliding layers keep every column
    linear.rows = linear.runner.empty_rows()
    every = run_with_gaps(linear, prompts, greedy, seed=3)
    assert not sliding(linear) or all(c.ring is None for c in sliding(linear))
    for a, b in zip(ring, every, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y),
                 len(a.tokens))
        assert n >= 10, n  # a near-tie may flip a late greedy token; not an early one
        got = mx.array([t.logprob for t in a.logprobs[:n]])
        want = mx.array([t.logprob for t in b.logprobs[:n]])
        assert mx.allclose(got, want, atol=1e-4).item()
