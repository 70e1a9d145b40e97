"""LMI's create_non_stream_output(): an Output holding one answer, a dict (as JSON) or a string, with
its content type; with `error`, a failed answer with `code` (424 when none is given) and LMI's error body."""
from __future__ import annotations

from djl_python.outputs import Output


def create_non_stream_output(data, properties: dict | None = None, error: str | None = None,
                             code: int | None = None) -> Output:
    if error:
        out = Output().error(error, code=code or 424)
    else:
        out = Output().add_property("content-type", "application/json")
        out.add(data)     # a dict as JSON, a string as it is
    for k, v in (properties or {}).items():
        out.add_property(k, v)
    return out
