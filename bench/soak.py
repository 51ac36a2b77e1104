"""Soak: many concurrent streaming clients, some hostile, against a live `tandem serve`.

Starts `tandem serve` as a subprocess on 127.0.0.1 (speculation as its defaults: ngram,
adaptive), computes each greedy request's solo reference (one request at a time to the
same server), warms up, then sends `--requests` chat requests from `--clients`
concurrent clients: `--disconnect` of them hang up mid-stream, `--invalid` send bodies
the server must refuse (400), the rest stream greedy completions of mixed lengths.
Every request has a deadline (`--request-timeout`); the run is bounded.

Reports (and exits 1 unless all hold): no lost responses (every request answered:
streams end with a finish_reason and [DONE], invalid bodies get 400), no truncated
streams, every completed greedy text equal to its solo reference, the server's RSS at
the end within 10% of its post-warm-up value, its thread count back to the post-warm-up
count, no 5xx in /metrics, no rows left running.

    .venv/bin/python bench/soak.py --model smollm2-135m               # 64 clients, 500 requests
    .venv/bin/python bench/soak.py --model ./folder --clients 16 --requests 60

Oracle: tests/test_soak.py (the same at 12 clients, 40 requests; slow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

QUESTIONS = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "Count from one to ten in words.",
    "Name two planets of the solar system.",
    "What colour is the sky on a clear day?",
    "Give me a synonym for 'happy'.",
    "Say hello in German, French and Italian.",
    "Why do leaves change colour in autumn?",
]
LENGTHS = (8, 24, 48)
INVALID = [
    '{"messages": [',
    '{"messages": [{"role": "user", "content": "x"}], "max_tokens": "4"}',
    '{"messages": [{"role": "user", "content": "x"}], "temperature": 1e-45}',
    '{"messages": [{"role": "wizard", "content": "x"}]}',
    '{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
    '"json_schema": {"name": "x", "schema": {"type": "nope"}}}}',
    '{"prompt": "no messages here"}',
]


@dataclass
class Tally:
    ok: int = 0  # greedy streams complete and equal to their reference
    mismatched: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    disconnected: int = 0
    refused: int = 0  # invalid bodies answered 400
    latencies: list[float] = field(default_factory=list)


def proc_status(pid: int) -> tuple[int, int]:
    """(RSS bytes, threads) of a process, from /proc."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "mlx_tandem.cli.main", "serve", "--model", model, "--port", "0",
           "--log-level", "WARNING", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner = proc.stdout.readline() if proc.stdout else ""
    if " on http://" not in banner:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise RuntimeError(f"tandem serve did not start: {banner}{err}")
    url = banner.split(" on ")[1].split()[0]
    return proc, url


def body(question: str, tokens: int, stream: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": tokens,
            "stream": stream}  # fmt: skip


async def stream_text(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], hang_up_after: int | None
) -> tuple[str, str | None, bool]:
    """(text, last finish_reason, saw [DONE]); hang_up_after=k closes after k data events."""
    text, finish, done, events = "", None, False, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
            if hang_up_after is not None and events >= hang_up_after:
                break  # leaving the block closes the connection mid-stream
    return text, finish, done


async def references(
    url: str, timeout: float, pairs: set[tuple[int, int]]
) -> dict[tuple[int, int], str]:
    """Each (question, length) the plans use, served alone, one request at a time."""
    out = {}
    async with httpx.AsyncClient(timeout=timeout) as client:
        for q, tokens in sorted(pairs):
            text, finish, done = await stream_text(client, url, body(QUESTIONS[q], tokens, True), None)
            if not done or finish is None:
                raise RuntimeError(f"reference {q}/{tokens} did not complete")
            out[(q, tokens)] = text
    return out


def plan(
    requests: int, disconnect: float, invalid: float, seed: int, questions: int = len(QUESTIONS)
) -> list[tuple[str, Any]]:
    """Each request's kind and argument; greedy and disconnecting ones ask the first
    `questions` of QUESTIONS."""
    rng = random.Random(seed)
    kinds = []
    for _ in range(requests):
        u = rng.random()
        if u < invalid:
            kinds.append(("invalid", rng.choice(INVALID)))
        elif u < invalid + disconnect:
            kinds.append(("disconnect", (rng.randrange(questions), 48, rng.randint(1, 4))))
        else:
            kinds.append(("greedy", (rng.randrange(questions), rng.choice(LENGTHS))))
    return kinds


async def load(
    url: str, work: list[tuple[str, Any]], clients: int, refs: dict, timeout: float
) -> Tally:
    tally = Tally()
    queue: asyncio.Queue[tuple[int, str, Any]] = asyncio.Queue()
    for i, item in enumerate(work):
        queue.put_nowait((i, *item))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def one(client: httpx.AsyncClient, i: int, kind: str, arg: Any) -> None:
        start = time.monotonic()
        if kind == "invalid":
            r = await client.post(url + "/v1/chat/completions", content=arg,
                                  headers={"Content-Type": "application/json"})  # fmt: skip
            if r.status_code == 400 and "error" in r.json():
                tally.refused += 1
            else:
                tally.lost.append(f"#{i} invalid body got {r.status_code}")
            return
        q, tokens, *rest = arg
        hang_up = rest[0] if kind == "disconnect" else None
        text, finish, done = await stream_text(client, url, body(QUESTIONS[q], tokens, True), hang_up)
        if kind == "disconnect":
            tally.disconnected += 1
            return
        tally.latencies.append(time.monotonic() - start)
        if not done or finish is None:
            tally.truncated.append(f"#{i} ({q}/{tokens}) finish={finish} done={done}")
        elif text != refs[(q, tokens)]:
            tally.mismatched.append(f"#{i} ({q}/{tokens}): {text!r} != {refs[(q, tokens)]!r}")
        else:
            tally.ok += 1

    async def client_loop() -> None:
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            while True:
                try:
                    i, kind, arg = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    await asyncio.wait_for(one(client, i, kind, arg), timeout)
                except Exception as err:  # every failure is a lost response
                    tally.lost.append(f"#{i} {kind}: {type(err).__name__}: {err}")

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return tally


async def wait_idle(url: str, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            text = (await client.get(url + "/metrics")).text
            metrics = {
                line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
                for line in text.splitlines()
                if line and not line.startswith("#")
            }
            idle = metrics["tandem_rows_running"] == 0 and metrics["tandem_rows_queued"] == 0
            if idle or time.monotonic() > deadline:
                return metrics


def run(
    model: str,
    clients: int = 64,
    requests: int = 500,
    disconnect: float = 0.2,
    invalid: float = 0.1,
    seed: int = 0,
    request_timeout: float = 300.0,
    serve_args: tuple[str, ...] = (),
    questions: int = len(QUESTIONS),
) -> dict[str, Any]:
    """The soak; returns its numbers and `passed`. `questions`: how many of QUESTIONS the
    requests ask (fewer: fewer solo references to compute first)."""
    proc, url = start_server(model, list(serve_args))
    try:
        started = time.monotonic()
        warm = plan(min(clients, requests), disconnect, invalid, seed + 1, questions)
        work = plan(requests, disconnect, invalid, seed, questions)
        pairs = {arg for kind, arg in warm + work if kind == "greedy"}
        refs = asyncio.run(references(url, request_timeout, pairs))
        asyncio.run(load(url, warm, clients, refs, request_timeout))  # warm-up: same mix
        asyncio.run(wait_idle(url, 30))
        rss_warm, threads_warm = proc_status(proc.pid)
        samples: list[tuple[int, int]] = []

        async def soak() -> Tally:
            async def sample() -> None:
                while True:
                    samples.append(proc_status(proc.pid))
                    await asyncio.sleep(0.5)

            sampler = asyncio.create_task(sample())
            try:
                return await load(url, work, clients, refs, request_timeout)
            finally:
                sampler.cancel()

        t0 = time.monotonic()
        tally = asyncio.run(soak())
        elapsed = time.monotonic() - t0
        metrics = asyncio.run(wait_idle(url, 30))
        time.sleep(1.0)  # let finished prompt workers exit
        rss_end, threads_end = proc_status(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    errors_5xx = sum(v for k, v in metrics.items() if 'code="5' in k)
    greedy = tally.ok + len(tally.mismatched) + len(tally.truncated)
    result = {
        "requests": requests, "clients": clients, "greedy": greedy, "equal": tally.ok,
        "mismatched": len(tally.mismatched), "truncated": len(tally.truncated),
        "lost": len(tally.lost), "disconnected": tally.disconnected, "refused_400": tally.refused,
        "http_5xx": int(errors_5xx), "rows_left": int(metrics["tandem_rows_running"]),
        "elapsed_s": elapsed, "setup_s": t0 - started,
        "rss_warm_mb": rss_warm / 2**20, "rss_end_mb": rss_end / 2**20,
        "rss_peak_mb": max([rss_warm, *(s[0] for s in samples)]) / 2**20,
        "threads_warm": threads_warm, "threads_end": threads_end,
        "threads_peak": max([threads_warm, *(s[1] for s in samples)]),
        "p50_s": sorted(tally.latencies)[len(tally.latencies) // 2] if tally.latencies else 0.0,
        "details": tally.lost[:5] + tally.truncated[:5] + tally.mismatched[:5],
    }  # fmt: skip
    result["passed"] = (
        result["lost"] == result["truncated"] == result["mismatched"] == 0
        and result["http_5xx"] == 0
        and result["rows_left"] == 0
        and abs(rss_end - rss_warm) <= 0.1 * rss_warm
        and threads_end == threads_warm
    )
    return result


def table(r: dict[str, Any]) -> str:
    rows = [
        ("requests / clients", f"{r['requests']} / {r['clients']}"),
        ("greedy streams: equal to solo reference", f"{r['equal']} / {r['greedy']}"),
        ("mismatched / truncated / lost", f"{r['mismatched']} / {r['truncated']} / {r['lost']}"),
        ("disconnected mid-stream", str(r["disconnected"])),
        ("invalid bodies answered 400", str(r["refused_400"])),
        ("HTTP 5xx in /metrics", str(r["http_5xx"])),
        ("rows running after the run", str(r["rows_left"])),
        ("server RSS warm / peak / end (MiB)",
         f"{r['rss_warm_mb']:.0f} / {r['rss_peak_mb']:.0f} / {r['rss_end_mb']:.0f}"),
        ("server threads warm / peak / end",
         f"{r['threads_warm']} / {r['threads_peak']} / {r['threads_end']}"),
        ("soak wall time (s)", f"{r['elapsed_s']:.1f}"),
        ("greedy stream latency p50 (s)", f"{r['p50_s']:.2f}"),
        ("verdict", "PASS" if r["passed"] else "FAIL"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--disconnect", type=float, default=0.2)
    p.add_argument("--invalid", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-rows", type=int, default=None, help="passed to tandem serve")
    args = p.parse_args()
    extra = ("--max-rows", str(args.max_rows)) if args.max_rows else ()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run(args.model, args.clients, args.requests, args.disconnect, args.invalid,
                 args.seed, args.request_timeout, extra)  # fmt: skip
    print(table(result))
    for line in result["details"]:
        print("  ", line)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
