"""RuntimeConfig: every engine knob, read from CLI flags and TANDEM_* variables in one place.

Precedence: explicit keyword/flag > environment variable > default. Values are
validated here, before any engine state exists.

    TANDEM_MAX_ROWS           rows decoded together (default 16)
    TANDEM_PREFILL_CHUNK      prompt tokens per prefill chunk (default: auto, PrefillPolicy)
    TANDEM_PREFILL_TAPER      the prompt depth at which a row's prefill chunk is half its size
                              (default: from the model, PrefillPolicy; 0: chunks never shrink)
    TANDEM_PREFILL_STALL_MS   how long running rows may wait for one step that prefills
                              (the rows' own step included; default 1000)
    TANDEM_MEMORY_BUDGET      KV-cache budget, bytes or with K/M/G suffix (default: auto)
    TANDEM_MAX_QUEUE          waiting requests before submit refuses (default 256)
    TANDEM_BATCH_INVARIANT    1/0: pad forwards so a row's arithmetic never depends on
                              the batch (default 1; 0 is faster at small batch, not exact)
    TANDEM_KV_CODEC           how rows store committed K/V: fp (default), affineB[:gG],
                              turbo-kKvV and their options (kv/codec.NAMES_HELP)
    TANDEM_PREFIX_CACHE_BYTES bytes of earlier prompts' chunks kept for reuse (kv/prefix_cache.py):
                              0 off (default here; `tandem serve` sizes it), "auto" from free memory
    TANDEM_BUFFER_CACHE       MLX's buffer cache limit the engine sets: freed arrays kept for
                              reuse, bytes or 0 (default auto: engine/scheduler.size_buffer_cache)

There is no compiled-decode switch: with batch invariance on, the rows engine's
one-token forwards run compiled segments between the attentions (engine/runner.py,
engine/compiled_step.py), which give the eager forward's bits.

Oracle: tests/test_config.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from mlx_tandem.kv.codec import parse_codec

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = _UNITS.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in _UNITS else t
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):  # OverflowError: 'inf', '1e999'
        raise ValueError(f"memory size {text!r} is not a number of bytes (e.g. 4G, 512M)") from None
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return value


def format_bytes(n: float) -> str:
    """A size in the largest binary unit it fills (so 1K reads 1.0 KiB, not 0.0 MiB)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def parse_cache_bytes(text: str) -> int | None:
    """A prefix-cache size: bytes (K/M/G suffix), 0 (off) or "auto" (None)."""
    t = text.strip().lower()
    if t == "auto":
        return None
    return 0 if t in ("0", "off") else parse_bytes(text)


BOOLEAN_WORDS = "true/false (t/f), 1/0, yes/no or on/off"


def parse_bool(text: str) -> bool | None:
    """A boolean as flags and environment variables spell it (any case: exactly the words of
    BOOLEAN_WORDS; t/f as mlx_lm spells them too), or None for anything else (mlx_lm's
    'anything but false/f is true' turned '0' and 'off' on)."""
    t = text.strip().lower()
    if t in ("true", "t", "1", "yes", "on"):
        return True
    if t in ("false", "f", "0", "no", "off"):
        return False
    return None


def _bool(text: str, name: str) -> bool:
    value = parse_bool(text)
    if value is None:
        raise ValueError(f"{name}={text!r}: expected {BOOLEAN_WORDS}")
    return value


@dataclass(frozen=True)
class RuntimeConfig:
    max_rows: int = 16
    prefill_chunk: int | None = None
    prefill_taper: int | None = None  # None: from the model (a fixed prefill_chunk: 0)
    prefill_stall_ms: int = 1000
    memory_budget: int | None = None
    max_queue: int = 256
    batch_invariant: bool = True
    kv_codec: str = "fp"
    prefix_cache_bytes: int | None = 0  # None: sized from free memory when the engine is built
    buffer_cache: int | None = None  # None: auto (engine/scheduler.size_buffer_cache)

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefill_taper is not None and self.prefill_taper < 0:
            raise ValueError(f"prefill_taper must be >= 0, got {self.prefill_taper}")
        if self.prefill_stall_ms < 0:
            raise ValueError(f"prefill_stall_ms must be >= 0, got {self.prefill_stall_ms}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {self.memory_budget}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        parse_codec(self.kv_codec)  # ValueError naming the known codecs
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.buffer_cache is not None and self.buffer_cache < 0:
            raise ValueError(f"buffer_cache must be >= 0, got {self.buffer_cache}")

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RuntimeConfig:
        """Defaults, then TANDEM_* variables, then explicit overrides that are not None."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"TANDEM_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            name = f"TANDEM_{f.name.upper()}"
            if f.name == "memory_budget":
                values[f.name] = parse_bytes(raw)
            elif f.name == "batch_invariant":
                values[f.name] = _bool(raw, name)
            elif f.name == "kv_codec":
                values[f.name] = raw
            elif f.name in ("prefix_cache_bytes", "buffer_cache"):
                try:
                    values[f.name] = parse_cache_bytes(raw)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from None
            else:
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ValueError(f"{name}={raw!r} is not an integer") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown runtime settings: {', '.join(sorted(unknown))}")
        return cls(**values)

    def with_(self, **changes: Any) -> RuntimeConfig:
        return replace(self, **changes)
