"""Negative control on real SmolLM2: the batch-invariance machinery is needed, and it works.

Without it the shape dependence it guards against is there (a projection's per-row result
changes with the call's row count or the row's position; mlx's fused SDPA gives a row a different result in a batch
with wider keys), and on this BLAS a row's logits differ between alone and batched when
projection padding and the routed attention are off. With it on they are identical.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_tandem.engine.runner import ModelRunner
from mlx_tandem.models.invariance import RowPlan, probe_plan

pytestmark = [pytest.mark.slow, pytest.mark.machine_blas]  # the regime of this BLAS at its threads

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List primes."]


@pytest.fixture(scope="module")
def smollm2(real_model):
    return real_model("smollm2-135m", "float32")


def _alone_vs_batched(
    model, batch_invariant: bool, steps: int = 3, questions: list[str] = QUESTIONS
) -> list[bool]:
    """Per row: are its greedy decode logits identical alone and in a batch of all rows?"""
    runner = ModelRunner(model, batch_invariant=batch_invariant)
    prompts = [model.encode(q) for q in questions]

    def prefilled(p: list[int]):
        row = runner.blank_rows(1)
        runner.prefill(row, p[:-1], 64)
        return row

    def decode(rows, tokens: list[int]) -> list[list[mx.array]]:
        out: list[list[mx.array]] = [[] for _ in tokens]
        ids = mx.array(tokens, dtype=mx.int32)[:, None]
        for _ in range(steps):
            logits = runner.logits(runner.forward(rows, ids))[:, -1]
            mx.eval(logits)
            for i in range(len(tokens)):
                out[i].append(logits[i])
            ids = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
        return out

    singles = [prefilled(p) for p in prompts]
    rows = runner.empty_rows()
    rows.prepare_append(singles).commit()  # a new cohort: decoding the singles leaves it be
    alone = [decode(row, [p[-1]])[0] for row, p in zip(singles, prompts, strict=True)]
    batched = decode(rows, [p[-1] for p in prompts])
    return [
        all(mx.array_equal(a, b).item() for a, b in zip(x, y, strict=True))
        for x, y in zip(alone, batched, strict=True)
    ]


def _fused_sdpa_depends_on_key_width(H: int, Hkv: int, D: int, L: int = 4) -> bool:
    k1, k2, k3 = mx.random.split(mx.random.key(0), 3)
    lens = [7, 40, 300, 1000]
    S = max(lens)
    q = mx.random.normal((len(lens), H, L, D), key=k1)
    k = mx.random.normal((len(lens), Hkv, S, D), key=k2)
    v = mx.random.normal((len(lens), Hkv, S, D), key=k3)
    mask = (mx.arange(S)[None] < mx.array(lens)[:, None])[:, None, None, :]
    batched = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)
    return any(
        not mx.array_equal(
            mx.fast.scaled_dot_product_attention(
                q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], scale=D**-0.5
            ),
            batched[i : i + 1],
        ).item()
        for i, n in enumerate(lens)
    )


def test_invariance_is_needed_and_sufficient_on_smollm2(smollm2):
    attn = smollm2.model.model.layers[0].self_attn
    needs = {
        name: probe_plan(getattr(attn, name), attn.q_proj.weight.shape[1])
        for name in ("q_proj", "k_proj", "v_proj")
    }
    assert any(plan != RowPlan() for plan in needs.values()), needs  # one call is not exact
    assert _fused_sdpa_depends_on_key_width(attn.n_heads, attn.n_kv_heads, 64)
    off = _alone_vs_batched(smollm2, batch_invariant=False)
    on = _alone_vs_batched(smollm2, batch_invariant=True)
    assert all(on), on
    print(f"probe {needs}; machinery off, rows equal alone/batched: {off}")


def test_rows_past_the_exact_chunk_decode_as_they_do_alone(smollm2):
    """16 rows: wider than OpenBLAS's exact 12-row calls here, so every projection and the
    tied head run turned (`(W @ x.T).T`, models/invariance.py), one call for all rows."""
    runner = ModelRunner(smollm2)
    q_proj = runner.graph.backbone.layers[0].self_attn.q_proj
    assert q_proj.plan.chunk < 16 <= q_proj.plan.wide, q_proj.plan
    questions = [f"{q} Answer in {n} words." for q in QUESTIONS for n in (5, 10, 20, 40, 80, 160, 320)]
    assert all(_alone_vs_batched(smollm2, batch_invariant=True, steps=2, questions=questions[:16]))


def _prefilled_together(runner, prompts: list[list[int]]) -> list[mx.array]:
    """Each prompt's hidden states, prefilled together in one (packed) forward."""
    width = max(len(p) for p in prompts)
    ids = mx.array([p + [0] * (width - len(p)) for p in prompts], dtype=mx.int32)
    hidden = runner.forward(runner.blank_rows(len(prompts)), ids, [len(p) for p in prompts],
                            prefill=True)
    return [hidden[i, : len(p)] for i, p in enumerate(prompts)]


def test_prompts_prefilled_together_get_the_rows_they_get_alone(smollm2):
    """Short prompts prefilled together run packed projection calls (192 rows here), each
    prompt laid out at a multiple of the pack unit: every token's hidden state equals the
    prompt's own prefill. Laid out off the unit (unit 1), some row differs."""
    runner = ModelRunner(smollm2)
    assert runner.pack_unit > 1, runner.pack_unit
    prompts = [smollm2.encode(f"{q} Answer in {n} words.") for q in QUESTIONS for n in (5, 40)]
    alone = [_prefilled_together(runner, [p])[0] for p in prompts]
    together = _prefilled_together(runner, prompts)
    assert all(mx.array_equal(a, b).item() for a, b in zip(alone, together, strict=True))
    runner.pack_unit = 1  # the negative control: rows at arbitrary offsets of the calls
    off = _prefilled_together(runner, prompts)
    assert not all(mx.array_equal(a, b).item() for a, b in zip(alone, off, strict=True))
