"""Build a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from GGUF metadata.

Owns: turning llama.cpp's `tokenizer.ggml.*` keys into a `tokenizers.Tokenizer` that tokenizes the
way llama.cpp does, for the two vocabulary kinds the project's models use:

- `gpt2` (SmolLM2): byte-level BPE from the file's tokens and merges, with the pre-tokenizer named by
  `tokenizer.ggml.pre` (`smollm` = single digits, then the GPT-2 regex).
- `llama` with scores and no merges (Gemma 3): SentencePiece-style BPE. Merges are rebuilt from the
  vocabulary and ranked by the score of the merged token (llama.cpp's SPM tokenizer merges the
  best-scoring bigram first), with `<0xNN>` byte fallback and no pre-tokenizer.

Control tokens (type 3) become special added tokens; user-defined ones (type 4) plain added tokens,
matched whole in raw text as llama.cpp always does. Oracle: llama.cpp's prompt token ids in
tests/data/llamacpp_greedy.json (tests/test_gguf_import.py) and a decode->encode vocabulary round trip.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# llama.cpp token types (llama_token_type / gguf TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (regexes applied in order, ignore_merges), mirroring llama.cpp's llama-vocab.cpp.
_BPE_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": ((_GPT2_SPLIT,), False),
    "gpt2": ((_GPT2_SPLIT,), False),
    "smollm": ((r"\p{N}", _GPT2_SPLIT), False),
    "llama3": ((_LLAMA3_SPLIT,), True),
    "llama-v3": ((_LLAMA3_SPLIT,), True),
    "llama-bpe": ((_LLAMA3_SPLIT,), True),
}
# Texts llama.cpp treats as end-of-generation when they are control tokens (llama-vocab.cpp).
_EOG_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<|eom_id|>",
)
SPACE = "\u2581"  # SentencePiece's visible space


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _unique_vocab(tokens: Sequence[str]) -> dict[str, int]:
    """token -> id; a repeated spelling gets a placeholder so every id keeps a token."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            tok = f"<gguf_duplicate_{i}>"
        vocab[tok] = i
    return vocab


def _token_types(meta: Mapping[str, Any], n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * n
    if len(types) != n:
        raise ValueError(f"GGUF has {len(types)} token types for {n} tokens")
    return [int(t) for t in types]


def _added_tokens(spellings: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
    added = []
    for tok, ty in zip(spellings, types, strict=True):
        if ty == CONTROL:
            added.append(AddedToken(tok, special=True, normalized=False))
        elif ty == USER_DEFINED:
            added.append(AddedToken(tok, special=False, normalized=False))
    return added


def _build_bpe(meta: Mapping[str, Any]) -> tuple[Tokenizer, list[str]]:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`)."""
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in _BPE_PRE:
        raise ValueError(
            f"unsupported GGUF BPE pre-tokenizer {pre!r}; supported: {sorted(_BPE_PRE)}"
        )
    regexes, ignore_merges = _BPE_PRE[pre]
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = _token_types(meta, len(tokens))
    spell = [
        t
        if ty in (CONTROL, USER_DEFINED) or set(t) <= letters
        else "".join(alphabet[b] for b in t.encode("utf-8"))
        for t, ty in zip(tokens, types, strict=True)
    ]
    vocab = _unique_vocab(spell)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    splits: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes
    ]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(_added_tokens([t for t in vocab], types))
    return tok, [t for t in vocab]


def _spm_merges(
    spell: Sequence[str], types: Sequence[int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal token into two normal tokens, best merged score first.

    llama.cpp's SPM tokenizer repeatedly merges the adjacent pair whose concatenation is the
    best-scoring vocabulary entry; ranking BPE merges by that score reproduces it.
    """
    normal = {t: i for i, (t, ty) in enumerate(zip(spell, types, strict=True)) if ty == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for tok, i in normal.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), i, -cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _build_spm(meta: Mapping[str, Any]) -> tuple[Tokenizer, list[str]]:
    """SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`, scores, no merges)."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = _token_types(meta, len(tokens))
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores")
    # Normal tokens made of real spaces are looked up as SentencePiece's visible space; user-defined
    # ones keep their raw spelling, since they are matched in the raw text before normalization.
    spell = [
        t.replace(" ", SPACE) if ty not in (CONTROL, USER_DEFINED) else t
        for t, ty in zip(tokens, types, strict=True)
    ]
    vocab = _unique_vocab(spell)
    spell = list(vocab)
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _spm_merges(spell, types, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = spell[int(unk_id)] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    replace = normalizers.Replace(" ", SPACE)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if space_prefix else replace
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_tokens(_added_tokens(spell, types))
    return tok, spell


def _special(
    meta: Mapping[str, Any], key: str, spell: Sequence[str]
) -> tuple[int | None, str | None]:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None or not 0 <= int(value) < len(spell):
        return None, None
    return int(value), spell[int(value)]


def eos_token_ids(meta: Mapping[str, Any], spell: Sequence[str] | None = None) -> list[int]:
    """llama.cpp's end-of-generation set: eos, eot/eom, and control tokens it knows end a turn."""
    spell = list(spell if spell is not None else meta["tokenizer.ggml.tokens"])
    types = _token_types(meta, len(spell))
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and 0 <= int(value) < len(spell):
            ids.append(int(value))
    index = {t: i for i, t in enumerate(spell)}
    for text in _EOG_TEXTS:
        i = index.get(text)
        if i is not None and types[i] == CONTROL:
            ids.append(i)
    return list(dict.fromkeys(ids))


def build_tokenizer(meta: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and the tokenizer_config.json contents described by GGUF metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: no tokenizer to build")
    if kind == "gpt2":
        tok, spell = _build_bpe(meta)
        default_bos = False
    elif kind == "llama":
        tok, spell = _build_spm(meta)
        default_bos = True  # llama.cpp's default for SPM vocabularies without the flag
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: ['gpt2', 'llama']")
    arch = meta.get("general.architecture", "")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos_id, bos = _special(meta, "bos_token_id", spell)
    eos_id, eos = _special(meta, "eos_token_id", spell)
    _, unk = _special(meta, "unknown_token_id", spell)
    _, pad = _special(meta, "padding_token_id", spell)
    add_bos = add_bos and bos is not None
    add_eos = add_eos and eos is not None
    if add_bos or add_eos:
        pre = [f"{bos}:0"] if add_bos else []
        post = [f"{eos}:0"] if add_eos else []
        single = " ".join([*pre, "$A:0", *post])
        pair = " ".join(
            [
                single,
                *[p.replace(":0", ":1") for p in pre],
                "$B:1",
                *[p.replace(":0", ":1") for p in post],
            ]
        )
        specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(specials))
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{arch}.context_length", 0)) or 1_000_000_000,
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = str(template)
    return tok, {k: v for k, v in config.items() if v is not None}


def save_tokenizer(meta: Mapping[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir.

    Returns {"bos_token_id", "eos_token_id" (list), "pad_token_id", "add_bos_token"} for config.json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok, config = build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special = {
        k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in config
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))
    spell = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size())]
    return {
        "bos_token_id": _special(meta, "bos_token_id", spell)[0],
        "eos_token_id": eos_token_ids(meta, spell),
        "pad_token_id": _special(meta, "padding_token_id", spell)[0],
        "add_bos_token": config["add_bos_token"],
    }
