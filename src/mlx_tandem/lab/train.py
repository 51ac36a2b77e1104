"""Training an assistant drafter against a frozen target, "as it runs" (training-time test).

Features come from one plain forward of the frozen target over a batch of
sequences: its final hidden h_t, the K/V of the donor layers, and its logits.
For every anchor t at once, unrolled `depth` steps exactly as at inference:

    step 1 feeds (x_{t+1}, h_t); step j feeds (x_{t+j}, h_next of step j-1);
    every step queries position t+1 over the target's keys 0..t (sliding
    layers: the last `window` of them) — the committed context when x_{t+1}
    is the pending token;
    step j is scored against the target's distribution at t+j (the token
    x_{t+j+1}), renormalised over the draft vocabulary and kept as its TEACHER_TOP most
    likely tokens (renormalised again; computed once per batch with the features), by
    KL, weight 0.8^(j-1);
    anchors whose target argmax falls outside the draft vocabulary, and
    predicted tokens outside the assistant's reply, are masked.

Greedy acceptance on held-out sequences is measured the same way: per anchor,
how many consecutive steps' argmax equal the target's argmax — a target token
outside the draft vocabulary counting as a miss, as it is at inference.

Oracle: tests/test_lab.py (training lowers the loss and raises held-out
acceptance on a tiny target; a resumed run continues from its checkpoint; a token outside
the draft vocabulary is an acceptance miss).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache

from mlx_tandem.lab.corpus import Sample
from mlx_tandem.models.assistant import (
    Assistant,
    DonorLayer,
    bind_target,
    embed_tokens,
    target_head_rows,
)
from mlx_tandem.models.loader import LoadedModel

STEP_DECAY = 0.8
TEACHER_TOP = 64  # the teacher's distribution per position, truncated to its top tokens
KEEP = mx.float16  # cached features
BUCKET = 64  # sequence lengths are padded to multiples of this


@dataclass
class TrainConfig:
    depth: int = 3
    minutes: float = 40.0
    seed: int = 0
    lr: float = 1e-3
    min_lr: float = 5e-5
    warmup: int = 30
    batch_tokens: int = 2048
    max_len: int = 512
    clip: float = 0.5
    eval_every_s: float = 300.0
    checkpoint_every_s: float = 120.0
    max_steps: int = 0  # > 0: also stop after this many steps (tests: load-independent runs)


@dataclass
class Batch:
    ids: mx.array  # (N, T)
    reply: mx.array  # (N, T) bool: position holds a reply token


@dataclass
class Features:
    """What the frozen target gives one batch, computed once and kept (float16) across epochs."""

    hidden: mx.array  # (N, T, B) the target's final hidden
    donors: list[tuple[mx.array, mx.array]]  # per assistant layer: keys, values (N, Hkv, T, hd)
    inside: mx.array  # (N, T) the target's argmax is in the draft vocabulary
    argmax: mx.array  # (N, T) the target's argmax, as a draft-vocabulary index (if inside)
    top_ids: mx.array  # (N, T, TEACHER_TOP) the teacher's most likely draft-vocabulary indices
    top_p: mx.array  # (N, T, TEACHER_TOP) their probabilities, renormalised to sum to 1


@dataclass
class Teacher:
    """The target's head restricted to the draft vocabulary: its log-probs from a hidden."""

    vocab: mx.array  # (Vd,) target ids of the draft vocabulary
    rows: mx.array  # (Vd, B) the target's head rows for them
    softcap: float | None

    def log_probs(self, hidden: mx.array) -> mx.array:
        logits = hidden.astype(mx.float32) @ self.rows.T
        if self.softcap:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    @classmethod
    def of(cls, target: LoadedModel, vocab: mx.array) -> Teacher:
        cap = getattr(getattr(target.model, "args", None), "final_logit_softcapping", None)
        rows = target_head_rows(target.model, vocab).astype(mx.float32)
        return cls(vocab, rows, float(cap) if cap else None)


def batches(samples: list[Sample], cfg: TrainConfig, rng: random.Random) -> list[Batch]:
    """Samples in random order, grouped by similar length into ~batch_tokens each."""
    order = sorted(samples, key=lambda s: len(s.tokens) + rng.random() * 32)
    out, group = [], []
    for s in order:
        group.append(s)
        T = _bucket(max(len(g.tokens) for g in group), cfg.max_len)
        if len(group) * T >= cfg.batch_tokens:
            out.append(_pad(group, T))
            group = []
    if group:
        out.append(_pad(group, _bucket(max(len(g.tokens) for g in group), cfg.max_len)))
    rng.shuffle(out)
    return out


def _bucket(n: int, cap: int) -> int:
    return min(cap, -(-n // BUCKET) * BUCKET)


def _pad(group: list[Sample], T: int) -> Batch:
    ids = [(s.tokens + [0] * T)[:T] for s in group]
    reply = [([False] * len(s.prompt) + [True] * len(s.response) + [False] * T)[:T] for s in group]
    return Batch(mx.array(ids, dtype=mx.int32), mx.array(reply))


def target_features(
    target: LoadedModel,
    teacher: Teacher,
    donors: list[DonorLayer],
    batch: Batch,
    full_vocab: bool = True,
) -> Features:
    """The target's hiddens and donor K/V for a batch, and where its argmax falls. With
    `full_vocab=False` the full-vocabulary head is skipped (a sixth of the forward's cost
    on SmolLM2) and every argmax is taken inside the draft vocabulary — right when the
    vocabulary covers the replies (the lab reports the coverage)."""
    caches = [KVCache() for _ in target.model.layers]
    hidden = target.graph.forward_hidden(batch.ids, caches)
    logits = target.graph.project_logits(hidden, "all") if full_vocab else None
    sub = teacher.log_probs(hidden) if logits is None else logits[..., teacher.vocab]
    inside = (
        mx.ones(sub.shape[:2], mx.bool_)
        if logits is None
        else mx.max(sub, axis=-1) >= mx.max(logits, axis=-1)
    )
    T = batch.ids.shape[1]
    kv = [
        (caches[d.index].keys[:, :, :T].astype(KEEP), caches[d.index].values[:, :, :T].astype(KEEP))
        for d in donors
    ]
    top_ids = mx.argpartition(-sub, TEACHER_TOP - 1, axis=-1)[..., :TEACHER_TOP]
    top = mx.take_along_axis(sub, top_ids, axis=-1).astype(mx.float32)
    top_p = mx.softmax(top, axis=-1)  # renormalised over the kept tokens
    out = Features(hidden.astype(KEEP), kv, inside, mx.argmax(sub, axis=-1),
                   top_ids.astype(mx.int32), top_p)
    mx.eval(out.hidden, out.inside, out.argmax, out.top_ids, out.top_p,
            *[a for p in kv for a in p])
    return out


def _masks(donors: list[DonorLayer], A: int, T: int) -> list[mx.array]:
    """Per layer: anchor t (query position t+1) sees keys 0..t (and the window's last keys)."""
    rows, cols = mx.arange(A)[:, None], mx.arange(T)[None, :]
    out = []
    for d in donors:
        valid = cols <= rows
        if d.window is not None:
            valid = valid & (cols > rows + 1 - d.window)
        out.append(valid[None, None])
    return out


def _fused(q, k, v, scale, valid):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=valid)


def unroll(
    assistant: Assistant,
    target: LoadedModel,
    donors: list[DonorLayer],
    batch: Batch,
    feats: Features,
    depth: int,
) -> tuple[list[mx.array], list[mx.array]]:
    """Per draft step j: draft log-probs (N, A, Vd) and the anchors scored (N, A) bool."""
    T = batch.ids.shape[1]
    A = T - depth - 1
    masks = _masks(donors, A, T)
    dtype = assistant.pre_projection.weight.dtype
    kv = [(k.astype(dtype), v.astype(dtype), m) for (k, v), m in zip(feats.donors, masks, strict=True)]
    h = feats.hidden[:, :A].astype(dtype)
    logps, scored = [], []
    for j in range(1, depth + 1):
        e = embed_tokens(target.model, batch.ids[:, j : j + A], assistant.config.embed_scale)
        logits, h = assistant(e, h, kv, donors, 1, _fused)
        logps.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        scored.append(batch.reply[:, j + 1 : j + 1 + A] & feats.inside[:, j : j + A])
    return logps, scored


def loss_fn(assistant, target, donors, batch, feats, depth) -> mx.array:
    logps, scored = unroll(assistant, target, donors, batch, feats, depth)
    A = batch.ids.shape[1] - depth - 1
    total, weight = mx.array(0.0), 0.0
    for j, (lq, ok) in enumerate(zip(logps, scored, strict=True)):
        p = feats.top_p[:, j + 1 : j + 1 + A]
        picked = mx.take_along_axis(lq, feats.top_ids[:, j + 1 : j + 1 + A], axis=-1)
        kl = (p * (mx.log(mx.maximum(p, 1e-30)) - picked)).sum(-1)
        n = mx.maximum(ok.sum(), 1)
        total = total + STEP_DECAY**j * (kl * ok).sum() / n
        weight += STEP_DECAY**j
    return total / weight


def acceptance(
    assistant: Assistant,
    target: LoadedModel,
    donors: list[DonorLayer],
    data: list[tuple[Batch, Features]],
    depth: int,
) -> list[float]:
    """Greedy per-position acceptance on held-out batches: P(step j right | steps < j right).
    A target token outside the draft vocabulary is a miss, as at inference (the loss masks
    those anchors; counting them out here would overstate the drafter)."""
    right = [0.0] * depth
    reached = [0.0] * depth
    for batch, feats in data:
        logps, _ = unroll(assistant, target, donors, batch, feats, depth)
        A = batch.ids.shape[1] - depth - 1
        alive = mx.array(True)  # the anchors whose drafts so far were all right
        for j, lq in enumerate(logps):
            at = slice(j + 1, j + 1 + A)  # the target's next token after x_{t+j+1}
            valid = batch.reply[:, j + 2 : j + 2 + A]
            hit = (mx.argmax(lq, axis=-1) == feats.argmax[:, at]) & feats.inside[:, at] & valid
            reached[j] += float((alive & valid).sum())
            alive = alive & hit
            right[j] += float(alive.sum())
    return [r / max(n, 1.0) for r, n in zip(right, reached, strict=True)]


def expected_tokens(alpha: list[float]) -> float:
    """Tokens per target forward for a chain with per-position acceptance alpha: 1 + sum prod."""
    out, run = 1.0, 1.0
    for a in alpha:
        run *= a
        out += run
    return out


class Trainer:
    """The training loop: AdamW, warmup then cosine over the time budget, checkpoints."""

    def __init__(
        self,
        assistant: Assistant,
        target: LoadedModel,
        cfg: TrainConfig,
        folder: Path,
    ) -> None:
        self.assistant, self.target, self.cfg, self.folder = assistant, target, cfg, folder
        self.donors = bind_target(assistant, target.model)
        self.teacher = Teacher.of(target, assistant.draft_vocab)
        self.full_vocab = True  # see target_features
        self.opt = optim.AdamW(learning_rate=cfg.lr, betas=[0.9, 0.95], weight_decay=0.0)
        self.step, self.elapsed = 0, 0.0
        self.history: list[dict] = []
        self._grad = nn.value_and_grad(assistant, loss_fn)

    def lr(self) -> float:
        c = self.cfg
        if self.step < c.warmup:
            return c.lr * (self.step + 1) / c.warmup
        frac = min(1.0, self.elapsed / (c.minutes * 60))
        return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * frac))

    def features(self, batch: Batch) -> Features:
        return target_features(self.target, self.teacher, self.donors, batch, self.full_vocab)

    def train_step(self, batch: Batch, feats: Features) -> float:
        loss, grads = self._grad(
            self.assistant, self.target, self.donors, batch, feats, self.cfg.depth
        )
        grads, _ = optim.clip_grad_norm(grads, self.cfg.clip)
        self.opt.learning_rate = mx.array(self.lr())
        self.opt.update(self.assistant, grads)
        mx.eval(loss, self.assistant.parameters(), self.opt.state)
        self.step += 1
        return float(loss)

    def run(
        self,
        train: list[Sample],
        held_out: list[tuple[Batch, Features]],
        report: Callable[[dict], None] | None = None,
    ) -> list[float]:
        """Train until the time budget is spent (counting time from earlier, resumed runs).

        Batches are formed once (seeded); each epoch visits them in a new order, and the
        target's features of a batch are computed on its first visit and kept."""
        cfg = self.cfg
        rng = random.Random(cfg.seed + self.step)
        data = batches(train, cfg, random.Random(cfg.seed))
        cache: dict[int, Features] = {}
        start = time.perf_counter() - self.elapsed
        last_eval = last_ckpt = time.perf_counter()
        alpha: list[float] = []
        queue: list[int] = []
        while self.elapsed < cfg.minutes * 60 and not 0 < cfg.max_steps <= self.step:
            if not queue:
                queue = list(range(len(data)))
                rng.shuffle(queue)
            i = queue.pop()
            if i not in cache:
                cache[i] = self.features(data[i])
            loss = self.train_step(data[i], cache[i])
            self.elapsed = time.perf_counter() - start
            now = time.perf_counter()
            done = self.elapsed >= cfg.minutes * 60 or 0 < cfg.max_steps <= self.step
            evaluate = now - last_eval > cfg.eval_every_s or done
            if evaluate:
                alpha = acceptance(self.assistant, self.target, self.donors, held_out, cfg.depth)
                last_eval = time.perf_counter()
            entry = {"step": self.step, "loss": loss, "lr": self.lr(), "s": self.elapsed}
            if evaluate:
                entry["alpha"] = alpha
                entry["tokens_per_forward"] = expected_tokens(alpha)
            self.history.append(entry)
            if report is not None:
                report(entry)
            if now - last_ckpt > cfg.checkpoint_every_s:
                self.save_checkpoint()
                last_ckpt = time.perf_counter()
        self.save_checkpoint()
        return alpha

    # --- resumable state ------------------------------------------------------------
    def save_checkpoint(self) -> None:
        ckpt = self.folder / "checkpoint"
        ckpt.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(self.assistant.trainable_parameters()))
        mx.save_safetensors(str(ckpt / "weights.safetensors"), weights)
        state = {k: v for k, v in tree_flatten(self.opt.state) if isinstance(v, mx.array)}
        mx.save_safetensors(str(ckpt / "optimizer.safetensors"), state)
        meta = {"step": self.step, "elapsed": self.elapsed, "config": asdict(self.cfg),
                "history": self.history}
        (ckpt / "state.json").write_text(json.dumps(meta))

    def load_checkpoint(self) -> bool:
        ckpt = self.folder / "checkpoint"
        if not (ckpt / "state.json").is_file():
            return False
        self.assistant.load_weights(
            list(mx.load(str(ckpt / "weights.safetensors")).items()), strict=False
        )
        state = mx.load(str(ckpt / "optimizer.safetensors"))
        self.opt.init(self.assistant.trainable_parameters())
        self.opt.state = tree_unflatten(list(state.items()))
        meta = json.loads((ckpt / "state.json").read_text())
        self.step, self.elapsed, self.history = meta["step"], meta["elapsed"], meta["history"]
        return True
