"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as a translation:

  body -> (pydantic models below) -> a Chat Completions body -> openai.parse_chat -> Generation
  samples / events -> answer.parts / answer.blocks -> a `message` object / Anthropic's SSE events

Anthropic -> chat: `system` -> a system message; a user turn's `tool_result` blocks -> `tool`
messages (before its text); an assistant turn's `tool_use` blocks -> `tool_calls`; `thinking`
blocks of earlier turns are dropped (templates drop them too); `tools[].input_schema` ->
`parameters`; tool_choice auto/any/tool/none -> auto/required/named/none; `thinking` -> the
template's enable_thinking (its blocks come from option.reasoning_parser); an `image` block (a
base64 or, with option.allow_remote_images, url source) -> an `image_url` part at its place
(handler/http/protocols/media.py decodes it, errors naming the block). Documents are refused (400),
and so are images inside tool results.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from handler.engine.request import MAX_NEW_TOKENS, MAX_STOP_LENGTH, RequestError, TopK, bounded_float, bounded_int, show, warn_once
from handler.http.protocols import Generation, Sample, answer, media, openai, reasoning

_STRICT = ConfigDict(strict=True, extra="ignore")   # extra: cache_control, citations, ... accepted


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class Base64Source(BaseModel):
    model_config = _STRICT
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class UrlSource(BaseModel):
    model_config = _STRICT
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(BaseModel):
    model_config = _STRICT
    type: Literal["image"]
    source: Annotated[Union[Base64Source, UrlSource], Field(discriminator="type")]


class MediaBlock(BaseModel):
    """Declared to be refused by name (400)."""
    model_config = _STRICT
    type: Literal["document", "search_result"]


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: answer.text_or(Annotated[Union[TextBlock, ImageBlock, MediaBlock], Field(discriminator="type")],
                            "text") = []
    is_error: bool = False


class ThinkingBlock(BaseModel):
    model_config = _STRICT
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[Union[TextBlock, ImageBlock, MediaBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock],
                  Field(discriminator="type")]


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: answer.text_or(Block, "text")


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["custom"] = "custom"    # server tools (web_search_*, bash_*, ...) are not ours to run
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str = None
    input_schema: dict


class ToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str = Field(None, min_length=1)
    disable_parallel_tool_use: bool = None


class Thinking(BaseModel):
    model_config = _STRICT
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: bounded_int(1, MAX_NEW_TOKENS) = None


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens."""
    model_config = _STRICT
    model: str = None
    messages: list[Message] = Field(min_length=1)
    system: answer.text_or(TextBlock, "text") = None
    tools: list[Tool] = None
    tool_choice: ToolChoice = None
    thinking: Thinking = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""
    max_tokens: bounded_int(1, MAX_NEW_TOKENS)
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]] = Field(None, max_length=16)
    stream: bool = None
    temperature: bounded_float(0.0, 1.0) = None
    top_p: bounded_float(0.0, 1.0, lo_open=True) = None
    top_k: TopK = None
    metadata: dict = None
    output_config: dict = None
    service_tier: str = None


TAGS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document", "search_result")
# Accepted and without effect here (docs/API.md).
_QUIET = {"metadata", "output_config", "service_tier", "container", "mcp_servers", "context_management"}
STOP = {"eos_token": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def _text(blocks) -> str:
    return "\n".join(b.text for b in blocks if isinstance(b, TextBlock))


def _refuse_media(block, where: str, images: str | None = None) -> None:
    """Documents always; images where `images` says why not (None: they are taken here)."""
    if isinstance(block, MediaBlock):
        raise RequestError(where, f"{block.type} blocks are not supported")
    if isinstance(block, ImageBlock) and images is not None:
        raise RequestError(where, f"image blocks are not taken {images}")


def _image_part(block: ImageBlock, where: str) -> dict:
    """An image block -> Chat Completions' image_url part, naming its block for errors."""
    src = block.source
    url = media.data_url(src.media_type, src.data) if isinstance(src, Base64Source) else src.url
    return {"type": "image_url", "image_url": {"url": url}, media.WHERE: where}


def _chat_messages(req: CountTokensRequest) -> list[dict]:
    msgs = []
    if req.system:
        msgs.append({"role": "system", "content": _text(req.system)})
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        blocks = m.content
        where = f"messages[{i}].content"
        text, uses = [], []     # text: strings, or parts once an image is among them
        for j, b in enumerate(blocks):
            _refuse_media(b, f"{where}[{j}]", None if m.role == "user" else "in assistant messages")
            if isinstance(b, TextBlock):
                text.append(b.text)
            elif isinstance(b, ImageBlock):
                text.append(_image_part(b, f"{where}[{j}]"))
            elif isinstance(b, ToolUseBlock):
                if m.role != "assistant":
                    raise RequestError(f"{where}[{j}]", "tool_use blocks belong to assistant messages")
                uses.append({"id": b.id, "type": "function",
                             "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
                calls.add(b.id)
            elif isinstance(b, ToolResultBlock):
                if m.role != "user":
                    raise RequestError(f"{where}[{j}]", "tool_result blocks belong to user messages")
                if b.tool_use_id not in calls:
                    raise RequestError(f"{where}[{j}].tool_use_id",
                                       f"{show(b.tool_use_id)} names no tool_use block of an earlier assistant "
                                       f"message (known: {', '.join(sorted(calls)) or 'none'})")
                for k, c in enumerate(b.content):
                    _refuse_media(c, f"{where}[{j}].content[{k}]", "inside tool_result (send the image in "
                                                                   "the user's content)")
                result = _text(b.content)
                msgs.append({"role": "tool", "tool_call_id": b.tool_use_id,
                             "content": f"Error: {result}" if b.is_error else result})
        if m.role == "assistant":
            msg = {"role": "assistant", "content": "\n".join(text) if text else None}
            if uses:
                msg["tool_calls"] = uses
            msgs.append(msg)
        elif text and all(isinstance(t, str) for t in text):
            msgs.append({"role": "user", "content": "\n".join(text)})
        elif text:      # with images: the parts in order
            msgs.append({"role": "user", "content": [{"type": "text", "text": t} if isinstance(t, str) else t
                                                     for t in text]})
    return msgs


def _tool_choice(req: CountTokensRequest):
    c = req.tool_choice
    if c is None:
        return None
    if c.type == "tool":
        if not c.name:
            raise RequestError("tool_choice.name", "is required when tool_choice.type is \"tool\"")
        return {"type": "function", "function": {"name": c.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[c.type]


# Chat Completions field -> ours, for the errors openai.parse_chat raises.
_FIELDS = ((re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
           (re.compile(r"^tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
           (re.compile(r"^tool_choice\.function\.name$"), "tool_choice.name"),
           (re.compile(r"^stop$"), "stop_sequences"),
           (re.compile(r"^(response_format|chat_template_kwargs)"), "thinking"))


def _renamed(e: RequestError) -> RequestError:
    field = e.field
    for theirs, ours in _FIELDS:
        field = theirs.sub(ours, field)
    return RequestError(field, e.message, e.status)


def _check(payload, model: type[CountTokensRequest]) -> CountTokensRequest:
    if not isinstance(payload, dict):
        raise RequestError("body", "must be a JSON object")
    body = {k: v for k, v in payload.items() if v is not None}
    for name in body:
        if name not in model.model_fields and name not in _QUIET:
            warn_once(f"anthropic:{name[:100]}", f"unknown Messages field {show(name)} dropped")
    return answer.checked(model, {k: v for k, v in body.items() if k in model.model_fields}, TAGS)


def parse(payload, tokenizer, server: openai.ServerOptions = openai.ServerOptions(),
          count: bool = False, sampling: dict | None = None) -> Generation:
    """A Messages body (count: a count_tokens body, which has no max_tokens) -> Generation.
    sampling: what a body without temperature, top_p and top_k gets (answer.model_sampling:
    the model's generation config); None: Anthropic's default, temperature 1."""
    req = _check(payload, CountTokensRequest if count else MessagesRequest)
    chat: dict = {"messages": _chat_messages(req), "model": req.model,
                  "max_tokens": 1 if count else req.max_tokens}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema, **({"description": t.description} if t.description else {})}}
            for t in req.tools]
    choice = _tool_choice(req)
    if choice is not None:
        chat["tool_choice"] = choice
    if req.thinking is not None and server.reasoning != "none":
        chat["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if not count:
        given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k") if getattr(req, k) is not None}
        chat.update(given or sampling or {})
        if req.stream is not None:
            chat["stream"] = req.stream
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
    try:
        gen = openai.parse_chat(chat, tokenizer, server=server)
    except RequestError as e:
        raise _renamed(e) from None
    if not count and req.thinking is not None and req.thinking.type == "enabled" and req.thinking.budget_tokens \
            and server.reasoning != "none":
        budget = thinking_budget(req.thinking.budget_tokens, server.reasoning, tokenizer)
        if budget is not None:
            gen.params = dataclasses.replace(gen.params, thinking_budget=budget)
    gen.extra.update(protocol="anthropic", fields={"inputs": "messages", "parameters.max_new_tokens": "max_tokens"})
    return gen


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def thinking_budget(tokens: int, parser: str, tokenizer) -> tuple[int, int, int | None] | None:
    """SamplingParams.thinking_budget for budget_tokens: the reasoning parser's close tag must be one token
    of this tokenizer (Qwen3's and DeepSeek-R1's are); otherwise the budget is not enforced (warned once)."""
    close = _single_token(tokenizer, reasoning.CLOSE)
    if close is None:
        warn_once("thinking-budget", f"thinking.budget_tokens is not enforced: {reasoning.CLOSE} is not one token "
                                     "of this model's tokenizer")
        return None
    opener = _single_token(tokenizer, reasoning.OPEN) if parser == "qwen3" else None
    if parser == "qwen3" and opener is None:
        return None
    return tokens, close, opener


# ---- responses
def _id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _block(kind: str, text: str, head) -> dict:
    if kind == "reasoning":
        return {"type": "thinking", "thinking": text, "signature": ""}
    if kind == "text":
        return {"type": "text", "text": text}
    return {"type": "tool_use", "id": "toolu_" + head["id"].removeprefix("call_"), "name": head["name"],
            "input": answer.arguments(text)}


def _stop(done, called: bool) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    reason = STOP.get(done.finish_reason, "end_turn")
    if reason == "stop_sequence" and done.stop_string is None:    # a stop token id: no string to name
        reason = "end_turn"
    return reason, done.stop_string if reason == "stop_sequence" else None


def _usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _head(gen: Generation, model: str) -> dict:
    return {"id": _id(), "type": "message", "role": "assistant", "model": gen.extra.get("model") or model}


def encode(gen: Generation, samples: list[Sample], model: str) -> dict:
    chat = openai.encode(gen, samples, model)
    message = chat["choices"][0]["message"]
    done = samples[0].done
    blocks = [_block(k, t, h) for k, t, h in answer.parts(message)]
    reason, seq = _stop(done, any(b["type"] == "tool_use" for b in blocks))
    return {**_head(gen, model), "content": blocks, "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(done.prompt_tokens, done.generated_tokens)}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


_DELTA = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "call": ("input_json_delta", "partial_json")}


def stream(gen: Generation, events, model: str):
    """Anthropic's event sequence: message_start, ping, per block content_block_start / _delta /
    _stop, message_delta (stop reason, usage), message_stop; an engine error is an `error` event."""
    prompt = gen.prompt_tokens[0] if gen.prompt_tokens else 0
    yield _sse({"type": "message_start", "message": {
        **_head(gen, model), "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt, 0)}})
    yield _sse({"type": "ping"})
    index = -1
    for ev in answer.blocks(gen, events):
        if ev[0] == "start":
            index += 1
            _kind, kind, head = ev
            block = _block(kind, "", head)
            if kind == "call":
                block["input"] = {}
            yield _sse({"type": "content_block_start", "index": index, "content_block": block})
        elif ev[0] == "delta":
            name, key = _DELTA[ev[1]]
            yield _sse({"type": "content_block_delta", "index": index, "delta": {"type": name, key: ev[2]}})
        elif ev[0] == "stop":
            if ev[1] == "reasoning":
                yield _sse({"type": "content_block_delta", "index": index,
                            "delta": {"type": "signature_delta", "signature": ""}})
            yield _sse({"type": "content_block_stop", "index": index})
        elif ev[0] == "end":
            done, called = ev[1], ev[2]
            reason, seq = _stop(done, called)
            yield _sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": done.generated_tokens}})
            yield _sse({"type": "message_stop"})
        else:
            status, message = ev[1].status, ev[1].message
            yield _sse(error_body(status, message))


def count_tokens(n: int) -> dict:
    return {"input_tokens": n}


# ---- errors: Anthropic's shape and status codes
_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
           404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
           415: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def status(code: int) -> int:
    """Our status -> Anthropic's: a full queue or a loading model is 529 (overloaded); the model failing 500."""
    return {503: 529, 424: 500}.get(code, code)


def error_body(code: int, message: str, field: str | None = None) -> dict:
    kind = _ERRORS.get(status(code), "api_error")
    return {"type": "error", "error": {"type": kind, "message": f"{field}: {message}" if field else message}}
