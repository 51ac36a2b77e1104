"""MTP draft source: the target checkpoint's own multi-token-prediction layer drafts
(`--draft-model mtp`; the Qwen3-Next / Qwen3.5 layout, `mtp.*` tensors).

mlx-lm drops a checkpoint's `mtp.*` tensors when it loads the target; `load_mtp` reads
them from the target's folder and builds the head from mlx-lm's own classes: one
decoder layer of the target family (a full-attention layer: its attention, MLP or
mixture of experts) behind `fc(concat(norm_e(embed(token)), norm_h(hidden)))`, then
`norm`; logits come from the target's own head. Hugging Face stores these norms
zero-centred (as the backbone's, which mlx-lm's sanitize shifts by one) and experts
one by one (stacked here into mlx-lm's `switch_mlp`).

Per row the drafter keeps the head's own attention rows (a `StateRows` of one
layer, attention routed to row caches) and the seed hidden: the target's final
hidden at the last position the row fed, handed over by the engine. A round feeds
(seed, pending token), then its own output hidden with each draft, `depth` times,
drafting the argmax. On commit a row keeps the entries of its accepted tokens (by
end) and takes the new seed; a fully accepted last draft, never fed, is fed first
next round with the hidden that drafted it ("pending last"). The head holds no
prompt entries (only the target's last hidden is handed over at join); its RoPE is
relative, so positions counted from the row's first entry give the same scores.
Drafts are deterministic (argmax): the engine verifies them by each position's own
keyed sample, so output is the target's exactly (greedy: plain decoding's tokens;
seeded sampled rows: plain sampling's), whatever the drafts are.

Oracle: tests/test_mtp.py (a tiny qwen3_5 / qwen3_next checkpoint with `mtp.*`
tensors: the head's first draft equals a direct mlx-lm computation; greedy
speculation == plain at depths 1..6, rows joining and leaving; seeded sampled
rows == plain sampling; checkpoints without `mtp.*` are refused by name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlx_tandem.engine.draft_source import Drafts
from mlx_tandem.engine.request import Request
from mlx_tandem.kv.state_rows import PreparedChange, StateRows, rows_model
from mlx_tandem.models.loader import LoadedModel

LAYERS: dict[str, type] = {
    "qwen3_next": qwen3_next.Qwen3NextDecoderLayer,
    "qwen3_5": qwen3_5.DecoderLayer,
}


class MTPHead(nn.Module):
    """One MTP step: (token ids, hidden) -> the next hidden (normed; the target's head)."""

    def __init__(self, args: Any, layer_cls: type, embed: nn.Module) -> None:
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.embed_tokens = embed
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        full = args.full_attention_interval - 1  # an index whose layer is full attention
        self.layers = [layer_cls(args, full)]
        assert not self.layers[0].is_linear
        self.norm = nn.RMSNorm(H, eps=eps)

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def __call__(self, inputs: mx.array, cache: Any = None, hidden: mx.array | None = None
                 ) -> mx.array:  # fmt: skip
        e = self.pre_fc_norm_embedding(self.embed_tokens(inputs))
        h = mx.zeros_like(e) if hidden is None else self.pre_fc_norm_hidden(hidden)
        x = self.fc(mx.concatenate([e, h], axis=-1))
        c = None if cache is None else cache[0]
        x = self.layers[0](x, create_attention_mask(x, c), c)
        return self.norm(x)


def _text_args(model: nn.Module) -> Any:
    return getattr(model, "language_model", model).args


def mtp_tensors(folder: Path) -> dict[str, mx.array]:
    """The checkpoint's `mtp.*` tensors, keys without the prefix (only shards holding them)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / f for k, f in weight_map.items() if "mtp." in k})
        files += [f for f in folder.glob("*mtp*.safetensors") if f not in files]
    else:
        files = sorted(folder.glob("*.safetensors"))
    out: dict[str, mx.array] = {}
    for f in files:
        for k, v in mx.load(str(f)).items():
            if "mtp." in k:
                out[k.split("mtp.", 1)[1]] = v
    return out


def hf_to_mlx(weights: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """Zero-centred norms shifted by one; per-expert projections stacked into switch_mlp."""
    out: dict[str, mx.array] = {}
    for k, v in weights.items():
        if ".experts." in k and k.split(".experts.")[1].split(".")[0].isdigit():
            continue
        out[k] = v + 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v
    for k in weights:
        if k.endswith(".experts.0.up_proj.weight"):
            prefix = k.split(".experts.")[0]
            for n in ("up_proj", "down_proj", "gate_proj"):
                out[f"{prefix}.switch_mlp.{n}.weight"] = mx.stack(
                    [weights[f"{prefix}.experts.{e}.{n}.weight"] for e in range(num_experts)]
                )
    return out


def load_mtp(target: LoadedModel) -> MTPHead:
    """The target's MTP head, or ValueError naming what is missing."""
    family = str(target.config.get("model_type") or "")
    if family not in LAYERS:
        raise ValueError(
            f"--draft-model mtp needs a {' or '.join(LAYERS)} target; {target.name!r} is "
            f"{family or 'of unknown type'}"
        )
    weights = mtp_tensors(Path(target.path))
    if not weights:
        raise ValueError(
            f"{target.name!r} carries no mtp.* tensors (mlx-lm's conversions drop them; use "
            "the original checkpoint's safetensors)"
        )
    args = _text_args(target.model)
    head = MTPHead(args, LAYERS[family], target.graph.embedding)
    weights = hf_to_mlx(weights, int(getattr(args, "num_experts", 0) or 0))
    want = {k for k, _ in tree_flatten(head.parameters()) if not k.startswith("embed_tokens.")}
    missing, extra = sorted(want - set(weights)), sorted(set(weights) - want)
    if missing or extra:
        raise ValueError(
            f"{target.name!r}: mtp tensors do not match the {family} MTP layout "
            f"(missing {missing[:4]}, unexpected {extra[:4]})"
        )
    dtype = target.graph.embedding.weight.dtype
    head.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=False)
    mx.eval(head.parameters())
    return head


class MTPSource:
    samples = False  # argmax drafts: verified by each position's keyed sample
    stateless = False  # its rows hold entries of its own proposals (rewound by end)

    def __init__(self, target: LoadedModel) -> None:
        self.name = "mtp"
        self.head = load_mtp(target)
        self.net = rows_model(self.head)
        self.project = target.graph.project_logits
        self.rows: StateRows = StateRows.empty(self.head)
        self.seeds = mx.zeros((0, self.head.fc.weight.shape[0]), self.head.fc.weight.dtype)
        mx.eval(self.seeds)  # nothing lazy may cross into the engine's thread
        self.pending_last: list[tuple[int, mx.array] | None] = []
        self._drafts: list[list[int]] = []
        self._depth = 0
        self._last_hidden: mx.array | None = None

    def prepare_append(self, requests: list[Request], hidden: mx.array) -> PreparedChange:
        change = self.rows.prepare_append([StateRows.blank(self.head, len(requests))])

        def commit() -> None:
            change.commit()
            self.seeds = mx.concatenate([self.seeds, hidden.astype(self.seeds.dtype)])
            self.pending_last += [None] * len(requests)

        return PreparedChange(commit=commit, dispose=change.dispose)

    def filter_rows(self, keep: list[int]) -> None:
        self.rows.filter_rows(keep)
        self.seeds = self.seeds[mx.array(keep, dtype=mx.int32)] if keep else self.seeds[:0]
        self.pending_last = [self.pending_last[i] for i in keep]

    def _forward(self, ids: mx.array, hidden: mx.array, lengths: list[int]) -> mx.array:
        before = self.rows.ends
        out = self.net(ids, cache=self.rows.layers, hidden=hidden)
        self.rows.set_ends([e + n for e, n in zip(before, lengths, strict=True)], padding=True)
        return out

    def draft(self, requests: list[Request], depths: list[int], target: StateRows) -> Drafts:
        depth = max(depths, default=0)
        B = len(requests)
        self._depth = depth
        tokens, hiddens = [], []
        for i, (r, last) in enumerate(zip(requests, self.pending_last, strict=True)):
            seed = self.seeds[i : i + 1]
            if last is None:
                tokens.append([r.pending, 0])
                hiddens.append(mx.concatenate([seed, seed]))
            else:
                tokens.append([last[0], r.pending])
                hiddens.append(mx.concatenate([last[1], seed]))
        lengths = [1 if last is None else 2 for last in self.pending_last]
        width = max(lengths, default=1)
        ids = mx.array([t[:width] for t in tokens], dtype=mx.int32)
        hidden = mx.stack(hiddens)[:, :width]
        columns: list[mx.array] = []
        out = self._forward(ids, hidden, lengths)
        picks = mx.array([n - 1 for n in lengths], dtype=mx.int32)[:, None, None]
        g = mx.take_along_axis(out, picks, axis=1)  # (B, 1, H): each row's last real slot
        outs = []
        for step in range(depth):
            token = mx.argmax(self.project(g, "last")[:, -1], axis=-1).astype(mx.int32)
            columns.append(token)
            outs.append(g)
            if step + 1 < depth:
                g = self._forward(token[:, None], g, [1] * B)
        mx.eval(self.rows.arrays(), columns, outs)
        values = mx.stack(columns, axis=1).tolist() if columns else [[] for _ in requests]
        self._drafts = [row[:k] for row, k in zip(values, depths, strict=True)]
        self._last_hidden = outs[-1] if outs else None
        return Drafts(tokens=self._drafts, q=[None] * B)

    def commit(self, accepted: list[int], hidden: mx.array) -> None:
        depth, ends = self._depth, self.rows.ends
        later = max(0, depth - 1)  # entries fed after (seed, pending): d_1 .. d_{depth-1}
        self.rows.set_ends(
            [e - later + min(a, later) for e, a in zip(ends, accepted, strict=True)]
        )
        self.pending_last = [
            (self._drafts[i][-1], self._last_hidden[i : i + 1, 0])
            if self._last_hidden is not None and a == depth == len(self._drafts[i])
            else None
            for i, a in enumerate(accepted)
        ]
        self.seeds = hidden.astype(self.seeds.dtype)
        self._drafts, self._depth, self._last_hidden = [], 0, None
