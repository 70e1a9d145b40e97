"""GET /openapi.json: the generation routes' request bodies, from the declared models.

The sampling parameters (handler/engine/request.Parameters) and OpenAI's scalar fields
(handler/http/protocols/openai.ChatFields, CompletionFields) are pydantic models; their JSON
schemas are the document's components. The free-form parts (`messages`, `tools`, the guided-
decoding parameters) are described by docs/API.md and checked by their own parsers.
"""
from __future__ import annotations

import json
from functools import lru_cache

from handler.engine import guide
from handler.engine.request import ALIASES, Parameters, RequestOptions
from handler.http.protocols.lmi import LmiRequest
from handler.http.protocols.openai import ChatFields, CompletionFields

_TEXT_OR_LIST = {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}]}


def _parameters_schema() -> dict:
    """Parameters plus the request options, the aliases and the guided-decoding names (any JSON)."""
    s = Parameters.model_json_schema()
    props = dict(s["properties"])
    props.update(RequestOptions.model_json_schema()["properties"])
    for alias, canon in ALIASES.items():
        props[alias] = {**props[canon], "description": f"the same as {canon}"}
    for name in guide.PARAMETERS:
        props[name] = {"description": "guided decoding (docs/API.md)"}
    return {"type": "object", "title": "Parameters", "description": s.get("description", ""),
            "properties": props, "additionalProperties": True}


def _body(schema: dict, required: list[str], extra: dict) -> dict:
    """A model's schema with `extra` properties (the free-form or separately parsed parts) in
    place of the model's own of those names."""
    s = dict(schema)
    s["properties"] = {**s.get("properties", {}), **extra}
    s["required"] = required
    s["additionalProperties"] = True
    return s


def _post(summary: str, ref: str) -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": f"#/components/schemas/{ref}"}}}},
                     "responses": {"200": {"description": "the generated text (or a stream)"},
                                   "400": {"description": "a bad request: one line naming the field"},
                                   "424": {"description": "the model failed"},
                                   "503": {"description": "the queue is full, or the model is loading"}}}}


@lru_cache(maxsize=1)
def document() -> dict:
    params = _parameters_schema()
    lmi = _body(LmiRequest.model_json_schema(), ["inputs"],
                {"inputs": _TEXT_OR_LIST, "parameters": {"$ref": "#/components/schemas/Parameters"},
                 "adapters": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                 "messages": {"type": "array", "items": {"type": "object"}}})
    tgi = _body(LmiRequest.model_json_schema(), ["inputs"],      # one string; adapter_id in parameters
                {"inputs": {"type": "string", "minLength": 1},
                 "parameters": {"$ref": "#/components/schemas/Parameters"}})
    lmi["title"], tgi["title"] = "LMIRequest", "TGIRequest"
    tgi["properties"].pop("adapters", None)
    chat = _body(ChatFields.model_json_schema(), ["messages"],
                 {"messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
                  "model": {"type": "string"}, "tools": {"type": "array"}, "response_format": {"type": "object"}})
    completion = _body(CompletionFields.model_json_schema(), ["prompt"],
                       {"prompt": _TEXT_OR_LIST, "model": {"type": "string"}, "response_format": {"type": "object"}})
    schemas = {"Parameters": params, "LMIRequest": lmi, "TGIRequest": tgi,
               "ChatCompletionRequest": chat, "CompletionRequest": completion}
    for s in list(schemas.values()):    # nested models' definitions, moved to components
        for name, d in s.pop("$defs", {}).items():
            schemas.setdefault(name, d)
    doc = {"openapi": "3.1.0", "info": {"title": "lmi-serve", "version": "1.0.0"},
           "paths": {"/invocations": _post("LMI / SageMaker generation", "LMIRequest"),
                     "/v1/chat/completions": _post("OpenAI Chat Completions", "ChatCompletionRequest"),
                     "/v1/completions": _post("OpenAI Completions", "CompletionRequest"),
                     "/generate": _post("TGI generation", "TGIRequest"),
                     "/generate_stream": _post("TGI streamed generation", "TGIRequest")},
           "components": {"schemas": schemas}}
    # pydantic writes nested references as #/$defs/X: point them at the components
    return json.loads(json.dumps(doc).replace('"#/$defs/', '"#/components/schemas/'))
