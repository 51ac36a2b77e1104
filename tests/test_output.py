"""TextStream: safe streaming text, stop strings cut exactly where str.find says."""

import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.engine.output import RowOutput, TextOffsets, TextStream, TokenBytes


def feed(model, tokens, stop=()):
    stream = TextStream(model.tokenizer, tuple(stop))
    pieces = []
    for t in tokens:
        pieces.append(stream.add(t))
        if stream.stopped:
            return "".join(pieces), True, pieces
    pieces.append(stream.finish())
    return "".join(pieces), False, pieces


def ids(model, text):
    return model.tokenizer.encode(text, add_special_tokens=False)


def test_text_equals_decode(tiny_model):
    m = tiny_model("llama")
    toks = ids(m, "Hello, wörld! naïve café — 日本語 🎉")
    text, stopped, pieces = feed(m, toks)
    assert text == m.tokenizer.decode(toks) and not stopped
    assert all("\ufffd" not in p for p in pieces)  # multi-byte chars are never split


@pytest.mark.parametrize("stop", ["wor", "d! n", "🎉", "xyz"])
def test_stop_cut(tiny_model, stop):
    m = tiny_model("llama")
    full = "Hello, world! naive 🎉 tail"
    text, stopped, _ = feed(m, ids(m, full), [stop])
    cut = full.find(stop)
    assert stopped == (cut >= 0)
    assert text == (full[:cut] if cut >= 0 else full)


def test_stop_prefix_is_held_back_then_released(tiny_model):
    m = tiny_model("llama")
    stream = TextStream(m.tokenizer, ("END",))
    out = "".join(stream.add(t) for t in ids(m, "abcEN"))
    assert out == "abc"  # "EN" could still become "END"
    assert stream.finish() == "EN"


def test_earliest_of_several_stops_wins(tiny_model):
    m = tiny_model("llama")
    text, stopped, _ = feed(m, ids(m, "one two three"), ["three", "two"])
    assert stopped and text == "one "


def _run_rule(m, tokens, stop=(), stop_ids=(), max_tokens=100):
    rule = RowOutput(m.tokenizer, tuple(stop), set(stop_ids), max_tokens)
    text, kept = "", []
    for t in tokens:
        delta, emitted = rule.add(t)
        text += delta
        kept += [t] if emitted else []
        if rule.finish_reason:
            break
    return text, kept, rule.finish_reason


def test_finish_rule_stop_id_is_not_emitted(tiny_model):
    m = tiny_model("llama")
    toks = ids(m, "alpha beta gamma")
    text, kept, reason = _run_rule(m, toks, stop_ids=[toks[2]])
    assert (kept, reason) == (toks[:2], "stop")
    assert text == m.tokenizer.decode(toks[:2])


def test_finish_rule_stop_string_and_length(tiny_model):
    m = tiny_model("llama")
    toks = ids(m, "alpha beta gamma delta")
    text, _, reason = _run_rule(m, toks, stop=["gam"])
    assert (text, reason) == ("alpha beta ", "stop")
    text, kept, reason = _run_rule(m, toks, max_tokens=3)
    assert (kept, reason) == (toks[:3], "length") and text == m.tokenizer.decode(toks[:3])
    _, _, reason = _run_rule(m, toks)
    assert reason is None  # ran out of tokens without finishing


def test_plain_path_and_rows_engine_share_the_finish_rule(tiny_model):
    """Both paths stop a greedy row at the same token with the same reason and text."""
    from mlx_tandem import generate
    from mlx_tandem.engine.config import RuntimeConfig
    from mlx_tandem.engine.core import EngineCore

    m = tiny_model("llama")
    plain = generate(m, [5, 6, 7], max_tokens=12)
    stop_text = m.tokenizer.decode(plain.tokens[4:6])
    for params in (
        SamplingParams(max_tokens=12, stop_token_ids=(plain.tokens[3],)),
        SamplingParams(max_tokens=12, stop=(stop_text,)),
        SamplingParams(max_tokens=5),
    ):
        a = generate(m, [5, 6, 7], params)
        core = EngineCore(m, RuntimeConfig.resolve(environ={}))
        handle = core.submit([5, 6, 7], params)
        core.run_until_idle()
        b = handle.result()
        assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
        assert b.stats.mean_accepted_length == 1.0  # no drafts; a stop id counts as produced
        assert handle.result(timeout=1.0) is b  # read once, kept


def _continuation(m, prompt: str, output: str) -> tuple[list[int], list[int]]:
    p = ids(m, prompt)
    return p, ids(m, prompt + output)[len(p):]


def test_a_continuation_keeps_its_first_leading_space(tiny_model):
    """The output's text is decode(prompt + output) minus decode(prompt): "is" + " Paris"."""
    m = tiny_model("llama")
    for prompt, output in (("The capital of France is", " Paris."), ("Sum: ", "1 + 1"),
                           ("Emoji", " 🎉 done")):
        p, out = _continuation(m, prompt, output)
        stream = TextStream(m.tokenizer, (), p)
        text = "".join(stream.add(t) for t in out) + stream.finish()
        assert text == m.tokenizer.decode(p + out)[len(m.tokenizer.decode(p)):]
    # control: read without its prompt, the streaming detokenizer drops the space
    p, out = _continuation(m, "The capital of France is", " Paris.")
    assert "".join(feed(m, out)[2]) == "Paris."


def test_stop_strings_never_match_inside_the_context(tiny_model):
    m = tiny_model("llama")
    p, out = _continuation(m, "one END two", " three END four")
    stream = TextStream(m.tokenizer, ("END",), p)
    text = "".join(stream.add(t) for t in out if not stream.stopped)
    assert stream.stopped and text == " three "


def _byte_checks(m, text: str) -> None:
    tokens = ids(m, text)
    pieces = TokenBytes(m.tokenizer)
    assert b"".join(pieces(t) for t in tokens) == text.encode("utf-8")
    offsets = TextOffsets(pieces, 3).of(tokens)
    done = b""
    for token, offset in zip(tokens, offsets, strict=True):
        assert done.startswith(text[: offset - 3].encode("utf-8"))  # whole characters only
        assert len(done.decode("utf-8", "ignore")) == offset - 3
        done += pieces(token)


def test_token_bytes_join_to_the_texts_bytes(tiny_model):
    """Byte-level tokens hold parts of characters: their bytes, not U+FFFD, and offsets that
    count the characters the bytes before them complete."""
    _byte_checks(tiny_model("llama"), " naïve café — 日本語 🐉🔥 ok")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_token_bytes_and_continuations_on_real_tokenizers(real_model, name):
    m = real_model(name)
    _byte_checks(m, " naïve café — 日本語 🐉🔥 ok")  # BPE bytes; SentencePiece byte fallback
    p, out = _continuation(m, "The capital of France is", " Paris, of course.")
    stream = TextStream(m.tokenizer, (), p)
    text = "".join(stream.add(t) for t in out) + stream.finish()
    assert text == " Paris, of course."
