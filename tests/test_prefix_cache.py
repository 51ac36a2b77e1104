"""The prefix cache: warm rows equal cold rows bit for bit; eviction keeps its budget."""

import random
from dataclasses import replace
from itertools import pairwise

import mlx.core as mx
import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.engine.config import RuntimeConfig, parse_cache_bytes
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.prefill import PrefillPolicy
from mlx_tandem.kv.prefix_cache import Block, Cuts, PrefixCache
from mlx_tandem.kv.state_rows import RowSpan
from mlx_tandem.server.metrics import Metrics, parse

from conftest import run_with_gaps

CHUNK = 16


def config(cache_bytes: int, **kw) -> RuntimeConfig:
    return RuntimeConfig.resolve(
        environ={}, prefill_chunk=CHUNK, prefix_cache_bytes=cache_bytes, **kw
    )


def params(i: int, sampled: bool = True) -> SamplingParams:
    if i % 2 and sampled:
        return SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=i, logprobs=20)
    return SamplingParams(max_tokens=8, logprobs=20)  # 20 top entries: a rounding shows


def outputs(results) -> list:
    """Tokens and every logprob (chosen and top): equal only if the logits are."""
    return [(r.tokens, [(t.logprob, t.top) for t in r.logprobs]) for r in results]


def prompts(seed: int) -> list[list[int]]:
    """Prompts sharing prefixes of 0-3 whole chunks, tails of assorted lengths."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(3 * CHUNK + 5)]
    out = []
    for cut in (3 * CHUNK, 2 * CHUNK + 7, CHUNK, 3 * CHUNK + 5, 0, 3 * CHUNK):
        tail = [rng.randrange(3, 250) for _ in range(rng.choice([1, 2, 9, CHUNK + 1, 30]))]
        out.append(shared[:cut] + tail)
    out.append(shared[: 2 * CHUNK + 1])  # a full hit: every prefilled token is cached
    out.append(out[1])  # the same prompt again: its whole chunks and its tail are cached
    return out


@pytest.mark.parametrize(("arch", "taper"), [("llama", 0), ("gemma3_text", 0), ("lfm2", 0),
                                             ("qwen3_5", 0), ("llama", 24)])
def test_warm_rows_equal_cold_rows(tiny_model, arch, taper):
    """Every request served from cached chunks gives the tokens and logprobs of the same
    request run alone on an engine without a cache (hybrids: recurrent-state snapshots).
    taper: chunks shrink with depth (16, 8, 8, ...) and the cache's blocks are those chunks.
    Negative control (tapered): a warm engine that cuts fixed chunks after its hits."""
    model = tiny_model(arch)
    ps = prompts(1)
    cold = []
    for i, p in enumerate(ps):
        engine = EngineCore(model, config(0, prefill_taper=taper))
        assert engine.scheduler.prefix_cache is None
        h = engine.submit(p, params(i))
        engine.run_until_idle()
        cold.append(h.result())
    engine = EngineCore(model, config(1 << 30, max_rows=4, prefill_taper=taper))
    assert engine.prefill_policy.cuts.at(3 * CHUNK) == (8 if taper else CHUNK)
    warm = run_with_gaps(engine, ps, [params(i) for i in range(len(ps))], seed=3)
    assert outputs(warm) == outputs(cold)
    stats = engine.scheduler.prefix_cache.stats
    assert stats.hits >= 4 and stats.hit_tokens >= 8 * CHUNK, stats
    # sequentially: each prompt's whole shared chunks were cached by an earlier row
    engine = EngineCore(model, config(1 << 30, prefill_taper=taper))
    stats = engine.scheduler.prefix_cache.stats
    for i, p in enumerate(ps):
        served = stats.hit_tokens
        h = engine.submit(p, params(i))
        engine.run_until_idle()
        assert outputs([h.result()]) == outputs([cold[i]]), i
        if i == len(ps) - 1:  # a repeated prompt is served whole, its tail included
            assert stats.hit_tokens - served == len(p) - 1
    assert stats.hits >= 5
    if taper:
        engine = EngineCore(model, config(1 << 30, max_rows=4, prefill_taper=taper))
        engine.prefill_policy = replace(engine.prefill_policy, taper=0)
        broken = run_with_gaps(engine, ps, [params(i) for i in range(len(ps))], seed=3)
        assert outputs(broken) != outputs(cold)


def short_prompts(seed: int) -> list[list[int]]:
    """Prompts of at most one chunk (prefilled together) sharing prefixes of assorted lengths."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    out = [shared[:cut] + [rng.randrange(3, 250) for _ in range(tail)]
           for cut, tail in ((38, 0), (40, 8), (30, 9), (13, 1), (40, 20), (0, 7), (25, 30), (40, 3))]
    return [*out, shared[:37], shared[:37]]  # whole hits: every prefilled token cached


def short_config(cache_bytes: int, **kw) -> RuntimeConfig:
    return RuntimeConfig.resolve(environ={}, prefill_chunk=4096, prefix_cache_bytes=cache_bytes,
                                 **kw)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_short_prompts_warm_equal_cold(tiny_model, arch):
    """Prompts prefilled together start from their longest cached prefix of whole pack units
    (engine/prefill.start_short): tokens and logprobs equal each prompt run alone without a
    cache, joining mid-flight in groups. A cache whose blocks are not whole units puts a
    warm row's tokens off the packed calls' period: not exact (the negative control)."""
    model = tiny_model(arch)
    ps = short_prompts(4)
    cold = [sequential(EngineCore(model, short_config(0)), [p], [i])[0] for i, p in enumerate(ps)]
    engine = EngineCore(model, short_config(1 << 30, max_rows=4))
    cache = engine.scheduler.short_cache
    assert cache is not None and cache.cuts.size == engine.runner.pack_unit > 1
    warm = run_with_gaps(engine, ps + ps, [params(i) for i in range(len(ps))] * 2, seed=5)
    assert outputs(warm) == outputs(cold) * 2
    assert cache.stats.hits >= len(ps) and cache.stats.hit_tokens >= 8 * cache.cuts.size, cache.stats
    served = cache.stats.hit_tokens  # a repeated prompt is served whole (its tail cached)
    assert outputs(sequential(engine, ps[3:4], [3])) == outputs(cold[3:4])
    assert cache.stats.hit_tokens - served == len(ps[3]) - 1
    if arch == "llama":  # negative controls: blocks off the unit; tails served to longer prompts
        # (greedy rows: which of a row's logprobs are reported never hangs on a draw)
        greedy = [sequential(EngineCore(model, short_config(0)), [p], [i], sampled=False)[0]
                  for i, p in enumerate(ps)]
        for broken in (PrefixCache(1 << 30, cache.cuts.size + 1), PrefixTails(1 << 30, cache.cuts.size)):
            engine = EngineCore(model, short_config(1 << 30))
            engine.scheduler.short_cache = broken
            again = sequential(engine, ps * 2, [*range(len(ps))] * 2, sampled=False)
            assert outputs(again) != outputs(greedy) * 2


def sequential(
    engine: EngineCore, ps: list[list[int]], seeds: list[int], sampled: bool = True
) -> list:
    out = []
    for p, i in zip(ps, seeds, strict=True):
        h = engine.submit(p, params(i, sampled))
        engine.run_until_idle()
        out.append(h.result())
    return out


class PrefixTails(PrefixCache):
    """Broken on purpose: serves a cached tail to a longer prompt that starts with it."""

    def lookup(self, tokens):
        found = super().lookup(tokens)
        keys, rest = self._keys(tokens)
        if len(found) != len(keys):  # a miss, or a whole hit (its own tail)
            return found
        node = self._root
        for key in keys:
            node = node.children[key]
        for key, child in node.children.items():
            if len(key) < len(rest) and rest[: len(key)] == key and child.block is not None:
                return [*found, child.block]
        return found


def test_speculative_rows_hit_and_stay_exact(tiny_model):
    """With prompt lookup drafting, warm rows (a full hit included) equal cold rows."""
    from mlx_tandem.drafters.prompt_lookup import PromptLookupSource

    model = tiny_model("llama")
    ps = prompts(2)
    ps = [p + p[-6:] * 3 for p in ps]  # repeats, so prompt lookup drafts something

    def run(cache: int) -> list:
        engine = EngineCore(model, config(cache), drafter=PromptLookupSource())
        out = []
        for i, p in enumerate(ps):
            h = engine.submit(p, params(i))
            engine.run_until_idle()
            out.append(h.result())
        return out

    assert outputs(run(1 << 30)) == outputs(run(0))


def test_eviction_keeps_the_budget_over_200_requests(tiny_model):
    """200 requests over a few shared prefixes, a budget of a few blocks: the cache never
    holds more bytes than its budget (counted from the arrays it holds), evicts, still hits."""
    model = tiny_model("lfm2")
    probe = EngineCore(model, config(1 << 30))
    h = probe.submit(list(range(3, 3 + CHUNK + 2)), SamplingParams(max_tokens=1))
    probe.run_until_idle()
    h.result()
    block_bytes = probe.scheduler.prefix_cache.bytes
    assert block_bytes > 0
    budget = 5 * block_bytes + block_bytes // 2
    engine = EngineCore(model, config(budget, max_rows=6))
    cache = engine.scheduler.prefix_cache
    rng = random.Random(7)
    roots = [[rng.randrange(3, 250) for _ in range(4 * CHUNK)] for _ in range(6)]
    handles = []
    for i in range(200):
        root = rng.choice(roots[: 2 + i // 40])
        prompt = root[: rng.choice([CHUNK, 2 * CHUNK, 3 * CHUNK, 4 * CHUNK])]
        prompt = prompt + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 12))]
        handles.append(engine.submit(prompt, SamplingParams(max_tokens=rng.randrange(1, 4))))
        for _ in range(rng.randrange(3)):
            engine.step()
            assert cache.bytes <= budget
            assert held_bytes(cache) == cache.bytes
    while engine.busy():
        engine.step()
        assert cache.bytes <= budget
    assert all(h.result().finish_reason == "length" for h in handles)
    assert held_bytes(cache) == cache.bytes <= budget
    assert cache.stats.evicted > 0 and cache.stats.hits > 20, cache.stats


def held_bytes(cache: PrefixCache) -> int:
    return sum(n.block.nbytes for n in cache._nodes())


def fake_block(nbytes: int, start: int = 0, end: int = 1) -> Block:
    return Block(RowSpan(start, end, ([mx.zeros((nbytes // 4,), mx.float32)],)), mx.zeros((0,)))


def test_lru_evicts_leaves_and_protects_the_path():
    cache = PrefixCache(budget=300, cuts=2)
    assert cache.insert([1, 2], lambda: fake_block(100))
    assert cache.insert([1, 2, 3, 4], lambda: fake_block(100))
    assert cache.insert([5, 6], lambda: fake_block(100))
    assert len(cache.lookup([1, 2, 3, 4, 9])) == 2  # touches [1,2] and [1,2,3,4]
    # room for a child of [5,6]: the oldest leaf not on its path is [1,2,3,4]
    assert cache.insert([5, 6, 7, 8], lambda: fake_block(100))
    assert len(cache.lookup([1, 2, 3, 4])) == 1 and cache.bytes == 300
    assert cache.stats.evicted == 1
    assert not cache.insert([9, 9], lambda: fake_block(400))  # larger than the budget
    assert not cache.insert([7, 7, 1, 1], lambda: fake_block(4))  # its parent is not cached
    built = []
    assert cache.insert([5, 6], lambda: built.append(1) or fake_block(4))  # already there
    assert not built and cache.bytes == 300
    with pytest.raises(ValueError, match="at least one token"):
        cache.insert([], lambda: fake_block(4))


def test_a_tail_serves_only_its_exact_prompt():
    """A prompt's final partial block is kept under its whole blocks and served only to the
    same prompt, never to one that merely starts with it."""
    cache = PrefixCache(budget=1000, cuts=2)
    assert cache.insert([1, 2], lambda: fake_block(100, 0, 2))
    assert cache.insert([1, 2, 3], lambda: fake_block(100, 2, 3))  # a tail under [1, 2]
    assert cache.insert([7], lambda: fake_block(100, 0, 1))  # a tail under the root
    assert not cache.insert([9, 9, 1], lambda: fake_block(100))  # [9, 9] is not cached
    assert len(cache.lookup([1, 2, 3])) == 2 and cache.stats.hit_tokens == 3
    assert len(cache.lookup([1, 2, 3, 4])) == 1  # [3, 4] is no block; [3] not its tail
    assert len(cache.lookup([1, 2, 4])) == 1 and len(cache.lookup([7])) == 1
    assert cache.lookup([7, 8]) == [] and cache.lookup([1]) == []
    assert cache.stats.lookup_tokens == 3 + 4 + 3 + 1 + 2 + 1
    with pytest.raises(ValueError, match="positive"):
        PrefixCache(0, 2)


def test_config_and_metrics(tiny_model):
    assert parse_cache_bytes("auto") is None and parse_cache_bytes("0") == 0
    assert parse_cache_bytes("2M") == 2 << 20
    assert RuntimeConfig.resolve(environ={"TANDEM_PREFIX_CACHE_BYTES": "1G"}).prefix_cache_bytes == (
        1 << 30
    )
    assert RuntimeConfig.resolve(environ={}).prefix_cache_bytes == 0  # off unless asked
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        RuntimeConfig.resolve(environ={}, prefix_cache_bytes=-1)
    model = tiny_model("llama")
    auto = EngineCore(model, RuntimeConfig.resolve(environ={}).with_(prefix_cache_bytes=None))
    assert auto.scheduler.prefix_cache is not None and auto.scheduler.prefix_cache.budget > 0
    engine = EngineCore(model, config(1 << 30))
    for _ in range(2):
        engine.submit(list(range(3, 3 + 2 * CHUNK + 3)), SamplingParams(max_tokens=2))
        engine.run_until_idle()
    values = parse(Metrics("tiny").render(engine))
    assert values["tandem_prefix_cache_lookups_total"] == 2
    assert values["tandem_prefix_cache_hits_total"] == 1
    assert values["tandem_prefix_cache_hit_tokens_total"] == 2 * CHUNK + 2  # all but the last
    assert values["tandem_prefix_cache_hit_rate"] == 0.5
    assert values["tandem_prefix_cache_bytes"] == engine.scheduler.prefix_cache.bytes > 0
    assert values["tandem_prefix_cache_budget_bytes"] == 1 << 30
    off = parse(Metrics("tiny").render(EngineCore(model, config(0))))
    assert off["tandem_prefix_cache_bytes"] == 0 and off["tandem_prefix_cache_budget_bytes"] == 0


def test_multi_turn_chat_through_the_server_reuses_the_conversation(tiny_model):
    """Turn 2's prompt starts with turn 1's: its whole chunks come from the cache, and the
    reply equals the same conversation on a server without a prefix cache."""
    from test_server import LiveServer

    model = tiny_model("llama")
    first = [{"role": "user", "content": " ".join(f"fact {i} is {i * 7 % 13}" for i in range(12))}]

    def conversation(cache: int) -> tuple[list[str], dict[str, float]]:
        server = LiveServer(model, config={"prefill_chunk": CHUNK, "prefix_cache_bytes": cache})
        try:
            kw = {"model": "x", "max_tokens": 6, "temperature": 0}
            one = server.client.chat.completions.create(messages=first, **kw)
            reply = one.choices[0].message.content
            second = [*first, {"role": "assistant", "content": reply},
                      {"role": "user", "content": "and fact 3?"}]  # fmt: skip
            two = server.client.chat.completions.create(messages=second, **kw)
            assert server.wait_idle()
            return [reply, two.choices[0].message.content], server.metrics()
        finally:
            server.stop()

    warm, metrics = conversation(1 << 28)
    cold, off = conversation(0)
    assert warm == cold
    assert metrics["tandem_prefix_cache_hits_total"] == 1
    assert metrics["tandem_prefix_cache_hit_tokens_total"] >= 2 * CHUNK
    assert metrics["tandem_prefix_cache_bytes"] > 0 and off["tandem_prefix_cache_bytes"] == 0


def test_serve_flag(capsys):
    from mlx_tandem.cli.main import main

    assert main(["serve", "--model", "nowhere", "--prefix-cache-bytes", "lots"]) == 2
    assert "--prefix-cache-bytes" in capsys.readouterr().err


@pytest.mark.parametrize("codec", ["affine4:g32", "turbo-k4v4"])
def test_quantized_rows_warm_equal_cold(tiny_model, codec):
    """Blocks keep what the layer's codec stores (its parts), so warm == cold under a codec."""
    model = tiny_model("qwen3", head_dim=32)
    ps = prompts(4)
    cold = []
    for i, p in enumerate(ps):
        engine = EngineCore(model, config(0, kv_codec=codec))
        h = engine.submit(p, params(i))
        engine.run_until_idle()
        cold.append(h.result())
    engine = EngineCore(model, config(1 << 30, kv_codec=codec, max_rows=4))
    warm = run_with_gaps(engine, ps, [params(i) for i in range(len(ps))], seed=5)
    assert outputs(warm) == outputs(cold)
    assert engine.scheduler.prefix_cache.stats.hit_tokens >= 8 * CHUNK


@pytest.mark.slow
def test_smollm2_warm_equals_cold(real_model):
    """Real SmolLM2: rows sharing a 4-chunk prefix, batched with gaps, equal each alone cold."""
    model = real_model("smollm2-135m")
    from pydoc_data.topics import topics

    doc = model.encode_text(topics["execmodel"])[: 4 * 64 + 20]
    ps = [doc + model.encode_text(q) for q in (" Summary:", " In short, names", " Q: what?")]
    ps.append(ps[0])
    cfg = {"environ": {}, "prefill_chunk": 64}
    cold = []
    for i, p in enumerate(ps[:3]):
        engine = EngineCore(model, RuntimeConfig.resolve(**cfg))
        h = engine.submit(p, params(i))
        engine.run_until_idle()
        cold.append(h.result())
    cold.append(cold[0])
    engine = EngineCore(model, RuntimeConfig.resolve(**cfg, prefix_cache_bytes=1 << 30))
    warm = run_with_gaps(engine, ps, [params(i % 3) for i in range(4)], seed=1)
    assert outputs(warm) == outputs(cold)
    assert engine.scheduler.prefix_cache.stats.hit_tokens >= 3 * 4 * 64 - 64


class SeedRecorder:
    """A drafter that proposes nothing and records the seed hidden each joining row gets."""

    name, samples, stateless = "recorder", False, True

    def __init__(self) -> None:
        self.seeds: dict[tuple[int, ...], mx.array] = {}

    def prepare_append(self, requests, hidden):
        from mlx_tandem.kv.state_rows import PreparedChange

        for i, r in enumerate(requests):
            self.seeds[tuple(r.prompt)] = hidden[i]
        mx.eval(hidden)
        return PreparedChange(lambda: None, lambda: None)

    def filter_rows(self, keep):
        pass

    def draft(self, requests, depths, target):
        from mlx_tandem.engine.draft_source import Drafts

        return Drafts([[] for _ in requests], [None] * len(requests))

    def commit(self, accepted, hidden):
        pass


def test_drafters_get_the_cold_seed_hidden(tiny_model):
    """The hidden handed to the drafter at join (the assistant's and MTP's seed) is the cold
    one bit for bit, also when every prefilled token came from the cache (a full hit)."""
    model = tiny_model("lfm2")
    ps = prompts(6)
    seeds = []
    for cache in (0, 1 << 30):
        recorder = SeedRecorder()
        engine = EngineCore(model, config(cache), drafter=recorder)
        for i, p in enumerate(ps):
            engine.submit(p, params(i))
            engine.run_until_idle()
        seeds.append(recorder.seeds)
    assert seeds[0].keys() == seeds[1].keys()
    for key, cold in seeds[0].items():
        assert mx.array_equal(cold, seeds[1][key]).item(), len(key)


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_cached_bytes_are_the_memory_it_holds(tiny_model, arch):
    """Blocks are copies, not views: clearing the cache frees what it counted (a view of a
    chunk's hidden or of a row's buffer would keep the whole source buffer alive)."""
    import gc

    model = tiny_model(arch)  # chunks of 64: arrays large enough that allocator rounding is noise
    engine = EngineCore(model, RuntimeConfig.resolve(environ={}, prefill_chunk=64,
                                                     prefix_cache_bytes=1 << 30))  # fmt: skip
    cache = engine.scheduler.prefix_cache

    def active() -> int:
        gc.collect()
        mx.clear_cache()
        return mx.get_active_memory()

    # No buffer reuse while the blocks are made: a cached free buffer handed out for a smaller
    # request counts its whole size as active (earlier tests leave such buffers behind).
    mx.clear_cache()
    limit = mx.set_cache_limit(0)
    try:
        rng = random.Random(0)
        for _ in range(4):
            engine.submit([rng.randrange(3, 250) for _ in range(640)], SamplingParams(max_tokens=1))
            engine.run_until_idle()
        before, held = active(), cache.bytes
        cache.clear()
        freed = before - active()
    finally:
        mx.set_cache_limit(limit)
    assert held > 0 and abs(freed - held) < 0.05 * held, (freed, held)


def test_chunks_shrink_with_depth_as_a_function_of_position():
    cuts = Cuts(128, 744)
    assert cuts.at(0) == 128 and cuts.at(744) == 64 and 8 <= cuts.at(1900) <= 40
    ends = cuts.ends(2000)
    assert ends[0] == 128 and all(b - a == cuts.at(a) for a, b in pairwise(ends))
    assert ends[-1] <= 2000 < ends[-1] + cuts.at(ends[-1])
    assert cuts.start_of(ends[3]) == ends[2] and cuts.start_of(ends[3] + 1) == ends[3]
    assert Cuts(16).ends(40) == [16, 32] and Cuts(16).start_of(40) == 32
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
               "intermediate_size": 1536, "num_hidden_layers": 30}
    policy = PrefillPolicy.resolve(smollm2, RuntimeConfig.resolve(environ={}), 8 << 30, "cpu")
    assert policy.chunk == 80 and 500 < policy.taper < 1000  # attention ~ projections there
    fixed = RuntimeConfig.resolve(environ={}, prefill_chunk=64)
    assert PrefillPolicy.resolve(smollm2, fixed, 8 << 30, "cpu").taper == 0
    off = RuntimeConfig.resolve(environ={}, prefill_taper=0)
    assert PrefillPolicy.resolve(smollm2, off, 8 << 30, "cpu").cuts.at(5000) == 80
