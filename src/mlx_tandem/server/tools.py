"""Tool calls: split a row's generated text into content and tool calls, as it streams.

Owns the text side of tool calling. A model has tool calling when mlx-lm's tokenizer
loader inferred a tool parser for it (`TokenizerWrapper.has_tool_calling`, from the chat
template or vocabulary); its markers (`tool_call_start`/`tool_call_end`, e.g.
`<tool_call>`...`</tool_call>`) delimit each call and mlx-lm's parser turns the text
between them into `{"name", "arguments"}`. `ToolCallStream` never releases text that may
still be the start of a marker, so a streamed client sees exactly the content a
non-streamed one does. A call the parser rejects (e.g. cut by max_tokens) is returned as
plain content rather than dropped.

Oracle: tests/test_server_tools.py (a tool-call round trip, streamed and not).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from mlx_tandem.engine.constraint import TOOL_JSON_LAYOUT
from mlx_tandem.engine.sampling import Grammar

log = logging.getLogger("mlx_tandem.server")


def tool_support(tokenizer: Any) -> tuple[str, str, Callable[..., Any]] | None:
    """(start marker, end marker, parser) when the model has tool calling, else None."""
    if not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
        return None
    return tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser


JSON_TOOLS = "mlx_lm.tool_parsers.json_tools"  # <tool_call>{"name": ..., "arguments": ...}</tool_call>


def forced_call_grammar(tokenizer: Any, tools: list[dict[str, Any]], name: str | None) -> Grammar:
    """tool_choice `required` (name None) or a named function: the reply is one tool call
    whose arguments follow the function's JSON schema. ValueError when the model's call
    layout is not one this grammar writes, or the name is not among the tools."""
    parser = tokenizer.tool_parser
    if getattr(parser, "__module__", "") != JSON_TOOLS:
        raise ValueError(
            f"forcing a tool call needs the json_tools call layout; this model's parser is "
            f"{getattr(parser, '__module__', parser)!r} (use tool_choice 'auto')"
        )
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    bodies = [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": f["name"]},
                        "arguments": f.get("parameters") or {"type": "object"}}}
        for f in functions
    ]  # fmt: skip
    schema = {**(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}), "x-guidance": TOOL_JSON_LAYOUT}
    start = _marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = _marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    lark = f'start: {start} "\\n"? call "\\n"? {end}\n'
    return Grammar("lark", lark + f"call: %json {json.dumps(schema)}\n")


def _marker(text: str, ids: tuple[int, ...] | None) -> str:
    """A call marker in Lark: its token when it is one (added tokens are matched by id,
    as the model writes them), else its text."""
    return f"<[{ids[0]}]>" if ids and len(ids) == 1 else json.dumps(text)


def format_call(parsed: dict[str, Any], index: int | None = None) -> dict[str, Any]:
    """OpenAI's tool-call object; `index` is set in streamed deltas."""
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    out: dict[str, Any] = {
        "id": str(parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
        "type": "function",
        "function": {"name": str(parsed.get("name", "")), "arguments": arguments},
    }
    if index is not None:
        out["index"] = index
    return out


class ToolCallStream:
    """Feed text deltas; get back (content to emit now, tool calls completed now)."""

    def __init__(
        self, start: str, end: str, parser: Callable[..., Any], tools: list[dict] | None
    ) -> None:
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self.buffer = ""
        self.in_call = False
        self.count = 0  # tool calls returned so far

    def feed(self, text: str, streaming: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(self.start)
                if at < 0:
                    keep = _partial_suffix(self.buffer, self.start)
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return content, calls
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(self.start) :]
                self.in_call = True
            at = self.buffer.find(self.end) if self.end else -1
            if at < 0:
                return content, calls
            body, self.buffer = self.buffer[:at], self.buffer[at + len(self.end) :]
            self.in_call = False
            parsed = self._parse(body)
            if parsed is None:
                content += self.start + body + self.end
            else:
                calls += self._format(parsed, streaming)

    def finish(self, streaming: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """End of the row: a call left open is parsed if it can be, else returned as text."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        parsed = self._parse(rest)
        if parsed is None:
            return self.start + rest, []
        return "", self._format(parsed, streaming)

    def _parse(self, body: str) -> list[dict[str, Any]] | None:
        try:
            parsed = self.parser(body, self.tools)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            log.warning("unparseable tool call (%s: %s): %r", type(err).__name__, err, body[:200])
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(p, dict) and "name" in p for p in items):
            return None
        return items

    def _format(self, parsed: list[dict[str, Any]], streaming: bool) -> list[dict[str, Any]]:
        out = []
        for p in parsed:
            out.append(format_call(dict(p), self.count if streaming else None))
            self.count += 1
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
