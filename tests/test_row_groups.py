"""Rows of very different capacity in groups of their own (kv/row_groups.py): a long prompt
joining short rows copies nothing, and every row's tokens equal the row run alone."""

import random

import mlx.core as mx
import pytest
from test_engine import run_alone

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.draft_model import DraftModelSource
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.kv import row_groups
from mlx_tandem.kv.row_cache import RowKVCache
from mlx_tandem.kv.row_groups import GroupedKVCache, merge_groups


def _prompts():
    rng = random.Random(7)
    short = [[rng.randrange(3, 250) for _ in range(n)] for n in (12, 30, 5, 50)]
    return [*short[:2], [rng.randrange(3, 250) for _ in range(600)], *short[2:]]


def _params(n, tokens=10):
    out = []
    for i in range(n):
        if i % 2:
            out.append(SamplingParams(max_tokens=tokens + i, temperature=0.9, seed=40 + i))
        else:
            out.append(SamplingParams(max_tokens=tokens + i))
    return out


def _grouped(core: EngineCore) -> int:
    return max((len(c.groups) for c in core.rows.leaves() if isinstance(c, GroupedKVCache)),
               default=1)


def run_cohort(model, together: bool, drafter=None, tokens=10):
    cfg = RuntimeConfig.resolve(environ={}, prefill_chunk=64, max_rows=8, prefix_cache_bytes=0)
    prompts, params = _prompts(), _params(5, tokens)
    if not together:
        return [run_alone(model, p, sp, cfg) for p, sp in zip(prompts, params, strict=True)], 1
    core = EngineCore(model, cfg, drafter, FixedDepth(3) if drafter else None)
    handles, most = [], 1
    for p, sp in zip(prompts, params, strict=True):
        handles.append(core.submit(p, sp))
        for _ in range(2):
            core.step()
            most = max(most, _grouped(core))
    while core.busy():
        core.step()
        most = max(most, _grouped(core))
    return [h.result().tokens for h in handles], most


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_long_row_joins_short_rows_as_its_own_group_and_rows_stay_exact(tiny_model, arch):
    m = tiny_model(arch)
    alone, _ = run_cohort(m, together=False)
    together, groups = run_cohort(m, together=True)
    assert groups >= 2  # the 600-token row joined as a group of its own
    assert together == alone


@pytest.mark.parametrize("drafter", ["draft-model", "ngram"])
def test_speculative_rows_in_groups_stay_exact(tiny_model, drafter):
    """Drafts verified over grouped rows (the assistant's own case: tests/test_assistant.py)."""
    m = tiny_model("llama")
    alone, _ = run_cohort(m, together=False, tokens=40)  # short rows still running at the join
    source = DraftModelSource(m) if drafter == "draft-model" else PromptLookupSource()
    together, groups = run_cohort(m, together=True, drafter=source, tokens=40)
    assert groups >= 2
    if drafter == "ngram":  # deterministic drafts: sampled rows are plain sampling's too
        assert together == alone
    else:  # a draft model's sampled rows follow the distribution, not plain's draws
        assert together[::2] == alone[::2]  # the greedy rows


def test_groups_read_their_own_rows_of_the_mask(tiny_model, monkeypatch):
    """Negative control: groups that read the first rows' validity are not exact."""
    m = tiny_model("llama")
    alone, _ = run_cohort(m, together=False)
    attend = GroupedKVCache.attend

    def first_rows_mask(self, queries, keys, values, scale, mask, *args, **kwargs):
        rows = len(self.groups[0].ends)
        wrong = mx.concatenate([mask[:rows]] * (-(-mask.shape[0] // rows)))[: mask.shape[0]]
        return attend(self, queries, keys, values, scale, wrong, *args, **kwargs)

    monkeypatch.setattr(GroupedKVCache, "attend", first_rows_mask)
    together, groups = run_cohort(m, together=True)
    assert groups >= 2
    assert together != alone


def _cache(rows: int, columns: int) -> RowKVCache:
    c = RowKVCache()
    c.ends = [0] * rows
    keys = mx.random.normal((rows, 2, columns, 8), key=mx.random.key(columns + rows))
    c.update_and_fetch(keys, keys + 1)
    return c


def test_merging_keeps_close_capacities_together_and_taking_rows_copies_only_what_changes():
    short, also_short, long = _cache(3, 40), _cache(2, 300), _cache(1, 1500)
    merged = merge_groups([short, also_short, long])
    assert isinstance(merged, GroupedKVCache)
    assert [len(g.ends) for g in merged.groups] == [5, 1]  # 256 and 512 columns: one group
    assert merged.ends == [40, 40, 40, 300, 300, 1500]
    kept = merged.take_rows([0, 1, 2, 3, 4])  # the long row leaves: one plain row cache
    assert type(kept) is RowKVCache and kept.ends == [40, 40, 40, 300, 300]
    some = merged.take_rows([1, 5])
    assert isinstance(some, GroupedKVCache)
    assert some.groups[1].kparts[0] is merged.groups[1].kparts[0]  # kept as it is: no copy
    k, _ = some.fetch(1536)
    assert mx.array_equal(k[0, :, :40], short.fetch()[0][1, :, :40]).item()
    assert mx.array_equal(k[1, :, :1500], long.fetch()[0][0, :, :1500]).item()
    many = merge_groups([_cache(1, n) for n in (40, 1000, 3000, 40, 1000, 3000)])
    assert len(many.groups) == row_groups.MOST_GROUPS
