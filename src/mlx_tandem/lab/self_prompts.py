"""User prompts written by the target itself (Magpie, arXiv 2406.08464).

A chat model fed only its template's opening of a user turn (the "pre-query"
template: everything before a user's words) writes a user request, drawn from
what its instruction tuning taught it users ask. Sampled at temperature 1 and
then answered greedily by the same model, these prompts give a drafter answers
in the register of chat benchmarks (short instructions, advice, writing,
how-to), where ShareGPT's first turns lean to pasted text and code.

Each batch of prompts is drawn under its own key (`seed`, batch index), so a
resumed file grows exactly as an uninterrupted one would on the same machine;
batches are appended to a JSONL file as they finish.

Oracle: tests/test_lab.py (the pre-query template is the chat template's
opening; prompts are seeded, resumable, filtered, and never an excluded one).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from mlx_tandem.lab.corpus import MAX_CHARS, MIN_CHARS
from mlx_tandem.models.loader import LoadedModel

TEMPERATURE = 1.0  # Magpie's: the model's own distribution of user turns
MARKER = "\u2063USER\u2063"  # invisible separator: never part of a real template


def pre_query_ids(target: LoadedModel) -> list[int]:
    """The chat template's text before a user's words, as token ids."""
    tok = target.tokenizer
    if not tok.has_chat_template:
        raise ValueError(f"self-written prompts need a chat template; {target.name} has none "
                         "(use the ShareGPT prompts)")
    text = tok.apply_chat_template([{"role": "user", "content": MARKER}], tokenize=False,
                                   add_generation_prompt=True)
    return list(tok.encode(text[: text.index(MARKER)], add_special_tokens=False))


def read_batches(path: Path) -> dict[int, list[str]]:
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line)
    return {int(r["batch"]): list(r["prompts"]) for r in rows}


def self_prompts(
    target: LoadedModel,
    path: Path,
    count: int,
    *,
    seed: int,
    seconds: float,
    batch: int = 32,
    max_prompt_tokens: int = 128,
    exclude: frozenset[str] = frozenset(),
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Up to `count` distinct prompts the target writes, in batch order, grown in `path`.

    A sampled turn is kept when it ends (an end-of-turn token within `max_prompt_tokens`),
    has MIN_CHARS..MAX_CHARS characters, and is not in `exclude` (the benchmark's
    questions). Batches already in `path` are reused; new ones are drawn until `count`
    prompts exist, `seconds` pass, or a few times the batches `count` needs were drawn.
    """
    from mlx_lm.generate import batch_generate

    pre = pre_query_ids(target)
    done = read_batches(path)
    limit = 4 * math.ceil(count / batch) + 4  # a target that rarely ends a turn stops here
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    for i in range(limit):
        if len(_kept(done, exclude)) >= count:
            break
        if i in done:
            continue
        if time.perf_counter() - start > seconds:
            break
        result = batch_generate(  # this batch's own key: a resumed run draws the same
            target.model, target.tokenizer, [pre] * batch, max_tokens=max_prompt_tokens,
            return_token_ids=True, sampler=keyed_sampler(mx.random.key(seed * 1_000_003 + i)),
        )
        texts = [target.tokenizer.decode(list(ids)).strip()
                 for ids in result.token_ids if 0 < len(ids) < max_prompt_tokens]
        done[i] = [t for t in texts if MIN_CHARS <= len(t) <= MAX_CHARS]
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"batch": i, "prompts": done[i]}) + "\n")
        if progress is not None:
            progress(len(_kept(done, exclude)))
    return _kept(done, exclude)[:count]


def keyed_sampler(key: mx.array) -> Callable[[mx.array], mx.array]:
    """Draws at TEMPERATURE from a key of its own (split per step), not MLX's global state."""
    state = [key]

    def sample(logprobs: mx.array) -> mx.array:
        state[0], step = mx.random.split(state[0])
        return mx.random.categorical(logprobs * (1 / TEMPERATURE), key=step)

    return sample


def _kept(done: dict[int, list[str]], exclude: frozenset[str]) -> list[str]:
    seen = set(exclude)
    out = []
    for i in sorted(done):
        for text in done[i]:
            if text not in seen:
                seen.add(text)
                out.append(text)
    return out
