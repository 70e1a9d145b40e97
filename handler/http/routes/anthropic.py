"""Anthropic's Messages API: POST /v1/messages (whole or streamed), POST /v1/messages/count_tokens.
The `anthropic-version`, `anthropic-beta` and `x-api-key` headers are accepted and not checked."""
from __future__ import annotations

from flask import Blueprint

from handler.http import protocols as api
from handler.http.protocols import anthropic, answer, openai
from handler.http.routes.common import (SSE, body_json, current_state, json_response, model_name, run, streamed,
                                        with_client)

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
    sampling = answer.model_sampling(state.cfg.model_dir)
    return run(lambda tok: anthropic.parse(body_json(), tok, server, sampling=sampling), anthropic_error,
               *respond_with(state))


@bp.post("/v1/messages/count_tokens")
def count_tokens():
    server = openai.ServerOptions.of(current_state().cfg)

    def count(client):
        gen = anthropic.parse(body_json(), client.tokenizer, server, count=True)
        return anthropic.count_tokens(len(api.tokenize(client.tokenizer, gen, client.media)[0]))

    return with_client(anthropic_error, count)
