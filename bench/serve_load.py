"""Server load: `tandem serve` vs `mlx_lm.server` on the same model folder, same machine.

Starts each server as a subprocess (mlx_lm.server also gets OpenBLAS preloaded, for
a fair comparison): mlx_lm.server, `tandem serve` with its defaults (prompt lookup,
adaptive depth) and `tandem serve --draft-model none`. For each load — `chat` (open-ended
questions), `grounded` (rewrite a given passage: the output copies the input) and `mixed`
(alternating) — and 1, 8 and 32 concurrent streaming clients it sends greedy requests of
`--tokens` tokens (`--per-client` of them in turn per client; a run of one request is a
few seconds, too short to resolve a few percent here) and reports generated tok/s counted
from each response's `usage`
(`stream_options.include_usage`; SSE chunks hide multi-token steps), time to first token
p50/p95, inter-token latency p50 and failed requests (errors, or a stream without usage).
All servers run at once (idle, each takes no CPU; `--alone`: each is started for its run
and stopped after, a cold prefix cache every run) and every load runs `--rounds` times
per server, the servers' order rotated each round, so drift over the run (this VM's
speed moves by ±10%) does not favour whichever server ran first; medians are reported
and failures summed, and defaults / none also as the median of each round's own ratio
(a round's runs are minutes apart at most, so slower drift cancels within it). What
rounds do not cancel with the servers kept up: a process's own speed, which on this VM can
sit a steady several percent off another's for its whole life (two identical engines in
one process differed by ~7% at 32 rows, `depth_ab.py`'s A/A control); `--alone` starts
fresh processes every round, so that offset falls differently each round. Every
server sees the same prompts in the same order, so prompt caches (mlx_lm.server's,
tandem's prefix caches) warm up alike.

    .venv/bin/python bench/serve_load.py --model smollm2-135m --tokens 64
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import asyncio
import itertools
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx
from common import PROMPTS, machine_line

from mlx_tandem.models.loader import load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start: {' '.join(cmd)}")


def passages() -> list[str]:
    """Short passages of CPython's own documentation (offline, deterministic)."""
    from pydoc_data.topics import topics

    out = []
    for key in ("execmodel", "exceptions", "compound", "assert", "pass", "del", "return", "if"):
        words = topics[key].split()
        out.append(" ".join(words[:90]))
    return out


def prompts(load: str) -> list[str]:
    grounded = [f"Rewrite the following passage, keeping every sentence and fixing only its "
                f"punctuation:\n\n{p}" for p in passages()]
    if load == "chat":
        return list(PROMPTS)
    if load == "grounded":
        return grounded
    return [x for pair in zip(PROMPTS, grounded * 4, strict=False) for x in pair]


async def one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> dict:
    body = {"model": "default_model", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps: list[float] = []
    generated = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    generated = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError):
        generated = None
    return {"ttft": stamps[0] - start if stamps else float("nan"),
            "itl": [b - a for a, b in itertools.pairwise(stamps)],
            "tokens": generated or 0, "failed": generated is None}


async def load_test(port: int, clients: int, tokens: int, texts: list[str],
                    per_client: int = 1) -> dict:
    """`clients` concurrent clients, each sending `per_client` requests one after another.
    Client c's j-th request is prompt (c + j) mod n: with per_client = n every client sends
    every prompt once, so each does the same work and the run does not end with one
    client's slowest prompt repeated at a batch of one or two (speculation speeds prompts
    up unequally; a client repeating one prompt made the run's tail that prompt's)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def client_run(client: httpx.AsyncClient, c: int) -> list[dict]:
        return [await one(client, url, texts[(c + j) % len(texts)], tokens)
                for j in range(per_client)]

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        per = await asyncio.gather(*(client_run(client, c) for c in range(clients)))
        elapsed = time.perf_counter() - start
    runs = [r for rs in per for r in rs]
    ttfts = sorted(r["ttft"] for r in runs if not r["failed"]) or [float("nan")]
    itl = [x for r in runs if not r["failed"] for x in r["itl"]]
    return {"tps": sum(r["tokens"] for r in runs) / elapsed,
            "ttft50": statistics.median(ttfts),
            "ttft95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "itl50": statistics.median(itl) if itl else float("nan"),
            "failed": sum(r["failed"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--loads", default="chat,grounded,mixed")
    ap.add_argument("--only", default="", help="run only servers whose name contains this")
    ap.add_argument("--per-client", type=int, default=1,
                    help="requests each client sends one after another in a run (more than one "
                         "steadies the one-client case: one request is a few seconds)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs per server and load, servers interleaved in rotating order")
    ap.add_argument("--alone", action="store_true",
                    help="start each server for its run and stop it after, so no other server "
                         "is resident (a check on the all-up design; cold caches every run)")
    args = ap.parse_args()
    folder = load(args.model, dtype=args.dtype, progress=False).path  # prepared mlx-lm folder
    py = sys.executable
    servers = {
        "mlx_lm.server": lambda port: [py, "-c", "import mlx_tandem; from mlx_lm.server import main; "
                                       "main()", "--model", str(folder), "--port", str(port)],
        "tandem (defaults)": lambda port: [py, "-m", "mlx_tandem.cli.main", "serve", "--model",
                                           str(folder), "--port", str(port), "--max-rows", "32"],
        "tandem (--draft-model none)": lambda port: [py, "-m", "mlx_tandem.cli.main", "serve",
                                                     "--model", str(folder), "--port", str(port),
                                                     "--draft-model", "none", "--max-rows", "32"],
    }
    loads = args.loads.split(",")
    clients_list = [int(c) for c in args.clients.split(",")]
    print(machine_line(f"server load, {args.model} ({folder.name}), {args.tokens} tokens/request, "
                       f"{args.per_client} request(s) per client, median of {args.rounds} "
                       f"interleaved rounds{', each server alone' if args.alone else ''}"))
    print("| load | server | clients | tok/s (usage) | TTFT p50 s | TTFT p95 s | ITL p50 ms "
          "| failed |")
    print("|---|---|---|---|---|---|---|---|")
    results: dict[tuple[str, str, int], dict] = {}
    paired: dict[tuple[str, int], float] = {}  # median over rounds of defaults / none
    names = [n for n in servers if args.only in n]
    procs: dict[str, subprocess.Popen] = {}
    ports: dict[str, int] = {}

    def up(name: str) -> None:
        ports[name] = free_port()
        procs[name] = start(servers[name](ports[name]), ports[name])
        asyncio.run(load_test(ports[name], 1, 4, prompts("chat")))  # warm-up

    def down(name: str) -> None:
        procs[name].terminate()
        procs.pop(name).wait(timeout=60)

    try:
        for name in [] if args.alone else names:  # all up at once: rounds interleave
            up(name)
        for kind, clients in itertools.product(loads, clients_list):
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for r in range(args.rounds):  # each round rotates the servers' order
                for name in names[r % len(names):] + names[: r % len(names)]:
                    if args.alone:
                        up(name)
                    runs[name].append(asyncio.run(load_test(ports[name], clients, args.tokens,
                                                            prompts(kind), args.per_client)))
                    if args.alone:
                        down(name)
            for name in names:
                res = {k: statistics.median(x[k] for x in runs[name])
                       for k in ("tps", "ttft50", "ttft95", "itl50")}
                res["failed"] = sum(x["failed"] for x in runs[name])
                results[kind, name, clients] = res
                print(f"| {kind} | {name} | {clients} | {res['tps']:.1f} | {res['ttft50']:.2f} | "
                      f"{res['ttft95']:.2f} | {1000 * res['itl50']:.0f} | {res['failed']} |",
                      flush=True)
            pair = [n for n in names if n.startswith("tandem")]
            if len(pair) == 2:  # each round's two runs are adjacent in time: drift cancels
                paired[kind, clients] = statistics.median(
                    a["tps"] / b["tps"] for a, b in zip(runs[pair[0]], runs[pair[1]], strict=True))
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(timeout=60)
    print("\n| load | clients | defaults / none | the same, paired by round | defaults / "
          "mlx_lm.server | TTFT p50 defaults vs mlx_lm |")
    print("|---|---|---|---|---|---|")
    for kind, clients in itertools.product(loads, clients_list):
        got = {n: results.get((kind, n, clients)) for n in servers}
        d, off = got["tandem (defaults)"], got["tandem (--draft-model none)"]
        ref = got["mlx_lm.server"]
        ratio = paired.get((kind, clients))
        cells = [f"{d['tps'] / off['tps']:.2f}x" if d and off else "",
                 f"{ratio:.2f}x" if ratio else "",
                 f"{d['tps'] / ref['tps']:.2f}x" if d and ref else "",
                 f"{d['ttft50']:.2f} vs {ref['ttft50']:.2f} s" if d and ref else ""]
        print(f"| {kind} | {clients} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
