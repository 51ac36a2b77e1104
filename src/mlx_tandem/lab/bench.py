"""`tandem bench`'s measurements: tandem and mlx-lm side by side on one loaded model.

A `Configuration` is one table row: an mlx-lm side and a tandem side doing the
same job — greedy, the same chat-templated prompt ids, `tokens` new tokens per
prompt with EOS ignored on both sides (so every row does the same work):

  * plain B=1: mlx-lm `stream_generate` vs tandem's plain path and vs the rows
    engine with one row (B=1 runs each of `alone` prompts alone, in turn);
  * batched B: mlx-lm `batch_generate` vs the rows engine (`EngineCore`);
  * speculative: the model drafting for itself (mlx-lm `stream_generate(...,
    draft_model=)` vs tandem's draft-model source, both fixed depth k), and
    tandem's `ngram` (on prompts that copy their input, and on chat prompts)
    and `assistant` drafters vs what mlx-lm does for the same prompts without
    speculation (it has neither drafter): `stream_generate` at B=1,
    `batch_generate` at B=4. A drafter that cannot be built (no assistant for
    this target) leaves its rows skipped, with the reason as their note.

Engines are built (probes, memory measurement) before any clock starts; each
side is warmed up once with a few tokens, then each repeat alternates the two
sides and times only the work (submit -> every request finished; prefill
included); tok/s is generated tokens (counted from the outputs) / seconds, the
median over repeats. A side shared by several rows (mlx-lm's B=1 chat run) is
measured once.

Oracle: tests/test_bench_cli.py.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import mlx.core as mx

from mlx_tandem.drafters.factory import build_depth, build_drafter
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.generate import generate
from mlx_tandem.engine.sampling import SamplingParams
from mlx_tandem.models.loader import LoadedModel

CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List five tips for learning a new language, with one sentence each.",
    "Describe the water cycle in a paragraph.",
    "What are the main differences between cats and dogs as pets?",
    "Write a polite email asking a colleague to review a document.",
    "Summarize the plot of a heist movie you invent.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer in plain language.",
    "Write a limerick about a programmer and a bug.",
    "What should I pack for a weekend hiking trip?",
    "Describe a sunset over the ocean using vivid imagery.",
    "Explain what a binary search does, step by step.",
    "Write a dialogue between a robot and a gardener.",
    "What are three benefits of regular exercise?",
    "Invent a new board game and explain its rules briefly.",
]

_PASSAGES = [
    "The old harbour town wakes slowly. Fishing boats return at dawn, their decks crowded "
    "with nets and crates, and the gulls follow them in wide circles. By eight o'clock the "
    "market stalls are open and the ferry to the island sounds its horn twice.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\nprint(mean([1, 2, 3, 4]))\n",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. "
    "When the light turns green, open the settings page and sign in with the password "
    "printed on the sticker under the device.",
    "Dear Maria, thank you for the lovely dinner on Saturday. The soup was wonderful and "
    "the children are still talking about the chocolate cake. We hope to see you again "
    "soon. With love, Tom and Anna.",
]
COPY_PROMPTS = [f"Repeat exactly, word for word:\n\n{p}" for p in _PASSAGES]

WARMUP_TOKENS = 2


def machine() -> dict[str, str]:
    """Where a measurement or a training run happened: platform, device, versions, date."""
    try:
        name = str(mx.device_info().get("device_name", ""))
    except (AttributeError, RuntimeError):
        name = ""
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "device": ("cpu" if mx.default_device() == mx.cpu else "gpu")
        + (f" ({name})" if name else ""),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "mlx_tandem": version("mlx-tandem"),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


@dataclass(frozen=True)
class BenchSettings:
    tokens: int = 64  # new tokens per prompt
    repeats: int = 3  # timed rounds per side (median)
    batches: tuple[int, ...] = (4, 8, 16)  # batched plain decoding
    spec_batches: tuple[int, ...] = (1, 4)  # speculative rows
    alone: int = 4  # prompts run alone, in turn, at B = 1
    draft_tokens: int = 3  # k: fixed depth (self-draft), maximum depth (ngram, assistant)
    draft_depth: str = "adaptive"  # ngram and assistant, as `tandem serve` runs them

    @classmethod
    def preset(cls, quick: bool, **overrides: Any) -> BenchSettings:
        """The full or `--quick` settings (fewer prompts, tokens, repeats, batch sizes);
        overrides that are not None win."""
        base = cls(tokens=32, repeats=1, batches=(4,), alone=1) if quick else cls()
        values = {k: v for k, v in overrides.items() if v is not None}
        settings = cls(**{**base.__dict__, **values})
        if settings.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {settings.tokens}")
        if settings.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {settings.repeats}")
        if settings.draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {settings.draft_tokens}")
        return settings

    @property
    def max_rows(self) -> int:
        return max((*self.batches, *self.spec_batches, 1))


@dataclass
class Measured:
    """One timed run: seconds of work, tokens generated, and speculation counters."""

    seconds: float
    tokens: int
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


Work = Callable[[int], Measured]  # new tokens per prompt -> one timed run


@dataclass
class Side:
    key: str  # sides with the same key are the same measurement (shared between rows)
    label: str  # what ran, e.g. "batch_generate"
    work: Work
    speculative: bool = False


@dataclass
class Configuration:
    name: str
    group: str  # "plain" | "batched" | "speculative"
    batch: int
    prompts: str  # "chat" | "copy"
    mlx_lm: Side | None
    tandem: Side | None
    note: str = ""


@dataclass
class Row:
    """One configuration's result (JSON-ready: `asdict`)."""

    name: str
    group: str
    batch: int
    prompts: str
    mlx_lm: str | None
    tandem: str | None
    mlx_lm_tps: float | None = None
    tandem_tps: float | None = None
    ratio: float | None = None  # tandem / mlx-lm
    acceptance: float | None = None  # tandem's accepted / drafted tokens
    tokens_per_forward: float | None = None  # tandem's tokens per target forward
    skipped: bool = False
    note: str = ""


@dataclass
class Summary:
    tps: float
    acceptance: float | None
    tokens_per_forward: float | None


# --- the two sides' work ------------------------------------------------------------


@contextmanager
def eos_ignored(model: LoadedModel) -> Iterator[None]:
    """mlx-lm stops at the tokenizer's EOS ids: none while the bench runs its side."""
    saved = set(model.tokenizer.eos_token_ids)
    model.tokenizer.eos_token_ids = set()
    try:
        yield
    finally:
        model.tokenizer.eos_token_ids = saved


def mlx_lm_alone(model: LoadedModel, prompts: list[list[int]], draft: bool, k: int) -> Work:
    """mlx-lm `stream_generate`, each prompt alone in turn (draft: the model drafts itself)."""
    from mlx_lm.generate import stream_generate

    extra: dict[str, Any] = {"draft_model": model.model, "num_draft_tokens": k} if draft else {}

    def work(n: int) -> Measured:
        seconds, tokens = 0.0, 0
        with eos_ignored(model):
            for prompt in prompts:
                start = time.perf_counter()
                out = [r.token for r in stream_generate(
                    model.model, model.tokenizer, prompt, max_tokens=n, **extra)]
                seconds += time.perf_counter() - start
                tokens += len(out)
        return Measured(seconds, tokens)

    return work


def mlx_lm_batch(model: LoadedModel, prompts: list[list[int]]) -> Work:
    """mlx-lm `batch_generate` over all prompts at once."""
    from mlx_lm.generate import batch_generate

    def work(n: int) -> Measured:
        with eos_ignored(model):
            start = time.perf_counter()
            out = batch_generate(model.model, model.tokenizer, prompts, max_tokens=n,
                                 return_token_ids=True)
            seconds = time.perf_counter() - start
        return Measured(seconds, sum(len(t) for t in out.token_ids or []))

    return work


def tandem_plain(model: LoadedModel, prompts: list[list[int]]) -> Work:
    """tandem's plain path (`engine.generate`), each prompt alone in turn."""

    def work(n: int) -> Measured:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        seconds, tokens = 0.0, 0
        for prompt in prompts:
            start = time.perf_counter()
            result = generate(model, prompt, params)
            seconds += time.perf_counter() - start
            tokens += len(result.tokens)
        return Measured(seconds, tokens)

    return work


def tandem_rows(engine: EngineCore, prompts: list[list[int]], alone: bool) -> Work:
    """The rows engine: every prompt submitted at once (or each alone, in turn)."""

    def work(n: int) -> Measured:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        total = Measured(0.0, 0)
        for group in ([p] for p in prompts) if alone else [prompts]:
            start = time.perf_counter()
            handles = [engine.submit(p, params) for p in group]
            engine.run_until_idle()
            total.seconds += time.perf_counter() - start
            for handle in handles:
                result = handle.result()
                if result.finish_reason == "error":
                    raise RuntimeError(f"bench request failed: {result.error}")
                total.tokens += len(result.tokens)
                if result.stats is not None:
                    total.drafted += result.stats.drafted
                    total.accepted += result.stats.accepted
                    total.steps += result.stats.steps
        return total

    return work


# --- engines and the plan -----------------------------------------------------------


@dataclass
class Engines:
    """Every engine the plan uses, built before any clock starts; None + a note if unbuildable."""

    plain: EngineCore
    drafting: dict[str, EngineCore | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


DRAFTERS = ("self-draft", "ngram", "assistant")


def build_engines(model: LoadedModel, settings: BenchSettings) -> Engines:
    config = RuntimeConfig.resolve(max_rows=settings.max_rows)
    engines = Engines(EngineCore(model, config))
    for name in DRAFTERS:
        try:
            if name == "self-draft":  # the target's own name: factory drafts with the target
                drafter = build_drafter(model.name, model, config)
                depth = build_depth("fixed", settings.draft_tokens)
            else:
                drafter = build_drafter(name, model, config)
                depth = build_depth(settings.draft_depth, settings.draft_tokens)
            engines.drafting[name] = EngineCore(model, config, drafter=drafter, depth=depth)
        except ValueError as err:
            engines.drafting[name] = None
            engines.notes[name] = str(err)
    return engines


def take(prompts: list[list[int]], count: int) -> list[list[int]]:
    """The first `count` prompts, cycling when there are fewer."""
    return [prompts[i % len(prompts)] for i in range(count)]


def plan(
    model: LoadedModel, engines: Engines, settings: BenchSettings, chat: list[list[int]],
    copy: list[list[int]],
) -> list[Configuration]:
    """The configurations, in table order (`chat`/`copy`: chat-templated prompt ids)."""
    k = settings.draft_tokens
    sets = {"chat": chat, "copy": copy}

    def mlx_side(kind: str, batch: int) -> Side:
        prompts = take(sets[kind], settings.alone if batch == 1 else batch)
        if batch == 1:
            return Side(f"mlx-lm {kind} B=1", "stream_generate",
                        mlx_lm_alone(model, prompts, False, k))
        return Side(f"mlx-lm {kind} B={batch}", "batch_generate", mlx_lm_batch(model, prompts))

    def rows_side(name: str, engine: EngineCore, kind: str, batch: int, label: str) -> Side:
        prompts = take(sets[kind], settings.alone if batch == 1 else batch)
        return Side(f"tandem {name} {kind} B={batch}", label,
                    tandem_rows(engine, prompts, alone=batch == 1), speculative=name != "plain")

    one = take(chat, settings.alone)
    configs = [
        Configuration("plain B=1, plain path", "plain", 1, "chat", mlx_side("chat", 1),
                      Side("tandem plain-path chat B=1", "plain path", tandem_plain(model, one))),
        Configuration("plain B=1, rows engine", "plain", 1, "chat", mlx_side("chat", 1),
                      rows_side("plain", engines.plain, "chat", 1, "rows engine")),
    ]
    for b in settings.batches:
        configs.append(Configuration(f"batched B={b}", "batched", b, "chat", mlx_side("chat", b),
                                     rows_side("plain", engines.plain, "chat", b, "rows engine")))
    self_draft = engines.drafting["self-draft"]
    if self_draft is None:
        configs.append(Configuration("self-draft B=1", "speculative", 1, "chat", None, None,
                                     engines.notes["self-draft"]))
    else:
        mlx = Side("mlx-lm self-draft chat B=1", f"stream_generate(draft_model=self, k={k})",
                   mlx_lm_alone(model, one, True, k))
        configs.append(Configuration(
            "self-draft B=1", "speculative", 1, "chat", mlx,
            rows_side("self-draft", self_draft, "chat", 1, f"rows engine + self-draft, k={k}")))
    cases = [("ngram", "copy"), ("ngram", "chat"), ("assistant", "chat")]
    for b in settings.spec_batches:
        for drafter, kind in cases:
            name = f"{drafter} {kind} B={b}"
            engine = engines.drafting[drafter]
            if engine is None:
                configs.append(Configuration(name, "speculative", b, kind, None, None,
                                             engines.notes[drafter]))
                continue
            label = f"rows engine + {drafter}, {settings.draft_depth} k<={k}"
            configs.append(Configuration(name, "speculative", b, kind, mlx_side(kind, b),
                                         rows_side(drafter, engine, kind, b, label)))
    return configs


# --- measuring ----------------------------------------------------------------------


def summarize(runs: list[Measured], speculative: bool) -> Summary:
    drafted = sum(r.drafted for r in runs)
    steps = sum(r.steps for r in runs)
    return Summary(
        tps=statistics.median(r.tps for r in runs),
        acceptance=sum(r.accepted for r in runs) / drafted if speculative and drafted else None,
        tokens_per_forward=sum(r.tokens for r in runs) / steps if speculative and steps else None,
    )


def measure(config: Configuration, settings: BenchSettings, done: dict[str, Summary]) -> Row:
    """Time the configuration's sides not measured yet (`done`, by key), one row of results."""
    row = Row(config.name, config.group, config.batch, config.prompts,
              config.mlx_lm.label if config.mlx_lm else None,
              config.tandem.label if config.tandem else None, note=config.note)
    if config.mlx_lm is None or config.tandem is None:
        row.skipped = True
        return row
    sides = [s for s in (config.mlx_lm, config.tandem) if s.key not in done]
    for side in sides:
        side.work(min(WARMUP_TOKENS, settings.tokens))
    runs: dict[str, list[Measured]] = {s.key: [] for s in sides}
    for _ in range(settings.repeats):
        for side in sides:  # alternate, so drift in the machine hits both sides alike
            runs[side.key].append(side.work(settings.tokens))
    for side in sides:
        done[side.key] = summarize(runs[side.key], side.speculative)
    ref, ours = done[config.mlx_lm.key], done[config.tandem.key]
    row.mlx_lm_tps, row.tandem_tps = ref.tps, ours.tps
    row.ratio = ours.tps / ref.tps if ref.tps > 0 else None
    row.acceptance, row.tokens_per_forward = ours.acceptance, ours.tokens_per_forward
    return row


def encode_prompts(model: LoadedModel) -> tuple[list[list[int]], list[list[int]]]:
    """(chat, copy) prompt ids through the model's chat template, the same for both sides."""
    return [model.encode(p) for p in CHAT_PROMPTS], [model.encode(p) for p in COPY_PROMPTS]
