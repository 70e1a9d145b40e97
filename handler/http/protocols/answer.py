"""One chat answer as a sequence of blocks, whole or streamed: what Anthropic's Messages and OpenAI's
Responses share. Both protocols translate their body into a Chat Completions body (openai.parse_chat
renders it, with its tools, reasoning parser and guided decoding); the answer comes back here as

  ("reasoning", text, None)              the thinking (option.reasoning_parser)
  ("text", text, None)                   the answer's text
  ("call", arguments, {"id", "name"})    a tool call (arguments: JSON text)

Streamed, `blocks` turns the engine's events into block events, in order:
  ("start", kind, head)  ("delta", kind, piece)  ("stop", kind, whole, head)  ... then
  ("end", DoneEvent, called) or ("error", ErrorEvent)
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from typing import Annotated, Union

from pydantic import BeforeValidator

from handler.engine.request import RequestError, validated
from handler.engine.types import ErrorEvent
from handler.http.protocols import openai


def text_or(parts, text_type: str):
    """A field that takes a string or a list of `parts`: a string is one {"type": text_type, "text": ...}
    part, so a bad part's error names its place (a plain Union reports the string branch first)."""
    def wrap(v):
        return [{"type": text_type, "text": v}] if isinstance(v, str) else v
    return Annotated[list[parts], BeforeValidator(wrap, json_schema_input_type=Union[str, list[parts]])]


@lru_cache(maxsize=4)
def model_sampling(model_dir: str) -> dict:
    """The sampling the model's generation_config.json asks for, as Chat Completions fields:
    {"temperature": 0} (greedy: transformers' default, do_sample false) or its temperature / top_p /
    top_k. For clients that send none (the anthropic SDK 2.x types none of them)."""
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            gc = json.load(f)
    except (OSError, ValueError):
        gc = {}
    if not isinstance(gc, dict) or gc.get("do_sample") is not True:
        return {"temperature": 0.0}
    out = {"temperature": gc.get("temperature", 1.0), "top_p": gc.get("top_p", 1.0), "top_k": gc.get("top_k", 50)}
    return {k: v for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def checked(model, values: dict, tags: tuple[str, ...]):
    """validated(model, values) for a body with blocks told apart by `type` (one of `tags`): an error
    names the block's place without pydantic's tag step (content[0].text, not content[0].text.text),
    and an unknown type lists the known ones."""
    try:
        return validated(model, values, "", {k: k for k in values})
    except RequestError as e:
        field = re.sub(r"\[(\d+)\]\.(?:" + "|".join(tags) + r")(?=\.)", r"[\1]", e.field)
        message = e.message
        if message.startswith("Input tag "):
            message = f"has an unknown type; allowed: {', '.join(tags)}, got {message.split(chr(39))[1]!r}"
        elif message.startswith("Unable to extract tag"):
            message = f"needs a `type`: one of {', '.join(tags)}"
        raise RequestError(field, message, e.status) from None


def parts(message: dict) -> list[tuple]:
    """A chat.completion message -> its blocks."""
    out = []
    if message.get("reasoning_content"):
        out.append(("reasoning", message["reasoning_content"], None))
    if message.get("content"):
        out.append(("text", message["content"], None))
    for c in message.get("tool_calls") or ():
        out.append(("call", c["function"]["arguments"], {"id": c["id"], "name": c["function"]["name"]}))
    return out


def _pieces(delta: dict):
    """A ChoiceStream delta -> (kind, piece, head or None)."""
    if delta.get("reasoning_content"):
        yield "reasoning", delta["reasoning_content"], None
    if delta.get("content"):
        yield "text", delta["content"], None
    for tc in delta.get("tool_calls") or ():
        head = {"id": tc["id"], "name": tc["function"]["name"]} if tc.get("id") else None
        yield "call", tc.get("function", {}).get("arguments") or "", head


def blocks(gen, events):
    """The block events of one choice's stream (the events of api.stream_events)."""
    st = openai.ChoiceStream(gen.extra.get("tools"), gen.extra.get("reasoning"))
    kind, whole, head = None, "", None
    for _p, _s, ev in events:
        if isinstance(ev, ErrorEvent):
            yield "error", ev
            return
        deltas = st.feed(ev.text)
        called = False
        if ev.done is not None:
            last, called = st.finish()
            deltas += last
        for d in deltas:
            for k, piece, h in _pieces(d):
                if k != kind or h is not None:      # a new kind, or the next call: a new block
                    if kind is not None:
                        yield "stop", kind, whole, head
                    if not piece and h is None:
                        kind = None
                        continue
                    kind, whole, head = k, "", h
                    yield "start", kind, head
                if piece:
                    whole += piece
                    yield "delta", kind, piece
        if ev.done is not None:
            if kind is not None:
                yield "stop", kind, whole, head
            yield "end", ev.done, called
            return


def arguments(text: str) -> dict:
    """A call's JSON arguments as an object (a non-object is wrapped, as {"value": ...})."""
    try:
        v = json.loads(text) if text else {}
    except ValueError:
        return {"value": text}
    return v if isinstance(v, dict) else {"value": v}
