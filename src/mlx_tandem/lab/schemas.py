"""Generated JSON schemas for measuring structured output: nested objects, arrays, enums,
bounded numbers and strings, every one of them finite (bounded arrays and strings), so a
constrained greedy run always ends.

Oracle: tests/test_constraint.py (tiny-model outputs validate against these schemas) and
the slow real-model test in tests/test_real_models.py (50 schemas, batched at 8, with
speculation: every output parses and validates).
"""

from __future__ import annotations

import random
from typing import Any

WORDS = ("alpha", "beta", "gamma", "red", "green", "blue", "north", "south", "small", "large",
         "cat", "dog", "paris", "rome", "yes", "no", "open", "closed", "low", "high")  # fmt: skip
NAMES = ("name", "title", "city", "count", "score", "color", "tags", "items", "size", "owner",
         "status", "level", "price", "year", "kind", "notes", "labels", "author", "rank", "id")  # fmt: skip


def random_schemas(n: int, seed: int = 0, floats: bool = True) -> list[dict[str, Any]]:
    """n object schemas, reproducible from seed; `floats` adds bounded `number` fields."""
    rng = random.Random(seed)
    return [_object(rng, depth=0, floats=floats) for _ in range(n)]


def _object(rng: random.Random, depth: int, floats: bool) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(2, 4 if depth else 5))
    props = {name: _value(rng, depth, floats) for name in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


def _value(rng: random.Random, depth: int, floats: bool) -> dict[str, Any]:
    kinds = ["string", "integer", "enum", "boolean", "array"]
    if floats:
        kinds.append("number")
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 16)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([5, 100, 2000])}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = rng.choice([{"type": "string", "maxLength": 8}, {"type": "boolean"},
                           {"enum": rng.sample(WORDS, 3)},
                           {"type": "integer", "minimum": 0, "maximum": 9}])  # fmt: skip
        return {"type": "array", "items": item, "maxItems": rng.randint(1, 4)}
    return _object(rng, depth + 1, floats)
