"""OpenAI's routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""
from __future__ import annotations

from flask import Blueprint

from handler.http.protocols import openai
from handler.http.routes.common import (SSE, body_json, current_state, json_response, model_name, openai_error,
                                        run, streamed)

bp = Blueprint("openai", __name__)


def _route(parse):
    state = current_state()
    name = model_name(state.cfg)

    def respond(gen, samples):
        return json_response(openai.encode(gen, samples, name))

    def stream(gen, events):
        return streamed(state, openai.stream(gen, events, name), events, SSE)

    return run(parse, openai_error, respond, stream)


@bp.post("/v1/chat/completions")
def chat_completions():
    return _route(lambda tok: openai.parse_chat(body_json(), tok))


@bp.post("/v1/completions")
def completions():
    return _route(lambda tok: openai.parse_completion(body_json(), tok))


@bp.get("/v1/models")
def list_models():
    state = current_state()
    client = state.client
    names = client.adapter_names() if client is not None else []
    return json_response(openai.models(model_name(state.cfg), state.started, names))
