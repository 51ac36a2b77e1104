"""Structured output: grammar-mask cost per token (llguidance vs outlines-core) and constrained
decoding speed with and without speculation, on generated JSON schemas.

  1. Engine runs (greedy, `--rows` rows, every schema's prompt submitted at once):
     constrained plain (no proposals at all); unconstrained with each row generating as
     many tokens as it did constrained (EOS ignored: the cost of the grammar); and
     constrained with each drafter (adaptive depth; within it the grammar's forced tokens
     are proposed in place of a stateless drafter's). Every
     constrained output must parse and validate (jsonschema), and equal constrained plain
     token for token. Tokens are counted from what was generated; engines are built
     before the clock starts.
  2. Mask cost at B = 16: the constrained outputs of run 1 replayed through 16 matchers at
     once (schemas cycled), timing only the per-token mask computation (and, for
     outlines-core, the index each schema needs first). xgrammar is not measured: its
     PyPI wheel requires torch and triton.

    .venv/bin/python bench/structured.py --model smollm2-135m --schemas 50 --rows 8
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split

import argparse
import json
import time

import jsonschema
import numpy as np
from common import machine_line

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.factory import build_depth, build_drafter
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.constraint import json_schema_grammar
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.lab.schemas import random_schemas
from mlx_tandem.models.loader import load

TOPICS = ("a city", "a book", "a recipe", "a planet", "a company", "a song", "a robot",
          "a festival", "a river", "a painter")  # fmt: skip


def prompts_for(model, schemas: list[dict]) -> list[list[int]]:
    out = []
    for i, schema in enumerate(schemas):
        ask = (f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object that follows this JSON "
               f"schema:\n{json.dumps(schema)}")  # fmt: skip
        out.append(model.encode(ask, chat=True))
    return out


def run(model, prompts, schemas, rows, max_tokens, drafter=None, constrained=True, lengths=None,
        proposals=True):
    """lengths: per-row max_tokens with EOS ignored (the unconstrained reference generates
    exactly as many tokens as the constrained run did); proposals=False: num_draft_tokens 0."""
    config = RuntimeConfig.resolve(max_rows=rows)
    depth = build_depth("adaptive", 3) if drafter else None
    engine = EngineCore(model, config, drafter=drafter, depth=depth)
    params = [
        SamplingParams(
            max_tokens=lengths[i] if lengths else max_tokens, ignore_eos=bool(lengths),
            grammar=json_schema_grammar(s) if constrained else None,
            num_draft_tokens=None if proposals else 0,
        )
        for i, s in enumerate(schemas)
    ]  # fmt: skip
    engine.grammars.tokenizer()  # built once per model, outside the clock
    start = time.perf_counter()
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    results = [h.result() for h in handles]
    return seconds, results, engine


def valid(results, schemas) -> int:
    ok = 0
    for r, s in zip(results, schemas, strict=True):
        try:
            jsonschema.validate(json.loads(r.text), s)
            ok += r.finish_reason == "stop"
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return ok


def mask_cost_llguidance(model, schemas, outputs, batch=16) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    from mlx_tandem.engine.constraint import GrammarCompiler

    compiler = GrammarCompiler(model.tokenizer._tokenizer, model.graph.vocab_size, model.eos_token_ids)
    compiler.tokenizer()
    picks = [i % len(schemas) for i in range(batch)]
    start = time.perf_counter()
    rows = [compiler.compile(json_schema_grammar(schemas[i])) for i in picks]
    compile_s = time.perf_counter() - start
    bitmask = lnp.allocate_token_bitmask(batch, model.graph.vocab_size)
    executor = llguidance.LLExecutor()
    steps = max(len(outputs[i]) for i in picks)
    seq = par = 0.0
    masks = 0
    for t in range(steps):
        live = [(j, rows[j].matcher) for j, i in enumerate(picks) if t < len(outputs[i])]
        s0 = time.perf_counter()
        for j, m in live:
            lnp.fill_next_token_bitmask(m, bitmask, j)
        s1 = time.perf_counter()
        lnp.fill_next_token_bitmask_par(executor, [(m, j) for j, m in live], bitmask)
        s2 = time.perf_counter()
        seq, par, masks = seq + s1 - s0, par + s2 - s1, masks + len(live)
        for j, m in live:
            m.consume_token(outputs[picks[j]][t])
    return {"compile_ms_per_schema": 1e3 * compile_s / batch, "us_per_mask": 1e6 * seq / masks,
            "us_per_mask_parallel": 1e6 * par / masks, "ms_per_step_b16": 1e3 * seq / steps}  # fmt: skip


def _byte_vocabulary(model) -> tuple[int, dict[bytes, list[int]]]:
    """outlines-core's Vocabulary input: each token's bytes (byte-level BPE decoding)."""
    tok = model.tokenizer._tokenizer
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    to_char, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in to_char:
            to_char[b], n = chr(256 + n), n + 1
    to_byte = {c: b for b, c in to_char.items()}
    eos = tok.eos_token_id
    vocab: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i != eos and all(c in to_byte for c in text):
            vocab.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    return eos, vocab


def mask_cost_outlines(model, schemas, outputs, batch=16) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos, vocab = _byte_vocabulary(model)
    vocabulary = Vocabulary(eos, vocab)
    picks = [i % len(schemas) for i in range(batch)]
    start = time.perf_counter()
    indexes = {i: Index(build_regex_from_schema(json.dumps(schemas[i]), whitespace_pattern=" ?"),
                        vocabulary) for i in set(picks)}  # fmt: skip
    compile_s = time.perf_counter() - start
    guides = [Guide(indexes[i]) for i in picks]
    words = (model.graph.vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    steps = max(len(outputs[i]) for i in picks)
    seconds, masks, refused = 0.0, 0, 0
    for t in range(steps):
        live = [j for j, i in enumerate(picks) if t < len(outputs[i]) and guides[j] is not None]
        s0 = time.perf_counter()
        for j in live:
            guides[j].write_mask_into(mask.ctypes.data, words, 4)
        seconds += time.perf_counter() - s0
        masks += len(live)
        for j in live:
            try:
                guides[j].advance(outputs[picks[j]][t], return_tokens=False)
            except ValueError:  # a token its regex layout does not admit: stop replaying it
                guides[j], refused = None, refused + 1
    return {"compile_ms_per_schema": 1e3 * compile_s / len(indexes),
            "us_per_mask": 1e6 * seconds / max(1, masks), "replays_refused": refused}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--drafters", default="ngram,assistant")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = load(args.model, progress=False)
    schemas = random_schemas(args.schemas, seed=0)
    prompts = prompts_for(model, schemas)
    print(machine_line(f"structured output, {args.model}, {args.schemas} schemas, B = {args.rows}"))
    report: dict = {"runs": {}}
    run(model, prompts[:2], schemas[:2], args.rows, 16)  # warm-up, untimed
    base_s, base, _ = run(model, prompts, schemas, args.rows, args.max_tokens, proposals=False)
    base_tokens = sum(len(r.tokens) for r in base)
    lengths = [max(1, len(r.tokens)) for r in base]
    free_s, free, _ = run(model, prompts, schemas, args.rows, args.max_tokens, constrained=False,
                          lengths=lengths)  # fmt: skip
    free_tokens = sum(len(r.tokens) for r in free)
    report["runs"]["unconstrained, same lengths"] = {"tok_s": free_tokens / free_s,
                                                     "tokens": free_tokens}  # fmt: skip
    report["runs"]["constrained plain"] = {
        "tok_s": base_tokens / base_s, "tokens": base_tokens, "valid": valid(base, schemas)}
    for name in [d for d in args.drafters.split(",") if d]:
        config = RuntimeConfig.resolve(max_rows=args.rows)
        drafter = build_drafter(name, model, config)
        seconds, got, engine = run(model, prompts, schemas, args.rows, args.max_tokens, drafter)
        tokens = sum(len(r.tokens) for r in got)
        stats = engine.stats
        forced = stats.drafted.get("grammar", 0)
        row = {"tok_s": tokens / seconds, "tokens": tokens, "valid": valid(got, schemas),
               "identical": sum(a.tokens == b.tokens for a, b in zip(got, base, strict=True)),
               "tokens_per_forward": tokens / max(1, sum(r.stats.steps for r in got)),
               "forced_drafted": forced, "forced_acceptance": stats.acceptance("grammar")}  # fmt: skip
        row["acceptance"] = stats.acceptance(drafter.name)
        report["runs"][f"constrained + {name}"] = row
    outputs = [r.tokens for r in base]
    report["masks_b16"] = {"llguidance": mask_cost_llguidance(model, schemas, outputs),
                           "outlines-core": mask_cost_outlines(model, schemas, outputs)}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2))
        return
    ref = report["runs"]["constrained plain"]["tok_s"]
    print(f"{'run':34} {'tok/s':>7} {'vs constrained plain':>21} {'valid':>7} {'identical':>9} "
          f"{'tok/fwd':>7}")  # fmt: skip
    for name, r in report["runs"].items():
        print(f"{name:34} {r['tok_s']:7.1f} {r['tok_s'] / ref:20.2f}x "
              f"{r.get('valid', '-'):>7} {r.get('identical', '-'):>9} "
              f"{r.get('tokens_per_forward', 1.0):7.2f}")  # fmt: skip
    for lib, m in report["masks_b16"].items():
        print(f"mask cost {lib:14} " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))


if __name__ == "__main__":
    main()
