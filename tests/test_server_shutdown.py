"""SIGTERM under load: every accepted request finishes or gets an error; none hangs."""

import signal
import threading
import time

import httpx
from test_serve_cli import serve_process
from test_server import MSG, NO_EOS, sse_events

from mlx_tandem.models.tiny import make_tiny_model


def test_sigterm_under_load_ends_every_request(tmp_path):
    proc, url, _ = serve_process(make_tiny_model("llama", tmp_path / "m"), "--max-rows", "2",
                                 "--no-warmup")
    outcomes: dict[int, str] = {}
    started = threading.Barrier(7)

    def stream(i: int) -> None:
        body = {"messages": MSG, "max_tokens": 2000, "stream": True, "logit_bias": NO_EOS}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                started.wait(timeout=30)
                events = sse_events(list(r.iter_lines()))
            reason = events[-2]["choices"][0]["finish_reason"] if events[-1] == "[DONE]" else None
            outcomes[i] = f"stream:{reason}"
        except httpx.HTTPError as err:
            outcomes[i] = f"error:{type(err).__name__}"

    def whole(i: int) -> None:
        body = {"messages": MSG, "max_tokens": 2000, "logit_bias": NO_EOS}
        started.wait(timeout=30)
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            reason = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else None
            outcomes[i] = f"json:{r.status_code}:{reason}"
        except httpx.HTTPError as err:
            outcomes[i] = f"error:{type(err).__name__}"

    try:
        workers = [threading.Thread(target=stream if i % 2 else whole, args=(i,)) for i in range(6)]
        for w in workers:
            w.start()
        started.wait(timeout=30)
        time.sleep(1.0)  # two rows decode, the rest wait in the queue
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for w in workers:
            w.join(timeout=30)
        assert not any(w.is_alive() for w in workers), outcomes  # nothing hangs
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - signalled < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(outcomes) == 6, outcomes
    for outcome in outcomes.values():  # a clean end: finished, aborted at the drain, or refused
        assert outcome in {"stream:abort", "stream:length", "json:200:abort", "json:200:length",
                           "json:503:None"}, outcomes
