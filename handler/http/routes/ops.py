"""Operations: GET /metrics (Prometheus text, handler/http/metrics.py), GET /openapi.json (the
generation routes' request bodies, handler/http/protocols/openapi.py)."""
from __future__ import annotations

from flask import Blueprint, Response

from handler.http.metrics import CONTENT_TYPE
from handler.http.protocols import openapi
from handler.http.routes.common import current_state, json_response

bp = Blueprint("ops", __name__)


@bp.get("/metrics")
def metrics():
    return Response(current_state().metrics.exposition(), content_type=CONTENT_TYPE)


@bp.get("/openapi.json")
def openapi_document():
    state = current_state()
    client = state.client                   # once loaded: bounds from its vocabulary and length
    limits = dict(priorities=state.cfg.scheduling_policy == "priority", lora=bool(state.cfg.enable_lora))
    if client is None:
        return json_response(openapi.document(**limits))
    return json_response(openapi.document(len(client.tokenizer), client.max_sequence_len,
                                          pooling=bool(getattr(client, "pooling", False)), **limits))
