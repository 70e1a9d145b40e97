"""OpenAI's routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models; vLLM's
POST /tokenize and /detokenize (also under /v1/), GET /tokenizer_info."""
from __future__ import annotations

from flask import Blueprint

from handler.http.protocols import openai, tokens
from handler.http.routes.common import (SSE, body_json, current_state, json_response, model_name, openai_error,
                                        run, streamed, with_client)

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
    server = openai.ServerOptions.of(current_state().cfg)
    return _route(lambda tok: openai.parse_chat(body_json(), tok, server=server))


@bp.post("/v1/completions")
def completions():
    return _route(lambda tok: openai.parse_completion(body_json(), tok))


@bp.get("/v1/models")
def list_models():
    state = current_state()
    client = state.client
    names = client.adapter_names() if client is not None else []
    return json_response(openai.models(model_name(state.cfg), state.started, names))


def _tokens(work):
    return with_client(openai_error, work)


@bp.post("/tokenize")
@bp.post("/v1/tokenize")
def tokenize():
    server = openai.ServerOptions.of(current_state().cfg)
    return _tokens(lambda c: tokens.tokenize(body_json(), c.tokenizer, c.max_sequence_len, server))


@bp.post("/detokenize")
@bp.post("/v1/detokenize")
def detokenize():
    return _tokens(lambda c: tokens.detokenize(body_json(), c.tokenizer))


@bp.get("/tokenizer_info")
@bp.get("/v1/tokenizer_info")
def tokenizer_info():
    return _tokens(lambda c: tokens.tokenizer_info(c.tokenizer, c.max_sequence_len))
