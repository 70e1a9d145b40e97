"""Anthropic's Messages API: POST /v1/messages (whole or streamed), POST /v1/messages/count_tokens.
The `anthropic-version`, `anthropic-beta` and `x-api-key` headers are accepted and not checked."""
from __future__ import annotations

from flask import Blueprint

from handler.engine.request import RequestError
from handler.http import protocols as api
from handler.http.protocols import anthropic, openai
from handler.http.routes.common import SSE, body_json, current_state, json_response, model_name, run, streamed

bp = Blueprint("anthropic", __name__)


def anthropic_error(status, message, field=None):
    return json_response(anthropic.error_body(status, message, field), anthropic.status(status))


def respond_with(state):
    """The respond / stream callbacks of `run` for a Messages request (also /invocations' hook)."""
    name = model_name(state.cfg)

    def respond(gen, samples):
        return json_response(anthropic.encode(gen, samples, name))

    def stream(gen, events):
        return streamed(state, anthropic.stream(gen, events, name), events, SSE)

    return respond, stream


@bp.post("/v1/messages")
def messages():
    state = current_state()
    server = openai.ServerOptions.of(state.cfg)
    return run(lambda tok: anthropic.parse(body_json(), tok, server), anthropic_error, *respond_with(state))


@bp.post("/v1/messages/count_tokens")
def count_tokens():
    state = current_state()
    client = state.client
    if client is None:
        return anthropic_error(503, "the model is still loading" if not state.error
                               else f"the model failed to load: {state.error}")
    try:
        gen = anthropic.parse(body_json(), client.tokenizer, openai.ServerOptions.of(state.cfg), count=True)
        ids = api.tokenize(client.tokenizer, gen)
    except RequestError as e:
        return anthropic_error(e.status, e.message, e.field)
    return json_response(anthropic.count_tokens(len(ids[0])))
