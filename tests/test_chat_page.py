"""The chat page at GET / (server/static/chat.html), and what it reads from the server.

Fast (tiny random-weight model): the page is served as self-contained HTML without the API
key (the API itself still needs it); `tandem serve` prints the page's URL; usage reports
speculation as `completion_tokens_details` (accepted / rejected draft tokens), the same in
JSON and in the stream's usage chunk, and equal to what /metrics counted.

Slow (real SmolLM2-135M, headless system Chromium driven by Playwright): the page asks for
the key, keeps it, streams a reply that arrives in pieces, shows tok/s and the drafts'
acceptance, sends the whole conversation on the next turn, and Stop ends a reply early.
Chromium (/usr/bin/chromium) and playwright come with `scripts/install.sh --dev`; without
them the slow test fails (CI has them), it does not skip.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_server import KEY, NO_EOS, LiveServer, chat

from mlx_tandem.cli.serve import banner

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL = "run `scripts/install.sh --dev` (installs Debian's chromium and the playwright package)"


@pytest.fixture(scope="module")
def keyed(tiny_model: Any) -> Iterator[LiveServer]:
    server = LiveServer(tiny_model("llama"), drafter="ngram", api_key=KEY)
    yield server
    server.stop()


def test_page_is_public_self_contained_html(keyed: LiveServer) -> None:
    r = httpx.get(keyed.url + "/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    assert page.lstrip().lower().startswith("<!doctype html>") and "</html>" in page
    assert not re.search(r"https?://", page), "the page must not reach beyond this server"
    fetched = re.findall(r"<(?:script|link|img|iframe)[^>]+(?:src|href)=\"([^\"]*)\"", page)
    assert all(url.startswith("data:") for url in fetched), fetched  # nothing to fetch
    assert "/v1/chat/completions" in page and "num_draft_tokens" in page
    assert len(page.splitlines()) < 400
    assert httpx.get(keyed.url + "/v1/models").status_code == 401  # the API still needs the key
    keyed.client.models.list()


def test_serve_prints_the_page_url(monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(host="127.0.0.1", draft_depth="adaptive", num_draft_tokens=3)
    lines = banner("smollm2-135m", "ngram", args, False)(8080).splitlines()
    assert lines[-1] == "  open http://127.0.0.1:8080/ in a browser to chat"
    # a key given as --api-key: the curl line reads it from the variable, so say to set it
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    keyed_lines = banner("smollm2-135m", "ngram", args, True)(8080).splitlines()
    assert '"Authorization: Bearer $TANDEM_API_KEY"' in keyed_lines[1]
    assert keyed_lines[2].startswith("  (export TANDEM_API_KEY=")
    monkeypatch.setenv("TANDEM_API_KEY", "k")
    assert len(banner("m", "ngram", args, True)(8080).splitlines()) == 3


def test_usage_reports_draft_acceptance(keyed: LiveServer) -> None:
    name = 'tandem_spec_{}_tokens_total{{drafter="ngram"}}'
    before = keyed.metrics()
    kw: dict[str, Any] = {"max_tokens": 48, "logit_bias": NO_EOS}
    prompt = "a b c d a b c d a b c d a b c d"
    ref = chat(keyed, prompt, **kw)
    assert keyed.wait_idle()
    after = keyed.metrics()
    drafted, accepted = (
        after.get(name.format(k), 0) - before.get(name.format(k), 0)
        for k in ("drafted", "accepted")
    )
    details = ref.usage.completion_tokens_details
    assert drafted > 0, "the prompt should give prompt lookup something to draft"
    assert details.accepted_prediction_tokens == accepted
    assert details.rejected_prediction_tokens == drafted - accepted
    chunks = list(chat(keyed, prompt, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.model_dump() == ref.usage.model_dump()
    off = chat(keyed, prompt, extra_body={"num_draft_tokens": 0}, **kw)
    details = off.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


# --- a real browser on the real model ---------------------------------------------------------


def chromium(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


# Records every distinct text of the newest assistant reply, as the page changes it.
RECORD = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const all = document.querySelectorAll('.msg.assistant .text');
    const text = all.length ? all[all.length - 1].textContent : '';
    if (text && text !== window.seen[window.seen.length - 1]) window.seen.push(text);
  }).observe(document.getElementById('log'),
             {childList: true, subtree: true, characterData: true});
}"""


@pytest.mark.slow
def test_chat_in_a_real_browser(real_model: Any) -> None:
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.fail(f"the playwright package is missing: {INSTALL}")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: {INSTALL}")
    server = LiveServer(real_model("smollm2-135m", "float32"), drafter="ngram", api_key=KEY)
    requests: list[Any] = []
    try:
        with sync_playwright() as p:
            browser = chromium(p)
            page = browser.new_page()
            page.on("request", lambda r: requests.append(r))

            def posts() -> list[Any]:
                return [r.post_data_json for r in requests if r.method == "POST"]

            page.goto(server.url + "/")
            expect(page.locator("#notice")).to_contain_text("HTTP 401")  # no key yet
            page.fill("#key", KEY)
            page.dispatch_event("#key", "change")
            expect(page.locator("#model")).to_have_text("smollm2-135m")
            assert page.evaluate("localStorage.getItem('mlx-tandem.api-key')") == KEY
            page.fill("#temperature", "0")
            page.fill("#depth", "4")
            page.fill("#max-tokens", "64")
            page.evaluate(RECORD)

            page.fill("#input", "Write a short poem about the sea.")
            page.press("#input", "Enter")
            reply = page.locator(".msg.assistant").nth(0)
            expect(reply).to_have_class(re.compile(r"\bdone\b"), timeout=180_000)
            final = reply.locator(".text").text_content() or ""
            stats = reply.locator(".stats").text_content() or ""
            assert final.strip(), reply.inner_text()
            assert re.search(r"\d+ tokens · \d+\.\d tok/s", stats), stats
            assert re.search(r"drafts accepted \d+/\d+ \(\d+%\)|no drafts", stats), stats
            seen = page.evaluate("window.seen")
            partial = [s for s in seen if s != final]
            assert len(set(partial)) >= 2, f"the reply did not stream: {seen}"
            assert all(final.startswith(s) for s in partial), seen
            assert posts()[-1]["stream"] is True and posts()[-1]["num_draft_tokens"] == 4
            assert posts()[-1]["temperature"] == 0

            page.fill("#input", "Give it a title.")
            page.click("#send")
            expect(page.locator(".msg.assistant.done")).to_have_count(2, timeout=180_000)
            turns = [(m["role"], m["content"]) for m in posts()[-1]["messages"]]
            assert turns == [
                ("user", "Write a short poem about the sea."),
                ("assistant", final),
                ("user", "Give it a title."),
            ]

            page.fill("#max-tokens", "2000")
            page.fill("#input", "Tell me a very long story about a lighthouse keeper.")
            page.press("#input", "Enter")
            third = page.locator(".msg.assistant").nth(2)
            expect(third.locator(".text")).not_to_have_text("", timeout=180_000)
            page.click("#stop")
            expect(third).to_have_class(re.compile(r"\bdone\b"), timeout=30_000)
            expect(third.locator(".stats")).to_contain_text("stopped")
            expect(page.locator("#send")).to_be_enabled()

            page.fill("#temperature", "5000")  # refused by the server: shown, and undone
            page.fill("#input", "hi")
            page.press("#input", "Enter")
            error = page.locator(".msg.assistant").nth(3).locator(".error")
            expect(error).to_have_text(re.compile(r"^HTTP 400: temperature: .*100"))
            expect(page.locator("#input")).to_have_value("hi")
            browser.close()
        urls = [r.url for r in requests]
        assert all(u.startswith(server.url + "/") or u.startswith("data:") for u in urls), urls
        deadline = time.monotonic() + 30
        while server.engine.busy() and time.monotonic() < deadline:  # the row was cancelled
            time.sleep(0.05)
        assert not server.engine.busy()
    finally:
        server.stop()
