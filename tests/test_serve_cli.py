"""`tandem serve` as a process: flags against mlx_lm.server's own parser, flag errors, SIGTERM draining."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from typing import Any
from unittest import mock

import httpx
import pytest
from test_server import MSG, NO_EOS, sse_events

from mlx_tandem.models.catalogue import DEFAULT_MODEL
from mlx_tandem.models.loader import load_folder
from mlx_tandem.models.tiny import make_tiny_model

# --- the CLI process ----------------------------------------------------------------------------


def mlx_lm_server_parser() -> argparse.ArgumentParser:
    """The parser mlx_lm.server's main() builds (captured at its parse_args call)."""
    import mlx_lm.server

    class Built(Exception):
        pass

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise Built(self)

    patch = mock.patch.object(argparse.ArgumentParser, "parse_args", capture)
    with patch, pytest.raises(Built) as built:
        mlx_lm.server.main()
    return built.value.args[0]


# mlx_lm.server flags `tandem serve` does not take, and why
NOT_OURS = {
    "--adapter-path": "no LoRA adapters",
    "--trust-remote-code": "no remote code: tokenizers come from the folder or the GGUF",
    "--use-default-chat-template": "no default template",
    "--prompt-concurrency": "prefill batching is budgeted by --prefill-chunk",
    "--prompt-cache-size": "the prefix cache is sized in bytes (--prompt-cache-bytes)",
    "--quantized-kv-start": "a codec holds every position (--kv-codec's ,fp@0+N keeps a "
    "prefix in float)",
    "--pipeline": "one device",
}
# flags both have whose default differs on purpose
OUR_DEFAULTS = {
    "--model": DEFAULT_MODEL,  # theirs has no default model; ours is the catalogue default
    "--draft-model": "ngram",  # speculation on by default
    "--allowed-origins": [],  # CORS off unless asked for
    "--decode-concurrency": None,  # --max-rows, resolved by RuntimeConfig
    "--prefill-step-size": None,  # --prefill-chunk, resolved by RuntimeConfig
    "--kv-group-size": None,  # 64 once --kv-bits is given (the codec's own default)
}


def test_serve_flags_match_mlx_lm_server():
    from mlx_tandem.cli.main import build_parser

    theirs = mlx_lm_server_parser()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    ours = {flag: a for a in sub.choices["serve"]._actions for flag in a.option_strings}
    compared = 0
    for action in theirs._actions:
        flag = next((f for f in action.option_strings if f.startswith("--")), None)
        if flag in (None, "--help") or flag in NOT_OURS:
            continue
        assert flag in ours, f"tandem serve lacks mlx_lm.server's {flag}"
        mine = ours[flag]
        default = mine.default  # --chat-template-args: both hold the JSON text "{}"
        expected = OUR_DEFAULTS.get(flag, action.default)
        assert default == expected, (flag, default, action.default)
        if action.type in (int, float):
            assert mine.type is action.type, flag
        if action.choices:
            assert list(mine.choices) == list(action.choices), flag
        compared += 1
    assert compared >= 14

    args = parser.parse_args(
        [
            "serve",
            "--allowed-origins",
            "http://a,http://b",
            "--decode-concurrency",
            "8",
            "--draft-model",
            "none",
            "--log-level",
            "debug",
            "--chat-template",
            "{{ x }}",
            "--prompt-cache-bytes",
            "1G",
        ]
    )
    assert args.cors_origin == ["http://a,http://b"] and args.max_rows == 8
    assert args.prefix_cache_bytes == "1G"
    assert args.log_level == "DEBUG" and args.draft_model == "none"
    args = parser.parse_args(["serve"])
    assert (args.api_key, args.allow_request_chat_template) == (None, False)


def test_serve_flag_errors_and_chat_template(tmp_path, capsys):
    from mlx_tandem.cli.main import main
    from mlx_tandem.cli.serve import set_chat_template

    for argv in (["--port", "99999"], ["--chat-template-args", "[1]"], ["--temp", "-1"]):
        assert main(["serve", "--model", "nowhere", *argv]) == 2
        assert capsys.readouterr().err.startswith("tandem: error: ")
    import socket

    with socket.socket() as busy:  # a port in use fails before the model (here: none) loads
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert main(["serve", "--model", "nowhere", "--port", port]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tandem: error: cannot listen on 127.0.0.1:{port}"), err
    model = load_folder(make_tiny_model("llama", tmp_path / "m"), name="t")
    hi = [{"role": "user", "content": "hi"}]
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}|")
    set_chat_template(model.tokenizer, str(tmp_path / "t.jinja"))
    assert model.tokenizer.decode(model.encode_messages(hi)) == "hi|"
    set_chat_template(model.tokenizer, "[{{ messages[0]['content'] }}]")
    assert model.tokenizer.decode(model.encode_messages(hi)) == "[hi]"


def serve_process(folder, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """A real `tandem serve` on a free port: the process, its URL and its curl line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_tandem.cli.main", "serve", "--model", str(folder),
         "--port", "0", "--drain-timeout", "1", "--log-level", "WARNING", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    banner = proc.stdout.readline()
    if " on http://127.0.0.1:" not in banner:
        proc.kill()
        raise AssertionError(banner + proc.stderr.read())
    assert ("; warmed up in " in banner) == ("--no-warmup" not in extra), banner
    return proc, banner.split(" on ")[1].split()[0], proc.stdout.readline()


def test_sigterm_drains_and_exits_zero(tmp_path):
    # a context no test can fill: the row cannot finish before the drain cuts it
    proc, url, curl = serve_process(make_tiny_model("llama", tmp_path / "m",
                                                    max_position_embeddings=1 << 20))
    try:
        assert "curl " + url + "/v1/chat/completions" in curl
        body = {"messages": MSG, "max_tokens": 1 << 18, "stream": True, "logit_bias": NO_EOS}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(4)]
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            events = sse_events(first + list(lines))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"  # cut at the drain timeout
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - signalled < 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
