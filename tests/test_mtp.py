"""`--draft-model mtp`: the target checkpoint's own MTP layer drafts (drafters/mtp.py), on tiny
qwen3_5 / qwen3_next checkpoints carrying random `mtp.*` tensors in Hugging Face's layout."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from mlx_tandem import SamplingParams
from mlx_tandem.cli.main import main
from mlx_tandem.drafters.mtp import LAYERS, MTPHead, MTPSource, _text_args
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.models.loader import LoadedModel, load_folder
from mlx_tandem.models.tiny import FAMILY_OVERRIDES, make_tiny_model

from conftest import run_with_gaps

ARCHS = tuple(LAYERS)
CFG = RuntimeConfig.resolve(environ={}, prefill_chunk=16)


def write_mtp(folder: Path, arch: str) -> None:
    """Random MTP tensors for the folder's model, as Hugging Face stores them: `mtp.` keys,
    zero-centred norms, one tensor per expert. (mlx-lm would not load a model*.safetensors
    holding them for a checkpoint whose experts are already stacked, so: mtp.safetensors.)"""
    m = load_folder(folder, arch)
    mx.random.seed(11)
    head = MTPHead(_text_args(m.model), LAYERS[arch], m.graph.embedding)
    hf: dict[str, mx.array] = {}
    for k, v in tree_flatten(head.parameters()):
        if k.startswith("embed_tokens."):
            continue
        if k.endswith("norm.weight") and v.ndim == 1:
            v = v - 1.0 + 0.1 * mx.random.normal(v.shape)
        if ".switch_mlp." in k:
            prefix, name = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                hf[f"mtp.{prefix}.experts.{e}.{name}"] = v[e]
        else:
            hf[f"mtp.{k}"] = v
    mx.save_safetensors(str(folder / "mtp.safetensors"), hf)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    cache: dict[str, LoadedModel] = {}

    def get(arch: str) -> LoadedModel:
        if arch not in cache:
            folder = make_tiny_model(arch, tmp_path_factory.mktemp(f"mtp-{arch}") / "m",
                                     **FAMILY_OVERRIDES.get(arch, {}))  # fmt: skip
            write_mtp(folder, arch)
            cache[arch] = load_folder(folder, arch)
        return cache[arch]

    return get


def workload(seed: int = 0, sampled: bool = False):
    rng = random.Random(seed)
    prompts, params = [], []
    for i, n in enumerate((1, 3, 6, 9, 14, 24)):
        base = [rng.randrange(3, 250) for _ in range(n)]
        prompts.append(base + base[:4] * 2)
        params.append(SamplingParams(max_tokens=rng.randrange(5, 10), temperature=0.9,
                                     top_k=40, seed=70 + i) if sampled
                      else SamplingParams(max_tokens=rng.randrange(5, 10)))  # fmt: skip
    return prompts, params


def run(m, prompts, params, drafter=None, depth=3, rows=16, seed=1):
    engine = EngineCore(m, CFG.with_(max_rows=rows), drafter=drafter,
                        depth=FixedDepth(depth) if drafter else None)  # fmt: skip
    return [r.tokens for r in run_with_gaps(engine, prompts, params, seed)], engine


@pytest.mark.parametrize("arch", ARCHS)
def test_the_drafts_are_the_heads_own_computation(mtp_model, arch):
    """Two rounds of one row, the first fully accepted: every draft equals the head run
    directly (mlx-lm's layer on a plain KVCache) over the entries the drafter should feed:
    (seed, pending), (g1, d1), then (g2, d2) -- the unfed last draft -- and (seed', pending')."""
    m = mtp_model(arch)
    src = MTPSource(m)
    H = src.head.fc.weight.shape[0]
    seed, seed2 = mx.random.normal((1, H), key=mx.random.key(1)), mx.random.normal((1, H))
    src.prepare_append([object()], seed).commit()
    drafts = src.draft([SimpleNamespace(pending=17)], [2], None).tokens[0]
    src.commit([2], seed2)
    third = src.draft([SimpleNamespace(pending=99)], [1], None).tokens[0]

    cache = [KVCache()]
    head, project = src.head, m.graph.project_logits

    def step(token: int, hidden: mx.array) -> tuple[int, mx.array]:
        g = head(mx.array([[token]]), cache=cache, hidden=hidden[None])
        return int(mx.argmax(project(g, "last")[0, -1]).item()), g[0]

    d1, g1 = step(17, seed)
    d2, g2 = step(d1, g1)
    assert drafts == [d1, d2]
    step(d2, g2)
    d3, g3 = step(99, seed2)
    assert third == [d3]
    assert src._last_hidden is not None
    assert mx.allclose(src._last_hidden[0], g3, atol=1e-4).item()  # the very hidden, not luck


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculation_with_mtp_equals_plain(mtp_model, arch):
    m = mtp_model(arch)
    prompts, params = workload()
    plain, _ = run(m, prompts, params)
    for rows, depth in ((1, 1), (2, 2), (3, 3), (5, 4), (6, 5), (8, 6)):
        got, engine = run(m, prompts, params, MTPSource(m), depth, rows, seed=rows)
        assert got == plain, f"B={rows} depth={depth}"
        assert engine.stats.drafted["mtp"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampled_rows_with_mtp_equal_plain_sampling(mtp_model, arch):
    m = mtp_model(arch)
    prompts, params = workload(seed=3, sampled=True)
    assert run(m, prompts, params, MTPSource(m), 4)[0] == run(m, prompts, params)[0]


def test_checkpoints_without_mtp_tensors_and_other_families_are_refused(tiny_model):
    with pytest.raises(ValueError, match="carries no mtp"):
        MTPSource(tiny_model("qwen3_5", **FAMILY_OVERRIDES.get("qwen3_5", {})))
    with pytest.raises(ValueError, match="needs a qwen3_next or qwen3_5 target"):
        MTPSource(tiny_model("llama"))


def test_tandem_generate_draft_model_mtp(mtp_model, capsys):
    m = mtp_model("qwen3_5")
    argv = ["generate", "--model", str(m.path), "--prompt", "abcabcabcabc",
            "--ignore-chat-template", "--max-tokens", "10", "--json"]  # fmt: skip

    def out(*extra: str) -> dict:
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    spec = out("--draft-model", "mtp", "--num-draft-tokens", "3")
    assert spec["tokens"] == out("--engine", "rows")["tokens"]
