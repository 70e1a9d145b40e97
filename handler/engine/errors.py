"""A bad request (`RequestError`, a 400 naming the request field) and how a client's value is
echoed in its message (`show`). No torch."""
from __future__ import annotations

import json

MAX_SHOWN = 100                     # characters of a client's value echoed in an error


class RequestError(ValueError):
    """A bad request: `field` names the offending part of the body (HTTP 400 unless `status`)."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status      # 415 for an unsupported content type


def show(v) -> str:
    """A client's value for an error message: JSON, at most MAX_SHOWN characters."""
    try:
        s = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= MAX_SHOWN else s[:MAX_SHOWN - 3] + "..."
