"""OpenAI's Responses API: POST /v1/responses (whole or streamed), GET and DELETE /v1/responses/<id>,
GET /v1/responses/<id>/input_items, over the server's bounded store (handler/http/protocols/store.py)."""
from __future__ import annotations

from flask import Blueprint, request

from handler.engine.request import RequestError
from handler.http.protocols import openai, responses
from handler.http.routes.common import (SSE, body_json, current_state, json_response, model_name, openai_error, run,
                                        streamed)

bp = Blueprint("responses", __name__)


def respond_with(state):
    """The respond / stream callbacks of `run` for a Responses request (also /invocations' hook):
    the finished response is stored unless the request said `store: false`."""
    name = model_name(state.cfg)

    def keep(gen, response):
        if response["store"]:
            state.responses.put(response["id"], responses.record(gen, response))

    def respond(gen, samples):
        response = responses.encode(gen, samples, name)
        keep(gen, response)
        return json_response(response)

    def stream(gen, events):
        return streamed(state, responses.stream(gen, events, name, lambda r: keep(gen, r)), events, SSE)

    return respond, stream


@bp.post("/v1/responses")
def create():
    state = current_state()
    server = openai.ServerOptions.of(state.cfg)
    return run(lambda tok: responses.parse(body_json(), tok, server, state.responses.get), openai_error,
               *respond_with(state))


def _unknown(rid: str):
    return openai_error(404, f"no stored response {rid!r} (unknown, deleted, evicted, or made with store: false)",
                        "response_id")


@bp.get("/v1/responses/<rid>")
def get(rid):
    got = current_state().responses.get(rid)
    return _unknown(rid) if got is None else json_response(got["response"])


@bp.get("/v1/responses/<rid>/input_items")
def input_items(rid):
    got = current_state().responses.get(rid)
    if got is None:
        return _unknown(rid)
    try:
        return json_response(responses.input_items(got, rid, request.args))
    except RequestError as e:
        return openai_error(e.status, e.message, e.field)


@bp.delete("/v1/responses/<rid>")
def delete(rid):
    return json_response(responses.deleted(rid)) if current_state().responses.delete(rid) else _unknown(rid)
