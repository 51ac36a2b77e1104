"""Google's Gemma 4 assistant checkpoints (models/gemma4_assistant) drafting for Gemma 4 targets.

Real checkpoints cannot be downloaded here, so tiny random mlx-lm `gemma4_text` targets and
tiny `gemma4_assistant` folders (config.json + safetensors with the real tensor names, shaped
as the documented configs) stand in. The references are numpy transcriptions of SPEC_REFERENCE
§1, reading the checkpoint's tensors by their own names.

The rows engine cannot run KV-shared Gemma 4 targets (E2B/E4B): mlx-lm runs their shared
layers' attention with no cache, which the row caches' routing refuses. Engine tests use
targets without KV sharing (per-layer inputs on); donor choice on a KV-sharing target is
tested at the binding level.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlx_tandem import SamplingParams
from mlx_tandem.drafters import assistant as assistant_source
from mlx_tandem.drafters.assistant import AssistantSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.models import assistant as assistant_model
from mlx_tandem.models.assistant import (
    FULL,
    SLIDING,
    DonorLayer,
    bind_target,
)
from mlx_tandem.models.assistant_folder import is_assistant_folder, load_assistant
from mlx_tandem.models.gemma4_assistant import CentroidHead
from mlx_tandem.models.loader import LoadedModel, load_folder
from mlx_tandem.models.tiny import make_tiny_model

from conftest import run_with_gaps

B, D, HEADS, HEAD_DIM, GLOBAL_HEAD_DIM, WINDOW = 64, 32, 4, 16, 32, 16
CLUSTERS, TOP_K = 20, 4
TYPES = [SLIDING, SLIDING, SLIDING, FULL]  # the released drafters' layout


# --- tiny checkpoints ------------------------------------------------------------------
def assistant_config(vocab: int, ordered: bool, global_head_dim: int) -> dict:
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": B,
        "use_ordered_embeddings": ordered,
        "num_centroids": CLUSTERS,
        "centroid_intermediate_top_k": TOP_K,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": D,
            "intermediate_size": 64,
            "num_hidden_layers": len(TYPES),
            "num_attention_heads": HEADS,
            "num_key_value_heads": 2,
            "head_dim": HEAD_DIM,
            "global_head_dim": global_head_dim,
            "layer_types": TYPES,
            "sliding_window": WINDOW,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab,
            "num_kv_shared_layers": len(TYPES),
            "hidden_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "final_logit_softcapping": 30.0,
        },
    }


def checkpoint_tensors(
    vocab: int, ordered: bool, global_head_dim: int, seed: int, copy_from: np.ndarray | None
) -> dict[str, np.ndarray]:
    """Random tensors under the checkpoint's names. `copy_from` (the target's embedding
    table) makes a drafter that mostly predicts its input token again."""
    rng = np.random.default_rng(seed)

    def lin(out: int, inp: int) -> np.ndarray:
        return rng.normal(0.0, inp**-0.5, (out, inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.normal(size=n)).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.normal(size=(vocab, D))}
    t["pre_projection.weight"] = lin(D, 2 * B)
    if copy_from is not None:  # pass the token embedding's first D dims straight through
        t["model.embed_tokens.weight"] = copy_from[:, :D] / np.abs(copy_from).mean()
        t["pre_projection.weight"] = np.concatenate(
            [np.eye(D, B), 0.02 * t["pre_projection.weight"][:, B:]], axis=1
        )
    t["post_projection.weight"] = lin(B, D)
    t["model.norm.weight"] = norm(D)
    for i, kind in enumerate(TYPES):
        p, hd = f"model.layers.{i}.", global_head_dim if kind == FULL else HEAD_DIM
        for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[f"{p}{n}_layernorm.weight"] = norm(D)
        if copy_from is not None:  # layers add to the copied token: it is sometimes lost
            for n in ("post_attention", "post_feedforward"):
                t[f"{p}{n}_layernorm.weight"] *= 0.7
        t[p + "self_attn.q_proj.weight"] = lin(HEADS * hd, D)
        t[p + "self_attn.o_proj.weight"] = lin(D, HEADS * hd)
        t[p + "self_attn.q_norm.weight"] = norm(hd)
        t[p + "mlp.gate_proj.weight"] = lin(64, D)
        t[p + "mlp.up_proj.weight"] = lin(64, D)
        t[p + "mlp.down_proj.weight"] = lin(D, 64)
        t[p + "layer_scalar"] = rng.uniform(0.5, 1.5, (1,))
    t["lm_head.weight"] = t["model.embed_tokens.weight"]  # tied: dropped on load
    if ordered:
        order = rng.permutation(vocab)
        clusters = t["model.embed_tokens.weight"][order].reshape(CLUSTERS, -1, D)
        t["masked_embedding.centroids.weight"] = clusters.mean(axis=1)
        t["masked_embedding.token_ordering"] = order.astype(np.int64)
    return {
        k: v if k == "masked_embedding.token_ordering" else v.astype(np.float32)
        for k, v in t.items()
    }


def write_assistant(
    folder: Path, vocab: int, *, ordered: bool = True, global_head_dim: int = GLOBAL_HEAD_DIM,
    seed: int = 0, copy_from: np.ndarray | None = None, drop: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    tensors = checkpoint_tensors(vocab, ordered, global_head_dim, seed, copy_from)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = assistant_config(vocab, ordered, global_head_dim)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    kept = {k: mx.array(v) for k, v in tensors.items() if not k.startswith(drop)}
    mx.save_safetensors(str(folder / "model.safetensors"), kept)
    return tensors


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma4")


@pytest.fixture(scope="module")
def target(root: Path) -> LoadedModel:
    return load_folder(make_tiny_model("gemma4_text", root / "target"), "tiny-gemma4")


@pytest.fixture(scope="module")
def tied_target(root: Path) -> LoadedModel:
    """Tied head: greedy decoding repeats the last token, which a copying drafter predicts."""
    folder = make_tiny_model("gemma4_text", root / "tied", seed=1, tie_word_embeddings=True)
    return load_folder(folder, "tiny-gemma4-tied")


@pytest.fixture(scope="module")
def centroid_folder(root: Path, target: LoadedModel) -> tuple[Path, dict[str, np.ndarray]]:
    folder = root / "assistant-centroid"
    return folder, write_assistant(folder, target.graph.vocab_size)


# --- the engine --------------------------------------------------------------------------
def prompts_of(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 24))] for _ in range(n)]


def engine_run(target, prompts, params, source=None, depth=None, max_rows=8):
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=max_rows)
    engine = EngineCore(target, config, drafter=source, depth=depth)
    return [r.tokens for r in run_with_gaps(engine, prompts, params, len(prompts))], engine


def test_tiny_gemma4_target_rows_batched_equal_alone(target: LoadedModel) -> None:
    prompts = prompts_of(5, seed=1)
    params = [SamplingParams(max_tokens=10) for _ in prompts]
    batched, _ = engine_run(target, prompts, params)
    alone = [engine_run(target, [p], [sp], max_rows=1)[0][0] for p, sp in zip(prompts, params, strict=True)]
    assert batched == alone
    assert len({t for row in batched for t in row}) > 10  # not a degenerate repeat


def test_kv_sharing_targets_are_refused_by_the_rows_engine(root: Path) -> None:
    shared = load_folder(
        make_tiny_model("gemma4_text", root / "kv-shared", num_kv_shared_layers=2), "shared"
    )
    with pytest.raises(ValueError, match="NoneType cache"):
        EngineCore(shared, RuntimeConfig.resolve(environ={}, max_rows=2))


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("case", ["centroid", "dense", "copying"])
def test_greedy_speculation_equals_plain(root, target, tied_target, case, depth) -> None:
    tgt = tied_target if case == "copying" else target
    folder = root / f"assistant-{case}"
    if not folder.exists():
        embed = np.array(tgt.model.model.embed_tokens.weight) if case == "copying" else None
        write_assistant(folder, tgt.graph.vocab_size, ordered=case != "dense", seed=2,
                        copy_from=embed)
    assert is_assistant_folder(folder)
    prompts = prompts_of(7, seed=depth)
    params = [SamplingParams(max_tokens=8 + i % 5) for i in range(len(prompts))]
    plain, _ = engine_run(tgt, prompts, params)
    got, engine = engine_run(tgt, prompts, params, AssistantSource(load_assistant(folder), tgt),
                             FixedDepth(depth))
    assert got == plain
    assert engine.stats.drafted["assistant"] > 0
    if case == "copying":  # a real accept/reject mix through the verify path
        assert 0.3 < engine.stats.acceptance("assistant") < 0.95


def test_seeded_sampled_drafts_batched_equal_alone(target, centroid_folder) -> None:
    folder, _ = centroid_folder
    prompts = prompts_of(4, seed=9)
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=50 + i) for i in range(4)]

    def run(ps, sps):
        source = AssistantSource(load_assistant(folder), target, "sample")
        return engine_run(target, ps, sps, source, FixedDepth(2))[0]

    batched = run(prompts, params)
    assert batched == [run([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]


# --- numpy references of the documented algorithm ---------------------------------------
def centroid_reference(n: np.ndarray, t: dict[str, np.ndarray]) -> np.ndarray:
    """SPEC §1 centroid head for one normed hidden n (D,): full-vocab logits, -inf elsewhere."""
    emb = t["model.embed_tokens.weight"].astype(np.float64)
    top = np.argsort(-(t["masked_embedding.centroids.weight"] @ n))[:TOP_K]
    ids = t["masked_embedding.token_ordering"].reshape(CLUSTERS, -1)[top].ravel()
    out = np.full(emb.shape[0], -np.inf)
    out[ids] = emb[ids] @ n
    return out


def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w


def rope(x: np.ndarray, pos: int, base: float, partial: float) -> np.ndarray:
    """Non-traditional RoPE on (..., d); only the first `partial` of the pairs rotate."""
    d = x.shape[-1]
    half, rotated = d // 2, int(d * partial) // 2
    ang = np.zeros(half)
    ang[:rotated] = pos * base ** (-np.arange(0, 2 * rotated, 2) / d)
    a, b = x[..., :half], x[..., half:]
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def reference_drafts(target, t, context, tokens, donors):
    """Per step, the draft distribution SPEC §1 gives: `context` committed except its last
    token (pending), then the drafts fed back; K/V from target layers `donors`[kind]."""
    cache = [KVCache() for _ in target.model.layers]
    hidden = target.model.model(mx.array([context[:-1]]), cache=cache)
    h = np.array(hidden[0, -1], np.float64)
    end = len(context) - 1
    kv = {}
    for kind, i in donors.items():
        k, v = (np.array(a[0, :, :end], np.float64) for a in (cache[i].keys, cache[i].values))
        # a sliding layer sees the last W - 1 committed keys (HF's sliding cache keeps as many)
        first = max(0, end - WINDOW + 1) if kind == SLIDING else 0
        kv[kind] = k[:, first:], v[:, first:]
    rope_params = target.model.args.rope_parameters
    table = np.array(target.model.model.embed_tokens.weight, np.float64)
    out = []
    for tok in tokens:
        x = t["pre_projection.weight"] @ np.concatenate([table[tok] * math.sqrt(B), h])
        for li, kind in enumerate(TYPES):
            p = f"model.layers.{li}."
            a = rms(x, t[p + "input_layernorm.weight"])
            q = rms((t[p + "self_attn.q_proj.weight"] @ a).reshape(HEADS, -1),
                    t[p + "self_attn.q_norm.weight"])
            rp = rope_params[kind]
            q = rope(q, end, rp["rope_theta"], rp.get("partial_rotary_factor", 1.0))
            k, v = kv[kind]
            rep = HEADS // k.shape[0]
            heads = []
            for hh in range(HEADS):
                s = k[hh // rep] @ q[hh]  # scale 1.0
                w = np.exp(s - s.max())
                heads.append((w / w.sum()) @ v[hh // rep])
            x = x + rms(t[p + "self_attn.o_proj.weight"] @ np.concatenate(heads),
                        t[p + "post_attention_layernorm.weight"])
            m = rms(x, t[p + "pre_feedforward_layernorm.weight"])
            g = t[p + "mlp.gate_proj.weight"] @ m
            g = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            m = t[p + "mlp.down_proj.weight"] @ (g * (t[p + "mlp.up_proj.weight"] @ m))
            x = (x + rms(m, t[p + "post_feedforward_layernorm.weight"])) * t[p + "layer_scalar"]
        n = rms(x, t["model.norm.weight"])
        h = t["post_projection.weight"] @ n
        logits = centroid_reference(n, t)
        out.append(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())
    return np.stack(out)


def test_centroid_head_equals_the_reference(centroid_folder, monkeypatch) -> None:
    folder, t = centroid_folder
    head = load_assistant(folder).centroid_head
    assert isinstance(head, CentroidHead)
    normed = np.random.default_rng(3).normal(size=(2, 3, D))

    def max_diff() -> float:
        got = np.array(head(mx.array(normed, mx.float32))[0], np.float64)
        worst = 0.0
        for idx in np.ndindex(2, 3):
            ref = centroid_reference(normed[idx], t)
            assert np.array_equal(np.isinf(got[idx]), np.isinf(ref))
            fin = np.isfinite(ref)
            assert fin.sum() == TOP_K * got.shape[-1] // CLUSTERS
            worst = max(worst, float(np.abs(got[idx][fin] - ref[fin]).max()))
        return worst

    assert max_diff() < 1e-4

    def ignores_selection(self, n):
        return (self.embedding @ n[..., None])[..., 0], None

    monkeypatch.setattr(CentroidHead, "__call__", ignores_selection)
    with pytest.raises(AssertionError):
        max_diff()


def engine_drafts_after_some_steps(target, folder, depth=3):
    prompts = prompts_of(5, seed=11)
    config = RuntimeConfig.resolve(environ={}, prefill_chunk=16, max_rows=8)
    source = AssistantSource(load_assistant(folder), target, "sample")
    engine = EngineCore(target, config, source, FixedDepth(depth))
    for i, p in enumerate(prompts):
        engine.submit(p, SamplingParams(max_tokens=40, temperature=1.0, seed=i))
    for _ in range(5):  # rows join at different lengths and move on
        engine.step()
    rows = engine.running
    assert [r.pending for r in rows] == [(r.prompt + r.tokens)[-1] for r in rows]
    assert engine.rows.ends == [len(r.prompt + r.tokens) - 1 for r in rows]
    drafts = engine.drafter.draft(rows, [depth] * len(rows), engine.rows)
    return [(r.prompt + r.tokens, d, np.array(q))
            for r, d, q in zip(rows, drafts.tokens, drafts.q, strict=True)]


def test_engine_drafts_equal_the_reference(target, centroid_folder, monkeypatch) -> None:
    """The engine's draft distributions (sampled mode, depth 3, rows at different ends)
    equal the numpy reference reading the last sliding (2) / full (3) target layers.
    Reading the other layer of each type (a wrong donor) breaks the equality."""
    folder, t = centroid_folder
    donors = {SLIDING: 2, FULL: 3}
    assert target.model.args.layer_types == [SLIDING, FULL, SLIDING, FULL]
    cases = engine_drafts_after_some_steps(target, folder)
    assert len(cases) >= 3 and len({len(c) for c, _, _ in cases}) > 1
    for context, drafts, q in cases:
        ref = reference_drafts(target, t, context, [context[-1], *drafts[:-1]], donors)
        assert np.abs(q - ref).max() < 1e-4

    def wrong_layer(assistant, model):
        return [DonorLayer(d.index - 2, d.rope, d.scale, d.window)
                for d in bind_target(assistant, model)]

    monkeypatch.setattr(assistant_source, "bind_target", wrong_layer)
    wrong = engine_drafts_after_some_steps(target, folder)
    assert any(
        np.abs(q - reference_drafts(target, t, c, [c[-1], *d[:-1]], donors)).max() > 1e-2
        for c, d, q in wrong
    )


# --- loading, config, binding -------------------------------------------------------------
def test_config_and_tensors_map_onto_the_assistant(root, target, centroid_folder) -> None:
    folder, t = centroid_folder
    net = load_assistant(folder)
    cfg = net.config
    assert (cfg.head, cfg.norm_offset, cfg.sandwich_norms, cfg.q_norm) == ("centroid", 0, True, True)
    assert (cfg.activation, cfg.attention_scale, cfg.embed_scale) == ("gelu_approx", 1.0, 8.0)
    assert [layer.self_attn.head_dim for layer in net.layers] == [16, 16, 16, 32]
    assert np.array_equal(np.array(net.layers[3].self_attn.q_proj.weight),
                          t["model.layers.3.self_attn.q_proj.weight"])
    assert np.array_equal(np.array(net.layers[1].layer_scalar), t["model.layers.1.layer_scalar"])
    assert net.centroid_head.token_ordering.dtype == mx.int32
    dense_folder = root / "assistant-dense-map"
    td = write_assistant(dense_folder, target.graph.vocab_size, ordered=False, seed=4)
    dense = load_assistant(dense_folder)
    assert dense.config.head == "dense" and "centroid_head" not in dense
    assert np.array_equal(np.array(dense.lm_head.weight), td["model.embed_tokens.weight"])


@pytest.mark.parametrize("drop", ["masked_embedding.", "model.layers.2.self_attn.q_norm"])
def test_a_checkpoint_missing_tensors_is_refused(root, target, drop) -> None:
    folder = root / f"missing-{drop}"
    write_assistant(folder, target.graph.vocab_size, drop=(drop,))
    with pytest.raises(ValueError, match="missing tensors") as err:
        load_assistant(folder)
    assert drop in str(err.value)
    if drop == "masked_embedding.":
        assert "masked_embedding.centroids.weight" in str(err.value)
        assert "masked_embedding.token_ordering" in str(err.value)


def test_a_query_width_unlike_the_donors_is_refused(root, target) -> None:
    folder = root / "narrow-global"
    write_assistant(folder, target.graph.vocab_size, global_head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="16-wide query heads but target layer 3"):
        AssistantSource(load_assistant(folder), target)


def test_donors_are_the_last_non_kv_shared_layers(root, centroid_folder) -> None:
    """On a KV-sharing target (E2B/E4B-like: layers 3..5 reuse earlier K/V), each assistant
    layer reads the K/V the target's own last layer of its type attends to: mlx-lm's
    `previous_kvs` names it (sliding -> 2, full -> 1; the last layers overall are 5 and 4)."""
    folder, _ = centroid_folder
    types = [SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING]
    shared = load_folder(make_tiny_model("gemma4_text", root / "shared6", num_hidden_layers=6,
                                         layer_types=types, num_kv_shared_layers=3), "shared6")
    model = shared.model
    donors = bind_target(load_assistant(folder), model)
    last = {kind: max(i for i, k in enumerate(types) if k == kind) for kind in (SLIDING, FULL)}
    expected = [model.model.previous_kvs[last[kind]] for kind in TYPES]
    assert expected == [2, 2, 2, 1]
    assert [d.index for d in donors] == expected
    assert [d.window for d in donors] == [WINDOW] * 3 + [None]
    assert all(d.rope is model.layers[d.index].self_attn.rope for d in donors)
    caches = model.make_cache()  # the banks the donors name hold K/V
    model(mx.array([[5, 6, 7]]), cache=caches)
    assert all(caches[d.index].offset == 3 for d in donors)

    def last_of_type(assistant, target):  # a binding that ignores KV sharing
        return [DonorLayer(last[kind], d.rope, d.scale, d.window)
                for kind, d in zip(TYPES, bind_target(assistant, target), strict=True)]

    wrong = last_of_type(load_assistant(folder), model)
    assert [d.index for d in wrong] != expected
    assert assistant_model.target_layer_windows(model) == [WINDOW, None, WINDOW]
