"""Flask app: SageMaker's contract (/ping, /invocations, /execution-parameters), the OpenAI routes
(/v1/chat/completions, /v1/completions, /v1/models), TGI's (/generate, /generate_stream, POST /)
and /metrics.

Thin on purpose: a protocol module in handler/api/ decodes each body into a Generation and encodes
the engine's samples or events; the routes only submit, wait and choose the response type.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException
from werkzeug.wsgi import ClosingIterator

from handler.http import protocols as api
from handler.http.protocols import lmi, openai, tgi
from handler.http.metrics import CONTENT_TYPE, Metrics, RequestTrace, request_id
from handler.http.guard import (Admission, ClientDisconnected, MalformedBody, PayloadTooLarge, check_prompt,
                    longest_token_chars, read_body)
from handler.engine.request import RequestError, SamplingParams, show
from handler.engine.scheduler import CapacityError, QueueFull

log = logging.getLogger("lmi.http")

SSE = "text/event-stream"
JSONLINES = "application/jsonlines"
STREAMING_FORMATTERS = ("jsonlines", "sse", "jsonlines_chat", "sse_chat")
ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"   # SageMaker's per-request LoRA adapter


class ServerState:
    """What the app serves from; the engine appears once the model has loaded."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.engine = None
        self.error: str | None = None
        self.lock = threading.Lock()
        self.http = {"2xx": 0, "400": 0, "413": 0, "424": 0, "503": 0, "504": 0, "other": 0}
        self.started = int(time.time())
        # Client went away during its upload or mid-stream: not a server error.
        self.client_disconnects = 0
        # At most this many generation requests in flight: every running slot + the queue.
        self.admission = Admission(running_width(cfg) + cfg.job_queue_size)
        self._max_prompt_chars: int | None = None
        self.metrics = Metrics(model_name(cfg), cfg.strategy, lambda: self.engine, self.http_stats)
        # The gevent worker's hub.HubWaker (set by server.create_state); None: threads block.
        self.waker = None

    def http_stats(self) -> dict:
        """What the HTTP layer counts itself, for the metrics collector."""
        with self.lock:
            return {"responses": dict(self.http), "client_disconnects": self.client_disconnects,
                    "in_flight": self.admission.inside, "refused": self.admission.refused}

    def check_prompts(self, gen) -> None:
        """Before tokenizing: text the tokenizer cannot take, or too long to fit the context
        whatever it tokenizes to (a token covers at most the longest vocabulary entry's
        characters; x4 for normalizers that merge characters). Truncated prompts may be long."""
        eng = self.engine
        if self._max_prompt_chars is None:
            self._max_prompt_chars = 4 * eng.scheduler.policy.max_model_len * \
                longest_token_chars(eng.tokenizer)
        limit = self._max_prompt_chars if gen.truncate is None else None
        for i, text in enumerate(gen.prompts):
            check_prompt(text, gen.fields[i] if i < len(gen.fields) else "inputs", limit,
                         eng.scheduler.policy.max_model_len)

    def disconnected(self) -> None:
        with self.lock:
            self.client_disconnects += 1

    def count(self, status: int) -> None:
        key = "2xx" if 200 <= status < 300 else str(status) if str(status) in self.http else "other"
        with self.lock:
            self.http[key] += 1


def _json(body, status: int = 200) -> Response:
    # A lone surrogate (echoed from a client's value) cannot be UTF-8: write it as its JSON escape.
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return Response(data, status=status, mimetype="application/json")


def error_response(status: int, message: str, field: str | None = None) -> Response:
    body = {"code": status, "error": message}
    if field:
        body["field"] = field
    return _json(body, status)


def _openai_error(status, message, field=None):
    return _json(openai.error_body(status, message, field), status)


def _tgi_error(status, message, field=None):
    return _json(tgi.error_body(status, message, field), 422 if status == 400 else status)


def running_width(cfg) -> int:
    """Sequences the strategy runs at once."""
    return cfg.batch_size if cfg.strategy == "dynamic" else (
        cfg.max_rolling_batch_size if cfg.strategy in ("rolling", "paged") else 1)


def model_name(cfg) -> str:
    return os.path.basename(str(cfg.model_id).rstrip("/")) or "model"


def create_app(state: ServerState) -> Flask:
    app = Flask("lmi-serve")
    cfg = state.cfg
    tgi_compat = getattr(cfg, "tgi_compat", False)
    formatter = cfg.output_formatter
    timeout_hint = "request_timeout / option.predict_timeout / SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS"

    @app.before_request
    def _trace():
        rid, header = request_id(request.headers)
        g.request_id, g.id_header = rid, header
        if request.method == "POST":          # an inference request, whatever its protocol
            g.trace = RequestTrace(state.metrics, rid)

    @app.after_request
    def _record(resp):
        if request.path != "/ping" and request.method == "POST":
            state.count(resp.status_code)
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

    def lora_of(eng):
        return getattr(eng.runner, "lora", None)

    def pick_adapter(eng, gen) -> None:
        """The LoRA adapter a request names (the body's `adapters`, SageMaker's header, or an
        OpenAI `model` other than the base's) into gen.params; an unknown name is a 400."""
        lora = lora_of(eng)
        name, where = gen.adapter, gen.adapter_field
        if name is None and request.headers.get(ADAPTER_HEADER):
            name, where = request.headers[ADAPTER_HEADER], ADAPTER_HEADER
        model = gen.extra.get("model")
        if name is None and lora is not None and isinstance(model, str) and model \
                and model != model_name(cfg):
            name, where = model, "model"
        if name is None:
            return
        if lora is None:
            raise RequestError(where, "LoRA adapters are not enabled on this server "
                                      "(set option.enable_lora=true)")
        try:
            adapter = lora.get(name)
        except ValueError as e:     # AdapterError: its files changed since it was registered
            raise RequestError(where, str(e), status=424) from None
        if adapter is None:
            known = sorted(a["name"] for a in lora.list())
            raise RequestError(where, f"unknown adapter {show(name)}; registered: "
                                      f"{', '.join(known[:20]) or 'none'}"
                                      + (f" (base model: {model_name(cfg)})" if where == "model" else ""))
        gen.params = dataclasses.replace(gen.params, adapter=adapter)

    def run(parse, error, respond, stream):
        """parse() -> Generation; respond(gen, samples) -> Response; stream(gen, events) -> Response."""
        eng = state.engine
        if eng is None:
            g.trace.reason = "loading"
            return error(503, "the model is still loading" if not state.error
                         else f"the model failed to load: {state.error}")
        try:
            gen = parse(eng.tokenizer)
            pick_adapter(eng, gen)
            state.check_prompts(gen)
            ids = api.tokenize(eng.tokenizer, gen)
            api.with_length(gen, ids, min(eng.scheduler.policy.max_model_len,
                                          eng.blocks.num_blocks * eng.blocks.block_size))
            chans = eng.submit(ids, gen.params, stream=gen.stream)
        except RequestError as e:
            return error(e.status, e.message, e.field)
        except CapacityError as e:
            g.trace.reason = "too_long"
            return error(400, e.message, gen.extra.get("fields", {}).get(e.field, e.field))
        except QueueFull as e:
            g.trace.reason = "queue_full"
            log.warning("refused a request: %s", e)
            return error(503, str(e))
        if state.waker is not None:
            state.waker.attach(chans)
        g.trace.watch(chans)
        deadline = chans[0].submitted + cfg.request_timeout_s
        if gen.stream:
            events = api.stream_events(eng, chans, len(gen.prompts), deadline)
            return stream(gen, events)
        try:
            samples = api.collect(eng, chans, len(gen.prompts), deadline)
        except api.Timeout:
            return error(504, f"request timed out after {cfg.request_timeout_s:g} s ({timeout_hint})")
        except api.Failed as f:
            return error(f.status, f.message)
        return respond(gen, samples)

    def streamed(lines, events, mimetype) -> Response:
        def gen():
            try:
                yield from lines
            except GeneratorExit:   # closed before its end: the client went away
                state.disconnected()
                raise
            finally:
                events.close()      # the client went away: abort what is still running
        return Response(gen(), mimetype=mimetype, headers={"X-Accel-Buffering": "no"})

    def body_json():
        try:
            body = read_body(request.environ, int(cfg.max_payload_mb * 1e6))
        except PayloadTooLarge as e:
            raise RequestError("body", f"{e} (option.max_payload_mb={cfg.max_payload_mb:g})", 413) from None
        except MalformedBody as e:
            raise RequestError("body", str(e)) from None
        except ClientDisconnected:
            state.disconnected()
            raise RequestError("body", "the client closed the connection before sending its body") from None
        return lmi.decode_body(body, request.content_type)

    @app.get("/ping")
    def ping():
        eng = state.engine
        if eng is not None and eng.healthy:
            return _json({"status": "healthy", "strategy": cfg.strategy})
        status = "unhealthy" if state.error else "loading"
        return _json({"status": status, "error": state.error}, 503)

    @app.get("/execution-parameters")
    def execution_parameters():
        mb = cfg.max_payload_mb
        return {"MaxConcurrentTransforms": running_width(cfg), "BatchStrategy": "MULTI_RECORD"
                if cfg.strategy != "none" else "SINGLE_RECORD",
                "MaxPayloadInMB": int(mb) if mb == int(mb) else mb}

    # ---- LMI
    # LMI (DJL Serving) also answers /predictions/<model>, which clients of LMI images use.
    @app.post("/invocations")
    @app.post("/predictions/<model>")
    def invocations(model=None):
        chat_out = formatter.endswith("_chat")
        sse = formatter in ("sse", "sse_chat") or (tgi_compat and formatter == "json")
        tgi_shape = tgi_compat and formatter in ("json", "sse")

        def parse(tokenizer):
            payload = body_json()
            if isinstance(payload, dict) and payload.get("messages") is not None:
                gen = openai.parse_chat(payload, tokenizer, lmi=True)
                gen.adapter = lmi.adapter_name(payload.get("adapters"), 1)
                if payload.get("stream") is None and formatter in STREAMING_FORMATTERS:
                    gen.stream = True
                return gen
            defaults = SamplingParams(details=True) if tgi_shape else SamplingParams()
            gen = lmi.parse(payload, default_stream=formatter in STREAMING_FORMATTERS,
                            max_batch_inputs=cfg.job_queue_size, defaults=defaults)
            if chat_out:
                gen.extra = {"kind": "chat", "logprobs": False, "lmi": True, "include_usage": False}
            return gen

        def respond(gen, samples):
            if gen.extra.get("kind") == "chat":
                return _json(openai.encode(gen, samples, model_name(cfg)))
            return _json(lmi.encode(gen, samples, tgi=tgi_shape))

        def stream(gen, events):
            if gen.extra.get("kind") == "chat":
                return streamed(openai.stream(gen, events, model_name(cfg), sse=sse), events,
                                SSE if sse else JSONLINES)
            return streamed(lmi.stream(gen, events, sse, tgi=tgi_shape), events, SSE if sse else JSONLINES)

        return run(parse, error_response, respond, stream)

    # ---- OpenAI
    def openai_route(parse_fn):
        def respond(gen, samples):
            return _json(openai.encode(gen, samples, model_name(cfg)))

        def stream(gen, events):
            return streamed(openai.stream(gen, events, model_name(cfg)), events, SSE)

        return run(parse_fn, _openai_error, respond, stream)

    @app.post("/v1/chat/completions")
    def chat_completions():
        return openai_route(lambda tok: openai.parse_chat(body_json(), tok))

    @app.post("/v1/completions")
    def completions():
        return openai_route(lambda tok: openai.parse_completion(body_json()))

    @app.get("/v1/models")
    def list_models():
        lora = lora_of(state.engine) if state.engine is not None else None
        names = [a["name"] for a in lora.list()] if lora is not None else []
        return _json(openai.models(model_name(cfg), state.started, names))

    # ---- LoRA adapters: LMI's management routes (djl-serving docs/adapters_api.md)
    def adapters_or_error(model):
        if model is not None and model != model_name(cfg):
            return None, error_response(404, f"no model {show(model)}; this server serves "
                                             f"{show(model_name(cfg))}")
        if state.engine is None:
            return None, error_response(503, "the model is still loading")
        lora = lora_of(state.engine)
        if lora is None:
            return None, error_response(400, "LoRA adapters are not enabled on this server "
                                             "(set option.enable_lora=true)")
        return lora, None

    def arg(name):
        v = request.args.get(name)
        if v is None and request.is_json:
            body = request.get_json(silent=True)
            v = body.get(name) if isinstance(body, dict) else None
        return v

    @app.post("/models/<model>/adapters")
    @app.post("/adapters", defaults={"model": None})
    def register_adapter(model):
        lora, err = adapters_or_error(model)
        if err:
            return err
        name, src = arg("name"), arg("src")
        for key, v in (("name", name), ("src", src)):
            if not isinstance(v, str) or not v:
                return error_response(400, f"{key} is required (POST .../adapters?name=NAME&src=DIR)", key)
        from handler.model.lora import AdapterError
        try:
            lora.register(name, src)
        except KeyError:
            return error_response(409, f"adapter {show(name)} is already registered; DELETE it first", "name")
        except AdapterError as e:
            return error_response(400, str(e), "src")
        return _json({"status": f"Adapter {name} registered"})

    @app.get("/models/<model>/adapters")
    @app.get("/adapters", defaults={"model": None})
    def list_adapters(model):
        lora, err = adapters_or_error(model)
        return err or _json({"adapters": lora.list()})

    @app.get("/models/<model>/adapters/<name>")
    @app.get("/adapters/<name>", defaults={"model": None})
    def describe_adapter(model, name):
        lora, err = adapters_or_error(model)
        if err:
            return err
        found = [a for a in lora.list() if a["name"] == name]
        return _json(found) if found else error_response(404, f"no adapter {show(name)}")

    @app.delete("/models/<model>/adapters/<name>")
    @app.delete("/adapters/<name>", defaults={"model": None})
    def unregister_adapter(model, name):
        lora, err = adapters_or_error(model)
        if err:
            return err
        if not lora.unregister(name):
            return error_response(404, f"no adapter {show(name)}")
        return _json({"status": f"Adapter {name} unregistered"})

    # ---- TGI
    def tgi_route(force_stream, as_list):
        def respond(gen, samples):
            out = tgi.encode(gen, samples)
            return _json([out] if as_list else out)

        def stream(gen, events):
            return streamed(tgi.stream(gen, events), events, SSE)

        return run(lambda tok: tgi.parse(body_json(), stream=force_stream), _tgi_error, respond, stream)

    @app.post("/generate")
    def tgi_generate():
        return tgi_route(False, False)

    @app.post("/generate_stream")
    def tgi_generate_stream():
        return tgi_route(True, False)

    @app.post("/")
    def tgi_compat_route():
        return tgi_route(None, True)

    # ---- operations
    @app.get("/metrics")
    def metrics():
        return Response(state.metrics.exposition(), content_type=CONTENT_TYPE)

    def _route_error(status, message):
        if request.path.startswith("/v1/"):
            return _openai_error(status, message)
        return error_response(status, message)

    @app.errorhandler(404)
    def not_found(_e):
        return _route_error(404, f"no route {request.path}; use GET /ping, POST /invocations, "
                                 "POST /v1/chat/completions, POST /v1/completions or POST /generate")

    @app.errorhandler(405)
    def bad_method(_e):
        return _route_error(405, f"{request.method} is not allowed on {request.path}")

    @app.errorhandler(HTTPException)
    def http_error(e):
        return _route_error(e.code or 500, f"{e.name}: {e.description}")

    @app.errorhandler(Exception)
    def internal(e):
        log.exception("unhandled error")
        return _route_error(500, f"internal error: {type(e).__name__}")

    app.wsgi_app = _admitting(app.wsgi_app, state)
    return app


def _admitting(wsgi_app, state: ServerState):
    """Admission in front of Flask: every POST (a generation request, whatever its protocol)
    enters the counter or is refused with a prepared 503 before Flask builds a request, reads
    the body, parses or tokenizes (the cheapest refusal this process can make). An admitted
    request leaves when its response is closed, i.e. after the last byte of a stream."""
    refusal = json.dumps({"code": 503, "error": f"the queue is full ({state.admission.capacity} "
                          "requests in flight: running + job_queue_size); retry later"}).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(refusal)))]

    def app(environ, start_response):
        if environ.get("REQUEST_METHOD") != "POST":
            return wsgi_app(environ, start_response)
        if not state.admission.enter():
            state.count(503)
            state.metrics.count("queue_full", 503)
            start_response("503 SERVICE UNAVAILABLE", headers)
            return [refusal]
        try:
            return ClosingIterator(wsgi_app(environ, start_response), state.admission.leave)
        except BaseException:
            state.admission.leave()
            raise

    return app
