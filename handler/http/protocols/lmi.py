"""LMI's schema on /invocations: {"inputs", "parameters", "stream"} -> Generation; samples ->
{"generated_text", "details"} (a list for a list input); jsonlines/SSE token lines.

As djl-serving: unknown top-level fields are dropped with a warning; `text/plain` is one prompt in
a list; `messages` makes a Chat Completions request (handler/http/protocols/openai.py); `tgi_compat` gives
TGI's token names (`logprob`, `special`), a one-element list and details by default.
Sources: djl_python/output_formatter.py, input_parser.py, encode_decode.py.
"""
from __future__ import annotations

import csv
import io
import json

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationInfo

from handler.engine.request import (Refused, RequestError, SamplingParams, parse_params, show, validated,
                                    warn_once)
from handler.http.protocols import Generation, Sample, by_prompt, ranked

TOP_LEVEL = ("inputs", "parameters", "stream", "messages", "adapters")
NO_EFFECT_TOP_LEVEL = {"cached_prompt": "prompt caching by the client is not implemented"}


def json_number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an integral one (`11.0`, `1e3`) is the integer,
    as JSON Schema counts it (`"type": "integer"` takes 11.0) and as vLLM's lax models read it."""
    v = float(text)
    return int(v) if v.is_integer() and abs(v) < 2**63 else v


def decode_body(body: bytes, content_type: str | None) -> dict:
    """A request body -> a JSON-like map, per content type as LMI's encode_decode.decode."""
    ctype = (content_type or "").split(";")[0].strip().lower()
    # curl -d sends application/x-www-form-urlencoded: its body is read as JSON too, so that
    # `curl URL -d '{"inputs": ...}'` works without a content-type header.
    if not ctype or ctype in ("application/json", "application/jsonlines", "application/x-jsonlines",
                              "application/x-www-form-urlencoded"):
        if not body.strip() and not ctype:
            return {"inputs": ""}
        try:
            payload = json.loads(body, parse_float=json_number)
        except (ValueError, UnicodeDecodeError) as e:
            hint = " (one JSON object per request)" if "Extra data" in str(e) else ""
            raise RequestError("body", f"invalid JSON{hint}: {str(e)[:100]}") from None
        except RecursionError:
            raise RequestError("body", "JSON nested too deeply") from None
        return payload
    if ctype == "text/plain":
        try:
            return {"inputs": [body.decode("utf-8")]}
        except UnicodeDecodeError:
            raise RequestError("body", "text/plain body is not valid UTF-8") from None
    if ctype == "text/csv":
        try:
            rows = list(csv.DictReader(io.StringIO(body.decode("utf-8"))))
        except (UnicodeDecodeError, csv.Error) as e:
            raise RequestError("body", f"unreadable CSV: {str(e)[:100]}") from None
        if not rows or "inputs" not in rows[0]:
            raise RequestError("body", "a text/csv body needs a header row with an 'inputs' column")
        return {"inputs": [r["inputs"] for r in rows]}
    raise RequestError("content-type", f"unsupported content type {show(ctype)}; use application/json, "
                                       "text/plain or text/csv", status=415)


def _inputs(value, info: ValidationInfo) -> list[str]:
    """`inputs`: a prompt, or (unless the route takes one string) a non-empty list of them."""
    ctx = info.context or {}
    is_list = isinstance(value, list)
    if is_list and ctx.get("require_string"):
        raise Refused(RequestError("inputs", "must be a string"))
    items = value if is_list else [value]
    limit = ctx.get("max_batch_inputs", 1000)
    if is_list and not items:
        raise Refused(RequestError("inputs", "must not be an empty list"))
    if len(items) > limit:
        raise Refused(RequestError("inputs", f"at most {limit} prompts per request, got {len(items)}"))
    for i, s in enumerate(items):
        where = f"inputs[{i}]" if is_list else "inputs"
        if not isinstance(s, str):
            raise Refused(RequestError(where, f"must be a string or a list of strings, got {show(s)}"))
        if not s:
            raise Refused(RequestError(where, "must not be empty"))
    return value


class LmiRequest(BaseModel):
    """LMI's body (TGI's too, whose `inputs` is one string). `parameters` is parsed by
    handler.engine.request.parse_params (Parameters, with aliases and guided decoding);
    `messages` makes it a Chat Completions request (openai.parse_chat)."""
    model_config = ConfigDict(strict=True, extra="allow")   # unknown fields: warned and dropped

    inputs: Annotated[str | list[str], PlainValidator(_inputs, json_schema_input_type=str | list[str])]
    parameters: Any = None
    stream: bool = None
    adapters: Any = None                    # adapter_name() below


def parse(payload, *, default_stream: bool = False, max_batch_inputs: int = 1000,
          defaults: SamplingParams = SamplingParams(), require_string: bool = False,
          lax: bool = False, infer_sampling: bool = False) -> Generation:
    """An LMI (or TGI) body without `messages` -> Generation. lax / infer_sampling: the
    `parameters` as LMI 0.32+ reads them (handler.engine.request.parse_params)."""
    if not isinstance(payload, dict):
        raise RequestError("body", 'must be a JSON object like {"inputs": "...", "parameters": {...}}')
    for k in payload:
        if k in NO_EFFECT_TOP_LEVEL:
            warn_once(f"top:{k}", f"request field {k!r} is ignored: {NO_EFFECT_TOP_LEVEL[k]}")
        elif k not in TOP_LEVEL:
            warn_once(f"top:{k[:100]}", f"unknown request field {show(k)} dropped (as LMI does); "
                                        f"known: {', '.join(TOP_LEVEL)}")
    declared = {k: v for k, v in payload.items() if k in LmiRequest.model_fields and v is not None}
    body = validated(LmiRequest, declared, "", {k: k for k in declared},
                     context={"require_string": require_string, "max_batch_inputs": max_batch_inputs})
    inputs = body.inputs
    is_list = isinstance(inputs, list)
    items = inputs if is_list else [inputs]
    fields = [f"inputs[{i}]" if is_list else "inputs" for i in range(len(items))]
    stream = default_stream if body.stream is None else body.stream
    if stream and is_list:
        raise RequestError("stream", "streaming needs a single string in inputs, not a list")
    options: dict = {}
    params = parse_params(body.parameters, defaults, options=options, lax=lax, infer_sampling=infer_sampling)
    if stream and params.num_samples > 1:
        raise RequestError("parameters.n" if params.n > 1 else "parameters.best_of",
                           "several samples per prompt (n, best_of) work only without streaming")
    gen = Generation(list(items), params, stream, is_list, options.get("truncate"), fields=fields,
                     adapter=adapter_name(payload.get("adapters"), len(items)))
    if gen.adapter is None and options.get("adapter_id"):     # TGI's name for it
        gen.adapter, gen.adapter_field = options["adapter_id"], "parameters.adapter_id"
    return gen


def adapter_name(value, n_inputs: int) -> str | None:
    """LMI's `adapters`: a name, or a list with one name per input (one adapter per request
    here: the names must agree)."""
    if value is None:
        return None
    names = value if isinstance(value, list) else [value]
    if not names or not all(isinstance(v, str) and v for v in names):
        raise RequestError("adapters", f"must be an adapter name or a list of names, got {show(value)}")
    if isinstance(value, list) and len(names) != n_inputs:
        raise RequestError("adapters", f"a list needs one name per input ({n_inputs}), got {len(names)}")
    if len(set(names)) > 1:
        raise RequestError("adapters", "one adapter per request: send the inputs for different "
                                       "adapters as separate requests (they are batched together)")
    return names[0]


# ---- responses
def token(t, tgi: bool) -> dict:
    if tgi:
        d = {"id": t.id, "text": t.text, "logprob": t.log_prob}
        if t.special:
            d["special"] = True
    else:
        d = {"id": t.id, "text": t.text, "log_prob": t.log_prob}
        if t.special:
            d["special_token"] = True
    return d


def _alt(tid, text, lp, tgi: bool) -> dict:
    return {"id": tid, "text": text, "logprob" if tgi else "log_prob": lp}


def generated_text(gen: Generation, prompt: str, s: Sample) -> str:
    return (prompt if gen.params.return_full_text else "") + s.done.generated_text


def _sequence(gen: Generation, s: Sample, tgi: bool, tokens: bool = True) -> dict:
    d = {"finish_reason": s.done.finish_reason, "generated_tokens": s.done.generated_tokens}
    if tokens:
        d["tokens"] = [token(t, tgi) for t in s.tokens]
    if gen.params.decoder_input_details:
        d["prefill"] = [_alt(i, x, lp, tgi) for i, x, lp in (s.done.prefill or ())]
    if gen.params.top_n_tokens > 0:
        d["top_tokens"] = [[_alt(*a, tgi) for a in t.top_tokens] for t in s.tokens]
    return d


def result(gen: Generation, prompt: str, samples: list[Sample], tgi: bool = False) -> dict:
    """One prompt's answer: the most likely sample; the others in details.best_of_sequences."""
    order = ranked(samples) if len(samples) > 1 else samples
    best = order[0]
    out = {"generated_text": generated_text(gen, prompt, best)}
    if gen.params.details or len(samples) > 1:
        details = {"inputs": prompt, **_sequence(gen, best, tgi)}
        if len(samples) > 1:
            details["best_of_sequences"] = [
                {**_sequence(gen, s, tgi), "generated_text": generated_text(gen, prompt, s)} for s in order[1:]]
        out["details"] = details
    return out


def encode(gen: Generation, samples: list[Sample], tgi: bool = False):
    results = [result(gen, p, ss, tgi) for p, ss in zip(gen.prompts, by_prompt(samples, len(gen.prompts)))]
    if gen.is_list:
        return results
    return [results[0]] if tgi else results[0]


def line(obj, sse: bool) -> str:
    data = json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n" if sse else data + "\n"


def stream(gen: Generation, events, sse: bool, tgi: bool = False):
    """One line per token; the last also carries generated_text (and details without tokens)."""
    prompt = gen.prompts[0]
    for _p, _s, ev in events:
        if not hasattr(ev, "id"):            # ErrorEvent: LMI's error line, plus the code and message
            yield line({"token": {"id": -1, "text": "", "log_prob": -1, "special_token": True},
                        "generated_text": "", "details": {"finish_reason": "error", "generated_tokens": None,
                                                          "inputs": None},
                        "error": ev.message, "code": ev.status}, sse)
            return
        obj = {"token": token(ev, tgi)}
        if ev.done is not None:
            obj["generated_text"] = (prompt if gen.params.return_full_text else "") + ev.done.generated_text
            if gen.params.details:
                s = Sample(0, 0, [], ev.done)
                obj["details"] = {**_sequence(gen, s, tgi, tokens=False), "inputs": prompt}
                if gen.params.top_n_tokens > 0:
                    obj["details"].pop("top_tokens")
        yield line(obj, sse)
