"""Flask app: SageMaker's contract (/ping, /invocations, /execution-parameters) + /metrics.

Thin on purpose: `parse_invocation` decodes a body, `collect` / `stream_lines` encode results;
neither changes with the batching strategy.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time

from flask import Flask, Response, request

from .engine import Channel, ErrorEvent, TokenEvent
from .request import RequestError, parse_invocation
from .scheduler import CapacityError, QueueFull

log = logging.getLogger("lmi.http")

STREAM_TYPES = {"jsonlines": "application/jsonlines", "sse": "text/event-stream"}


class ServerState:
    """What the app serves from; the engine appears once the model has loaded."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.engine = None
        self.error: str | None = None
        self.lock = threading.Lock()
        self.http = {"2xx": 0, "400": 0, "424": 0, "503": 0, "504": 0, "other": 0}

    def count(self, status: int) -> None:
        key = "2xx" if 200 <= status < 300 else str(status) if str(status) in self.http else "other"
        with self.lock:
            self.http[key] += 1


def error_response(status: int, message: str, field: str | None = None) -> Response:
    body = {"code": status, "error": message}
    if field:
        body["field"] = field
    return Response(json.dumps(body), status=status, mimetype="application/json")


class Timeout(Exception):
    pass


def _events(engine, ch: Channel, deadline: float):
    """Yield a channel's events until its last token; Timeout when the deadline passes."""
    while True:
        try:
            ev = ch.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            engine.abort(ch.seq_id)
            raise Timeout() from None
        yield ev
        if isinstance(ev, ErrorEvent) or ev.done is not None:
            return


def _result(prompt: str, tokens: list[TokenEvent], params) -> dict:
    done = tokens[-1].done
    text = (prompt if params.return_full_text else "") + done.generated_text
    out = {"generated_text": text}
    if params.details:
        out["details"] = {"finish_reason": done.finish_reason, "generated_tokens": done.generated_tokens,
                          "inputs_tokens": done.prompt_tokens,
                          "tokens": [{"id": t.id, "text": t.text, "log_prob": t.log_prob} for t in tokens]}
    return out


def collect(engine, chans: list[Channel], prompts: list[str], params, deadline: float):
    """Wait for every prompt's result. Returns (results, None) or (None, ErrorEvent)."""
    results = []
    for ch, prompt in zip(chans, prompts):
        tokens = []
        for ev in _events(engine, ch, deadline):
            if isinstance(ev, ErrorEvent):
                for other in chans:
                    engine.abort(other.seq_id)
                return None, ev
            tokens.append(ev)
        results.append(_result(prompt, tokens, params))
    return results, None


def stream_lines(engine, ch: Channel, prompt: str, params, deadline: float, fmt: str):
    """jsonlines / SSE: one {"token": ...} per token; the last also has generated_text."""
    def line(obj) -> str:
        data = json.dumps(obj, ensure_ascii=False)
        return f"data: {data}\n\n" if fmt == "sse" else data + "\n"

    finished = False
    tokens: list[TokenEvent] = []
    try:
        for ev in _events(engine, ch, deadline):
            if isinstance(ev, ErrorEvent):
                finished = True
                yield line({"error": ev.message, "code": ev.status})
                return
            tokens.append(ev)
            obj = {"token": {"id": ev.id, "text": ev.text, "log_prob": ev.log_prob}}
            if ev.done is not None:
                finished = True
                obj.update(_result(prompt, tokens, params))
            yield line(obj)
    except Timeout:
        finished = True
        yield line({"error": "request timed out", "code": 504})
    finally:
        if not finished:          # the client went away mid-stream: free its sequence now
            engine.abort(ch.seq_id)


def create_app(state: ServerState) -> Flask:
    app = Flask("lmi-serve")
    cfg = state.cfg

    @app.after_request
    def _count(resp):
        if request.path == "/invocations":
            state.count(resp.status_code)
        return resp

    @app.get("/ping")
    def ping():
        eng = state.engine
        if eng is not None and eng.healthy:
            return Response(json.dumps({"status": "healthy", "strategy": cfg.strategy}),
                            mimetype="application/json")
        status = "unhealthy" if state.error else "loading"
        return Response(json.dumps({"status": status, "error": state.error}), status=503,
                        mimetype="application/json")

    @app.get("/execution-parameters")
    def execution_parameters():
        running = cfg.batch_size if cfg.strategy == "dynamic" else (
            cfg.max_rolling_batch_size if cfg.strategy in ("rolling", "paged") else 1)
        return {"MaxConcurrentTransforms": running, "BatchStrategy": "MULTI_RECORD"
                if cfg.strategy != "none" else "SINGLE_RECORD", "MaxPayloadInMB": 6}

    @app.post("/invocations")
    def invocations():
        eng = state.engine
        if eng is None:
            return error_response(503, "the model is still loading" if not state.error
                                  else f"the model failed to load: {state.error}")
        try:
            inv = parse_invocation(request.get_data(), request.content_type,
                                   default_stream=cfg.output_formatter in STREAM_TYPES,
                                   max_batch_inputs=cfg.job_queue_size)
            prompt_ids = [eng.tokenize(p) for p in inv.inputs]
            for i, ids in enumerate(prompt_ids):
                if not ids:
                    raise RequestError(f"inputs[{i}]" if inv.is_list else "inputs", "encodes to no tokens")
            chans = eng.submit(prompt_ids, inv.params)
        except RequestError as e:
            return error_response(400, e.message, e.field)
        except CapacityError as e:
            field, _, msg = str(e).partition(": ")
            return error_response(400, msg, field)
        except QueueFull as e:
            log.warning("refused a request: %s", e)
            return error_response(503, str(e))
        deadline = chans[0].submitted + cfg.request_timeout_s
        if inv.stream:
            fmt = cfg.output_formatter if cfg.output_formatter in STREAM_TYPES else "jsonlines"
            return Response(stream_lines(eng, chans[0], inv.inputs[0], inv.params, deadline, fmt),
                            mimetype=STREAM_TYPES[fmt], headers={"X-Accel-Buffering": "no"})
        try:
            results, err = collect(eng, chans, inv.inputs, inv.params, deadline)
        except Timeout:
            for ch in chans:
                eng.abort(ch.seq_id)
            return error_response(504, f"request timed out after {cfg.request_timeout_s:g} s "
                                       f"(request_timeout / SAGEMAKER_MODEL_SERVER_TIMEOUT)")
        if err is not None:
            return error_response(err.status, err.message)
        body = results if inv.is_list else results[0]
        return Response(json.dumps(body, ensure_ascii=False), mimetype="application/json")

    @app.get("/metrics")
    def metrics():
        lines = [f'lmi_http_responses_total{{class="{k}"}} {v}' for k, v in state.http.items()]
        if state.engine is not None:
            for k, v in state.engine.stats().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    lines.append(f"lmi_{k} {v}")
        return Response("\n".join(lines) + "\n", mimetype="text/plain; version=0.0.4")

    @app.errorhandler(404)
    def not_found(_e):
        return error_response(404, f"no route {request.path}; use GET /ping or POST /invocations")

    @app.errorhandler(405)
    def bad_method(_e):
        return error_response(405, f"{request.method} is not allowed on {request.path}")

    @app.errorhandler(413)
    def too_large(_e):
        return error_response(413, "request body too large")

    @app.errorhandler(Exception)
    def internal(e):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}")

    return app
