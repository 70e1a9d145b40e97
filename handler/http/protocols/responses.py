"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/<id>) as a translation:

  body (+ the stored conversation of previous_response_id) -> a Chat Completions body ->
  openai.parse_chat -> Generation;  samples / events -> answer.parts / answer.blocks -> a
  `response` object / the Responses SSE events, each with its sequence_number.

Items -> chat: `instructions` -> a system message (not carried over from a previous response, as
OpenAI); `message` items by role (developer -> system); `function_call` -> an assistant message's
tool_calls; `function_call_output` -> a tool message (its call_id must name an earlier call);
`reasoning` items are dropped; an `input_image` part (`image_url`: a base64 data: URL, or http(s)
with option.allow_remote_images) -> an `image_url` part at its place (handler/http/protocols/media.py;
`file_id` is refused: no Files API here). `text.format` json_schema / json_object -> response_format (guided
decoding). A stored record is the response and its whole conversation as input items, so
previous_response_id continues it (handler/http/protocols/store.py bounds them).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from handler.engine.request import MAX_NEW_TOKENS, RequestError, bounded_float, bounded_int, show, validated, \
    warn_once
from handler.http.protocols import Generation, Sample, answer, media, openai

_STRICT = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str


class ImagePart(BaseModel):
    model_config = _STRICT
    type: Literal["input_image"]
    image_url: str = Field(None, min_length=1)
    file_id: str = None
    detail: Literal["auto", "low", "high"] = None


class MediaPart(BaseModel):
    """Declared to be refused by name (400)."""
    model_config = _STRICT
    type: Literal["input_file", "input_audio", "refusal"]


Part = Annotated[Union[TextPart, ImagePart, MediaPart], Field(discriminator="type")]


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: answer.text_or(Part, "input_text")


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: answer.text_or(Part, "input_text")


class ReasoningItem(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning"]


Item = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                 Field(discriminator="type")]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str = None
    parameters: dict = None
    strict: bool = None


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class FormatText(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict = Field(alias="schema")
    description: str = None
    strict: bool = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: Annotated[Union[FormatText, FormatJsonObject, FormatJsonSchema], Field(discriminator="type")] = None
    verbosity: str = None


class ReasoningConfig(BaseModel):
    model_config = _STRICT
    effort: str = None
    summary: str = None


def _foreground(v: bool) -> bool:
    if v:
        raise ValueError("background responses are not served: send background false or leave it out")
    return v


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""
    model_config = _STRICT
    model: str = None
    input: Annotated[list[Item], BeforeValidator(lambda v: _items(v), json_schema_input_type=Union[str, list[Item]])]
    instructions: str = None
    tools: list[FunctionTool] = None
    tool_choice: Union[Literal["auto", "none", "required"], FunctionChoice] = None
    max_output_tokens: bounded_int(1, MAX_NEW_TOKENS) = None
    temperature: bounded_float(0.0, 2.0) = None
    top_p: bounded_float(0.0, 1.0, lo_open=True) = None
    text: TextConfig = None
    reasoning: ReasoningConfig = None
    store: bool = None
    previous_response_id: str = None
    stream: bool = None
    background: Annotated[bool, AfterValidator(_foreground), WithJsonSchema({"const": False})] = None
    parallel_tool_calls: bool = None
    truncation: Literal["auto", "disabled"] = None
    metadata: dict = None
    user: str = None


TAGS = ("message", "function_call", "function_call_output", "reasoning", "input_text", "output_text", "input_image",
        "input_file", "input_audio", "refusal")
# Accepted and without effect here (docs/API.md).
_QUIET = {"include", "service_tier", "prompt_cache_key", "safety_identifier", "max_tool_calls", "stream_options",
          "top_logprobs", "conversation", "prompt"}


def _text(parts, where: str, images: bool = False):
    """A content's text, or with `images` (a user's message) its parts in order once an image is among
    them (Chat Completions' text and image_url parts)."""
    for k, p in enumerate(parts):
        if isinstance(p, MediaPart) or (isinstance(p, ImagePart) and not images):
            raise RequestError(f"{where}[{k}]", f"{p.type} parts are not supported"
                                                + (" here (images go in user messages)"
                                                   if isinstance(p, ImagePart) else ""))
        if isinstance(p, ImagePart) and p.image_url is None:
            raise RequestError(f"{where}[{k}]", "needs image_url (a base64 data: URL); file_id is not served "
                                                "(no Files API here)")
    if not any(isinstance(p, ImagePart) for p in parts):
        return "\n".join(p.text for p in parts)
    return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else
            {"type": "image_url", "image_url": {"url": p.image_url, **({"detail": p.detail} if p.detail else {})},
             media.WHERE: f"{where}[{k}]", media.WHERE + "_detail": f"{where}[{k}].detail"}
            for k, p in enumerate(parts)]


def _items(raw) -> list:
    """The input as items: a string is one user message; an item without `type` is a message."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if isinstance(raw, list):
        return [{"type": "message", **x} if isinstance(x, dict) and "type" not in x and "role" in x else x
                for x in raw]
    return raw


def _chat_messages(history: list, items: list, where: list[str], instructions: str | None) -> list[dict]:
    """history + items (validated) -> chat messages; `where[i]`: the request field of item i."""
    msgs = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    for it, at in zip(history + items, where):
        if isinstance(it, MessageItem):
            role = "system" if it.role == "developer" else it.role
            msgs.append({"role": role, "content": _text(it.content, f"{at}.content", images=role == "user")})
        elif isinstance(it, FunctionCallItem):
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(it.call_id)
        elif isinstance(it, FunctionCallOutputItem):
            if it.call_id not in calls:
                raise RequestError(f"{at}.call_id", f"{show(it.call_id)} names no earlier function_call "
                                                    f"(known: {', '.join(sorted(calls)) or 'none'})")
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output, f"{at}.output")})
    return msgs


def _check(payload) -> ResponsesRequest:
    if not isinstance(payload, dict):
        raise RequestError("body", "must be a JSON object")
    body = {k: v for k, v in payload.items() if v is not None}
    for name in body:
        if name not in ResponsesRequest.model_fields and name not in _QUIET:
            warn_once(f"responses:{name[:100]}", f"unknown Responses field {show(name)} dropped")
    return answer.checked(ResponsesRequest, {k: v for k, v in body.items() if k in ResponsesRequest.model_fields},
                          TAGS)


class _Items(BaseModel):
    model_config = _STRICT
    items: list[Item]


def parse(payload, tokenizer, server: openai.ServerOptions = openai.ServerOptions(), lookup=lambda rid: None
          ) -> Generation:
    """A Responses body -> Generation; lookup(id) -> the stored record of previous_response_id or None."""
    req = _check(payload)
    history: list = []
    if req.previous_response_id is not None:
        record = lookup(req.previous_response_id)
        if record is None:
            raise RequestError("previous_response_id", f"no stored response {show(req.previous_response_id)} "
                                                       "(unknown, deleted, evicted, or made with store: false)", 404)
        history = record["items"]
    items = list(req.input)
    where = ["previous_response_id"] * len(history) + [f"input[{i}]" for i in range(len(items))]
    earlier = list(validated(_Items, {"items": history}, "previous_response_id").items) if history else []
    msgs = _chat_messages(earlier, items, where, req.instructions)
    if not msgs or all(m["role"] == "system" for m in msgs):
        raise RequestError("input", "holds no message to answer")
    chat: dict = {"messages": msgs, "model": req.model}
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            **({"parameters": t.parameters} if t.parameters is not None else {})}} for t in req.tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        chat["tool_choice"] = c if isinstance(c, str) else {"type": "function", "function": {"name": c.name}}
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, FormatJsonSchema):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    if req.reasoning is not None and req.reasoning.effort is not None and server.reasoning != "none":
        chat["chat_template_kwargs"] = {"enable_thinking": req.reasoning.effort not in ("none", "minimal")}
    chat.update({k: getattr(req, k) for k in ("temperature", "top_p", "stream") if getattr(req, k) is not None})
    try:
        gen = openai.parse_chat(chat, tokenizer, server=server)
    except RequestError as e:
        raise RequestError(_renamed(e.field), e.message, e.status) from None
    gen.extra.update(protocol="responses", request=req, items=history + [i.model_dump(by_alias=True) for i in items],
                     fields={"inputs": "input", "parameters.max_new_tokens": "max_output_tokens"})
    return gen


def _renamed(field: str) -> str:
    for theirs, ours in (("response_format.json_schema.schema", "text.format.schema"),
                         ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
                         ("chat_template_kwargs", "reasoning")):
        if field.startswith(theirs):
            return ours + field[len(theirs):]
    if field.startswith("tools[") and ".function." in field:
        return field.replace(".function.", ".", 1)
    return field.replace("tool_choice.function.", "tool_choice.")


# ---- responses
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item(kind: str, text: str, head, status: str = "completed") -> dict:
    if kind == "reasoning":
        return {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}
    if kind == "text":
        return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
                "content": [_part("text", text)]}
    return {"type": "function_call", "id": _new_id("fc"), "call_id": head["id"], "name": head["name"],
            "arguments": text, "status": status}


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class Head:
    """A response's fixed fields, echoing the request."""

    def __init__(self, gen: Generation, model: str):
        req: ResponsesRequest = gen.extra["request"]
        self.id = _new_id("resp")
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else {"type": "text"}
        choice = req.tool_choice
        self.fields = {
            "id": self.id, "object": "response", "created_at": time.time(), "model": req.model or model,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "store": req.store is not False, "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": fmt}, "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice)
            else choice or "auto", "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": req.top_p if req.top_p is not None else 1.0, "truncation": req.truncation or "disabled",
            "user": req.user, "background": False, "error": None, "incomplete_details": None}

    def response(self, status: str, output: list, done=None, called: bool = False) -> dict:
        out = {**self.fields, "status": status, "output": output, "usage": None}
        if done is not None:
            if done.finish_reason == "length" and not called:
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            out["usage"] = {"input_tokens": done.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                            "output_tokens": done.generated_tokens,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": done.prompt_tokens + done.generated_tokens}
        return out


def record(gen: Generation, response: dict) -> dict:
    """What the store keeps: the response and its whole conversation as input items."""
    items = gen.extra["items"] + [{k: v for k, v in it.items() if k not in ("id", "status")}
                                  for it in response["output"]]
    return {"response": response, "items": items}


def encode(gen: Generation, samples: list[Sample], model: str) -> dict:
    chat = openai.encode(gen, samples, model)
    output = [_item(k, t, h) for k, t, h in answer.parts(chat["choices"][0]["message"])]
    called = any(it["type"] == "function_call" for it in output)
    return Head(gen, model).response("completed", output, samples[0].done, called)


def stream(gen: Generation, events, model: str, on_done=lambda response: None):
    """The Responses event sequence; on_done(response) gets the final response (to store it)."""
    head = Head(gen, model)
    seq = 0
    output: list[dict] = []

    def ev(kind: str, **fields) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    yield ev("response.created", response=head.response("in_progress", []))
    yield ev("response.in_progress", response=head.response("in_progress", []))
    for b in answer.blocks(gen, events):
        if b[0] == "start":
            item = _item(b[1], "", b[2], "in_progress")
            if b[1] != "call":
                item["content"] = []
            output.append(item)
            at = {"output_index": len(output) - 1}
            yield ev("response.output_item.added", item=item, **at)
            if b[1] != "call":
                yield ev("response.content_part.added", item_id=item["id"], content_index=0,
                         part=_part(b[1], ""), **at)
        elif b[0] == "delta":
            item = output[-1]
            at = {"item_id": item["id"], "output_index": len(output) - 1}
            if b[1] == "call":
                yield ev("response.function_call_arguments.delta", delta=b[2], **at)
            elif b[1] == "text":
                yield ev("response.output_text.delta", content_index=0, delta=b[2], logprobs=[], **at)
            else:
                yield ev("response.reasoning_text.delta", content_index=0, delta=b[2], **at)
        elif b[0] == "stop":
            kind, whole = b[1], b[2]
            item = output[-1]
            at = {"item_id": item["id"], "output_index": len(output) - 1}
            if kind == "call":
                item.update(arguments=whole, status="completed")
                yield ev("response.function_call_arguments.done", arguments=whole, name=item["name"], **at)
            else:
                part = _part(kind, whole)
                if kind == "text":
                    yield ev("response.output_text.done", content_index=0, text=whole, logprobs=[], **at)
                else:
                    yield ev("response.reasoning_text.done", content_index=0, text=whole, **at)
                yield ev("response.content_part.done", content_index=0, part=part, **at)
                item.update(content=[part], status="completed")
            yield ev("response.output_item.done", item=item, output_index=len(output) - 1)
        elif b[0] == "end":
            response = head.response("completed", output, b[1], b[2])
            on_done(response)
            yield ev("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                     response=response)
        else:
            yield ev("error", code=str(b[1].status), message=b[1].message, param=None)


def deleted(rid: str) -> dict:
    return {"id": rid, "object": "response", "deleted": True}


MAX_LIST = 100      # OpenAI's bounds for a page of input items (limit 1..100, 20 by default)


def input_items(record: dict, rid: str, args) -> dict:
    """GET /v1/responses/<id>/input_items: OpenAI's list of the items the response answered (the
    previous responses' conversation included), `args` its query (limit, order (desc by default),
    after: an item id). An item keeps its id, or gets `<response id>_item_<position>` (stable)."""
    outputs = len(record["response"]["output"])
    items = [{"id": it.get("id") or f"{rid}_item_{i}", **{k: v for k, v in it.items() if k != "id"}}
             for i, it in enumerate(record["items"][:len(record["items"]) - outputs])]
    limit = args.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= MAX_LIST):
        raise RequestError("limit", f"must be an integer in 1..{MAX_LIST}, got {show(limit)}")
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError("order", f"must be asc or desc, got {show(order)}")
    if order == "desc":
        items.reverse()
    after = args.get("after")
    if after is not None:
        at = next((i for i, it in enumerate(items) if it["id"] == after), None)
        if at is None:
            raise RequestError("after", f"{show(after)} is no input item of response {show(rid)}")
        items = items[at + 1:]
    page = items[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}
