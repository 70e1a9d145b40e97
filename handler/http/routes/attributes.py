"""/invocations' protocol switch: SageMaker passes a request's `CustomAttributes`
(`invoke_endpoint(..., CustomAttributes="protocol=anthropic-messages")`) to the container as the
`X-Amzn-SageMaker-Custom-Attributes` header, so an agent behind an endpoint can speak Anthropic's
Messages or OpenAI's Responses through /invocations:

  protocol=anthropic-messages   the body is a POST /v1/messages body, answered as that route does
  protocol=openai-responses     the body is a POST /v1/responses body (the store included)

Attributes are `key=value` pairs separated by `;` or `,`; other keys are ignored. Without a
`protocol` attribute, /invocations keeps LMI's body dispatch (handler/http/routes/sagemaker.py).
"""
from __future__ import annotations

from flask import request

from handler.engine.request import RequestError, show
from handler.http.routes import anthropic, responses
from handler.http.routes.common import CUSTOM_ATTRIBUTES_HEADER as HEADER, custom_attribute, error_response

PROTOCOLS = {"anthropic-messages": anthropic.messages, "openai-responses": responses.create}


def protocol(header: str | None) -> str | None:
    """The `protocol` attribute of a custom-attributes value, or None."""
    value = custom_attribute(header, "protocol")
    if value is not None and value not in PROTOCOLS:
        raise RequestError(HEADER, f"protocol={show(value)} is not served; allowed: "
                                   + ", ".join(f"protocol={p}" for p in PROTOCOLS))
    return value


def dispatch():
    """The response of the protocol the header picks, or None (LMI's dispatch)."""
    try:
        name = protocol(request.headers.get(HEADER))
    except RequestError as e:
        return error_response(e.status, e.message, e.field)
    return None if name is None else PROTOCOLS[name]()
