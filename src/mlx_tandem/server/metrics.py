"""Prometheus metrics for `GET /metrics`, in the text exposition format (version 0.0.4).

Owns the server's counters and histograms; everything is written by the event-loop
thread (handlers record when a row finishes, an event arrives, or a response starts) and
read at scrape time, under one lock. Engine-side values (rows running and queued, tokens
drafted and accepted per drafter) are read from the engine when scraped, never cached.

    tandem_http_requests_total{endpoint,code}        HTTP responses by status code
    tandem_requests_total{status}                    rows (choices) by outcome:
                                                     stop | length | tool_calls | cancelled | error
    tandem_prompt_tokens_total, tandem_generation_tokens_total
    tandem_rows_running, tandem_rows_queued          gauges, read from the engine
    tandem_time_to_first_token_seconds               histogram (arrival -> first token)
    tandem_inter_token_latency_seconds               histogram (per generated token)
    tandem_spec_drafted_tokens_total{drafter}, tandem_spec_accepted_tokens_total{drafter}
    tandem_prefix_cache_{lookups,hits,lookup_tokens,hit_tokens,evictions}_total
    tandem_prefix_cache_hit_rate, tandem_prefix_cache_bytes, tandem_prefix_cache_budget_bytes
                                                     the prefix caches, summed (kv/prefix_cache.py:
                                                     long prompts' chunks, short prompts' pack
                                                     units; zeros when off), read at scrape

Oracle: tests/test_server.py and tests/test_server_hostile.py (counters after
requests; every 5xx counted).
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, name: str) -> list[str]:
        lines, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {total}')
        lines += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return lines


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._lock = threading.Lock()
        self.http: dict[tuple[str, int], int] = {}
        self.rows: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def record_http(self, endpoint: str, code: int) -> None:
        with self._lock:
            self.http[(endpoint, code)] = self.http.get((endpoint, code), 0) + 1

    def record_prompt(self, tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens

    def record_tokens(self, tokens: int, gap_s: float | None) -> None:
        """`tokens` new tokens arrived; `gap_s` since the row's previous token (None: first)."""
        with self._lock:
            self.generation_tokens += tokens
            if gap_s is not None and tokens > 0:
                self.itl.observe(gap_s / tokens, tokens)

    def record_row(self, status: str, ttft_s: float | None) -> None:
        with self._lock:
            self.rows[status] = self.rows.get(status, 0) + 1
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def render(self, engine: Any) -> str:
        running = len(engine.running)
        queued = len(engine.scheduler.waiting) + len(engine.scheduler.joining)
        drafted = engine.stats.drafted.copy()
        accepted = engine.stats.accepted.copy()
        out: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])

        with self._lock:
            family("tandem_info", "gauge", "Served model.")
            out.append(f'tandem_info{{model="{_label(self.model_id)}"}} 1')
            family("tandem_http_requests_total", "counter", "HTTP responses by endpoint and code.")
            for (endpoint, code), n in sorted(self.http.items()):
                out.append(
                    f'tandem_http_requests_total{{endpoint="{_label(endpoint)}",code="{code}"}} {n}'
                )
            family("tandem_requests_total", "counter", "Finished rows (choices) by status.")
            for status in sorted(
                {"stop", "length", "tool_calls", "cancelled", "error", *self.rows}
            ):
                out.append(f'tandem_requests_total{{status="{status}"}} {self.rows.get(status, 0)}')
            family("tandem_prompt_tokens_total", "counter", "Prompt tokens of admitted rows.")
            out.append(f"tandem_prompt_tokens_total {self.prompt_tokens}")
            family("tandem_generation_tokens_total", "counter", "Generated tokens.")
            out.append(f"tandem_generation_tokens_total {self.generation_tokens}")
            family("tandem_rows_running", "gauge", "Rows in the decoding cohort.")
            out.append(f"tandem_rows_running {running}")
            family("tandem_rows_queued", "gauge", "Rows waiting or being prefilled.")
            out.append(f"tandem_rows_queued {queued}")
            family("tandem_time_to_first_token_seconds", "histogram", "Arrival to first token.")
            out += self.ttft.render("tandem_time_to_first_token_seconds")
            family("tandem_inter_token_latency_seconds", "histogram", "Time per generated token.")
            out += self.itl.render("tandem_inter_token_latency_seconds")
        family("tandem_spec_drafted_tokens_total", "counter", "Drafted tokens per drafter.")
        for name, n in sorted(drafted.items()):
            out.append(f'tandem_spec_drafted_tokens_total{{drafter="{_label(name)}"}} {n}')
        family("tandem_spec_accepted_tokens_total", "counter", "Accepted drafted tokens.")
        for name, n in sorted(accepted.items()):
            out.append(f'tandem_spec_accepted_tokens_total{{drafter="{_label(name)}"}} {n}')
        scheduler = engine.scheduler
        out += _prefix_cache([c for c in (getattr(scheduler, "prefix_cache", None),
                                          getattr(scheduler, "short_cache", None)) if c])
        return "\n".join(out) + "\n"


def _prefix_cache(caches: list[Any]) -> list[str]:
    """The prefix caches' counters and gauges, summed (long prompts' chunks and short
    prompts' pack units; zeros when the engine has none)."""
    counters = {
        "lookups": ("lookups", "Prompts looked up in the prefix caches."),
        "hits": ("hits", "Of them, prompts that started from cached blocks."),
        "lookup_tokens": ("lookup_tokens", "Prompt tokens looked up."),
        "hit_tokens": ("hit_tokens", "Of them, tokens served from the prefix caches."),
        "evictions": ("evicted", "Cached blocks evicted (LRU, byte budget)."),
    }
    out: list[str] = []
    for name, (attr, help_) in counters.items():
        metric = f"tandem_prefix_cache_{name}_total"
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} counter"]
        out.append(f"{metric} {sum(getattr(c.stats, attr) for c in caches)}")
    looked = sum(c.stats.lookup_tokens for c in caches)
    gauges = {
        "hit_rate": (sum(c.stats.hit_tokens for c in caches) / max(1, looked),
                     "Share of looked-up tokens served."),
        "bytes": (sum(c.bytes for c in caches), "Bytes the prefix caches hold."),
        "budget_bytes": (sum(c.budget for c in caches), "The prefix caches' byte budget."),
    }
    for name, (value, help_) in gauges.items():
        metric = f"tandem_prefix_cache_{name}"
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge", f"{metric} {value}"]
    return out


def parse(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, for tests and tools reading /metrics."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
