"""Server load: `tandem serve` vs `mlx_lm.server` on the same model folder, same machine.

Starts each server as a subprocess (mlx_lm.server also gets OpenBLAS preloaded, for
a fair comparison), then for 1, 8 and 32 concurrent streaming clients sends the same
chat requests (greedy, fixed max_tokens) and reports generated tok/s, time to first
token p50/p95 and inter-token latency p50. tandem runs with speculation off and with
ngram speculation on.

    .venv/bin/python bench/serve_load.py --model smollm2-135m --tokens 48
"""

from __future__ import annotations

import mlx_tandem  # noqa: F401  (preloads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import asyncio
import itertools
import json
import os
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


async def one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> dict:
    body = {"model": "default_model", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0.0, "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - start if stamps else float("nan"),
            "itl": [b - a for a, b in itertools.pairwise(stamps)],
            "chunks": len(stamps), "end": time.perf_counter()}


async def load_test(port: int, clients: int, tokens: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        runs = await asyncio.gather(*(one(client, url, PROMPTS[i % len(PROMPTS)], tokens)
                                      for i in range(clients)))
        elapsed = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in runs)
    itl = [x for r in runs for x in r["itl"]]
    return {"tps": sum(r["chunks"] for r in runs) / elapsed,
            "ttft50": statistics.median(ttfts),
            "ttft95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            "itl50": statistics.median(itl) if itl else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--only", default="", help="run only servers whose name contains this")
    args = ap.parse_args()
    folder = load(args.model, dtype=args.dtype, progress=False).path  # prepared mlx-lm folder
    py = sys.executable
    servers = {
        "mlx_lm.server": lambda port: [py, "-c", "import mlx_tandem; from mlx_lm.server import main; "
                                       "main()", "--model", str(folder), "--port", str(port)],
        "tandem (no speculation)": lambda port: [py, "-m", "mlx_tandem.cli.main", "serve", "--model",
                                                 str(folder), "--port", str(port), "--draft-model",
                                                 "none", "--max-rows", "32"],
        "tandem (ngram)": lambda port: [py, "-m", "mlx_tandem.cli.main", "serve", "--model",
                                        str(folder), "--port", str(port), "--draft-model", "ngram",
                                        "--max-rows", "32"],
    }
    print(machine_line(f"server load, {args.model} ({folder.name}), {args.tokens} tokens/request"))
    print("| server | clients | tok/s | TTFT p50 s | TTFT p95 s | ITL p50 ms |")
    print("|---|---|---|---|---|---|")
    env_note = os.environ.get("TANDEM_BATCH_INVARIANT", "1")
    for name, cmd in servers.items():
        if args.only not in name:
            continue
        port = free_port()
        proc = start(cmd(port), port)
        try:
            asyncio.run(load_test(port, 1, 4))  # warm-up
            for clients in (int(c) for c in args.clients.split(",")):
                r = asyncio.run(load_test(port, clients, args.tokens))
                print(f"| {name} | {clients} | {r['tps']:.1f} | {r['ttft50']:.2f} | "
                      f"{r['ttft95']:.2f} | {1000 * r['itl50']:.0f} |", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"\n(TANDEM_BATCH_INVARIANT={env_note})")


if __name__ == "__main__":
    main()
