"""LMI's decode(): a request's body by its content type (JSON; text/plain as one prompt in a list;
text/csv's `inputs` column), as /invocations decodes it (handler/http/protocols/lmi.py)."""
from __future__ import annotations

import json

from djl_python.inputs import Input


def decode(inputs: Input, content_type: str | None, key=None):
    from handler.http.protocols.lmi import decode_body
    return decode_body(inputs.get_as_bytes(key=key) or b"", content_type)


def encode(outputs, content, accept: str | None = None):
    """JSON into an Output (the content types LMI's text handlers answer)."""
    outputs.add_property("content-type", "application/json")
    outputs.add(json.dumps(content, ensure_ascii=False).encode("utf-8"))
    return outputs
