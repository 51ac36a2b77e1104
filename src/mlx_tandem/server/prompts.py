"""Request -> prompt token ids, off the event loop and bounded in time.

Owns chat-template rendering and tokenization for the server. Both run on a short-lived
worker thread (the event loop only awaits it), at most `SLOTS` at a time, and each job
has `prompt_timeout_s`: when it runs out the worker is interrupted (an asynchronous
exception, delivered at its next Python bytecode: Jinja templates are compiled Python,
so a runaway template loop stops) and the request gets a 400. Tokenization itself runs
in the tokenizer's native code, which releases the GIL.

What a request may pass to the template (`chat_template_kwargs`): plain variables, and
`add_generation_prompt` (a boolean, default true). `chat_template` only when the
operator allows request templates; the keys apply_chat_template uses for itself
(`tokenize`, `messages`, `tools`, ...) are refused by name. Template errors name the
request's problem (the template's own message), never our functions.

Oracle: tests/test_server_hostile.py (a nested-loop template bomb gets 400 within the
time limit while /health answers within 1 s; request templates refused by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jinja2

from mlx_tandem.server import schemas as S
from mlx_tandem.server.schemas import ApiError
from mlx_tandem.server.state import ServerState

log = logging.getLogger("mlx_tandem.server")

T = TypeVar("T")
SLOTS = 4  # prompt jobs running at once; more wait their turn on the event loop

# apply_chat_template's own arguments: a request may not set them through the kwargs
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "continue_final_message",
    }
)


class PromptTimeout(Exception):
    """Raised inside a prompt worker whose time is up."""


class PromptWorkers:
    """Runs prompt jobs on worker threads: at most SLOTS at once, each within a time limit."""

    def __init__(self, timeout_s: float, slots: int = SLOTS) -> None:
        self.timeout_s = timeout_s
        self.slots = slots
        self._sem: asyncio.Semaphore | None = None

    async def run(self, job: Callable[[], T], param: str | None) -> T:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        async with self._sem:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[T] = loop.create_future()
            running = threading.Event()
            worker = threading.Thread(
                target=_work, args=(loop, done, job, running), name="tandem-prompt", daemon=True
            )
            worker.start()
            try:
                return await asyncio.wait_for(asyncio.shield(done), self.timeout_s)
            except TimeoutError:
                raise ApiError(
                    400,
                    f"building the prompt (chat template and tokenizer) took longer than "
                    f"{self.timeout_s:g} s",
                    param,
                    code="prompt_timeout",
                ) from None
            finally:
                if not done.done():
                    done.add_done_callback(_consume)  # nobody awaits it any more
                    if running.is_set():
                        _interrupt(worker)


def _work(
    loop: asyncio.AbstractEventLoop,
    done: asyncio.Future[Any],
    job: Callable[[], Any],
    running: threading.Event,
) -> None:
    outcome: tuple[bool, Any]
    try:
        running.set()
        try:
            outcome = (True, job())
        finally:
            running.clear()  # an interrupt is sent only while the job runs
    except BaseException as err:
        outcome = (False, err)
    with contextlib.suppress(RuntimeError):  # the loop may be closed at shutdown
        loop.call_soon_threadsafe(_settle, done, outcome)


def _settle(done: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if done.done():
        return
    ok, value = outcome
    if ok:
        done.set_result(value)
    else:
        done.set_exception(value)


def _consume(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()


def _interrupt(worker: threading.Thread) -> None:
    if worker.ident is not None and worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(worker.ident), ctypes.py_object(PromptTimeout)
        )


# --- chat ------------------------------------------------------------------------------------


def template_kwargs(state: ServerState, body: S.ChatCompletionRequest) -> tuple[dict, bool]:
    """(kwargs for the template, add_generation_prompt), refusing what a request may not set."""
    given = dict(body.chat_template_kwargs or {})
    for key in given:
        if key in RESERVED_KWARGS:
            raise ApiError(
                400, f"chat_template_kwargs may not set {key!r}", f"chat_template_kwargs.{key}"
            )
    if "chat_template" in given and not state.options.allow_request_templates:
        raise ApiError(
            400,
            "this server does not accept chat templates in requests",
            "chat_template_kwargs.chat_template",
        )
    generation = given.pop("add_generation_prompt", True)
    if not isinstance(generation, bool):
        raise ApiError(
            400,
            "add_generation_prompt must be true or false",
            "chat_template_kwargs.add_generation_prompt",
        )
    kwargs = {**state.options.chat_template_args, **given}
    if body.tools and body.tool_choice != "none":
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    return kwargs, generation


def template_message(message: S.ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        out["content"] = "".join(part.text for part in content)
    elif content is None:
        out["content"] = ""
    for call in out.get("tool_calls", []):
        args = call["function"].get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # templates that expect text get the text
                call["function"]["arguments"] = json.loads(args)
    return out


async def chat_prompt(
    state: ServerState, workers: PromptWorkers, body: S.ChatCompletionRequest
) -> list[int]:
    messages = [template_message(m) for m in body.messages]
    kwargs, generation = template_kwargs(state, body)
    model = state.model

    def job() -> list[int]:
        try:
            return model.encode_messages(
                messages, template_kwargs=kwargs, add_generation_prompt=generation
            )
        except PromptTimeout:
            raise
        except jinja2.TemplateError as err:  # the template's own words (raise_exception too)
            raise ApiError(
                400, f"the chat template rejected the request: {err.message}", "messages"
            ) from None
        except UnicodeError:
            raise ApiError(400, "the messages are not valid Unicode text", "messages") from None
        except Exception as err:  # the template is data: a failure is the request's
            log.info("chat template failed: %s: %s", type(err).__name__, err)
            raise ApiError(
                400,
                "the chat template could not render these messages (check roles, content "
                "and chat_template_kwargs)",
                "messages",
            ) from None

    return await workers.run(job, "messages")


# --- text completions --------------------------------------------------------------------------


async def text_prompts(
    state: ServerState, workers: PromptWorkers, body: S.CompletionRequest
) -> tuple[list[list[int]], list[str]]:
    """(token ids per prompt, each prompt's text for `echo`, else empty strings)."""
    p = body.prompt
    if isinstance(p, str):
        items: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [list(p)]  # type: ignore[arg-type]
    else:
        items = list(p)  # type: ignore[arg-type]
    model = state.model

    vocab = model.graph.vocab_size

    def job() -> tuple[list[list[int]], list[str]]:
        try:
            prompts = [model.encode_text(x) if isinstance(x, str) else list(x) for x in items]
        except UnicodeError:
            raise ApiError(400, "the prompt is not valid Unicode text", "prompt") from None
        if not prompts or any(not ids for ids in prompts):
            raise ApiError(400, "prompt is empty: need at least one token", "prompt")
        if any(not 0 <= t < vocab for ids in prompts for t in ids):
            raise ApiError(
                400, f"prompt has a token id outside the vocabulary (size {vocab})", "prompt"
            )
        # echo: a text prompt as sent (encoding may add BOS); token ids as their text
        texts = ["" if not body.echo else x if isinstance(x, str)
                 else model.tokenizer.decode(ids) for x, ids in zip(items, prompts, strict=True)]
        return prompts, texts

    return await workers.run(job, "prompt")
