"""Structured output on real SmolLM2 (slow): generated schemas, batched at 8, speculating.

Every greedy output parses and validates (jsonschema) with prompt lookup and the grammar's
forced tokens proposed, and equals constrained plain decoding (no proposals at all) token
for token. bench/structured.py runs the same check on 50 schemas and times it.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from mlx_tandem import SamplingParams
from mlx_tandem.drafters.prompt_lookup import PromptLookupSource
from mlx_tandem.engine.config import RuntimeConfig
from mlx_tandem.engine.constraint import json_schema_grammar
from mlx_tandem.engine.core import EngineCore
from mlx_tandem.engine.depth import FixedDepth
from mlx_tandem.lab.schemas import random_schemas

pytestmark = pytest.mark.slow


def run(model, prompts, params, drafter=None):
    engine = EngineCore(model, RuntimeConfig.resolve(max_rows=8), drafter=drafter,
                        depth=FixedDepth(3) if drafter else None)  # fmt: skip
    handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run_until_idle()
    return [h.result() for h in handles], engine


def test_generated_schemas_validate_with_speculation_and_equal_plain(real_model):
    model = real_model("smollm2-135m")
    schemas = random_schemas(4, seed=2)  # answers of 22-39 tokens
    prompts = [model.encode(f"Describe a city as JSON following this schema:\n{json.dumps(s)}",
                            chat=True) for s in schemas]  # fmt: skip
    params = [SamplingParams(max_tokens=400, grammar=json_schema_grammar(s)) for s in schemas]
    spec, engine = run(model, prompts, params, PromptLookupSource())
    for r, s in zip(spec, schemas, strict=True):
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), s)
    assert engine.stats.acceptance("grammar") > 0.5 and engine.stats.drafted["grammar"] > 40
    plain = [dataclasses.replace(p, num_draft_tokens=0) for p in params]
    reference, _ = run(model, prompts, plain)
    assert [r.tokens for r in spec] == [r.tokens for r in reference]
