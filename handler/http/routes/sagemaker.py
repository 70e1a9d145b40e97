"""SageMaker's contract and LMI's routes: GET /ping, GET /execution-parameters, POST /invocations
(and DJL Serving's POST /predictions/<model>), in the shape option.output_formatter and
option.tgi_compat choose."""
from __future__ import annotations

from flask import Blueprint, Response, request

from handler.config import compat
from handler.engine.request import SamplingParams
from handler.engine.request import RequestError
from handler.http.custom import CustomCallError
from handler.http.protocols import lmi, openai
from handler.http.routes import attributes, pooling
from handler.http.routes.common import (ADAPTER_HEADER, JSONLINES, SSE, STREAMING_FORMATTERS, body_bytes, body_json, current_state,
                                        error_response, json_response, model_name, run, running_width,
                                        streamed)

bp = Blueprint("sagemaker", __name__)


@bp.get("/ping")
def ping():
    state = current_state()
    client = state.client
    if client is not None and client.healthy:
        return json_response({"status": "healthy", "strategy": state.cfg.strategy})
    # Loading; or unhealthy: the load failed, a rank died, the engine thread died or wedged.
    error = state.error or (client.error if client is not None else None)
    status = "unhealthy" if error or client is not None else "loading"
    return json_response({"status": status, "error": error}, 503)


@bp.get("/execution-parameters")
def execution_parameters():
    cfg = current_state().cfg
    mb = cfg.max_payload_mb
    return {"MaxConcurrentTransforms": running_width(cfg), "BatchStrategy": "MULTI_RECORD"
            if cfg.strategy != "none" else "SINGLE_RECORD",
            "MaxPayloadInMB": int(mb) if mb == int(mb) else mb}


# LMI (DJL Serving) also answers /predictions/<model>, which clients of LMI images use.
@bp.post("/invocations")
@bp.post("/predictions/<model>")
def invocations(model=None):
    picked = attributes.dispatch()       # X-Amzn-SageMaker-Custom-Attributes: protocol=...
    if picked is not None:
        return picked
    state = current_state()
    cfg = state.cfg
    custom = state.custom       # model.py (handler/http/custom.py): its handle() or formatters
    if custom is not None and custom.handle is not None:
        return _custom_handle(state, custom)
    if state.client is not None and state.client.pooling:      # an embedding / rerank model
        return pooling.invocations()
    formatter = cfg.output_formatter
    tgi_compat = getattr(cfg, "tgi_compat", False)
    chat_out = formatter.endswith("_chat")
    sse = formatter in ("sse", "sse_chat") or (tgi_compat and formatter == "json")
    tgi_shape = tgi_compat and formatter in ("json", "sse")
    line = compat.line(cfg)
    code = custom       # the formatters in force: the adapter's model.py over the model's (LMI)

    def parse(tokenizer):
        nonlocal code
        # The body's shape picks its API (current LMI: prompt, inputs, messages, in that order).
        payload = body_json()
        if state.adapter_custom:
            name = payload.get("adapters") if isinstance(payload, dict) else None
            code = state.adapter_custom.get(name if isinstance(name, str) else request.headers.get(ADAPTER_HEADER),
                                            custom)
        if code is not None and code.input_formatter is not None:
            try:
                payload = code.format_input(payload, tokenizer)
            except CustomCallError as e:
                raise RequestError("body", f"Custom formatter failed: {e}", status=424) from None
        if line.prompt_as_completion and isinstance(payload, dict) and payload.get("prompt") is not None:
            return openai.parse_completion(payload, tokenizer, lax=line.lax_numbers)
        if isinstance(payload, dict) and payload.get("messages") is not None:
            gen = openai.parse_chat(payload, tokenizer, lmi=True, server=openai.ServerOptions.of(cfg))
            gen.adapter = lmi.adapter_name(payload.get("adapters"), 1)
            if payload.get("stream") is None and formatter in STREAMING_FORMATTERS:
                gen.stream = True
            return gen
        defaults = SamplingParams(details=True) if tgi_shape else SamplingParams()
        gen = lmi.parse(payload, default_stream=formatter in STREAMING_FORMATTERS,
                        max_batch_inputs=cfg.job_queue_size, defaults=defaults,
                        lax=line.lax_numbers, infer_sampling=line.infer_sampling)
        if chat_out:
            gen.extra = {"kind": "chat", "logprobs": False, "lmi": True, "include_usage": False}
        return gen

    def respond(gen, samples):
        if gen.extra.get("kind") in ("chat", "completion"):
            body = openai.encode(gen, samples, model_name(cfg))
        else:
            body = lmi.encode(gen, samples, tgi=tgi_shape)
        if code is not None:
            try:
                body = code.format_output(body)
            except CustomCallError as e:
                return error_response(424, f"Custom formatter failed: {e}")
        return json_response(body)

    def stream(gen, events):
        mimetype = SSE if sse else JSONLINES
        if gen.extra.get("kind") in ("chat", "completion"):
            lines = openai.stream(gen, events, model_name(cfg), sse=sse)
        else:
            lines = lmi.stream(gen, events, sse, tgi=tgi_shape)
        return streamed(state, code.format_lines(lines, sse) if code is not None else lines, events, mimetype)

    return run(parse, error_response, respond, stream)


def _custom_handle(state, custom) -> Response:
    """model.py's handle() answers the request (LMI's custom handler): its Output's code, content and
    content type; a raise or a wrong return is a 424 naming the function, file and line."""
    from handler.http.custom import model_properties
    try:
        body = body_bytes()
    except RequestError as e:
        return error_response(e.status, e.message, e.field)
    try:
        status, data, ctype = custom.invoke(body, dict(request.headers), model_properties(state.cfg.properties))
    except CustomCallError as e:
        return error_response(424, str(e))
    return Response(data, status=status, mimetype=None, content_type=ctype)
