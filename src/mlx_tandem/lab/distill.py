"""`tandem distill`: corpus -> draft vocabulary -> a new assistant -> training -> a folder.

Every stage resumes: the corpus file is appended batch by batch, training
checkpoints into the output folder, and the final assistant (float16
safetensors + config.json with the command and seed that made it) is written
where `--draft-model PATH` (or `--draft-model assistant`, for the default
folder) loads it.

Oracle: tests/test_lab.py (a tiny target's distill run writes a folder that
loads, drafts, and beats its untrained start on held-out acceptance).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from mlx_tandem.lab.bench import machine
from mlx_tandem.lab.corpus import (
    Sample,
    build_corpus,
    dataset_replies,
    mtbench_first_turns,
    read_corpus,
    sharegpt_pairs,
    split_prompts,
)
from mlx_tandem.lab.self_prompts import self_prompts
from mlx_tandem.lab.train import TrainConfig, Trainer, acceptance, batches, expected_tokens
from mlx_tandem.models.assistant import (
    FULL,
    SLIDING,
    Assistant,
    AssistantConfig,
    save_assistant,
    target_layer_windows,
)
from mlx_tandem.models.catalogue import tandem_home
from mlx_tandem.models.loader import LoadedModel

FULL_VOCAB_BELOW = 0.995  # reply coverage under which training checks argmaxes on the full head
PROMPT_SOURCES = ("sharegpt", "self")


@dataclass
class DistillOptions:
    layers: int = 2
    width: int = 384
    intermediate: int = 1024
    vocab: int = 8192
    prompts: int = 4000
    prompt_source: str = "sharegpt"  # or "self": prompts the target writes (self_prompts.py)
    first_prompt: int = 0  # > 0: the corpus starts here (earlier prompts trained --init)
    max_tokens: int = 256
    data_minutes: float = 15.0
    dataset_replies: int = 0  # ShareGPT's own replies to other prompts, added to training
    init: Path | None = None  # start from this trained assistant (its shape and vocabulary)
    train: TrainConfig = field(default_factory=TrainConfig)
    command: str = ""


def default_folder(target_name: str) -> Path:
    return tandem_home() / "assistants" / target_name


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int) -> tuple[list[int], float]:
    """The `size` most frequent reply tokens (ties by id), sorted; and their reply coverage."""
    counts = Counter(t for s in samples for t in s.response)
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(top) < size:  # pad with the lowest unused ids so the head has a fixed size
        used = set(top)
        top += [t for t in range(vocab_size) if t not in used][: size - len(top)]
    return sorted(top), vocab_coverage(samples, top)


def vocab_coverage(samples: list[Sample], vocab: list[int]) -> float:
    """The share of reply tokens inside `vocab`."""
    inside = set(vocab)
    total = sum(len(s.response) for s in samples)
    return sum(t in inside for s in samples for t in s.response) / max(total, 1)


def initial_assistant(target: LoadedModel, folder: Path) -> Assistant:
    """A trained tandem assistant to continue training (float32), checked against `target`."""
    from mlx_tandem.models.assistant_folder import load_assistant

    model = load_assistant(folder)
    cfg = model.config
    if cfg.model_type != "tandem_assistant" or cfg.head != "target":
        raise ValueError(f"--init {folder}: only a tandem assistant with the target's head "
                         f"rows can continue training (got {cfg.model_type}, head {cfg.head})")
    if cfg.backbone_hidden_size != int(target.config["hidden_size"]):
        raise ValueError(f"--init {folder}: made for a {cfg.backbone_hidden_size}-wide target, "
                         f"{target.name} is {target.config['hidden_size']} wide")
    return model


def new_assistant(target: LoadedModel, opts: DistillOptions, vocab: list[int]) -> Assistant:
    """An untrained assistant shaped for `target` (query heads and head size of its layers)."""
    cfg = target.config
    B = int(cfg["hidden_size"])
    attn = target.model.layers[-1].self_attn
    heads = int(cfg.get("num_attention_heads") or attn.n_heads)
    head_dim = int(cfg.get("head_dim") or B // heads)
    windows = target_layer_windows(target.model)
    kinds = [FULL] * opts.layers
    if any(w is not None for w in windows):  # sliding targets: sliding layers, then one full
        kinds = [SLIDING] * (opts.layers - 1) + [FULL]
    gemma = str(cfg.get("model_type", "")).startswith("gemma")
    scale = float(mx.array(B**0.5, mx.bfloat16).astype(mx.float32).item()) if gemma else 1.0
    config = AssistantConfig(
        backbone_hidden_size=B,
        hidden_size=opts.width,
        intermediate_size=opts.intermediate,
        num_attention_heads=heads,
        head_dim=head_dim,
        layer_types=kinds,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        norm_offset=1.0 if gemma else 0.0,
        activation="gelu_approx" if gemma else "silu",
        q_norm=hasattr(attn, "q_norm"),
        embed_scale=scale,
        head="target",
        draft_vocab_size=len(vocab),
        out_norm=True,
        target=target.name,
    )
    model = Assistant(config)
    model.draft_vocab = mx.array(vocab, dtype=mx.int32)
    model.out_norm.weight = mx.array(target.model.model.norm.weight).astype(mx.float32)
    _scale_init(model)
    mx.eval(model.parameters())
    return model


def _scale_init(model: Assistant) -> None:
    """Residual-branch outputs start small so the untrained net is a gentle perturbation."""
    for layer in model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight = proj.weight * (1.0 / math.sqrt(2 * len(model.layers)))


def distill(
    target: LoadedModel,
    out: Path,
    opts: DistillOptions,
    *,
    prompts: list[str] | None = None,
    say: Callable[[str], None] = print,
    report: Callable[[dict], None] | None = None,
) -> dict:
    """Run every stage for `target`, writing `out`; returns the summary saved with it."""
    if not 0 <= opts.first_prompt < opts.prompts:
        raise ValueError(f"first prompt {opts.first_prompt} must be in 0 .. {opts.prompts - 1} "
                         f"(below --prompts {opts.prompts})")
    if opts.prompt_source not in PROMPT_SOURCES:
        raise ValueError(f"prompt source {opts.prompt_source!r}: choose one of {PROMPT_SOURCES}")
    if opts.dataset_replies and (prompts is not None or opts.prompt_source != "sharegpt"):
        raise ValueError("dataset_replies needs ShareGPT's replies: leave `prompts` unset and "
                         "the prompt source 'sharegpt'")
    # a bad --init fails before any work: no corpus answered, no folder written
    model = initial_assistant(target, opts.init) if opts.init is not None else None
    out.mkdir(parents=True, exist_ok=True)
    corpus_path = out / "corpus.jsonl"
    replies: dict[str, str] = {}
    extra: list[Sample] = []
    data_start = time.perf_counter()
    if prompts is None:  # never the benchmark's questions, whichever the source
        exclude = frozenset(mtbench_first_turns(tandem_home() / "data"))
        if opts.prompt_source == "self":
            prompts = self_prompts(
                target, out / "prompts.jsonl", opts.prompts, seed=opts.train.seed,
                seconds=opts.data_minutes * 60, exclude=exclude,
                progress=lambda n: say(f"prompts: {n} written by the target"),
            )
        else:
            pairs = sharegpt_pairs(exclude)
            replies = dict(pairs)
            prompts, _ = split_prompts([p for p, _ in pairs], opts.train.seed)
    say(f"corpus: {len(read_corpus(corpus_path))} answers so far in {corpus_path}")
    samples = build_corpus(
        target, prompts, corpus_path, max_tokens=opts.max_tokens, answers=opts.prompts,
        first=opts.first_prompt,
        seconds=opts.data_minutes * 60 - (time.perf_counter() - data_start),
        progress=lambda n, made: say(f"corpus: {n} prompts answered (+{made} tokens)"),
    )
    say(f"corpus: {len(samples)} answers to prompts {opts.first_prompt} .. {opts.prompts - 1} "
        "of the order train this run")
    if len(samples) < 2:
        raise RuntimeError(f"the corpus at {corpus_path} has {len(samples)} answers; need >= 2")
    order = list(samples)
    random.Random(opts.train.seed).shuffle(order)
    cut = max(1, len(order) // 20)
    held, train = order[:cut], order[cut:]
    if model is not None:  # continuing: its vocabulary, not the corpus's most frequent
        vocab = model.draft_vocab.tolist()
        coverage = vocab_coverage(train, vocab)
    else:
        vocab, coverage = draft_vocabulary(train, opts.vocab, target.graph.vocab_size)
    say(f"draft vocabulary: {len(vocab)} tokens cover {coverage:.1%} of reply tokens")
    if opts.dataset_replies:  # other train-split prompts than the corpus's (held-out stays clean)
        extra = dataset_replies(
            target, [(p, replies.get(p, "")) for p in prompts], opts.dataset_replies,
            max_tokens=opts.max_tokens, skip=frozenset(tuple(s.prompt) for s in samples),
        )
        train = train + extra
        say(f"dataset replies: {len(extra)} ({sum(len(s.response) for s in extra)} tokens) "
            "join training, teacher-forced")
    if model is None:
        mx.random.seed(opts.train.seed)  # the initial weights
        model = new_assistant(target, opts, vocab)
    trainer = Trainer(model, target, opts.train, out)
    trainer.full_vocab = coverage < FULL_VOCAB_BELOW
    if trainer.load_checkpoint():
        say(f"resuming at step {trainer.step} ({trainer.elapsed / 60:.1f} min done)")
    start_step = trainer.step
    prior = dict(model.config.extra) if opts.init is not None else {}
    held_batches = [(b, trainer.features(b)) for b in batches(held, opts.train, random.Random(1))]
    start_alpha = acceptance(model, target, trainer.donors, held_batches, opts.train.depth)
    alpha = trainer.run(train, held_batches, report)
    tokens = sum(len(s.response) for s in train)
    summary = {
        "target": target.name,
        "command": opts.command,
        "seed": opts.train.seed,
        "machine": machine(),  # where it trained: the device and MLX version
        "train_answers": len(train),
        "train_reply_tokens": tokens,
        "dataset_replies": len(extra),
        "dataset_reply_tokens": sum(len(s.response) for s in extra),
        "held_out_answers": len(held),
        "vocab_coverage": coverage,
        "steps": trainer.step,
        "minutes": trainer.elapsed / 60,
        "held_out_alpha": alpha,
        "held_out_tokens_per_forward": expected_tokens(alpha),
        "start_step": start_step,  # > 0: this run resumed a checkpoint
        "init": str(opts.init) if opts.init else None,  # the assistant this run started from
        "init_steps": prior.get("steps", 0) + prior.get("init_steps", 0),
        "start_alpha": start_alpha,  # held-out acceptance when this run started
        "options": {k: v for k, v in asdict(opts).items() if k != "command"},
    }
    summary["options"]["init"] = summary["init"]
    model.config.extra = summary
    save_assistant(model, out)
    return summary
