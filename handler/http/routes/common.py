"""What every route shares: the server state of the current app, JSON and error responses,
reading a body, admission, the per-request trace, and `run`, which takes a protocol's
parse / respond / stream callbacks through adapter choice, prompt checks, tokenizing,
submission and the wait, and picks a whole or a streamed response.

Routes reach the engine only through `state.client` (handler.engine.client.EngineClient).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re

import orjson
from flask import Response, current_app, g, request
from werkzeug.exceptions import HTTPException
from werkzeug.wsgi import ClosingIterator

from handler.config.sizing import running_width  # noqa: F401  (re-exported: the routes' name for it)
from handler.engine.client import CapacityError, LoraDisabled, QueueFull
from handler.engine.request import MAX_PRIORITY, RequestError, check_int, show
from handler.http import protocols as api
from handler.http.guard import ClientDisconnected, MalformedBody, PayloadTooLarge, SlowBody, read_body
from handler.http.metrics import RequestTrace, request_id
from handler.http.protocols import anthropic, lmi, openai, tgi

log = logging.getLogger("lmi.http")

STATE_KEY = "lmi.state"     # app.extensions[STATE_KEY]: the app's ServerState
SSE = "text/event-stream"
JSONLINES = "application/jsonlines"
STREAMING_FORMATTERS = ("jsonlines", "sse", "jsonlines_chat", "sse_chat")
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"   # SageMaker's per-request LoRA adapter
# SageMaker passes InvokeEndpoint's CustomAttributes through as this header (opaque, <= 1024 chars).
CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
TIMEOUT_HINT = "request_timeout / option.predict_timeout / SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS"


def current_state():
    """The ServerState (handler.http.app) the current request's app serves from."""
    return current_app.extensions[STATE_KEY]


def model_name(cfg) -> str:
    return os.path.basename(str(cfg.model_id).rstrip("/")) or "model"


# ---- responses
def json_response(body, status: int = 200) -> Response:
    # A lone surrogate (echoed from a client's value) cannot be UTF-8: write it as its JSON escape.
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return Response(data, status=status, mimetype="application/json")


def vectors_response(body) -> Response:
    """json_response for bodies of many floats (embeddings, scores): orjson writes a float in ~1/20 of
    json's time (the same shortest round-trip digits); a body orjson refuses (a lone surrogate echoed
    from a client, an int beyond 64 bits) goes to json_response. A non-finite float becomes null (JSON
    has no NaN; json would write the non-JSON token NaN)."""
    try:
        return Response(orjson.dumps(body), status=200, mimetype="application/json")
    except TypeError:
        return json_response(body)


def error_response(status: int, message: str, field: str | None = None) -> Response:
    body = {"code": status, "error": message}
    if field:
        body["field"] = field
    return json_response(body, status)


def openai_error(status, message, field=None):
    return json_response(openai.error_body(status, message, field), status)


def tgi_error(status, message, field=None):
    return json_response(tgi.error_body(status, message, field), 422 if status == 400 else status)


def streamed(state, lines, events, mimetype) -> Response:
    def gen():
        try:
            yield from lines
        except GeneratorExit:   # closed before its end: the client went away
            state.disconnected()
            raise
        finally:
            events.close()      # the client went away: abort what is still running
    return Response(gen(), mimetype=mimetype, headers={"X-Accel-Buffering": "no"})


# ---- requests
def body_json():
    """The request's body, read within option.max_payload_mb and decoded (lmi.decode_body)."""
    return lmi.decode_body(body_bytes(), request.content_type)


def body_bytes() -> bytes:
    """The request's body, read within option.max_payload_mb."""
    state = current_state()
    cfg = state.cfg
    try:
        body = read_body(request.environ, int(cfg.max_payload_mb * 1e6))
    except PayloadTooLarge as e:
        raise RequestError("body", f"{e} (option.max_payload_mb={cfg.max_payload_mb:g})", 413) from None
    except MalformedBody as e:
        raise RequestError("body", str(e)) from None
    except SlowBody as e:
        state.disconnected()
        raise RequestError("body", str(e), 408) from None
    except ClientDisconnected:
        state.disconnected()
        raise RequestError("body", "the client closed the connection before sending its body") from None
    return body


def pick_adapter(client, gen, cfg) -> None:
    """The LoRA adapter a request names (the body's `adapters`, SageMaker's header, or an
    OpenAI `model` other than the base's) into gen.params; an unknown name is a 400."""
    name, where = gen.adapter, gen.adapter_field
    if name is None and request.headers.get(ADAPTER_HEADER):
        name, where = request.headers[ADAPTER_HEADER], ADAPTER_HEADER
    model = gen.extra.get("model")
    if name is None and client.lora_enabled and isinstance(model, str) and model \
            and model != model_name(cfg):
        name, where = model, "model"
    if name is None:
        return
    try:
        adapter = client.adapter(name)
    except LoraDisabled as e:
        raise RequestError(where, str(e)) from None
    except ValueError as e:     # AdapterError: its files changed since it was registered
        raise RequestError(where, str(e), status=424) from None
    if adapter is None:
        known = sorted(client.adapter_names())
        raise RequestError(where, f"unknown adapter {show(name)}; registered: "
                                  f"{', '.join(known[:20]) or 'none'}"
                                  + (f" (base model: {model_name(cfg)})" if where == "model" else ""))
    gen.params = dataclasses.replace(gen.params, adapter=adapter)


def _loading(state) -> str:
    return "the model is still loading" if not state.error else f"the model failed to load: {state.error}"


def with_client(error, work):
    """work(client) -> a JSON body, for routes that use the model's tokenizer but generate nothing;
    error(status, message, field) while the model loads, or for a RequestError."""
    state = current_state()
    if state.client is None:
        return error(503, _loading(state))
    try:
        return json_response(work(state.client))
    except RequestError as e:
        return error(e.status, e.message, e.field)


def custom_attribute(value: str | None, name: str) -> str | None:
    """The value of `name` in SageMaker's custom attributes (`key=value` pairs split by `;` or `,`,
    keys matched without case; other keys are the client's own and left alone), or None."""
    for part in re.split(r"[;,]", value or ""):
        key, eq, v = part.partition("=")
        if eq and key.strip().lower() == name:
            return v.strip()
    return None


def custom_attributes_priority(value: str | None) -> int | None:
    """`priority=N` in the custom attributes (an integer, as the body's field), or None."""
    v = custom_attribute(value, "priority")
    if v is None:
        return None
    n = int(v) if re.fullmatch(r"[+-]?[0-9]{1,10}", v) else v
    return check_int(f"{CUSTOM_ATTRIBUTES_HEADER}: priority", n, -MAX_PRIORITY, MAX_PRIORITY)


def pick_priority(gen, policy: str) -> None:
    """The request's scheduling priority: its body's field, else SageMaker's custom attributes;
    a non-zero one on an fcfs server is refused, as vLLM does (nothing would honour it)."""
    field = gen.extra.get("fields", {}).get("parameters.priority", "parameters.priority")
    priority = gen.params.priority
    if priority == 0:
        header = custom_attributes_priority(request.headers.get(CUSTOM_ATTRIBUTES_HEADER))
        if header is not None:
            priority, field = header, f"{CUSTOM_ATTRIBUTES_HEADER}: priority"
    if priority != 0 and policy != "priority":
        raise RequestError(field, f"is {priority}, but this server schedules first come, first served; "
                                  "set option.scheduling_policy=priority to use priorities (or send 0)")
    if priority != gen.params.priority:
        gen.params = dataclasses.replace(gen.params, priority=priority)


def run(parse, error, respond, stream):
    """parse(tokenizer) -> Generation; error(status, message, field) -> Response;
    respond(gen, samples) -> Response; stream(gen, events) -> Response."""
    state = current_state()
    cfg = state.cfg
    client = state.client
    if client is None:
        g.trace.reason = "loading"
        return error(503, _loading(state))
    if client.pooling:
        return error(400, f"this server serves a {client.task} model (option.task={client.task}), which generates "
                          "no text: use POST /v1/embeddings, /embed, /rerank or /invocations with {\"inputs\": ...}",
                     "option.task")
    try:
        gen = parse(client.tokenizer)
        pick_adapter(client, gen, cfg)
        pick_priority(gen, cfg.scheduling_policy)
        state.check_prompts(gen)
        ids = api.tokenize(client.tokenizer, gen, client.media)
        api.with_length(gen, ids, client.max_sequence_len)
        chans = client.submit(ids, gen.params, stream=gen.stream, media=gen.media)
    except RequestError as e:
        return error(e.status, e.message, e.field)
    except CapacityError as e:
        g.trace.reason = "too_long"
        return error(400, e.message, gen.extra.get("fields", {}).get(e.field, e.field))
    except QueueFull as e:
        g.trace.reason = "queue_full"
        log.warning("refused a request: %s", e)
        return error(503, str(e))
    g.trace.watch(chans)
    deadline = chans[0].submitted + cfg.request_timeout_s
    if gen.stream:
        events = api.stream_events(client, chans, deadline, observe=g.trace.note)
        return stream(gen, events)
    try:
        samples = api.collect(client, chans, deadline, observe=g.trace.note)
    except api.Timeout:
        return error(504, f"request timed out after {cfg.request_timeout_s:g} s ({TIMEOUT_HINT})")
    except api.Failed as f:
        return error(f.status, f.message)
    return respond(gen, samples)


# ---- the app's hooks (create_app installs them)
def start_trace():
    """before_request: the request's id, and a trace for every inference request (a POST)."""
    rid, header = request_id(request.headers)
    g.request_id, g.id_header = rid, header
    if request.method == "POST":          # an inference request, whatever its protocol
        g.trace = RequestTrace(current_state().metrics, rid)


def record_response(resp):
    """after_request: count the status, echo the request id, record the trace once sent."""
    if request.path != "/ping" and request.method == "POST":
        current_state().count(resp.status_code)
    rid = g.get("request_id")
    if rid is not None:
        resp.headers["X-Request-Id"] = rid
        if g.id_header == "X-Amzn-RequestId":
            resp.headers["X-Amzn-RequestId"] = rid
    trace = g.get("trace")
    if trace is not None:               # after the body is sent (a stream included)
        status = resp.status_code
        resp.call_on_close(lambda: trace.finish(status))
    return resp


def _route_error(status, message):
    if request.path.startswith("/v1/messages"):
        return json_response(anthropic.error_body(status, message), anthropic.status(status))
    if request.path.startswith("/v1/"):
        return openai_error(status, message)
    return error_response(status, message)


def not_found(_e):
    return _route_error(404, f"no route {request.path}; use GET /ping, POST /invocations, "
                             "POST /v1/chat/completions, POST /v1/completions, POST /v1/messages, "
                             "POST /v1/responses, POST /generate; an embedding or rerank model: POST /v1/embeddings, "
                             "/embed, /rerank, /v1/rerank, /predict, /score")


def bad_method(e):
    # RFC 9110: a 405 lists the methods the route takes
    allowed = sorted(getattr(e, "valid_methods", None) or [])
    resp = _route_error(405, f"{request.method} is not allowed on {request.path}"
                             + (f"; use {', '.join(allowed)}" if allowed else ""))
    if allowed:
        resp.headers["Allow"] = ", ".join(allowed)
    return resp


def http_error(e):
    return _route_error(e.code or 500, f"{e.name}: {e.description}")


def internal(e):
    log.exception("unhandled error")
    return _route_error(500, f"internal error: {type(e).__name__}")


def register_error_handlers(app) -> None:
    """Every error as JSON: OpenAI's shape under /v1/, {"code", "error"} elsewhere."""
    app.register_error_handler(404, not_found)
    app.register_error_handler(405, bad_method)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, internal)


def admitting(wsgi_app, state):
    """Admission in front of Flask: every POST (a generation request, whatever its protocol)
    enters the counter or is refused with a prepared 503 before Flask builds a request, reads
    the body, parses or tokenizes (the cheapest refusal this process can make). An admitted
    request leaves when its response is closed, i.e. after the last byte of a stream."""
    message = (f"the queue is full ({state.admission.capacity} requests in flight: running + job_queue_size); "
               "retry later")

    def prepared(body: dict, status: str):
        data = json.dumps(body).encode()
        return status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))], [data]

    refusal = prepared({"code": 503, "error": message}, "503 SERVICE UNAVAILABLE")
    # Anthropic's clients read their own shape and code (529 overloaded_error) on /v1/messages
    overloaded = prepared(anthropic.error_body(503, message), f"{anthropic.status(503)} OVERLOADED")

    def app(environ, start_response):
        if environ.get("REQUEST_METHOD") != "POST":
            return wsgi_app(environ, start_response)
        if not state.admission.enter():
            state.count(503)
            state.metrics.count("queue_full", 503)
            status, headers, body = overloaded if environ.get("PATH_INFO", "").startswith("/v1/messages") \
                else refusal
            start_response(status, headers)
            return body
        try:
            return ClosingIterator(wsgi_app(environ, start_response), state.admission.leave)
        except BaseException:
            state.admission.leave()
            raise

    return app
