"""Operations: GET /metrics (Prometheus text, handler/http/metrics.py)."""
from __future__ import annotations

from flask import Blueprint, Response

from handler.http.metrics import CONTENT_TYPE
from handler.http.routes.common import current_state

bp = Blueprint("ops", __name__)


@bp.get("/metrics")
def metrics():
    return Response(current_state().metrics.exposition(), content_type=CONTENT_TYPE)
