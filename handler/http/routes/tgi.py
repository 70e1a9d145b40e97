"""Text Generation Inference's routes: POST /generate, POST /generate_stream and POST / (TGI's
compat route: a list answer, streamed when the body asks)."""
from __future__ import annotations

from flask import Blueprint

from handler.http.protocols import tgi
from handler.http.routes.common import SSE, body_json, current_state, json_response, run, streamed, tgi_error

bp = Blueprint("tgi", __name__)


def _route(force_stream, as_list):
    state = current_state()

    def respond(gen, samples):
        out = tgi.encode(gen, samples)
        return json_response([out] if as_list else out)

    def stream(gen, events):
        return streamed(state, tgi.stream(gen, events), events, SSE)

    return run(lambda tok: tgi.parse(body_json(), stream=force_stream), tgi_error, respond, stream)


@bp.post("/generate")
def generate():
    return _route(False, False)


@bp.post("/generate_stream")
def generate_stream():
    return _route(True, False)


@bp.post("/")
def compat():
    return _route(None, True)
