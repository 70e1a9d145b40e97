"""OpenAI's Chat Completions and Completions (POST /v1/chat/completions, /v1/completions,
GET /v1/models) and LMI's chat schema (`messages` on /invocations).

Request fields -> Generation (the chat template renders `messages`); samples -> `chat.completion` /
`text_completion` objects, or SSE chunks ending with `data: [DONE]`. On /v1 the finish reasons are
OpenAI's (`stop`, `length`); LMI's chat on /invocations keeps LMI's (`eos_token`, `stop_sequence`).
Sampling as OpenAI: temperature defaults to 1 (sampling); temperature 0 is greedy.
"""
from __future__ import annotations

import functools
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from handler.config import compat
from handler.engine import guide
from handler.engine.request import (MAX_NEW_TOKENS, MAX_PRIORITY, MAX_SAMPLES, MAX_SEED, MAX_TOP_N_TOKENS, BadWords, LogitBias,
                                    RequestError, SamplingParams, Stops, TokenIds, TopK, bounded_float,
                                    bounded_int, show, validated, warn_once)
from handler.http.protocols import Generation, Sample, by_prompt, media, ranked, reasoning, tools as tooling

MAX_TEMPLATE_CHARS = 65536         # a request's own chat_template (vLLM's ChatCompletionRequest.chat_template)
FINISH = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


@dataclass(frozen=True)
class ServerOptions:
    """What the server's properties say about chat output: the tool-call format and switch,
    the reasoning parser (option.tool_call_parser, option.enable_auto_tool_choice,
    option.reasoning_parser); and how /invocations reads an OpenAI body (option.lmi_compat's
    line: chat without max_tokens to the context limit, lax numbers)."""
    tools: tooling.Options = field(default_factory=tooling.Options)
    reasoning: str = "none"
    line: compat.Line = compat.LINES[compat.DEFAULT]
    content_format: str = "auto"        # option.chat_template_content_format
    images: media.Limits = field(default_factory=media.Limits)   # option.allow_remote_images, max_image_*

    @classmethod
    def of(cls, cfg) -> "ServerOptions":
        return cls(tooling.Options(getattr(cfg, "tool_call_parser", "auto"),
                                   getattr(cfg, "enable_auto_tool_choice", True)),
                   getattr(cfg, "reasoning_parser", "none"), compat.line(cfg),
                   getattr(cfg, "chat_template_content_format", "auto"), media.Limits.of(cfg))


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = None


class _Fields(BaseModel):
    """The scalar fields both OpenAI bodies share, declared (OpenAI's names; vLLM's extensions
    marked). Strict: "1" is not 1, 1 is not true. `messages`, `prompt`, `tools` and the output
    constraints are parsed by their own functions below."""
    model_config = ConfigDict(strict=True, extra="ignore")

    temperature: bounded_float(0.0, 2.0) = None
    top_p: bounded_float(0.0, 1.0, lo_open=True) = None
    n: bounded_int(1, MAX_SAMPLES) = None
    stop: Stops = None
    seed: bounded_int(0, MAX_SEED) = None
    presence_penalty: bounded_float(-2.0, 2.0) = None
    frequency_penalty: bounded_float(-2.0, 2.0) = None
    max_tokens: bounded_int(1, MAX_NEW_TOKENS) = None
    max_completion_tokens: bounded_int(1, MAX_NEW_TOKENS) = None
    stream: bool = None
    stream_options: StreamOptions = None
    logit_bias: LogitBias = None                  # token ids checked against the vocabulary below
    ignore_eos: bool = None                       # vLLM / LMI
    top_k: TopK = None                            # vLLM
    min_p: bounded_float(0.0, 1.0) = None         # vLLM
    repetition_penalty: bounded_float(0.0, 100.0, lo_open=True) = None   # vLLM
    include_stop_str_in_output: bool = None       # vLLM
    stop_token_ids: TokenIds = None               # vLLM's sampling extras
    min_tokens: bounded_int(0, MAX_NEW_TOKENS) = None
    bad_words: BadWords = None
    skip_special_tokens: bool = None
    spaces_between_special_tokens: bool = None
    truncate_prompt_tokens: bounded_int(1, MAX_NEW_TOKENS) = None
    prompt_logprobs: bounded_int(0, MAX_TOP_N_TOKENS) = None
    priority: bounded_int(-MAX_PRIORITY, MAX_PRIORITY) = None     # vLLM: lower runs first


class ChatFields(_Fields):
    logprobs: bool = None
    top_logprobs: bounded_int(0, MAX_TOP_N_TOKENS) = None
    chat_template_kwargs: dict = None             # vLLM: extra variables for the chat template
    chat_template: Annotated[str, Field(min_length=1, max_length=MAX_TEMPLATE_CHARS)] = None   # vLLM: this request's


class CompletionFields(_Fields):
    max_tokens: bounded_int(0, MAX_NEW_TOKENS) = None   # 0: the prompt's log-probs only (with echo)
    logprobs: bounded_int(0, 5) = None            # top alternatives per token (legacy completions)
    best_of: bounded_int(1, MAX_SAMPLES) = None
    echo: bool = None


# OpenAI field -> SamplingParams field
_TO_PARAMS = {"temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop_sequences",
              "seed": "seed", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
              "ignore_eos": "ignore_eos", "top_k": "top_k", "min_p": "min_p",
              "repetition_penalty": "repetition_penalty", "include_stop_str_in_output": "include_stop_str_in_output",
              "stop_token_ids": "stop_token_ids", "min_tokens": "min_tokens", "bad_words": "bad_words",
              "skip_special_tokens": "skip_special_tokens",
              "spaces_between_special_tokens": "spaces_between_special_tokens", "priority": "priority"}
# Fields that change nothing in the answer (or are parsed elsewhere), accepted quietly.
_QUIET = {"model", "user", "messages", "prompt", "store", "metadata", "service_tier", "parallel_tool_calls", "tools",
          "tool_choice", "response_format", *guide.PARAMETERS, *guide.QUIET_PARAMETERS}
# Fields whose effect we do not implement: refused unless they are at their no-op value.
_UNSUPPORTED = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "suffix": lambda v: v == "",
}


def _check_object(payload) -> dict:
    if not isinstance(payload, dict):
        raise RequestError("body", "must be a JSON object")
    return payload


def _response_format(v) -> guide.GuideSpec | None:
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError("response_format", f'must be {{"type": "text" | "json_object" | "json_schema", ...}}, '
                                              f"got {show(v)}")
    if v["type"] == "json_object":
        return guide.json_object("response_format")
    if v["type"] == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise RequestError("response_format.json_schema", f'must be {{"name": ..., "schema": {{...}}, '
                                                              f'"strict": true}}, got {show(js)}')
        return guide.json_schema("response_format.json_schema.schema", js["schema"])
    return None


def _constraint(payload: dict, tools: tooling.Tools | None = None) -> guide.GuideSpec | None:
    """The one output constraint a body asks for: response_format, vLLM's guided_* /
    structured_outputs extras, or tool_choice required / a named function."""
    found = []
    if payload.get("response_format") is not None:
        spec = _response_format(payload["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    for name, parse in guide.PARAMETERS.items():
        if name != "grammar" and payload.get(name) is not None:
            found.append((name, parse(name, payload[name])))
    if tools is not None and tooling.constraint(tools) is not None:
        found.append(("tool_choice", tooling.constraint(tools)))
    if len(found) > 1:
        raise RequestError(found[1][0], f"conflicts with {found[0][0]} (one output constraint per request)")
    return found[0][1] if found else None


def _logit_bias(bias: tuple | None, tokenizer) -> tuple:
    if bias is None:
        return ()
    vocab = len(tokenizer) if tokenizer is not None else None
    for tid, _b in bias:
        if vocab is not None and tid >= vocab:
            raise RequestError("logit_bias", f"token id {tid} is not in this model's vocabulary (0..{vocab - 1})")
    return bias


def _fields(payload: dict, model: type[_Fields], lax: bool = False) -> _Fields:
    """The body's declared fields, checked (nulls are absent; lax: numbers in strings coerced, as
    vLLM's models on LMI's /invocations); the others warned about once."""
    body = {k: v for k, v in payload.items() if v is not None}
    if not isinstance(body.get("model", ""), str):      # the name is not checked, its type is
        raise RequestError("model", f"must be a string, got {show(body['model'])}")
    for name, v in body.items():
        if name in model.model_fields or name in _QUIET:
            continue
        if name in _UNSUPPORTED:
            if not _UNSUPPORTED[name](v):
                raise RequestError(name, "is not supported by this server")
        else:
            warn_once(f"openai:{name[:100]}", f"unknown request field {show(name)} dropped")
    return validated(model, {k: v for k, v in body.items() if k in model.model_fields}, "",
                     {k: k for k in body}, lax=lax)


def _sampling(f: _Fields, defaults: SamplingParams, lmi: bool) -> tuple[dict, dict]:
    """Declared fields -> (SamplingParams values, stream options)."""
    # OpenAI (and vLLM) end the text before a stop string; LMI's chat schema keeps it.
    values: dict = {} if lmi else {"include_stop_str_in_output": False}
    for name, key in _TO_PARAMS.items():
        if getattr(f, name) is not None:
            values[key] = getattr(f, name)
    for name in ("max_completion_tokens", "max_tokens"):
        if getattr(f, name) is not None:
            values["max_new_tokens"] = getattr(f, name)
            break
    if f.prompt_logprobs is not None:            # vLLM: N alternatives per prompt token
        values.update(decoder_input_details=True, prompt_top_n=f.prompt_logprobs)
    temperature = values.get("temperature", 1.0)
    values["do_sample"] = temperature > 0.0
    if not values["do_sample"]:
        values.pop("temperature", None)
    include_usage = bool(f.stream_options is not None and f.stream_options.include_usage)
    return {**defaults.__dict__, **values}, {"stream": bool(f.stream), "include_usage": include_usage}


# ---- chat
# A template that loops over a message's content takes OpenAI's list of parts (vLLM's "auto" detection).
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[['\"]content['\"]\]|\.content\b)")


@functools.lru_cache(maxsize=16)
def content_format(template: str | None, configured: str = "auto") -> str:
    """option.chat_template_content_format for this template: `string` or `openai`."""
    if configured != "auto":
        return configured
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def _content(i: int, content, parts: bool = False, images: list | None = None, limits: media.Limits | None = None):
    """A message's content: its text (parts joined, as LMI), or with `parts` OpenAI's list of parts.
    Image parts (`image_url`) are decoded into `images` (handler/http/protocols/media.py) and stand in
    the content as `{"type": "image"}` parts, or as media.MARKER in the text; without `images` they
    are refused."""
    where = f"messages[{i}].content"
    if content is None:
        return [] if parts else ""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if parts else content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and images is not None:
                at = part.get(media.WHERE) or f"{where}[{j}]"
                spec = part.get("image_url")
                url, detail = (spec.get("url"), spec.get("detail")) if isinstance(spec, dict) else (spec, None)
                media.check_room(len(images), at, limits)
                images.append(media.read(url, at, limits, detail, part.get(media.WHERE + "_detail")
                                         or f"{at}.image_url.detail"))
                out.append({"type": "image"})
            else:
                raise RequestError(f"{where}[{j}]", f"only text and image_url parts are supported, got type "
                                                    f"{show(kind)}" if images is not None else
                                   f"only text parts are supported, got type {show(kind)}")
        if parts:
            return out
        # as LMI joins text parts; an image where its part stood
        return "\n".join(p["text"] if p["type"] == "text" else media.MARKER for p in out)
    raise RequestError(where, f"must be a string or a list of text and image_url parts, got {show(content)}")


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls, for the template: arguments as objects (as HF templates
    expect them; OpenAI sends JSON text)."""
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls", f"must be a list, got {show(calls)}")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError(f"messages[{i}].tool_calls[{j}]", f"must be {{\"function\": {{\"name\", "
                                                                  f"\"arguments\"}}}}, got {show(c)}")
        args = f.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise RequestError(f"messages[{i}].tool_calls[{j}].function.arguments",
                               f"must be JSON text or an object, got {show(args)}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({"id": c.get("id"), "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def render_chat(tokenizer, messages, tools: list[dict] | None = None, kwargs: dict | None = None,
                template: str | None = None, fmt: str = "auto", images: list | None = None,
                limits: media.Limits | None = None) -> str:
    """messages -> the prompt text: the tokenizer's chat template (option.chat_template's when set), or a
    request's own `template`; content as text or OpenAI parts per `fmt` (content_format()). `images`:
    image parts are decoded into it (in order) within `limits`; None refuses them."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    parts = content_format(template or getattr(tokenizer, "chat_template", None), fmt) == "openai"
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]", f"must be an object with a string role, got {show(m)}")
        msg = {"role": m["role"], "content": _content(i, m.get("content"), parts, images, limits)}
        calls = _tool_calls(i, m["tool_calls"]) if m.get("tool_calls") is not None else None
        if calls:
            msg["tool_calls"] = calls
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        msgs.append(msg)
    if not template and not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages", "this model's tokenizer has no chat template (tokenizer_config.json "
                                       "chat_template; or set option.chat_template); send {\"inputs\": ...} instead")
    try:
        own = {"chat_template": template} if template else {}
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **own, **(kwargs or {}))
    except Exception as e:  # a template may raise on roles it does not know (jinja2 exceptions)
        field = "chat_template" if template else "messages"
        raise RequestError(field, f"the chat template refused these messages: {str(e)[:100]}") from None


# Template variables a request may not set: the ones render_chat passes itself; a name is a plain
# identifier (the document states both: openapi.py)
RESERVED_KWARGS = ("messages", "tools", "tokenize", "add_generation_prompt", "chat_template")
KWARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _template_kwargs(f: ChatFields, guided: bool, parser: str) -> dict:
    """chat_template_kwargs, checked; a guided answer under a reasoning parser is rendered without
    thinking (Qwen3's enable_thinking=false), since the constraint covers the whole output."""
    kwargs = dict(f.chat_template_kwargs or {})
    for k in kwargs:
        if k in RESERVED_KWARGS or not isinstance(k, str) or not KWARG_NAME.search(k):
            raise RequestError(f"chat_template_kwargs.{k}", "is not a template variable a request may set")
    if guided and parser != "none":
        if parser == "deepseek_r1" or kwargs.get("enable_thinking") is True:
            raise RequestError("response_format", f"an output constraint (response_format, guided_*, tool_choice "
                                                  f"required or named) cannot be combined with thinking "
                                                  f"(option.reasoning_parser={parser}): the constraint would cover "
                                                  f"the thinking too; send chat_template_kwargs "
                                                  f"{{\"enable_thinking\": false}} with a model that takes it")
        kwargs["enable_thinking"] = False
    return kwargs


def parse_chat(payload, tokenizer, lmi: bool = False, server: ServerOptions = ServerOptions()) -> Generation:
    """A Chat Completions body (from /v1/chat/completions, or /invocations with `messages`)."""
    payload = _check_object(payload)
    f = _fields(payload, ChatFields, lax=lmi and server.line.lax_numbers)
    tools = tooling.parse(payload, tokenizer, server.tools)
    guide_spec = _constraint(payload, tools)
    kwargs = _template_kwargs(f, guide_spec is not None, server.reasoning)
    images: list[media.ImageInput] = []
    prompt = render_chat(tokenizer, payload.get("messages"), tools.template_tools(), kwargs, f.chat_template,
                         server.content_format, images, server.images)
    values, opts = _sampling(f, SamplingParams(), lmi)
    values["guide"] = guide_spec
    if tools.choice == "auto" and tools.fmt in tooling.tool_parsers.SPECIAL_MARKERS \
            and f.skip_special_tokens is None:
        values["skip_special_tokens"] = False    # the call's marker is a special token: keep it in the text
    values["logit_bias"] = _logit_bias(f.logit_bias, tokenizer)
    logprobs = bool(f.logprobs)
    top = f.top_logprobs
    if top is not None:
        if not logprobs and top:
            raise RequestError("top_logprobs", "needs logprobs: true")
        values["top_n_tokens"] = top if logprobs else 0
    params = SamplingParams(**values)
    if opts["stream"] and f.prompt_logprobs is not None:
        raise RequestError("stream", "prompt_logprobs works without stream")
    if opts["stream"] and params.num_samples > 1 and lmi:
        raise RequestError("n", "several choices work only without streaming on /invocations")
    no_max = payload.get("max_tokens") is None and payload.get("max_completion_tokens") is None
    if images and f.truncate_prompt_tokens is not None:
        raise RequestError("truncate_prompt_tokens", "cannot cut a prompt with images (an image's tokens are whole)")
    return Generation([prompt], params, opts["stream"], truncate=f.truncate_prompt_tokens, add_special_tokens=False,
                      fill_max_tokens=no_max and (not lmi or server.line.chat_to_context), fields=["messages"],
                      images=[images] if images else None,
                      extra={"kind": "chat", "logprobs": logprobs, "lmi": lmi, "model": payload.get("model"),
                             "tools": tools if tools.active else None,
                             "reasoning": server.reasoning if server.reasoning != "none" else None,
                             "prompt_logprobs": f.prompt_logprobs is not None,
                             "include_usage": opts["include_usage"],
                             "fields": {"inputs": "messages", "parameters.max_new_tokens": "max_tokens",
                                        "parameters.priority": "priority"}})


# ---- completions
_PROMPT = ("must be a non-empty string, a list of non-empty strings, a non-empty list of token ids or a list "
           "of those")


def _is_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompts(prompt, tokenizer) -> tuple[list[str], bool, list[list[int]] | None]:
    """OpenAI's prompt forms -> (texts, is_list, token ids or None): "text", ["text", ...], [id, ...]
    or [[id, ...], ...] (what eval harnesses send). Token-id prompts' texts are their decoding."""
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        prompt, is_list = [prompt], False
    else:
        is_list = isinstance(prompt, list)
        prompt = prompt if is_list else [prompt]
    if not prompt or not (all(isinstance(p, str) and p for p in prompt)
                          or all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in prompt)):
        raise RequestError("prompt", f"{_PROMPT}, got {show(prompt if is_list else prompt[0])}")
    if isinstance(prompt[0], str):
        return prompt, is_list, None
    vocab = len(tokenizer)
    for i, ids in enumerate(prompt):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt[{i}]" if is_list else "prompt",
                               f"token id {bad} is not in this model's vocabulary (0..{vocab - 1})")
    texts = [tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) for ids in prompt]
    return texts, is_list, [list(ids) for ids in prompt]


def parse_completion(payload, tokenizer=None, lax: bool = False) -> Generation:
    """A Completions body (from /v1/completions, or /invocations with `prompt`; lax: see _fields)."""
    payload = _check_object(payload)
    f = _fields(payload, CompletionFields, lax)
    if payload.get("tools"):
        raise RequestError("tools", "tools work on /v1/chat/completions; completions take response_format "
                                    "or guided_json / guided_regex / guided_choice / guided_grammar")
    prompts, is_list, prompt_ids = _prompts(payload.get("prompt"), tokenizer)
    values, opts = _sampling(f, SamplingParams(max_new_tokens=16), False)
    values["guide"] = _constraint(payload)
    echo = bool(f.echo)
    only_prompt = f.max_tokens == 0          # the prompt's log-probs (eval harnesses): one token, dropped
    if only_prompt:
        if not echo and f.prompt_logprobs is None:
            raise RequestError("max_tokens", "0 works with echo: true or prompt_logprobs (the prompt's log-probs)")
        values["max_new_tokens"] = 1
    if echo and f.logprobs is not None:      # OpenAI: log-probs of the prompt tokens too
        values.update(decoder_input_details=True,
                      prompt_top_n=max(f.logprobs, values.get("prompt_top_n") or 0))
    values["logit_bias"] = _logit_bias(f.logit_bias, tokenizer)
    lp = f.logprobs
    if lp is not None:
        values["top_n_tokens"] = lp
    best_of = f.best_of
    if best_of is not None:
        values["best_of"] = best_of
        if values["best_of"] < values["n"]:
            raise RequestError("best_of", f"must be >= n ({values['n']}), got {best_of}")
    params = SamplingParams(**values)
    if opts["stream"] and params.best_of not in (None, params.n):
        raise RequestError("best_of", "cannot be used with stream")
    if opts["stream"] and (only_prompt or params.decoder_input_details):
        raise RequestError("stream", "prompt log-probs (echo with logprobs, prompt_logprobs, max_tokens 0) "
                                     "work without stream")
    fields = [f"prompt[{i}]" if is_list else "prompt" for i in range(len(prompts))]
    return Generation(list(prompts), params, opts["stream"], is_list, truncate=f.truncate_prompt_tokens,
                      fields=fields, prompt_ids=prompt_ids,
                      extra={"kind": "completion", "logprobs": lp is not None, "echo": echo,
                             "only_prompt": only_prompt, "prompt_logprobs": f.prompt_logprobs is not None,
                             "model": payload.get("model"), "include_usage": opts["include_usage"],
                             "fields": {"inputs": "prompt", "parameters.max_new_tokens": "max_tokens",
                                        "parameters.priority": "priority"}})


# ---- responses
def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _chat_logprob(t) -> dict:
    return {"token": t.text, "logprob": t.log_prob, "bytes": _bytes(t.text),
            "top_logprobs": [{"token": x, "logprob": lp, "bytes": _bytes(x)} for _i, x, lp in t.top_tokens]}


def _completion_logprobs(tokens, offset: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(t.text)
        out["token_logprobs"].append(t.log_prob)
        out["top_logprobs"].append({x: lp for _i, x, lp in t.top_tokens})
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def _prompt_logprobs(done) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}}, the token itself and its alternatives."""
    if done.prefill is None or done.prefill_top is None:
        return None
    out = []
    for (tid, text, lp), top in zip(done.prefill, done.prefill_top):
        if top is None:
            out.append(None)
            continue
        rank, alts = top
        entry = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": text}}
        for r, (i, x, a) in enumerate(alts, 1):
            entry.setdefault(str(i), {"logprob": a, "rank": r, "decoded_token": x})
        out.append(entry)
    return out


def _echo_logprobs(done, tokens, top: bool) -> dict:
    """OpenAI's completion log-probs over prompt + completion: the first prompt token's are null."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    tops = done.prefill_top or (None,) * len(done.prefill or ())
    for (tid, text, lp), t in zip(done.prefill or (), tops):
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if t is None else {x: a for _i, x, a in t[1]} if top else None)
        out["text_offset"].append(offset)
        offset += len(text)
    rest = _completion_logprobs(tokens, offset)
    for k in out:
        out[k] += rest[k]
    return out


def _finish(gen: Generation, reason: str) -> str:
    return reason if gen.extra.get("lmi") else FINISH.get(reason, reason)


def _usage(gen: Generation, samples: list[Sample]) -> dict:
    # prompt tokens once per prompt, as OpenAI counts them for n > 1
    prompt = sum(ss[0].done.prompt_tokens for ss in by_prompt(samples, len(gen.prompts)) if ss)
    completion = 0 if gen.extra.get("only_prompt") else sum(s.done.generated_tokens for s in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chosen(gen: Generation, samples: list[Sample]) -> list[Sample]:
    """Per prompt, the n answers: all samples in order, or the n most likely of best_of."""
    out = []
    for ss in by_prompt(samples, len(gen.prompts)):
        if gen.params.best_of and gen.params.best_of > gen.params.n:
            ss = sorted(ranked(ss)[:gen.params.n], key=lambda s: s.sample_index)
        out.extend(ss)
    return out


class Ids:
    def __init__(self, gen: Generation, model: str):
        self.id = ("chatcmpl-" if gen.extra.get("kind") == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = gen.extra.get("model") or model

    def head(self, obj: str, lmi: bool) -> dict:
        h = {"id": self.id, "object": obj, "created": self.created}
        if not lmi:
            h["model"] = self.model
        return h


def encode(gen: Generation, samples: list[Sample], model: str) -> dict:
    ids = Ids(gen, model)
    chosen = _chosen(gen, samples)
    n = gen.params.n
    choices = []
    if gen.extra["kind"] == "chat":
        tools = gen.extra.get("tools")
        parser = gen.extra.get("reasoning")
        for i, s in enumerate(chosen):
            text, thought = s.done.generated_text, None
            if parser is not None:          # the thinking never reaches content or a call's arguments
                thought, text = reasoning.split(parser, text)
            message = {"role": "assistant", "content": text}
            if parser is not None:
                message["reasoning_content"] = thought
            reason = _finish(gen, s.done.finish_reason)
            if tools is not None:
                content, calls = tooling.parse_output(tools, text)
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls"
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": [_chat_logprob(t) for t in s.tokens]}
                            if gen.extra["logprobs"] else None,
                            "finish_reason": reason})
        obj = "chat.completion"
        top = {}
        if gen.extra.get("prompt_logprobs") and chosen:
            top["prompt_logprobs"] = _prompt_logprobs(chosen[0].done)
    else:
        top = {}
        only_prompt = gen.extra.get("only_prompt")
        for s in chosen:
            prompt = gen.prompts[s.prompt_index]
            head = prompt if gen.extra["echo"] else ""
            tokens = [] if only_prompt else s.tokens
            text = "" if only_prompt else s.done.generated_text
            if not gen.extra["logprobs"]:
                logprobs = None
            elif gen.extra["echo"]:
                logprobs = _echo_logprobs(s.done, tokens, True)
            else:
                logprobs = _completion_logprobs(tokens, 0)
            choice = {"index": s.prompt_index * n + len([c for c in choices if c["_p"] == s.prompt_index]),
                      "_p": s.prompt_index, "text": head + text, "logprobs": logprobs,
                      "finish_reason": "length" if only_prompt else _finish(gen, s.done.finish_reason)}
            if gen.extra.get("prompt_logprobs"):
                choice["prompt_logprobs"] = _prompt_logprobs(s.done)
            choices.append(choice)
        for c in choices:
            del c["_p"]
        obj = "text_completion"
    return {**ids.head(obj, gen.extra.get("lmi", False)), "choices": choices, "usage": _usage(gen, samples), **top}


def stream(gen: Generation, events, model: str, sse: bool = True):
    """SSE chunks (`data: {...}`), one per token; `data: [DONE]` last. LMI's jsonlines_chat when not sse."""
    ids = Ids(gen, model)
    lmi = gen.extra.get("lmi", False)
    chat = gen.extra["kind"] == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def out(d) -> str:
        data = json.dumps(d, ensure_ascii=False)
        return f"data: {data}\n\n" if sse else data + "\n"

    first: set[tuple[int, int]] = set()
    done: list[Sample] = []
    usage = gen.extra.get("include_usage")
    tools = gen.extra.get("tools") if chat else None
    parser = gen.extra.get("reasoning") if chat else None
    streamers: dict[tuple[int, int], ChoiceStream] = {}
    for p, s, ev in events:
        if not hasattr(ev, "id"):                       # ErrorEvent mid-stream
            yield out({"error": {"message": ev.message, "type": "server_error", "param": None,
                                 "code": ev.status}})
            break
        index = p * gen.params.n + s
        reason = _finish(gen, ev.done.finish_reason) if ev.done is not None else None
        if tools is not None or parser is not None:     # deltas as the choice's streamer makes them
            st = streamers.setdefault((p, s), ChoiceStream(tools, parser))
            deltas = st.feed(ev.text)
            if ev.done is not None:
                last, called = st.finish()
                deltas += last
                reason = "tool_calls" if called else reason
            if (p, s) not in first:
                first.add((p, s))
                deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
            if ev.done is not None:
                deltas = deltas or [{}]
            for k, delta in enumerate(deltas):
                chunk = {**ids.head(obj, lmi), "choices": [{
                    "index": index, "delta": delta, "logprobs": None,
                    "finish_reason": reason if ev.done is not None and k == len(deltas) - 1 else None}]}
                if usage:
                    chunk["usage"] = None
                yield out(chunk)
            if ev.done is not None:
                done.append(Sample(p, s, [], ev.done))
            continue
        if chat:
            delta = {"content": ev.text}
            if (p, s) not in first:
                first.add((p, s))
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta,
                      "logprobs": {"content": [_chat_logprob(ev)]} if gen.extra["logprobs"] else None,
                      "finish_reason": reason}
        else:
            text = ev.text
            if (p, s) not in first:
                first.add((p, s))
                if gen.extra["echo"]:
                    text = gen.prompts[p] + text
            choice = {"index": index, "text": text,
                      "logprobs": _completion_logprobs([ev], 0) if gen.extra["logprobs"] else None,
                      "finish_reason": reason}
        chunk = {**ids.head(obj, lmi), "choices": [choice]}
        if usage:
            chunk["usage"] = None
        yield out(chunk)
        if ev.done is not None:
            done.append(Sample(p, s, [], ev.done))
    else:
        if usage:
            yield out({**ids.head(obj, lmi), "choices": [], "usage": _usage(gen, done)})
    if sse:
        yield "data: [DONE]\n\n"


class ChoiceStream:
    """One chat choice's deltas: the thinking as reasoning_content (reasoning parser), the answer
    as content or tool-call deltas (tools)."""

    def __init__(self, tools: tooling.Tools | None, parser: str | None):
        self.split = reasoning.Splitter(parser) if parser else None
        self.tools = tooling.Streamer(tools) if tools is not None else None

    def _answer(self, text: str) -> list[dict]:
        if self.tools is not None:
            return self.tools.feed(text)
        return [{"content": text}] if text else []

    def _route(self, parts) -> list[dict]:
        out = []
        for kind, text in parts:
            out += [{"reasoning_content": text}] if kind == "reasoning" else self._answer(text)
        return out

    def feed(self, text: str) -> list[dict]:
        return self._route(self.split.feed(text)) if self.split else self._answer(text)

    def finish(self) -> tuple[list[dict], bool]:
        out = self._route(self.split.finish()) if self.split else []
        if self.tools is None:
            return out, False
        last, called = self.tools.finish()
        return out + last, called


def models(model: str, created: int, adapters: list[str] = ()) -> dict:
    """The served model, then its LoRA adapters (as vLLM: `parent` is the base)."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "lmi-serve"}] + [
        {"id": a, "object": "model", "created": created, "owned_by": "lmi-serve", "parent": model}
        for a in adapters]}


def error_body(status: int, message: str, field: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error", 415: "invalid_request_error",
            503: "service_unavailable", 504: "timeout"}.get(status, "server_error")
    # the part named in the message too (as the TGI and Anthropic bodies do): SDKs show the message, not param
    text = f"{field}: {message}" if field and not message.startswith(field) else message
    return {"error": {"message": text, "type": kind, "param": field, "code": status}}
