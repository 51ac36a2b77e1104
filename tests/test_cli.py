"""The `tandem` CLI: --json output, mlx_lm-compatible flags, one-line errors and exit codes."""

import argparse
import json
import subprocess
import sys

import pytest

from mlx_tandem.cli.main import build_parser, main
from mlx_tandem.models.tiny import make_tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("cli") / "m", max_position_embeddings=64
    )


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json(capsys, tiny_folder):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_folder),
        "--prompt",
        "hi",
        "--max-tokens",
        "6",
        "--json",
    )
    assert code == 0
    obj = json.loads(out)
    assert len(obj["tokens"]) == 6 and obj["finish_reason"] == "length"
    # chat template applied: <|user|>hi<|assistant|>
    assert obj["prompt_tokens"][0] == 258 and obj["prompt_tokens"][-1] == 259
    assert set(obj["timing"]) >= {"ttft_s", "prompt_tps", "generation_tps"}


def test_generate_ignore_chat_template_and_verbose_false(capsys, tiny_folder):
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_folder),
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
        "--ignore-chat-template",
        "--json",
    )
    assert code == 0 and json.loads(out)["prompt_tokens"] == tiny_tokenizer().encode("hi").ids
    code, out, _ = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_folder),
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
        "--verbose",
        "False",
    )
    assert code == 0 and "==========" not in out and "Generation:" not in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--model", "/nonexistent/x.gguf"], "GGUF file not found"),
        (["--temp", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--max-tokens", "100"], "context window"),
        (["--logit-bias", "[1]"], "logit-bias"),
        (["--logit-bias", '{"5": true}'], "--logit-bias: the bias of token 5 must be a number"),
        (["--logit-bias", '{"5": 1, "05": 2}'], "--logit-bias: token 5 is named twice"),
        (["--dtype", "q4"], "re-quantizes GGUF imports only"),
    ],
)
def test_errors_are_one_line(capsys, tiny_folder, argv, needle):
    base = ["generate", "--model", str(tiny_folder), "--prompt", "hello", "--max-tokens", "4"]
    code, _, err = run_cli(capsys, *base, *argv)
    assert code == 2
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_error_from_a_real_process_has_no_traceback(tmp_path):
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(b"GGUF\x03\x00")
    done = subprocess.run(
        [sys.executable, "-m", "mlx_tandem.cli.main", "generate", "--model", str(bad)],
        capture_output=True,
        text=True,
        env={"TANDEM_HOME": str(tmp_path), "PATH": ""},
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "truncated or corrupt" in done.stderr


def test_doctor_and_models(capsys):
    code, out, _ = run_cli(capsys, "doctor", "--size", "64")
    assert code == 0 and "blas:" in out and "GFLOP/s" in out
    code, out, _ = run_cli(capsys, "models")
    assert code == 0 and "smollm2-135m" in out and "gemma3-270m" in out


def test_batch_json_lines_equal_each_prompt_alone(capsys, tiny_folder):
    base = ["generate", "--model", str(tiny_folder), "--max-tokens", "6", "--json"]
    code, out, _ = run_cli(capsys, *base, "-p", "hi", "-p", "a longer prompt", "-p", "x")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    for r, text in zip(rows, ["hi", "a longer prompt", "x"], strict=True):
        code, single, _ = run_cli(capsys, *base, "-p", text, "--engine", "rows")
        assert code == 0 and json.loads(single)["tokens"] == r["tokens"]


def test_prompts_file_and_engine_flag_errors(capsys, tiny_folder, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("one\n\ntwo\n")
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_folder), "--prompts-file", str(f),
                           "--max-tokens", "3", "--json")
    assert code == 0 and len(out.splitlines()) == 2
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_folder), "-p", "a", "-p", "b",
                           "--engine", "plain")
    assert code == 2 and "--engine plain" in err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_folder), "-p", "a", "-p", "b",
                           "--max-rows", "0")
    assert code == 2 and "max_rows" in err


def test_rows_engine_options_choose_the_rows_engine(capsys, tiny_folder):
    """--max-rows (or --prefill-chunk, --memory-budget) with one prompt runs the rows engine,
    which reads them, instead of the plain path, which would not."""
    base = ["generate", "--model", str(tiny_folder), "-p", "hello", "--max-tokens", "3", "--json"]
    code, out, _ = run_cli(capsys, *base)
    assert code == 0 and "peak_memory_gb" in json.loads(out)["timing"]  # the plain path's
    code, out, _ = run_cli(capsys, *base, "--max-rows", "2")
    assert code == 0 and "peak_memory_gb" not in json.loads(out)["timing"]
    assert json.loads(out)["index"] == 0  # both paths' objects carry it


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--memory-budget", "inf"], "--memory-budget: memory size 'inf' is not a number"),
        (["--memory-budget", "1K", "--engine", "rows"], "the budget is 1.0 KiB"),
        (["--memory-budget", "-1"], "--memory-budget: memory size '-1' must be positive"),
        (["--chat-template-config", '{"add_generation_prompt": false}'],
         "--chat-template-config may not set 'add_generation_prompt'"),
        (["--chat-template-config", '{"tokenize": true}'], "may not set 'tokenize'"),
        (["--chat-template-config", '{"conversation": []}'], "may not set 'conversation'"),
        (["--prompts-file", "/dev/null"], "--prompts-file /dev/null: no prompts"),
        (["--logit-bias", "notjson"],
         "--logit-bias must be a JSON object mapping token ids to biases"),
        (["--logprobs", "2"], "--logprobs are reported in --json output"),
        (["--engine", "plain", "--max-rows", "2"], "--max-rows: rows engine options"),
        (["-p", "-", "-p", "-"], "reads stdin once"),
    ],
)
def test_bad_option_values_are_one_line_errors(capsys, tiny_folder, argv, needle):
    base = ["generate", "--model", str(tiny_folder), "--prompt", "hello", "--max-tokens", "4"]
    code, out, err = run_cli(capsys, *base, *argv)
    assert code == 2 and out == ""
    assert err.startswith("tandem: error: ") and needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", False), ("no", False), ("OFF", False), ("False", False), ("f", False),
     ("1", True), ("yes", True), ("On", True), ("TRUE", True), ("T", True)],
)
def test_boolean_flags_take_exactly_the_usual_spellings(text, value):
    from mlx_tandem.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--batch-invariant", text, "--verbose", text])
    assert args.batch_invariant is value and args.verbose is value


@pytest.mark.parametrize("text", ["maybe", "n", ""])
def test_boolean_flags_refuse_anything_else(capsys, text):
    from mlx_tandem.cli.main import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "--batch-invariant", text])
    assert exit_.value.code == 2
    assert "argument --batch-invariant: expected true/false" in capsys.readouterr().err


def test_draft_model_none_is_no_drafter(capsys, tiny_folder):
    base = ["generate", "--model", str(tiny_folder), "-p", "hi", "--max-tokens", "4", "--json"]
    code, plain, _ = run_cli(capsys, *base)
    assert code == 0
    for spelling in ("none", "None"):
        code, out, err = run_cli(capsys, *base, "--draft-model", spelling)
        assert code == 0, err
        assert json.loads(out)["tokens"] == json.loads(plain)["tokens"]


def test_batch_verbose_false_prints_only_the_text(capsys, tiny_folder):
    base = ["generate", "--model", str(tiny_folder), "-p", "a", "-p", "b", "--max-tokens", "3"]
    code, out, _ = run_cli(capsys, *base, "--verbose", "False")
    assert code == 0 and "==========" not in out and "Rows engine" not in out
    code, loud, _ = run_cli(capsys, *base)
    assert code == 0 and "========== [1]" in loud


def test_chat_json_schema_runs_constrained_turns(capsys, monkeypatch, tiny_folder):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/reset\nhello\n"))
    code, out, err = run_cli(
        capsys, "chat", "--model", str(tiny_folder), "--max-tokens", "6", "--json-schema", "object"
    )
    assert code == 0 and "error" not in err, err
    replies = out.splitlines()
    assert len(replies) == 2 and all(r.startswith("{") for r in replies), out


def test_chat_defaults_are_mlx_lm_chats_and_a_session_replays(capsys, monkeypatch, tiny_folder):
    """256 tokens a turn and seed 0, as mlx_lm.chat: the same turns, sampled, reply the same."""
    import io

    from mlx_lm.chat import setup_arg_parser

    theirs = setup_arg_parser().parse_args([])
    chat = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    ours = chat.choices["chat"].parse_args([])
    assert (ours.max_tokens, ours.seed) == (theirs.max_tokens, theirs.seed) == (256, 0)
    replies = []
    for _ in range(2):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhello\n"))
        code, out, _ = run_cli(capsys, "chat", "--model", str(tiny_folder), "--max-tokens", "8",
                               "--temp", "1.0")
        assert code == 0
        replies.append(out)
    assert replies[0] == replies[1] and replies[0].strip()


@pytest.mark.parametrize("minutes", ["inf", "0", "-1", "nan"])
def test_distill_refuses_minutes_that_are_not_a_positive_finite_number(capsys, minutes):
    with pytest.raises(SystemExit) as exit_:
        main(["distill", "--target", "x", "--out", "y", "--minutes", minutes])
    assert exit_.value.code == 2 and "positive finite number" in capsys.readouterr().err


def test_sigterm_ends_a_command_like_ctrl_c_and_its_cleanup_runs(capsys, monkeypatch):
    """A SIGTERM mid-command (e.g. a GGUF conversion) unwinds through `finally` blocks, so
    nothing half-written stays behind, and exits 143 with one line."""
    import os
    import signal

    from mlx_tandem.cli import models

    cleaned = []

    def run(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            return 0
        finally:
            cleaned.append(True)

    monkeypatch.setattr(models, "run", run)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["models"]) == 143 and cleaned == [True]
    assert capsys.readouterr().err == "tandem: terminated\n"
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back


@pytest.mark.parametrize(("flag", "value"), [("--data-minutes", "-1"), ("--data-minutes", "inf"),
                                             ("--max-steps", "-1"), ("--first-prompt", "-2"),
                                             ("--dtype", "f16")])  # fmt: skip
def test_distill_refuses_bad_values_before_loading_anything(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["distill", "--target", "nowhere", flag, value])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err
