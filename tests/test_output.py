"""TextStream: safe streaming text, stop strings cut exactly where str.find says."""

import pytest

from mlx_tandem.engine.output import TextStream


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
